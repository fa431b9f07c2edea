"""The figures of a timed run, computed the same way for pprun and every peer: throughput,
latency percentiles, steady decode, and how far two engines' greedy tokens agree."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pprun.apps.bench.workloads import BenchRequest

STEADY_DECODE_KEYS = ("decode_tokens_per_s", "decode_ms_per_step", "decode_steps", "decode_batch")
"""Keys of ``EngineTrace.steady_decode`` in the result (null when the run has too few such steps)."""

PREFILL_KEYS = ("prefill_tokens_per_s", "prefill_ms_per_step", "prefill_steps")
"""Keys of ``EngineTrace.prefill_phase`` in the result (null when no step record carried prompt tokens)."""

COMPARED_KEYS = (
    "output_tokens_per_s", "ttft_ms_p50", "ttft_ms_p99", "tpot_ms_p50", "decode_tokens_per_s",
    "prefill_tokens_per_s", "prefill_ms_per_step",
)  # fmt: skip
"""The figures ``pprun_over_peer`` divides (pprun's value over the peer's) when the peer has them."""


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (linear interpolation), or None without values."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def ms(seconds: float | None) -> float | None:
    """Seconds as milliseconds rounded to the microsecond (None stays None)."""
    return None if seconds is None else round(seconds * 1000.0, 3)


def throughput_metrics(
    elapsed_s: float, requests: list[BenchRequest], tokens: list[list[int]]
) -> dict[str, Any]:
    """Whole-run rates of a timed run: output and total tokens per second, requests per second."""
    num_output_tokens = sum(len(t) for t in tokens)
    num_prompt_tokens = sum(len(r.model_token_ids) for r in requests)
    return {
        "elapsed_s": round(elapsed_s, 4),
        "num_output_tokens": num_output_tokens,
        "output_tokens_per_s": round(num_output_tokens / elapsed_s, 2),
        "total_tokens_per_s": round((num_prompt_tokens + num_output_tokens) / elapsed_s, 2),
        "requests_per_s": round(len(requests) / elapsed_s, 3),
    }


def latency_metrics(ttfts: Sequence[float], tpots: Sequence[float]) -> dict[str, float | None]:
    """TTFT and TPOT percentiles (ms) from per-request seconds."""
    return {
        "ttft_ms_p50": ms(percentile(ttfts, 50)),
        "ttft_ms_p99": ms(percentile(ttfts, 99)),
        "tpot_ms_p50": ms(percentile(tpots, 50)),
        "tpot_ms_p99": ms(percentile(tpots, 99)),
    }


def pprun_over_peer(pprun: dict[str, Any], peer: dict[str, Any]) -> dict[str, float]:
    """pprun's figure over the peer's for each of :data:`COMPARED_KEYS` both report (above 1 is
    pprun faster for rates, slower for latencies)."""
    out = {}
    for key in COMPARED_KEYS:
        ours, theirs = pprun.get(key), peer.get(key)
        if isinstance(ours, (int, float)) and isinstance(theirs, (int, float)) and theirs > 0:
            out[key] = round(ours / theirs, 3)
    return out


def until_eos(tokens: Sequence[int], eos_token_ids: set[int]) -> list[int]:
    """``tokens`` up to and including the first EOS (all of them without one)."""
    out = []
    for t in tokens:
        out.append(int(t))
        if t in eos_token_ids:
            break
    return out


def greedy_match_fraction(
    ours: list[list[int]], theirs: list[list[int]], eos_token_ids: set[int], ignore_eos: bool
) -> float:
    """The fraction of requests on which pprun and the peer generated the same tokens.  Without
    ``ignore_eos`` both stop at EOS and must agree up to it; with it, they must agree before
    pprun's first EOS, past which they need not: pprun samples on from the EOS while the peer
    (EOS suppressed by ``min_new_tokens``) never sampled it."""
    same = 0
    for a, b in zip(ours, theirs):
        if not ignore_eos:
            same += until_eos(a, eos_token_ids) == until_eos(b, eos_token_ids)
            continue
        head = until_eos(a, eos_token_ids)
        if head and head[-1] in eos_token_ids:
            head = head[:-1]
        same += list(b[: len(head)]) == head
    return round(same / len(ours), 3) if ours else 0.0


def first_token_match_fraction(ours: list[list[int]], theirs: list[list[int]]) -> float:
    """The fraction of requests whose first generated token is the same in both engines: the
    prefill's greedy pick, which a random half-precision checkpoint's near-tied logits flip far
    less often than they flip one of a whole sequence's tokens (``greedy_match_fraction``)."""
    pairs = [(a, b) for a, b in zip(ours, theirs) if a and b]
    return round(sum(a[0] == b[0] for a, b in pairs) / len(pairs), 3) if pairs else 0.0


def common_prefix_tokens(ours: list[list[int]], theirs: list[list[int]]) -> dict[str, float | None]:
    """How many leading generated tokens the two engines agree on, per request: the median and
    the least.  Unlike :func:`greedy_match_fraction` it says how far agreement reaches where one
    near-tie flips a sequence (random half-precision checkpoints), so tokens 2..N are compared too."""
    counts = []
    for a, b in zip(ours, theirs):
        n = 0
        for x, y in zip(a, b):
            if x != y:
                break
            n += 1
        counts.append(n)
    return {"common_prefix_tokens_p50": percentile(counts, 50), "common_prefix_tokens_min": min(counts, default=None)}


SPREAD_LIMIT = 0.15
"""A row whose passes' output rates spread by more than this share of their median is timed
again once, then flagged ``unstable``."""

RUN_KEYS_SKIPPED = ("cache_stats", "settings", "effective_settings", "name", "version")
"""Keys of a pass's figures that are facts about the engine, not measurements to take a median of."""


def summarize_runs(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One figure per key over repeated timed passes: the median of each number the passes all
    report (the facts of the first pass otherwise), with ``min_max`` (``[min, max]`` per number),
    ``repeats`` and ``spread`` (the output rate's max minus min over its median)."""
    import statistics

    first = runs[0]
    out: dict[str, Any] = {}
    min_max: dict[str, list[float]] = {}
    for key, value in first.items():
        values = [r.get(key) for r in runs]
        numeric = key not in RUN_KEYS_SKIPPED and all(
            isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)
        if numeric and len(runs) > 1:
            median = statistics.median(values)
            out[key] = round(median, 4) if isinstance(median, float) else median
            min_max[key] = [min(values), max(values)]
        else:
            out[key] = value
    out["repeats"] = len(runs)
    rates = [r["output_tokens_per_s"] for r in runs if r.get("output_tokens_per_s")]
    out["spread"] = round((max(rates) - min(rates)) / statistics.median(rates), 4) if rates else None
    if len(runs) > 1:
        out["min_max"] = min_max
    return out
