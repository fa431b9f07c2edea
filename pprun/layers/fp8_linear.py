"""A linear layer that keeps an FP8 checkpoint's weights in float8 and multiplies on FP8 tensor cores.

:class:`Fp8Linear` holds what the checkpoint stores: the float8 e4m3 ``weight [out, in]`` and its
float32 ``weight_scale`` (one per 128x128 block, or one per output row: a per-tensor scale is
kept per row, so q/k/v fused into one layer keep their three scales).  Each call quantizes its
activations (one Triton launch: per token for row scales, per token and 128 columns for block
scales, as vLLM and DeepSeek do) and runs cuBLAS's scaled matmul (``torch._scaled_mm``): rowwise
scaling, or 1x128 activation blocks against 128x128 weight blocks (batches of up to
``pprun.layers.fp8_block_gemm.TRITON_MAX_M`` rows: that module's Triton kernel, off by default).  The weights take half the
memory of bf16 and each step reads half the bytes.  Decode-sized batches (up to
``pprun.layers.skinny.DISPATCH_MAX_M`` rows) skip the activation quantization:
``pprun.layers.linear`` sends them to the split-K kernels of ``pprun.layers.skinny``, which read
the float8 weight with its scales and keep the activations in bf16/fp16 (W8A16).

A model builds one where :func:`fp8_compute_supported` holds (a CUDA GPU of compute capability
8.9 or more, 16-bit activations) and the layer's shape fits the scheme
(:func:`fits_fp8_compute`; block-scaled weights unless :data:`BLOCK_GEMM_ENABLED` is off); elsewhere
the loader dequantizes the weights into a plain ``nn.Linear`` (CPU, fp32 runs), which is the
exact reference the tests compare with.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from pprun.switches import enabled_unless

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
"""The largest finite float8 e4m3 value: a block's largest magnitude maps to it."""
SCALE_EPS = 1e-10
"""The smallest activation scale (an all-zero row would otherwise divide by zero)."""
BLOCK = 128
"""The block size cuBLAS's block-scaled FP8 matmul takes (1x128 activations, 128x128 weights)."""
BLOCKWISE_ROW_MULTIPLE = 16
"""cuBLAS's block-scaled FP8 matmul on Hopper has no algorithm for one row, nor for 73 (seen on
the H200; 8, 16, 64, 256 and 2,048 run): rows are padded to a multiple of this."""


BLOCK_GEMM_ENABLED: bool = enabled_unless("PPRUN_DISABLE_FP8_BLOCK_GEMM")
"""False when ``PPRUN_DISABLE_FP8_BLOCK_GEMM`` is set: block-scaled (128x128) FP8 weights are then
dequantized at load (bf16 memory and speed, exact) instead of multiplied by cuBLAS's
block-scaled FP8 matmul.  The matmul takes layers of four or more column blocks only (on the
H200, 256-column layers gave NaNs; 512 and wider matched the dequantized weights, whole models
included)."""


def fp8_compute_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a run on ``device`` in ``dtype`` multiplies FP8 weights on FP8 tensor cores."""
    if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


def fits_fp8_compute(block: tuple[int, int] | None, in_features: int, row_blocks: list[int]) -> bool:
    """Whether a layer of ``in_features`` columns whose rows come from checkpoint tensors of
    ``row_blocks`` rows each (q, k, v fused: three) can keep its FP8 weights as they are:
    ``block`` (None: per-row or per-tensor scales) must be 128x128 (the only block cuBLAS scales
    by) with every fused part whole blocks, and the widths those of cuBLAS's FP8 matmul
    (multiples of 16)."""
    if in_features % 16 or sum(row_blocks) % 16:
        return False
    if block is not None and not BLOCK_GEMM_ENABLED:
        return False
    if block is not None:
        # The weight scales' rows must hold a multiple of 4 column blocks: narrower layers gave NaNs on
        # the H200 (256 columns: 2 blocks), 512 and wider run.
        return (block == (BLOCK, BLOCK) and in_features % (4 * BLOCK) == 0
                and all(r % BLOCK == 0 for r in row_blocks))
    return True


class Fp8Linear(nn.Module):
    """``y = x W^T (+ b)`` with ``W`` stored in float8 e4m3 and its scales (module docstring)."""

    keep_dtypes = ("weight", "weight_scale")
    """Parameters :func:`pprun.models.base.allocate` leaves in their own dtypes."""

    def __init__(self, in_features: int, out_features: int, bias: bool, block_scaled: bool) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.block_scaled = block_scaled
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8_DTYPE), requires_grad=False)
        scale_shape = ((math.ceil(out_features / BLOCK), math.ceil(in_features / BLOCK)) if self.block_scaled
                       else (out_features, 1))
        self.weight_scale = nn.Parameter(torch.empty(scale_shape, dtype=torch.float32), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def load_scale(self, row0: int, rows: int, scale: torch.Tensor) -> None:
        """Copy a checkpoint tensor's scale into place: the tensor fills weight rows
        ``row0 : row0 + rows`` of this layer (a fused part), its scale the matching scale rows
        (a per-tensor scale repeated over the rows)."""
        if self.block_scaled:
            self.weight_scale.data[row0 // BLOCK: (row0 + rows) // BLOCK].copy_(scale)
        else:
            self.weight_scale.data[row0: row0 + rows].copy_(scale.reshape(-1, 1).expand(rows, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., in]`` in bf16/fp16 -> ``[..., out]`` in the same dtype, through cuBLAS's scaled
        FP8 matmul (decode-sized batches go to the split-K kernels instead, through
        ``pprun.layers.linear``)."""
        # Imported here, not at the top: fp8_quant imports Triton (the optional ``gpu`` extra),
        # while CPU runs import this module to build FP8 checkpoints' layers (LinearFactory's
        # fits_fp8_compute) with Triton absent, or before tests set TRITON_INTERPRET.  After the
        # first call this is a sys.modules lookup, and CUDA graphs replay without it.
        from pprun.layers import fp8_block_gemm, fp8_quant

        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        num_rows = x2.shape[0]
        if self.block_scaled and num_rows <= fp8_block_gemm.TRITON_MAX_M:
            xq, xs = fp8_quant.quantize_groups(x2, BLOCK)
            out = fp8_block_gemm.block_fp8_matmul(xq, xs, self.weight, self.weight_scale, x.dtype, self.bias)
        elif self.block_scaled:
            xq, xs = fp8_quant.quantize_groups(x2, BLOCK, row_multiple=BLOCKWISE_ROW_MULTIPLE)
            out = torch._scaled_mm(xq, self.weight.t(), scale_a=xs, scale_b=self.weight_scale.t(),
                                   out_dtype=x.dtype)[:num_rows]
            if self.bias is not None:
                out = out + self.bias
        else:
            xq, xs = fp8_quant.quantize_rows(x2)
            out = torch._scaled_mm(xq, self.weight.t(), scale_a=xs, scale_b=self.weight_scale.t(),
                                   bias=self.bias, out_dtype=x.dtype)
        return out.reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        scales = "128x128 blocks" if self.block_scaled else "rows"
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8 scaled by {scales}"
