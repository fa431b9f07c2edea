"""The V2 runner's model-state plug-in for encoder-decoder models (Whisper).

The stage's :class:`~pprun.worker.encoder_decoder.EncoderDecoderState` (built by the worker, the
same object V1 uses) owns the cross caches, the slots and the encoder step.  This plug-in runs
that step and feeds the decoder its cross-attention metadata in the V2 way:

- :meth:`begin_step`: the step's deltas are in; the first stage encodes the requests the step
  brings in (eagerly, outside any CUDA graph) and sends the encoder output down the pipeline
  once per request; every stage writes its layers' cross K/V into the requests' slots;
- :meth:`extra_model_kwargs`: ``encoder_seq_lens`` and ``cross_slots`` written into persistent
  buffers for the step's request rows (``StepBatch.num_request_rows``: ``num_reqs_padded``, or a
  piecewise graph's captured rows), real rows first and padding rows zero (docs/design.md
  contract 4), one host-to-device copy from pinned memory; the model gets views of them as
  ``cross_metadata``;
- :meth:`capture_inputs`: the same buffers, zeroed, for graph warm-up and capture.  A full decode
  graph captured over them reads each replay's values at the same addresses; a piecewise graph
  keeps cross-attention inside its segments (only self-attention is cut), over the same buffers.
- the metadata's ``one_query_per_row`` (uniform decode steps run eagerly, and full-graph
  capture; never piecewise capture): on a GPU cross-attention then reads the slots in place
  (``pprun.attention.cross.cross_decode_attention``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from pprun.attention.cross import CrossAttentionMetadata
from pprun.core.outputs import NewRequestData, SchedulerOutput
from pprun.distributed.layout import StageLayout
from pprun.models.base import EncoderDecoderModel
from pprun.worker.encoder_decoder import EncoderDecoderState
from pprun.worker.v2.inputs import StepBatch, _Arena
from pprun.worker.v2.model_state import ModelState


class EncoderDecoderModelState(ModelState):
    """Encoder step and persistent cross-attention metadata of one encoder-decoder stage."""

    masks_suppressed_in_graph = True  # every Whisper request suppresses its generation config's ids

    def __init__(
        self,
        model: EncoderDecoderModel,
        layout: StageLayout,
        device: torch.device,
        dtype: torch.dtype,
        max_num_reqs: int,
        max_num_tokens: int,
        encoder_decoder: EncoderDecoderState | None = None,
    ) -> None:
        super().__init__(model, layout, device, dtype, max_num_reqs, max_num_tokens)
        if encoder_decoder is None:
            raise ValueError(
                f"{type(model).__name__} is an encoder-decoder model: its V2 plug-in needs the stage's "
                "EncoderDecoderState (encoder_decoder=...), which the worker builds with the cross caches"
            )
        self.encoder_decoder = encoder_decoder
        self._arena = _Arena([((max_num_reqs,), torch.int32), ((max_num_reqs,), torch.int32)], device)
        self.encoder_seq_lens, self.cross_slots = self._arena.fields
        """Persistent ``[max_num_reqs]`` int32 buffers (pinned host staging and device twin):
        encoder positions each request row attends to, and its cross-cache slot (0 for padding)."""
        self._copy_done: torch.cuda.Event | None = torch.cuda.Event() if device.type == "cuda" else None
        self._copy_pending = False
        self._slot_of_row = np.zeros(max_num_reqs, dtype=np.int32)
        """Request-table row -> its request's cross-cache slot (a step's rows are gathered from
        it in one indexed read, not looked up request by request)."""
        self._added: list[tuple[int, str]] = []
        """(row, request id) of the requests added since the last :meth:`begin_step`."""
        self._written: tuple[bytes, int] | None = None
        """The table rows and row count the device buffers hold now (None: unknown), so that a
        step with the same rows as the last one (steady decode) writes and copies nothing."""

    def add_request(self, row: int, new: NewRequestData) -> None:
        """Note the row; its slot is known once :meth:`begin_step` has handed slots out."""
        self._added.append((row, new.req_id))

    def begin_step(self, so: SchedulerOutput) -> None:
        """Free the slots of requests that ended; encode (first stage) or receive the encoder
        output of the step's new requests, send it on, and write their cross K/V."""
        self.encoder_decoder.begin_step(so)
        slot_of = self.encoder_decoder.slot_of
        for row, req_id in self._added:
            self._slot_of_row[row] = slot_of[req_id]
        if self._added:
            self._written = None  # a row may hold another request's slot now
        self._added.clear()

    def _write(self, req_ids: list[str], num_rows: int, rows: np.ndarray | None = None) -> None:
        """Rows ``[:num_rows]`` of both buffers (real rows first, padding zero), then one copy to
        the device on the current stream; nothing when ``rows`` and ``num_rows`` are what the
        buffers hold already."""
        written = None if rows is None else (rows.tobytes(), num_rows)
        if written is not None and written == self._written:
            return
        self._written = written
        if self._copy_pending:
            # The previous copy may still be reading the pinned rows about to be rewritten.
            self._copy_done.synchronize()
            self._copy_pending = False
        slots = None if rows is None else self._slot_of_row[rows]
        self.encoder_decoder.write_rows(req_ids, num_rows, self.encoder_seq_lens.np, self.cross_slots.np, slots)
        if self._arena.copy_ranges([self.encoder_seq_lens.span(num_rows), self.cross_slots.span(num_rows)]):
            self._copy_done.record()
            self._copy_pending = True

    def _metadata(self, num_reqs_padded: int, one_query_per_row: bool) -> CrossAttentionMetadata:
        return CrossAttentionMetadata(
            encoder_seq_lens=self.encoder_seq_lens.device[:num_reqs_padded],
            cross_slots=self.cross_slots.device[:num_reqs_padded],
            one_query_per_row=one_query_per_row,
        )

    def extra_model_kwargs(self, batch: StepBatch) -> dict[str, Any]:
        """``cross_metadata``: views ``[:num_reqs_padded]`` of the persistent buffers, written for
        the step's request rows (a graph replay reads them at the addresses it was captured over)."""
        self._write(batch.req_ids, max(batch.num_request_rows, batch.num_reqs_padded), batch.rows.numpy())
        # A uniform decode step: query row i is request row i's token (an eager step; a graph
        # replay reads what its capture was given, below).
        decode = batch.max_query_len == 1 and batch.num_tokens == batch.num_reqs
        return {"cross_metadata": self._metadata(batch.num_reqs_padded, decode)}

    def capture_inputs(
        self, num_reqs_padded: int, num_tokens_padded: int
    ) -> tuple[torch.Tensor | None, dict[str, Any]]:
        """The same buffers, every row zero (attends to nothing through the reserved slot 0).

        A full graph replays decode steps only (one token per request row), so its capture gets
        ``one_query_per_row``; a piecewise graph's segments replay for any batch, so theirs not."""
        self._write([], max(num_reqs_padded, min(num_tokens_padded, self.max_num_reqs)))
        full = self.capture_kind == "full" and num_tokens_padded == num_reqs_padded
        return None, {"cross_metadata": self._metadata(num_reqs_padded, full)}
