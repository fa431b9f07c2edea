"""Where Triton kernels can run in tests: natively on CUDA, or on CPU through the Triton
interpreter when ``PPRUN_TEST_TRITON_INTERPRET=1``.  Import this before any module that defines
Triton kernels: ``triton.jit`` reads ``TRITON_INTERPRET`` when a kernel is decorated."""

from __future__ import annotations

import importlib.util
import os

import torch

HAS_CUDA = torch.cuda.is_available()
USE_INTERPRETER = (
    not HAS_CUDA
    and os.environ.get("PPRUN_TEST_TRITON_INTERPRET") == "1"
    and importlib.util.find_spec("triton") is not None
)
if USE_INTERPRETER:
    os.environ["TRITON_INTERPRET"] = "1"
RUN_TRITON = importlib.util.find_spec("triton") is not None and (HAS_CUDA or USE_INTERPRETER)
DEVICE = "cuda" if HAS_CUDA else "cpu"


def count_calls_by_form(monkeypatch, module, name: str) -> dict[str, int]:
    """Wrap ``module.name`` (one of ``pprun.layers.skinny``'s matmuls) so that each call is
    counted as ``"swiglu"`` or ``"plain"``; returns the live counts."""
    calls = {"plain": 0, "swiglu": 0}
    original = getattr(module, name)

    def counted(*args, **kwargs):
        calls["swiglu" if kwargs.get("swiglu") else "plain"] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls
