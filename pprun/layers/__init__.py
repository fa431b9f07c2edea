"""Model-agnostic layer ops, and the switch that routes CUDA tensors to their fused Triton kernels.

``fused_ops_for(t)`` is what a model calls at an op's call site: it returns the
``pprun.layers.fused`` module when ``t`` is on CUDA, Triton imports and fusion is enabled, and
``None`` otherwise (the caller then runs its plain torch code, which stays the CPU / HF-parity
reference).  ``fused`` is imported lazily, on the first CUDA tensor, so a CPU-only run never
imports Triton and a test can set ``TRITON_INTERPRET`` before the kernels are decorated.
"""

from __future__ import annotations

import os
from types import ModuleType

import torch

FUSED_ENABLED: bool = os.environ.get("PPRUN_DISABLE_FUSED", "") in ("", "0")
"""False when ``PPRUN_DISABLE_FUSED`` is set (to anything but ``0``); tests may flip it."""

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
