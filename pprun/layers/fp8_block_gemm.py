"""A Triton matmul of 1x128-quantized FP8 activations by 128x128 block-scaled FP8 weights (W8A8).

``out [M, N] = (xq * xs) @ (w * ws).T``: ``xq [M, K]`` float8 e4m3 with one float32 scale per
row and 128 columns (``xs [M, K / 128]``, any strides: :func:`pprun.layers.fp8_quant.quantize_groups`
gives them column-major), ``w [N, K]`` float8 e4m3 with one float32 scale per 128x128 block
(``ws [ceil(N / 128), K / 128]``, the checkpoint's ``weight_scale_inv``).  Each program computes
an ``BLOCK_M x BLOCK_N`` tile: for every 128 columns of K one FP8 tensor-core product (fp32
accumulation) scaled by the activations' row scales and the weights' block scale, summed in fp32;
the output in the activations' dtype, with the bias added.

It is the scheme of DeepSeek-V3's and vLLM's block-FP8 matmuls, written for pprun's
``Fp8Linear``: where cuBLAS's block-scaled FP8 matmul (``torch._scaled_mm``) takes as long as bf16
weights do (2-64 rows on the H200: the weights' bytes halve, its time does not), a kernel that
reads the float8 weight once per tile and multiplies it as FP8 can take the halved bytes.  It
runs for block-scaled layers on batches of up to :data:`TRITON_MAX_M` rows (``0``: never, the
default until its speed on the GPU is measured against cuBLAS's; ``scripts/gpu_speed.py --ab
--ab-only TRITON_MAX_M`` and ``scripts/fp8_decode_matmuls.py`` time both).  On CPU it runs under
Triton's interpreter, whose float8 products are exact, so the tests compare it with the
dequantized product directly.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

GROUP = 128
"""Columns per activation scale and rows/columns per weight scale block."""

TRITON_MAX_M = 0
"""Block-scaled ``Fp8Linear`` batches of up to this many rows take this kernel instead of cuBLAS's
block-scaled FP8 matmul (0: none)."""


@triton.jit
def _block_fp8_matmul_kernel(
    xq_ptr, xs_ptr, w_ptr, ws_ptr, bias_ptr, out_ptr,
    M, N, K,
    stride_xm, stride_wn, stride_om,
    stride_xs_m, stride_xs_k, stride_ws_n, stride_ws_k,
    HAS_BIAS: tl.constexpr, GROUP_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_SIZE_M: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    # Grouped order: programs that run together share weight tiles in L2.
    in_group = GROUP_SIZE_M * num_n
    first_m = (pid // in_group) * GROUP_SIZE_M
    group_m = min(num_m - first_m, GROUP_SIZE_M)
    pid_m = first_m + (pid % in_group) % group_m
    pid_n = (pid % in_group) // group_m

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, GROUP_K)
    row_ok = rows < M
    col_ok = cols < N
    x_ptrs = xq_ptr + rows[:, None] * stride_xm + ks[None, :]
    w_ptrs = w_ptr + cols[None, :] * stride_wn + ks[:, None]  # [GROUP_K, BLOCK_N]: w transposed
    xs_ptrs = xs_ptr + rows * stride_xs_m
    ws_ptrs = ws_ptr + (cols // GROUP_K) * stride_ws_n

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, K // GROUP_K):  # K is whole groups (block_fp8_matmul checks): no K mask
        x = tl.load(x_ptrs, mask=row_ok[:, None], other=0.0)
        w = tl.load(w_ptrs, mask=col_ok[None, :], other=0.0)
        x_scale = tl.load(xs_ptrs + kb * stride_xs_k, mask=row_ok, other=0.0)
        w_scale = tl.load(ws_ptrs + kb * stride_ws_k, mask=col_ok, other=0.0)
        acc += tl.dot(x, w, out_dtype=tl.float32) * x_scale[:, None] * w_scale[None, :]
        x_ptrs += GROUP_K
        w_ptrs += GROUP_K

    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + rows[:, None] * stride_om + cols[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def launch_config(m: int) -> dict:
    """Tile and launch settings by row count.  Up to 64 rows: one 64-row tile, the smallest that
    Hopper's warpgroup FP8 MMA (``wgmma ... e4m3.e4m3``) takes (a 16- or 32-row tile compiles to
    ``mma.sync`` on float8 converted to fp16 instead), with narrow column tiles (more programs over
    the weight, which is what those rows read; the unused rows cost MMA time these rows have to
    spare).  Past 64 rows, 128x128 tiles as in a prefill."""
    if m <= 64:
        return {"BLOCK_M": 64, "BLOCK_N": 32 if m <= 16 else 64, "GROUP_SIZE_M": 1, "num_warps": 4, "num_stages": 4}
    return {"BLOCK_M": 128, "BLOCK_N": 128, "GROUP_SIZE_M": 8, "num_warps": 8, "num_stages": 3}


def block_fp8_matmul(xq: torch.Tensor, xs: torch.Tensor, w: torch.Tensor, ws: torch.Tensor,
                     out_dtype: torch.dtype, bias: torch.Tensor | None = None,
                     num_rows: int | None = None) -> torch.Tensor:
    """``(xq * xs) @ (w * ws).T (+ bias)`` as ``[num_rows, N]`` in ``out_dtype`` (module docstring;
    ``num_rows``: the rows of ``xq`` that count, all by default — quantization may pad them)."""
    m = xq.shape[0] if num_rows is None else num_rows
    n, k = w.shape
    if xq.shape[1] != k or k % GROUP:
        raise ValueError(f"block_fp8_matmul: x has {xq.shape[1]} columns, the weight {k} (a multiple of {GROUP} needed)")
    if tuple(ws.shape) != (-(-n // GROUP), k // GROUP) or xs.shape[1] != k // GROUP or xs.shape[0] < m:
        raise ValueError(f"block_fp8_matmul: scales {tuple(xs.shape)} and {tuple(ws.shape)} do not fit "
                         f"x [{m}, {k}] and w [{n}, {k}] in {GROUP}-column groups")
    if xq.stride(1) != 1 or w.stride(1) != 1:
        raise ValueError("block_fp8_matmul: x and the weight must be contiguous along K")
    out = torch.empty((m, n), dtype=out_dtype, device=xq.device)
    if m == 0:
        return out
    cfg = launch_config(m)
    grid = (triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"]),)
    _block_fp8_matmul_kernel[grid](
        xq, xs, w, ws, bias if bias is not None else out, out,
        m, n, k,
        xq.stride(0), w.stride(0), out.stride(0),
        xs.stride(0), xs.stride(1), ws.stride(0), ws.stride(1),
        HAS_BIAS=bias is not None, GROUP_K=GROUP, **cfg,
    )  # fmt: skip
    return out
