"""What every Triton kernel module of pprun shares: interpreter detection, the no-FMA compile
option, and programmatic dependent launch (PDL).

PDL (Hopper and later): a kernel launched with ``launch_pdl=True`` may be scheduled while the
kernel before it on the stream is still running.  It must call :func:`gdc_wait` before it
reads anything an earlier kernel wrote or writes anything an earlier kernel may still read;
what it does before that (address arithmetic, loading weights, which no kernel writes) overlaps
the previous kernel's tail and the launch gap.  Each kernel calls :func:`gdc_launch_dependents`
early so that the next one can be scheduled.  ``gdc_wait`` is a no-op for a kernel launched
without PDL, so switching PDL off (``PPRUN_DISABLE_PDL=1``, the A/B switch of
``scripts/gpu_speed.py``) changes only the launch.  The CPU interpreter gets no-ops.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl  # noqa: F401  (the interpreter wants it visible to jit functions)

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
"""True under the Triton CPU interpreter (tests)."""

NO_FMA = {} if INTERPRETED else {"enable_fp_fusion": False}
"""Compile option, passed at launch: no mul+add -> fma contraction (torch rounds in between)."""

PDL_ENABLED: bool = os.environ.get("PPRUN_DISABLE_PDL", "") in ("", "0")
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


def pdl_launch(device: torch.device) -> dict[str, bool]:
    """Launch options for a kernel written for PDL: ``{"launch_pdl": True}`` while a CUDA graph
    is being captured on a GPU that supports it (compute capability 9.0+), else none.

    Only under capture: there the overlap is baked into the graph once, while eager PDL
    launches measured slower on the host (the engine step at batch 1 rose from ~0.92 to
    ~1.3 ms with the LM head launched eagerly with PDL after each replay)."""
    if not (PDL_ENABLED and _HAS_GDC and device.type == "cuda"):
        return {}
    if not torch.cuda.is_current_stream_capturing():
        return {}
    return {"launch_pdl": True} if _capability(device) >= 9 else {}


_capabilities: dict[int, int] = {}


def _capability(device: torch.device) -> int:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _capabilities:
        _capabilities[index] = torch.cuda.get_device_capability(index)[0]
    return _capabilities[index]
