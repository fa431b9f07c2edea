"""Model-agnostic layer ops, and the switch that routes CUDA tensors to their fused Triton kernels.

``fused_ops_for(t)`` is what a model calls at an op's call site: it returns the
``pprun.layers.fused`` module when ``t`` is on CUDA, Triton imports and fusion is enabled, and
``None`` otherwise (the caller then runs its plain torch code, which stays the CPU / HF-parity
reference).  ``fused`` is imported lazily, on the first CUDA tensor, so a CPU-only run never
imports Triton and a test can set ``TRITON_INTERPRET`` before the kernels are decorated.
"""

from __future__ import annotations

from types import ModuleType

import torch
from torch import nn

from pprun.kernels.partials import DEFER_MERGERS, SplitPartials, check_defer_merge, merged  # noqa: F401  (re-exported)
from pprun.layers.fp8_linear import BLOCK as FP8_BLOCK
from pprun.layers.fp8_linear import FP8_DTYPE, Fp8Linear
from pprun.layers.parallel_linear import ColumnParallelLinear
from pprun.switches import enabled_unless

FUSED_ENABLED: bool = enabled_unless("PPRUN_DISABLE_FUSED")
"""False when ``PPRUN_DISABLE_FUSED`` is set (to anything but ``0``); tests may flip it."""

FUSED_DECODE_ENABLED: bool = enabled_unless("PPRUN_DISABLE_FUSED_DECODE")
"""False when ``PPRUN_DISABLE_FUSED_DECODE`` is set: decode steps then rotate q/k, write the
cache and attend in separate kernels (the A/B switch of ``scripts/gpu_speed.py``)."""

SKINNY_ENABLED: bool = enabled_unless("PPRUN_DISABLE_SKINNY_GEMM")
"""False when ``PPRUN_DISABLE_SKINNY_GEMM`` is set: decode-sized matmuls then go to cuBLAS."""

FP8_SKINNY_ENABLED: bool = enabled_unless("PPRUN_DISABLE_FP8_SKINNY")
"""False when ``PPRUN_DISABLE_FP8_SKINNY`` is set: an ``Fp8Linear``'s decode-sized matmuls then
quantize their activations and go to cuBLAS's scaled FP8 matmul (``Fp8Linear.forward``) instead
of the split-K kernels reading the float8 weights (the A/B switch of ``scripts/gpu_speed.py``)."""

NORM_FOLD_ENABLED: bool = enabled_unless("PPRUN_DISABLE_NORM_FOLD")
"""False when ``PPRUN_DISABLE_NORM_FOLD`` is set: the residual add + RMSNorm before a one-row
split-K matmul then runs as its own launch (the A/B switch of :func:`norm_linear`)."""

DEFER_MERGE_ENABLED: bool = enabled_unless("PPRUN_DISABLE_DEFER_MERGE")
"""False when ``PPRUN_DISABLE_DEFER_MERGE`` is set: a split-K decode matmul followed by a norm
(``o_proj``, ``down``) then merges its partials itself instead of leaving them to the norm's
kernel, and a split-K qkv its own merge instead of leaving it to the decode attention (the A/B
switch of ``scripts/gpu_speed.py``).  Deferring pays because a split-K matmul's own merge is a
second pass over its output that ends its launch late, while the next kernel reads the partials
anyway; ``docs/performance.md`` has the figures.  The merges are exact; the switch also changes the launch settings that come with deferral (the
norm-merged matmuls' split count, the merging norm's warps), hence fp32 sum orders, so its two
sides may differ in a last bit as two launch settings may."""


_fused_module: ModuleType | None = None
_fused_import_failed = False


def _load_fused() -> ModuleType | None:
    """Import ``pprun.layers.fused`` once; None (for good) if Triton is not importable."""
    global _fused_module, _fused_import_failed
    if _fused_module is None and not _fused_import_failed:
        try:
            from pprun.layers import fused
        except ImportError:
            _fused_import_failed = True
        else:
            _fused_module = fused
    return _fused_module


def fused_ops_for(t: torch.Tensor) -> ModuleType | None:
    """The fused-ops module if ``t``'s op should take the Triton path, else None (plain torch)."""
    if not FUSED_ENABLED or not t.is_cuda:
        return None
    return _load_fused()


def fused_decode_enabled(t: torch.Tensor) -> bool:
    """Whether a decode step on ``t``'s device may fold rotary and cache write into attention."""
    return FUSED_DECODE_ENABLED and fused_ops_for(t) is not None


_skinny_module: ModuleType | None = None


def _load_skinny() -> ModuleType:
    global _skinny_module
    if _skinny_module is None:
        from pprun.layers import skinny

        _skinny_module = skinny
    return _skinny_module


def _kernel_weight(module: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
    """``module.weight`` when a kernel may read it as it is for the input ``x``: no hooks on the
    module, no autograd, ``x``'s dtype and device, contiguous; else None."""
    if module._forward_hooks or module._forward_pre_hooks:
        return None
    weight = module.weight
    if torch.is_grad_enabled() and weight.requires_grad:
        return None
    if weight.dtype != x.dtype or weight.device != x.device or not weight.is_contiguous():
        return None
    return weight


def _fp8_weight(layer: Fp8Linear, x: torch.Tensor) -> torch.Tensor | None:
    """``layer.weight`` when the kernels may read an ``Fp8Linear``'s float8 weight and its scales
    as they are for the input ``x``: no hooks, no autograd, both on ``x``'s device, the weight
    float8 e4m3 and contiguous, the scales float32 of the layer's layout; else None."""
    if not FP8_SKINNY_ENABLED or layer._forward_hooks or layer._forward_pre_hooks:
        return None
    weight, scale = layer.weight, layer.weight_scale
    if torch.is_grad_enabled() and (weight.requires_grad or scale.requires_grad):
        return None
    if weight.dtype != FP8_DTYPE or weight.device != x.device or not weight.is_contiguous():
        return None
    if scale.dtype != torch.float32 or scale.device != x.device or scale.dim() != 2 or scale.stride(1) != 1:
        return None
    return weight


def _weight_scales(layer: nn.Module) -> dict:
    """The keyword arguments that give ``skinny`` a layer's weight scales: an ``Fp8Linear``'s
    (per row, or per 128x128 block), none for an ``nn.Linear``."""
    if type(layer) is Fp8Linear:
        return {"weight_scale": layer.weight_scale, "scale_block": FP8_BLOCK if layer.block_scaled else None}
    return {}


def _skinny_for(layer: nn.Module, x: torch.Tensor):
    """``pprun.layers.skinny`` when ``layer(x)`` can take it: a plain ``nn.Linear`` (or a tensor-parallel
    ``ColumnParallelLinear``), or an
    ``Fp8Linear`` (its float8 weight read with its scales), with no subclass, no hooks and no
    autograd, on a decode-sized bf16/fp16 CUDA batch whose weight, bias and input the kernel reads
    as they are (a block-scaled ``Fp8Linear``: up to ``skinny.FP8_BLOCK_DISPATCH_MAX_M`` rows).
    Anything else gets None and runs ``layer(x)`` (an ``Fp8Linear``: cuBLAS's scaled FP8 matmul)."""
    if not SKINNY_ENABLED or x.dim() != 2 or x.dtype not in (torch.bfloat16, torch.float16):
        return None
    if fused_ops_for(x) is None:  # also: Triton imports, so skinny does too
        return None
    skinny = _load_skinny()
    if x.shape[0] > skinny.DISPATCH_MAX_M or x.stride(1) != 1:
        return None
    # A tensor-parallel rank's column shard is a plain matmul over its rows; a row-parallel shard
    # all-reduces in its forward, which a kernel here would skip, so it runs ``layer(x)``.
    if type(layer) in (nn.Linear, ColumnParallelLinear):
        if _kernel_weight(layer, x) is None:
            return None
    elif type(layer) is not Fp8Linear or _fp8_weight(layer, x) is None:
        return None
    elif layer.block_scaled and x.shape[0] > skinny.FP8_BLOCK_DISPATCH_MAX_M:
        return None  # cuBLAS's block-scaled FP8 matmul is faster there
    bias = layer.bias
    if bias is not None and (bias.dtype != x.dtype or bias.device != x.device or bias.stride(0) != 1):
        return None
    return skinny


def _halves_fit(layer: nn.Module) -> bool:
    """Whether ``layer``'s rows split into SwiGLU's gate and up halves as the kernel reads them:
    an even count, and with 128x128 block scales whole blocks each."""
    rows = layer.weight.shape[0]
    if type(layer) is Fp8Linear and layer.block_scaled:
        return rows % (2 * FP8_BLOCK) == 0
    return rows % 2 == 0


LIGHT_PRODUCERS = ("norm", "attention")
"""Kernels that leave the memory bandwidth idle while they run (a norm on its own, the decode
attention reading little K/V): a one-row decode matmul after one loads its weights first."""


def linear(
    layer: nn.Linear | Fp8Linear, x: torch.Tensor, *, after: str | None = None, then: str | None = None
) -> torch.Tensor | SplitPartials:
    """``layer(x)``; decode-sized CUDA batches take the split-K kernels of ``skinny`` (an
    ``Fp8Linear``'s float8 weight and scales too).

    The caller (a block's ``forward_fused`` in ``pprun.models.llama``) says where the matmul sits in its model, and this
    dispatch decides the kernel's launch from it:

    ``after``: the kernel that produced ``x``.  After one of :data:`LIGHT_PRODUCERS` a decode
    matmul may load its weights before its wait on that kernel (``skinny.default_config``
    decides for which rows).

    ``then``: the kernel that consumes the output.  ``"norm"`` (a fused add + RMSNorm,
    ``fused.fused_add_rms_norm``) or ``"attention"`` (the one-kernel decode attention, see
    :func:`pprun.layers.attend.decode_kernel`) take a split-K matmul's partials and merge them
    as they read them, so from two rows on it returns :class:`SplitPartials` unmerged (not at one
    row: there the next norm folds into the matmul after it, :func:`norm_linear`, whose prologue
    reads a merged row).  Before the attention, which loads its own K/V ahead of its wait, the
    matmul holds no weight tile across its own wait.  None: anything else (a merged tensor).
    """
    check_defer_merge(then)
    skinny = _skinny_for(layer, x)
    if skinny is None:
        return layer(x)
    defer = then if DEFER_MERGE_ENABLED and x.shape[0] > 1 else None
    return skinny.skinny_linear(x, layer.weight, layer.bias, weights_ahead=after in LIGHT_PRODUCERS,
                                defer_merge=defer, hold_last=then != "attention", **_weight_scales(layer))


def linear_swiglu(layer: nn.Linear | Fp8Linear, x: torch.Tensor) -> torch.Tensor | None:
    """``silu(gate) * up`` of ``layer(x)`` (rows ``[gate; up]``) in one launch for decode-sized
    CUDA batches, or None: the caller then runs the matmul and activation itself."""
    skinny = _skinny_for(layer, x)
    if skinny is None or not _halves_fit(layer):
        return None
    return skinny.skinny_linear(x, layer.weight, layer.bias, swiglu=True, **_weight_scales(layer))


def norm_linear(
    norm: nn.Module, layer: nn.Linear | Fp8Linear, x: torch.Tensor, residual: torch.Tensor | None, swiglu: bool = False
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``layer`` applied to ``norm(x, residual)``'s output (with ``swiglu``, as
    :func:`linear_swiglu` applies it), in one launch, for a one-row CUDA batch: the add + RMSNorm
    runs as the prologue of ``skinny``'s matmul, so its own launch disappears.

    ``norm`` is an RMSNorm as ``pprun.layers.norm.RMSNorm`` defines it (``weight``, ``eps``, the
    residual add fused in).  Returns ``(out, new_residual)`` as ``norm`` and then the layer would,
    or None when the fold does not apply (then the caller runs ``norm`` and the layer itself):
    the fold switched off, more than one row, a layer ``_skinny_for`` refuses, a norm with hooks
    or a trainable weight, or a norm weight / residual of another dtype, device or layout.
    """
    if not NORM_FOLD_ENABLED or not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[0] != 1:
        return None
    skinny = _skinny_for(layer, x)
    if skinny is None or (swiglu and not _halves_fit(layer)):
        return None
    weight = _kernel_weight(norm, x)
    if weight is None or weight.shape != (x.shape[1],):
        return None
    if residual is not None and (
        residual.shape != x.shape
        or residual.dtype != x.dtype
        or residual.device != x.device
        or residual.stride(1) != 1
    ):
        return None
    return skinny.skinny_norm_linear(x, residual, weight, norm.eps, layer.weight, layer.bias, swiglu=swiglu,
                                     **_weight_scales(layer))
