"""A stage's cross-attention state for an encoder-decoder model (Whisper), shared by both runners.

What it owns on each stage:

- the cross caches of the stage's decoder layers (``pprun.attention.cross``), with one slot per
  request the scheduler may run at once (``scheduler.max_num_seqs``) plus the reserved slot 0;
  their bytes come out of the stage's KV-cache budget before its blocks are counted
  (``Worker.num_available_blocks``), so a running request always has a slot and a full
  self-attention cache preempts as for any model;
- which slot each running request holds: taken when the request arrives (new, or resumed after a
  preemption), given back when the step's ``finished_req_ids`` name it (finished, aborted or
  preempted);
- the encoder step: the first stage encodes the audio features of the requests a step brings in
  (one encoder batch per step, outside any CUDA graph), sends the encoder output down the
  pipeline once (``PipelineTransport.send_payload``, before the step's hidden states), and every
  stage turns it into its own layers' cross K/V in the requests' slots.  A request resumed after
  a preemption is encoded again: its slot was freed with its blocks.
- the step's :class:`~pprun.attention.cross.CrossAttentionMetadata`, written by :meth:`fill` for
  ``num_reqs_padded`` rows: real rows first, padding rows zeroed (DESIGN contract 4).  The V2
  runner passes its persistent buffers, the V1 runner fresh ones: the same code either way.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from pprun.attention.cross import CrossAttentionMetadata
from pprun.audio import AUDIO_FEATURES_KEY
from pprun.core.outputs import SchedulerOutput
from pprun.distributed.layout import StageLayout
from pprun.models.base import PprunModel
from pprun.worker.kv_cache import allocate_cross_caches


def is_encoder_decoder(model: PprunModel) -> bool:
    """True for a model with an encoder whose output decoder layers cross-attend to."""
    return model.is_encoder_decoder


class EncoderDecoderState:
    """Cross caches, slots and the encoder step of one stage (see the module docstring)."""

    def __init__(
        self,
        model: nn.Module,
        layout: StageLayout,
        device: torch.device,
        dtype: torch.dtype,
        max_num_reqs: int,
        transport=None,
    ) -> None:
        self.model = model
        self.layout = layout
        self.device = device
        self.dtype = dtype
        self.transport = transport
        self.num_slots = max_num_reqs + 1
        self.caches = allocate_cross_caches(model, self.num_slots, dtype, device)
        model.bind_cross_caches(self.caches)
        self.source_len: int = model.encoder_arch.max_source_positions
        """Encoder positions of every request (Whisper pads each window to 30 s)."""
        self._free_slots = list(range(self.num_slots - 1, 0, -1))  # pop() hands out the lowest
        self.slot_of: dict[str, int] = {}
        """Running request id -> its cross-cache slot."""
        self.num_encoded = 0
        """Requests run through the encoder (first stage) or given cross K/V (every stage)."""

    @property
    def cache_bytes(self) -> int:
        """Bytes of this stage's cross caches."""
        return sum(t.numel() * t.element_size() for t in self.caches)

    def begin_step(self, so: SchedulerOutput) -> None:
        """Free the slots of requests that ended, then give the step's new requests theirs and
        their cross K/V (the encoder runs on the first stage only)."""
        for req_id in so.finished_req_ids:
            slot = self.slot_of.pop(req_id, None)
            if slot is not None:
                self._free_slots.append(slot)
        new = [n for n in so.scheduled_new_reqs if n.req_id not in self.slot_of]
        if not new:
            return
        if len(new) > len(self._free_slots):
            raise RuntimeError(
                f"stage {self.layout.pp_rank}: {len(new)} new requests but {len(self._free_slots)} free "
                f"cross-attention slots (the scheduler admits at most {self.num_slots - 1} at once)"
            )
        slots = [self._free_slots.pop() for _ in new]
        for n, slot in zip(new, slots, strict=True):
            self.slot_of[n.req_id] = slot
        encoder_out = self._encoder_output(new)
        self.model.write_cross_kv(encoder_out, torch.tensor(slots, device=self.device))
        self.num_encoded += len(new)

    def _encoder_output(self, new: Sequence) -> torch.Tensor:
        """``[len(new), source_len, hidden]``: encoded here (first stage) or received, and sent
        on to the next stage when there is one."""
        if self.layout.is_first:
            features = []
            for n in new:
                item = next((i for i in n.mm_items if i.modality == "audio"), None)
                if item is None or item.data is None or AUDIO_FEATURES_KEY not in item.data:
                    raise RuntimeError(f"request {n.req_id!r} reached the encoder without audio features")
                features.append(np.asarray(item.data[AUDIO_FEATURES_KEY], dtype=np.float32))
            batch = torch.from_numpy(np.stack(features)).to(self.device)
            out = self.model.encode(batch)
        else:
            shape = (len(new), self.source_len, self.model.arch.hidden_size)
            out = self.transport.recv_payload(torch.empty(shape, dtype=self.dtype, device=self.device))
        if not self.layout.is_last:
            self.transport.send_payload(out)
        return out

    def fill(
        self,
        req_ids: Sequence[str],
        num_reqs_padded: int,
        encoder_seq_lens: torch.Tensor | None = None,
        cross_slots: torch.Tensor | None = None,
    ) -> CrossAttentionMetadata:
        """The step's cross metadata for ``req_ids`` (in batch order), written into the given
        buffers (or new ones) for ``num_reqs_padded`` rows: real rows first, padding rows zero."""
        num_reqs = len(req_ids)
        if num_reqs > num_reqs_padded:
            raise ValueError(f"num_reqs={num_reqs} > num_reqs_padded={num_reqs_padded}")
        if encoder_seq_lens is None:
            encoder_seq_lens = torch.zeros(num_reqs_padded, dtype=torch.int32, device=self.device)
        if cross_slots is None:
            cross_slots = torch.zeros(num_reqs_padded, dtype=torch.int32, device=self.device)
        lens = encoder_seq_lens[:num_reqs_padded]
        slots = cross_slots[:num_reqs_padded]
        host_slots = torch.tensor([self.slot_of[r] for r in req_ids], dtype=torch.int32)
        slots[:num_reqs].copy_(host_slots, non_blocking=True)
        lens[:num_reqs].fill_(self.source_len)
        # Padding rows: a graph captured for num_reqs_padded reads them; zero means "attends to
        # nothing, through the reserved slot 0", whatever an earlier, larger step left there.
        slots[num_reqs:].zero_()
        lens[num_reqs:].zero_()
        return CrossAttentionMetadata(encoder_seq_lens=lens, cross_slots=slots)
