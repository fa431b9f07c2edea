"""The V2 runner's persistent input buffers and the tensor-indexed construction of a step's inputs.

Every buffer is allocated once at its largest size and reused: a step writes its real rows first,
then makes the padded rows inert (input id 0, position 0, slot -1: not written, sequence length
0, flat ``query_start_loc``: an empty query), and the model and attention layers read views
``[:num_tokens_padded]`` / ``[:num_reqs_padded]``.  Eager steps and CUDA-graph replays read the
very same device buffers, so a captured graph sees each step's values at fixed addresses.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from pprun.attention.metadata import AttentionMetadata, count_leading_decodes
from pprun.core.outputs import SchedulerOutput
from pprun.switches import enabled_unless
from pprun.worker.v2.ranges import MAX_RANGES, fit_ranges, merge_ranges
from pprun.worker.v2.request_state import RequestTable

MERGE_GAP_BYTES = 128 * 1024
"""Two used ranges of the staging arena closer than this go in one copy, unused gap included:
copying a few more bytes costs the copy engine less than another copy costs the host."""
_ALIGN = 64
STAGING_KERNEL_ENABLED: bool = enabled_unless("PPRUN_DISABLE_STAGING_KERNEL")
"""On CUDA, a step's inputs reach the device through one kernel that reads the pinned arena
(``pprun.worker.v2.staging``) instead of ``cudaMemcpyAsync`` plus, with async scheduling, three
kernels that put the previous step's samples into ``input_ids``.  ``PPRUN_DISABLE_STAGING_KERNEL=1``
(or ``scripts/gpu_speed.py --ab``) goes back to the copies."""
STAGING_KERNEL_MAX_BYTES = 1 << 20
"""Steps whose used ranges hold more bytes go by the copies even with the kernel on: a copy engine
is the known path for bulk transfers, while the kernel's gain (a few us of stream switches,
measured on decode steps of a few KB) does not grow with size.  Large steps (long prefill chunks,
wide block tables) were not timed through the kernel."""


class HostDeviceBuffer:
    """One persistent buffer: a host staging view (pinned on CUDA) and its device twin.

    Both are views into :class:`InputBuffers`' arenas, so a step's fields reach the device in one
    copy.  On CPU both are the same tensor and nothing is copied.  ``np`` is a NumPy view of
    ``host`` (host-side writes go through it: far less dispatch cost than torch indexing).
    """

    def __init__(self, host: torch.Tensor, device: torch.Tensor, offset: int) -> None:
        self.host = host
        self.device = device
        self.np = host.numpy()
        self.offset = offset
        """Byte offset of this buffer in its arena."""
        self.row_bytes = host[0].numel() * host.element_size() if host.dim() else host.element_size()

    def span(self, num_rows: int) -> tuple[int, int]:
        """The arena's byte range ``[start, end)`` of the first ``num_rows`` rows."""
        return self.offset, self.offset + num_rows * self.row_bytes


class _Arena:
    """Fields packed into one host byte buffer (pinned on CUDA) and one device byte buffer at the
    same offsets, each field aligned to 64 bytes."""

    def __init__(self, specs: list[tuple[tuple[int, ...], torch.dtype]], device: torch.device) -> None:
        layout = []
        total = 0
        for shape, dtype in specs:
            nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            layout.append((shape, dtype, total, nbytes))
            total += -(-nbytes // _ALIGN) * _ALIGN
        self.host = torch.zeros(total, dtype=torch.uint8, pin_memory=device.type == "cuda")
        self.device = self.host if device.type == "cpu" else torch.zeros(total, dtype=torch.uint8, device=device)
        self.fields = [
            HostDeviceBuffer(
                self.host[off : off + nbytes].view(dtype).view(shape),
                self.device[off : off + nbytes].view(dtype).view(shape),
                off,
            )
            for shape, dtype, off, nbytes in layout
        ]

    def copy_ranges(self, ranges: list[tuple[int, int]]) -> int:
        """Copy the byte ranges ``[start, end)`` (sorted by start) host -> device, merged by
        :func:`merge_ranges`; returns the number of copies issued."""
        if self.device is self.host:
            return 0
        merged = merge_ranges(ranges, MERGE_GAP_BYTES)
        for start, end in merged:
            self.device[start:end].copy_(self.host[start:end], non_blocking=True)
        return len(merged)


@dataclass
class StepBatch:
    """A step's batch as the runner laid it out (host side), real and padded counts named apart."""

    req_ids: list[str]
    """Scheduled requests in batch order (the order of ``num_scheduled_tokens``)."""
    rows: torch.Tensor
    """[num_reqs] int64 (host): each request's row in the :class:`RequestTable`."""
    num_scheduled_tokens: torch.Tensor
    """[num_reqs] int64 (host): tokens each request computes this step."""
    num_reqs: int
    num_reqs_padded: int
    num_tokens: int
    num_tokens_padded: int
    max_query_len: int
    sample_batch_idx: torch.Tensor
    """[num_sampled] int64 (host): batch positions of the requests that sample this step (their
    scheduled tokens reach the end of what the runner knows of them)."""
    num_pending: int = 0
    """Input tokens that are the previous step's samples, not yet known on the host (async
    scheduling): ``bufs.pending_token_idx[:num_pending]`` is filled on the device."""
    num_computed_tokens: np.ndarray | None = None
    """[num_reqs] int64 (host): each request's computed tokens before this step: its scheduled
    window starts at that prompt position (model-state plug-ins read it, e.g. for placeholder ranges)."""
    query_start: np.ndarray | None = None
    """[num_reqs] int64 (host): batch row of each request's first scheduled token."""
    num_leading_decodes: int = 0
    """With ``max_query_len > 1``: how many of the first requests compute one token each
    (:attr:`AttentionMetadata.num_leading_decodes`)."""
    num_request_rows: int = 0
    """Rows of the per-request buffers this step writes, real rows first and the rest inert:
    ``num_reqs_padded``, or up to ``num_tokens_padded`` (at most ``max_num_reqs``), since a
    piecewise graph captured for N tokens was captured over N request rows and an op inside it
    (Whisper's cross-attention maps tokens to requests through ``query_start_loc``) reads them
    all.  Plug-ins write their own per-request buffers this far (:meth:`InputBuffers.request_rows`)."""

    @property
    def num_sampled(self) -> int:
        """Requests that sample this step."""
        return int(self.sample_batch_idx.numel())


class InputBuffers:
    """All per-step input buffers of one stage, at their maximum sizes, packed into one arena so
    that a step's inputs reach the device in one copy (see :meth:`to_device`)."""

    def __init__(
        self,
        max_num_tokens: int,
        max_num_reqs: int,
        max_num_blocks_per_req: int,
        block_size: int,
        device: torch.device,
    ) -> None:
        self.max_num_tokens = max_num_tokens
        self.max_num_reqs = max_num_reqs
        self.block_size = block_size
        self.device = device
        # Arena order: small per-request fields, per-token fields, then the block table, whose
        # used rows start at its region's beginning.  A decode step's used ranges then sit close
        # together and merge into one copy.
        self._arena = _Arena(
            [
                ((max_num_reqs + 1,), torch.int32),
                ((max_num_reqs,), torch.int32),
                ((max_num_reqs,), torch.int64),
                ((max_num_reqs,), torch.int64),
                ((1,), torch.int32),
                ((max_num_tokens,), torch.int64),
                ((max_num_tokens,), torch.int64),
                ((max_num_tokens,), torch.int64),
                ((max_num_reqs, max_num_blocks_per_req), torch.int32),
                ((max_num_reqs,), torch.int64),
                ((max_num_reqs,), torch.int64),
            ],
            device,
        )
        (
            self.query_start_loc,
            self.seq_lens,
            self.logits_indices,
            self.sample_rows,
            self.host_slot,
            self.input_ids,
            self.positions,
            self.slot_mapping,
            self.block_table,
            self.pending_token_idx,
            self.pending_sample_idx,
        ) = self._arena.fields
        """``logits_indices``: rows of the step's hidden states whose logits are sampled;
        ``sample_rows``: the sampling requests' :class:`RequestTable` rows (the sampler gathers
        their parameters on the device with it); ``host_slot``: the row of the runner's pinned ring
        that this step's sampled ids go to (a full decode graph's argmax writes it there itself);
        ``pending_token_idx`` / ``pending_sample_idx``:
        with async scheduling, which input tokens are the previous step's samples, still on the
        device, and where they are in its sampled ids."""
        self.token_source = torch.full((max_num_tokens,), -1, dtype=torch.int32, pin_memory=device.type == "cuda")
        """Host only, read by the staging kernel: per token -1, or its row in the previous step's
        sampled ids (what ``pending_token_idx`` / ``pending_sample_idx`` say, per token)."""
        self.num_copies_last_step = 0
        """Host-to-device copies :meth:`to_device` issued last (1 for a typical step; 0 when the
        staging kernel moved the inputs)."""
        # The host staging buffers are rewritten every step while the previous step's copies or
        # staging kernel may still be reading them: wait for those first.
        self._reads_done: torch.cuda.Event | None = None
        self._read_event = torch.cuda.Event() if device.type == "cuda" else None
        self.stream = torch.cuda.current_stream(device) if device.type == "cuda" else None
        """The stream the steps run on (the one current when the buffers were made), kept for the
        runner's events too: ``Event.record()`` without a stream builds a stream object per call,
        host time on every step."""
        self.make_inert(0, 0, max_num_reqs, max_num_tokens)
        self.to_device(max_num_reqs, max_num_tokens, 0)

    # --- writing -----------------------------------------------------------------------------

    def request_rows(self, num_reqs_padded: int, num_tokens_padded: int) -> int:
        """Per-request rows a step writes (see :attr:`StepBatch.num_request_rows`)."""
        return max(num_reqs_padded, min(num_tokens_padded, self.max_num_reqs))

    def make_inert(
        self, num_reqs: int, num_tokens: int, num_reqs_padded: int, num_tokens_padded: int
    ) -> None:
        """Write the padding rows ``[num_reqs:num_reqs_padded]`` / ``[num_tokens:num_tokens_padded]``
        (host side) so that they read and write nothing and change no real row's result;
        ``query_start_loc`` up to :meth:`request_rows` (a piecewise graph reads that many)."""
        if num_tokens_padded > num_tokens:
            self.input_ids.np[num_tokens:num_tokens_padded] = 0
            self.positions.np[num_tokens:num_tokens_padded] = 0
            self.slot_mapping.np[num_tokens:num_tokens_padded] = -1
        # Padded requests have an empty query: every boundary after the real ones equals num_tokens
        # (kept sorted: a captured op may binary-search it).
        self.query_start_loc.np[num_reqs + 1 : self.request_rows(num_reqs_padded, num_tokens_padded) + 1] = num_tokens
        if num_reqs_padded > num_reqs:
            self.seq_lens.np[num_reqs:num_reqs_padded] = 0
            self.block_table.np[num_reqs:num_reqs_padded] = 0

    def wait_for_previous_reads(self) -> None:
        """Block until the last :meth:`to_device` finished reading the host buffers (its copies or
        the staging kernel)."""
        if self._reads_done is not None:
            self._reads_done.synchronize()
            self._reads_done = None

    def to_device(
        self,
        num_reqs_padded: int,
        num_tokens_padded: int,
        num_sampled: int,
        num_pending: int = 0,
        prev_sampled: torch.Tensor | None = None,
    ) -> None:
        """Send the step's rows (real and padding) to the device buffers, asynchronously, no sync.

        ``num_pending`` (async scheduling): ``input_ids[pending_token_idx[:n]]`` become
        ``prev_sampled[pending_sample_idx[:n]]``, the previous step's samples, which stay on the
        device.  On CUDA one kernel reads the pinned arena and does both
        (:data:`STAGING_KERNEL_ENABLED`, up to :data:`STAGING_KERNEL_MAX_BYTES`); otherwise
        non-blocking copies from pinned memory (normally one: used ranges merged, see
        :data:`MERGE_GAP_BYTES`) and an indexed write.
        """
        if num_pending and prev_sampled is None:
            raise ValueError(f"{num_pending} pending input ids need the previous step's sampled ids")
        used = (
            (self.query_start_loc, self.request_rows(num_reqs_padded, num_tokens_padded) + 1),
            (self.seq_lens, num_reqs_padded),
            (self.logits_indices, num_sampled),
            (self.sample_rows, num_sampled),
            (self.host_slot, 1),
            (self.input_ids, num_tokens_padded),
            (self.positions, num_tokens_padded),
            (self.slot_mapping, num_tokens_padded),
            (self.block_table, num_reqs_padded),
            (self.pending_token_idx, num_pending),
            (self.pending_sample_idx, num_pending),
        )
        spans = [(b, b.span(n)) for b, n in used]
        staged = (
            self.device.type == "cuda"
            and STAGING_KERNEL_ENABLED
            and sum(end - start for _, (start, end) in spans) <= STAGING_KERNEL_MAX_BYTES
        )
        if staged:
            self._stage(spans, num_tokens_padded, num_pending, prev_sampled)
        else:
            self.num_copies_last_step = self._arena.copy_ranges([span for _, span in spans])
            if num_pending:
                ids = self.input_ids.device
                ids[self.pending_token_idx.device[:num_pending]] = prev_sampled[
                    self.pending_sample_idx.device[:num_pending]
                ]
        if self.device.type == "cuda":
            # One event, recorded again each step (it was waited on first, or a second record
            # simply covers both steps' reads): no allocation per step.
            self._reads_done = self._read_event
            self._reads_done.record(self.stream)

    def staging_ranges(self, spans: list[tuple[HostDeviceBuffer, tuple[int, int]]]) -> list[tuple[int, int]]:
        """The arena's byte ranges the staging kernel copies for ``spans`` (buffer, its used byte
        range) pairs: all but ``input_ids`` (the kernel writes it token by token) and the pending
        index lists (it reads :attr:`token_source` from the host instead), merged as the copies
        merge them but never across ``input_ids``, at most :data:`MAX_RANGES`."""
        ids = self.input_ids
        skip = (ids, self.pending_token_idx, self.pending_sample_idx)
        sides: tuple[list[tuple[int, int]], list[tuple[int, int]]] = ([], [])
        for b, span in spans:
            if b not in skip:
                sides[b.offset > ids.offset].append(span)
        half = MAX_RANGES // 2
        return [r for side in sides for r in fit_ranges(merge_ranges(side, MERGE_GAP_BYTES), half)]

    def _stage(
        self,
        spans: list[tuple[HostDeviceBuffer, tuple[int, int]]],
        num_tokens_padded: int,
        num_pending: int,
        prev_sampled: torch.Tensor | None,
    ) -> None:
        """The staging kernel's launch (ranges: :meth:`staging_ranges`)."""
        from pprun.worker.v2.staging import stage_inputs

        ids = self.input_ids
        if num_pending:
            source = self.token_source.numpy()
            source[:num_tokens_padded] = -1
            source[self.pending_token_idx.np[:num_pending]] = self.pending_sample_idx.np[:num_pending]
        stage_inputs(
            self._arena.host,
            self._arena.device,
            self.staging_ranges(spans),
            ids.host,
            ids.device,
            num_tokens_padded,
            self.token_source if num_pending else None,
            prev_sampled if num_pending else None,
        )
        self.num_copies_last_step = 0

    # --- reading -----------------------------------------------------------------------------

    def attn_metadata(
        self, num_reqs: int, num_reqs_padded: int, num_tokens: int, num_tokens_padded: int, max_query_len: int,
        num_leading_decodes: int = 0,
    ) -> AttentionMetadata:
        """Attention metadata over views of the persistent device buffers (padded lengths)."""
        return AttentionMetadata(
            num_reqs=num_reqs,
            num_reqs_padded=num_reqs_padded,
            num_tokens=num_tokens,
            num_tokens_padded=num_tokens_padded,
            max_query_len=max_query_len,
            num_leading_decodes=num_leading_decodes,
            query_start_loc=self.query_start_loc.device[: num_reqs_padded + 1],
            seq_lens=self.seq_lens.device[:num_reqs_padded],
            block_table=self.block_table.device[:num_reqs_padded],
            slot_mapping=self.slot_mapping.device[:num_tokens_padded],
        )


def prepare_step(
    table: RequestTable,
    so: SchedulerOutput,
    bufs: InputBuffers,
    num_reqs_padded: int,
    num_tokens_padded: int,
    prev_sample_index: Mapping[str, int] | None = None,
) -> StepBatch:
    """Fill the host buffers for ``so`` from the request table, by array indexing (NumPy views of
    the pinned buffers; no device work, no sync).

    Token ``t`` of batch request ``i`` (row ``r``) sits at position
    ``num_computed_tokens[r] + t - query_start[i]``; its id is gathered from the token table and
    its slot is ``block_table[r, pos // block_size] * block_size + pos % block_size``.  Padded
    rows are made inert (see :meth:`InputBuffers.make_inert`).
    """
    req_ids = list(so.num_scheduled_tokens)
    num_reqs = len(req_ids)
    num_tokens = so.total_num_scheduled_tokens
    if not (num_reqs <= num_reqs_padded <= bufs.max_num_reqs):
        raise ValueError(f"num_reqs_padded={num_reqs_padded} must be in [{num_reqs}, {bufs.max_num_reqs}]")
    if not (num_tokens <= num_tokens_padded <= bufs.max_num_tokens):
        raise ValueError(
            f"num_tokens_padded={num_tokens_padded} must be in [{num_tokens}, {bufs.max_num_tokens}]"
        )
    bs = bufs.block_size
    row_of = table.row_of
    rows = np.fromiter((row_of[r] for r in req_ids), dtype=np.int64, count=num_reqs)
    num_scheduled = np.fromiter(so.num_scheduled_tokens.values(), dtype=np.int64, count=num_reqs)
    cu_num_tokens = np.cumsum(num_scheduled)
    if int(cu_num_tokens[-1]) != num_tokens:
        raise ValueError(
            f"step {so.step_id}: total_num_scheduled_tokens={num_tokens} but the per-request counts "
            f"sum to {int(cu_num_tokens[-1])}"
        )

    num_computed = table.num_computed_tokens_np[rows]
    seq_lens = num_computed + num_scheduled
    known = table.num_tokens_np[rows]
    beyond = seq_lens > known
    num_pending = 0
    if beyond.any():
        # Async scheduling: a decode whose input is the token the previous step sampled for the
        # request, still on the device.  Anything else beyond the known tokens is a bug.
        pending = np.flatnonzero(beyond)
        prev = prev_sample_index if prev_sample_index is not None else {}
        for i in pending.tolist():
            if seq_lens[i] != known[i] + 1 or num_scheduled[i] != 1 or req_ids[i] not in prev:
                raise RuntimeError(
                    f"step {so.step_id}: request {req_ids[i]!r} is scheduled up to token "
                    f"{int(seq_lens[i])} but the runner knows only {int(known[i])} of its tokens"
                )
        num_pending = len(pending)
        bufs.pending_token_idx.np[:num_pending] = cu_num_tokens[pending] - 1
        bufs.pending_sample_idx.np[:num_pending] = [prev[req_ids[i]] for i in pending.tolist()]
    max_query_len = int(num_scheduled.max())
    if max_query_len == 1:
        # Decode: one token per request, at its first uncomputed position.
        token_rows = rows
        positions = num_computed
    else:
        # Per token: its request's row and its position (query offset + computed tokens).
        token_rows = np.repeat(rows, num_scheduled)
        positions = np.arange(num_tokens) + np.repeat(num_computed - (cu_num_tokens - num_scheduled), num_scheduled)

    # (A pending token's position is one past the known ones: the gather reads a stale id there,
    # which the runner overwrites on the device.)
    bufs.input_ids.np[:num_tokens] = table.token_ids_np[token_rows, positions]
    bufs.positions.np[:num_tokens] = positions
    block_ids = table.block_table_np[token_rows, positions // bs].astype(np.int64)
    bufs.slot_mapping.np[:num_tokens] = block_ids * bs + positions % bs
    bufs.query_start_loc.np[0] = 0
    bufs.query_start_loc.np[1 : num_reqs + 1] = cu_num_tokens
    bufs.seq_lens.np[:num_reqs] = seq_lens
    # Only the columns some request reads this step (attention stops at each request's
    # ceil(seq_len / block_size) blocks; the stale columns past them are never read): a
    # long max_model_len would otherwise copy its whole table width every step.
    num_cols = -(-int(seq_lens.max()) // bs)
    bufs.block_table.np[:num_reqs, :num_cols] = table.block_table_np[rows, :num_cols]
    bufs.make_inert(num_reqs, num_tokens, num_reqs_padded, num_tokens_padded)

    # A request samples when this step's tokens reach the end of what is known of it (a
    # prefill chunk that stops short of the prompt's end samples nothing).
    samples = seq_lens >= known
    sample_batch_idx = np.arange(num_reqs) if samples.all() else np.flatnonzero(samples)
    num_sampled = len(sample_batch_idx)
    bufs.logits_indices.np[:num_sampled] = cu_num_tokens[sample_batch_idx] - 1
    bufs.sample_rows.np[:num_sampled] = rows[sample_batch_idx]
    return StepBatch(
        req_ids=req_ids,
        rows=torch.from_numpy(rows),
        num_scheduled_tokens=torch.from_numpy(num_scheduled),
        num_reqs=num_reqs,
        num_reqs_padded=num_reqs_padded,
        num_tokens=num_tokens,
        num_tokens_padded=num_tokens_padded,
        max_query_len=max_query_len,
        # Decodes scheduled ahead of the prompt chunks (running requests come first).
        num_leading_decodes=count_leading_decodes(num_scheduled) if max_query_len > 1 else 0,
        sample_batch_idx=torch.from_numpy(sample_batch_idx.astype(np.int64, copy=False)),
        num_pending=num_pending,
        num_computed_tokens=num_computed,
        query_start=cu_num_tokens - num_scheduled,
        num_request_rows=bufs.request_rows(num_reqs_padded, num_tokens_padded),
    )
