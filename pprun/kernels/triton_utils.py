"""What every Triton kernel module of pprun shares: interpreter detection, the no-FMA compile
option, and programmatic dependent launch (PDL).

PDL (Hopper and later): a kernel launched with ``launch_pdl=True`` may be scheduled while the
kernel before it on the stream is still running.  It must call :func:`gdc_wait` before it
reads anything an earlier kernel wrote or writes anything an earlier kernel may still read;
what it does before that (address arithmetic, loading weights, which no kernel writes) overlaps
the previous kernel's tail and the launch gap.  Each kernel calls :func:`pdl_sync` (wait, then
let the next kernel be scheduled) under a ``USE_PDL`` constexpr that :func:`pdl_options` sets
together with the launch flag, so GPUs before sm_90 never see the instructions.  Switching PDL
off (``PPRUN_DISABLE_PDL=1``, the A/B switch of ``scripts/gpu_speed.py``) changes only the
launch.  The CPU interpreter gets no-ops.

Under the interpreter this module also mends one of its bugs (:func:`_patch_interpreter_splat`)
before any kernel runs: every kernel module imports it first.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch
import triton
import triton.language as tl

from pprun.switches import enabled_unless

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
"""True under the Triton CPU interpreter (tests)."""

NO_FMA = {} if INTERPRETED else {"enable_fp_fusion": False}
"""Compile option, passed at launch: no mul+add -> fma contraction (torch rounds in between)."""


def _patch_interpreter_splat() -> None:
    """Make the interpreter's splat of a boolean (``int1``) scalar give numpy ``bool`` data.

    The interpreter gives a comparison's result the numpy dtype ``bool`` but the *operands'*
    Triton dtype (``n < end`` on int32 is an int32 handle holding a bool), and its
    ``create_splat`` picks the numpy dtype from that handle dtype: broadcasting such a scalar
    into a block (``mask & write_residual``, ``g_mask & merged_s``) yields an ``int1`` block
    that holds int32 0/1.  Up to Triton 3.8 the native load, store and atomics took any integer
    mask (nonzero: on); since 3.9.0 they accept numpy ``bool`` only and raise ``ValueError:
    mask has unsupported dtype``.  The splat is mended here (its data cast to ``bool`` and its
    handle typed ``int1`` when the block's element type is ``int1``), for every Triton version,
    so that 3.7 and 3.9 interpret alike.  Interpreter only: compiled kernels are untouched."""
    import numpy as np
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    splat = builder.create_splat
    if getattr(splat, "_pprun_bool_splat", False):
        return

    def create_splat(self, ret_ty, arg):
        out = splat(self, ret_ty, arg)
        if ret_ty.scalar == tl.int1 and out.data.dtype != np.bool_:
            out = interpreter.TensorHandle(out.data.astype(np.bool_), tl.int1)
        return out

    create_splat._pprun_bool_splat = True  # type: ignore[attr-defined]
    builder.create_splat = create_splat


if INTERPRETED:
    _patch_interpreter_splat()

PDL_ENABLED: bool = enabled_unless("PPRUN_DISABLE_PDL")
"""False when ``PPRUN_DISABLE_PDL`` is set; tests and benchmarks may flip it."""

try:
    if INTERPRETED:
        raise ImportError("the interpreter has no grid dependency control")
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    _HAS_GDC = True
except ImportError:
    _HAS_GDC = False

    @triton.jit
    def gdc_wait():  # type: ignore[no-redef]
        """No-op stand-in (interpreter, or a Triton without grid dependency control)."""

    @triton.jit
    def gdc_launch_dependents():  # type: ignore[no-redef]
        """No-op stand-in (interpreter, or a Triton without grid dependency control)."""


@triton.jit
def pdl_sync(USE_PDL: tl.constexpr):
    """Wait for the previous kernel, then let the next one be scheduled (PDL).  Compiled in only
    when ``USE_PDL``: the ``griddepcontrol`` instructions exist on sm_90 and later only."""
    if USE_PDL:
        gdc_wait()
        gdc_launch_dependents()


_force_pdl = False


@contextlib.contextmanager
def force_pdl() -> Iterator[None]:
    """Launch PDL kernels eagerly too (CUDA-graph warm-up: the PDL variants are compiled and
    loaded before capture, not during it)."""
    global _force_pdl
    previous, _force_pdl = _force_pdl, True
    try:
        yield
    finally:
        _force_pdl = previous


def pdl_options(device: torch.device) -> dict[str, bool]:
    """Launch keyword arguments for a kernel with a ``USE_PDL`` constexpr: PDL on while a CUDA
    graph is being captured (or under :func:`force_pdl`) on a GPU that supports it (compute
    capability 9.0+), off otherwise.

    Only under capture: there the overlap is baked into the graph once, while an eager PDL
    launch costs more host time than its overlap saves (docs/performance.md, "Launch
    settings")."""
    on = (
        PDL_ENABLED
        and _HAS_GDC
        and device.type == "cuda"
        and (_force_pdl or torch.cuda.is_current_stream_capturing())
        and _capability(device) >= 9
    )
    return {"USE_PDL": True, "launch_pdl": True} if on else {"USE_PDL": False}


_capabilities: dict[int, int] = {}


def _capability(device: torch.device) -> int:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _capabilities:
        _capabilities[index] = torch.cuda.get_device_capability(index)[0]
    return _capabilities[index]
