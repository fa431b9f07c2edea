"""What a decode step's byte pattern costs when nothing but streaming happens: the ceiling for
any kernel design, and what its sync points cost kernel by kernel or inside one kernel.

A batch-32 decode step of the 1.1B model reads, in order and with a full dependency between
each: per layer the norm's partials (~2.2 MB), qkv (12.6 MB), the K/V cache (33.5 MB at
context 512), o_proj (8.4 MB), the norm's partials again, gate_up (67.1 MB), down (33.5 MB);
then the final norm, the LM head (131.1 MB) and the logits (2 MB): 113 phases, ~2.69 GB.
This script streams exactly those byte counts from HBM (distinct ranges of one buffer, so L2
never serves a phase from an earlier one) with a kernel that only loads and sums, in four ways:

- ``one_phase``: every byte in a single phase (no sync point at all): the bandwidth ceiling;
- ``kernels_pdl``: one launch per phase in a CUDA graph, with PDL as pprun's kernels use it
  (wait for the previous kernel, then let the next one be scheduled);
- ``kernels_plain``: the same launches without PDL;
- ``persistent``: one launch of a few programs per SM that stream phase after phase with a
  grid-wide barrier (an arrival counter in L2) between phases: the sync a whole-step
  "megakernel" with coarse dependencies would pay.

``--merge NAMES`` folds each named phase's bytes into the next phase: the floor once a fusion or
an overlap removes those sync points.  ``--boundary WAYS`` times the PDL launches with other
ways of crossing each boundary (``boundary_*``): some of each program's loads issued before the
wait (what a matmul's weights or the cached K/V allow; never for the norm's and argmax's bytes),
those loads held until most of the kernel before has finished, or the next kernel let launch
only at the end.  Prints one JSON object with each way's ms per step and TB/s, and the byte
count.  On an H200 the fastest kernels were 4 warps, 2 loads in flight, 8 programs per SM
(thirteenth session), and one 16 KB group per program ahead of the wait took the step from
0.796 to 0.751 ms (fourteenth; ``docs/performance.md``).

    python3 scripts/stream_probe.py [--warps 4] [--unroll 2] [--programs-per-sm 8] [--merge norm,qkv]
                                    [--boundary 0,1,2,1:late,1:g0.8] [--out FILE]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

from pprun.layers.triton_utils import gdc_launch_dependents, gdc_wait, pdl_options, pdl_sync

sys.path.insert(0, str(Path(__file__).resolve().parent))
from layer_bench import time_us, write_result  # noqa: E402

MB = 1e6
LAYER_PHASES = [("norm", 2.2), ("qkv", 12.58), ("attention", 33.55), ("o_proj", 8.39), ("norm", 2.2),
                ("gate_up", 67.11), ("down", 33.55)]
TAIL_PHASES = [("norm", 2.2), ("lm_head", 131.07), ("argmax", 2.05)]
CHUNK = 4096  # bf16 elements per load (8 KB)
DEPENDENT = {"norm", "argmax"}
"""Phases whose bytes come from the kernel before (the split-K partials, the logits): nothing of
theirs can be loaded ahead of the PDL wait.  The others read weights or cached K/V."""


@triton.jit
def _stream_phase(buf_ptr, start, end, pid, nprog, CHUNK: tl.constexpr, UNROLL: tl.constexpr):
    """The sum of elements [start, end) of buf (both multiples of CHUNK * UNROLL) that this
    program reads: groups of UNROLL chunks dealt round-robin over nprog programs, each group's
    loads all in flight at once."""
    acc = tl.zeros([CHUNK], tl.float32)
    offs = tl.arange(0, CHUNK)
    for base in range(start + pid * CHUNK * UNROLL, end, nprog * CHUNK * UNROLL):
        for u in tl.static_range(UNROLL):
            at = tl.multiple_of(base + u * CHUNK, CHUNK)
            acc += tl.load(buf_ptr + at + offs, cache_modifier=".cg").to(tl.float32)
    return tl.sum(acc)


@triton.jit
def _read_counter(ptr, SEM: tl.constexpr):
    """A counter in global memory, read at GPU scope (a compare-and-swap that never matches: an
    atomic add of 0 is folded away)."""
    return tl.atomic_cas(ptr, -1, -1, sem=SEM, scope="gpu")


@triton.jit
def _phase_kernel(buf_ptr, start, end, sink_ptr, CHUNK: tl.constexpr, UNROLL: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_sync(USE_PDL)
    pid = tl.program_id(0)
    tl.store(sink_ptr + pid, _stream_phase(buf_ptr, start, end, pid, tl.num_programs(0), CHUNK, UNROLL))


@triton.jit
def _ahead_kernel(buf_ptr, start, end, sink_ptr, done_ptr, prev_done_ptr, gate_programs, CHUNK: tl.constexpr,
                  UNROLL: tl.constexpr, AHEAD: tl.constexpr, GATE: tl.constexpr, LATE: tl.constexpr,
                  COUNT: tl.constexpr):
    """One phase, PDL always on, with the boundary handled one of several ways: ``AHEAD`` groups
    of this program's share loaded before the PDL wait (they do not depend on the kernel before,
    as a matmul's weights do not); with ``GATE``, those loads wait until ``gate_programs`` programs of the
    kernel before have finished (with ``COUNT`` each program bumps a counter at its end), so
    that they fill that kernel's tail instead of competing with its stream; with ``LATE``, the
    next kernel is let launch only once this program has read everything (instead of right
    after the wait)."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    group = CHUNK * UNROLL
    total = 0.0
    if AHEAD > 0:
        if GATE:
            while _read_counter(prev_done_ptr, "relaxed") < gate_programs:
                pass
        # the first AHEAD groups _stream_phase would deal this program, loaded at once
        rows = tl.arange(0, AHEAD * UNROLL)
        at = start + (pid + (rows // UNROLL) * nprog) * group + (rows % UNROLL) * CHUNK
        ptrs = buf_ptr + at[:, None] + tl.arange(0, CHUNK)[None, :]
        ahead = tl.load(ptrs, mask=(at < end)[:, None], other=0.0, cache_modifier=".cg")
    gdc_wait()
    if not LATE:
        gdc_launch_dependents()
    if AHEAD > 0:
        total += tl.sum(tl.sum(ahead.to(tl.float32), axis=0))
    total += _stream_phase(buf_ptr, start + AHEAD * nprog * group, end, pid, nprog, CHUNK, UNROLL)
    tl.store(sink_ptr + pid, total)
    if COUNT:
        tl.debug_barrier()
        tl.atomic_add(done_ptr, 1, sem="release", scope="gpu")
    if LATE:
        gdc_launch_dependents()


@triton.jit
def _persistent_kernel(buf_ptr, bounds_ptr, n_phases, sink_ptr, bar_ptr, CHUNK: tl.constexpr, UNROLL: tl.constexpr):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    for p in range(n_phases):
        start = tl.multiple_of(tl.load(bounds_ptr + p), CHUNK)
        end = tl.multiple_of(tl.load(bounds_ptr + p + 1), CHUNK)
        tl.store(sink_ptr + p * nprog + pid, _stream_phase(buf_ptr, start, end, pid, nprog, CHUNK, UNROLL))
        # Grid barrier: every program's loads of this phase are done before the next starts.
        tl.debug_barrier()
        tl.atomic_add(bar_ptr, 1, sem="release", scope="gpu")
        while _read_counter(bar_ptr, "acquire") < (p + 1) * nprog:
            pass
        tl.debug_barrier()


def parse_boundary(way: str, unroll: int) -> tuple[int, float, bool]:
    """``AHEAD[:gFRACTION|:late]`` -> (groups ahead, gate fraction or 0, late launch)."""
    ahead, _, how = way.partition(":")
    try:
        groups = int(ahead)
        gate = float(how[1:]) if how.startswith("g") else 0.0
    except ValueError:
        groups, gate = -1, 0.0
    loads = groups * unroll
    power_of_two = groups >= 0 and loads & (loads - 1) == 0  # 0 (nothing ahead) passes too
    gated = how.startswith("g") and 0 < gate <= 1 and groups > 0
    if not power_of_two or not (how in ("", "late") or gated):
        raise SystemExit(f"--boundary {way!r}: want AHEAD (0, or groups with AHEAD x --unroll a power of two), "
                         f"optionally ':late' or ':gF' with 0 < F <= 1 and AHEAD > 0")
    return groups, gate, how == "late"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--programs-per-sm", default="1,2", help="programs per SM (all must fit at once: the persistent kernel spins)")
    ap.add_argument("--unroll", type=int, default=8, help="loads in flight per program per iteration")
    ap.add_argument("--warps", type=int, default=4)
    ap.add_argument("--merge", default="", help="phase names (e.g. norm,qkv) whose bytes join the next phase: "
                    "the sync points a fusion or an overlap would remove")
    ap.add_argument("--boundary", default="", help="ways of crossing a phase boundary, timed with PDL as "
                    "'AHEAD[:gGATE|:late]' each (e.g. 0,1,2,1:g0.8,1:late): AHEAD groups per program loaded "
                    "before the wait, those loads held until a fraction GATE of the kernel before has "
                    "finished, or the next kernel let launch only at the end")
    ap.add_argument("--out")
    args = ap.parse_args()
    ways = {way: parse_boundary(way, args.unroll) for way in filter(None, args.boundary.split(","))}
    dev = torch.device("cuda")
    phases = LAYER_PHASES * args.layers + TAIL_PHASES
    merge = set(filter(None, args.merge.split(",")))
    folded: list[tuple[str, float]] = []
    carry = 0.0
    for name, mb in phases:  # a merged phase's bytes go to the phase after it (no sync point between)
        if name in merge:
            carry += mb
        else:
            folded.append((name, mb + carry))
            carry = 0.0
    phases = folded
    group = CHUNK * args.unroll
    sizes = [int(mb * MB / 2) // group * group for _, mb in phases]  # bf16 elements, whole groups
    bounds = [0]
    for s in sizes:
        bounds.append(bounds[-1] + s)
    total_bytes = bounds[-1] * 2
    buf = torch.ones(bounds[-1], dtype=torch.bfloat16, device=dev)
    bounds_t = torch.tensor(bounds, dtype=torch.int64, device=dev)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    result = {"device": torch.cuda.get_device_name(dev), "phases": len(phases), "bytes": total_bytes,
              "chunk_bytes": CHUNK * 2, "unroll": args.unroll, "warps": args.warps,
              "merged": sorted(merge)}

    def record(name: str, step) -> None:
        """Time ``step`` (one whole step's launches) in a CUDA graph of two steps."""
        ms = time_us(step, calls=2) / 1e3
        result[name] = {"ms": round(ms, 4), "tb_s": round(total_bytes / ms / 1e9, 3)}
        print(name, result[name], flush=True)

    for per_sm in (int(v) for v in args.programs_per_sm.split(",")):
        nprog = sms * per_sm
        sink = torch.empty(nprog * len(phases), dtype=torch.float32, device=dev)
        def one_phase(nprog=nprog, sink=sink):
            _phase_kernel[(nprog,)](buf, 0, bounds[-1], sink, CHUNK=CHUNK, UNROLL=args.unroll, USE_PDL=False,
                                    num_warps=args.warps)
        record(f"one_phase_{per_sm}_per_sm", one_phase)
        for use_pdl in (True, False):

            def kernels(use_pdl=use_pdl, nprog=nprog, sink=sink):
                # pprun's launch options: PDL while a graph is captured
                opts = pdl_options(dev) if use_pdl else {"USE_PDL": False}
                for p in range(len(phases)):
                    _phase_kernel[(nprog,)](buf, bounds[p], bounds[p + 1], sink, CHUNK=CHUNK, UNROLL=args.unroll,
                                            num_warps=args.warps, **opts)
            record(f"kernels_{'pdl' if use_pdl else 'plain'}_{per_sm}_per_sm", kernels)
        done = torch.zeros(len(phases) + 1, dtype=torch.int32, device=dev)
        for way, (ahead, gate, late) in ways.items():

            def crossing(ahead=ahead, gate=gate, late=late, nprog=nprog, sink=sink, done=done):
                done.zero_()  # a memset node at the step's start: the counters count this step
                for p in range(len(phases)):
                    gated = gate > 0 and p > 0
                    _ahead_kernel[(nprog,)](buf, bounds[p], bounds[p + 1], sink, done[p + 1:], done[p:],
                                            int(gate * nprog) if gated else 0, CHUNK=CHUNK, UNROLL=args.unroll,
                                            AHEAD=0 if phases[p][0] in DEPENDENT else ahead, GATE=gated, LATE=late,
                                            COUNT=gate > 0, num_warps=args.warps, launch_pdl=True)
            record(f"boundary_{way}_{per_sm}_per_sm", crossing)
        bar = torch.zeros(1, dtype=torch.int32, device=dev)
        compiled = _persistent_kernel.warmup(buf, bounds_t, len(phases), sink, bar, CHUNK=CHUNK, UNROLL=args.unroll,
                                             num_warps=args.warps, grid=(1,))
        compiled._init_handles()
        threads = 32 * args.warps
        fits = min(65536 // max(1, compiled.n_regs * threads), 2048 // threads)
        if per_sm > fits:  # the barrier would wait for programs that cannot start
            result[f"persistent_{per_sm}_per_sm"] = {"skipped": f"{compiled.n_regs} registers: {fits} per SM fit"}
            continue

        def persistent(bar=bar, sink=sink, nprog=nprog):
            bar.zero_()
            _persistent_kernel[(nprog,)](buf, bounds_t, len(phases), sink, bar, CHUNK=CHUNK, UNROLL=args.unroll,
                                         num_warps=args.warps)
        record(f"persistent_{per_sm}_per_sm", persistent)
    write_result(result, args.out)


if __name__ == "__main__":
    main()
