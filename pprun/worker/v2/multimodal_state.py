"""The V2 runner's model-state plug-in for models that merge encoder output into the token
embeddings (vision-language models; the same path serves audio items).

First stage: the plug-in keeps each request's items and the encoder cache
(:class:`~pprun.worker.multimodal.MultiModalRunnerState`, shared with the V1 runner), runs the
encoder for the items a step schedules (:meth:`begin_step`) and builds the step's
``inputs_embeds`` in a persistent ``[max_num_tokens, hidden]`` buffer: token embeddings, then the
encoder rows of the scheduled window scattered in where ``is_mm_embed`` is True.  The buffer's
address never changes, so a CUDA graph captured over it replays any decode step (decode windows
meet no placeholder range: only the embedding lookup runs before the replay).  Later stages hold
nothing (no encoder is loaded there).  The V2 runner gives it to every model declaring
``supports_multimodal`` (``pprun.worker.v2.plugins``).
"""

from __future__ import annotations

import torch

from pprun.core.outputs import NewRequestData, SchedulerOutput
from pprun.distributed.layout import StageLayout
from pprun.models.base import MultiModalModel
from pprun.multimodal.mask import StepWindow
from pprun.worker.multimodal import MultiModalRunnerState
from pprun.worker.v2.inputs import StepBatch
from pprun.worker.v2.model_state import ModelState


class MultiModalModelState(ModelState):
    """Items, encoder cache and ``inputs_embeds`` of a multimodal model's first stage."""

    def __init__(
        self,
        model: MultiModalModel,
        layout: StageLayout,
        device: torch.device,
        dtype: torch.dtype,
        max_num_reqs: int,
        max_num_tokens: int,
    ) -> None:
        super().__init__(model, layout, device, dtype, max_num_reqs, max_num_tokens)
        self.mm: MultiModalRunnerState | None = None
        self.inputs_embeds: torch.Tensor | None = None
        """[max_num_tokens, hidden]: the first stage's persistent embeddings buffer."""
        self._req_of_row: dict[int, str] = {}
        if layout.is_first:
            self.mm = MultiModalRunnerState(model)
            self.inputs_embeds = torch.zeros((max_num_tokens, model.arch.hidden_size), dtype=dtype, device=device)

    def add_request(self, row: int, new: NewRequestData) -> None:
        """Remember the request's items (first stage)."""
        if self.mm is not None:
            self._req_of_row[row] = new.req_id
            self.mm.add_request(new.req_id, new.mm_items)

    def remove_request(self, row: int) -> None:
        """Forget the row's items (its cache entries are freed by hash when the scheduler says)."""
        req_id = self._req_of_row.pop(row, None)
        if self.mm is not None and req_id is not None:
            self.mm.remove_request(req_id)

    def begin_step(self, so: SchedulerOutput) -> None:
        """Free and encode what the scheduler asked for (first stage)."""
        if self.mm is not None:
            self.mm.apply_step(so)

    def prepare_inputs_embeds(self, batch: StepBatch, input_ids: torch.Tensor) -> torch.Tensor | None:
        """Token embeddings with the scheduled windows' encoder rows scattered in, in the
        persistent buffer (a view of ``[:num_tokens_padded]``)."""
        if self.mm is None or self.inputs_embeds is None:
            return None
        n = input_ids.shape[0]
        out = self.inputs_embeds[:n]
        out.copy_(self.model.embed_input_ids(input_ids))
        if self.mm.items:
            windows = [
                StepWindow(int(qs), int(nc), int(ns))
                for qs, nc, ns in zip(batch.query_start, batch.num_computed_tokens, batch.num_scheduled_tokens.tolist())
            ]
            self.mm.scatter(out, batch.req_ids, windows)
        return out

    def capture_inputs(self, num_reqs_padded: int, num_tokens_padded: int):
        """Graphs read the same embeddings buffer (zeros for capture)."""
        if self.inputs_embeds is None:
            return None, {}
        self.inputs_embeds[:num_tokens_padded].zero_()
        return self.inputs_embeds[:num_tokens_padded], {}
