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

The V2 runner adds two host waits before a step's launch (host clock, part of ``host``):
``wait_reads`` until the previous step's copies have read the pinned input buffers (they run on
the stream behind the step before it, so this waits for the device), and on an async pipeline's
first stage ``wait_ids`` for the sampled ids that the last stage sends
(``pprun.distributed.feedback``).  On the first stage the stream's start event is recorded before
that host work, so a host wait there shows as ``compute``, not ``idle``.  The rest of its host
time it splits by phase (:data:`HOST_PHASES`): ``update`` (the request table takes the step's
deltas), ``prepare`` (the step's plan and its rows in the pinned input buffers), ``to_device``
(their launch to the device and the attention metadata), ``launch`` (the receive on a non-first
stage, the graph replay or the eager forward), ``expect`` (the first stage notes the step's
sampled ids as coming, or on gloo posts their receive) and ``sample`` (the last stage).

Off by default: the events cost a few microseconds of host time per step
(``PPRUN_STEP_TRACE_EVENTS=0`` keeps the host clock only, for throughput runs).
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import time
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

ENV = "PPRUN_STEP_TRACE"
MAX_STEPS = 50_000
"""Steps kept per process (the first ones); later steps are not recorded."""
HOST_PHASES = ("update_us", "prepare_us", "to_device_us", "launch_us", "expect_us", "sample_us")
"""The V2 runner's host work per step, by phase (see the module docstring)."""
STAGE_KEYS = (
    "host_us", "wait_reads_us", "wait_ids_us", *HOST_PHASES, "recv_wait_us", "compute_us", "send_wait_us", "idle_us",
)
"""A stage step's timings, as its row and the summaries name them (see the module docstring)."""


class HostClock:
    """Laps of one step's host time (perf_counter, in us), one per phase, into ``out`` (cleared
    first); inert when ``out`` is None, so that an untraced step reads no clock."""

    def __init__(self, out: dict[str, float] | None) -> None:
        self.out = out
        if out is not None:
            out.clear()
            self._t = time.perf_counter()

    def lap(self, key: str) -> None:
        """Charge the time since the last lap (or the start) to ``key``."""
        if self.out is not None:
            t = time.perf_counter()
            self.out[key] = (t - self._t) * 1e6
            self._t = t


def trace_prefix() -> str | None:
    """The output prefix when tracing is on, else None."""
    return os.environ.get(ENV) or None


def _write(path: str, obj: dict[str, Any]) -> None:
    """Write a trace as JSON; a path that cannot be written is logged, never raised (a trace
    must not keep a stage or the engine from shutting down).  The prefix's directory is made if
    it does not exist."""
    try:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            json.dump(obj, f)
    except OSError as e:
        logger.warning("%s: cannot write %s: %s", ENV, path, e)


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


class NullStageTrace:
    """What a stage holds when tracing is off: every call does nothing."""

    def begin(self, num_tokens: int, num_reqs: int) -> None:  # noqa: D102
        pass

    def mark(self) -> None:  # noqa: D102
        pass

    def note(self, values: dict[str, float] | None) -> None:  # noqa: D102
        pass

    def end(self) -> None:  # noqa: D102
        pass

    def dump(self) -> None:  # noqa: D102
        pass


class StageTrace(NullStageTrace):
    """Timings of one stage's steps (host clock, plus CUDA events on a GPU), written to
    ``path`` by :meth:`dump`."""

    def __init__(self, device: torch.device, name: str, path: str) -> None:
        self.device = device
        self.name = name
        self.path = path
        self.cuda = device.type == "cuda" and os.environ.get("PPRUN_STEP_TRACE_EVENTS", "1") != "0"
        self.rows: list[dict[str, Any]] = []
        self._events: list[list[torch.cuda.Event | None]] = []
        self._open: dict[str, Any] | None = None
        self._evs: list[torch.cuda.Event | None] = []

    def _event(self) -> torch.cuda.Event | None:
        if not self.cuda:
            return None
        import torch

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

    def note(self, values: dict[str, float] | None) -> None:
        """Extra per-step figures (the runner's host times by phase, in us) for the open step."""
        if self._open is not None and values:
            self._open.update(values)

    def end(self) -> None:
        """After the send (or the sampling on the last stage)."""
        if self._open is None:
            return
        self._evs.append(self._event())
        self._open["host_us"] = (time.perf_counter() - self._open["t0"]) * 1e6
        self.rows.append(self._open)
        self._events.append(self._evs)
        self._open = None

    def dump(self) -> None:
        """Write the per-step rows and a summary (medians over steps that computed tokens)."""
        import torch

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
            for key in STAGE_KEYS
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
        _write(self.path, out)


class EngineStep(NamedTuple):
    """One ``LLMEngine.step`` as the engine saw it (host clock, seconds)."""

    start: float
    wait: float
    """When ``get_output`` was called (scheduling and submitting done)."""
    end: float
    """When the answer came back."""
    num_submitted: int
    """Steps submitted by this call (0 when the pipeline was already full)."""
    num_tokens: int
    """Tokens scheduled in the answered step (real, not padded)."""
    num_reqs: int
    """Requests in the answered step."""
    num_prefill_tokens: int = 0
    """Prompt tokens computed in the answered step (:meth:`EngineTrace.prompt_tokens`; prompt
    tokens served from the prefix cache are not computed); 0 in a trace written without it."""


class EngineTrace:
    """The engine's side of each step: scheduling and submitting, then waiting for the output;
    written to ``path`` (if any) by :meth:`dump`."""

    def __init__(self, path: str | None = None) -> None:
        self.path = path
        self.rows: list[EngineStep] = []
        self._partial_prompts: dict[str, int] = {}
        """Request id -> prompt length, for requests whose prompt a step left unfinished
        (chunked prefill): the only scheduled requests :meth:`prompt_tokens` looks at beyond
        the step's new ones."""

    def prompt_tokens(self, so: Any) -> int:
        """The prompt tokens a step (a ``SchedulerOutput``) computes: each request's scheduled
        tokens at positions before the end of its prompt.  Prompt tokens found in the prefix
        cache are never scheduled, so they do not count; nor does a preempted request's prompt
        computed again once it has outputs (vLLM's record counts a prompt once, at its first
        token).  Call it on every step, in submission order: a prompt chunked over several steps
        is followed from the step that admits it."""
        partial = self._partial_prompts
        for req_id in so.finished_req_ids:  # finished, aborted or preempted (back as a new request)
            partial.pop(req_id, None)
        scheduled = so.num_scheduled_tokens
        total = 0
        if partial:
            cached = so.scheduled_cached_reqs
            for req_id, prompt_len in list(partial.items()):
                num_new = scheduled.get(req_id, 0)
                if not num_new:
                    continue
                try:
                    index = cached.req_ids.index(req_id)
                except ValueError:
                    continue  # a new request again (resumed): below
                total += self._prompt_part(req_id, cached.num_computed_tokens[index], num_new, prompt_len)
        for new in so.scheduled_new_reqs:
            prompt_len = len(new.prompt_token_ids) if new.num_prompt_tokens is None else new.num_prompt_tokens
            if len(new.prompt_token_ids) > prompt_len:
                continue  # resumed after a preemption with outputs: its prompt was counted
            total += self._prompt_part(new.req_id, new.num_computed_tokens, scheduled.get(new.req_id, 0), prompt_len)
        return total

    def _prompt_part(self, req_id: str, computed: int, num_new: int, prompt_len: int) -> int:
        """Of ``num_new`` tokens from position ``computed``, those before ``prompt_len``; notes
        whether the prompt is still unfinished after them."""
        if computed + num_new < prompt_len:
            self._partial_prompts[req_id] = prompt_len
        else:
            self._partial_prompts.pop(req_id, None)
        return max(0, min(computed + num_new, prompt_len) - computed)

    def record(self, step: EngineStep) -> None:
        """One ``LLMEngine.step`` (the first ``MAX_STEPS`` are kept)."""
        if len(self.rows) < MAX_STEPS:
            self.rows.append(step)

    def steady_decode(self, since: int = 0, min_steps: int = 10) -> dict[str, float | int] | None:
        """Decode rate while the batch is full, over ``rows[since:]``: the answered steps after
        the last one with prefill tokens, those with the most requests, tokens per second between
        their answers (the first answer opens the window).  None when fewer than ``min_steps``
        qualify."""
        window = self.steady_window(since, min_steps)
        if window is None:
            return None
        span = window[-1].end - window[0].end
        tokens = sum(r.num_tokens for r in window[1:])
        return {
            "decode_tokens_per_s": round(tokens / span, 1),
            "decode_ms_per_step": round(span / (len(window) - 1) * 1e3, 4),
            "decode_steps": len(window),
            "decode_batch": max(r.num_reqs for r in window),
        }

    def prefill_phase(self, start: float, since: int = 0) -> dict[str, float | int | None] | None:
        """The prefill phase of the run over ``rows[since:]``, which started at ``start`` (the
        rows' clock): its steps are the answered steps that carried prompt tokens
        (``num_prefill_tokens > 0``).  Prompt tokens per second from ``start`` to the answer of
        the last of them; their mean period (a step's answer less the previous step's answer, or
        less ``start`` for the first step); their number.  None when no step carried prompt
        tokens."""
        prev = start
        periods: list[float] = []
        tokens = 0
        last_end = start
        for r in self.rows[since:]:
            if r.num_prefill_tokens > 0:
                periods.append(r.end - prev)
                tokens += r.num_prefill_tokens
                last_end = r.end
            prev = r.end
        if not periods:
            return None
        span = last_end - start
        return {
            "prefill_tokens_per_s": round(tokens / span, 1) if span > 0 else None,
            "prefill_ms_per_step": round(statistics.fmean(periods) * 1e3, 4),
            "prefill_steps": len(periods),
        }

    def steady_window(self, since: int = 0, min_steps: int = 10) -> list[EngineStep] | None:
        """The answered steps :meth:`steady_decode` measures over (None when too few)."""
        rows = self.rows[since:]
        last_prefill = max((i for i, r in enumerate(rows) if r.num_tokens != r.num_reqs), default=-1)
        decode = [r for r in rows[last_prefill + 1 :] if r.num_tokens > 0]
        if not decode:
            return None
        full = max(r.num_reqs for r in decode)
        idx = [i for i, r in enumerate(decode) if r.num_reqs == full]
        window = decode[idx[0] : idx[-1] + 1]
        if len(window) < max(min_steps, 2) or window[-1].end <= window[0].end:
            return None
        return window

    def dump(self) -> None:
        """Write the rows (the :class:`EngineStep` fields) and the summary: scheduling and
        submitting, blocked in ``get_output``, and the output handling between steps."""
        if self.path is None:
            return
        own = [(r.wait - r.start) * 1e6 for r in self.rows]
        wait = [(r.end - r.wait) * 1e6 for r in self.rows]
        # Output handling (scheduler update, stop strings, the caller's loop) between two steps.
        between = [(b.start - a.end) * 1e6 for a, b in zip(self.rows, self.rows[1:])]
        out = {
            "name": "engine",
            "num_steps": len(self.rows),
            "summary": {
                "schedule_submit_us": _summary(own),
                "get_output_wait_us": _summary(wait),
                "between_steps_us": _summary(between),
            },
            "steady_decode": self.steady_decode(),
            "fields": list(EngineStep._fields),
            "steps": [[round(r.start, 6), round(r.wait, 6), round(r.end, 6), *r[3:]] for r in self.rows],
        }
        _write(self.path, out)


def summarize_traces(prefix: str) -> dict[str, Any]:
    """What one traced run (``PPRUN_STEP_TRACE=prefix``) says about its steady decode.

    The window is the engine's (:meth:`EngineTrace.steady_decode`: answered steps after the last
    prefill while the batch is full); each stage's steps whose start falls in it give per-stage
    medians of host time and, on CUDA, receive wait, compute, send wait and idle time, and the
    period between step starts.  Read it as: a stage whose stream idles waits on the host (its own
    or the engine's); a stage whose compute is much longer than its share of the model waits on a
    neighbour (a graph-captured hop counts as compute); an engine that spends most of a period
    scheduling and handling outputs is the bottleneck.
    """
    import glob

    path = f"{prefix}.engine.json"
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"{path} does not exist: trace a run with {ENV}={prefix} first (the engine writes it when it shuts down)"
        )
    with open(path, encoding="utf-8") as f:
        engine = json.load(f)
    trace = EngineTrace()
    trace.rows = [EngineStep(*r) for r in engine["steps"]]
    out: dict[str, Any] = {"steady_decode": trace.steady_decode(), "stages": {}}
    decode = trace.steady_window()
    if decode is None:
        return out
    t0, t1 = decode[0].end, decode[-1].end
    out["engine"] = {
        "schedule_submit_us": _summary([(r.wait - r.start) * 1e6 for r in decode]),
        "get_output_wait_us": _summary([(r.end - r.wait) * 1e6 for r in decode]),
        "between_steps_us": _summary([(b.start - a.end) * 1e6 for a, b in zip(decode, decode[1:])]),
    }
    for path in sorted(glob.glob(f"{glob.escape(prefix)}.stage*.json")):
        with open(path, encoding="utf-8") as f:
            stage = json.load(f)
        steps = [r for r in stage["steps"] if t0 <= r["t0"] <= t1 and r["num_tokens"] > 0]
        if len(steps) < 2:
            continue
        summary = {k: _summary([r[k] for r in steps if k in r]) for k in STAGE_KEYS}
        summary["period_us"] = round((steps[-1]["t0"] - steps[0]["t0"]) / (len(steps) - 1) * 1e6, 1)
        out["stages"][stage["name"]] = {k: v for k, v in summary.items() if v}
    return out
