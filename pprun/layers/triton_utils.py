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

    Only under capture: there the overlap is baked into the graph once, while eager PDL
    launches measured slower on the host (the engine step at batch 1 rose from ~0.92 to
    ~1.3 ms with the LM head launched eagerly with PDL after each replay)."""
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


# --------------------------------------------------------------------------------------
# L2 prefetch of a weight that a later kernel of the step reads
# --------------------------------------------------------------------------------------


@triton.jit
def l2_prefetch_rows(ptr, row_stride, num_rows, row_bytes, program, rows_per_program,
                     ROWS: tl.constexpr, EVICT_LAST: tl.constexpr):
    """Ask L2 for the first ``row_bytes`` of rows ``[first_row, first_row + rows_per_program)``
    of the matrix at ``ptr`` (rows ``row_stride`` elements apart, 16-byte aligned), with
    ``first_row = program * rows_per_program``: one bulk prefetch per row, fire-and-forget
    (sm_90+; :func:`prefetch_args` turns it off elsewhere)."""
    first_row = program * rows_per_program
    rows = first_row + tl.arange(0, ROWS)
    mask = (rows < num_rows) & (rows < first_row + rows_per_program)
    addrs = ptr + rows.to(tl.int64) * row_stride
    size = tl.zeros([ROWS], tl.int32) + row_bytes
    if EVICT_LAST:
        tl.inline_asm_elementwise(
            "{ .reg .pred p; .reg .b64 pol; setp.ne.b32 p, $2, 0; "
            "createpolicy.fractional.L2::evict_last.b64 pol, 1.0; "
            "@p cp.async.bulk.prefetch.L2.global.L2::cache_hint [$1], $3, pol; mov.u32 $0, 0; }",
            "=r,l,r,r", [addrs, mask.to(tl.int32), size], dtype=tl.int32, is_pure=False, pack=1,
        )
    else:
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $3; mov.u32 $0, 0; }",
            "=r,l,r,r", [addrs, mask.to(tl.int32), size], dtype=tl.int32, is_pure=False, pack=1,
        )


def prefetchable(weight: torch.Tensor | None, device: torch.device, name: str = "prefetch") -> torch.Tensor | None:
    """``weight`` if :func:`l2_prefetch_rows` can take it (rows contiguous, 16-byte aligned row
    starts), else None: a prefetch is a hint, skipped when it cannot run.  Anything but a 2-d
    tensor on ``device`` is refused (``name`` is the argument it came in)."""
    if weight is None:
        return None
    if weight.dim() != 2 or weight.device != device:
        raise ValueError(f"{name} must hold 2-d tensors on {device}, got shape {tuple(weight.shape)} "
                         f"on {weight.device}")
    if weight.stride(1) != 1 or (weight.stride(0) * weight.element_size()) % 16 or weight.data_ptr() % 16:
        return None
    return weight


def prefetch_args(
    weight: torch.Tensor | None, fraction: float, num_programs: int, placeholder: torch.Tensor
) -> tuple[tuple, int]:
    """The arguments of one :func:`l2_prefetch_rows` slot spread over ``num_programs`` programs:
    ``(matrix, row stride, rows, bytes per row, rows per program)`` and its ``ROWS`` block; the
    leading ``fraction`` of every row (whole 16-byte units, the bulk prefetch's granularity).
    ``ROWS`` is 0 when the slot is off (no weight, no fraction, no sm_90, the interpreter); then
    ``placeholder`` stands for the matrix, never read."""
    row_bytes = 0
    if (weight is not None and fraction > 0 and not INTERPRETED and weight.device.type == "cuda"
            and _capability(weight.device) >= 9):
        row_bytes = int(weight.shape[1] * weight.element_size() * min(fraction, 1.0)) // 16 * 16
    if not row_bytes:
        return (placeholder, 0, 0, 0, 0), 0
    rows_per_program = -(-weight.shape[0] // num_programs)
    args = (weight, weight.stride(0), weight.shape[0], row_bytes, rows_per_program)
    return args, triton.next_power_of_2(rows_per_program)
