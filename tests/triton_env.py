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
