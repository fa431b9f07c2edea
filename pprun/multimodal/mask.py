"""``is_mm_embed``: which rows of a step's flattened tokens take encoder output (pure NumPy logic).

A step computes, for each scheduled request, the prompt positions ``[num_computed,
num_computed + num_scheduled)`` at batch rows ``[query_start, query_start + num_scheduled)``.
Every multimodal item whose placeholder range meets that window contributes the part inside it:
its ``is_embed`` entries are OR-ed into the batch mask, so one item's ``False`` entries never
erase another item's ``True`` entries where ranges interleave or overlap (audio inside a video's
range).  Alongside, each ``True`` row records which item and which of its encoder rows it takes,
so the rows scattered are exactly the ``True`` entries, in token order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pprun.multimodal.items import PlaceholderRange


@dataclass(frozen=True)
class StepWindow:
    """One scheduled request's window: where its tokens sit in the batch and in its prompt."""

    query_start: int
    """Batch row of the request's first scheduled token."""
    num_computed: int
    """Prompt positions computed before this step (the window starts there)."""
    num_scheduled: int
    """Tokens the request computes this step."""


@dataclass
class ScatterPlan:
    """The mask of a step and, for each of its ``True`` rows in order, the encoder row it takes."""

    is_mm_embed: np.ndarray
    """[num_tokens] bool."""
    items: list[tuple[int, int]]
    """The items that contribute, as ``(request index, item index)``."""
    row_item: np.ndarray
    """[num True] int64: index into :attr:`items` of each ``True`` row, in token order."""
    row_embed: np.ndarray
    """[num True] int64: the encoder output row of that item each ``True`` row takes."""

    @property
    def num_rows(self) -> int:
        """Embedding rows to scatter (equals the ``True`` entries of the mask)."""
        return int(self.row_item.shape[0])


def _embed_rows(rng: PlaceholderRange) -> np.ndarray:
    """Per position of the range: its encoder row (meaningful where ``is_embed`` is True)."""
    if rng.is_embed is None:
        return np.arange(rng.length, dtype=np.int64)
    return np.cumsum(np.asarray(rng.is_embed, dtype=np.int64)) - 1


def build_scatter_plan(
    num_tokens: int,
    windows: Sequence[StepWindow],
    ranges: Sequence[Sequence[PlaceholderRange]],
) -> ScatterPlan:
    """The step's ``is_mm_embed`` mask (OR over every item's range) and the rows to scatter.

    ``windows[i]`` and ``ranges[i]`` belong to the same scheduled request.  Raises ValueError when
    two items claim the same position (both ``True`` there): no row may take two embeddings.
    """
    mask = np.zeros(num_tokens, dtype=bool)
    owner = np.full(num_tokens, -1, dtype=np.int64)
    embed_row = np.zeros(num_tokens, dtype=np.int64)
    items: list[tuple[int, int]] = []
    for req_index, (win, req_ranges) in enumerate(zip(windows, ranges, strict=True)):
        start, end = win.num_computed, win.num_computed + win.num_scheduled
        for item_index, rng in enumerate(req_ranges):
            lo, hi = max(start, rng.offset), min(end, rng.end)
            if lo >= hi:
                continue  # the window does not meet this item
            cut = slice(lo - rng.offset, hi - rng.offset)
            part = (np.ones(hi - lo, dtype=bool) if rng.is_embed is None
                    else np.asarray(rng.is_embed[cut], dtype=bool))
            if not part.any():
                continue
            rows = slice(win.query_start + lo - start, win.query_start + hi - start)
            if (mask[rows] & part).any():
                raise ValueError(
                    f"request {req_index}: item {item_index}'s range (offset={rng.offset}, length={rng.length}) "
                    "claims a position another item already embeds"
                )
            mask[rows] |= part  # OR: this item's False entries leave the others' True ones alone
            key = len(items)
            items.append((req_index, item_index))
            owner[rows] = np.where(part, key, owner[rows])
            embed_row[rows] = np.where(part, _embed_rows(rng)[cut], embed_row[rows])
    return ScatterPlan(mask, items, owner[mask], embed_row[mask])
