"""Greedy token ids on the GPU in one launch: copy each row of logits out and take its argmax.

The last stage's full decode graphs end with the LM head, a copy of its logits into a buffer
shared by every graph size, and each row's argmax.  As two torch ops those cost two launches,
and torch's argmax reduces a 32,000-wide row with one block, one SM for the whole row
(docs/performance.md lists what this kernel saves).  Here every row is cut into chunks, one
program each: it copies its chunk, finds the chunk's largest value and its first index, and
the last program of the row to finish (an arrival counter, ``pprun.kernels.grid``)
merges the chunks' winners in chunk order.

The result is ``torch.argmax``'s: the first index of the largest value, NaN counting as larger
than anything (so the first NaN wins), and index 0 for a row of ``-inf``.  Capture-safe (grid
from shapes, persistent counters, no host reads) and launched with programmatic dependent
launch under capture, like the other kernels.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pprun.kernels.grid import arrival_counters
from pprun.kernels.triton_utils import pdl_options, pdl_sync

BLOCK_V = 2048
"""Vocabulary entries per program (16 programs per row of a 32,000-word vocabulary)."""

_NO_INDEX = tl.constexpr(2**31 - 1)


@triton.jit
def _chunk_winner(x, offs, mask):
    """(value, first index) of the largest entry, NaN above everything; value NaN if any."""
    is_nan = (x != x) & mask
    nan_idx = tl.min(tl.where(is_nan, offs, _NO_INDEX), axis=0)
    best = tl.max(tl.where(mask & ~is_nan, x, float("-inf")), axis=0)
    best_idx = tl.min(tl.where(mask & (x == best), offs, _NO_INDEX), axis=0)
    has_nan = nan_idx != _NO_INDEX
    # A row (chunk) of -inf only: x == best holds for each, so the first index wins.
    return tl.where(has_nan, float("nan"), best), tl.where(has_nan, nan_idx, best_idx)


@triton.jit
def _store_id(ids_ptr, host_ptr, slot_ptr, stride_host, row, index, TO_HOST: tl.constexpr):
    """The row's id into ``ids``, and with ``TO_HOST`` also into row ``slot`` of the pinned
    ``host`` ring (mapped host memory: the store crosses PCIe, no copy engine involved)."""
    tl.store(ids_ptr + row, index.to(tl.int64))
    if TO_HOST:
        slot = tl.load(slot_ptr)
        tl.store(host_ptr + slot.to(tl.int64) * stride_host + row, index.to(tl.int64))


@triton.jit
def _copy_argmax_kernel(
    x_ptr,
    out_ptr,
    ids_ptr,
    part_v_ptr,
    part_i_ptr,
    counter_ptr,
    host_ptr,
    slot_ptr,
    V,
    stride_x,
    stride_out,
    stride_host,
    BLOCK: tl.constexpr,
    CHUNKS: tl.constexpr,
    CHUNKS_P2: tl.constexpr,
    USE_PDL: tl.constexpr,
    TO_HOST: tl.constexpr,
):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    mask = offs < V
    pdl_sync(USE_PDL)  # the logits come from the kernel before
    x = tl.load(x_ptr + row.to(tl.int64) * stride_x + offs, mask=mask, other=float("-inf"))
    tl.store(out_ptr + row.to(tl.int64) * stride_out + offs, x, mask=mask)
    value, index = _chunk_winner(x.to(tl.float32), offs, mask)
    if CHUNKS == 1:
        _store_id(ids_ptr, host_ptr, slot_ptr, stride_host, row, index, TO_HOST)
    else:
        tl.store(part_v_ptr + row * CHUNKS + chunk, value)
        tl.store(part_i_ptr + row * CHUNKS + chunk, index)
        tl.debug_barrier()
        done = tl.atomic_add(counter_ptr + row, 1, sem="acq_rel", scope="gpu")
        if done == CHUNKS - 1:
            c = tl.arange(0, CHUNKS_P2)
            c_mask = c < CHUNKS
            # .cg: read from L2, where the other programs' stores landed.
            values = tl.load(part_v_ptr + row * CHUNKS + c, mask=c_mask, other=float("-inf"), cache_modifier=".cg")
            indices = tl.load(part_i_ptr + row * CHUNKS + c, mask=c_mask, other=_NO_INDEX, cache_modifier=".cg")
            # Each chunk's index is its first best; chunks ascend, so the smallest index among
            # the chunks holding the row's best is the row's first best.
            _, index = _chunk_winner(values, indices, c_mask)
            _store_id(ids_ptr, host_ptr, slot_ptr, stride_host, row, index, TO_HOST)
            tl.atomic_xchg(counter_ptr + row, 0, sem="relaxed", scope="gpu")


def copy_and_argmax(logits: torch.Tensor, logits_out: torch.Tensor, ids_out: torch.Tensor,
                    block_v: int = BLOCK_V, host_out: torch.Tensor | None = None,
                    host_slot: torch.Tensor | None = None) -> None:
    """``logits_out.copy_(logits)`` and ``torch.argmax(logits, -1, out=ids_out)`` in one launch.

    Args:
        logits: ``[rows, vocab]``, contiguous in its last dim.
        logits_out: same shape and dtype (rows may be strided).
        ids_out: ``[rows]`` int64.
        block_v: vocabulary entries per program (a power of two; tests use small ones).
        host_out: ``[slots, >= rows]`` int64 in pinned host memory (CUDA), contiguous rows: the
            ids also go to its row ``host_slot[0]``, read when the kernel runs (a captured graph
            writes wherever the step before it pointed), so no device-to-host copy follows.
        host_slot: ``[1]`` int32 on the logits' device, with ``host_out``.
    """
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"logits must be [rows, vocab] and contiguous in vocab, got shape "
                         f"{tuple(logits.shape)}, strides {logits.stride()}")
    if logits_out.shape != logits.shape or logits_out.dtype != logits.dtype or logits_out.stride(1) != 1:
        raise ValueError(f"logits_out must be {tuple(logits.shape)} {logits.dtype}, contiguous in vocab; got "
                         f"{tuple(logits_out.shape)} {logits_out.dtype}, strides {logits_out.stride()}")
    if ids_out.shape != (logits.shape[0],) or ids_out.dtype != torch.int64:
        raise ValueError(f"ids_out must be a ({logits.shape[0]},) int64 tensor, got "
                         f"{tuple(ids_out.shape)} {ids_out.dtype}")
    if block_v < 16 or block_v & (block_v - 1):
        raise ValueError(f"block_v must be a power of two >= 16, got {block_v}")
    if (host_out is None) != (host_slot is None):
        raise ValueError("host_out and host_slot go together")
    if host_out is not None:
        if host_out.dim() != 2 or host_out.dtype != torch.int64 or host_out.shape[1] < logits.shape[0] \
                or host_out.stride(1) != 1:
            raise ValueError(f"host_out must be [slots, >= {logits.shape[0]}] int64 with contiguous rows, got "
                             f"{tuple(host_out.shape)} {host_out.dtype}, strides {host_out.stride()}")
        if logits.is_cuda and not host_out.is_pinned():
            raise ValueError("host_out must be in pinned host memory (the kernel stores into it across PCIe)")
        if host_slot.shape != (1,) or host_slot.dtype != torch.int32 or host_slot.device != logits.device:
            raise ValueError(f"host_slot must be a (1,) int32 tensor on {logits.device}, got "
                             f"{tuple(host_slot.shape)} {host_slot.dtype} on {host_slot.device}")
    rows, vocab = logits.shape
    if rows == 0:
        return
    chunks = triton.cdiv(vocab, block_v)
    if chunks > 1:
        counters = arrival_counters(logits.device, rows)
        part_v = torch.empty(rows * chunks, dtype=torch.float32, device=logits.device)
        part_i = torch.empty(rows * chunks, dtype=torch.int32, device=logits.device)
    else:
        counters = part_v = part_i = ids_out  # unread with one chunk
    to_host = host_out is not None
    _copy_argmax_kernel[(rows, chunks)](
        logits, logits_out, ids_out, part_v, part_i, counters,
        host_out if to_host else ids_out, host_slot if to_host else ids_out,  # unread without TO_HOST
        vocab, logits.stride(0), logits_out.stride(0), host_out.stride(0) if to_host else 0,
        BLOCK=block_v, CHUNKS=chunks, CHUNKS_P2=max(2, triton.next_power_of_2(chunks)), TO_HOST=to_host,
        num_warps=4, **pdl_options(logits.device),
    )
