"""A checkpoint's ``quantization_config``, read at config validation: run it exactly or refuse it.

A quantized checkpoint stores what a plain cast would corrupt (float8 or integer weights beside
their scales).  Loading it as if it were a floating-point checkpoint gives wrong tokens without
a word, so ``config.json``'s ``quantization_config`` (or the older ``compression_config`` of
compressed-tensors) is read here, before any process starts: a method pprun runs becomes a
:class:`QuantizationArch` (which weights are quantized, how their scales are laid out) that the
weight loader (:mod:`pprun.models.quantization`) follows; any other method, or a setting of a
supported method that pprun does not run, is refused by name.  Nothing here imports torch.

The FP8 layouts pprun reads:

- ``quant_method: fp8`` (Hugging Face's fine-grained FP8, the layout of Qwen3-FP8 and
  DeepSeek-V3): float8 e4m3 ``*.weight`` with ``*.weight_scale_inv`` per 128x128 block
  (``weight_block_size``), or, without a block size, one ``*.weight_scale`` per tensor;
  ``activation_scheme`` ``dynamic`` or ``static`` (then ``*.input_scale``);
  ``modules_to_not_convert`` names modules left in floating point (substring match, as
  transformers matches it).
- ``quant_method: compressed-tensors`` with ``format: float-quantized`` (llm-compressor's
  "FP8-dynamic" and "FP8" checkpoints): 8-bit float weights per ``channel``, ``tensor`` or
  ``block`` (``*.weight_scale``), input activations dynamic or static per ``token``, ``tensor``
  or ``group`` (static: ``*.input_scale``); ``targets`` ``Linear`` or ``re:`` patterns; the
  ``ignore`` list by exact module name or ``re:`` regular expression.

Routers, embeddings, norms and the LM head stay in floating point unless the config's targets
say otherwise and the checkpoint agrees; the loader checks every quantized weight is stored as
float8 e4m3 with scales of the shape its scheme implies, and every other weight is not.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUPPORTED_QUANTIZATION_METHODS: tuple[str, ...] = ("fp8", "compressed-tensors")
"""``quant_method`` values pprun runs (FP8 weights; see the module docstring)."""

QUANTIZABLE_ARCHITECTURES: tuple[str, ...] = (
    "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM", "MixtralForCausalLM",
)
"""Architectures whose quantized checkpoints pprun loads (dense and mixture-of-experts text
decoders; a quantized Llava or Whisper is refused)."""


@dataclass(frozen=True)
class WeightScheme:
    """How one group of weights is quantized."""

    strategy: str
    """``block`` (a scale per ``block`` tile), ``channel`` (per output row) or ``tensor``."""
    block: tuple[int, int] | None
    """Rows x columns of a block (``block`` only)."""
    scale_name: str
    """The scale tensor's suffix beside ``weight``: ``weight_scale_inv`` or ``weight_scale``."""
    static_input_scale: bool
    """Activations are quantized with a stored ``input_scale`` (static) rather than per step."""


@dataclass(frozen=True)
class QuantizationArch:
    """A quantization method pprun runs, as the checkpoint's config describes it."""

    method: str
    """``quantization_config.quant_method``."""
    groups: tuple[tuple[tuple[str, ...], WeightScheme], ...]
    """``(targets, scheme)`` pairs: a linear module matching a target (``Linear``: every linear;
    ``re:PATTERN``: a module name) is quantized by the first group it matches."""
    ignore: tuple[str, ...]
    """Modules left in floating point: ``re:PATTERN`` (matched from the name's start), or a name
    matched exactly (compressed-tensors) or as a substring (``fp8``)."""
    routers_quantizable: bool
    """The config may quantize a mixture-of-experts router (compressed-tensors targets every
    ``Linear`` unless ignored); ``fp8`` never does (transformers and vLLM keep routers dense)."""
    online: bool = False
    """The checkpoint stores floating-point weights that pprun quantizes at load
    (``model.quantization=fp8``); no scales are stored."""

    def scheme_for(self, module: str) -> WeightScheme | None:
        """The scheme quantizing linear ``module`` (its name without ``.weight``), or None when
        the config leaves it in floating point."""
        if self.method in ("fp8", ONLINE_FP8_METHOD) and module == "lm_head":
            return None
        for pattern in self.ignore:
            if pattern.startswith("re:"):
                if re.match(pattern[3:], module):
                    return None
            elif (pattern in module) if self.method == "fp8" else (pattern == module):
                return None
        if not self.routers_quantizable and _is_router(module):
            return None
        for targets, scheme in self.groups:
            for target in targets:
                if target == "Linear" or (target.startswith("re:") and re.match(target[3:], module)):
                    return scheme
        return None


def _is_router(module: str) -> bool:
    return module.endswith(".mlp.gate") or module.endswith(".block_sparse_moe.gate")


def read_quantization_config(
    config: dict[str, Any], model_dir: Path, source: Path, architecture: str
) -> QuantizationArch | None:
    """The checkpoint's quantization method, or None for a floating-point checkpoint.

    Raises ValueError naming the method (or the setting), the checkpoint and what pprun supports
    when ``config.json`` names a method pprun does not run, a setting of a supported method it
    does not run, or no method in a quantization config, or when ``architecture`` (the model's,
    ``config.json``'s top level) is not one whose quantized checkpoints pprun loads.
    """
    for key in ("quantization_config", "compression_config"):
        qc = config.get(key)
        if qc is None:
            continue
        supported = ", ".join(SUPPORTED_QUANTIZATION_METHODS)
        if not isinstance(qc, dict):
            raise ValueError(f"{source}: {key}={qc!r} must be a mapping with a quant_method")
        method = qc.get("quant_method")
        if method not in SUPPORTED_QUANTIZATION_METHODS:
            named = f"quant_method={method!r}" if method is not None else "no quant_method"
            raise ValueError(
                f"checkpoint model.model={str(model_dir)!r} is quantized ({key} with {named} in {source}), "
                f"which pprun does not run; supported quantization methods: {supported} (FP8 weights). "
                "Loading its tensors as plain weights would give wrong tokens, so it is refused."
            )

        def refuse(field: str, value: Any, allowed: str, key: str = key, method: str = method) -> ValueError:
            return ValueError(
                f"checkpoint model.model={str(model_dir)!r}: {key}.{field}={value!r} ({method}) is not "
                f"supported; pprun runs {allowed}"
            )

        if architecture not in QUANTIZABLE_ARCHITECTURES:
            raise ValueError(
                f"checkpoint model.model={str(model_dir)!r}: a quantized {architecture} ({key}.quant_method="
                f"{method!r}) is not supported; pprun loads quantized checkpoints of "
                + ", ".join(QUANTIZABLE_ARCHITECTURES)
            )
        if method == "fp8":
            return _read_fp8(qc, refuse)
        return _read_compressed_tensors(qc, refuse)
    return None


def _read_fp8(qc: dict[str, Any], refuse) -> QuantizationArch:
    """Hugging Face's fine-grained FP8 config (``quant_method: fp8``)."""
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise refuse("fmt", fmt, "float8 e4m3 weights")
    activation = qc.get("activation_scheme", "dynamic")
    if activation not in ("dynamic", "static"):
        raise refuse("activation_scheme", activation, "'dynamic' or 'static'")
    block = qc.get("weight_block_size")
    if block is not None:
        if (not isinstance(block, list | tuple) or len(block) != 2
                or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
            raise refuse("weight_block_size", block, "two positive integers, e.g. [128, 128]")
        if activation == "static":
            raise refuse("activation_scheme", activation, "dynamic activations with block-wise weights")
        scheme = WeightScheme("block", (block[0], block[1]), "weight_scale_inv", False)
    else:
        scheme = WeightScheme("tensor", None, "weight_scale", activation == "static")
    ignore = qc.get("modules_to_not_convert") or qc.get("ignored_layers") or []
    if not isinstance(ignore, list) or not all(isinstance(m, str) for m in ignore):
        raise refuse("modules_to_not_convert", ignore, "a list of module names")
    return QuantizationArch("fp8", ((("Linear",), scheme),), tuple(ignore), routers_quantizable=False)


def _read_compressed_tensors(qc: dict[str, Any], refuse) -> QuantizationArch:
    """compressed-tensors' ``float-quantized`` format (8-bit float weights)."""
    fmt = qc.get("format")
    if fmt != "float-quantized":
        raise refuse("format", fmt, "'float-quantized' (FP8 weights)")
    if qc.get("kv_cache_scheme") is not None:
        raise refuse("kv_cache_scheme", qc["kv_cache_scheme"], "an unquantized KV cache (null)")
    groups_cfg = qc.get("config_groups")
    if not isinstance(groups_cfg, dict) or not groups_cfg:
        raise refuse("config_groups", groups_cfg, "one or more groups of FP8 weights")
    groups = []
    for group_name, group in groups_cfg.items():
        prefix = f"config_groups.{group_name}"
        if not isinstance(group, dict):
            raise refuse(prefix, group, "a mapping with targets, weights and input_activations")
        targets = group.get("targets")
        if not isinstance(targets, list) or not targets or not all(
                isinstance(t, str) and (t == "Linear" or t.startswith("re:")) for t in targets):
            raise refuse(f"{prefix}.targets", targets, "'Linear' or 're:' patterns of module names")
        weights = group.get("weights") or {}
        if not isinstance(weights, dict) or weights.get("type") != "float" or weights.get("num_bits") != 8:
            raise refuse(f"{prefix}.weights", weights, "8-bit float weights (type 'float', num_bits 8)")
        if weights.get("dynamic"):
            raise refuse(f"{prefix}.weights.dynamic", True, "weights quantized in the checkpoint")
        if weights.get("symmetric", True) is not True:
            raise refuse(f"{prefix}.weights.symmetric", weights.get("symmetric"), "symmetric weights")
        strategy = weights.get("strategy")
        block = None
        if strategy == "block":
            block = weights.get("block_structure")
            if not isinstance(block, list) or len(block) != 2 or not all(
                    isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block):
                raise refuse(f"{prefix}.weights.block_structure", block, "two positive integers")
            block = (block[0], block[1])
        elif strategy not in ("channel", "tensor"):
            raise refuse(f"{prefix}.weights.strategy", strategy, "'channel', 'tensor' or 'block'")
        acts = group.get("input_activations")
        static_input = False
        if acts is not None:
            if not isinstance(acts, dict) or acts.get("type") != "float" or acts.get("num_bits") != 8:
                raise refuse(f"{prefix}.input_activations", acts, "8-bit float activations or none")
            if acts.get("strategy") not in ("token", "tensor", "group"):
                raise refuse(f"{prefix}.input_activations.strategy", acts.get("strategy"),
                             "'token', 'tensor' or 'group'")
            static_input = not acts.get("dynamic", False)
            if static_input and acts.get("strategy") != "tensor":
                raise refuse(f"{prefix}.input_activations.strategy", acts.get("strategy"),
                             "static activation scales per tensor")
        groups.append((tuple(targets), WeightScheme(strategy, block, "weight_scale", static_input)))
    ignore = qc.get("ignore") or []
    if not isinstance(ignore, list) or not all(isinstance(m, str) for m in ignore):
        raise refuse("ignore", ignore, "a list of module names or 're:' patterns")
    return QuantizationArch("compressed-tensors", tuple(groups), tuple(ignore), routers_quantizable=True)


ONLINE_FP8_METHOD = "fp8 (online)"
"""What :func:`with_online_quantization` names the method it adds (logs and errors)."""

