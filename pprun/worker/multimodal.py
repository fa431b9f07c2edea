"""The first stage's multimodal state, shared by both runners: each request's items, the encoder
cache, and the scatter of encoder output into a step's token embeddings (runner side; the request
side, items, processing, the encoder budget and the mask, is ``pprun.multimodal``).

The scheduler decides what to encode and what to free (``SchedulerOutput.scheduled_encoder_inputs``
and ``free_encoder_hashes``, see :mod:`pprun.multimodal.encoder_budget`); this class follows it.
The model provides two methods (:class:`pprun.models.base.MultiModalModel`):
``encode_items(items) -> list[Tensor]`` (one ``[num_embeds, hidden]`` tensor per item) and
``embed_input_ids(input_ids)``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from pprun.core.outputs import SchedulerOutput
from pprun.models.base import MultiModalModel
from pprun.multimodal.items import MultiModalItem
from pprun.multimodal.mask import ScatterPlan, StepWindow, build_scatter_plan


class MultiModalRunnerState:
    """Items by request, encoder outputs by content hash, and the step's scatter."""

    def __init__(self, model: MultiModalModel) -> None:
        self.model = model
        self.items: dict[str, list[MultiModalItem]] = {}
        """Request id -> its items (ranges, hashes; tensors until encoded)."""
        self.encoder_cache: dict[str, torch.Tensor] = {}
        """Content hash -> the item's encoder output, ``[num_embeds, hidden]``."""
        self.num_items_encoded = 0
        """Items run through the encoder so far (tests count these)."""
        self.last_plan: ScatterPlan | None = None
        """The latest step's mask and rows (tests and diagnostics)."""

    def add_request(self, req_id: str, items: Sequence[MultiModalItem]) -> None:
        """A request (new or resumed) with these items."""
        if items:
            self.items[req_id] = list(items)

    def remove_request(self, req_id: str) -> None:
        """A request finished or was preempted (its cache entries are freed by hash, later)."""
        self.items.pop(req_id, None)

    def apply_step(self, so: SchedulerOutput) -> None:
        """Free what the scheduler freed, then encode the step's scheduled items (once per hash)."""
        for content_hash in so.free_encoder_hashes:
            self.encoder_cache.pop(content_hash, None)
        todo: dict[str, MultiModalItem] = {}
        for req_id, indices in so.scheduled_encoder_inputs.items():
            items = self.items.get(req_id)
            if items is None:
                raise RuntimeError(f"step {so.step_id}: encoder inputs scheduled for unknown request {req_id!r}")
            for i in indices:
                item = items[i]
                if item.content_hash not in self.encoder_cache and item.content_hash not in todo:
                    if item.data is None:
                        raise RuntimeError(
                            f"step {so.step_id}: item {i} of request {req_id!r} is scheduled for encoding "
                            "but carries no tensors (only the first stage encodes)"
                        )
                    todo[item.content_hash] = item
        if not todo:
            return
        outputs = self.model.encode_items(list(todo.values()))
        for (content_hash, item), out in zip(todo.items(), outputs, strict=True):
            if out.shape[0] != item.num_embeds:
                raise RuntimeError(
                    f"the encoder gave {out.shape[0]} rows for a {item.modality} item whose placeholder "
                    f"range takes {item.num_embeds}"
                )
            self.encoder_cache[content_hash] = out
        self.num_items_encoded += len(todo)

    def scatter(
        self, embeds: torch.Tensor, req_ids: Sequence[str], windows: Sequence[StepWindow]
    ) -> ScatterPlan:
        """Write the encoder rows of every item meeting the step's windows into ``embeds``
        (``[num_tokens(_padded), hidden]``, token embeddings already there), in place."""
        empty: list[MultiModalItem] = []
        req_items = [self.items.get(r, empty) for r in req_ids]
        plan = build_scatter_plan(
            embeds.shape[0], windows, [[item.placeholder for item in items] for items in req_items]
        )
        self.last_plan = plan
        if not plan.num_rows:
            return plan
        sources = []
        for req_index, item_index in plan.items:
            item = req_items[req_index][item_index]
            cached = self.encoder_cache.get(item.content_hash)
            if cached is None:
                raise RuntimeError(
                    f"request {req_ids[req_index]!r}: item {item_index}'s encoder output is not cached "
                    "(the scheduler should have scheduled its encoding)"
                )
            sources.append(cached)
        bases = np.cumsum([0] + [s.shape[0] for s in sources[:-1]])
        gather = torch.from_numpy(bases[plan.row_item] + plan.row_embed).to(embeds.device)
        rows = torch.cat(sources)[gather] if len(sources) > 1 else sources[0][gather]
        targets = torch.from_numpy(np.flatnonzero(plan.is_mm_embed)).to(embeds.device)
        if targets.numel() != rows.shape[0]:
            raise RuntimeError(f"is_mm_embed has {targets.numel()} True entries for {rows.shape[0]} rows")
        embeds[targets] = rows.to(embeds.dtype)
        return plan
