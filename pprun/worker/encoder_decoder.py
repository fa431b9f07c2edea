"""A stage's cross-attention state for an encoder-decoder model (Whisper), shared by both runners.

What it owns on each stage:

- the cross caches of the stage's decoder layers (``pprun.attention.cross``), with the slots
  :func:`cross_slots_for_budget` sizes from the stage's KV-cache budget (at most
  ``scheduler.max_num_seqs``) plus the reserved slot 0; their bytes come out of that budget
  before its blocks are counted (``Worker.num_available_blocks``).  The scheduler admits a
  request only while a slot is free (``Scheduler(num_cross_slots=...)``; a request that finds
  none waits), so a running request always has a slot;
- which slot each running request holds: taken when the request arrives (new, or resumed after a
  preemption), given back when the step's ``finished_req_ids`` name it (finished, aborted or
  preempted);
- the encoder step: the first stage computes the log-mel features of every window a step brings
  in (new requests, or resumed after a preemption) in one batch on its device
  (``pprun.audio.LogMelSpectrogram``, from the samples the requests carry) and encodes them in
  one encoder call, outside any CUDA graph; it sends the encoder output down the pipeline once
  (``PipelineTransport.send_payload``, before the step's hidden states), and every stage turns it
  into its own layers' cross K/V in the requests' slots, all layers and requests in one
  projection (``write_cross_kv``).  A request resumed after a preemption is encoded again: its
  slot was freed with its blocks.
- the step's cross metadata rows, written by :meth:`write_rows` for the padded request count:
  real rows first, padding rows zeroed (docs/design.md contract 4).  The V2 runner's plug-in
  (``pprun.worker.v2.encoder_decoder_state``) writes its persistent buffers with it, the V1
  runner fresh ones (:meth:`fill`): the same code either way.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from pprun.attention.cross import CrossAttentionMetadata
from pprun.audio import AUDIO_SAMPLES_KEY, LogMelSpectrogram
from pprun.core.outputs import SchedulerOutput
from pprun.distributed.layout import StageLayout
from pprun.models.base import EncoderDecoderModel, PprunModel
from pprun.worker.kv_cache import allocate_cross_caches

ENCODER_MAX_WINDOWS = 64
"""Most windows one log-mel + encoder call takes (a step bringing in more runs several calls):
bounds the encoder's transient activations, which the KV-cache budget does not count (64
windows of large-v3: about 4 GiB in float16)."""


def cross_slots_for_budget(
    budget_bytes: int, slot_bytes: int, request_kv_bytes: int, block_bytes: int, max_num_seqs: int
) -> int:
    """Cross-attention slots a stage's KV-cache budget of ``budget_bytes`` holds: each slot
    (``slot_bytes``) with room in the paged cache for its request's self-attention up to
    ``max_model_len`` (``request_kv_bytes``), besides the reserved slot 0 and the null block
    (``block_bytes``); at most ``max_num_seqs``.  So the default ``max_num_seqs`` fits any budget
    (fewer requests then run at once), and a full batch of slots never preempts for blocks.
    Returns 0 when not even one request fits; the caller turns that into an error."""
    reserved = slot_bytes + block_bytes
    if budget_bytes <= reserved:
        return 0
    return min(max_num_seqs, (budget_bytes - reserved) // (slot_bytes + request_kv_bytes))


def is_encoder_decoder(model: PprunModel) -> bool:
    """True for a model with an encoder whose output decoder layers cross-attend to."""
    return model.is_encoder_decoder


class EncoderDecoderState:
    """Cross caches, slots and the encoder step of one stage (see the module docstring)."""

    def __init__(
        self,
        model: EncoderDecoderModel,
        layout: StageLayout,
        device: torch.device,
        dtype: torch.dtype,
        max_num_reqs: int,
        transport=None,
        log_mel: LogMelSpectrogram | None = None,
    ) -> None:
        """``max_num_reqs``: requests that may hold a slot at once (the scheduler's
        ``num_cross_slots``); ``log_mel``: the first stage's feature front end (the checkpoint's
        ``preprocessor_config.json`` on this stage's device); later stages take none."""
        if layout.is_first and log_mel is None:
            raise ValueError("the first stage of an encoder-decoder model needs its log-mel front end (log_mel=...)")
        self.model = model
        self.log_mel = log_mel
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
        self.num_sent = 0
        """Requests whose encoder output this stage sent down the pipeline (once each per
        admission: new, or resumed after a preemption)."""
        self.num_received = 0
        """Requests whose encoder output this stage received from the previous one."""

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
                f"cross-attention slots (the scheduler runs at most {self.num_slots - 1} requests at once)"
            )
        slots = [self._free_slots.pop() for _ in new]
        for n, slot in zip(new, slots, strict=True):
            self.slot_of[n.req_id] = slot
        encoder_out = self._encoder_output(new)
        slots_t = torch.tensor(slots, dtype=torch.int64)
        self.model.write_cross_kv(encoder_out, slots_t.to(self.device, non_blocking=True))
        self.num_encoded += len(new)

    def _encoder_output(self, new: Sequence) -> torch.Tensor:
        """``[len(new), source_len, hidden]``: encoded here (first stage) or received, and sent
        on to the next stage when there is one."""
        if self.layout.is_first:
            windows = []
            for n in new:
                item = next((i for i in n.mm_items if i.modality == "audio"), None)
                if item is None or item.data is None or AUDIO_SAMPLES_KEY not in item.data:
                    raise RuntimeError(f"request {n.req_id!r} reached the encoder without audio samples")
                windows.append(item.data[AUDIO_SAMPLES_KEY])
            # One batch of features, one encoder call, for every window of the step (in chunks
            # of ENCODER_MAX_WINDOWS, which bound the encoder's activations).
            chunk = ENCODER_MAX_WINDOWS
            outs = [self.model.encode(self.log_mel(windows[i : i + chunk])) for i in range(0, len(windows), chunk)]
            out = outs[0] if len(outs) == 1 else torch.cat(outs)
        else:
            shape = (len(new), self.source_len, self.model.arch.hidden_size)
            out = self.transport.recv_payload(torch.empty(shape, dtype=self.dtype, device=self.device))
            self.num_received += len(new)
        if not self.layout.is_last:
            self.transport.send_payload(out)
            self.num_sent += len(new)
        return out

    def write_rows(
        self,
        req_ids: Sequence[str],
        num_rows: int,
        encoder_seq_lens: np.ndarray,
        cross_slots: np.ndarray,
        slots: np.ndarray | None = None,
    ) -> None:
        """Rows ``[:num_rows]`` of host arrays for ``req_ids`` (in batch order): real rows first,
        padding rows zero.  A graph captured for ``num_rows`` requests reads every one of them;
        zero means "attends to nothing, through the reserved slot 0", whatever an earlier, larger
        step left there.  ``slots``: the requests' slots when the caller has them as an array
        (the V2 plug-in, by table row); else they are looked up by id."""
        num_reqs = len(req_ids)
        if num_reqs > num_rows:
            raise ValueError(f"num_reqs={num_reqs} > num_rows={num_rows}")
        if slots is not None:
            cross_slots[:num_reqs] = slots
        else:
            slot_of = self.slot_of
            cross_slots[:num_reqs] = [slot_of[r] for r in req_ids]
        encoder_seq_lens[:num_reqs] = self.source_len
        cross_slots[num_reqs:num_rows] = 0
        encoder_seq_lens[num_reqs:num_rows] = 0

    def fill(
        self,
        req_ids: Sequence[str],
        num_reqs_padded: int,
        encoder_seq_lens: torch.Tensor | None = None,
        cross_slots: torch.Tensor | None = None,
    ) -> CrossAttentionMetadata:
        """The step's cross metadata for ``req_ids`` (in batch order), written into the given
        buffers (or new ones) for ``num_reqs_padded`` rows by :meth:`write_rows`."""
        lens_np = np.empty(num_reqs_padded, dtype=np.int32)
        slots_np = np.empty(num_reqs_padded, dtype=np.int32)
        self.write_rows(req_ids, num_reqs_padded, lens_np, slots_np)
        if encoder_seq_lens is None:
            encoder_seq_lens = torch.empty(num_reqs_padded, dtype=torch.int32, device=self.device)
        if cross_slots is None:
            cross_slots = torch.empty(num_reqs_padded, dtype=torch.int32, device=self.device)
        lens = encoder_seq_lens[:num_reqs_padded]
        slots = cross_slots[:num_reqs_padded]
        lens.copy_(torch.from_numpy(lens_np))
        slots.copy_(torch.from_numpy(slots_np))
        return CrossAttentionMetadata(encoder_seq_lens=lens, cross_slots=slots)
