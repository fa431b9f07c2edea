"""pprun's side of ``pprun bench``: warm the engine up, time the workload through
``LLM.generate``, and read its figures from the request metrics and the engine's step trace."""

from __future__ import annotations

import time
from typing import Any, Protocol, runtime_checkable

from pprun.apps.bench.metrics import PREFILL_KEYS, STEADY_DECODE_KEYS, latency_metrics, throughput_metrics
from pprun.apps.bench.workloads import Workload
from pprun.sampling.params import SamplingParams


@runtime_checkable
class ReportsCacheStats(Protocol):
    """An engine front end (``LLM``) that reports its KV-cache statistics (prefix-cache hit rate,
    cached blocks, ...): ``pprun bench`` copies them into ``pprun.cache_stats`` after the timed
    run.  Optional: an ``LLM`` without ``cache_stats`` leaves the key out."""

    def cache_stats(self) -> dict[str, Any]:
        """The statistics as a JSON-serialisable dict of numbers."""
        ...

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block and zero the counters (while no request holds blocks)."""
        ...


def sampling_params(max_tokens: int, ignore_eos: bool) -> SamplingParams:
    """Greedy, exactly ``max_tokens`` with ``ignore_eos`` (else up to EOS): what every engine runs."""
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos)


def run_pprun(
    llm: Any, workload: Workload, ignore_eos: bool, repeats: int = 1
) -> tuple[dict[str, Any], list[list[int]]]:
    """Warm up on ``workload.warmup``, then time ``workload.requests`` through ``llm.generate``
    ``repeats`` times (:func:`repeated`): the passes' figures summarised, and each request's
    output token ids (the first pass's)."""
    if workload.warmup:
        llm.generate(
            [r.prompt() for r in workload.warmup], [sampling_params(r.max_tokens, ignore_eos) for r in workload.warmup]
        )
    return repeated(lambda: timed_pass(llm, workload, ignore_eos), repeats)


def repeated(timed: Any, repeats: int) -> tuple[dict[str, Any], list[list[int]]]:
    """``repeats`` calls of ``timed()`` (each ``(figures, tokens)``), summarised
    (:func:`~pprun.apps.bench.metrics.summarize_runs`); when the output rate spreads by more than
    :data:`~pprun.apps.bench.metrics.SPREAD_LIMIT` of its median the passes are made once more,
    and a second spread that wide is flagged ``unstable`` (with the first set's spread kept)."""
    from pprun.apps.bench.metrics import SPREAD_LIMIT, summarize_runs

    passes = [timed() for _ in range(repeats)]
    summary = summarize_runs([p[0] for p in passes])
    if repeats > 1 and summary["spread"] is not None and summary["spread"] > SPREAD_LIMIT:
        first_spread = summary["spread"]
        passes = [timed() for _ in range(repeats)]
        summary = summarize_runs([p[0] for p in passes])
        summary["retimed_after_spread"] = first_spread
        summary["unstable"] = summary["spread"] is not None and summary["spread"] > SPREAD_LIMIT
    return summary, passes[0][1]


def timed_pass(llm: Any, workload: Workload, ignore_eos: bool) -> tuple[dict[str, Any], list[list[int]]]:
    """One timed pass of ``workload.requests`` from an empty prefix cache: its figures and each
    request's output token ids."""
    if isinstance(llm, ReportsCacheStats):
        # The timed run's cache figures are its own, and it starts from no cached block (as the
        # vLLM peer's does): the warm-up's prompts are other prompts, but the counters add up.
        llm.reset_prefix_cache()
    from pprun.utils.step_trace import EngineTrace

    requests = workload.requests
    prompts = [r.prompt() for r in requests]
    # The engine's step trace over the timed run (host clock: three reads per step); the one of
    # PPRUN_STEP_TRACE when set, else one for this run only.
    engine = llm.engine
    own_trace = engine.trace is None
    trace = engine.trace = engine.trace or EngineTrace()
    first_step = len(trace.rows)
    try:
        start = time.perf_counter()
        outputs = llm.generate(prompts, [sampling_params(r.max_tokens, ignore_eos) for r in requests])
        elapsed_s = time.perf_counter() - start
    finally:
        if own_trace:
            engine.trace = None
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    ttfts = [o.metrics.time_to_first_token for o in outputs if o.metrics.time_to_first_token is not None]
    tpots = [o.metrics.time_per_output_token for o in outputs if o.metrics.time_per_output_token is not None]
    metrics = {
        **throughput_metrics(elapsed_s, requests, tokens),
        **latency_metrics(ttfts, tpots),
        # Steady decode: answered steps after the last prefill while the batch is full (None
        # when too few such steps); the whole-run rates above include prefill and the tail.
        **(trace.steady_decode(since=first_step) or dict.fromkeys(STEADY_DECODE_KEYS)),
        # Prefill phase: the steps that computed prompt tokens, from the run's start to the
        # answer of the last of them (None without such a step).
        **(trace.prefill_phase(start, since=first_step) or dict.fromkeys(PREFILL_KEYS)),
    }
    if isinstance(llm, ReportsCacheStats):
        metrics["cache_stats"] = llm.cache_stats()
    return metrics, tokens
