"""The weight loader of a quantized checkpoint: which tensors each quantized weight owns, what
they must look like, and the weights they make.

:class:`Fp8WeightLoader` follows a :class:`~pprun.models.quantization_config.QuantizationArch`:
for every linear weight a stage reads, the config says whether it is quantized; a quantized one
must be stored as float8 e4m3 beside its scale (and, for static activations, its input scale)
of the shape the scheme implies, and an unquantized one must not be float8.  The weights are
dequantized at load (float8 x scale in float32, then the run's dtype), on the stage's device, so
a run computes on exactly the weights the checkpoint stores and CPU tests compare exactly with
``transformers`` on the dequantized weights.  Stored input scales are checked and accounted for;
activations are not quantized on this path (it runs the checkpoint's weights, not its
activation rounding).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Protocol

import torch

from pprun.distributed.tensor_parallel import TensorParallel
from pprun.layers.parallel_linear import ColumnParallelLinear, RowParallelLinear, Shard
from pprun.models.hf_config import ModelArchConfig, MoeArch
from pprun.models.quantization_config import (
    ONLINE_FP8_METHOD,
    QUANTIZABLE_ARCHITECTURES,
    SUPPORTED_QUANTIZATION_METHODS,
    QuantizationArch,
    WeightScheme,
)

FP8_DTYPE = torch.float8_e4m3fn


class CheckpointIndex(Protocol):
    """What the loader reads a checkpoint through (``pprun.models.checkpoint.CheckpointIndex``,
    which imports this module's users: a protocol keeps the import graph acyclic)."""

    def __contains__(self, name: object) -> bool: ...
    def shape(self, name: str) -> tuple[int, ...]: ...
    def dtype(self, name: str) -> torch.dtype: ...
    def load(self, names: Iterable[str], device: torch.device | str = "cpu",
             dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]: ...
    def iter_tensors(self, names: Iterable[str], device: torch.device | str = "cpu",
                     dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]: ...


class Fp8WeightLoader:
    """Reads one stage's weights from an FP8 checkpoint (see the module docstring)."""

    def __init__(self, arch: ModelArchConfig, quant: QuantizationArch) -> None:
        self.arch = arch
        self.quant = quant

    def scheme(self, name: str) -> WeightScheme | None:
        """How checkpoint tensor ``name`` is quantized; None when it is read as stored (not a
        linear weight, or one the config leaves in floating point)."""
        if not name.endswith(".weight"):
            return None
        module = name.removesuffix(".weight")
        is_linear = module == "lm_head" or (".layers." in module and not module.endswith("norm"))
        return self.quant.scheme_for(module) if is_linear else None

    def scale_name(self, name: str) -> str:
        """The checkpoint name of quantized weight ``name``'s scale."""
        return name.removesuffix("weight") + self.scheme(name).scale_name

    def owned_names(self, names: Iterable[str]) -> list[str]:
        """The scale tensors the quantized ones of ``names`` own (what the stage also reads)."""
        if self.quant.online:
            return []
        owned = []
        for name in names:
            scheme = self.scheme(name)
            if scheme is not None:
                base = name.removesuffix("weight")
                owned.append(base + scheme.scale_name)
                if scheme.static_input_scale:
                    owned.append(base + "input_scale")
        return owned

    def scale_shape(self, scheme: WeightScheme, weight_shape: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
        """The shapes a weight's scale may be stored in (a scalar may be stored as ``[]`` or ``[1]``)."""
        rows, cols = weight_shape
        if scheme.strategy == "block":
            return ((math.ceil(rows / scheme.block[0]), math.ceil(cols / scheme.block[1])),)
        if scheme.strategy == "channel":
            return ((rows, 1), (rows,))
        return ((), (1,))

    def problems(self, index: CheckpointIndex, names: Iterable[str]) -> list[str]:
        """What in ``names`` (and the scales they own) disagrees with the config: each as
        ``tensor: what is wrong`` (headers only)."""
        out = []
        for name in names:
            scheme = self.scheme(name)
            stored = index.dtype(name)
            if self.quant.online:  # floating-point weights, quantized here
                if stored not in (torch.float32, torch.bfloat16, torch.float16):
                    out.append(f"{name}: stored as {_short(stored)}; online FP8 quantizes floating-point weights")
                continue
            if scheme is None:
                if stored not in (torch.float64, torch.float32, torch.bfloat16, torch.float16):
                    out.append(f"{name}: stored as {_short(stored)}, but the quantization_config leaves "
                               f"this module in floating point ({self.quant.method})")
                continue
            if stored != FP8_DTYPE:
                out.append(f"{name}: stored as {_short(stored)}; the quantization_config "
                           f"({self.quant.method}, {scheme.strategy}) quantizes it to float8_e4m3fn")
                continue
            base = name.removesuffix("weight")
            scale = base + scheme.scale_name
            allowed = self.scale_shape(scheme, index.shape(name))
            if scale not in index:
                out.append(f"{scale}: missing (the scale of {name}, {scheme.strategy}-wise)")
            elif index.shape(scale) not in allowed or index.dtype(scale) not in (
                    torch.float32, torch.bfloat16, torch.float16):
                out.append(f"{scale}: shape {index.shape(scale)} {_short(index.dtype(scale))}; a "
                           f"{scheme.strategy}-wise scale of a {index.shape(name)} weight is "
                           f"{' or '.join(str(s) for s in allowed)} floating point")
            if scheme.static_input_scale:
                input_scale = base + "input_scale"
                if input_scale not in index:
                    out.append(f"{input_scale}: missing (static activations need it)")
                elif index.shape(input_scale) not in ((), (1,)):
                    out.append(f"{input_scale}: shape {index.shape(input_scale)}; a per-tensor scale is () or (1,)")
        return out

    def iter_tensors(
        self, index: CheckpointIndex, names: list[str], device: torch.device | str, dtype: torch.dtype,
        keep_fp8: set[str] | frozenset[str] = frozenset(),
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, tensor)`` for each of ``names``: quantized weights dequantized with their
        scales, the rest cast to ``dtype`` as :meth:`CheckpointIndex.iter_tensors` casts.

        ``keep_fp8``: weights the model holds in float8 (``LinearFactory.fp8_weight_names``):
        these come as stored, each followed by its scale under its checkpoint name."""
        plain = [n for n in names if self.scheme(n) is None]
        yield from index.iter_tensors(plain, device=device, dtype=dtype)
        for name in names:
            scheme = self.scheme(name)
            if scheme is None:
                continue
            scale_name = name.removesuffix("weight") + scheme.scale_name
            if self.quant.online:
                weight, scale = quantize(index.load([name], device=device)[name], scheme)
                raw = {name: weight, scale_name: scale}
            else:
                raw = index.load([name, scale_name], device=device)
            if name in keep_fp8:
                yield name, raw[name]
                yield scale_name, raw[scale_name].to(torch.float32)
                continue
            weight = dequantize(raw[name], raw[scale_name], scheme)
            yield name, weight.to(dtype)


def dequantize(weight: torch.Tensor, scale: torch.Tensor, scheme: WeightScheme) -> torch.Tensor:
    """``weight`` (float8) times its scale, in float32: one scale per ``block`` tile, per output
    row (``channel``) or for the whole tensor."""
    w = weight.to(torch.float32)
    s = scale.to(torch.float32)
    if scheme.strategy == "block":
        rows, cols = w.shape
        block_rows, block_cols = scheme.block
        s = s.repeat_interleave(block_rows, 0)[:rows].repeat_interleave(block_cols, 1)[:, :cols]
        return w * s
    if scheme.strategy == "channel":
        return w * s.reshape(-1, 1)
    return w * s.reshape(())


def quantize(weight: torch.Tensor, scheme: WeightScheme) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` as float8 e4m3 and its float32 scale, :func:`dequantize`'s inverse up to
    rounding: each block's, row's or the tensor's largest magnitude maps to 448."""
    w = weight.to(torch.float32)
    if scheme.strategy == "block":
        rows, cols = w.shape
        block_rows, block_cols = scheme.block
        padded = torch.zeros(math.ceil(rows / block_rows) * block_rows, math.ceil(cols / block_cols) * block_cols,
                             device=w.device)
        padded[:rows, :cols] = w
        tiles = padded.view(padded.shape[0] // block_rows, block_rows, padded.shape[1] // block_cols, block_cols)
        scale = (tiles.abs().amax(dim=(1, 3)) / 448.0).clamp(min=1e-12)
        expanded = scale.repeat_interleave(block_rows, 0)[:rows].repeat_interleave(block_cols, 1)[:, :cols]
    elif scheme.strategy == "channel":
        scale = (w.abs().amax(dim=1, keepdim=True) / 448.0).clamp(min=1e-12)
        expanded = scale
    else:
        scale = (w.abs().max() / 448.0).clamp(min=1e-12).reshape(1)
        expanded = scale
    return (w / expanded).clamp(-448.0, 448.0).to(FP8_DTYPE), scale


def weight_loader(arch: ModelArchConfig) -> Fp8WeightLoader | None:
    """The quantization method's weight loader for ``arch``; None for a floating-point checkpoint."""
    if arch.quantization is None:
        return None
    return Fp8WeightLoader(arch, arch.quantization)


def _short(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class LinearFactory:
    """Builds each linear layer of a decoder in the form the checkpoint and the run call for: an
    :class:`~pprun.layers.fp8_linear.Fp8Linear` keeping an FP8 checkpoint's weights where the
    run multiplies in FP8 (:func:`~pprun.layers.fp8_linear.fp8_compute_supported`) and the
    layer's shape fits, else a plain ``nn.Linear`` (whose FP8 weights the loader dequantizes);
    with tensor parallelism (``tp.size > 1``) this rank's shard of it
    (:mod:`pprun.layers.parallel_linear`: :meth:`column` and :meth:`row`).

    The model file names its layers through it (``pprun.models.llama``); :attr:`fp8_weight_names`
    is then what the loader hands over as stored (:meth:`Fp8WeightLoader.iter_tensors`).
    """

    def __init__(self, arch: ModelArchConfig, device: torch.device, dtype: torch.dtype,
                 tp: TensorParallel | None = None) -> None:
        from pprun.layers.fp8_linear import fp8_compute_supported

        self.tp = tp if tp is not None else TensorParallel.single()
        self.quant = arch.quantization
        if self.quant is not None and self.tp.size > 1:
            raise ValueError(f"tensor_parallel_size={self.tp.size} with a quantized checkpoint "
                             f"({self.quant.method}) is not supported; use tensor_parallel_size=1")
        self.compute_fp8 = self.quant is not None and fp8_compute_supported(torch.device(device), dtype)
        self.fp8_weight_names: set[str] = set()
        """Checkpoint weight names held in float8 by an ``Fp8Linear``."""

    def __call__(self, modules: list[str], in_features: int, rows: list[int], bias: bool) -> torch.nn.Module:
        """The whole layer computing checkpoint ``modules`` (their names without ``.weight``;
        several when fused, e.g. q, k and v) of ``rows`` output rows each from ``in_features``."""
        from pprun.layers.fp8_linear import Fp8Linear, fits_fp8_compute

        if self.compute_fp8:
            schemes = {self.quant.scheme_for(m) for m in modules}
            scheme = schemes.pop() if len(schemes) == 1 else None
            if scheme is not None and fits_fp8_compute(scheme.block, in_features, rows):
                self.fp8_weight_names.update(f"{m}.weight" for m in modules)
                return Fp8Linear(in_features, sum(rows), bias, block_scaled=scheme.strategy == "block")
        return torch.nn.Linear(in_features, sum(rows), bias=bias)

    def fp8_experts(self, prefix: str, moe: MoeArch) -> WeightScheme | None:
        """The scheme of the sparse block ``prefix``'s experts (its checkpoint name:
        ``model.layers.3.mlp``) where they stay float8 with their scales
        (``pprun.models.moe.SparseMoeBlock``), their weights then in :attr:`fp8_weight_names`;
        None where the loader dequantizes them: no FP8 compute on this run
        (:func:`~pprun.layers.fp8_linear.fp8_compute_supported`), ``PPRUN_DISABLE_FP8_MOE``, experts
        left in floating point or under different schemes, blocks other than 128x128."""
        from pprun.layers import moe as moe_ops
        from pprun.models.moe import SCALE_BLOCK

        if not (self.compute_fp8 and moe_ops.FP8_EXPERTS_ENABLED):
            return None
        modules = [f"{prefix}.experts.{e}.{proj}" for e in range(moe.num_experts) for proj in moe.expert_names]
        schemes = {self.quant.scheme_for(m) for m in modules}
        scheme = schemes.pop() if len(schemes) == 1 else None
        if scheme is None or (scheme.strategy == "block" and scheme.block != (SCALE_BLOCK, SCALE_BLOCK)):
            return None
        self.fp8_weight_names.update(f"{m}.weight" for m in modules)
        return scheme

    def column(self, modules: list[str], in_features: int, shards: list[Shard], bias: bool) -> torch.nn.Module:
        """A column-parallel layer: this rank's ``shards`` (rows) of ``modules`` fused; at tp 1
        (every shard whole) the layer :meth:`__call__` builds."""
        if self.tp.size == 1:
            return self(modules, in_features, [s.size for s in shards], bias)
        return ColumnParallelLinear(modules, in_features, shards, bias)

    def row(self, module: str, in_features: int, out_features: int, bias: bool) -> torch.nn.Module:
        """A row-parallel layer (its input split, its output all-reduced); at tp 1 the layer
        :meth:`__call__` builds."""
        if self.tp.size == 1:
            return self([module], in_features, [out_features], bias)
        return RowParallelLinear(module, in_features, out_features, bias, self.tp)


def with_online_quantization(arch: ModelArchConfig, requested: str | None, model_dir: Path) -> ModelArchConfig:
    """``arch`` as the run quantizes it: ``requested`` (``model.quantization``) None leaves it
    as read; ``fp8`` on a floating-point checkpoint quantizes the decoder linears (not routers,
    not the LM head) per output row at load; on an FP8 checkpoint it is what the checkpoint
    already is.  Another quantization method with ``fp8`` requested is a ValueError."""
    if requested is None:
        return arch
    if arch.quantization is not None:
        if arch.quantization.method in SUPPORTED_QUANTIZATION_METHODS:  # FP8 already
            return arch
        raise ValueError(f"model.quantization={requested!r}, but {model_dir} is quantized by "
                         f"{arch.quantization.method}")
    if arch.architecture not in QUANTIZABLE_ARCHITECTURES:
        raise ValueError(f"model.quantization={requested!r} is not supported for {arch.architecture}; "
                         f"it is for {', '.join(QUANTIZABLE_ARCHITECTURES)}")
    scheme = WeightScheme("channel", None, "weight_scale", False)
    return replace(arch, quantization=QuantizationArch(ONLINE_FP8_METHOD, ((("Linear",), scheme),), (),
                                                       routers_quantizable=False, online=True))
