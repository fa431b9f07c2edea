"""What the server reports about its engine, in one place: ``GET /metrics`` on the HTTP server
writes these in Prometheus' text format.

An engine-side statistic joins the list in :func:`server_metrics` (one :class:`Metric` each),
read from what the :class:`~pprun.engine.async_engine.EngineClient` keeps of the engine's reports:
nothing here asks the engine process anything, so a scrape never waits for a step.
"""

from __future__ import annotations

from dataclasses import dataclass

from pprun.engine.async_engine import EngineClient


@dataclass(frozen=True)
class Metric:
    """One gauge or counter and its value now."""

    name: str
    kind: str
    """Prometheus type: "gauge" or "counter"."""
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
        Metric("pprun_requests_unfinished", "gauge", "requests accepted whose last answer is not delivered yet",
               engine.num_unfinished),
        Metric("pprun_kv_blocks_total", "gauge", "KV-cache blocks per stage", facts["kv_blocks_per_stage"]),
        Metric("pprun_kv_blocks_free", "gauge", "KV-cache blocks free at the engine's last report",
               engine.num_free_blocks()),
        Metric("pprun_engine_steps_total", "counter", "engine steps submitted so far", engine.num_steps),
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


def prometheus_text(metrics: list[Metric]) -> str:
    """Metrics in Prometheus' text exposition format."""
    lines = []
    for m in metrics:
        lines += [f"# HELP {m.name} {m.help}", f"# TYPE {m.name} {m.kind}", f"{m.name} {m.value:g}"]
    return "\n".join(lines) + "\n"
