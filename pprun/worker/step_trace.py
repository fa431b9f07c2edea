"""Per-step timings of a stage or the engine, for finding where a pipeline loses time.

Set ``PPRUN_STEP_TRACE=/some/prefix`` and every stage writes ``prefix.stage{rank}.json`` when it
shuts down (the engine writes ``prefix.engine.json``).  A stage records, per step, the host time
spent in the step and — on CUDA — four events on its stream: step start, after the receive,
after the compute, after the send.  From them:

- ``recv_wait``: the step's input copies and the stream waiting for the previous stage's tensors
  (start -> after the receive; nothing on the first stage);
- ``compute``: the stage's own work (after receive -> after compute; on the last stage up to the
  launch of the sampling, whose result may be awaited later);
- ``send_wait``: the stream blocked in the send until the next stage takes the tensors (nothing
  on the last stage);
- ``idle``: the stream empty between the end of one step and the start of the next (the host
  was late: waiting for the step's message, or preparing it).

Off by default: the events cost a few microseconds of host time per step
(``PPRUN_STEP_TRACE_EVENTS=0`` keeps the host clock only, for throughput runs).
"""

from __future__ import annotations

import json
import os
import statistics
import time
from typing import Any

import torch

ENV = "PPRUN_STEP_TRACE"
MAX_STEPS = 50_000
"""Steps kept per process (the first ones); later steps are not recorded."""


def trace_prefix() -> str | None:
    """The output prefix when tracing is on, else None."""
    return os.environ.get(ENV) or None


def _summary(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    s = sorted(values)
    return {
        "median_us": round(statistics.median(s), 1),
        "p10_us": round(s[len(s) // 10], 1),
        "p90_us": round(s[(len(s) * 9) // 10], 1),
        "mean_us": round(statistics.fmean(s), 1),
        "n": len(s),
    }


class StageTrace:
    """Timings of one stage's steps (host clock, plus CUDA events on a GPU)."""

    def __init__(self, device: torch.device, name: str) -> None:
        self.device = device
        self.name = name
        self.cuda = device.type == "cuda" and os.environ.get("PPRUN_STEP_TRACE_EVENTS", "1") != "0"
        self.rows: list[dict[str, Any]] = []
        self._events: list[list[torch.cuda.Event]] = []
        self._open: dict[str, Any] | None = None

    def _event(self) -> torch.cuda.Event | None:
        if not self.cuda:
            return None
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        return e

    def begin(self, num_tokens: int, num_reqs: int) -> None:
        """Start of a step (before the receive)."""
        if len(self.rows) >= MAX_STEPS:
            self._open = None
            return
        self._open = {"t0": time.perf_counter(), "num_tokens": num_tokens, "num_reqs": num_reqs}
        self._evs = [self._event()]

    def mark(self) -> None:
        """After the receive, then after the compute."""
        if self._open is not None:
            self._evs.append(self._event())

    def end(self) -> None:
        """After the send (or the sampling on the last stage)."""
        if self._open is None:
            return
        self._evs.append(self._event())
        self._open["host_us"] = (time.perf_counter() - self._open["t0"]) * 1e6
        self.rows.append(self._open)
        self._events.append(self._evs)
        self._open = None

    def dump(self, path: str) -> None:
        """Write the per-step rows and a summary (medians over steps that computed tokens)."""
        if self.cuda:
            torch.cuda.synchronize(self.device)
        gaps: list[float] = []
        prev_end = None
        for row, evs in zip(self.rows, self._events):
            if self.cuda and all(e is not None for e in evs) and len(evs) == 4:
                row["recv_wait_us"] = evs[0].elapsed_time(evs[1]) * 1e3
                row["compute_us"] = evs[1].elapsed_time(evs[2]) * 1e3
                row["send_wait_us"] = evs[2].elapsed_time(evs[3]) * 1e3
                if prev_end is not None:
                    row["idle_us"] = prev_end.elapsed_time(evs[0]) * 1e3
                    gaps.append(row["idle_us"])
                prev_end = evs[3]
            row["t0"] = round(row["t0"], 6)
        busy = [r for r in self.rows if r["num_tokens"] > 0]
        summary = {
            key: _summary([r[key] for r in busy if key in r])
            for key in ("host_us", "recv_wait_us", "compute_us", "send_wait_us", "idle_us")
        }
        span = (self.rows[-1]["t0"] - self.rows[0]["t0"]) if len(self.rows) > 1 else 0.0
        out = {"name": self.name, "num_steps": len(self.rows), "span_s": round(span, 6), "summary": summary,
               "steps": self.rows}  # fmt: skip
        if self.cuda:
            # Allocator retries (a cudaFree of the whole cache, then a synchronize) stall a step
            # for tens of milliseconds: worth seeing next to the step times.
            stats = torch.cuda.memory_stats(self.device)
            out["cuda_memory"] = {
                k: stats.get(k)
                for k in ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_sync_all_streams",
                          "reserved_bytes.all.peak", "allocated_bytes.all.peak")
            }  # fmt: skip
        with open(path, "w", encoding="utf-8") as f:
            json.dump(out, f)


class EngineTrace:
    """The engine's side of each step: scheduling and submitting, then waiting for the output."""

    def __init__(self) -> None:
        self.rows: list[tuple[float, float, float, int, int, int]] = []

    def record(
        self, t_start: float, t_wait: float, t_end: float, num_submitted: int, num_tokens: int, num_reqs: int
    ) -> None:
        """One ``LLMEngine.step``: start, start of ``get_output``, end (host clock), steps
        submitted, and the answered step's scheduled tokens and requests."""
        if len(self.rows) < MAX_STEPS:
            self.rows.append((t_start, t_wait, t_end, num_submitted, num_tokens, num_reqs))

    def steady_decode(self, min_steps: int = 10) -> dict[str, float | int] | None:
        """Decode rate while the batch is full: over the answered steps after the last one with
        prefill tokens, those with the most requests, tokens per second between their answers
        (the first answer opens the window).  None when fewer than ``min_steps`` qualify."""
        last_prefill = max((i for i, r in enumerate(self.rows) if r[4] != r[5]), default=-1)
        decode = [r for r in self.rows[last_prefill + 1 :] if r[4] > 0]
        if not decode:
            return None
        full = max(r[5] for r in decode)
        idx = [i for i, r in enumerate(decode) if r[5] == full]
        window = decode[idx[0] : idx[-1] + 1]
        span = window[-1][2] - window[0][2]
        if len(window) < max(min_steps, 2) or span <= 0:
            return None
        tokens = sum(r[4] for r in window[1:])
        return {
            "decode_tokens_per_s": round(tokens / span, 1),
            "decode_ms_per_step": round(span / (len(window) - 1) * 1e3, 4),
            "decode_steps": len(window),
            "decode_batch": full,
        }

    def dump(self, path: str) -> None:
        """Write the rows (start, start of ``get_output``, end, steps submitted, the answered
        step's tokens and requests; host clock) and
        the summary: scheduling and submitting, blocked in ``get_output``, and the output
        handling between steps."""
        own = [(r[1] - r[0]) * 1e6 for r in self.rows]
        wait = [(r[2] - r[1]) * 1e6 for r in self.rows]
        # Output handling (scheduler update, stop strings, the caller's loop) between two steps.
        between = [(b[0] - a[2]) * 1e6 for a, b in zip(self.rows, self.rows[1:])]
        out = {
            "name": "engine",
            "num_steps": len(self.rows),
            "summary": {
                "schedule_submit_us": _summary(own),
                "get_output_wait_us": _summary(wait),
                "between_steps_us": _summary(between),
            },
            "steady_decode": self.steady_decode(),
            "steps": [[round(r[0], 6), round(r[1], 6), round(r[2], 6), *r[3:]] for r in self.rows],
        }
        with open(path, "w", encoding="utf-8") as f:
            json.dump(out, f)
