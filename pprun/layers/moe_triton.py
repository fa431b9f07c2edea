"""The experts of a mixture-of-experts layer as grouped Triton GEMMs (CUDA; the CPU interpreter in tests).

A step's ``T`` tokens each chose ``top_k`` experts: ``N = T * top_k`` assignments, numbered
``entry = t * top_k + j``.  :func:`align_by_expert` sorts the entries by expert (stable: in
entry order within an expert) and pads each expert's run to a multiple of ``BLOCK_M`` rows, so
that every ``BLOCK_M``-row block of the sorted list belongs to one expert:

- ``sorted_entries [max_rows]``: the entries in that order, padding rows holding ``N``;
- ``block_expert [max_blocks]``: each block's expert, ``-1`` past the rows in use;
- ``num_rows [1]``: the rows in use (a multiple of ``BLOCK_M``), on the device.

Up to :data:`DIRECT_MAX_ENTRIES` assignments (decode at batch 1) there is no sort: block ``b``
is entry ``b`` alone and its expert is read from the routing (:func:`align_direct`).

``max_rows = N + min(N, E) * (BLOCK_M - 1)`` (rounded up to a block) bounds the padded length
whatever the routing, so every shape and grid depends on ``T`` alone: no host sync and no
data-dependent shape, and a full CUDA graph captured for ``T`` tokens replays for any routing.
Blocks past ``num_rows`` return at once.

The routing that chooses the experts (softmax, top-k, renormalisation) is one launch as well
(:func:`fused_route`).  After the sort, two grouped GEMM launches, each a grid of (block,
output tile) programs reading one expert's weights:

- gate_up: ``act[entry] = silu(x[t] @ gate_e^T) * (x[t] @ up_e^T)``, the SwiGLU in the
  epilogue (``[N, inter]``);
- down: ``y[entry] = weight[entry] * (act[entry] @ down_e^T)``, the routing weight in the
  epilogue (``[N, hidden]``);

and the sum over each token's ``top_k`` rows (``y.view(T, top_k, hidden).sum(1)``, one
reduction in a fixed order, so the output does not depend on the order rows were computed in),
or, where a fused add + RMSNorm reads the output, none: the rows are left to that kernel as
split partials, which it sums in slot order as it reads them.

Float8 experts (an FP8 checkpoint's, kept as stored: ``pprun.models.moe``): both GEMMs read
float8 e4m3 weights with float32 scales, one per weight row (compressed-tensors ``channel``; a
per-tensor scale repeated over the rows) or one per 128x128 block (``fp8`` with
``weight_block_size``), in one of two modes:

- W8A16 (every step of per-row-scaled experts; block-scaled ones below
  :data:`FP8_W8A8_MIN_TOKENS`, 32 by default): the activations stay in
  bf16/fp16; each weight tile is upcast in registers (exact: every e4m3 value is a bf16 value)
  and multiplied on the same tensor cores as bf16 experts; per-row scales multiply the fp32 sums
  once after the K loop, block scales each K tile's product (K tiles of at most one block:
  :func:`experts_config`).  The tiles are those tuned for bf16 experts.
- W8A8 (block-scaled experts, steps of at least :data:`FP8_W8A8_MIN_TOKENS` tokens, ``hidden``
  and ``inter`` whole scale blocks: :func:`uses_w8a8`): the activations are float8 too, quantized
  per row and scale block of columns (128; scale = the group's amax / 448, fp32) as
  ``pprun.layers.fp8_quant`` quantizes them (``to_fp8``'s rounding, exact under the
  interpreter).  The hidden states are quantized once per layer, ``T`` rows
  (:func:`quantize_fp8_rows`, one launch), and gate_up reads each token's row for each of its
  entries.  Each K tile is one float8-by-float8 ``tl.dot`` into fp32 (Hopper's FP8 MMA on
  64-row blocks), times the activations' scale of its row and K block and the weights' block
  scale of its column (K tiles of at most one block).  gate_up writes ``act`` in float8 with its
  scales itself: its column tiles are whole scale blocks (:func:`w8a8_config`), so a program
  holds each row's whole groups after the SwiGLU and quantizes them in its epilogue, which spares
  a launch and a write and read of ``act`` in bf16 per layer; with column tiles that split a
  block (a config given by hand) it writes ``act`` in bf16 and one quantization launch follows.
  down reads ``act``'s float8 values and scales the same way.  The SwiGLU output and each expert's
  output are rounded to the activations' dtype as in W8A16.  Tiles: :func:`w8a8_config` (the
  tuned table's W8A8 entries for the GPU and shape, :func:`w8a8_shape_key`, else a fixed rule).

A decode step reads the experts' weights once per expert used and little else, so it is bound
by their bytes, which float8 halves in either mode; prefill steps are bound by the MMAs, whose
peak rate FP8 doubles, at the cost of rounding the activations to 3 mantissa bits (a few
percent of each product).  Per-row-scaled experts run W8A16 at every size.

The sort runs in one Triton program (:func:`_align_kernel`) up to :data:`ALIGN_KERNEL_MAX_ENTRIES`
entries (decode steps, what full CUDA graphs hold); longer prefill steps sort in two launches over
chunks of entries (:func:`_chunk_counts_kernel`, :func:`_chunk_place_kernel`), or with torch ops
(:func:`align_by_expert_torch`); the same layout every way, free of host syncs.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
from pathlib import Path
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from pprun.kernels.partials import SplitPartials, check_defer_merge
from pprun.kernels.triton_utils import INTERPRETED, NO_FMA
from pprun.layers.fp8_quant import FP8_MAX, SCALE_EPS, quantize_groups, to_fp8
from pprun.layers.fused import silu_mul
from pprun.layers.moe_shapes import expert_scale_shapes
from pprun.utils.first_use import count_class_top

logger = logging.getLogger(__name__)

ALIGN_KERNEL_MAX_ENTRIES = 4096
"""Up to this many token -> expert assignments a step sorts them in one Triton program (its
loop is ``N / 64`` steps); more (long prefill chunks) are sorted over chunks
(:data:`ALIGN_CHUNKED_ENABLED`)."""


@triton.jit
def _route_kernel(
    logits_ptr,
    weights_ptr,
    ids_ptr,
    num_experts,
    stride_logits,
    TOP_K: tl.constexpr,
    TOP_K_P2: tl.constexpr,
    EXPERTS_P2: tl.constexpr,
    RENORMALIZE: tl.constexpr,
):
    """One token: softmax over its expert logits in fp32, the ``TOP_K`` largest (the lowest
    index first among equals, in descending order), renormalised where ``RENORMALIZE``."""
    token = tl.program_id(0).to(tl.int64)
    experts = tl.arange(0, EXPERTS_P2)
    x = tl.load(logits_ptr + token * stride_logits + experts, mask=experts < num_experts,
                other=float("-inf")).to(tl.float32)
    e = tl.exp(x - tl.max(x, axis=0))
    probs = e / tl.sum(e, axis=0)
    slots = tl.arange(0, TOP_K_P2)
    top = tl.zeros([TOP_K_P2], dtype=tl.float32)
    top_ids = tl.zeros([TOP_K_P2], dtype=tl.int64)
    total = 0.0
    for j in tl.static_range(TOP_K):
        best = tl.max(probs, axis=0)
        # Clamped: a row of NaN (a padding row's garbage) matches nothing, and must still name
        # an expert that exists (its output is dropped; the kernels after index by it).
        chosen = tl.minimum(tl.min(tl.where(probs == best, experts, EXPERTS_P2), axis=0), num_experts - 1)
        top = tl.where(slots == j, best, top)
        top_ids = tl.where(slots == j, chosen, top_ids)
        total += best
        probs = tl.where(experts == chosen, -1.0, probs)
    if RENORMALIZE:
        top = top / total
    out = token * TOP_K + slots
    tl.store(weights_ptr + out, top, mask=slots < TOP_K)
    tl.store(ids_ptr + out, top_ids, mask=slots < TOP_K)


def fused_route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``pprun.layers.moe.route`` in one launch (one program per token): ``(weights [T, top_k]
    float32, ids [T, top_k] int64)``."""
    num_tokens, num_experts = router_logits.shape
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k={top_k} must be between 1 and the expert count {num_experts}")
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int64, device=router_logits.device)
    if num_tokens == 0:
        return weights, ids
    logits = router_logits if router_logits.stride(1) == 1 else router_logits.contiguous()
    _route_kernel[(num_tokens,)](
        logits, weights, ids, num_experts, logits.stride(0),
        TOP_K=top_k, TOP_K_P2=triton.next_power_of_2(top_k), EXPERTS_P2=triton.next_power_of_2(num_experts),
        RENORMALIZE=renormalize, num_warps=1 if num_experts <= 128 else 4, **NO_FMA,
    )
    return weights, ids


class ExpertAlignment(NamedTuple):
    """Assignments sorted by expert and padded per expert to whole blocks (module docstring)."""

    sorted_entries: torch.Tensor
    """``[max_rows]`` int32: the entries (``t * top_k + j``) by expert; padding rows hold ``N``."""
    block_expert: torch.Tensor
    """``[max_blocks]`` int32: each ``block_m``-row block's expert; ``-1`` past ``num_rows``
    (direct: the routing's int64 ids)."""
    num_rows: torch.Tensor
    """``[1]`` int32: the padded rows in use (a multiple of ``block_m``)."""
    block_m: int
    """Rows per block."""
    direct: bool = False
    """No sort (:func:`align_direct`): block ``b`` is entry ``b`` alone, ``block_expert`` the
    routing's ids themselves, ``sorted_entries`` and ``num_rows`` unused."""


def max_padded_rows(num_entries: int, num_experts: int, block_m: int) -> int:
    """The most rows ``num_entries`` assignments take once each expert's run is padded to whole
    blocks (at most ``min(num_entries, num_experts)`` experts are used), rounded up to a block."""
    rows = num_entries + min(num_entries, num_experts) * (block_m - 1)
    return triton.cdiv(rows, block_m) * block_m


@triton.jit
def _count_entries(ids_ptr, lo, hi, experts, EXPERTS_P2: tl.constexpr, SUB: tl.constexpr):
    """Per expert, the entries of ``[lo, hi)`` routed to it."""
    counts = tl.zeros([EXPERTS_P2], dtype=tl.int32)
    for c0 in range(lo, hi, SUB):
        idx = c0 + tl.arange(0, SUB)
        ids = tl.load(ids_ptr + idx, mask=idx < hi, other=EXPERTS_P2)  # matches no expert
        counts += tl.sum((ids[:, None] == experts[None, :]).to(tl.int32), axis=0)
    return counts


@triton.jit
def _place_entries(ids_ptr, sorted_ptr, lo, hi, starts, seen, experts, EXPERTS_P2: tl.constexpr, SUB: tl.constexpr):
    """The entries of ``[lo, hi)`` to their rows: their expert's run start plus the entries of
    that expert before them (``seen`` per expert before ``lo``, then in entry order: stable)."""
    for c0 in range(lo, hi, SUB):
        idx = c0 + tl.arange(0, SUB)
        ids = tl.load(ids_ptr + idx, mask=idx < hi, other=EXPERTS_P2)
        hit = (ids[:, None] == experts[None, :]).to(tl.int32)  # [SUB, EXPERTS_P2]
        before = tl.cumsum(hit, axis=0) - hit  # same-expert entries earlier in the sub-chunk
        row = tl.sum(hit * (before + starts[None, :] + seen[None, :]), axis=1)
        tl.store(sorted_ptr + row, idx.to(tl.int32), mask=idx < hi)
        seen += tl.sum(hit, axis=0)


@triton.jit
def _finish_layout(sorted_ptr, block_expert_ptr, num_rows_ptr, counts, padded, num_entries, max_rows, experts,
                   EXPERTS_P2: tl.constexpr, BLOCK_M: tl.constexpr, SUB: tl.constexpr, FILL: tl.constexpr):
    """What the entries' rows leave: ``num_rows``, the rows no entry took (holding N) and each
    block's expert."""
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    total = tl.sum(padded, axis=0)
    tl.store(num_rows_ptr, total)
    # Rows no entry took hold N: each expert's padding (fewer than BLOCK_M rows after its
    # entries, one [experts, BLOCK_M] store), and the rows past the last run (never read: blocks
    # past num_rows return at once; filled so the layout is defined).  Both are disjoint from
    # the entries' rows, so no ordering is needed.  Per row this is O(1), not O(experts): a test
    # of every row against every run made this loop most of the kernel's time.
    pad = tl.arange(0, BLOCK_M)
    pad_rows = (starts + counts)[:, None] + pad[None, :]
    tl.store(sorted_ptr + pad_rows, tl.zeros([EXPERTS_P2, BLOCK_M], dtype=tl.int32) + num_entries,
             mask=pad[None, :] < (padded - counts)[:, None])
    for r0 in range(total // FILL * FILL, max_rows, FILL):
        rows = r0 + tl.arange(0, FILL)
        tl.store(sorted_ptr + rows, tl.zeros([FILL], dtype=tl.int32) + num_entries,
                 mask=(rows >= total) & (rows < max_rows))
    # Each block's expert: the one whose padded run holds the block's first row; -1 past them.
    for b0 in range(0, max_rows // BLOCK_M, SUB):
        blocks = b0 + tl.arange(0, SUB)
        first = blocks * BLOCK_M
        owner = (starts[None, :] <= first[:, None]) & (first[:, None] < ends[None, :])
        expert = tl.max(tl.where(owner, experts[None, :], -1), axis=1)
        tl.store(block_expert_ptr + blocks, expert.to(tl.int32), mask=blocks < max_rows // BLOCK_M)


@triton.jit(do_not_specialize=["num_entries", "max_rows"])
def _align_kernel(
    ids_ptr,
    sorted_ptr,
    block_expert_ptr,
    num_rows_ptr,
    num_entries,
    max_rows,
    EXPERTS_P2: tl.constexpr,
    BLOCK_M: tl.constexpr,
    CHUNK: tl.constexpr,
    FILL: tl.constexpr,
):
    """One program: per-expert counts, padded run starts, each entry's row (its expert's start
    plus the entries of that expert before it), padding rows and each block's expert."""
    experts = tl.arange(0, EXPERTS_P2)
    counts = _count_entries(ids_ptr, 0, num_entries, experts, EXPERTS_P2, CHUNK)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    starts = tl.cumsum(padded, axis=0) - padded
    _place_entries(ids_ptr, sorted_ptr, 0, num_entries, starts, tl.zeros([EXPERTS_P2], dtype=tl.int32), experts,
                   EXPERTS_P2, CHUNK)
    _finish_layout(sorted_ptr, block_expert_ptr, num_rows_ptr, counts, padded, num_entries, max_rows, experts,
                   EXPERTS_P2, BLOCK_M, CHUNK, FILL)


# Per-step sizes are not specialised on (Triton would compile a variant for each divisibility by
# 16 of a prefill step's token count, seconds inside a timed run).
@triton.jit(do_not_specialize=["num_entries"])
def _chunk_counts_kernel(ids_ptr, chunk_counts_ptr, num_entries, EXPERTS_P2: tl.constexpr, CHUNK: tl.constexpr,
                         SUB: tl.constexpr):
    """The chunked sort's first launch: program ``c`` counts per expert the entries of chunk
    ``c`` (``CHUNK`` entries) into row ``c`` of ``chunk_counts``."""
    pid = tl.program_id(0)
    experts = tl.arange(0, EXPERTS_P2)
    lo = pid * CHUNK
    counts = _count_entries(ids_ptr, lo, tl.minimum(lo + CHUNK, num_entries), experts, EXPERTS_P2, SUB)
    tl.store(chunk_counts_ptr + pid * EXPERTS_P2 + experts, counts)


@triton.jit(do_not_specialize=["num_entries", "num_chunks", "max_rows"])
def _chunk_place_kernel(ids_ptr, chunk_counts_ptr, sorted_ptr, block_expert_ptr, num_rows_ptr, num_entries,
                        num_chunks, max_rows, EXPERTS_P2: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr,
                        SUB: tl.constexpr, FILL: tl.constexpr):
    """The second launch: every program sums the chunks' counts (the runs' starts) and those of
    the chunks before its own; program ``c < num_chunks`` places chunk ``c``'s entries after
    them, the last program writes the rest of the layout (:func:`_finish_layout`)."""
    pid = tl.program_id(0)
    experts = tl.arange(0, EXPERTS_P2)
    counts = tl.zeros([EXPERTS_P2], dtype=tl.int32)
    seen = tl.zeros([EXPERTS_P2], dtype=tl.int32)
    for c in range(0, num_chunks):
        row = tl.load(chunk_counts_ptr + c * EXPERTS_P2 + experts)
        counts += row
        seen += tl.where(c < pid, row, 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    if pid < num_chunks:
        starts = tl.cumsum(padded, axis=0) - padded
        lo = pid * CHUNK
        _place_entries(ids_ptr, sorted_ptr, lo, tl.minimum(lo + CHUNK, num_entries), starts, seen, experts,
                       EXPERTS_P2, SUB)
    else:
        _finish_layout(sorted_ptr, block_expert_ptr, num_rows_ptr, counts, padded, num_entries, max_rows, experts,
                       EXPERTS_P2, BLOCK_M, SUB, FILL)


ALIGN_CHUNK = 1024
"""Entries per program of the chunked sort (past :data:`ALIGN_KERNEL_MAX_ENTRIES`)."""
ALIGN_CHUNKED_ENABLED = True
"""Past :data:`ALIGN_KERNEL_MAX_ENTRIES` the sort is two launches (:func:`_chunk_counts_kernel`,
:func:`_chunk_place_kernel`: one program per :data:`ALIGN_CHUNK` entries) instead of torch's sort
and the ops around it, about 40 launches: an 8,192-token prefill step of Qwen3-30B-A3B's 24
layers launches some 1,300 kernels with torch's, and its host launching them takes most of
the step's GPU time (an A/B switch of ``scripts/gpu_speed.py --ab-prefill``)."""


def sorts_in_chunks(num_tokens: int, top_k: int) -> bool:
    """Whether a step of ``num_tokens`` tokens sorts its assignments over chunks (two launches)
    rather than in one program: past :data:`ALIGN_KERNEL_MAX_ENTRIES` entries at the top of the
    tokens' class (``pprun.utils.first_use.count_class_top``), so that every count of a class
    takes the path the warm-up's count of that class took."""
    return count_class_top(num_tokens) * top_k > ALIGN_KERNEL_MAX_ENTRIES


def align_by_expert(ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertAlignment:
    """Sort the assignments ``ids [T, top_k]`` by expert, each expert's run padded to whole
    ``block_m``-row blocks (module docstring): one Triton program, past
    :data:`ALIGN_KERNEL_MAX_ENTRIES` entries two launches over chunks (or torch's sort without
    :data:`ALIGN_CHUNKED_ENABLED`)."""
    num_entries = ids.numel()
    chunked = sorts_in_chunks(*ids.shape)
    if chunked and not ALIGN_CHUNKED_ENABLED:
        return align_by_expert_torch(ids, num_experts, block_m)
    max_rows = max_padded_rows(num_entries, num_experts, block_m)
    device = ids.device
    sorted_entries = torch.empty(max_rows, dtype=torch.int32, device=device)
    block_expert = torch.empty(max_rows // block_m, dtype=torch.int32, device=device)
    num_rows = torch.empty(1, dtype=torch.int32, device=device)
    experts_p2 = triton.next_power_of_2(num_experts)
    flat = ids.reshape(-1)
    if not chunked:
        _align_kernel[(1,)](
            flat, sorted_entries, block_expert, num_rows, num_entries, max_rows,
            EXPERTS_P2=experts_p2, BLOCK_M=block_m, CHUNK=64, FILL=1024, num_warps=4,
        )
        return ExpertAlignment(sorted_entries, block_expert, num_rows, block_m)
    num_chunks = triton.cdiv(num_entries, ALIGN_CHUNK)
    chunk_counts = torch.empty(num_chunks, experts_p2, dtype=torch.int32, device=device)
    _chunk_counts_kernel[(num_chunks,)](
        flat, chunk_counts, num_entries, EXPERTS_P2=experts_p2, CHUNK=ALIGN_CHUNK, SUB=64, num_warps=4,
    )
    _chunk_place_kernel[(num_chunks + 1,)](
        flat, chunk_counts, sorted_entries, block_expert, num_rows, num_entries, num_chunks, max_rows,
        EXPERTS_P2=experts_p2, BLOCK_M=block_m, CHUNK=ALIGN_CHUNK, SUB=64, FILL=1024, num_warps=4,
    )
    return ExpertAlignment(sorted_entries, block_expert, num_rows, block_m)


DIRECT_MAX_ENTRIES = 8
"""Up to this many assignments (one token's top-8 at decode batch 1) the grouped GEMMs run
without the sort (:func:`align_direct`): one block per assignment, its expert read straight from
the routing, so the sort's launch and the wait for it leave the layer.  An expert two
assignments share is then read twice, which at a handful of assignments over many experts is
rare (never for one token: its top-k are distinct).  An A/B switch of ``scripts/gpu_speed.py
--ab`` (0: always sort)."""


def align_direct(ids: torch.Tensor, block_m: int) -> ExpertAlignment:
    """The layout without a sort: block ``b`` holds entry ``b`` in its first row (the rest
    padding), its expert ``ids.flat[b]``."""
    flat = ids.reshape(-1)
    return ExpertAlignment(flat, flat, flat, block_m, direct=True)


def layout(ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertAlignment:
    """The grouped GEMMs' row layout for the assignments ``ids [T, top_k]``: none up to
    :data:`DIRECT_MAX_ENTRIES` (:func:`align_direct`), else sorted by expert."""
    if ids.numel() <= DIRECT_MAX_ENTRIES:
        return align_direct(ids, block_m)
    return align_by_expert(ids, num_experts, block_m)


def align_by_expert_torch(ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertAlignment:
    """:func:`align_by_expert` in torch ops (a stable sort, scatters and a search): the same
    layout, fixed shapes, no host sync."""
    flat = ids.reshape(-1).long()
    num_entries = flat.numel()
    device = flat.device
    max_rows = max_padded_rows(num_entries, num_experts, block_m)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    starts = ends - padded
    order = torch.sort(flat, stable=True).indices
    by_expert = flat[order]
    first = torch.cumsum(counts, 0) - counts
    rows = starts[by_expert] + torch.arange(num_entries, device=device) - first[by_expert]
    sorted_entries = torch.full((max_rows,), num_entries, dtype=torch.int32, device=device)
    sorted_entries[rows] = order.to(torch.int32)
    block_first = torch.arange(max_rows // block_m, device=device) * block_m
    block_expert = torch.searchsorted(ends, block_first, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return ExpertAlignment(sorted_entries, block_expert, ends[-1:].to(torch.int32), block_m)


_FP8_MAX = tl.constexpr(FP8_MAX)
_FP8_SCALE_EPS = tl.constexpr(SCALE_EPS)
_EXACT_FP8 = tl.constexpr(INTERPRETED)


@triton.jit
def _dot(a, b, DOT_F32: tl.constexpr):
    """``a @ b`` accumulated in fp32: fp32 operands in IEEE fp32 where ``DOT_F32``."""
    if DOT_F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _block_tile(block_expert_ptr, sorted_ptr, pid_m, num_entries, width, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                DIRECT: tl.constexpr):
    """What a grouped-GEMM program works on (a block in use): its block's expert, the block's
    entries and which are real (padding rows hold ``num_entries``), and its ``BLOCK_N`` output
    columns of ``width`` with which are in range.  ``DIRECT``: block ``pid_m`` is entry
    ``pid_m`` alone (:func:`align_direct`)."""
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if DIRECT:
        entries = tl.where(tl.arange(0, BLOCK_M) == 0, pid_m, num_entries)
    else:
        entries = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    return expert, entries, entries < num_entries, cols, cols < width


@triton.jit
def _scaled_tile(acc, a, w, s_ptrs, col_ok, k0, a_scale, DOT_F32: tl.constexpr, W_SCALE: tl.constexpr,
                 SCALE_BLOCK: tl.constexpr, A_FP8: tl.constexpr):
    """``acc + a @ w`` for one K tile, ``w`` upcast to ``a``'s dtype in registers (exact for float8
    e4m3); with block scales (``W_SCALE == 2``) the tile's product times each column's scale of
    the K block the tile lies in (``BLOCK_K`` divides ``SCALE_BLOCK``; ``s_ptrs``: each column's
    row of block scales).  ``A_FP8`` (W8A8): ``a`` is float8 too, multiplied as float8 (FP8
    tensor-core MMAs, fp32 sums), the product scaled by each row's ``a_scale`` of this K block and
    the weights' block scales."""
    if A_FP8:
        p = tl.dot(a, w, out_dtype=tl.float32)
        p = p * a_scale[:, None] * tl.load(s_ptrs + k0 // SCALE_BLOCK, mask=col_ok, other=0.0)[None, :]
        return acc + p
    p = _dot(a, w.to(a.dtype), DOT_F32)
    if W_SCALE == 2:
        p = p * tl.load(s_ptrs + k0 // SCALE_BLOCK, mask=col_ok, other=0.0)[None, :]
    return acc + p


@triton.jit
def _store_fp8_groups(q_ptr, qs_ptr, x, rows, row_ok, cols, col_ok, stride_q, stride_qs, num_groups,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP: tl.constexpr):
    """``x [BLOCK_M, BLOCK_N]`` (whole ``GROUP``-column groups: the program's ``BLOCK_N`` columns
    of tile ``program_id(1)``) quantized as :func:`pprun.layers.fp8_quant.quantize_groups`
    quantizes: per row and group the scale ``amax / 448`` (at least its epsilon), ``x / scale``
    clamped to float8 e4m3's range; the float8 values at ``q_ptr + row * stride_q + col``, the
    scales at ``qs_ptr + row * stride_qs + group`` (groups ``< num_groups``)."""
    g = tl.reshape(x.to(tl.float32), [BLOCK_M, BLOCK_N // GROUP, GROUP])
    scale = tl.maximum(tl.max(tl.abs(g), axis=2) / _FP8_MAX, _FP8_SCALE_EPS)
    q = tl.reshape(tl.clamp(g / scale[:, :, None], -_FP8_MAX, _FP8_MAX), [BLOCK_M, BLOCK_N])
    tl.store(q_ptr + rows[:, None] * stride_q + cols[None, :], to_fp8(q, q_ptr.dtype.element_ty, _EXACT_FP8),
             mask=row_ok[:, None] & col_ok[None, :])
    groups = tl.program_id(1) * (BLOCK_N // GROUP) + tl.arange(0, BLOCK_N // GROUP)
    tl.store(qs_ptr + rows[:, None] * stride_qs + groups[None, :], scale,
             mask=row_ok[:, None] & (groups < num_groups)[None, :])


@triton.jit
def _scale_pointers(s_ptr, expert, cols, row0, stride_se, stride_sn, W_SCALE: tl.constexpr,
                    SCALE_BLOCK: tl.constexpr):
    """Each output column's scale (``W_SCALE == 1``: one per weight row) or row of block scales
    (``W_SCALE == 2``: ``SCALE_BLOCK`` weight rows share one), ``row0`` scale rows into the
    expert's."""
    if W_SCALE == 2:
        rows = row0 + cols // SCALE_BLOCK
    else:
        rows = row0 + cols
    return s_ptr + expert * stride_se + rows.to(tl.int64) * stride_sn


@triton.jit(do_not_specialize=["num_entries"])
def _gate_up_kernel(
    x_ptr, w_ptr, act_ptr, sorted_ptr, block_expert_ptr, num_rows_ptr, s_ptr, xs_ptr, act_s_ptr,
    num_entries, hidden, inter, up_scale_row,
    stride_x, stride_we, stride_wn, stride_act, stride_se, stride_sn, stride_xs_m, stride_xs_k, stride_act_s,
    TOP_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_F32: tl.constexpr,
    PRECISE_EXP: tl.constexpr,
    DIRECT: tl.constexpr,
    W_SCALE: tl.constexpr,
    SCALE_BLOCK: tl.constexpr,
    ACT_DTYPE: tl.constexpr,
    A_FP8: tl.constexpr,
    ACT_FP8: tl.constexpr,
):
    """One block of one expert's rows times ``BLOCK_N`` columns of its gate and of its up
    projection; SwiGLU in the epilogue (rounded to ``ACT_DTYPE``, the activations' dtype), stored
    at each row's entry.

    ``W_SCALE``: 0 for weights in the activations' dtype; float8 weights upcast in registers
    with 1, one fp32 scale per weight row (``s_ptr + expert * stride_se + row * stride_sn``),
    applied to the sums after the K loop, or with 2, one per ``SCALE_BLOCK`` x ``SCALE_BLOCK``
    block (``... + row_block * stride_sn + k_block``), applied per K tile; the up rows' scales
    start ``up_scale_row`` scale rows in (the gate's own blocks end there).

    ``A_FP8`` (W8A8, with ``W_SCALE == 2``): ``x`` is float8, one fp32 scale per token and
    ``SCALE_BLOCK`` columns at ``xs_ptr + token * stride_xs_m + k_block * stride_xs_k``; the float8
    tiles are multiplied as they are (:func:`_scaled_tile`).  ``ACT_FP8``: the SwiGLU output is
    stored quantized per row and ``SCALE_BLOCK`` columns (``act_ptr`` float8, its scales at
    ``act_s_ptr + entry * stride_act_s + group``; ``BLOCK_N`` a multiple of ``SCALE_BLOCK``)."""
    pid_m = tl.program_id(0)
    if not DIRECT:
        if pid_m * BLOCK_M >= tl.load(num_rows_ptr):
            return
    expert, entries, valid, cols, col_ok = _block_tile(
        block_expert_ptr, sorted_ptr, pid_m, num_entries, inter, BLOCK_M, BLOCK_N, DIRECT
    )
    tokens = (entries // TOP_K).to(tl.int64)
    w_gate = w_ptr + expert * stride_we + cols[None, :].to(tl.int64) * stride_wn
    w_up = w_gate + inter * stride_wn
    s_gate = _scale_pointers(s_ptr, expert, cols, 0, stride_se, stride_sn, W_SCALE, SCALE_BLOCK)
    s_up = _scale_pointers(s_ptr, expert, cols, up_scale_row, stride_se, stride_sn, W_SCALE, SCALE_BLOCK)
    xs_rows = xs_ptr + tokens * stride_xs_m
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < hidden
        a = tl.load(x_ptr + tokens[:, None] * stride_x + ks[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0)
        a_scale = 0.0
        if A_FP8:
            a_scale = tl.load(xs_rows + (k0 // SCALE_BLOCK) * stride_xs_k, mask=valid, other=0.0)
        w_mask = col_ok[None, :] & k_ok[:, None]
        g = tl.load(w_gate + ks[:, None], mask=w_mask, other=0.0)
        u = tl.load(w_up + ks[:, None], mask=w_mask, other=0.0)
        acc_gate = _scaled_tile(acc_gate, a, g, s_gate, col_ok, k0, a_scale, DOT_F32, W_SCALE, SCALE_BLOCK, A_FP8)
        acc_up = _scaled_tile(acc_up, a, u, s_up, col_ok, k0, a_scale, DOT_F32, W_SCALE, SCALE_BLOCK, A_FP8)
    if W_SCALE == 1:
        acc_gate = acc_gate * tl.load(s_gate, mask=col_ok, other=0.0)[None, :]
        acc_up = acc_up * tl.load(s_up, mask=col_ok, other=0.0)[None, :]
    act = silu_mul(acc_gate.to(ACT_DTYPE), acc_up.to(ACT_DTYPE), PRECISE_EXP)
    rows = entries.to(tl.int64)
    if ACT_FP8:
        # Columns past inter are zero (their weights load as zero): no group's amax changes.
        _store_fp8_groups(act_ptr, act_s_ptr, act, rows, valid, cols, col_ok, stride_act, stride_act_s,
                          inter // SCALE_BLOCK, BLOCK_M, BLOCK_N, SCALE_BLOCK)
    else:
        tl.store(act_ptr + rows[:, None] * stride_act + cols[None, :], act, mask=valid[:, None] & col_ok[None, :])


# stride_act_s_k: the entry count where act's scales are column-major (quantize_fp8_rows after a
# gate_up whose column tiles split the scale blocks), which a warm-up class does not fix.
@triton.jit(do_not_specialize=["num_entries", "num_tokens", "stride_act_s_k"])
def _down_kernel(
    act_ptr, w_ptr, weights_ptr, y_ptr, sorted_ptr, block_expert_ptr, num_rows_ptr, s_ptr, act_s_ptr,
    num_entries, num_tokens, hidden, inter,
    stride_act, stride_we, stride_wn, stride_y, stride_se, stride_sn, stride_act_s_m, stride_act_s_k,
    TOP_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_F32: tl.constexpr,
    PARTIALS: tl.constexpr,
    DIRECT: tl.constexpr,
    W_SCALE: tl.constexpr,
    SCALE_BLOCK: tl.constexpr,
    ACT_DTYPE: tl.constexpr,
    A_FP8: tl.constexpr,
):
    """One block of one expert's rows times ``BLOCK_N`` columns of its down projection, scaled
    by each row's routing weight in the epilogue, stored at the row's entry (``PARTIALS``: in
    fp32 at row ``slot * num_tokens + token``, a ``[TOP_K, T, hidden]`` partial sum per slot).
    ``W_SCALE``, ``SCALE_BLOCK``: float8 weights' scales, as :func:`_gate_up_kernel` takes them;
    ``A_FP8`` (W8A8): ``act`` float8 with one fp32 scale per entry and ``SCALE_BLOCK`` columns
    (``act_s_ptr + entry * stride_act_s_m + k_block * stride_act_s_k``); ``ACT_DTYPE``: the
    activations' dtype, which each expert output is rounded to."""
    pid_m = tl.program_id(0)
    if not DIRECT:
        if pid_m * BLOCK_M >= tl.load(num_rows_ptr):
            return
    expert, entries, valid, cols, col_ok = _block_tile(
        block_expert_ptr, sorted_ptr, pid_m, num_entries, hidden, BLOCK_M, BLOCK_N, DIRECT
    )
    rows = entries.to(tl.int64)
    w_cols = w_ptr + expert * stride_we + cols[None, :].to(tl.int64) * stride_wn
    s_cols = _scale_pointers(s_ptr, expert, cols, 0, stride_se, stride_sn, W_SCALE, SCALE_BLOCK)
    as_rows = act_s_ptr + rows * stride_act_s_m
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < inter
        a = tl.load(act_ptr + rows[:, None] * stride_act + ks[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0)
        a_scale = 0.0
        if A_FP8:
            a_scale = tl.load(as_rows + (k0 // SCALE_BLOCK) * stride_act_s_k, mask=valid, other=0.0)
        w = tl.load(w_cols + ks[:, None], mask=col_ok[None, :] & k_ok[:, None], other=0.0)
        acc = _scaled_tile(acc, a, w, s_cols, col_ok, k0, a_scale, DOT_F32, W_SCALE, SCALE_BLOCK, A_FP8)
    if W_SCALE == 1:
        acc = acc * tl.load(s_cols, mask=col_ok, other=0.0)[None, :]
    weight = tl.load(weights_ptr + rows, mask=valid, other=0.0).to(tl.float32)
    # Rounded as the reference rounds: the expert's output in the activation dtype, then scaled.
    y = acc.to(ACT_DTYPE).to(tl.float32) * weight[:, None]
    if PARTIALS:
        rows = (rows % TOP_K) * num_tokens + rows // TOP_K
    tl.store(y_ptr + rows[:, None] * stride_y + cols[None, :], y.to(y_ptr.dtype.element_ty),
             mask=valid[:, None] & col_ok[None, :])


class GemmConfig(NamedTuple):
    """Tile sizes and launch settings of one grouped GEMM (``scripts/bench_moe_kernels.py
    --tune`` times the alternatives)."""

    block_m: int
    """Rows per block (each expert's rows padded to a multiple)."""
    block_n: int
    """Output columns per program."""
    block_k: int
    """Reduction width per loop step."""
    num_warps: int
    num_stages: int | None = None
    """Software-pipelining depth of the K loop; None: Triton's default."""


class ExpertsConfig(NamedTuple):
    """The settings of one layer's two grouped GEMMs.  They share ``block_m``: one sort lays the
    rows out for both."""

    gate_up: GemmConfig
    down: GemmConfig


SPARSE_BLOCK_N = 64
"""Output columns per program while the assignments are fewer than the experts (decode at small
batches: one row per expert used, so the grid is the used experts times the column tiles, and
narrower tiles put more programs on the SMs to stream the weights; an A/B switch of
``scripts/gpu_speed.py --ab``)."""

PARTIALS_MAX_TOKENS: int | None = None
"""Up to this many tokens (None: any number) a step whose experts' output goes into a fused norm
leaves each token's ``top_k`` weighted rows to it as partials (:data:`PARTIALS_IN_DTYPE`); past
it they are summed here, one launch more.  An A/B switch of ``scripts/gpu_speed.py --ab-prefill``
(its switch sets 1024)."""

PARTIALS_IN_DTYPE = True
"""The partials left to the norm (:data:`PARTIALS_MAX_TOKENS`) are each weighted expert row
rounded to the activation dtype, as the summed path rounds it before its sum, instead of fp32:
half the bytes written and read.  On the H200 (``python scripts/gpu_speed.py /tmp/q30 --no-decode
--ab --ab-prefill --prefill-shape 512,32,8192 --prefill-trace --ab-only PARTIALS_IN_DTYPE=False``)
two 8,192-token steps of Qwen3-30B-A3B's 24 layers spend 129.7 ms in kernels with them in bf16,
133.7 ms in fp32; summing the rows before the norm instead (``PARTIALS_MAX_TOKENS=1024``):
133.8 ms."""

FP8_W8A8_MIN_TOKENS: int | None = 32
"""None: never; else steps of at least this many tokens (by their count's class,
``pprun.utils.first_use.count_class_top``, as the tiles are chosen) run block-scaled float8
experts W8A8: activations quantized to float8 per token and scale block of columns, FP8
tensor-core MMAs (module docstring, "Float8 experts").  32: one Qwen3-30B-A3B sparse layer's
experts on the H200 (``scripts/bench_moe_kernels.py --fp8 block --w8a8``, tuned tiles), W8A8
against W8A16: 174 against 224 us at 32 tokens, 293 against 410 at 256, 611 against 1,267 at
2,048, 1,851 against 4,916 at 8,192; at one token the two are even (32.5 against 32.4 us: the
weights' bytes bound both), so single-token decode keeps W8A16 and its one launch fewer."""

TUNED_DIR = Path(__file__).with_name("moe_configs")
"""Tuned settings shipped with pprun: one JSON file per GPU model (``NVIDIA_H200.json``), written
by ``scripts/bench_moe_kernels.py --tune --write``."""

TUNED_ENV = "PPRUN_MOE_CONFIGS"
"""A JSON file of tuned settings (the same format) whose entries take precedence over the shipped
ones, token count by token count, for a GPU or a shape they lack: ``PPRUN_MOE_CONFIGS=my_gpu.json``
in the environment of every process that runs the kernels (a Ray actor's through its
``runtime_env``); used only on the GPU model its ``device`` names."""


def shape_key(num_experts: int, inter: int, hidden: int, top_k: int, dtype: torch.dtype) -> str:
    """The key of a layer shape in a tuned-settings file: ``E=128,N=768,H=2048,K=8,bfloat16``."""
    return f"E={num_experts},N={inter},H={hidden},K={top_k},{str(dtype).removeprefix('torch.')}"


_W8A8_KEY_SUFFIX = ",float8_w8a8_block"


def w8a8_shape_key(num_experts: int, inter: int, hidden: int, top_k: int, scale_block: int) -> str:
    """The key of a layer shape's W8A8 tiles (block-scaled float8 experts, float8 activations) in a
    tuned-settings file: the shape's with the dtype field ``float8_w8a8_block<B>`` for
    ``scale_block`` B, ``E=128,N=768,H=2048,K=8,float8_w8a8_block128`` (the MMAs are float8 by
    float8 whatever the activations' dtype; the scale block bounds the K tiles)."""
    return f"E={num_experts},N={inter},H={hidden},K={top_k}{_W8A8_KEY_SUFFIX}{scale_block}"


def w8a8_block_of(key: str) -> int | None:
    """The scale block of a W8A8 key (:func:`w8a8_shape_key`), None for another key."""
    head, sep, block = key.rpartition(_W8A8_KEY_SUFFIX)
    return int(block) if sep and head and block.isdigit() and int(block) > 0 else None


def device_file_name(device_name: str) -> str:
    """The shipped file for a GPU model: ``NVIDIA H200`` -> ``NVIDIA_H200.json``."""
    return device_name.replace(" ", "_") + ".json"


_TUNED_FORMAT = '{"block_m": M, "gate_up": [N, K, warps, stages], "down": [N, K, warps, stages]}'

W8A8_MIN_BLOCK_K = 32
"""The narrowest K tile of a W8A8 GEMM: Triton's ``tl.dot`` on 8-bit operands takes K >= 32."""


def _check_entry(source: str, tokens: object, entry: object, w8a8_block: int | None = None) -> ExpertsConfig:
    """One token count's entry as configs, or an error naming the file, the entry, the field and
    what is allowed.  ``w8a8_block`` (an entry of W8A8 tiles, :func:`w8a8_shape_key`, for
    ``w8a8_block`` x ``w8a8_block`` block scales): also each ``block_k`` at least
    :data:`W8A8_MIN_BLOCK_K` and dividing the scale block (a K tile lies in one block of scales).  Any
    ``gate_up.block_n`` runs; one that is not a multiple of the scale block leaves the SwiGLU
    output to a quantization launch (:func:`gate_up`)."""
    def bad(what: str) -> ValueError:
        return ValueError(f"{source}: tuned MoE entry {tokens!r}={entry!r}: {what} (each entry is {_TUNED_FORMAT})")

    try:
        count = int(tokens)
        block_m = int(entry["block_m"])
        gate_up, down = (GemmConfig(block_m, *map(int, entry[name])) for name in ("gate_up", "down"))
    except (KeyError, TypeError, ValueError) as exc:
        raise bad(f"{type(exc).__name__}: {exc}") from None
    if count < 1:
        raise bad(f"token count {count} must be at least 1")
    for name, cfg in (("gate_up", gate_up), ("down", down)):
        for field in ("block_m", "block_n", "block_k"):
            size = getattr(cfg, field)
            if size < 16 or size & (size - 1):
                raise bad(f"{name}.{field}={size} must be a power of two, at least 16")
        if cfg.num_warps not in (1, 2, 4, 8, 16):
            raise bad(f"{name}.num_warps={cfg.num_warps} must be one of 1, 2, 4, 8, 16")
        if cfg.num_stages is not None and cfg.num_stages < 1:
            raise bad(f"{name}.num_stages={cfg.num_stages} must be at least 1")
        if w8a8_block is None:
            continue
        allowed = [k for k in (W8A8_MIN_BLOCK_K << i for i in range(8)) if w8a8_block % k == 0]
        if cfg.block_k not in allowed:
            raise bad(f"{name}.block_k={cfg.block_k} with W8A8 ({w8a8_block}x{w8a8_block} block scales, float8 "
                      f"activations) must be one of {allowed or 'none: no K tile fits'} (float8 tl.dot takes "
                      f"K >= {W8A8_MIN_BLOCK_K}; a K tile lies in one scale block, dividing it)")
    return ExpertsConfig(gate_up, down)


def parse_tuned(table: dict, source: str, w8a8_block: int | None = None) -> dict[int, ExpertsConfig]:
    """One shape's entries of a tuned-settings file, ``{tokens: {"block_m": 16, "gate_up": [n,
    k, warps, stages], "down": [...]}}``, as configs by token count; a malformed entry is an
    error naming the file, the entry and the field.  ``w8a8_block``: the entries are W8A8 tiles
    for that scale block (:func:`w8a8_block_of` of their key; :func:`_check_entry`)."""
    if not isinstance(table, dict):
        raise ValueError(f"{source}: a shape's tuned MoE entries must be an object of token counts, got {table!r}")
    return {int(tokens): _check_entry(source, tokens, entry, w8a8_block) for tokens, entry in table.items()}


def _read_tuned(path: Path) -> dict:
    """A tuned-settings file's top level, or an error naming it."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: not a readable JSON file of tuned MoE settings ({exc})") from None
    if not isinstance(data, dict) or not isinstance(data.get("shapes", {}), dict):
        raise ValueError(f'{path}: expected {{"device": NAME, "shapes": {{SHAPE: {{TOKENS: ENTRY}}}}}}')
    return data


def tuned_table(device_name: str, key: str) -> dict[int, ExpertsConfig]:
    """The tuned settings for a layer shape on a GPU model, by token count: the file shipped for
    the GPU, with the entries of the file named by :data:`TUNED_ENV` over them (per token
    count; that file is used only where its ``device`` is this GPU model); empty where neither
    has the shape."""
    return _tuned_table(device_name, key, os.environ.get(TUNED_ENV) or None)


@functools.cache
def _tuned_table(device_name: str, key: str, named: str | None) -> dict[int, ExpertsConfig]:
    table: dict[int, ExpertsConfig] = {}
    w8a8_block = w8a8_block_of(key)
    shipped = TUNED_DIR / device_file_name(device_name)
    if shipped.is_file():
        table.update(parse_tuned(_read_tuned(shipped)["shapes"].get(key, {}), str(shipped), w8a8_block))
    if named is not None:
        path = Path(named)
        if not path.is_file():
            raise FileNotFoundError(f"{TUNED_ENV}={path}: no such file (a JSON file of tuned MoE settings, "
                                    "as scripts/bench_moe_kernels.py --tune --write makes)")
        data = _read_tuned(path)
        if data.get("device", device_name) != device_name:
            logger.warning("%s=%s was tuned on %s, not this %s: not used", TUNED_ENV, path, data["device"], device_name)
        else:
            table.update(parse_tuned(data["shapes"].get(key, {}), str(path), w8a8_block))
    return table


tuned_table.cache_clear = _tuned_table.cache_clear  # files are read once per process: tests rewrite them


def nearest(table: dict[int, ExpertsConfig], num_tokens: int) -> ExpertsConfig:
    """The entry of the token count nearest ``num_tokens`` on a log scale (the smaller on a tie)."""
    return table[min(table, key=lambda t: (abs(math.log(t / max(num_tokens, 1))), t))]


@functools.cache
def _device_name(index: int | None) -> str:
    return torch.cuda.get_device_name(index)


def _tuned_device(w: torch.Tensor) -> str | None:
    """The GPU model whose tuned settings apply to kernels on ``w``'s device; None off CUDA and
    under the interpreter (the heuristics and rules then)."""
    return _device_name(w.device.index) if w.is_cuda and not INTERPRETED else None


def default_config(num_entries: int, num_experts: int, dtype: torch.dtype) -> GemmConfig:
    """Tiles for ``num_entries`` assignments over ``num_experts`` where no tuned setting exists:
    16-row blocks while experts get a few rows each (decode: the weights are what is read, and
    a block past an expert's rows is wasted), larger blocks as the rows per expert grow
    (prefill)."""
    rows_per_expert = num_entries / num_experts
    block_m = 16 if rows_per_expert <= 16 else 32 if rows_per_expert <= 64 else 64
    block_k = 32 if dtype == torch.float32 else 64
    block_n = SPARSE_BLOCK_N if num_entries < num_experts else 64
    return GemmConfig(block_m=block_m, block_n=block_n, block_k=block_k, num_warps=4)


def w8a8_config(num_tokens: int, num_experts: int, top_k: int, scale_block: int,
                table: dict[int, ExpertsConfig] | None = None) -> ExpertsConfig:
    """Tiles of the W8A8 GEMMs (block-scaled float8 experts, :data:`FP8_W8A8_MIN_TOKENS`) for a
    step of ``num_tokens`` tokens (by its class, as :func:`config_for` chooses): the entry of
    the tuned W8A8 ``table`` (:func:`w8a8_table`: this GPU's, this shape's) nearest the top of
    the class, where it has entries; else a rule, the tile sizes of vLLM's tuned H200 settings
    for Qwen3-30B-A3B's block-FP8 experts (16-row blocks up to 8 rows per expert, 64 past, where
    Hopper's warpgroup FP8 MMA takes the tile; 128 output columns; 128-column K tiles), K tiles
    within one scale block and column tiles of whole scale blocks (gate_up then quantizes its
    output itself: :func:`gate_up`)."""
    if table:
        return nearest(table, count_class_top(num_tokens))
    rows_per_expert = count_class_top(num_tokens) * top_k / num_experts
    block_m = 16 if rows_per_expert <= 8 else 64
    cfg = GemmConfig(block_m=block_m, block_n=max(128, scale_block), block_k=min(128, scale_block), num_warps=4,
                     num_stages=3 if block_m == 16 else 4)
    return ExpertsConfig(cfg, cfg)


def w8a8_table(device_name: str | None, num_experts: int, inter: int, hidden: int, top_k: int,
               scale_block: int) -> dict[int, ExpertsConfig]:
    """The tuned W8A8 tiles of a layer shape on a GPU model by token count (:func:`tuned_table`
    under :func:`w8a8_shape_key`, written by ``scripts/bench_moe_kernels.py --fp8 block --w8a8
    --tune --write``); empty for ``device_name`` None or where none were tuned."""
    if device_name is None:
        return {}
    return tuned_table(device_name, w8a8_shape_key(num_experts, inter, hidden, top_k, scale_block))


def uses_w8a8(num_tokens: int, hidden: int, inter: int, scale_block: int | None) -> bool:
    """Whether a step of ``num_tokens`` tokens runs experts with ``scale_block`` x ``scale_block``
    block scales (None: per-row scales, or not float8) W8A8: :data:`FP8_W8A8_MIN_TOKENS` admits
    its class, and ``hidden`` and ``inter`` (the GEMMs' K) are whole scale blocks (the activations
    are quantized per block of columns) of at least :data:`W8A8_MIN_BLOCK_K` columns (a K tile
    lies in one block)."""
    return (scale_block is not None and FP8_W8A8_MIN_TOKENS is not None
            and count_class_top(num_tokens) >= FP8_W8A8_MIN_TOKENS and scale_block >= W8A8_MIN_BLOCK_K
            and hidden % scale_block == 0 and inter % scale_block == 0)


def experts_config(num_tokens: int, w13: torch.Tensor, top_k: int, dtype: torch.dtype,
                   scale_block: int | None = None, w8a8: bool = False) -> ExpertsConfig:
    """The settings for ``num_tokens`` tokens through experts ``w13 [E, 2 * inter, hidden]``
    (:func:`config_for`, by the tokens' class): the tuned entry of the nearest token count for
    this GPU and shape (:func:`tuned_table`, keyed by the activations' ``dtype``: float8 experts
    take the tiles tuned for bf16 ones), else :func:`default_config` for both GEMMs.  ``scale_block`` (float8 experts with block scales):
    K tiles of at most one scale block (each tile's product takes one block's scales).  ``w8a8``
    (block-scaled experts run W8A8): :func:`w8a8_config`, from the tuned W8A8 entries of this GPU
    and shape (:func:`w8a8_table`) where there are any (the bf16 table's tiles are bf16 MMAs')."""
    num_experts, two_inter, hidden = w13.shape
    device_name = _tuned_device(w13)
    if w8a8:
        table = w8a8_table(device_name, num_experts, two_inter // 2, hidden, top_k, scale_block)
        return w8a8_config(num_tokens, num_experts, top_k, scale_block, table)
    table = {} if device_name is None else tuned_table(device_name, shape_key(num_experts, two_inter // 2, hidden,
                                                                             top_k, dtype))
    config = config_for(num_tokens, table, num_experts, top_k, dtype)
    if scale_block is not None:
        config = ExpertsConfig(*(c._replace(block_k=min(c.block_k, scale_block)) for c in config))
    return config


def config_for(num_tokens: int, table: dict[int, ExpertsConfig], num_experts: int, top_k: int,
               dtype: torch.dtype) -> ExpertsConfig:
    """:func:`experts_config`'s choice given the tuned ``table`` (empty: none): made from the top
    of the tokens' class (``pprun.utils.first_use.count_class_top``), not the count itself, so
    that every count of a class runs the tiles (and, through ``block_m``, the sort) that the
    warm-up's count of that class compiled: the tuned entries' boundaries lie between powers of
    two (at 256 and 2,048 tokens the nearest entry switches at 724), and a 600-token step of
    Qwen3-30B-A3B otherwise compiled its sort's 32-row variant in traffic on the H200."""
    tokens = count_class_top(num_tokens)
    if table:
        return nearest(table, tokens)
    both = default_config(tokens * top_k, num_experts, dtype)
    return ExpertsConfig(both, both)


def _launch(cfg: GemmConfig) -> dict:
    """A config's launch options."""
    return {"num_warps": cfg.num_warps, **({} if cfg.num_stages is None else {"num_stages": cfg.num_stages})}


def _dot_f32(dtype: torch.dtype) -> bool:
    """fp32 products in fp32 (no TF32), as torch's reference; the interpreter's bf16 dot is
    broken (Triton 3.7), so there bf16 tiles are multiplied in fp32 too (exact products)."""
    return dtype == torch.float32 or INTERPRETED


def _w_scale(scale: torch.Tensor | None, scale_block: int | None, cfg: GemmConfig) -> int:
    """The kernels' ``W_SCALE`` for weights with ``scale`` (None: in the activations' dtype)."""
    if scale is None:
        return 0
    if scale_block is None:
        return 1
    if cfg.block_k > scale_block or scale_block % cfg.block_k:
        raise ValueError(f"block_k={cfg.block_k} with {scale_block}x{scale_block} block-scaled float8 experts: "
                         f"a K tile must lie in one scale block (block_k dividing {scale_block})")
    return 2


def _scale_strides(scale: torch.Tensor | None) -> tuple[int, int]:
    """A scale tensor's expert and row strides (0, 0 where there is none: unread)."""
    return (0, 0) if scale is None else (scale.stride(0), scale.stride(1))


_TL_DTYPE = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


class Fp8Rows(NamedTuple):
    """Activations quantized to float8 e4m3 per row and group of columns (W8A8), as
    :func:`pprun.layers.fp8_quant.quantize_groups` makes them: ``q [rows, K]`` float8, ``scale
    [rows, K / group]`` float32 (any strides) with ``rows ~ q * scale``; ``dtype`` the activations'
    dtype they were quantized from (what the GEMM's outputs are rounded to)."""

    q: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype


def quantize_fp8_rows(x: torch.Tensor, group: int) -> Fp8Rows:
    """``x [rows, K]`` as :class:`Fp8Rows` (one launch of ``quantize_groups``: scales column-major)."""
    q, scale = quantize_groups(x, group)
    return Fp8Rows(q, scale, x.dtype)


def _check_fp8_rows(name: str, rows: Fp8Rows, width: int, scale_block: int | None, w_scale: int,
                    block_k: int) -> None:
    """W8A8 takes block-scaled float8 weights, and activations of ``width`` columns quantized in
    groups of their block (the activations' column groups are the weights' K blocks), in K tiles
    of float8 ``tl.dot``'s width at least."""
    if w_scale != 2:
        raise ValueError(f"float8 {name} (W8A8) take block-scaled float8 experts (scale_block={scale_block} "
                         "here): per-row-scaled ones run W8A16")
    if block_k < W8A8_MIN_BLOCK_K:
        raise ValueError(f"block_k={block_k} with float8 {name} (W8A8): float8 tl.dot takes K tiles of at least "
                         f"{W8A8_MIN_BLOCK_K} (scale blocks narrower than that run W8A16)")
    num_rows = rows.q.shape[0]
    if (width % scale_block or rows.q.dtype != FP8_WEIGHT_DTYPE or rows.q.shape[1] != width
            or tuple(rows.scale.shape) != (num_rows, width // scale_block)):
        raise ValueError(f"float8 {name} {rows.q.dtype} {tuple(rows.q.shape)} with scales {tuple(rows.scale.shape)}: "
                         f"W8A8 with {scale_block}x{scale_block} blocks takes float8 e4m3 [rows, {width}] with "
                         f"[rows, {width} / {scale_block}] scales, {width} a multiple of {scale_block}")


def gate_up(x: torch.Tensor | Fp8Rows, w13: torch.Tensor, align: ExpertAlignment, top_k: int, cfg: GemmConfig,
            w13_scale: torch.Tensor | None = None, scale_block: int | None = None) -> torch.Tensor | Fp8Rows:
    """The gate_up launch of :func:`fused_experts`: ``act [T * top_k, inter]`` by entry
    (``w13_scale``, ``scale_block``: float8 weights' scales, :func:`fused_experts`).  W8A8:
    ``x`` as :class:`Fp8Rows` (per token and ``scale_block`` columns); ``act`` is then
    :class:`Fp8Rows` too, quantized in the epilogue, where ``cfg.block_n`` is whole scale blocks
    (a program holds each row's whole groups), else in ``x``'s dtype (for
    :func:`quantize_fp8_rows`)."""
    fp8 = isinstance(x, Fp8Rows)
    xq, dtype = (x.q, x.dtype) if fp8 else (x, x.dtype)
    num_entries, (_, two_inter, hidden) = xq.shape[0] * top_k, w13.shape
    inter = two_inter // 2
    w_scale = _w_scale(w13_scale, scale_block, cfg)
    if fp8:
        _check_fp8_rows("x", x, hidden, scale_block, w_scale, cfg.block_k)
        if inter % scale_block:
            raise ValueError(f"W8A8 experts' inter={inter} must be whole {scale_block}-column scale blocks")
    quantize_out = fp8 and cfg.block_n % scale_block == 0
    act = torch.empty(num_entries, inter, dtype=FP8_WEIGHT_DTYPE if quantize_out else dtype, device=xq.device)
    act_s = torch.empty(num_entries, inter // scale_block, dtype=torch.float32, device=xq.device) if quantize_out else act
    xs = x.scale if fp8 else xq  # unread without float8 activations
    up_scale_row = inter if scale_block is None else triton.cdiv(inter, scale_block)
    _gate_up_kernel[(align.block_expert.shape[0], triton.cdiv(inter, cfg.block_n))](
        xq, w13, act, align.sorted_entries, align.block_expert, align.num_rows,
        w13 if w13_scale is None else w13_scale,  # unread without a scale
        xs, act_s,
        num_entries, hidden, inter, up_scale_row,
        xq.stride(0), w13.stride(0), w13.stride(1), act.stride(0), *_scale_strides(w13_scale),
        xs.stride(0), xs.stride(1), act_s.stride(0),
        TOP_K=top_k, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        DOT_F32=_dot_f32(dtype), PRECISE_EXP=not INTERPRETED, DIRECT=align.direct,
        W_SCALE=w_scale, SCALE_BLOCK=scale_block or 1, ACT_DTYPE=_TL_DTYPE[dtype], A_FP8=fp8,
        ACT_FP8=quantize_out, **_launch(cfg), **NO_FMA,
    )
    return Fp8Rows(act, act_s, dtype) if quantize_out else act


def down(act: torch.Tensor | Fp8Rows, w2: torch.Tensor, weights: torch.Tensor, align: ExpertAlignment, top_k: int,
         cfg: GemmConfig, partials: bool = False, w2_scale: torch.Tensor | None = None,
         scale_block: int | None = None) -> torch.Tensor:
    """The down launch of :func:`fused_experts`: ``y [T * top_k, hidden]`` by entry, weighted
    (``partials``: by slot then token, in fp32 unless :data:`PARTIALS_IN_DTYPE`; ``w2_scale``,
    ``scale_block``: float8 weights' scales, :func:`fused_experts`); in ``act``'s dtype (W8A8:
    ``act`` as :class:`Fp8Rows`, the dtype it was quantized from)."""
    fp8 = isinstance(act, Fp8Rows)
    aq, dtype = (act.q, act.dtype) if fp8 else (act, act.dtype)
    num_entries, inter = aq.shape
    hidden = w2.shape[1]
    fp32 = partials and not PARTIALS_IN_DTYPE
    y = torch.empty(num_entries, hidden, dtype=torch.float32 if fp32 else dtype, device=aq.device)
    w_scale = _w_scale(w2_scale, scale_block, cfg)
    if fp8:
        _check_fp8_rows("act", act, w2.shape[2], scale_block, w_scale, cfg.block_k)
    a_s = act.scale if fp8 else aq  # unread without float8 activations
    _down_kernel[(align.block_expert.shape[0], triton.cdiv(hidden, cfg.block_n))](
        aq, w2, weights.reshape(-1).contiguous(), y, align.sorted_entries, align.block_expert, align.num_rows,
        w2 if w2_scale is None else w2_scale,  # unread without a scale
        a_s,
        num_entries, num_entries // top_k, hidden, inter,
        aq.stride(0), w2.stride(0), w2.stride(1), y.stride(0), *_scale_strides(w2_scale), a_s.stride(0), a_s.stride(1),
        TOP_K=top_k, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        DOT_F32=_dot_f32(dtype), PARTIALS=partials, DIRECT=align.direct,
        W_SCALE=w_scale, SCALE_BLOCK=scale_block or 1, ACT_DTYPE=_TL_DTYPE[dtype], A_FP8=fp8,
        **_launch(cfg), **NO_FMA,
    )
    return y


FP8_WEIGHT_DTYPE = torch.float8_e4m3fn


def _check_scales(w13: torch.Tensor, w2: torch.Tensor, w13_scale: torch.Tensor | None,
                  w2_scale: torch.Tensor | None, scale_block: int | None) -> None:
    """Float8 experts come with float32 scales of :func:`expert_scale_shapes`; others without."""
    fp8 = w13.dtype == FP8_WEIGHT_DTYPE
    if (w2.dtype == FP8_WEIGHT_DTYPE) != fp8 or (w13_scale is not None) != fp8 or (w2_scale is not None) != fp8:
        raise ValueError(f"expert weights w13 {w13.dtype} and w2 {w2.dtype} with scales "
                         f"{'given' if w13_scale is not None else 'none'} / {'given' if w2_scale is not None else 'none'}: "
                         f"float8 e4m3 weights take w13_scale and w2_scale, others neither")
    if not fp8:
        return
    if scale_block is not None and (scale_block < 16 or scale_block & (scale_block - 1)):
        raise ValueError(f"scale_block={scale_block} must be None (per-row scales) or a power of two >= 16")
    num_experts, hidden, inter = w2.shape
    want = expert_scale_shapes(num_experts, inter, hidden, scale_block)
    for name, scale, shape in (("w13_scale", w13_scale, want[0]), ("w2_scale", w2_scale, want[1])):
        if tuple(scale.shape) != shape or scale.dtype != torch.float32:
            raise ValueError(f"{name} {tuple(scale.shape)} {scale.dtype}: float8 experts w13 {tuple(w13.shape)}, "
                             f"w2 {tuple(w2.shape)} with scale_block={scale_block} take float32 {shape}")


def fused_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    config: ExpertsConfig | GemmConfig | None = None,
    then: str | None = None,
    *,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    scale_block: int | None = None,
) -> torch.Tensor | SplitPartials:
    """``sum_j weights[t, j] * expert_{ids[t, j]}(x[t])`` for ``x [T, hidden]`` (module
    docstring): ``w13 [E, 2 * inter, hidden]``, ``w2 [E, hidden, inter]``, ``weights`` and
    ``ids [T, top_k]``.  Float8 e4m3 experts come with their float32 scales ``w13_scale`` and
    ``w2_scale`` (:func:`expert_scale_shapes`: per weight row, or per ``scale_block`` x
    ``scale_block`` block): the kernels read the float8 bytes, upcast them to ``x``'s dtype in
    registers and apply the scales to the fp32 sums (module docstring, "Float8 experts"); with
    block scales, from :data:`FP8_W8A8_MIN_TOKENS` tokens, they quantize the activations and
    multiply float8 by float8 (W8A8, :func:`uses_w8a8`).  Returns ``[T, hidden]`` in ``x``'s dtype; with ``then="norm"`` (a
    fused add + RMSNorm reads the output) the ``top_k`` weighted expert outputs unsummed, as
    :class:`~pprun.kernels.partials.SplitPartials` ``[top_k, T, hidden]`` (in ``x``'s dtype, or
    fp32 without :data:`PARTIALS_IN_DTYPE`) that the
    norm's kernel sums as it reads them (one launch and one pass over the output fewer).
    ``config``: both GEMMs' settings (a :class:`GemmConfig` for both); by default
    :func:`experts_config`'s."""
    check_defer_merge(then)
    num_tokens, hidden = x.shape
    num_experts, two_inter, _ = w13.shape
    inter = two_inter // 2
    top_k = ids.shape[1]
    if w13.shape != (num_experts, 2 * inter, hidden) or w2.shape != (num_experts, hidden, inter):
        raise ValueError(f"expert weights w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} do not fit "
                         f"hidden={hidden}: expected [E, 2 * inter, {hidden}] and [E, {hidden}, inter]")
    if weights.shape != ids.shape or ids.shape[0] != num_tokens:
        raise ValueError(f"routing weights {tuple(weights.shape)} and ids {tuple(ids.shape)} must both be "
                         f"[{num_tokens}, top_k]")
    _check_scales(w13, w2, w13_scale, w2_scale, scale_block)
    num_entries = num_tokens * top_k
    if num_entries == 0:
        return torch.zeros_like(x)
    x, ids = x.contiguous(), ids.contiguous()  # the sort and the direct layout read ids flat
    w13, w2 = w13.contiguous(), w2.contiguous()
    if w13_scale is not None:
        w13_scale, w2_scale = w13_scale.contiguous(), w2_scale.contiguous()
    else:
        scale_block = None
    w8a8 = uses_w8a8(num_tokens, hidden, inter, scale_block)
    if config is None:
        config = experts_config(num_tokens, w13, top_k, x.dtype, scale_block, w8a8)
    elif isinstance(config, GemmConfig):
        config = ExpertsConfig(config, config)
    up_cfg, down_cfg = config
    if up_cfg.block_m != down_cfg.block_m:
        raise ValueError(f"the two GEMMs share one sort: block_m {up_cfg.block_m} (gate_up) != {down_cfg.block_m} (down)")
    align = layout(ids, num_experts, up_cfg.block_m)
    act = gate_up(quantize_fp8_rows(x, scale_block) if w8a8 else x, w13, align, top_k, up_cfg, w13_scale, scale_block)
    if w8a8 and not isinstance(act, Fp8Rows):  # gate_up's column tiles split scale blocks
        act = quantize_fp8_rows(act, scale_block)
    partials = then == "norm" and (PARTIALS_MAX_TOKENS is None or num_tokens <= PARTIALS_MAX_TOKENS)
    y = down(act, w2, weights, align, top_k, down_cfg, partials, w2_scale, scale_block)
    if partials:
        return SplitPartials(y.view(top_k, num_tokens, hidden), None, x.dtype)
    return torch.sum(y.view(num_tokens, top_k, hidden), dim=1)
