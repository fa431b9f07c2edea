"""A step's inputs moved to the GPU by one kernel that reads the pinned staging arena itself.

The V2 runner packs a step's inputs into one pinned host arena (``inputs._Arena``).  Sent with
``cudaMemcpyAsync`` that is one host-to-device copy, and with async scheduling three small
kernels more put the previous step's sampled ids (still on the device) into ``input_ids``.  The
copy runs on a copy engine: the stream passes from compute to the copy engine and back around
it, and each pass costs a few microseconds; the three kernels cost a launch each.  Those ops run
outside the step's CUDA graph, where nothing hides them (docs/performance.md lists what this
kernel saves).

Here one kernel does all of it.  Pinned host memory is mapped into the GPU's address space, so
the kernel loads the used byte ranges straight from it over PCIe and stores them into the device
arena, and writes ``input_ids`` itself: per token, either the host's id or, for a token the host
does not know yet, the previous step's sampled id (``token_source``: -1, or the row of the
previous step's sampled ids).  ``input_ids`` is therefore never part of a copied range, so no
two programs write one word.

The ranges arrive as scalar arguments (``ranges.MAX_RANGES`` pairs, unused ones empty), so nothing
is read from the host before the data itself; they are not specialised on, so one compiled
kernel serves every step.  The host must not rewrite the staging arena before the kernel has
run: the caller records an event after the launch and waits for it first, as it does for the
copies.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from pprun.switches import enabled_unless
from pprun.worker.v2.ranges import MAX_RANGES

FAST_LAUNCH_ENABLED: bool = enabled_unless("PPRUN_DISABLE_FAST_LAUNCH")
"""Launch the compiled kernel through its launcher directly, once Triton's ``kernel[grid](...)``
has compiled and launched it for the same specialisation.  Triton's own path binds and
specialises every argument in Python on each launch, several times the direct launch's host
time (docs/performance.md lists what it saves).  What Triton
specialises on here is known: ``HAS_PENDING``, the device, whether each pointer is 16-byte
aligned, and whether an integer needs 64 bits (the integers are ``do_not_specialize``, which
Triton still types by value); those make the cache key.  Off while a Triton
launch hook is set (a profiler), which the direct path would bypass."""

_BLOCK = 1024
"""32-bit words (or token ids) per program and loop trip."""
_MAX_PROGRAMS = 64

_RANGE_ARGS = [f"{side}{i}" for i in range(MAX_RANGES) for side in ("s", "e")]


@triton.jit
def _copy_words(src_ptr, dst_ptr, start, end, pid, nprog, BLOCK: tl.constexpr):
    """Copy 32-bit words ``[start, end)`` from ``src`` to ``dst``, programs striding by blocks."""
    for w0 in range(start + pid * BLOCK, end, nprog * BLOCK):
        offs = w0 + tl.arange(0, BLOCK)
        mask = offs < end
        tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=mask), mask=mask)


@triton.jit(do_not_specialize=[*_RANGE_ARGS, "num_tokens_padded"])
def _stage_kernel(
    src_ptr,
    dst_ptr,
    s0, e0, s1, e1, s2, e2, s3, e3, s4, e4, s5, e5, s6, e6, s7, e7,
    ids_src_ptr,
    ids_dst_ptr,
    token_source_ptr,
    prev_ptr,
    num_tokens_padded,
    HAS_PENDING: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    _copy_words(src_ptr, dst_ptr, s0, e0, pid, nprog, BLOCK)
    _copy_words(src_ptr, dst_ptr, s1, e1, pid, nprog, BLOCK)
    _copy_words(src_ptr, dst_ptr, s2, e2, pid, nprog, BLOCK)
    _copy_words(src_ptr, dst_ptr, s3, e3, pid, nprog, BLOCK)
    _copy_words(src_ptr, dst_ptr, s4, e4, pid, nprog, BLOCK)
    _copy_words(src_ptr, dst_ptr, s5, e5, pid, nprog, BLOCK)
    _copy_words(src_ptr, dst_ptr, s6, e6, pid, nprog, BLOCK)
    _copy_words(src_ptr, dst_ptr, s7, e7, pid, nprog, BLOCK)
    for t0 in range(pid * BLOCK, num_tokens_padded, nprog * BLOCK):
        offs = t0 + tl.arange(0, BLOCK)
        mask = offs < num_tokens_padded
        ids = tl.load(ids_src_ptr + offs, mask=mask)
        if HAS_PENDING:
            source = tl.load(token_source_ptr + offs, mask=mask, other=-1)
            sampled = tl.load(prev_ptr + source, mask=mask & (source >= 0), other=0)
            ids = tl.where(source >= 0, sampled, ids)
        tl.store(ids_dst_ptr + offs, ids, mask=mask)


def stage_inputs(
    host_arena: torch.Tensor,
    device_arena: torch.Tensor,
    ranges: list[tuple[int, int]],
    ids_host: torch.Tensor,
    ids_device: torch.Tensor,
    num_tokens_padded: int,
    token_source: torch.Tensor | None = None,
    prev_sampled: torch.Tensor | None = None,
) -> None:
    """One launch: copy the byte ``ranges`` (4-byte aligned, at most :data:`MAX_RANGES`, none
    overlapping ``ids_device``) of ``host_arena`` (pinned uint8) into ``device_arena``, and write
    ``ids_device[:num_tokens_padded]`` (the step's tokens, padding rows included): ``ids_host``
    where ``token_source`` is -1, else ``prev_sampled[token_source]`` (no ``token_source``:
    ``ids_host`` throughout)."""
    if len(ranges) > MAX_RANGES:
        raise ValueError(f"at most {MAX_RANGES} ranges per launch, got {len(ranges)}")
    if any(s % 4 or e % 4 for s, e in ranges):
        raise ValueError(f"ranges must be 4-byte aligned, got {ranges}")
    if (token_source is None) != (prev_sampled is None):
        raise ValueError("token_source and prev_sampled go together")
    if ids_host.dtype != torch.int64 or ids_device.dtype != torch.int64:
        raise ValueError(f"the ids must be int64, got {ids_host.dtype} and {ids_device.dtype}")
    if token_source is not None:
        if token_source.dtype != torch.int32 or prev_sampled.dtype != torch.int64 or not prev_sampled.is_contiguous():
            raise ValueError(f"token_source must be int32 and prev_sampled contiguous int64, got "
                             f"{token_source.dtype}, {prev_sampled.dtype} with strides {prev_sampled.stride()}")
    words = [w for s, e in ranges for w in (s // 4, e // 4)]
    words += [0] * (2 * MAX_RANGES - len(words))
    longest = max([num_tokens_padded, *((e - s) for s, e in zip(words[::2], words[1::2]))])
    grid = (max(1, min(_MAX_PROGRAMS, triton.cdiv(longest, _BLOCK))),)
    has_pending = token_source is not None
    args = (
        host_arena.view(torch.int32),
        device_arena.view(torch.int32),
        *words,
        ids_host,
        ids_device,
        token_source if has_pending else ids_host,
        prev_sampled if has_pending else ids_host,
        num_tokens_padded,
    )
    key = None
    if FAST_LAUNCH_ENABLED and ids_device.is_cuda:
        pointers = (args[0], args[1], *args[-5:-1])
        # Triton types a do_not_specialize integer as i32 or i64 by its value: part of the key.
        wide = longest >= 2**31 or max(words) >= 2**31
        key = (has_pending, ids_device.device.index, wide, *(p.data_ptr() % 16 == 0 for p in pointers))
        kernel = _direct_kernel(key)
        if kernel is not None:
            stream = triton.runtime.driver.active.get_current_stream(key[1])
            kernel.run(grid[0], 1, 1, stream, kernel.function, kernel.packed_metadata, None, None, None,
                       *args, has_pending, _BLOCK)  # fmt: skip
            return
    kernel = _stage_kernel[grid](*args, HAS_PENDING=has_pending, BLOCK=_BLOCK)
    if key is not None and _direct_launch_possible(kernel):
        _compiled[key] = kernel


_compiled: dict[tuple, Any] = {}
"""Compiled staging kernels by specialisation (see :data:`FAST_LAUNCH_ENABLED`)."""


def _direct_kernel(key: tuple) -> Any:
    """The compiled kernel to launch directly for ``key``, or None: none compiled yet, or a
    launch hook is set (it must see every launch)."""
    kernel = _compiled.get(key)
    return kernel if kernel is not None and _no_launch_hooks() else None


def _direct_launch_possible(kernel: Any) -> bool:
    """Whether ``kernel`` (what ``_stage_kernel[grid](...)`` returned) can be launched directly:
    a compiled kernel with the launcher Triton 3.x uses itself, and no launch hook set."""
    return _no_launch_hooks() and all(hasattr(kernel, a) for a in ("run", "function", "packed_metadata"))


def _no_launch_hooks() -> bool:
    """True when Triton would call no hook around a launch: each hook unset, or a hook chain
    (``triton.knobs.HookChain``, Triton >= 3.5) holding none."""
    runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
    if runtime is None:
        return False
    return all(h is None or getattr(h, "calls", None) == [] for h in (runtime.launch_enter_hook, runtime.launch_exit_hook))
