"""The result of ``pprun bench``: its configuration facts, pprun's and the peer's figures side by
side, the JSON it prints and writes, and the Hydra callback that renders a sweep's report."""

from __future__ import annotations

import json
import logging
import sys
from typing import Any

from pprun.apps import job_output_dir, job_output_path
from pprun.apps.bench.metrics import (
    common_prefix_tokens,
    first_token_match_fraction,
    greedy_match_fraction,
    pprun_over_peer,
)
from pprun.apps.bench.peers import PeerResult
from pprun.config.config import BenchAppConfig

logger = logging.getLogger(__name__)


def config_facts(cfg: BenchAppConfig, facts: dict[str, Any]) -> dict[str, Any]:
    """The result's ``"config"`` object, from ``LLM.describe()``'s ``facts``."""
    return {
        "model": facts.get("model"),
        "runner": facts.get("runner"),
        "executor": facts.get("executor"),
        "pp": facts.get("pipeline_parallel_size"),
        "layer_partition": facts.get("layer_partition"),
        "device": facts.get("device"),
        "dtype": facts.get("dtype"),
        "batch": cfg.scheduler.max_num_seqs,
        "steps_in_flight": facts.get("steps_in_flight"),
        "async_scheduling": facts.get("async_scheduling"),
        "async_pipeline_steps": facts.get("async_pipeline_steps"),
        # CUDA graphs are only captured on GPU.
        "cudagraph_mode": cfg.compilation.cudagraph_mode if str(facts.get("device")).startswith("cuda") else "none",
    }


def peer_entry(
    pprun: dict[str, Any],
    pprun_tokens: list[list[int]],
    peer: PeerResult,
    eos_token_ids: set[int],
    ignore_eos: bool,
) -> tuple[dict[str, Any], float]:
    """The result's ``"peer"`` object and the ratio of output tokens per second (pprun / peer;
    with repeated passes, median over median)."""
    metrics = dict(peer.metrics)
    # Both are greedy on the same inputs: a low fraction flags a correctness problem (small
    # numeric differences can flip a near-tie, so 1.0 is not guaranteed in half precision).
    metrics["greedy_match_fraction"] = greedy_match_fraction(pprun_tokens, peer.tokens, eos_token_ids, ignore_eos)
    metrics["first_token_match_fraction"] = first_token_match_fraction(pprun_tokens, peer.tokens)
    metrics.update(common_prefix_tokens(pprun_tokens, peer.tokens))
    if metrics.get("ttft_ms_p50") is not None:
        # A peer that reports latencies (vLLM) is compared figure by figure.
        metrics["pprun_over_peer"] = pprun_over_peer(pprun, metrics)
    return metrics, round(pprun["output_tokens_per_s"] / metrics["output_tokens_per_s"], 3)


def job_overrides() -> dict[str, str] | None:
    """This Hydra job's command-line overrides as ``{key: value}`` (a sweep job's own values), or
    None outside Hydra."""
    try:
        from hydra.core.hydra_config import HydraConfig
    except ImportError:
        return None
    if not HydraConfig.initialized():
        return None
    overrides = {}
    for item in HydraConfig.get().overrides.task:
        key, sep, value = item.partition("=")
        if sep:
            overrides[key.lstrip("+~")] = value
    return overrides


def emit(result: dict[str, Any], output_json: str | None) -> None:
    """Print the result as JSON on stdout, and write it to ``output_json`` (in a sweep, to the
    job's folder as ``bench.json`` when no path is given)."""
    text = json.dumps(result, indent=2)
    print(text, flush=True)
    out_paths = [p for p in (job_output_path(output_json),) if p is not None]
    sweep_dir = job_output_dir()
    if sweep_dir is not None and not out_paths:
        # A sweep prints one object per job; keep each in its job folder too.
        out_paths.append(sweep_dir / "bench.json")
    for path in out_paths:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")
        logger.info("bench: wrote %s", path)


try:
    from hydra.experimental.callback import Callback as _HydraCallback
except ImportError:  # Hydra is optional for the Python API; the callback only runs under it
    _HydraCallback = object


class SweepReport(_HydraCallback):
    """Hydra callback (``hydra.callbacks`` in ``conf/bench.yaml``): when a ``pprun bench -m`` sweep
    ends, render its table and plot into the sweep directory (:mod:`pprun.apps.report`)."""

    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        """Render the report of the sweep just finished; a failure to render is logged, not raised,
        so the runs' JSONs stay the sweep's result (``pprun report DIR`` renders again)."""
        from pprun.apps.report import render_report

        sweep_dir = str(config.hydra.sweep.dir)
        try:
            paths = render_report(sweep_dir)
        except Exception as e:  # a plotting error must not hide the finished runs
            logger.error("bench: no sweep report for %s (%s: %s)", sweep_dir, type(e).__name__, e)
            return
        for path in paths.values():
            print(f"bench: wrote {path}", file=sys.stderr, flush=True)
