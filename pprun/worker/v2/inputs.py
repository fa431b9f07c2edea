"""The V2 runner's persistent input buffers and the tensor-indexed construction of a step's inputs.

Every buffer is allocated once at its largest size and reused: a step writes its real rows first,
then makes the padded rows inert (input id 0, position 0, slot -1: not written, sequence length
0, flat ``query_start_loc``: an empty query), and the model and attention layers read views
``[:num_tokens_padded]`` / ``[:num_reqs_padded]``.  Eager steps and CUDA-graph replays read the
very same device buffers, so a captured graph sees each step's values at fixed addresses.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pprun.attention.metadata import AttentionMetadata
from pprun.core.outputs import SchedulerOutput
from pprun.worker.v2.request_state import RequestTable


class HostDeviceBuffer:
    """One persistent buffer with a host staging copy (pinned on CUDA) and its device twin.

    On CPU both are the same tensor and :meth:`to_device` copies nothing.
    """

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
        pin = device.type == "cuda"
        self.host = torch.zeros(shape, dtype=dtype, pin_memory=pin)
        self.device = self.host if device.type == "cpu" else torch.zeros(shape, dtype=dtype, device=device)

    def to_device(self, num_rows: int) -> torch.Tensor:
        """Copy the first ``num_rows`` rows host -> device (asynchronously); returns the device view."""
        if self.device is not self.host:
            self.device[:num_rows].copy_(self.host[:num_rows], non_blocking=True)
        return self.device[:num_rows]


@dataclass
class StepBatch:
    """A step's batch as the runner laid it out (host side), real and padded counts named apart."""

    req_ids: list[str]
    """Scheduled requests in batch order (the order of ``num_scheduled_tokens``)."""
    rows: torch.Tensor
    """[num_reqs] int64: each request's row in the :class:`RequestTable`."""
    num_scheduled_tokens: torch.Tensor
    """[num_reqs] int64: tokens each request computes this step."""
    num_reqs: int
    num_reqs_padded: int
    num_tokens: int
    num_tokens_padded: int
    max_query_len: int
    sample_batch_idx: torch.Tensor
    """[num_sampled] int64: batch positions of the requests that sample this step (their
    scheduled tokens reach the end of what the runner knows of them)."""

    @property
    def num_sampled(self) -> int:
        """Requests that sample this step."""
        return int(self.sample_batch_idx.numel())


class InputBuffers:
    """All per-step input buffers of one stage, at their maximum sizes."""

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
        self.input_ids = HostDeviceBuffer((max_num_tokens,), torch.int64, device)
        self.positions = HostDeviceBuffer((max_num_tokens,), torch.int64, device)
        self.slot_mapping = HostDeviceBuffer((max_num_tokens,), torch.int64, device)
        self.query_start_loc = HostDeviceBuffer((max_num_reqs + 1,), torch.int32, device)
        self.seq_lens = HostDeviceBuffer((max_num_reqs,), torch.int32, device)
        self.block_table = HostDeviceBuffer((max_num_reqs, max_num_blocks_per_req), torch.int32, device)
        self.logits_indices = HostDeviceBuffer((max_num_reqs,), torch.int64, device)
        """Rows of the step's hidden states whose logits are sampled."""
        # The host staging buffers are rewritten every step while the previous step's
        # non_blocking copies may still be reading them: wait for those first.
        self._copies_done: torch.cuda.Event | None = None
        self.make_inert(0, 0, max_num_reqs, max_num_tokens)
        self.to_device(max_num_reqs, max_num_tokens, 0)

    # --- writing -----------------------------------------------------------------------------

    def make_inert(
        self, num_reqs: int, num_tokens: int, num_reqs_padded: int, num_tokens_padded: int
    ) -> None:
        """Write the padding rows ``[num_reqs:num_reqs_padded]`` / ``[num_tokens:num_tokens_padded]``
        (host side) so that they read and write nothing and change no real row's result."""
        self.input_ids.host[num_tokens:num_tokens_padded] = 0
        self.positions.host[num_tokens:num_tokens_padded] = 0
        self.slot_mapping.host[num_tokens:num_tokens_padded] = -1
        # Padded requests have an empty query: every boundary after the real ones equals num_tokens.
        self.query_start_loc.host[num_reqs + 1 : num_reqs_padded + 1] = num_tokens
        self.seq_lens.host[num_reqs:num_reqs_padded] = 0
        self.block_table.host[num_reqs:num_reqs_padded] = 0

    def wait_for_previous_copies(self) -> None:
        """Block until the last :meth:`to_device` copies finished reading the host buffers."""
        if self._copies_done is not None:
            self._copies_done.synchronize()
            self._copies_done = None

    def to_device(self, num_reqs_padded: int, num_tokens_padded: int, num_sampled: int) -> None:
        """Copy the step's rows (real and padding) to the device buffers."""
        self.input_ids.to_device(num_tokens_padded)
        self.positions.to_device(num_tokens_padded)
        self.slot_mapping.to_device(num_tokens_padded)
        self.query_start_loc.to_device(num_reqs_padded + 1)
        self.seq_lens.to_device(num_reqs_padded)
        self.block_table.to_device(num_reqs_padded)
        self.logits_indices.to_device(num_sampled)
        if self.device.type == "cuda":
            self._copies_done = torch.cuda.Event()
            self._copies_done.record()

    # --- reading -----------------------------------------------------------------------------

    def attn_metadata(
        self, num_reqs: int, num_reqs_padded: int, num_tokens: int, num_tokens_padded: int, max_query_len: int
    ) -> AttentionMetadata:
        """Attention metadata over views of the persistent device buffers (padded lengths)."""
        return AttentionMetadata(
            num_reqs=num_reqs,
            num_reqs_padded=num_reqs_padded,
            num_tokens=num_tokens,
            num_tokens_padded=num_tokens_padded,
            max_query_len=max_query_len,
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
) -> StepBatch:
    """Fill the host buffers for ``so`` from the request table, by tensor indexing.

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
    rows = torch.tensor([table.row_of[r] for r in req_ids], dtype=torch.int64)
    num_scheduled = torch.tensor(list(so.num_scheduled_tokens.values()), dtype=torch.int64)
    cu_num_tokens = torch.cumsum(num_scheduled, 0)
    if int(cu_num_tokens[-1]) != num_tokens:
        raise ValueError(
            f"step {so.step_id}: total_num_scheduled_tokens={num_tokens} but the per-request counts "
            f"sum to {int(cu_num_tokens[-1])}"
        )

    # Per token: its request's batch index, its offset in that request's query, its position.
    batch_idx = torch.repeat_interleave(torch.arange(num_reqs), num_scheduled)
    offsets = torch.arange(num_tokens) - (cu_num_tokens - num_scheduled)[batch_idx]
    num_computed = table.num_computed_tokens[rows]
    positions = num_computed[batch_idx] + offsets
    token_rows = rows[batch_idx]
    seq_lens = num_computed + num_scheduled
    known = table.num_tokens[rows]
    if bool((seq_lens > known).any()):
        bad = int(torch.nonzero(seq_lens > known)[0, 0])
        raise RuntimeError(
            f"step {so.step_id}: request {req_ids[bad]!r} is scheduled up to token {int(seq_lens[bad])} "
            f"but the runner knows only {int(known[bad])} of its tokens"
        )

    bufs.input_ids.host[:num_tokens] = table.token_ids[token_rows, positions]
    bufs.positions.host[:num_tokens] = positions
    block_ids = table.block_table[token_rows, positions // bs].to(torch.int64)
    bufs.slot_mapping.host[:num_tokens] = block_ids * bs + positions % bs
    bufs.query_start_loc.host[0] = 0
    bufs.query_start_loc.host[1 : num_reqs + 1] = cu_num_tokens
    bufs.seq_lens.host[:num_reqs] = seq_lens
    bufs.block_table.host[:num_reqs] = table.block_table[rows]
    bufs.make_inert(num_reqs, num_tokens, num_reqs_padded, num_tokens_padded)

    # A request samples when this step's tokens reach the end of what is known of it (a
    # prefill chunk that stops short of the prompt's end samples nothing).
    sample_batch_idx = torch.nonzero(seq_lens == known).flatten()
    bufs.logits_indices.host[: sample_batch_idx.numel()] = cu_num_tokens[sample_batch_idx] - 1
    return StepBatch(
        req_ids=req_ids,
        rows=rows,
        num_scheduled_tokens=num_scheduled,
        num_reqs=num_reqs,
        num_reqs_padded=num_reqs_padded,
        num_tokens=num_tokens,
        num_tokens_padded=num_tokens_padded,
        max_query_len=int(num_scheduled.max()),
        sample_batch_idx=sample_batch_idx,
    )
