"""Matmuls for decode-sized batches (a few rows of activations against a large weight).

At decode a linear layer reads its whole weight to produce a handful of rows: the work is a
matrix-vector product bound by memory bandwidth, and a library GEMM tiled for large M leaves
SMs idle on the small weights.  At one row these kernels use narrow column tiles (and split K
when it is long) so that every SM streams.  From two rows on the tile product is a tensor-core
dot in the swapped form: 64 weight rows as the MMA's M side and the activation rows (padded to
16-64) as its N side, which Hopper's wgmma accepts (with the activations as the M side, 32 rows
are too few for it).  Up to :data:`DISPATCH_MAX_M` rows both forms are faster than cuBLAS on
the model shapes measured, or equal (docs/performance.md, "Launch settings").

- ``out = x @ weight.T (+ bias)`` for ``x [M, K]`` with ``M <= MAX_M``;
- optional SwiGLU epilogue: with ``weight = [gate; up]`` (``2 * inter`` rows) the kernel
  returns ``silu(x @ gate.T) * (x @ up.T)`` directly, ``[M, inter]`` — the ``silu_and_mul``
  launch and the ``gate_up`` round trip through memory disappear;
- split-K partial sums are merged **inside the same launch**, in a fixed order, by the last
  program of each column block to finish (a per-block arrival counter that the merging
  program resets): deterministic, no second launch, no atomics on the data;
- optional RMSNorm prologue at one row (:func:`skinny_norm_linear`): the residual add and
  RMSNorm that precede qkv and gate_up run inside the matmul launch, so the standalone
  ``fused.fused_add_rms_norm`` launch disappears;
- capture-safe (grids from shapes, scratch from ``torch.empty``, counters persistent).

Rounding follows the torch path: fp32 accumulation, one rounding of the (biased) sum to the
activation dtype; the SwiGLU epilogue rounds gate and up first, then as ``fused.silu_and_mul``;
the norm prologue rounds as ``fused._add_rms_norm_kernel`` does, step by step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pprun.kernels.grid import arrival_counters
from pprun.kernels.partials import SplitPartials, check_defer_merge
from pprun.kernels.triton_utils import INTERPRETED as _INTERPRETED
from pprun.kernels.triton_utils import pdl_options, pdl_sync
from pprun.layers.fp8_linear import BLOCK as SCALE_BLOCK
from pprun.layers.fp8_linear import FP8_DTYPE as FP8_WEIGHT_DTYPE
from pprun.layers.fused import silu_mul

MAX_M = 64
"""Largest row count these kernels accept."""

DISPATCH_MAX_M = 32
"""Largest row count ``pprun.layers.linear`` sends here (more go to cuBLAS): up to 32 rows these
kernels are faster than cuBLAS on every 1.1B shape, or equal; at 64 rows cuBLAS is faster on qkv
and o_proj and within a few percent on the rest, so it takes them (docs/performance.md, "Launch
settings")."""


FP8_BLOCK_DISPATCH_MAX_M = 1
"""Largest row count ``pprun.layers.linear`` sends here for an ``Fp8Linear`` with 128x128 block
scales; more rows take cuBLAS's block-scaled FP8 matmul.  At one row these kernels take 0.51-0.70
of the bf16 kernels' time on Qwen3-8B's layers and beat cuBLAS's FP8 matmul by 1.2-1.8x; from two
rows the swapped form on float8 weights (upcast from shared memory before the MMA) is no faster
than on bf16, and cuBLAS's block-scaled FP8 matmul is faster (docs/quantization.md).  Per-row
scales keep :data:`DISPATCH_MAX_M`: there the swapped form beats cuBLAS's rowwise FP8 matmul at
2-8 rows and equals it at 32."""

WEIGHTS_AHEAD_ENABLED = True
"""Whether a matmul whose caller asks for it (``weights_ahead``: the kernel before it leaves the
memory bandwidth idle, as decode attention does before ``o_proj``) loads its whole weight slice
before its PDL wait, at one row and up to :data:`WEIGHTS_AHEAD_MAX_ROWS`; ``scripts/gpu_speed.py
--ab`` flips it."""
SWAPPED_NUM_STAGES = 4
"""Pipeline stages of the swapped form, one fewer with ``hold_last`` (``scripts/gpu_speed.py
--ab`` may change it)."""

HOLD_LAST_ENABLED = True
"""Whether the swapped form (2 to 32 rows) loads each program's last weight tile before its PDL
wait (``SkinnyConfig.hold_last``), so that those bytes stream while the kernel before drains.
The held tile takes one pipeline stage's shared memory (24 KiB at 32 rows), so the loop gets
one stage fewer and the kernel the same 96 KiB.  Used by o_proj, down and the LM head; not by
gate_up (SwiGLU: no gain) nor by a caller that passes ``hold_last=False`` (qkv, whose decode
attention after it preloads its own K/V, which a held tile competes with: qkv and attention
together are slower with it).  It shortens o_proj and down by more than it lengthens the norms
after them (docs/performance.md, "Launch settings"); ``scripts/gpu_speed.py --ab`` flips it."""
WEIGHTS_AHEAD_MAX_K = 4096
"""Longest K a program of the one-row weights-ahead form holds in registers (8 rows x K)."""

WEIGHTS_AHEAD_MAX_ROWS = 1
"""Most rows that take the weights-ahead form; from two rows it is the swapped form with each
program's 64 x 256 weight slice held across the wait.  At batch 32 the attention before it is
long enough to use the bandwidth itself, and the preloads slow it by more than o_proj gains
(docs/performance.md, "Launch settings"), so one row only."""

SWAPPED_TARGET_PROGRAMS = 128
"""Above one row, K is split until about this many programs run: the fastest setting, or
within 2% of it, for each matmul timed alone at 16 and 32 rows.  More splits lengthen the
in-launch merge by more than they shorten the streaming (gate_up most; docs/performance.md,
"Launch settings")."""

DEFERRED_TARGET_PROGRAMS = 256
"""The same for a matmul whose partials a norm merges (``defer_merge="norm"``), where more
splits cost that kernel a few more loads per row instead of this one a longer merge: o_proj
and down at batch 32 split 8 ways instead of 4, faster than 192 or 128 programs.  Partials that
the decode attention merges (``"attention"``, qkv) keep :data:`SWAPPED_TARGET_PROGRAMS` (2 splits
at batch 32): every program of a (request, KV head) merges its q/k/v rows again, so more splits
lengthen the attention by more than they shorten qkv (docs/performance.md, "Launch
settings")."""


@triton.jit
def _tile_product(x, w, USE_DOT: tl.constexpr, DOT_F32: tl.constexpr):
    """``x [BLOCK_M, BLOCK_K] @ w[BLOCK_N, BLOCK_K].T`` in fp32 (one return: Triton compiles
    every statement after a constexpr-if ``return``)."""
    if USE_DOT:
        if DOT_F32:
            p = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
        else:
            p = tl.dot(x, tl.trans(w.to(x.dtype)))
    else:
        # One row: a multiply and a row sum beat a padded 16-row dot.
        p = tl.sum(x.to(tl.float32) * w.to(tl.float32), 1)[None, :]
    return p


@triton.jit
def _swapped_product(x, w, DOT_F32: tl.constexpr):
    """``(x [BLOCK_M, BLOCK_K] @ w[BLOCK_N, BLOCK_K].T).T`` in fp32: the weight tile is the
    MMA's M side (64+ rows, what Hopper's wgmma needs) and the few activation rows its N side."""
    if DOT_F32:
        p = tl.dot(w.to(tl.float32), tl.trans(x.to(tl.float32)), input_precision="ieee")
    else:
        p = tl.dot(w.to(x.dtype), tl.trans(x))  # float8 weights upcast in registers (exact)
    return p


@triton.jit
def _product(x, w, ws_row, offs_k, k_mask, k0, USE_DOT: tl.constexpr, SWAP_AB: tl.constexpr,
             DOT_F32: tl.constexpr, W_SCALE: tl.constexpr, SCALE_BLOCK: tl.constexpr):
    """One K tile's product (transposed with ``SWAP_AB``) in fp32.  With block scales
    (``W_SCALE == 2``) the tile's rows lie in one row block, whose scales start at ``ws_row``: at
    one row the activations are multiplied by each column's block scale before the row sum (any
    ``BLOCK_K``); a dot's tile lies in one block (``BLOCK_K`` divides ``SCALE_BLOCK``) and its
    product is multiplied by that block's scale."""
    if W_SCALE == 2 and not USE_DOT:
        x = x.to(tl.float32) * tl.load(ws_row + offs_k // SCALE_BLOCK, mask=k_mask, other=0.0)[None, :]
    if SWAP_AB:
        p = _swapped_product(x, w, DOT_F32)
    else:
        p = _tile_product(x, w, USE_DOT, DOT_F32)
    if W_SCALE == 2 and USE_DOT:
        p = p * tl.load(ws_row + k0 // SCALE_BLOCK)
    return p


@triton.jit
def _epilogue(acc, acc_up, bias_ptr, offs_n, n_mask, N_OUT, dtype, HAS_BIAS: tl.constexpr,
              SWIGLU: tl.constexpr, PRECISE_EXP: tl.constexpr):
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        if SWIGLU:
            acc_up += tl.load(bias_ptr + N_OUT + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    y = acc.to(dtype)
    if SWIGLU:
        # As torch: gate and up rounded to the activation dtype, then F.silu(gate) * up.
        y = silu_mul(y, acc_up.to(dtype), PRECISE_EXP)
    return y


@triton.jit
def _mul_rn(a, b, EXACT: tl.constexpr):
    """``a * b`` in fp32 that the compiler may not contract into an FMA with a following add:
    ``fused`` compiles without contraction, this kernel keeps it for the matmul.  PTX's
    ``mul.rn`` is never contracted (libdevice's ``mul_rn`` would also flush denormals)."""
    if EXACT:
        p = tl.inline_asm_elementwise(
            "mul.rn.f32 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.float32, is_pure=True, pack=1
        )
    else:  # the interpreter (no inline PTX) never contracts
        p = a * b
    return p


@triton.jit
def _norm_row_rstd(x_ptr, res_ptr, res_out_ptr, K, inv_hidden, eps, write_residual,
                   HAS_RESIDUAL: tl.constexpr, BLOCK_ROW: tl.constexpr, EXACT_MUL: tl.constexpr):
    """``rsqrt(mean(h * h) + eps)`` for ``h = x (+ residual)`` of the one row, with the rounding
    steps of ``fused._add_rms_norm_kernel``; stores the rounded sum to ``res_out`` where
    ``write_residual`` (one program of the grid)."""
    offs = tl.arange(0, BLOCK_ROW)
    mask = offs < K
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + offs, x, mask=mask & write_residual)
    h = x.to(tl.float32)
    var = _mul_rn(tl.sum(_mul_rn(h, h, EXACT_MUL), axis=0), inv_hidden, EXACT_MUL)
    return tl.math.rsqrt(var + eps)


@triton.jit
def _norm_tile(x_ptrs, res_ptrs, norm_w_ptrs, mask, rstd, HAS_RESIDUAL: tl.constexpr):
    """One K tile of ``norm_weight * norm(x + residual)``: the sum and the normalisation are
    recomputed from the inputs (cheaper than a pass through memory), with the row's ``rstd``
    from :func:`_norm_row_rstd`, rounded as ``fused._add_rms_norm_kernel`` rounds them."""
    x = tl.load(x_ptrs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptrs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
    normed = (x.to(tl.float32) * rstd).to(x.dtype)
    w = tl.load(norm_w_ptrs, mask=mask, other=0.0)
    return (w.to(tl.float32) * normed.to(tl.float32)).to(x.dtype)


@triton.jit
def _add_partial(rows, mask, N_OUT, total, total_up, SWIGLU: tl.constexpr):
    """Add one split's fp32 partial (and its up half with SwiGLU) to the running sums."""
    # .cg: read from L2, where the other programs' stores landed.
    total += tl.load(rows, mask=mask, other=0.0, cache_modifier=".cg")
    if SWIGLU:
        total_up += tl.load(rows + N_OUT, mask=mask, other=0.0, cache_modifier=".cg")
    return total, total_up


@triton.jit
def _skinny_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    out_ptr,
    part_ptr,
    counter_ptr,
    ws_ptr,
    res_ptr,
    norm_w_ptr,
    res_out_ptr,
    M,
    K,
    N_OUT,
    stride_xm,
    stride_wn,
    stride_om,
    stride_ws,
    K_PER,
    inv_hidden,
    eps,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SWIGLU: tl.constexpr,
    USE_DOT: tl.constexpr,
    SWAP_AB: tl.constexpr,
    DOT_F32: tl.constexpr,
    PRECISE_EXP: tl.constexpr,
    PRELOAD_W: tl.constexpr,
    HOLD_LAST: tl.constexpr,
    USE_PDL: tl.constexpr,
    NORM: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_ROW: tl.constexpr,
    EXACT_MUL: tl.constexpr,
    DEFER_MERGE: tl.constexpr,
    W_SCALE: tl.constexpr,
    SCALE_BLOCK: tl.constexpr,
):
    """``x @ w.T`` (see the module docstring).  With ``NORM`` (one row, ``BLOCK_M == 1``) the
    matmul's input is ``norm_w * norm(x + residual)`` instead of ``x``: every program reads the
    whole row once for its ``rstd`` (``BLOCK_ROW >= K``), then normalises each K tile as it
    loads it; program (0, 0) alone writes the residual sum to ``res_out``.

    ``W_SCALE``: 0 for weights in the activations' dtype; float8 weights (upcast in registers)
    with 1, one fp32 scale per weight row (``ws_ptr + row * stride_ws``), applied to the sums
    before they are stored (it commutes with the split-K merge), or with 2, one per
    ``SCALE_BLOCK`` x ``SCALE_BLOCK`` block (``ws_ptr + row_block * stride_ws + k_block``),
    applied per K tile (:func:`_product`); the column tile lies in one row block (``BLOCK_N``
    divides ``SCALE_BLOCK``, and ``N_OUT`` is whole blocks with SwiGLU)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N_OUT
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    up_rows = w_ptr + (offs_n + N_OUT).to(tl.int64)[:, None] * stride_wn
    k_begin = pid_k * K_PER
    k_end = tl.minimum(k_begin + K_PER, K)
    # Block scales: the row block of this column tile (and of its up rows).
    ws_row = ws_ptr + ((pid_n * BLOCK_N) // SCALE_BLOCK).to(tl.int64) * stride_ws
    ws_up_row = ws_ptr + ((N_OUT + pid_n * BLOCK_N) // SCALE_BLOCK).to(tl.int64) * stride_ws
    # x comes from the kernel before (PDL: wait for it). Loading the first weight tile before
    # the wait, or asking L2 for its lines there, measured slower (docs/performance.md); only
    # PRELOAD_W (one K tile per split: the program's whole slice) loads weights first, for a
    # caller whose previous kernel leaves the bandwidth idle.
    if PRELOAD_W:
        offs_k_all = k_begin + tl.arange(0, BLOCK_K)
        k_mask_all = offs_k_all < k_end
        w_all = tl.load(w_rows + offs_k_all[None, :], mask=n_mask[:, None] & k_mask_all[None, :], other=0.0)
    # HOLD_LAST: the split's last K tile of weights is loaded before the wait and held across
    # the loop over the others (the compiler stages it in shared memory for the MMA: one
    # pipeline stage's worth), then multiplied last: the same order of accumulation as without
    # it, and the loop's own pipeline starts right after the wait, as it does without it.
    loop_end = k_end
    if HOLD_LAST:
        loop_end = k_begin + (tl.cdiv(k_end - k_begin, BLOCK_K) - 1) * BLOCK_K
        offs_k_last = loop_end + tl.arange(0, BLOCK_K)
        k_mask_last = offs_k_last < k_end
        wl_mask = n_mask[:, None] & k_mask_last[None, :]
        w_last = tl.load(w_rows + offs_k_last[None, :], mask=wl_mask, other=0.0)
        if SWIGLU:
            wu_last = tl.load(up_rows + offs_k_last[None, :], mask=wl_mask, other=0.0)
    pdl_sync(USE_PDL)
    if HOLD_LAST:
        x_last = tl.load(x_rows + offs_k_last[None, :], mask=m_mask[:, None] & k_mask_last[None, :], other=0.0)
    if NORM:
        rstd = _norm_row_rstd(x_ptr, res_ptr, res_out_ptr, K, inv_hidden, eps, (pid_n == 0) & (pid_k == 0),
                              HAS_RESIDUAL, BLOCK_ROW, EXACT_MUL)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    # SWAP_AB accumulates the transposed product, weight rows as the MMA's M side.
    acc_t = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    acc_up_t = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    if PRELOAD_W:
        x = tl.load(x_rows + offs_k_all[None, :], mask=m_mask[:, None] & k_mask_all[None, :], other=0.0)
        if SWAP_AB:
            acc_t += _product(x, w_all, ws_row, offs_k_all, k_mask_all, k_begin, USE_DOT, SWAP_AB, DOT_F32,
                              W_SCALE, SCALE_BLOCK)
        else:
            acc += _product(x, w_all, ws_row, offs_k_all, k_mask_all, k_begin, USE_DOT, SWAP_AB, DOT_F32,
                            W_SCALE, SCALE_BLOCK)
    else:
        for k0 in range(k_begin, loop_end, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_mask = offs_k < k_end
            if NORM:
                x = _norm_tile(x_ptr + offs_k[None, :], res_ptr + offs_k[None, :], norm_w_ptr + offs_k[None, :],
                               k_mask[None, :], rstd, HAS_RESIDUAL)
            else:
                x = tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            wk_mask = n_mask[:, None] & k_mask[None, :]
            w = tl.load(w_rows + offs_k[None, :], mask=wk_mask, other=0.0)
            if SWAP_AB:
                acc_t += _product(x, w, ws_row, offs_k, k_mask, k0, USE_DOT, SWAP_AB, DOT_F32, W_SCALE,
                                  SCALE_BLOCK)
            else:
                acc += _product(x, w, ws_row, offs_k, k_mask, k0, USE_DOT, SWAP_AB, DOT_F32, W_SCALE, SCALE_BLOCK)
            if SWIGLU:
                wu = tl.load(up_rows + offs_k[None, :], mask=wk_mask, other=0.0)
                if SWAP_AB:
                    acc_up_t += _product(x, wu, ws_up_row, offs_k, k_mask, k0, USE_DOT, SWAP_AB, DOT_F32, W_SCALE,
                                         SCALE_BLOCK)
                else:
                    acc_up += _product(x, wu, ws_up_row, offs_k, k_mask, k0, USE_DOT, SWAP_AB, DOT_F32, W_SCALE,
                                       SCALE_BLOCK)
    if HOLD_LAST:
        acc_t += _product(x_last, w_last, ws_row, offs_k_last, k_mask_last, loop_end, USE_DOT, SWAP_AB, DOT_F32,
                          W_SCALE, SCALE_BLOCK)
        if SWIGLU:
            acc_up_t += _product(x_last, wu_last, ws_up_row, offs_k_last, k_mask_last, loop_end, USE_DOT, SWAP_AB,
                                 DOT_F32, W_SCALE, SCALE_BLOCK)
    if SWAP_AB:
        acc = tl.trans(acc_t)
        acc_up = tl.trans(acc_up_t)
    if W_SCALE == 1:
        # Row scales: once, after the K reduction (each split's partial scaled alike).
        acc = acc * tl.load(ws_ptr + offs_n.to(tl.int64) * stride_ws, mask=n_mask, other=0.0)[None, :]
        if SWIGLU:
            acc_up = acc_up * tl.load(ws_ptr + (offs_n + N_OUT).to(tl.int64) * stride_ws, mask=n_mask,
                                      other=0.0)[None, :]

    out_ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    out_mask = m_mask[:, None] & n_mask[None, :]
    dtype = out_ptr.dtype.element_ty
    if SPLIT_K == 1:
        y = _epilogue(acc, acc_up, bias_ptr, offs_n, n_mask, N_OUT, dtype, HAS_BIAS, SWIGLU, PRECISE_EXP)
        tl.store(out_ptrs, y, mask=out_mask)
    else:
        # Partials [SPLIT_K, (2,) M, N_OUT] in fp32; the last program of this column block
        # to arrive sums them in split order and writes the output.
        width = N_OUT * (2 if SWIGLU else 1)
        part_rows = part_ptr + offs_m.to(tl.int64)[:, None] * width + offs_n[None, :]
        split_stride = M * width
        tl.store(part_rows + pid_k * split_stride, acc, mask=out_mask)
        if SWIGLU:
            tl.store(part_rows + pid_k * split_stride + N_OUT, acc_up, mask=out_mask)
        # DEFER_MERGE: the partials are the output, merged by the kernel after this one (the
        # norm or the decode attention, see skinny_linear), in the same order and rounding.
        if not DEFER_MERGE:
            tl.debug_barrier()
            done = tl.atomic_add(counter_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
            if done == SPLIT_K - 1:
                total = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
                total_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
                # Unrolled: every partial's load issued before the first is added (a loop
                # measures the same within noise; docs/performance.md, "Launch settings").
                for s in tl.static_range(SPLIT_K):
                    total, total_up = _add_partial(part_rows + s * split_stride, out_mask, N_OUT, total, total_up,
                                                   SWIGLU)
                y = _epilogue(total, total_up, bias_ptr, offs_n, n_mask, N_OUT, dtype, HAS_BIAS, SWIGLU,
                              PRECISE_EXP)
                tl.store(out_ptrs, y, mask=out_mask)
                tl.atomic_xchg(counter_ptr + pid_n, 0, sem="relaxed", scope="gpu")


@dataclass(frozen=True)
class SkinnyConfig:
    """Launch settings: column tile, K tile, K splits, warps, pipeline stages, and (above one
    row) whether the weight tile is the MMA's M side (``swap_ab``)."""

    block_n: int
    block_k: int
    split_k: int
    num_warps: int = 4
    num_stages: int = 3
    swap_ab: bool = False
    preload: bool = False
    """Each program loads its whole weight slice (one K tile per split: ``block_k * split_k >=
    K``) before its PDL wait (see :data:`WEIGHTS_AHEAD_ENABLED`); no norm prologue, no SwiGLU."""
    hold_last: bool = False
    """(swapped form only) Each program loads the last K tile of its weight slice before its PDL
    wait and holds it while its loop streams the others (see :data:`HOLD_LAST_ENABLED`)."""


def default_config(
    m: int, n_out: int, k: int, swiglu: bool, device: torch.device, weights_ahead: bool = False,
    defer_merge: str | None = None, hold_last: bool = True, scale_block: int | None = None,
    fp8_weight: bool = False,
) -> SkinnyConfig:
    """Launch settings for these shapes: the best of the launch-settings sweep over the 1.1B
    model's matmuls (docs/performance.md, "Launch settings and the comparisons behind them").

    One row: 8-row column tiles over 512-wide K tiles, one program per column tile (enough
    programs to fill the GPU, no merge), except for long K (``down``, K = 8192), which splits K
    into 1024-wide pieces; the SwiGLU form reads gate and up rows, 16 of each.

    More rows: the swapped form (64 weight rows as the MMA's M side, the activation rows as
    its N side) over 128-wide K tiles, 4 pipeline stages, and K split until there are about
    :data:`SWAPPED_TARGET_PROGRAMS` programs (gate_up and the LM head 1 split at 32 rows): the
    fastest setting, or within 2% of it, on every shape at 16 and 32 rows timed alone.

    ``weights_ahead`` (no SwiGLU): at one row (K up to :data:`WEIGHTS_AHEAD_MAX_K`), 8-row
    column tiles over one K tile holding the whole row, loaded before the PDL wait; from two rows
    up to :data:`WEIGHTS_AHEAD_MAX_ROWS`, the swapped form with K split into 256-wide slices, each
    program's slice loaded before the wait.  ``defer_merge="norm"`` (above one row, no SwiGLU):
    K is split toward :data:`DEFERRED_TARGET_PROGRAMS` programs instead.

    ``scale_block`` (float8 weights with block scales): the swapped form's K tiles are at most
    one scale block wide (a dot's tile takes one block's scale).  ``fp8_weight`` (one row):
    K tiles twice as wide, so that a tile holds as many bytes as a bf16 one (16-byte loads of
    16 values; qkv and o_proj of Qwen3-8B 20-23% faster than with the bf16 tiles)."""
    if weights_ahead and WEIGHTS_AHEAD_ENABLED and not swiglu:
        if m == 1 and k <= WEIGHTS_AHEAD_MAX_K:
            return SkinnyConfig(8, triton.next_power_of_2(k), 1, num_warps=8, num_stages=1, preload=True)
        if 1 < m <= WEIGHTS_AHEAD_MAX_ROWS:
            block_k = min(256 if scale_block is None else scale_block, triton.next_power_of_2(k))
            return SkinnyConfig(64, block_k, triton.cdiv(k, block_k), num_warps=4, num_stages=1, swap_ab=True,
                                preload=True)
    if m > 1:
        block_n, block_k = 64, min(128, triton.next_power_of_2(k))
        target = DEFERRED_TARGET_PROGRAMS if defer_merge == "norm" and not swiglu else SWAPPED_TARGET_PROGRAMS
        split = max(1, min(target // triton.cdiv(n_out, block_n), k // block_k))
        hold = HOLD_LAST_ENABLED and hold_last and not swiglu
        stages = SWAPPED_NUM_STAGES - 1 if hold else SWAPPED_NUM_STAGES  # the held tile takes a stage's memory
        return SkinnyConfig(block_n, block_k, split, num_warps=4, num_stages=stages, swap_ab=True, hold_last=hold)
    long_k = k > 4096
    block_n = 16 if (swiglu or long_k) else 8
    block_k = min(256 if long_k else 512, triton.next_power_of_2(k))
    if fp8_weight and not swiglu:  # SwiGLU's 16 + 16 rows over 512 columns measured fastest as they are
        block_k = min(2 * block_k, triton.next_power_of_2(k))
    split = max(1, k // 1024) if long_k else 1
    return SkinnyConfig(block_n, block_k, split)


def _check_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, swiglu: bool,
                  weight_scale: torch.Tensor | None = None, scale_block: int | None = None) -> None:
    """The checks every matmul here makes on its input row(s), weight, bias and weight scales."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"x must be [M, K] and weight [N, K], got x={tuple(x.shape)} weight={tuple(weight.shape)}")
    m = x.shape[0]
    n, k = weight.shape
    if m > MAX_M:
        raise ValueError(f"x has {m} rows; skinny_linear serves at most MAX_M={MAX_M}")
    if x.stride(1) != 1:
        raise ValueError(f"x must be contiguous in its last dim, got strides {x.stride()}")
    if not weight.is_contiguous():
        raise ValueError(f"weight must be contiguous, got strides {weight.stride()}")
    if weight_scale is None and scale_block is not None:
        raise ValueError(f"scale_block={scale_block} needs a weight_scale")
    if weight_scale is None and weight.dtype != x.dtype:
        raise ValueError(f"weight must have x's dtype {x.dtype} (or be {FP8_WEIGHT_DTYPE} with a weight_scale), "
                         f"got {weight.dtype}")
    if weight_scale is not None:
        if weight.dtype != FP8_WEIGHT_DTYPE:
            raise ValueError(f"a weight_scale goes with a {FP8_WEIGHT_DTYPE} weight, got weight {weight.dtype}")
        if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise ValueError(f"x must be bfloat16, float16 or float32 with a float8 weight, got {x.dtype}")
        if scale_block is None:
            want = (n, 1)
        elif scale_block == SCALE_BLOCK:
            want = (triton.cdiv(n, scale_block), triton.cdiv(k, scale_block))
        else:
            raise ValueError(f"scale_block must be None (a scale per weight row) or {SCALE_BLOCK}, got {scale_block}")
        if weight_scale.dtype != torch.float32 or tuple(weight_scale.shape) != want or weight_scale.stride(1) != 1:
            raise ValueError(
                f"weight_scale must be a float32 {want} tensor contiguous in its last dim "
                f"({'one per weight row' if scale_block is None else f'one per {scale_block}x{scale_block} block'}), "
                f"got {weight_scale.dtype} {tuple(weight_scale.shape)} with strides {weight_scale.stride()}"
            )
        if weight_scale.device != weight.device:
            raise ValueError(f"weight_scale must be on the weight's device {weight.device}, got {weight_scale.device}")
        if scale_block is not None and swiglu and (n // 2) % scale_block:
            raise ValueError(f"swiglu with block scales needs gate and up of whole {scale_block}-row blocks, "
                             f"got {n} weight rows")
    if bias is not None and bias.dtype != x.dtype:
        raise ValueError(f"bias must have x's dtype {x.dtype}, got {bias.dtype}")
    if bias is not None and (bias.shape != (n,) or bias.stride(0) != 1):
        raise ValueError(f"bias must be a contiguous ({n},) tensor, got shape {tuple(bias.shape)}, strides {bias.stride()}")
    if swiglu and n % 2:
        raise ValueError(f"swiglu needs an even number of weight rows (gate | up), got {n}")


def _plan(m: int, n_out: int, k: int, swiglu: bool, device: torch.device, config: SkinnyConfig | None,
          weights_ahead: bool, defer_merge: str | None = None, hold_last: bool = True,
          scale_block: int | None = None, fp8_weight: bool = False) -> tuple[SkinnyConfig, int, int]:
    """The launch settings, K per split and the number of splits for these shapes."""
    cfg = config or default_config(m, n_out, k, swiglu, device, weights_ahead, defer_merge, hold_last, scale_block,
                                   fp8_weight)
    if scale_block is not None and (scale_block % cfg.block_n or (m > 1 and scale_block % cfg.block_k)):
        raise ValueError(f"block-scaled float8 weights need block_n dividing {scale_block} (a column tile in one "
                         f"row block) and, above one row, block_k dividing it (a K tile in one block); got {cfg}")
    k_per = triton.cdiv(triton.cdiv(k, cfg.split_k), cfg.block_k) * cfg.block_k
    return cfg, k_per, triton.cdiv(k, k_per)


def _launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor | None,
    n_out: int,
    swiglu: bool,
    plan: tuple[SkinnyConfig, int, int],
    norm: tuple[torch.Tensor | None, torch.Tensor, torch.Tensor, float] | None = None,
    deferred: bool = False,
    weight_scale: torch.Tensor | None = None,
    scale_block: int | None = None,
) -> torch.Tensor | None:
    """One launch of :func:`_skinny_kernel` with the settings, K per split and splits of
    :func:`_plan`, writing ``out``; ``norm`` is ``(residual, norm_weight, residual_out, eps)`` for
    the norm prologue (one row), None for a plain matmul.  ``deferred`` (K split, no norm, no
    SwiGLU): nothing is written to ``out`` (None then) and the fp32 partials ``[splits, M,
    n_out]`` are returned; otherwise None.  ``weight_scale`` / ``scale_block``: a float8
    weight's scales, as :func:`skinny_linear` takes them."""
    m, k = x.shape
    cfg, k_per, split = plan
    if cfg.hold_last and (cfg.preload or norm is not None or not cfg.swap_ab or m == 1):
        raise ValueError(f"SkinnyConfig.hold_last needs the swapped form above one row, no preload and no norm "
                         f"prologue; got m={m}, norm={norm is not None}, {cfg}")
    if cfg.preload and (norm is not None or swiglu or cfg.block_k * cfg.split_k < k):
        raise ValueError(
            f"SkinnyConfig.preload needs no norm prologue, no SwiGLU and one K tile per split "
            f"(block_k * split_k >= K={k}); got norm={norm is not None}, swiglu={swiglu}, {cfg}"
        )
    block_m = 1 if m == 1 else max(16, triton.next_power_of_2(m))
    col_blocks = triton.cdiv(n_out, cfg.block_n)
    if split > 1:
        part = torch.empty(split * m * n_out * (2 if swiglu else 1), dtype=torch.float32, device=x.device)
        counters = part if deferred else arrival_counters(x.device, col_blocks)  # unused when deferred
    else:
        part = counters = out  # unused when SPLIT_K == 1
    if out is None:
        out = part  # unwritten with DEFER_MERGE
    if norm is not None:
        residual, norm_weight, residual_out, eps = norm
        res_in = residual if residual is not None else x  # unread without a residual
        norm_args = (res_in, norm_weight, residual_out)
        inv_hidden, block_row = 1.0 / k, triton.next_power_of_2(k)
    else:
        norm_args, eps, inv_hidden, block_row = (x, x, x), 0.0, 0.0, 1  # unread without NORM
    _skinny_kernel[(col_blocks, split)](
        x,
        weight,
        bias if bias is not None else weight,
        out,
        part,
        counters,
        weight_scale if weight_scale is not None else weight,  # unread without W_SCALE
        *norm_args,
        m,
        k,
        n_out,
        x.stride(0),
        weight.stride(0),
        n_out if deferred else out.stride(0),
        weight_scale.stride(0) if weight_scale is not None else 0,
        k_per,
        inv_hidden,
        eps,
        BLOCK_M=block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        SPLIT_K=split,
        HAS_BIAS=bias is not None,
        SWIGLU=swiglu,
        USE_DOT=block_m > 1,
        PRELOAD_W=cfg.preload,
        HOLD_LAST=cfg.hold_last,
        SWAP_AB=cfg.swap_ab and block_m > 1,
        DOT_F32=x.dtype == torch.float32 or _INTERPRETED,
        PRECISE_EXP=not _INTERPRETED,
        NORM=norm is not None,
        HAS_RESIDUAL=norm is not None and norm[0] is not None,
        BLOCK_ROW=block_row,
        EXACT_MUL=not _INTERPRETED,
        DEFER_MERGE=deferred,
        W_SCALE=0 if weight_scale is None else (1 if scale_block is None else 2),
        SCALE_BLOCK=scale_block or SCALE_BLOCK,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **pdl_options(x.device),
    )
    return part.view(split, m, n_out) if deferred else None


def skinny_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    swiglu: bool = False,
    config: SkinnyConfig | None = None,
    weights_ahead: bool = False,
    defer_merge: str | None = None,
    hold_last: bool = True,
    weight_scale: torch.Tensor | None = None,
    scale_block: int | None = None,
) -> torch.Tensor | SplitPartials:
    """``x @ weight.T (+ bias)``, or with ``swiglu`` ``silu(gate) * up`` of that product.

    Args:
        x: ``[M, K]`` with ``M <= MAX_M``, contiguous in its last dim.
        weight: ``[N, K]`` contiguous (an ``nn.Linear`` weight, or a float8 e4m3 one with
            ``weight_scale``); with ``swiglu``, ``[gate; up]`` with ``N`` even.
        bias: ``[N]`` or None.
        weight_scale: for a float8 e4m3 ``weight`` (an ``Fp8Linear``'s), its float32 scales: the
            real weight is ``weight.float() * scale`` per row (``scale_block`` None: ``[N, 1]``)
            or per ``scale_block`` x ``scale_block`` block (``[ceil(N / b), ceil(K / b)]``,
            ``b = 128``).  The kernel reads the float8 bytes (half of bf16's), upcasts them in
            registers and accumulates in fp32 (W8A16); the activations stay as they are.
        config: launch settings (default: :func:`default_config`, given ``weights_ahead``).
        weights_ahead: the kernel launched just before this one leaves the memory bandwidth
            idle, so the weights may be read before waiting for it (:func:`default_config`
            decides for which rows).
        defer_merge: the kernel that will merge this matmul's partials, ``"norm"``
            (``fused.fused_add_rms_norm``) or ``"attention"`` (the decode attention's
            ``qkv_parts``), or None.  Where K is split (no SwiGLU) the split's partial sums are
            returned as :class:`~pprun.layers.SplitPartials` instead of merged in this launch:
            that kernel merges them as this one would have, and the merge's arrival counter and
            L2 round trip leave the critical path.  It also sets how far K is split
            (:data:`DEFERRED_TARGET_PROGRAMS`).
        hold_last: False where the kernel after this one loads its own data ahead of its wait
            and a held weight tile would compete with it (:data:`HOLD_LAST_ENABLED`).

    Returns a new ``[M, N]`` (``[M, N // 2]`` with ``swiglu``) tensor in ``x``'s dtype, or the
    partials (see ``defer_merge``).
    """
    _check_linear(x, weight, bias, swiglu, weight_scale, scale_block)
    m, n = x.shape[0], weight.shape[0]
    n_out = n // 2 if swiglu else n
    check_defer_merge(defer_merge)
    defer_merge = defer_merge if not swiglu else None
    plan = _plan(m, n_out, x.shape[1], swiglu, x.device, config, weights_ahead, defer_merge, hold_last, scale_block,
                 weight_scale is not None)
    _, _, split = plan
    scales = dict(weight_scale=weight_scale, scale_block=scale_block)
    if m > 0 and defer_merge is not None and split > 1:  # K split: the partials are the output
        return SplitPartials(_launch(x, weight, bias, None, n_out, swiglu, plan, deferred=True, **scales), bias,
                             x.dtype)
    out = torch.empty((m, n_out), dtype=x.dtype, device=x.device)
    if m > 0:
        _launch(x, weight, bias, out, n_out, swiglu, plan, **scales)
    return out


def skinny_norm_linear(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    swiglu: bool = False,
    config: SkinnyConfig | None = None,
    weight_scale: torch.Tensor | None = None,
    scale_block: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``fused.fused_add_rms_norm`` followed by :func:`skinny_linear`, in one launch, for one row.

    The norm is the matmul's prologue: no launch writes or reads the normed row.  What
    ``fused_add_rms_norm`` would return as its first output, rounded the same way, is the
    matmul's input; its second output (the residual sum) is returned as it would return it.

    Args:
        x: ``[1, K]``, contiguous in its last dim (the hidden row before the norm).
        residual: ``[1, K]`` of ``x``'s dtype, contiguous in its last dim, or None (then ``x``
            itself is the residual, as in ``fused_add_rms_norm``).
        norm_weight: ``[K]`` contiguous, of ``x``'s dtype (so that the normed row has it too).
        eps: added to the mean square.
        weight, bias, swiglu, config, weight_scale, scale_block: as for :func:`skinny_linear`.

    Returns ``(out, new_residual)``: ``out`` as :func:`skinny_linear` returns it for the normed
    row, ``new_residual`` a new ``[1, K]`` tensor (``x`` itself when ``residual`` is None).
    """
    if x.dim() == 2 and x.shape[0] != 1:
        raise ValueError(f"x has {x.shape[0]} rows; skinny_norm_linear serves exactly one (M == 1)")
    _check_linear(x, weight, bias, swiglu, weight_scale, scale_block)
    k = x.shape[1]
    if norm_weight.shape != (k,) or not norm_weight.is_contiguous():
        raise ValueError(
            f"norm_weight must be a contiguous ({k},) tensor, got shape {tuple(norm_weight.shape)}, "
            f"strides {norm_weight.stride()}"
        )
    if norm_weight.dtype != x.dtype:
        raise ValueError(f"norm_weight must have x's dtype {x.dtype}, got {norm_weight.dtype}")
    if residual is not None:
        if residual.shape != x.shape or residual.dtype != x.dtype or residual.stride(1) != 1:
            raise ValueError(
                f"residual must be a {tuple(x.shape)} tensor of x's dtype {x.dtype}, contiguous in its "
                f"last dim, got shape {tuple(residual.shape)} of {residual.dtype}, strides {residual.stride()}"
            )
        new_residual = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    else:
        new_residual = x
    n = weight.shape[0]
    out = torch.empty((1, n // 2 if swiglu else n), dtype=x.dtype, device=x.device)
    plan = _plan(1, out.shape[1], k, swiglu, x.device, config, weights_ahead=False, scale_block=scale_block,
                 fp8_weight=weight_scale is not None)
    _launch(x, weight, bias, out, out.shape[1], swiglu, plan, norm=(residual, norm_weight, new_residual, eps),
            weight_scale=weight_scale, scale_block=scale_block)
    return out, new_residual
