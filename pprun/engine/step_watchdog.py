"""The step watchdog: a step much slower than its class is logged, with its sizes and what it used
for the first time, so that a regression shows in a deployment's logs.

A step's time is what it adds as the engine sees it: its launch (from
:meth:`StepWatchdog.submitting` to :meth:`StepWatchdog.submitted`: the host time of handing it to
the executor, which with the in-process executor launches its kernels), then from the end of that
launch or, when later, from the output of the step ahead of it, to :meth:`StepWatchdog.answered`
(its output back), less the launches of other steps in that interval.  With async scheduling a
step is submitted while the one ahead still runs (a decode step behind a new request's prefill,
say); from its submission alone its time would include the step ahead, and every first decode
step after a prefill would read as many times its class's median (seen in serving at one request
at a time: a 1 ms decode step timed at 13-27 ms).  The other way round, the engine launches the
next step before it waits for the one in flight: that launch is the next step's (an eager mixed
step of a new prompt and running decodes launches kernel by kernel, tens of ms for a model of 36
layers), not the in-flight decode step's, which would otherwise read as a slow decode step with
nothing new.  Through a pipeline of several stages the time is then the interval between two
outputs, which is also what a client sees between tokens.

A step's *class* (:class:`StepClass`) is its kind and its size, bucketed:

* kind ``decode`` (every scheduled request computes one token and none is new) or ``prefill``
  (anything else: a prompt chunk, a new or resumed request — mixed steps included);
* the number of tokens and of requests, each rounded up to a power of two (1, 2, 4, ...; for
  decode both are the same).

Each class keeps the last :data:`WINDOW` times; a step is judged against the median of its class
once :data:`MIN_SAMPLES` are there, before its own time joins them, and is slow above
:data:`SLOW_FACTOR` x that median.  At most one warning per :data:`WARN_INTERVAL_S`; the next one
says how many slow steps went unlogged in between.

*First use*: what a step is the first to use, as keys of the engine's first-use record
(``pprun.utils.first_use``, the one the warm-up fills before the engine reports ready): known
from its ``SchedulerOutput`` alone (no runner round trip), its kind with the classes of its token
and request counts (:func:`step_first_use_keys`) and, per new request, each sampler variant
(greedy, temperature, top-p, top-k, min-p, seed, logprobs, suppressed tokens, min-tokens), a
multimodal item (encoder) and a prefix-cache hit (:func:`request_features`); and, arriving with
the step's output, what the last stage compiled, captured or ran for the first time launching
it (Triton kernels, CUDA graphs, sampler branches).  A resumption after preemption is named in
the warning as well, though it is no key: it runs as a prefill that starts mid-prompt.  The
step whose output is awaited is the one judged, with the firsts it was submitted and answered
with.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import NamedTuple

from pprun.core.outputs import NewRequestData, SchedulerOutput
from pprun.utils.first_use import FirstUse, count_class

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


RESUMED = "recompute after preemption"
"""The :func:`request_features` entry of a request resumed after preemption (named in a slow
step's warning, not a first-use key)."""


def step_kind(so: SchedulerOutput) -> str:
    """``decode`` (every request computes one token, none is new), ``mixed`` (some requests
    decode while others compute prompt tokens) or ``prefill`` (every request computes prompt
    tokens: new ones, chunks, resumptions)."""
    num_tokens, num_reqs = so.total_num_scheduled_tokens, so.num_reqs
    if not so.scheduled_new_reqs and num_tokens == num_reqs:
        return "decode"
    cached = so.scheduled_cached_reqs
    n = so.num_scheduled_tokens
    # A cached request scheduled one token decodes (a one-token prompt chunk counts as one too).
    if any(n[req_id] == 1 for req_id in cached.req_ids) and (so.scheduled_new_reqs or num_tokens > num_reqs):
        return "mixed"
    return "prefill"


def step_first_use_keys(kind: str, num_tokens: int, num_reqs: int) -> list[str]:
    """The first-use keys of a step of ``kind``: the class of its request count and, unless it
    decodes (one token per request), of its token count (``pprun.utils.first_use.count_class``)."""
    keys = [f"step: {kind} {count_class(num_reqs)} requests"]
    if kind != "decode":
        keys.append(f"step: {kind} {count_class(num_tokens)} tokens")
    return keys


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
        feats.append(RESUMED)
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
    """A step in flight: its class, when its launch ended, its sizes and its firsts, and how long
    its launch took."""

    cls: StepClass
    t_submit: float
    num_tokens: int
    num_reqs: int
    num_new_reqs: int
    firsts: tuple[str, ...]
    launch_s: float = 0.0
    """Host time from :meth:`StepWatchdog.submitting` to :meth:`StepWatchdog.submitted` (0 when
    the engine did not say when it began)."""


@dataclass
class StepWatchdog:
    """Times each step from submission (or the output ahead of it) to its output and warns on one
    much slower than its class.

    ``first_use``: the engine's first-use record, where each step's new keys are recorded (and,
    after ready, counted and logged by it).  ``clock``: seconds, monotonic (tests inject one).
    """

    first_use: FirstUse = field(default_factory=FirstUse)
    clock: Callable[[], float] = time.perf_counter
    slow_factor: float = SLOW_FACTOR
    window: int = WINDOW
    min_samples: int = MIN_SAMPLES
    warn_interval_s: float = WARN_INTERVAL_S
    times: dict[StepClass, deque[float]] = field(default_factory=dict)
    """Each class's latest step times (seconds)."""
    num_observed: int = 0
    """Steps timed so far."""
    num_slow: int = 0
    """Steps found slow so far (logged or not)."""
    judging: bool = True
    """False while the engine warms up: steps are timed into their classes but none is judged
    (the warm-up's steps are the ones that compile)."""
    _pending: dict[int, SubmittedStep] = field(default_factory=dict, init=False, repr=False)
    _known: set[tuple[str, int]] = field(default_factory=set, init=False, repr=False)
    """``(kind, num_reqs)`` and ``(kind, -num_tokens)`` of the steps submitted so far (their keys
    are recorded)."""
    _last_warning: float | None = field(default=None, init=False, repr=False)
    _num_unlogged: int = field(default=0, init=False, repr=False)
    _last_answered: float = field(default=float("-inf"), init=False, repr=False)
    """When the latest output came back: a step's time starts there if it was submitted before."""
    _launch_began: float | None = field(default=None, init=False, repr=False)
    """When the launch of the step about to be submitted began (:meth:`submitting`)."""
    _launches: deque[tuple[float, float]] = field(default_factory=deque, init=False, repr=False)
    """``(began, ended)`` of recent launches: taken out of the times of the steps in flight then."""

    def submitting(self) -> None:
        """The engine is about to hand a step to the executor: its launch begins (the host time
        until :meth:`submitted` is that step's, not the steps' in flight)."""
        self._launch_began = self.clock()

    def submitted(self, so: SchedulerOutput) -> None:
        """Note a step handed to the executor: its class, sizes and what it uses for the first time."""
        cls = step_class(so)
        record = self.first_use.record
        firsts = []
        # Keys are made only for what may be new: a step of known kind and sizes makes none.
        num_tokens, num_reqs = so.total_num_scheduled_tokens, so.num_reqs
        kind = "decode" if cls.kind == "decode" else step_kind(so)
        if (kind, num_reqs) not in self._known or (kind, -num_tokens) not in self._known:
            self._known.update(((kind, num_reqs), (kind, -num_tokens)))
            firsts += [key for key in step_first_use_keys(kind, num_tokens, num_reqs) if record(key)]
        for new in so.scheduled_new_reqs:
            for feature in request_features(new):
                if feature == RESUMED:
                    firsts.append(feature)
                elif record(key := f"request: {feature}"):
                    firsts.append(key)
        now = self.clock()
        began, self._launch_began = self._launch_began, None
        launch_s = 0.0 if began is None else max(0.0, now - began)
        if launch_s > 0.0:
            self._launches.append((began, now))
        self._pending[so.step_id] = SubmittedStep(
            cls, now, num_tokens, num_reqs, len(so.scheduled_new_reqs), tuple(dict.fromkeys(firsts)), launch_s
        )

    def answered(self, so: SchedulerOutput, stage_keys: tuple[str, ...] = ()) -> SlowStep | None:
        """Time a step whose output came back; log it (rate-limited) when slow; returns it then.
        ``stage_keys``: what the last stage met for the first time launching it (its output's
        ``first_use``), recorded here and named with the step's own firsts."""
        p = self._pending.pop(so.step_id, None)
        if stage_keys:
            new = self.first_use.add(stage_keys)
            if p is not None and new:
                p = replace(p, firsts=p.firsts + tuple(new))
        if p is None:
            return None
        now = self.clock()
        started, self._last_answered = max(p.t_submit, self._last_answered), now
        # Other steps' launches in this step's interval (its own ended at t_submit <= started).
        others = sum(max(0.0, min(end, now) - max(began, started)) for began, end in self._launches)
        while self._launches and self._launches[0][1] <= now:
            self._launches.popleft()  # every later interval starts at this output or after
        slow = self.observe(p, p.launch_s + (now - started) - others, now)
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
        if self.judging and len(times) >= self.min_samples and duration_s > self.slow_factor * min(times):
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
        self._last_answered = float("-inf")
        self._launch_began = None
        self._launches.clear()
