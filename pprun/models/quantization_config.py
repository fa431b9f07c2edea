"""A checkpoint's ``quantization_config``, read at config validation: run it exactly or refuse it.

A quantized checkpoint stores what a plain cast would corrupt (float8 or integer weights beside
their scales).  Loading it as if it were a floating-point checkpoint gives wrong tokens without
a word, so ``config.json``'s ``quantization_config`` (or the older ``compression_config`` of
compressed-tensors) is read here, before any process starts: a method pprun runs is described by
a :class:`QuantizationArch` the model is built from; any other method is refused by name.
Nothing here imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUPPORTED_QUANTIZATION_METHODS: tuple[str, ...] = ()
"""``quant_method`` values pprun runs (none yet: every quantized checkpoint is refused)."""


@dataclass(frozen=True)
class QuantizationArch:
    """A quantization method pprun runs, as the checkpoint's config describes it."""

    method: str
    """``quantization_config.quant_method``."""


def read_quantization_config(config: dict[str, Any], model_dir: Path, source: Path) -> QuantizationArch | None:
    """The checkpoint's quantization method, or None for a floating-point checkpoint.

    Raises ValueError naming the method, the checkpoint and the supported methods when
    ``config.json`` names a method pprun does not run, or names none in a quantization config.
    """
    for key in ("quantization_config", "compression_config"):
        qc = config.get(key)
        if qc is None:
            continue
        supported = ", ".join(SUPPORTED_QUANTIZATION_METHODS) or "none (floating-point checkpoints only)"
        if not isinstance(qc, dict):
            raise ValueError(f"{source}: {key}={qc!r} must be a mapping with a quant_method")
        method = qc.get("quant_method")
        if method not in SUPPORTED_QUANTIZATION_METHODS:
            named = f"quant_method={method!r}" if method is not None else "no quant_method"
            raise ValueError(
                f"checkpoint model.model={str(model_dir)!r} is quantized ({key} with {named} in {source}), "
                f"which pprun does not run; supported quantization methods: {supported}. Loading its "
                "tensors as plain weights would give wrong tokens, so it is refused."
            )
        return QuantizationArch(method=str(method))
    return None
