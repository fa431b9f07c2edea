"""Dynamic FP8 quantization of activations, one Triton launch each: per row (token) or per row
and group of columns (1x128 blocks), the scale of each being its largest magnitude over 448.

What :class:`pprun.layers.fp8_linear.Fp8Linear` feeds cuBLAS's scaled matmul.  Capture-safe for
CUDA graphs: grids come from shapes, outputs from ``torch.empty``.  The float8 values are rounded
to nearest (:func:`to_fp8`, exact under Triton's interpreter as well).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pprun.kernels.triton_utils import INTERPRETED

FP8_MAX = 448.0
SCALE_EPS = 1e-10


@triton.jit
def to_fp8(x, dtype: tl.constexpr, EXACT: tl.constexpr):
    """fp32 ``x`` (within float8 e4m3's range) cast to the float8 ``dtype``, rounded to nearest.
    ``EXACT`` (Triton's interpreter, whose float32 -> float8 cast drops the carry of a mantissa
    rounded up into the exponent, 31.6 -> 16, and truncates subnormals): ``x`` is first rounded
    in fp32 onto e4m3's grid, to 4 significant bits by Veltkamp's split (``t - (t - x)``, ``t =
    (2**20 + 1) * x``) from 2**-6 up, to multiples of 2**-9 below, so that the cast is exact."""
    if EXACT:
        t = x * 1048577.0
        normal = t - (t - x)
        subnormal = (x + 24576.0) - 24576.0  # 1.5 * 2**14: fp32's step there is 2**-9
        x = tl.where(tl.abs(x) < 0.015625, subnormal, normal)
    return x.to(dtype)


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, stride_x, stride_q, K,
                          BLOCK_K: tl.constexpr, FP8_MAX_C: tl.constexpr, EPS: tl.constexpr, EXACT: tl.constexpr):
    row = tl.program_id(0)
    amax = tl.zeros([BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + row * stride_x + cols, mask=cols < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.maximum(tl.max(amax, axis=0) / FP8_MAX_C, EPS)
    tl.store(s_ptr + row, scale)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + row * stride_x + cols, mask=cols < K, other=0.0).to(tl.float32)
        q = tl.clamp(x / scale, -FP8_MAX_C, FP8_MAX_C)
        tl.store(q_ptr + row * stride_q + cols, to_fp8(q, q_ptr.dtype.element_ty, EXACT), mask=cols < K)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` -> ``(q [M, K] float8 e4m3, scale [M, 1] float32)`` with ``x ~ q * scale``."""
    num_rows, k = x.shape
    q = torch.empty((num_rows, k), dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty((num_rows, 1), dtype=torch.float32, device=x.device)
    if num_rows:
        block_k = min(2048, triton.next_power_of_2(k))
        _quantize_rows_kernel[(num_rows,)](x, q, s, x.stride(0), q.stride(0), k, BLOCK_K=block_k,
                                           FP8_MAX_C=FP8_MAX, EPS=SCALE_EPS, EXACT=INTERPRETED, num_warps=4)
    return q, s


# The row counts vary with the step (the MoE layer's W8A8 quantizes T * top_k entries, a multiple
# of 16 for some counts of a warm-up class and not for others): no variant per count.
@triton.jit(do_not_specialize=["num_rows", "num_rows_padded"])
def _quantize_groups_kernel(x_ptr, q_ptr, s_ptr, stride_x, stride_q, num_rows, num_rows_padded,
                            GROUP: tl.constexpr, FP8_MAX_C: tl.constexpr, EPS: tl.constexpr, EXACT: tl.constexpr):
    row = tl.program_id(0)
    group = tl.program_id(1)
    cols = group * GROUP + tl.arange(0, GROUP)
    x = tl.load(x_ptr + row * stride_x + cols, mask=(row < num_rows) & (cols >= 0), other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), axis=0) / FP8_MAX_C, EPS)
    # Scales column-major ([groups, rows] in memory), the layout cuBLAS's 1x128 scaling reads.
    tl.store(s_ptr + group * num_rows_padded + row, scale)
    q = tl.clamp(x / scale, -FP8_MAX_C, FP8_MAX_C)
    tl.store(q_ptr + row * stride_q + cols, to_fp8(q, q_ptr.dtype.element_ty, EXACT))


def quantize_groups(x: torch.Tensor, group: int, row_multiple: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` (``K`` a multiple of ``group``) -> ``(q [P, K] float8 e4m3, scale [P, K /
    group] float32)`` with ``x ~ q * scale`` per row and group of columns, ``P`` = ``M`` rounded
    up to a multiple of ``row_multiple`` (padding rows are zero); ``scale`` has strides ``(1,
    P)``, as cuBLAS reads it."""
    num_rows, k = x.shape
    if k % group:
        raise ValueError(f"quantize_groups: {k} columns are not whole groups of {group}")
    num_rows_padded = max(1, -(-num_rows // row_multiple)) * row_multiple
    q = torch.empty((num_rows_padded, k), dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty((k // group, num_rows_padded), dtype=torch.float32, device=x.device)
    _quantize_groups_kernel[(num_rows_padded, k // group)](x, q, s, x.stride(0), q.stride(0), num_rows,
                                                           num_rows_padded, GROUP=group, FP8_MAX_C=FP8_MAX,
                                                           EPS=SCALE_EPS, EXACT=INTERPRETED, num_warps=1)
    return q, s.t()


def quantize_reference(x: torch.Tensor, group: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The same in plain torch (the tests' reference): scales ``[M, 1]`` per row (``group``
    None) or ``[M, K / group]``, both plainly laid out."""
    xf = x.float()
    if group is None:
        s = (xf.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=SCALE_EPS)
        return (xf / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), s
    g = xf.view(x.shape[0], -1, group)
    s = (g.abs().amax(dim=2) / FP8_MAX).clamp(min=SCALE_EPS)
    q = (g / s[..., None]).clamp(-FP8_MAX, FP8_MAX).view(x.shape).to(torch.float8_e4m3fn)
    return q, s
