"""Fused Triton kernels for the elementwise parts of a Llama block: add+RMSNorm, RoPE, SiLU-and-mul.

Each op is one launch and reproduces, rounding step by rounding step, the torch code in
``pprun/models/llama.py`` that it replaces (that code stays the CPU / HF-parity reference and
the tests compare against it): every intermediate torch rounds to the activation dtype is
rounded here too, in the same order, and everything else is computed in fp32 like torch's
CUDA kernels do (opmath).  Multiply-add contraction to FMA is switched off
(``enable_fp_fusion=False``) because torch's separate mul and add kernels round twice.  What
can still differ is the order of the fp32 sum in RMSNorm's mean and the last bits of ``exp``
and ``rsqrt``: a bf16 result lands at most one ulp away, and rarely.

Every host function is capture-safe for CUDA graphs: grids come from shapes only, nothing
reads a device value on the host, outputs are allocated with ``torch.empty`` (graph pool) or
written in place.  Import through ``pprun.layers.fused_ops_for``, which keeps Triton out of
CPU-only runs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from pprun.kernels.partials import SplitPartials
from pprun.kernels.triton_utils import INTERPRETED as _INTERPRETED
from pprun.kernels.triton_utils import NO_FMA as _NO_FMA
from pprun.kernels.triton_utils import pdl_options, pdl_sync

# The CPU interpreter has no libdevice; it gets tl.exp (tests there use a bf16 tolerance anyway).


def _check_rows(name: str, t: torch.Tensor, ndim: int) -> None:
    """Kernels index rows by stride but assume the last dim is contiguous."""
    if t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-d, got shape {tuple(t.shape)}")
    if t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dim, got strides {t.stride()}")


# --------------------------------------------------------------------------------------
# Residual add + RMSNorm
# --------------------------------------------------------------------------------------

NORM_PARTS_NUM_WARPS = 16
"""Warps per row (hidden up to 4096; twice as many above) of the add + RMSNorm launch that
merges a matmul's split-K partials: each thread has ``splits`` times the loads of a plain row,
so more threads shorten the row's latency: 16 warps are faster than 8 or 4 at batch 32
(docs/performance.md, "Launch settings")."""


@triton.jit
def _add_rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    res_out_ptr,
    stride_x,
    stride_res,
    stride_out,
    stride_res_out,
    hidden,
    inv_hidden,
    eps,
    bias_ptr,
    stride_part,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
    NUM_PARTS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)  # a weight: readable before the wait (PDL)
    pdl_sync(USE_PDL)
    if NUM_PARTS > 0:
        # x is a split-K matmul's fp32 partials (pprun.layers.SplitPartials): merged as that
        # matmul's own merge would, in split order, plus its bias, rounded once.
        total = tl.zeros([BLOCK], tl.float32)
        for s in tl.static_range(NUM_PARTS):
            total += tl.load(x_ptr + s * stride_part + row * stride_x + offs, mask=mask, other=0.0)
        if HAS_BIAS:
            total += tl.load(bias_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        x = total.to(res_out_ptr.dtype.element_ty)
    else:
        x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_res + offs, mask=mask, other=0.0)
        # torch's ``x + residual``: add in fp32, round once to the result dtype.
        x = (x.to(tl.float32) + r.to(tl.float32)).to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * stride_res_out + offs, x, mask=mask)
    h = x.to(tl.float32)
    # torch's CUDA mean multiplies the fp32 sum by 1/N (itself an fp32 constant).
    var = tl.sum(h * h, axis=0) * inv_hidden
    normed = (h * tl.math.rsqrt(var + eps)).to(x.dtype)
    out = w.to(tl.float32) * normed.to(tl.float32)
    tl.store(out_ptr + row * stride_out + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def fused_add_rms_norm(
    x: torch.Tensor | SplitPartials, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``RMSNorm.forward`` in one launch: ``(weight * norm(x + residual), x + residual)``.

    Args:
        x: ``[num_tokens, hidden]``, or a split-K matmul's partials (merged in this launch when
            a residual of their output dtype comes with them; otherwise first, by torch).
        residual: ``[num_tokens, hidden]`` or None (then ``x`` itself is returned as the residual).
        weight: ``[hidden]``.
        eps: added to the mean square.

    Returns new tensors (inputs are not written); dtypes follow torch's promotion, as in
    ``llama.RMSNorm``.
    """
    parts = None
    if isinstance(x, SplitPartials):
        if x.parts.dim() != 3 or x.parts.dtype not in (torch.float32, x.dtype):
            raise ValueError(f"x.parts must be [splits, tokens, hidden] in float32 or {x.dtype}, got "
                             f"{x.parts.dtype} {tuple(x.parts.shape)}")
        if x.bias is not None and (x.bias.shape != (x.parts.shape[2],) or x.bias.stride(0) != 1):
            raise ValueError(f"x.bias must be a contiguous ({x.parts.shape[2]},) tensor, got shape "
                             f"{tuple(x.bias.shape)}, strides {x.bias.stride()}")
        if residual is None or residual.dtype != x.dtype or not x.parts.is_contiguous():
            x = x.merge()
        else:
            parts = x
            x = parts.parts[0]
            if x.shape != residual.shape:
                raise ValueError(f"residual must match the partials' shape {tuple(x.shape)}, "
                                 f"got {tuple(residual.shape)}")
    _check_rows("x", x, 2)
    num_tokens, hidden = x.shape
    if weight.shape != (hidden,):
        raise ValueError(f"weight must have shape ({hidden},), got {tuple(weight.shape)}")
    if not weight.is_contiguous():
        raise ValueError(f"weight must be contiguous, got strides {weight.stride()}")
    if residual is not None:
        _check_rows("residual", residual, 2)
        if residual.shape != x.shape:
            raise ValueError(f"residual must match x's shape {tuple(x.shape)}, got {tuple(residual.shape)}")
        out_dtype = parts.dtype if parts is not None else torch.result_type(x, residual)
        new_residual = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    else:
        new_residual = x
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, new_residual.dtype), device=x.device)
    if num_tokens == 0:
        return out, new_residual
    res_in = residual if residual is not None else x  # unread when HAS_RESIDUAL is False
    _add_rms_norm_kernel[(num_tokens,)](
        x,
        res_in,
        weight,
        out,
        new_residual,
        x.stride(0),
        res_in.stride(0),
        out.stride(0),
        new_residual.stride(0),
        hidden,
        1.0 / hidden,
        eps,
        parts.bias if parts is not None and parts.bias is not None else weight,
        x.numel(),
        HAS_RESIDUAL=residual is not None,
        BLOCK=triton.next_power_of_2(hidden),
        NUM_PARTS=parts.parts.shape[0] if parts is not None else 0,
        HAS_BIAS=parts is not None and parts.bias is not None,
        num_warps=min(32, (NORM_PARTS_NUM_WARPS if parts is not None else 4) * (1 if hidden <= 4096 else 2)),
        **_NO_FMA,
        **pdl_options(x.device),
    )
    return out, new_residual


# --------------------------------------------------------------------------------------
# Rotary embedding (non-interleaved, rotate_half layout), in place on q and k
# --------------------------------------------------------------------------------------


@triton.jit
def _rotary_kernel(
    q_ptr,
    k_ptr,
    cos_ptr,
    sin_ptr,
    pos_ptr,
    stride_q_tok,
    stride_q_head,
    stride_k_tok,
    stride_k_head,
    stride_cos,
    stride_sin,
    num_q_heads,
    num_heads_total,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    # Heads are numbered q first, then k; a group may straddle the two.
    head = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    is_q = head < num_q_heads
    row_ptr = tl.where(
        is_q,
        q_ptr + tok * stride_q_tok + head.to(tl.int64) * stride_q_head,
        k_ptr + tok * stride_k_tok + (head - num_q_heads).to(tl.int64) * stride_k_head,
    )
    offs = tl.arange(0, BLOCK_D)
    mask = (head[:, None] < num_heads_total) & (offs[None, :] < HALF)
    ptr1 = row_ptr[:, None] + offs[None, :]
    x1 = tl.load(ptr1, mask=mask, other=0.0)
    x2 = tl.load(ptr1 + HALF, mask=mask, other=0.0)
    dtype = x1.dtype

    pos = tl.load(pos_ptr + tok).to(tl.int64)
    dmask = offs < HALF
    # The tables are fp32; torch casts the looked-up rows to q's dtype before multiplying.
    c1 = tl.load(cos_ptr + pos * stride_cos + offs, mask=dmask, other=0.0).to(dtype)
    c2 = tl.load(cos_ptr + pos * stride_cos + HALF + offs, mask=dmask, other=0.0).to(dtype)
    s1 = tl.load(sin_ptr + pos * stride_sin + offs, mask=dmask, other=0.0).to(dtype)
    s2 = tl.load(sin_ptr + pos * stride_sin + HALF + offs, mask=dmask, other=0.0).to(dtype)

    # q * cos + rotate_half(q) * sin with rotate_half(q) = cat(-x2, x1); each product and the
    # sum are rounded to the activation dtype, as three separate torch ops would.
    a1 = (x1.to(tl.float32) * c1.to(tl.float32)[None, :]).to(dtype)
    b1 = (-(x2.to(tl.float32)) * s1.to(tl.float32)[None, :]).to(dtype)
    a2 = (x2.to(tl.float32) * c2.to(tl.float32)[None, :]).to(dtype)
    b2 = (x1.to(tl.float32) * s2.to(tl.float32)[None, :]).to(dtype)
    o1 = (a1.to(tl.float32) + b1.to(tl.float32)).to(dtype)
    o2 = (a2.to(tl.float32) + b2.to(tl.float32)).to(dtype)
    tl.store(ptr1, o1, mask=mask)
    tl.store(ptr1 + HALF, o2, mask=mask)


def rotary_qk(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``RotaryEmbedding.__call__`` in one launch, rotating ``q`` and ``k`` **in place**.

    ``q``/``k`` may be strided views (e.g. the q and k column blocks of the fused qkv output,
    which the caller owns); only their last dim must be contiguous.

    Args:
        q: ``[num_tokens, num_heads, head_dim]``.
        k: ``[num_tokens, num_kv_heads, head_dim]``, same dtype.
        cos, sin: fp32 tables ``[max_positions, head_dim]`` (``cat(freqs, freqs)`` layout).
        positions: ``[num_tokens]`` integer positions (not range-checked: that would sync).

    Returns ``(q, k)``, the same tensors, rotated.
    """
    _check_rows("q", q, 3)
    _check_rows("k", k, 3)
    num_tokens, num_heads, head_dim = q.shape
    if k.shape[0] != num_tokens or k.shape[2] != head_dim or k.dtype != q.dtype:
        raise ValueError(
            f"k must be [{num_tokens}, num_kv_heads, {head_dim}] of {q.dtype}, "
            f"got {tuple(k.shape)} of {k.dtype}"
        )
    if head_dim % 2:
        raise ValueError(f"head_dim must be even for rotate_half, got {head_dim}")
    for name, table in (("cos", cos), ("sin", sin)):
        _check_rows(name, table, 2)
        if table.shape[1] != head_dim:
            raise ValueError(f"{name} must be [max_positions, {head_dim}], got {tuple(table.shape)}")
    if positions.shape != (num_tokens,):
        raise ValueError(f"positions must have shape ({num_tokens},), got {tuple(positions.shape)}")
    if num_tokens == 0:
        return q, k
    num_heads_total = num_heads + k.shape[1]
    half = head_dim // 2
    block_d = triton.next_power_of_2(half)
    # About 1K elements per program: enough programs for decode, few enough for prefill.
    block_h = max(1, min(triton.next_power_of_2(num_heads_total), 1024 // block_d))
    grid = (num_tokens, triton.cdiv(num_heads_total, block_h))
    _rotary_kernel[grid](
        q,
        k,
        cos,
        sin,
        positions,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        cos.stride(0),
        sin.stride(0),
        num_heads,
        num_heads_total,
        HALF=half,
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        num_warps=4,
        **_NO_FMA,
    )
    return q, k


# --------------------------------------------------------------------------------------
# SwiGLU activation
# --------------------------------------------------------------------------------------


@triton.jit
def silu_mul(gate, up, PRECISE_EXP: tl.constexpr):
    """``F.silu(gate) * up`` for ``gate``/``up`` in the activation dtype, rounded as torch does:
    its CUDA silu is x / (1 + expf(-x)) in fp32 (IEEE div, full-precision expf), rounded to the
    input dtype; then ``* up`` rounds again.  Shared with ``skinny``'s SwiGLU epilogue."""
    dtype = gate.dtype
    g = gate.to(tl.float32)
    if PRECISE_EXP:
        e = libdevice.exp(-g)
    else:
        e = tl.exp(-g)
    silu = tl.math.div_rn(g, 1.0 + e).to(dtype)
    return (silu.to(tl.float32) * up.to(tl.float32)).to(dtype)


@triton.jit
def _silu_and_mul_kernel(
    gate_up_ptr,
    out_ptr,
    stride_in,
    stride_out,
    inter,
    BLOCK: tl.constexpr,
    PRECISE_EXP: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    gate = tl.load(gate_up_ptr + row * stride_in + offs, mask=mask, other=0.0)
    up = tl.load(gate_up_ptr + row * stride_in + inter + offs, mask=mask, other=0.0)
    tl.store(out_ptr + row * stride_out + offs, silu_mul(gate, up, PRECISE_EXP), mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``F.silu(gate) * up`` for ``gate_up = [gate | up]`` of shape ``[num_tokens, 2 * inter]``.

    Returns a new ``[num_tokens, inter]`` tensor in ``gate_up``'s dtype.
    """
    _check_rows("gate_up", gate_up, 2)
    num_tokens, width = gate_up.shape
    if width % 2:
        raise ValueError(f"gate_up's last dim must be even (gate | up), got {width}")
    inter = width // 2
    out = torch.empty((num_tokens, inter), dtype=gate_up.dtype, device=gate_up.device)
    if num_tokens == 0:
        return out
    block = min(1024, triton.next_power_of_2(inter))
    _silu_and_mul_kernel[(num_tokens, triton.cdiv(inter, block))](
        gate_up,
        out,
        gate_up.stride(0),
        out.stride(0),
        inter,
        BLOCK=block,
        PRECISE_EXP=not _INTERPRETED,
        num_warps=4,
        **_NO_FMA,
    )
    return out
