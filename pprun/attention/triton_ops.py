"""Triton paged attention for CUDA: cache write, flash-decoding and varlen causal prefill.

Layouts are those of ``ref_ops`` (the reference these kernels are tested against).  Every
host-side function here is capture-safe (CUDA graphs): launch grids and split counts come
from tensor shapes and Python ints only; per-request lengths are read inside the kernels,
where they bound runtime loops.  Accumulation is fp32; fp32 inputs use IEEE dot products
(no TF32) so they match the reference to ~1e-5.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from pprun.attention.ref_ops import check_kv_cache
from pprun.kernels.grid import arrival_counters, num_sms
from pprun.kernels.partials import SplitPartials
from pprun.kernels.triton_utils import INTERPRETED as _INTERPRETED
from pprun.kernels.triton_utils import NO_FMA as _NO_FMA
from pprun.kernels.triton_utils import pdl_options, pdl_sync

LOG2_E = 1.4426950408889634
# Stands in for -inf as the running max so that a fully masked tile gives
# exp2(-inf - m) = 0 instead of exp2(-inf + inf) = nan.
_NEG_BIG = tl.constexpr(-1.0e30)
DECODE_MIN_TOKENS_PER_SPLIT = 64
"""Fewest tokens of the longest possible context (the block table's width) per decode split:
one K/V tile.  The split count is fixed at capture while contexts vary; a context shorter than
the graph's longest leaves the last splits empty, and those return at once (the merge reads only
the splits that hold tokens).  More, shorter splits keep more SMs busy on a short batch, and an
empty split costs next to nothing; longer splits (fewer of them) are slower at batch 1
(docs/performance.md, "Launch settings")."""
DECODE_PROGRAMS_PER_SM = 2
"""Programs per SM the decode splits aim for: (request, KV head) pairs fewer than this many per
SM get their context split.  Batch 32 of the 1.1B model (256 pairs) gets 2 splits; its programs
each walk 4-5 dependent 64-token tiles at context ~512.  Two is the balance between a program's
chain of dependent tiles and the merge that every extra split adds: more per SM (shorter
chains) and one (no merge, twice the chain) are both slower (docs/performance.md, "Launch
settings")."""
_MAX_SPLITS = 16
"""At most this many splits: a wider block table gets longer splits rather than more of them,
since more measured slower at batch 1 even where only eight hold tokens (docs/performance.md,
"Launch settings")."""
# Decode launch settings: the sweep alone and behind qkv found no setting that gains more than
# ~1 us (docs/performance.md, "Launch settings do not move it"); these are the ones that measured
# best in the whole step ("Launch settings and the comparisons behind them").
_DECODE_BLOCK_N = 64
_DECODE_NUM_WARPS = 2  # 4 warps are slower at batch 1 and at batch 32
_DECODE_NUM_STAGES = 2  # a third stage gains nothing at batch 32 and is slower at batch 1
DECODE_PRELOAD_KV = True
"""Decode with a new token: each program loads its first K/V tile (and the step's metadata)
before waiting for the qkv kernel (PDL), overlapping that kernel's tail; ``scripts/gpu_speed.py
--ab`` flips it."""
DECODE_PRELOAD_SECOND = True
"""With :data:`DECODE_PRELOAD_KV`, each split's second K/V tile too, where the context is cut
into at most :data:`DECODE_PRELOAD_SECOND_MAX_SPLITS` splits (long splits: a batch that fills
the GPU with (request, KV head) pairs alone).  The qkv matmul before leaves the bandwidth half
idle, so the second tile shortens the attention by more than its competition with qkv's weights
lengthens qkv.  With many short splits (batch 1: one tile each, the second all masked) the
extra loads only delay qkv, hence the split limit (docs/performance.md, "Launch settings")."""
DECODE_PRELOAD_SECOND_MAX_SPLITS = 4
"""Most splits of the context that take :data:`DECODE_PRELOAD_SECOND` (more splits are shorter:
at batch 1 they hold one tile each)."""
# The CPU interpreter multiplies bf16/fp16 dot operands as raw bits; it gets fp32 dots.
# The rotary products are rounded one by one, as torch does them (see pprun.layers.fused): NO_FMA.


def _dot_in_fp32(dtype: torch.dtype) -> bool:
    """fp32 inputs need IEEE dots (not TF32) to match the reference; so does the interpreter."""
    return dtype == torch.float32 or _INTERPRETED


# --------------------------------------------------------------------------------------
# KV-cache write
# --------------------------------------------------------------------------------------


@triton.jit
def _reshape_and_cache_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_k_tok,
    stride_k_head,
    stride_v_tok,
    stride_v_head,
    stride_c_blk,
    stride_c_off,
    stride_c_head,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
):
    tok = tl.program_id(0)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    if slot < 0:
        return
    blk = slot // PAGE_SIZE
    off = slot % PAGE_SIZE
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)
    # The last dim is contiguous everywhere (checked on the host).
    k = tl.load(k_ptr + tok * stride_k_tok + offs_h[:, None] * stride_k_head + offs_d[None, :], mask=mask)
    v = tl.load(v_ptr + tok * stride_v_tok + offs_h[:, None] * stride_v_head + offs_d[None, :], mask=mask)
    dst = blk * stride_c_blk + off * stride_c_off + offs_h[:, None] * stride_c_head + offs_d[None, :]
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def _check_last_dim_contiguous(name: str, t: torch.Tensor) -> None:
    if t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dim, got strides {t.stride()}")


def reshape_and_cache(
    k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write each token's K/V into ``kv_cache`` at ``slot_mapping``; slots < 0 are skipped.

    Args:
        k, v: ``[num_tokens_padded, num_kv_heads, head_dim]``.
        kv_cache: ``[2, num_blocks, block_size, num_kv_heads, head_dim]``, written in place.
        slot_mapping: ``[num_tokens_padded]`` int64 (-1 for padded tokens).
    """
    if k.dim() != 3 or k.shape != v.shape:
        raise ValueError(f"k and v must share a 3-d shape, got k={tuple(k.shape)} v={tuple(v.shape)}")
    num_tokens_padded, num_kv_heads, head_dim = k.shape
    if slot_mapping.shape != (num_tokens_padded,):
        raise ValueError(
            f"slot_mapping must have shape ({num_tokens_padded},), got {tuple(slot_mapping.shape)}"
        )
    check_kv_cache(kv_cache, num_kv_heads, head_dim)
    for name, t in (("k", k), ("v", v), ("kv_cache", kv_cache)):
        _check_last_dim_contiguous(name, t)
    if num_tokens_padded == 0:
        return
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    _reshape_and_cache_kernel[(num_tokens_padded,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        PAGE_SIZE=kv_cache.shape[2],
    )


# --------------------------------------------------------------------------------------
# Decode: one query token per request, flash-decoding
# --------------------------------------------------------------------------------------


def num_decode_splits(
    num_reqs_padded: int, num_kv_heads: int, max_context_len: int, device: torch.device
) -> int:
    """Context splits per (request, kv head) for decode, from shapes only (capture-safe).

    Splitting pays when (request, kv head) programs alone cannot fill the GPU, e.g. batch 1
    with 8 KV heads on 132 SMs; each split keeps at least
    :data:`DECODE_MIN_TOKENS_PER_SPLIT` tokens of the longest possible context (at most
    ``_MAX_SPLITS`` splits, so the in-kernel merge stays cheap).
    """
    return decode_splits_for(num_reqs_padded, num_kv_heads, max_context_len, num_sms(device))


def decode_splits_for(num_reqs_padded: int, num_kv_heads: int, max_context_len: int, sms: int) -> int:
    """:func:`num_decode_splits` on a device of ``sms`` SMs (pure arithmetic: the engine's
    warm-up plans from it which split counts an eager decode launch can take)."""
    num_programs = num_reqs_padded * num_kv_heads
    target = DECODE_PROGRAMS_PER_SM * sms
    if num_programs >= target:
        return 1
    by_occupancy = -(-target // num_programs)
    by_length = max(1, max_context_len // DECODE_MIN_TOKENS_PER_SPLIT)
    return max(1, min(by_occupancy, by_length, _MAX_SPLITS))


def _check_attention_inputs(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    out: torch.Tensor,
) -> tuple[int, int, int, int]:
    if q.dim() != 3:
        raise ValueError(f"q must be [num_tokens_padded, num_heads, head_dim], got {tuple(q.shape)}")
    if out.shape != q.shape:
        raise ValueError(f"out must have q's shape {tuple(q.shape)}, got {tuple(out.shape)}")
    num_heads, head_dim = q.shape[1], q.shape[2]
    if kv_cache.dim() != 5:
        raise ValueError(f"kv_cache must be 5-d, got shape {tuple(kv_cache.shape)}")
    num_kv_heads = kv_cache.shape[3]
    check_kv_cache(kv_cache, num_kv_heads, head_dim)
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads}")
    num_reqs_padded = seq_lens.shape[0]
    if block_table.dim() != 2 or block_table.shape[0] != num_reqs_padded:
        raise ValueError(
            f"block_table must be [num_reqs_padded={num_reqs_padded}, max_num_blocks_per_req], "
            f"got {tuple(block_table.shape)}"
        )
    if block_table.stride(1) != 1:
        raise ValueError(
            f"block_table must be contiguous in its last dim, got strides {block_table.stride()}"
        )
    for name, t in (("q", q), ("out", out), ("kv_cache", kv_cache)):
        _check_last_dim_contiguous(name, t)
    return num_heads, num_kv_heads, head_dim, num_reqs_padded


# --------------------------------------------------------------------------------------
# Decode: flash-decoding over the paged cache, context splits merged in the same launch;
# optionally with the new token's rotary embedding and cache write folded in
# --------------------------------------------------------------------------------------


@triton.jit
def _load_act(ptrs, mask, bias_ptrs, part_stride, dtype, NUM_PARTS: tl.constexpr, HAS_BIAS: tl.constexpr):
    """Rows of q, k or v: as they are, or (``NUM_PARTS > 0``) merged from the qkv matmul's
    split-K fp32 partials as that matmul's own merge would: in split order from zero, plus its
    bias, rounded once to ``dtype`` (``pprun.layers.SplitPartials``)."""
    if NUM_PARTS == 0:
        x = tl.load(ptrs, mask=mask, other=0.0)
    else:
        total = 0.0 + tl.load(ptrs, mask=mask, other=0.0)
        for s in tl.static_range(1, NUM_PARTS):
            total += tl.load(ptrs + s * part_stride, mask=mask, other=0.0)
        if HAS_BIAS:
            total += tl.load(bias_ptrs, mask=mask, other=0.0).to(tl.float32)
        x = total.to(dtype)
    return x


@triton.jit
def _rope_row(x, partner, cos_row_ptr, sin_row_ptr, offs_d, HALF: tl.constexpr):
    """``x * cos + rotate_half(x) * sin`` for rows ``x`` (last dim at ``offs_d``; ``partner``
    holds each element's rotate_half partner), rounding each product and the sum to the
    activation dtype exactly as ``fused.rotary_qk`` does."""
    dtype = x.dtype
    d_mask = offs_d < 2 * HALF
    c = tl.load(cos_row_ptr + offs_d, mask=d_mask, other=0.0).to(dtype).to(tl.float32)
    s = tl.load(sin_row_ptr + offs_d, mask=d_mask, other=0.0).to(dtype).to(tl.float32)
    rot = tl.where(offs_d < HALF, -(partner.to(tl.float32)), partner.to(tl.float32))
    a = (x.to(tl.float32) * c).to(dtype)
    b = (rot * s).to(dtype)
    return (a.to(tl.float32) + b.to(tl.float32)).to(dtype)


@triton.jit
def _scores(q, k, scale_log2, DOT_F32: tl.constexpr):
    """``q @ k^T`` times ``scale_log2`` (fp32 operands in IEEE fp32 where ``DOT_F32``)."""
    if DOT_F32:
        qk = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        qk = tl.dot(q, tl.trans(k))
    return qk * scale_log2


@triton.jit
def _softmax_tile(q, k, visible, m_i, l_i, scale_log2, DOT_F32: tl.constexpr):
    """First half of one K/V tile of online softmax: the probabilities ``p`` of the ``visible``
    keys against the new running max, the rescale ``alpha`` of what came before, and the new
    (running max, sum)."""
    return _online_softmax(tl.where(visible, _scores(q, k, scale_log2, DOT_F32), float("-inf")), m_i, l_i)


@triton.jit
def _online_softmax(qk, m_i, l_i):
    """:func:`_softmax_tile` of scores ``qk`` already scaled (and masked, where keys are)."""
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit
def _accumulate_tile(acc, alpha, p, v, DOT_F32: tl.constexpr):
    """Second half: ``acc * alpha + p @ v``, ``p`` rounded to ``v``'s dtype first (in fp32 the
    product is then exact, as the low-precision path rounds it)."""
    if DOT_F32:
        pv = tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32), input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    return acc * alpha[:, None] + pv


@triton.jit
def _attend_tile(q, k, v, n_mask, m_i, l_i, acc, scale_log2, DOT_F32: tl.constexpr):
    """One K/V tile of online softmax over the keys in ``n_mask``: the updated (running max,
    sum, accumulator)."""
    p, alpha, m_i, l_i = _softmax_tile(q, k, n_mask[None, :], m_i, l_i, scale_log2, DOT_F32)
    return m_i, l_i, _accumulate_tile(acc, alpha, p, v, DOT_F32)


@triton.jit
def _kv_offsets(bt_row, n0, end, kv_head, d_mask, stride_c_blk, stride_c_off, stride_c_head,
                BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr):
    """Cache offsets of the K/V rows of positions ``[n0, n0 + BLOCK_N)`` through the block table
    row ``bt_row``; returns (positions, their mask at ``end``, offsets, the rows' load mask)."""
    n_pos = n0 + tl.arange(0, BLOCK_N)
    n_mask = n_pos < end
    blk = tl.load(bt_row + n_pos // PAGE_SIZE, mask=n_mask, other=0).to(tl.int64)
    kv_off = blk * stride_c_blk + (n_pos % PAGE_SIZE) * stride_c_off + kv_head * stride_c_head
    return n_pos, n_mask, kv_off, n_mask[:, None] & d_mask[None, :]


@triton.jit
def _kv_tile(k_cache_ptr, v_cache_ptr, bt_row, n0, end, kv_head, offs_d, d_mask,
             stride_c_blk, stride_c_off, stride_c_head, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr):
    """Load the K and V tile of cached positions ``[n0, n0 + BLOCK_N)`` (masked at ``end``)."""
    _, n_mask, kv_off, kv_mask = _kv_offsets(bt_row, n0, end, kv_head, d_mask, stride_c_blk, stride_c_off,
                                             stride_c_head, BLOCK_N, PAGE_SIZE)
    k_ptrs = k_cache_ptr + kv_off[:, None] + offs_d[None, :]
    v_ptrs = v_cache_ptr + kv_off[:, None] + offs_d[None, :]
    k = tl.load(k_ptrs, mask=kv_mask, other=0.0)
    v = tl.load(v_ptrs, mask=kv_mask, other=0.0)
    return k, v, n_mask


@triton.jit
def _merge_split(part_m_ptr, part_l_ptr, part_acc_ptr, rows, offs_d, g_mask, qd_mask, m_max, total, merged,
                 BLOCK_D: tl.constexpr):
    """Fold one split's partial (running max, sum, accumulator at ``rows``) into the merge."""
    # .cg: read from L2, where the other programs' stores landed.
    m_s = tl.load(part_m_ptr + rows, mask=g_mask, other=_NEG_BIG, cache_modifier=".cg")
    l_s = tl.load(part_l_ptr + rows, mask=g_mask, other=0.0, cache_modifier=".cg")
    a_s = tl.load(part_acc_ptr + rows[:, None] * BLOCK_D + offs_d[None, :], mask=qd_mask, other=0.0,
                  cache_modifier=".cg")
    m_next = tl.maximum(m_max, m_s)
    w_old = tl.exp2(m_max - m_next)
    w_s = tl.exp2(m_s - m_next)
    return m_next, total * w_old + l_s * w_s, merged * w_old[:, None] + a_s * w_s[:, None]


@triton.jit
def _decode_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    cos_ptr,
    sin_ptr,
    pos_ptr,
    slot_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_table_ptr,
    seq_lens_ptr,
    out_ptr,
    part_m_ptr,
    part_l_ptr,
    part_acc_ptr,
    counter_ptr,
    qkv_bias_ptr,
    qkv_part_stride,
    scale_log2,
    stride_q_tok,
    stride_q_head,
    stride_k_tok,
    stride_k_head,
    stride_v_tok,
    stride_v_head,
    stride_cos,
    stride_sin,
    stride_o_tok,
    stride_o_head,
    stride_bt_req,
    stride_c_blk,
    stride_c_off,
    stride_c_head,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,
    NEW_TOKEN: tl.constexpr,
    HAS_ROPE: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    DOT_F32: tl.constexpr,
    PRELOAD_KV: tl.constexpr,
    PRELOAD_SECOND: tl.constexpr,
    USE_PDL: tl.constexpr,
    QKV_PARTS: tl.constexpr,
    QKV_BIAS: tl.constexpr,
):
    # One program per (request, kv head, context split).  With QKV_PARTS q/k/v point into the
    # qkv matmul's fp32 split-K partials, merged here as they are read (_load_act).  With
    # NEW_TOKEN the request's new token (position seq_len - 1) is never read back from the cache:
    # the last split takes it from registers, and the same program writes it to the cache, so no
    # program races the write.  Without it the cache already holds every token (k/v/rotary/slot
    # unused).
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    if not NEW_TOKEN:
        # The cache was written by the kernel just before (PDL: wait before reading anything).
        pdl_sync(USE_PDL)
    # With NEW_TOKEN nothing read up to the wait below comes from a kernel of this step: the
    # step's metadata was copied in before its first kernel, and the cached tokens were written
    # by earlier steps (this step's token is never read back).  So they are read while the
    # kernel before (the qkv matmul) still runs.  This rests on every kernel of the step calling
    # pdl_sync (wait, then let the next one launch: when this one starts, every kernel before the
    # qkv matmul has finished) and on the metadata being written by the host; a kernel that lets
    # its successor launch before it waits, or metadata computed on the device within the step,
    # would break it (the CPU interpreter cannot tell).
    seq_len = tl.load(seq_lens_ptr + req)
    if NEW_TOKEN:
        cached = tl.maximum(seq_len - 1, 0)
    else:
        cached = seq_len
    split_len = tl.cdiv(tl.cdiv(cached, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, cached)
    # The splits holding cached tokens, and the last split, which takes the new token and
    # writes the output when no other does: a context shorter than the graph's longest leaves
    # the rest empty, and they neither compute nor take part in the merge.
    filled_splits = tl.cdiv(cached, tl.maximum(split_len, 1))
    merged_splits = filled_splits + (filled_splits < NUM_SPLITS).to(tl.int32)
    if NUM_SPLITS > 1:
        if (split >= filled_splits) & (split != NUM_SPLITS - 1):
            return

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + offs_g
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    qd_mask = g_mask[:, None] & d_mask[None, :]
    q_rows = q_ptr + req * stride_q_tok + heads[:, None] * stride_q_head
    k_row = k_ptr + req * stride_k_tok + kv_head * stride_k_head
    bt_row = block_table_ptr + req * stride_bt_req
    if PRELOAD_KV:
        # The first tile of this split's cached tokens, in flight across the wait.
        k0, v0, n_mask0 = _kv_tile(k_cache_ptr, v_cache_ptr, bt_row, start, end, kv_head, offs_d, d_mask,
                                   stride_c_blk, stride_c_off, stride_c_head, BLOCK_N, PAGE_SIZE)
        if PRELOAD_SECOND:
            # (past ``end`` it is all masked, which attends to nothing: an exact no-op)
            k1, v1, n_mask1 = _kv_tile(k_cache_ptr, v_cache_ptr, bt_row, start + BLOCK_N, end, kv_head, offs_d,
                                       d_mask, stride_c_blk, stride_c_off, stride_c_head, BLOCK_N, PAGE_SIZE)
    if HAS_ROPE:
        partner = tl.where(offs_d < HALF, offs_d + HALF, offs_d - HALF)
        pos = tl.load(pos_ptr + req).to(tl.int64)
        cos_row = cos_ptr + pos * stride_cos
        sin_row = sin_ptr + pos * stride_sin
    if NEW_TOKEN:
        slot = tl.load(slot_ptr + req).to(tl.int64)
        # q/k/v come from the kernel just before.
        pdl_sync(USE_PDL)
    act = out_ptr.dtype.element_ty
    q_bias = qkv_bias_ptr + heads[:, None] * HEAD_DIM
    q = _load_act(q_rows + offs_d[None, :], qd_mask, q_bias + offs_d[None, :], qkv_part_stride, act,
                  QKV_PARTS, QKV_BIAS)
    if HAS_ROPE:
        q_partner = _load_act(q_rows + partner[None, :], qd_mask, q_bias + partner[None, :], qkv_part_stride, act,
                              QKV_PARTS, QKV_BIAS)
        q = _rope_row(q, q_partner, cos_row, sin_row, offs_d, HALF)

    m_i = tl.full([BLOCK_G], _NEG_BIG, tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    if NEW_TOKEN:
        if (split == NUM_SPLITS - 1) & (seq_len > 0):
            # The new token first: its loads do not wait behind the cache loop.  The running
            # max starts at its score, so its weight is exactly 1 until rescaled.
            k_bias = qkv_bias_ptr + (NUM_HEADS + kv_head) * HEAD_DIM
            v_bias = qkv_bias_ptr + (NUM_HEADS + NUM_KV_HEADS + kv_head) * HEAD_DIM
            k_new = _load_act(k_row + offs_d, d_mask, k_bias + offs_d, qkv_part_stride, act, QKV_PARTS, QKV_BIAS)
            if HAS_ROPE:
                k_partner = _load_act(k_row + partner, d_mask, k_bias + partner, qkv_part_stride, act, QKV_PARTS,
                                      QKV_BIAS)
                k_new = _rope_row(k_new, k_partner, cos_row, sin_row, offs_d, HALF)
            v_new = _load_act(v_ptr + req * stride_v_tok + kv_head * stride_v_head + offs_d, d_mask, v_bias + offs_d,
                              qkv_part_stride, act, QKV_PARTS, QKV_BIAS)
            if slot >= 0:
                dst = (slot // PAGE_SIZE) * stride_c_blk + (slot % PAGE_SIZE) * stride_c_off + kv_head * stride_c_head
                tl.store(k_cache_ptr + dst + offs_d, k_new.to(k_cache_ptr.dtype.element_ty), mask=d_mask)
                tl.store(v_cache_ptr + dst + offs_d, v_new.to(v_cache_ptr.dtype.element_ty), mask=d_mask)
            # The cache's dtype is what the other tokens are multiplied in.
            k_new = k_new.to(k_cache_ptr.dtype.element_ty).to(tl.float32)
            v_new = v_new.to(v_cache_ptr.dtype.element_ty).to(tl.float32)
            m_i = tl.sum(q.to(tl.float32) * k_new[None, :], 1) * scale_log2
            l_i = tl.full([BLOCK_G], 1.0, tl.float32)
            acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32) + v_new[None, :]
    first = start
    if PRELOAD_KV:
        m_i, l_i, acc = _attend_tile(q, k0, v0, n_mask0, m_i, l_i, acc, scale_log2, DOT_F32)
        first = start + BLOCK_N
        if PRELOAD_SECOND:
            m_i, l_i, acc = _attend_tile(q, k1, v1, n_mask1, m_i, l_i, acc, scale_log2, DOT_F32)
            first = start + 2 * BLOCK_N
    for n0 in range(first, end, BLOCK_N):
        k, v, n_mask = _kv_tile(k_cache_ptr, v_cache_ptr, bt_row, n0, end, kv_head, offs_d, d_mask,
                                stride_c_blk, stride_c_off, stride_c_head, BLOCK_N, PAGE_SIZE)
        m_i, l_i, acc = _attend_tile(q, k, v, n_mask, m_i, l_i, acc, scale_log2, DOT_F32)

    out_rows = out_ptr + req * stride_o_tok + heads[:, None] * stride_o_head + offs_d[None, :]
    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_rows, out.to(out_ptr.dtype.element_ty), mask=qd_mask)
    else:
        # Partials laid out [num_reqs_padded, num_heads, NUM_SPLITS(, BLOCK_D)]; the last
        # program of this (request, kv head) to finish merges them (no second launch).
        row = (req * NUM_HEADS + heads) * NUM_SPLITS + split
        tl.store(part_m_ptr + row, m_i, mask=g_mask)
        tl.store(part_l_ptr + row, l_i, mask=g_mask)
        tl.store(part_acc_ptr + row[:, None] * BLOCK_D + offs_d[None, :], acc, mask=qd_mask)
        # Every thread's stores are issued before the release below.
        tl.debug_barrier()
        counter = counter_ptr + req * NUM_KV_HEADS + kv_head
        done = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
        if done == merged_splits - 1:
            m_max = tl.full([BLOCK_G], _NEG_BIG, tl.float32)
            total = tl.zeros([BLOCK_G], tl.float32)
            merged = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
            base = (req * NUM_HEADS + heads) * NUM_SPLITS
            # Unrolled: the partials' loads are all issued before the first is used (a loop
            # measures the same within noise; docs/performance.md, "Launch settings").
            for s in tl.static_range(NUM_SPLITS):
                # An empty split's masked loads stand for the empty partial it would have written
                # (max -big, sum 0): the same result, bit for bit.
                merged_s = (s < filled_splits) | (s == NUM_SPLITS - 1)
                m_max, total, merged = _merge_split(part_m_ptr, part_l_ptr, part_acc_ptr, base + s, offs_d,
                                                    g_mask & merged_s, qd_mask & merged_s, m_max, total, merged,
                                                    BLOCK_D)
            out = merged / tl.where(total > 0, total, 1.0)[:, None]
            tl.store(out_rows, out.to(out_ptr.dtype.element_ty), mask=qd_mask)
            # Ready for the next launch (and the next graph replay).
            tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")


def preload_second(num_splits: int) -> bool:
    """Whether a decode launch with ``num_splits`` splits loads each split's second K/V tile
    before its PDL wait (see :data:`DECODE_PRELOAD_SECOND`)."""
    return DECODE_PRELOAD_KV and DECODE_PRELOAD_SECOND and num_splits <= DECODE_PRELOAD_SECOND_MAX_SPLITS


def _launch_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    num_reqs_padded: int,
    new_token: tuple[torch.Tensor, ...] | None = None,
    qkv_parts: SplitPartials | None = None,
) -> torch.Tensor:
    """Launch :func:`_decode_kernel` over ``min(q rows, num_reqs_padded)`` rows (inputs checked
    by the caller); ``new_token`` is ``(k, v, cos, sin, positions, slot_mapping)`` (cos/sin may
    be None) or None when the cache already holds every token; ``qkv_parts`` the partials that
    ``q``/``k``/``v`` are views of (with a new token only).  Token rows past the request rows
    are zeroed."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads, page_size = kv_cache.shape[3], kv_cache.shape[2]
    num_rows_padded = min(q.shape[0], num_reqs_padded)
    if num_rows_padded < q.shape[0]:
        out[num_rows_padded:].zero_()
    if num_rows_padded == 0:
        return out
    block_d = triton.next_power_of_2(head_dim)
    num_splits = num_decode_splits(num_rows_padded, num_kv_heads, block_table.shape[1] * page_size, q.device)
    if num_splits > 1:
        counter = arrival_counters(q.device, num_rows_padded * num_kv_heads)
        part_m = torch.empty(num_rows_padded * num_heads * num_splits, dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty(part_m.shape[0], block_d, dtype=torch.float32, device=q.device)
    else:
        part_m = part_l = part_acc = counter = out  # unused by the kernel when NUM_SPLITS == 1
    # Placeholders (never read) for what a launch without a new token or rotary lacks.
    k, v, cos, sin, positions, slot_mapping = new_token or (q, q, None, None, seq_lens, seq_lens)
    has_rope = cos is not None
    cos, sin = (cos, sin) if has_rope else (q, q)
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    num_parts = qkv_parts.parts.shape[0] if qkv_parts is not None else 0
    qkv_bias = qkv_parts.bias if qkv_parts is not None else None
    _decode_kernel[(num_rows_padded, num_kv_heads, num_splits)](
        q,
        k,
        v,
        cos,
        sin,
        positions,
        slot_mapping,
        k_cache,
        v_cache,
        block_table,
        seq_lens,
        out,
        part_m,
        part_l,
        part_acc,
        counter,
        qkv_bias if qkv_bias is not None else q,
        qkv_parts.parts.stride(0) if qkv_parts is not None else 0,
        scale * LOG2_E,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        cos.stride(0),
        sin.stride(0),
        out.stride(0),
        out.stride(1),
        block_table.stride(0),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        GROUP=num_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        HALF=head_dim // 2,
        NEW_TOKEN=new_token is not None,
        HAS_ROPE=has_rope,
        # tl.dot needs M >= 16; the padded group rows are masked out.
        BLOCK_G=max(16, triton.next_power_of_2(num_heads // num_kv_heads)),
        BLOCK_D=block_d,
        BLOCK_N=max(_DECODE_BLOCK_N, page_size),
        PAGE_SIZE=page_size,
        NUM_SPLITS=num_splits,
        DOT_F32=_dot_in_fp32(out.dtype),
        PRELOAD_KV=DECODE_PRELOAD_KV,
        PRELOAD_SECOND=preload_second(num_splits),
        QKV_PARTS=num_parts,
        QKV_BIAS=qkv_bias is not None,
        num_warps=_DECODE_NUM_WARPS,
        num_stages=_DECODE_NUM_STAGES,
        **(_NO_FMA if has_rope else {}),
        **pdl_options(q.device),
    )
    return out


def paged_decode_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor,
) -> torch.Tensor:
    """Attention for one query token per request over the paged cache, written into ``out``.

    Args:
        q: ``[num_reqs_padded, num_heads, head_dim]``; row ``r`` is request ``r``'s token.
        kv_cache: ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` (already holding
            this step's K/V).
        block_table: ``[num_reqs_padded, max_num_blocks_per_req]`` int32.
        seq_lens: ``[num_reqs_padded]`` int32 context lengths (0 for padded rows, which get
            zeros).
        scale: softmax scale.
        out: like ``q``; returned.
    """
    _, _, _, num_reqs_padded = _check_attention_inputs(q, kv_cache, block_table, seq_lens, out)
    if q.shape[0] != num_reqs_padded:
        raise ValueError(
            f"decode q must have one row per request: q.shape[0]={q.shape[0]}, "
            f"num_reqs_padded={num_reqs_padded}"
        )
    return _launch_decode(q, kv_cache, block_table, seq_lens, scale, out, num_reqs_padded)


def paged_decode_attention_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    positions: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    qkv_parts: SplitPartials | None = None,
) -> torch.Tensor:
    """A decode step's attention in one launch: rotary on q and k, the new K/V written to the
    cache, flash-decoding over the cache, and the context splits merged in the same kernel.

    ``qkv_parts``: the qkv matmul left its split-K partials unmerged
    (``skinny_linear(..., defer_merge="attention")``); ``q``/``k``/``v`` are then float32 views of
    ``qkv_parts.parts[0]`` (split as the merged output would be), merged with the bias as they
    are read and rounded to ``out``'s dtype, the activations' (bit for bit what the matmul's own
    merge writes).

    Equals ``rotary_qk`` then :func:`paged_attention` with ``max_query_len == 1`` (rounding
    aside: the new token's score is summed outside the tile dot).  ``q``/``k``/``v`` are the
    un-rotated ``[num_tokens_padded, heads, head_dim]`` views of the qkv projection (left
    unchanged); ``cos``/``sin`` the fp32 ``[max_positions, head_dim]`` tables, or both
    ``None`` for a model without rotary embeddings; ``positions``, ``slot_mapping``
    ``[num_tokens_padded]``.  Token ``r`` is request ``r``'s; padded requests (seq_len 0)
    write nothing and get zeros, as do token rows past the requests.  Returns ``out``.
    """
    num_heads, num_kv_heads, head_dim, num_reqs_padded = _check_attention_inputs(
        q, kv_cache, block_table, seq_lens, out
    )
    num_tokens_padded = q.shape[0]
    if k.shape != (num_tokens_padded, num_kv_heads, head_dim) or v.shape != k.shape:
        raise ValueError(
            f"k and v must be [{num_tokens_padded}, {num_kv_heads}, {head_dim}], "
            f"got k={tuple(k.shape)} v={tuple(v.shape)}"
        )
    if qkv_parts is not None:
        parts = qkv_parts.parts
        if parts.dim() != 3 or parts.dtype != torch.float32 or out.dtype != qkv_parts.dtype:
            raise ValueError(
                f"qkv_parts must hold float32 [splits, tokens, q+k+v] partials of out's dtype {out.dtype}, "
                f"got {parts.dtype} {tuple(parts.shape)} of {qkv_parts.dtype}"
            )
        width = (num_heads + 2 * num_kv_heads) * head_dim
        if parts.shape[1:] != (num_tokens_padded, width) or not parts.is_contiguous():
            raise ValueError(
                f"qkv_parts.parts must be a contiguous [splits, {num_tokens_padded}, {width}] tensor "
                f"(q, k, v side by side), got shape {tuple(parts.shape)}, strides {parts.stride()}"
            )
        base = parts[0].data_ptr()
        columns = {"q": 0, "k": num_heads * head_dim, "v": (num_heads + num_kv_heads) * head_dim}
        for name, t in (("q", q), ("k", k), ("v", v)):
            if t.dtype != torch.float32 or t.data_ptr() != base + columns[name] * 4 or t.stride(0) != width:
                raise ValueError(
                    f"with qkv_parts, {name} must be the float32 view of qkv_parts.parts[0] at column "
                    f"{columns[name]} (q, k, v side by side)"
                )
        bias = qkv_parts.bias
        if bias is not None and (bias.shape != (width,) or bias.stride(0) != 1 or bias.device != parts.device):
            raise ValueError(f"qkv_parts.bias must be a contiguous ({width},) tensor on {parts.device}, got "
                             f"shape {tuple(bias.shape)}, strides {bias.stride()} on {bias.device}")
    else:
        for name, t in (("k", k), ("v", v), ("out", out)):
            if t.dtype != q.dtype:
                raise ValueError(f"{name} must have q's dtype {q.dtype}, got {t.dtype}")
    for name, t in (("positions", positions), ("slot_mapping", slot_mapping)):
        if t.shape != (num_tokens_padded,):
            raise ValueError(f"{name} must have shape ({num_tokens_padded},), got {tuple(t.shape)}")
        if t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be int32 or int64, got {t.dtype}")
    has_rope = cos is not None
    if has_rope != (sin is not None):
        raise ValueError("cos and sin must be given together (or both None: no rotary)")
    if has_rope:
        if head_dim % 2:
            raise ValueError(f"head_dim must be even for rotate_half, got {head_dim}")
        for name, table in (("cos", cos), ("sin", sin)):
            if table.dim() != 2 or table.shape[1] != head_dim or table.stride(1) != 1:
                raise ValueError(
                    f"{name} must be a [max_positions, {head_dim}] table contiguous in its "
                    f"last dim, got shape {tuple(table.shape)} with strides {table.stride()}"
                )
    for name, t in (("k", k), ("v", v)):
        _check_last_dim_contiguous(name, t)
    return _launch_decode(
        q, kv_cache, block_table, seq_lens, scale, out, num_reqs_padded,
        new_token=(k, v, cos, sin, positions, slot_mapping), qkv_parts=qkv_parts,
    )


# --------------------------------------------------------------------------------------
# Prefill / mixed batches: varlen causal flash attention over the paged cache
# --------------------------------------------------------------------------------------


@triton.jit
def _prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    block_table_ptr,
    out_ptr,
    scale_log2,
    stride_q_tok,
    stride_q_head,
    stride_o_tok,
    stride_o_head,
    stride_bt_req,
    stride_c_blk,
    stride_c_off,
    stride_c_head,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    DOT_F32: tl.constexpr,
    SPLIT_DIAGONAL: tl.constexpr,
):
    req = tl.program_id(0)
    head = tl.program_id(1)
    m_block = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + req)
    query_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    if m_block * BLOCK_M >= query_len:
        return
    seq_len = tl.load(seq_lens_ptr + req)
    context_len = seq_len - query_len  # tokens cached before this chunk
    kv_head = head // GROUP

    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_mask = offs_m < query_len
    d_mask = offs_d < HEAD_DIM
    q_rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(
        q_ptr + q_rows[:, None] * stride_q_tok + head * stride_q_head + offs_d[None, :],
        mask=m_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    # Absolute position of each query row; row i sees keys at positions <= q_pos[i].
    q_pos = context_len + offs_m

    m_i = tl.full([BLOCK_M], _NEG_BIG, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    bt_row = block_table_ptr + req * stride_bt_req
    # Keys past the last row of this query block are masked for every row: skip them.
    end = tl.minimum(seq_len, context_len + (m_block + 1) * BLOCK_M)
    start = 0
    if SPLIT_DIAGONAL:
        # Keys before the block's first row are visible to every row: whole tiles of them need
        # neither the causal mask nor bounds on their K/V loads; only the tiles that reach the
        # diagonal do.
        start = (context_len + m_block * BLOCK_M) // BLOCK_N * BLOCK_N
        for n0 in range(0, start, BLOCK_N):
            _, _, kv_off, _ = _kv_offsets(bt_row, n0, start, kv_head, d_mask, stride_c_blk, stride_c_off,
                                          stride_c_head, BLOCK_N, PAGE_SIZE)
            k = tl.load(k_cache_ptr + kv_off[:, None] + offs_d[None, :], mask=d_mask[None, :], other=0.0)
            p, alpha, m_i, l_i = _online_softmax(_scores(q, k, scale_log2, DOT_F32), m_i, l_i)
            v = tl.load(v_cache_ptr + kv_off[:, None] + offs_d[None, :], mask=d_mask[None, :], other=0.0)
            acc = _accumulate_tile(acc, alpha, p, v, DOT_F32)
    for n0 in range(start, end, BLOCK_N):
        pos, n_mask, kv_off, kv_mask = _kv_offsets(bt_row, n0, end, kv_head, d_mask, stride_c_blk, stride_c_off,
                                                   stride_c_head, BLOCK_N, PAGE_SIZE)
        k = tl.load(k_cache_ptr + kv_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        visible = n_mask[None, :] & (pos[None, :] <= q_pos[:, None])
        p, alpha, m_i, l_i = _softmax_tile(q, k, visible, m_i, l_i, scale_log2, DOT_F32)
        # V loaded after the softmax, the order docs/performance.md's prefill rate is measured in.
        v = tl.load(v_cache_ptr + kv_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        acc = _accumulate_tile(acc, alpha, p, v, DOT_F32)

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(
        out_ptr + q_rows[:, None] * stride_o_tok + head * stride_o_head + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=m_mask[:, None] & d_mask[None, :],
    )


PREFILL_BLOCK_M = 128
"""Query rows per prefill program for heads wider than 64, with 16-bit activations on Hopper or
later (64 otherwise: :func:`_prefill_config`).  On the H200, 32 prompts of 512 in
8,192-token steps (``python scripts/gpu_speed.py /tmp/q8b --no-decode --ab --ab-prefill
--prefill-shape 512,32,8192 --prefill-trace --ab-only PREFILL_BLOCK_M=64+PREFILL_SPLIT_DIAGONAL=False``):
the kernel takes 18.4 ms over Qwen3-8B's 72 layer-steps with 128 rows and the diagonal apart,
21.0 ms with 64 rows and every tile masked."""
PREFILL_NUM_STAGES = 2
"""Pipeline stages of the prefill kernel's K/V tiles for heads wider than 64 (3 measured no
faster: 18.2 against 18.4 ms above)."""
PREFILL_SPLIT_DIAGONAL = True
"""The prefill kernel walks the K/V tiles every query row of its block sees without the causal
mask and bounds, and masks only the tiles that reach the diagonal."""


@functools.cache
def _hopper_or_later(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device)[0] >= 9


def _prefill_config(head_dim: int, dtype: torch.dtype, device: torch.device) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for the prefill kernel.  :data:`PREFILL_BLOCK_M`
    rows where they were measured (16-bit activations on Hopper; any under the interpreter); 64
    elsewhere, whose tiles fit GPUs with less shared memory per block and fp32's wider tiles."""
    if head_dim <= 64:
        return 64, 64, 4, 3
    wide = _INTERPRETED or (dtype in (torch.bfloat16, torch.float16) and _hopper_or_later(device))
    return (PREFILL_BLOCK_M if wide else 64), 64, 8, PREFILL_NUM_STAGES


def paged_prefill_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    max_query_len: int,
) -> torch.Tensor:
    """Varlen causal attention over the paged cache (chunked prefill, mixed batches).

    Request ``r`` owns query rows ``query_start_loc[r]:query_start_loc[r + 1]``, which are
    the last ``qlen`` positions of its ``seq_lens[r]``-token context (the cache already
    holds them).  Rows of tokens that belong to no request are zeroed.

    Args:
        q: ``[num_tokens_padded, num_heads, head_dim]``.
        kv_cache: ``[2, num_blocks, block_size, num_kv_heads, head_dim]``.
        query_start_loc: ``[num_reqs_padded + 1]`` int32.
        seq_lens: ``[num_reqs_padded]`` int32.
        block_table: ``[num_reqs_padded, max_num_blocks_per_req]`` int32.
        scale: softmax scale.
        out: like ``q``; returned.
        max_query_len: an upper bound on every request's query length (sizes the grid).
    """
    num_heads, num_kv_heads, head_dim, num_reqs_padded = _check_attention_inputs(
        q, kv_cache, block_table, seq_lens, out
    )
    if query_start_loc.shape != (num_reqs_padded + 1,):
        raise ValueError(
            f"query_start_loc must have shape ({num_reqs_padded + 1},), got {tuple(query_start_loc.shape)}"
        )
    if max_query_len < 1:
        raise ValueError(f"max_query_len must be >= 1, got {max_query_len}")
    # Padded tokens are owned by no program; zeroing first keeps the output defined
    # without reading query_start_loc on the host (capture-safe; cheap next to prefill).
    out.zero_()
    if num_reqs_padded == 0:
        return out
    block_m, block_n, num_warps, num_stages = _prefill_config(head_dim, q.dtype, q.device)
    page_size = kv_cache.shape[2]
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    grid = (num_reqs_padded, num_heads, triton.cdiv(max_query_len, block_m))
    _prefill_kernel[grid](
        q,
        k_cache,
        v_cache,
        query_start_loc,
        seq_lens,
        block_table,
        out,
        scale * LOG2_E,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        block_table.stride(0),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        GROUP=num_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_M=block_m,
        BLOCK_N=max(block_n, page_size),
        BLOCK_D=triton.next_power_of_2(head_dim),
        PAGE_SIZE=page_size,
        DOT_F32=_dot_in_fp32(q.dtype),
        SPLIT_DIAGONAL=PREFILL_SPLIT_DIAGONAL,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    max_query_len: int,
    num_leading_decodes: int = 0,
) -> torch.Tensor:
    """Write this step's K/V into the cache, then attend: decode kernel when every request
    has one query token (``max_query_len == 1``), else the varlen prefill kernel.

    Shapes are those of :func:`paged_prefill_attention`; ``k``/``v`` are
    ``[num_tokens_padded, num_kv_heads, head_dim]`` and ``slot_mapping`` is
    ``[num_tokens_padded]`` int64 with -1 for padded tokens.  ``num_leading_decodes`` (a mixed
    step): the first requests have one query token each, token ``r`` request ``r``; they go to
    the decode kernel (one program per KV head reads its K/V once for the whole query group) and
    the rest to the prefill kernel.  Returns ``out``.
    """
    reshape_and_cache(k, v, kv_cache, slot_mapping)
    if max_query_len != 1:
        num_reqs_padded = seq_lens.shape[0]
        n = num_leading_decodes
        if not 0 <= n < num_reqs_padded or n > q.shape[0]:
            raise ValueError(f"num_leading_decodes must be in [0, {min(num_reqs_padded - 1, q.shape[0])}] for "
                             f"{num_reqs_padded} request rows and {q.shape[0]} tokens, got {n}")
        # The prefill kernel zeroes every row first, then writes its requests' rows.
        paged_prefill_attention(
            q, kv_cache, query_start_loc[n:], seq_lens[n:], block_table[n:], scale, out, max_query_len
        )
        if n:
            paged_decode_attention(q[:n], kv_cache, block_table[:n], seq_lens[:n], scale, out[:n])
        return out
    # With one token per request, token r is request r's (padded requests have qlen 0
    # and seq_len 0, so their rows come out zero).  The token and request paddings may
    # differ; both are shapes, so the slicing stays capture-safe.
    num_rows = min(q.shape[0], seq_lens.shape[0])
    paged_decode_attention(
        q[:num_rows],
        kv_cache,
        block_table[:num_rows],
        seq_lens[:num_rows],
        scale,
        out[:num_rows],
    )
    if out.shape[0] > num_rows:
        out[num_rows:].zero_()
    return out
