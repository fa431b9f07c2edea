"""What sizes a kernel's grid and synchronises its programs, per device: the SM count, and the
arrival counters of in-kernel split merges (the last program of a split set to arrive merges)."""

from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=64)
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of ``device``; 132 off CUDA (the Triton interpreter on CPU: a
    Hopper GPU's count, so the CPU tests exercise the same splits)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132


_counters: dict[tuple[torch.device, int], list[torch.Tensor]] = {}


def arrival_counters(device: torch.device, numel: int) -> torch.Tensor:
    """Zeroed int32 arrival counters for in-kernel split merges, one set per (device, stream).

    Shared by every kernel that merges splits in-kernel (``pprun.layers.skinny``'s matmuls, the
    fused decode attention, the greedy kernel): launches on one stream run one after another and
    each leaves the counters it used at zero, while launches on different streams (another
    engine in the process, a graph being captured) get their own.  Persistent, because CUDA
    graphs keep the address; a larger request makes a new tensor and keeps the old ones for
    graphs captured with them.  Made under capture, the zero-fill is part of the graph and runs
    at each replay.
    """
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    held = _counters.setdefault((device, stream), [])
    if not held or held[-1].numel() < numel:
        held.append(torch.zeros(max(numel, 4096), dtype=torch.int32, device=device))
    return held[-1]
