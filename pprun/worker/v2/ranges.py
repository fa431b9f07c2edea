"""Byte ranges of the pinned staging arena: which ones a step copies to the device, and how.

Shared by the input buffers (``pprun.worker.v2.inputs``, which plan the ranges) and the staging
kernel (``pprun.worker.v2.staging``, which copies at most :data:`MAX_RANGES` per launch).
Planning needs no Triton, so this module does not import it: CPU runs plan nothing but may
import the buffers.
"""

from __future__ import annotations

MAX_RANGES = 8
"""Byte ranges one launch of the staging kernel copies; more are merged (see :func:`fit_ranges`)."""


def merge_ranges(ranges: list[tuple[int, int]], max_gap: int) -> list[tuple[int, int]]:
    """Merge ``[start, end)`` ranges sorted by start whose gap is at most ``max_gap``; empty
    ranges are dropped."""
    merged: list[tuple[int, int]] = []
    for start, end in ranges:
        if end <= start:
            continue
        if merged and start - merged[-1][1] <= max_gap:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def fit_ranges(ranges: list[tuple[int, int]], limit: int = MAX_RANGES) -> list[tuple[int, int]]:
    """``ranges`` (sorted, disjoint) merged pairwise across their smallest gaps until at most
    ``limit`` remain (the gaps' bytes are copied too)."""
    out = list(ranges)
    while len(out) > limit:
        i = min(range(len(out) - 1), key=lambda j: out[j + 1][0] - out[j][1])
        out[i : i + 2] = [(out[i][0], out[i + 1][1])]
    return out
