"""What the server reports about its engine, in one place: ``GET /metrics`` on the HTTP server
writes these in Prometheus' text format, through ``prometheus_client``.

Two sources, one registry (:class:`ServerMetrics`):

* the engine's state now (:func:`server_metrics`, one :class:`Metric` each, ``pprun_`` names): an
  engine-side statistic joins that list, read from what the
  :class:`~pprun.engine.async_engine.EngineClient` keeps of the engine's reports: nothing here asks
  the engine process anything, so a scrape never waits for a step;
* the request latency histograms the client observes as reports come (time to first token, per
  output token, between tokens, in the queue: ``pprun:`` names, vLLM's with its prefix,
  ``pprun.engine.request_latency``) and its unfinished requests; with ``serve.api_servers`` > 1
  summed over the front-end processes (``prometheus_client``'s multi-process mode), while the
  engine's state is the same in each (every front end gets the engine's counters every step).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from pprun.engine.async_engine import EngineClient

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
"""Prometheus' text exposition format, as ``/metrics`` answers it."""


@dataclass(frozen=True)
class Metric:
    """One gauge or counter and its value now."""

    name: str
    kind: str
    """Prometheus type: "gauge" or "counter" (a counter's name ends in ``_total``)."""
    help: str
    value: float


def server_metrics(engine: EngineClient) -> list[Metric]:
    """The engine's state as the server knows it now, prefix caching's statistics included (as the
    engine last reported them; zeros before its first report or with caching off)."""
    facts = engine.describe()
    cache = engine.cache_stats()
    return [
        Metric("pprun_healthy", "gauge", "1 while the engine takes requests (no stage failure, not draining)",
               float(engine.healthy)),
        Metric("pprun_kv_blocks_total", "gauge", "KV-cache blocks per stage", facts["kv_blocks_per_stage"]),
        Metric("pprun_kv_blocks_free", "gauge", "KV-cache blocks free at the engine's last report",
               engine.num_free_blocks()),
        Metric("pprun_engine_steps_total", "counter", "engine steps submitted so far", engine.num_steps),
        Metric("pprun_first_uses_after_ready_total", "counter",
               "kernels compiled, graphs captured, step classes and sampler variants met for the first time "
               "after ready (each logged once; 0 when the warm-up covered the traffic)",
               engine.num_first_uses_after_ready),
        Metric("pprun_prefix_cache_enabled", "gauge", "1 where full KV blocks are reused across requests",
               float(bool(cache.get("enabled", False)))),
        Metric("pprun_prefix_cache_hit_rate", "gauge",
               "prompt tokens served from cached blocks over prompt tokens looked up", cache.get("hit_rate", 0.0)),
        Metric("pprun_prefix_cache_queries_total", "counter", "requests looked up in the prefix cache",
               cache.get("num_queries", 0)),
        Metric("pprun_prefix_cache_hits_total", "counter", "requests that found a cached prefix",
               cache.get("num_hits", 0)),
        Metric("pprun_prefix_cache_blocks", "gauge", "KV blocks that hold a named (reusable) prefix",
               cache.get("num_cached_blocks", 0)),
        Metric("pprun_prefix_cache_evicted_blocks_total", "counter", "cached blocks evicted for new ones",
               cache.get("num_evicted_blocks", 0)),
    ]


class _EngineState(Collector):
    """:func:`server_metrics` as a ``prometheus_client`` collector (read at each scrape)."""

    def __init__(self, engine: EngineClient) -> None:
        self.engine = engine

    def collect(self) -> Iterator:
        for m in server_metrics(self.engine):
            if m.kind == "counter":
                yield CounterMetricFamily(m.name.removesuffix("_total"), m.help, value=m.value)
            else:
                yield GaugeMetricFamily(m.name, m.help, value=m.value)


class ServerMetrics:
    """The registry ``/metrics`` serves: the engine's state and the client's latency histograms
    (and unfinished requests), or, in a front-end process of several (``PROMETHEUS_MULTIPROC_DIR``
    set, ``pprun.serve.api_servers``), every front end's histograms summed by
    ``prometheus_client``'s multi-process collector."""

    def __init__(self, engine: EngineClient) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineState(engine))
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            MultiProcessCollector(self.registry)
        else:
            self.registry.register(engine.latency)

    def text(self) -> bytes:
        """Every metric in Prometheus' text format (:data:`CONTENT_TYPE`)."""
        return generate_latest(self.registry)
