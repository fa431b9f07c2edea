"""The step watchdog: a step much slower than its class is logged, with its sizes and what it used
for the first time, so that a regression shows in a deployment's logs.

A step's time is its round trip as the engine sees it: from :meth:`StepWatchdog.submitted`
(handed to the executor) to :meth:`StepWatchdog.answered` (its output back).  Through a pipeline
that is the time through every stage, full or not; with async scheduling it may include the end
of the step ahead of it (at most about 2x, under the threshold).

A step's *class* (:class:`StepClass`) is its kind and its size, bucketed:

* kind ``decode`` (every scheduled request computes one token and none is new) or ``prefill``
  (anything else: a prompt chunk, a new or resumed request — mixed steps included);
* the number of tokens and of requests, each rounded up to a power of two (1, 2, 4, ...; for
  decode both are the same).

Each class keeps the last :data:`WINDOW` times; a step is judged against the median of its class
once :data:`MIN_SAMPLES` are there, before its own time joins them, and is slow above
:data:`SLOW_FACTOR` x that median.  At most one warning per :data:`WARN_INTERVAL_S`; the next one
says how many slow steps went unlogged in between.

*First use*: what a step is the first to use, known from its ``SchedulerOutput`` and the
configuration alone (no runner round trip): its class; the CUDA graph size a decode step pads
to (configured capture sizes, V2 runner); per new request, each sampler variant (greedy,
temperature, top-p, top-k, min-p, seed, logprobs, suppressed tokens, min-tokens), a multimodal
item (encoder), a prefix-cache hit and a resumption after preemption.  The step whose output
is awaited is the one judged, with the firsts it was submitted with.
"""

from __future__ import annotations

import logging
import time
from bisect import bisect_left
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

from pprun.core.outputs import NewRequestData, SchedulerOutput

logger = logging.getLogger(__name__)

SLOW_FACTOR = 3.0
"""A step slower than this many times its class's median is logged."""
WINDOW = 64
"""Times kept per class (the latest)."""
MIN_SAMPLES = 8
"""Times a class needs before its steps are judged."""
WARN_INTERVAL_S = 10.0
"""At most one warning per this many seconds."""


def _bucket(n: int) -> int:
    """``n`` rounded up to a power of two (0 stays 0)."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


class StepClass(NamedTuple):
    """What a step's time is compared within (see the module docstring)."""

    kind: str
    """``decode`` or ``prefill`` (any step with a prompt chunk or a new request)."""
    num_tokens_bucket: int
    num_reqs_bucket: int

    def __str__(self) -> str:
        return f"{self.kind}, <={self.num_tokens_bucket} tokens, <={self.num_reqs_bucket} requests"


def step_class(so: SchedulerOutput) -> StepClass:
    """The class of a step."""
    num_tokens, num_reqs = so.total_num_scheduled_tokens, so.num_reqs
    kind = "decode" if num_tokens == num_reqs and not so.scheduled_new_reqs else "prefill"
    return StepClass(kind, _bucket(num_tokens), _bucket(num_reqs))


def request_features(new: NewRequestData) -> list[str]:
    """What a new request makes the step use: sampler variants, encoder, cached prefix, recompute."""
    p = new.sampling_params
    feats = ["greedy sampling" if p.greedy else "random sampling"]
    if not p.greedy:
        if p.top_p < 1.0:
            feats.append("top-p")
        if p.top_k > 0:
            feats.append("top-k")
        if p.min_p > 0.0:
            feats.append("min-p")
        if p.seed is not None:
            feats.append("per-request seed")
    if p.logprobs is not None:
        feats.append("logprobs")
    if p.suppress_token_ids or p.begin_suppress_token_ids:
        feats.append("suppressed tokens")
    if p.min_tokens > 0:
        feats.append("min_tokens")
    if new.mm_items:
        feats.append("multimodal encoder")
    if new.num_computed_tokens > 0:
        feats.append("prefix-cache hit")
    if new.num_prompt_tokens is not None and new.num_prompt_tokens < len(new.prompt_token_ids):
        feats.append("recompute after preemption")
    return feats


@dataclass(frozen=True)
class SlowStep:
    """A step the watchdog found slow (what its warning says)."""

    cls: StepClass
    duration_s: float
    median_s: float
    num_samples: int
    num_tokens: int
    num_reqs: int
    num_new_reqs: int
    firsts: tuple[str, ...]
    num_unlogged: int
    """Slow steps since the previous warning that were not logged (rate limit)."""

    def message(self) -> str:
        """The warning's text."""
        firsts = ", ".join(self.firsts) if self.firsts else "nothing"
        text = (
            f"slow engine step: {self.duration_s * 1e3:.1f} ms, {self.duration_s / self.median_s:.1f}x the median "
            f"{self.median_s * 1e3:.1f} ms of its class ({self.cls}; {self.num_samples} steps); {self.num_tokens} "
            f"tokens, {self.num_reqs} requests ({self.num_new_reqs} new); first use: {firsts}"
        )
        if self.num_unlogged:
            text += f" ({self.num_unlogged} more slow steps since the last warning, not logged)"
        return text


@dataclass(frozen=True)
class SubmittedStep:
    """A step in flight: its class, when it was submitted, its sizes and its firsts."""

    cls: StepClass
    t_submit: float
    num_tokens: int
    num_reqs: int
    num_new_reqs: int
    firsts: tuple[str, ...]


@dataclass
class StepWatchdog:
    """Times each step from submission to output and warns on one much slower than its class.

    ``graph_sizes``: the CUDA graph sizes decode steps pad to (empty: none; the engine passes the
    resolved capture sizes where the V2 runner runs with graphs).  ``clock``: seconds, monotonic
    (tests inject one).
    """

    graph_sizes: list[int] = field(default_factory=list)
    clock: Callable[[], float] = time.perf_counter
    slow_factor: float = SLOW_FACTOR
    window: int = WINDOW
    min_samples: int = MIN_SAMPLES
    warn_interval_s: float = WARN_INTERVAL_S
    times: dict[StepClass, deque[float]] = field(default_factory=dict)
    """Each class's latest step times (seconds)."""
    seen: set[str] = field(default_factory=set)
    """Features used so far (:func:`request_features`, graph sizes, classes)."""
    num_observed: int = 0
    """Steps timed so far."""
    num_slow: int = 0
    """Steps found slow so far (logged or not)."""
    _pending: dict[int, SubmittedStep] = field(default_factory=dict, init=False, repr=False)
    _decode_sizes: set[int] = field(default_factory=set, init=False, repr=False)
    """Request counts of the decode steps submitted so far."""
    _last_warning: float | None = field(default=None, init=False, repr=False)
    _num_unlogged: int = field(default=0, init=False, repr=False)

    def __post_init__(self) -> None:
        self.graph_sizes = sorted(set(self.graph_sizes))

    def submitted(self, so: SchedulerOutput) -> None:
        """Note a step handed to the executor: its class, sizes and what it uses for the first time."""
        cls = step_class(so)
        firsts = []
        # The strings are made only for what may be new: a known class, a decode size met before.
        if cls not in self.times and (name := f"class {cls}") not in self.seen:
            firsts.append(name)
        if cls.kind == "decode" and self.graph_sizes and so.num_reqs not in self._decode_sizes:
            self._decode_sizes.add(so.num_reqs)
            i = bisect_left(self.graph_sizes, so.num_reqs)
            name = (
                f"CUDA graph of {self.graph_sizes[i]} requests"
                if i < len(self.graph_sizes)
                else "eager decode"
            )
            if name not in self.seen:
                firsts.append(name)
        for new in so.scheduled_new_reqs:
            firsts += [f for f in request_features(new) if f not in self.seen and f not in firsts]
        self.seen.update(firsts)
        self._pending[so.step_id] = SubmittedStep(
            cls, self.clock(), so.total_num_scheduled_tokens, so.num_reqs, len(so.scheduled_new_reqs), tuple(firsts)
        )  # fmt: skip

    def answered(self, so: SchedulerOutput) -> SlowStep | None:
        """Time a step whose output came back; log it (rate-limited) when slow; returns it then."""
        p = self._pending.pop(so.step_id, None)
        if p is None:
            return None
        now = self.clock()
        slow = self.observe(p, now - p.t_submit, now)
        if slow is not None:
            logger.warning("%s", slow.message())
        return slow

    def observe(self, p: SubmittedStep, duration_s: float, now: float) -> SlowStep | None:
        """Judge one step's time against its class and add it there; the :class:`SlowStep` to log
        (None when not slow, or when slow but rate-limited)."""
        self.num_observed += 1
        times = self.times.get(p.cls)
        if times is None:
            times = self.times[p.cls] = deque(maxlen=self.window)
        slow = None
        # Quick reject first: the median is at least the minimum.
        if len(times) >= self.min_samples and duration_s > self.slow_factor * min(times):
            median = sorted(times)[len(times) // 2]
            if duration_s > self.slow_factor * median:
                self.num_slow += 1
                if self._last_warning is not None and now - self._last_warning < self.warn_interval_s:
                    self._num_unlogged += 1
                else:
                    slow = SlowStep(p.cls, duration_s, median, len(times), p.num_tokens, p.num_reqs,
                                    p.num_new_reqs, p.firsts, self._num_unlogged)  # fmt: skip
                    self._last_warning, self._num_unlogged = now, 0
        times.append(duration_s)
        return slow

    def forget_in_flight(self) -> None:
        """Drop the steps in flight (the engine failed; their outputs never come)."""
        self._pending.clear()
