"""Where Triton kernels can run in tests: natively on CUDA, or on CPU through the Triton
interpreter, which is the default without CUDA when Triton is installed (the whole suite takes
~25 s longer on 2 cores; ``PPRUN_TEST_TRITON_INTERPRET=0`` turns it off).  ``conftest.py`` imports
this first: ``triton.jit`` reads ``TRITON_INTERPRET`` when a kernel is decorated.  The
interpreter has no compiler; ``sm90_compile`` compiles for sm_90 in a fresh process instead."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
USE_INTERPRETER = (
    not HAS_CUDA
    and os.environ.get("PPRUN_TEST_TRITON_INTERPRET", "1") != "0"
    and importlib.util.find_spec("triton") is not None
)
if USE_INTERPRETER:
    os.environ["TRITON_INTERPRET"] = "1"
RUN_TRITON = importlib.util.find_spec("triton") is not None and (HAS_CUDA or USE_INTERPRETER)
DEVICE = "cuda" if HAS_CUDA else "cpu"
triton_only = pytest.mark.skipif(
    not RUN_TRITON, reason="needs CUDA or triton (the interpreter, unless PPRUN_TEST_TRITON_INTERPRET=0)"
)
"""Marks a test of a Triton kernel: skipped where no kernel can run."""


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
