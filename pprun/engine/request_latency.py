"""Request latency histograms as a server reports them: time to first token, time per output
token, inter-token latency and queue time, in ``prometheus_client`` histograms named and bucketed
as vLLM's (``vllm:`` -> ``pprun:``), so that dashboards built for one read the other.

The serving client (``pprun.engine.async_engine.EngineClient``) feeds them from the engine's step
reports, on the thread that turns reports into deltas; every time is the difference of two wall
clock stamps (``time.time``) of this host:

* ``pprun:time_to_first_token_seconds``: arrival (the request accepted) to the report of the step
  that gave its first token; one observation per request that got a token;
* ``pprun:inter_token_latency_seconds``: between consecutive reports that gave a request tokens;
  one observation per such report after the first (one token each: a step samples one token per
  request), so a request of ``n`` tokens adds ``n - 1``;
* ``pprun:time_per_output_token_seconds``: per finished request of at least two tokens, its first
  to its last token over ``n - 1`` (vLLM's ``request_time_per_output_token_seconds``; its older
  name, used here, is today its per-token latency, which pprun calls inter-token latency);
* ``pprun:request_queue_time_seconds``: arrival to the first step that took the request (stamped
  by the engine, ``RequestMetrics.first_scheduled_time``); per finished request that ran.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Gauge, Histogram
from prometheus_client.registry import Collector

from pprun.engine.outputs import RequestMetrics

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
"""vLLM's time-to-first-token buckets (seconds)."""
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
"""vLLM's per-token buckets (seconds), with three below its 10 ms floor: a small model's decode
step on one GPU takes a few milliseconds."""
QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
"""vLLM's request-latency buckets (seconds), with five below its 0.3 s floor: an idle server
takes a request within a step."""


@dataclass
class RequestTimes:
    """One streaming request's token times so far (wall clock)."""

    arrival_time: float
    first_token_time: float | None = None
    last_token_time: float | None = None
    num_tokens: int = 0


def _observe_many(hist: Histogram, value: float, count: int) -> None:
    """``count`` observations of ``value``: what ``observe`` adds, in one go.  prometheus_client
    has no weighted observe, and a step's requests mostly share one inter-token time (a step of
    256 requests is two additions, not 256 calls)."""
    if count == 1:
        hist.observe(value)
        return
    hist._sum.inc(value * count)
    for i, bound in enumerate(hist._upper_bounds):
        if value <= bound:
            hist._buckets[i].inc(count)
            break


class LatencyHistograms(Collector):
    """The four histograms (see the module docstring) and the unfinished-request gauge; a
    ``prometheus_client`` collector, so a registry serves them (:attr:`registry` has only them)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram("pprun:time_to_first_token_seconds", "Time to first token (arrival to the step "
                              "that gave it)", buckets=TTFT_BUCKETS, registry=r)  # fmt: skip
        self.tpot = Histogram("pprun:time_per_output_token_seconds", "Time per output token of each finished "
                              "request (first to last token over tokens - 1)", buckets=TOKEN_BUCKETS, registry=r)  # fmt: skip
        self.itl = Histogram("pprun:inter_token_latency_seconds", "Time between steps that gave a request tokens",
                             buckets=TOKEN_BUCKETS, registry=r)  # fmt: skip
        self.queue = Histogram("pprun:request_queue_time_seconds", "Arrival to the first step that took the "
                               "request", buckets=QUEUE_BUCKETS, registry=r)  # fmt: skip
        self.unfinished = Gauge("pprun_requests_unfinished", "requests accepted whose last answer is not "
                                "delivered yet", registry=r, multiprocess_mode="livesum")  # fmt: skip
        """Set by the serving client as requests come and go; beside the histograms so that
        front-end processes' counts add up the same way (``prometheus_client`` multi-process mode)."""

    def collect(self) -> Iterator:
        """The histograms' metric families (to serve them from another registry)."""
        return self.registry.collect()

    def step_tokens(self, t: float, updates: list[tuple[RequestTimes, int]]) -> None:
        """A step's report at ``t`` gave each request in ``updates`` that many new tokens."""
        itls: dict[float, int] = {}
        for times, num_new in updates:
            if num_new <= 0:
                continue
            if times.first_token_time is None:
                times.first_token_time = t
                self.ttft.observe(t - times.arrival_time)
            else:
                itl = t - times.last_token_time
                itls[itl] = itls.get(itl, 0) + 1
            times.last_token_time = t
            times.num_tokens += num_new
        for itl, count in itls.items():
            _observe_many(self.itl, itl, count)

    def finished(self, times: RequestTimes, metrics: RequestMetrics | None) -> None:
        """A request ended: its time per output token and its queue time (where it ran)."""
        if times.num_tokens >= 2:
            self.tpot.observe((times.last_token_time - times.first_token_time) / (times.num_tokens - 1))
        queue_time = metrics.queue_time if metrics is not None else None
        if queue_time is not None:
            self.queue.observe(max(queue_time, 0.0))
