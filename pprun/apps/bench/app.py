"""``pprun bench``'s run: check, time pprun, shut it down, time the peer, report."""

from __future__ import annotations

import gc
import logging
from dataclasses import dataclass
from typing import Any

from pprun.apps.bench.checks import check_bench_config, check_model_for_workload
from pprun.apps.bench.peers import PEERS, PeerFailed, PeerJob, PeerSkipped
from pprun.apps.bench.pprun_engine import run_pprun
from pprun.apps.bench.results import config_facts, emit, job_overrides, peer_entry
from pprun.apps.bench.workloads import (
    Workload,
    build_workload,
    check_workload_fits,
    warmup_prompts,
    workload_facts,
    workload_rates,
)
from pprun.config.config import BenchAppConfig

logger = logging.getLogger(__name__)


def free_device_memory(device: str) -> None:
    """Return what this process cached on ``device`` to the driver (the next engine needs it)."""
    gc.collect()
    if str(device).startswith("cuda"):
        import torch

        if not torch.cuda.is_initialized():
            return  # the stages ran in their own processes; a context here would only take memory
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info()
        # What the next engine (a peer in another process) can have: printed for its errors.
        logger.info("bench: %s has %.1f of %.1f GiB free", device, free / 2**30, total / 2**30)


@dataclass
class PprunRun:
    """pprun's timed run, and what the peer needs of its settings (kept after its engine is gone)."""

    workload: Workload
    facts: dict[str, Any]
    """``LLM.describe()``."""
    peer_settings: dict[str, Any]
    """:class:`PeerJob` fields taken from the engine."""
    metrics: dict[str, Any]
    tokens: list[list[int]]


def time_pprun(cfg: BenchAppConfig, llm: Any, entries: list[tuple[str, dict, int]] | None) -> PprunRun:
    """Build the workload for the started ``llm`` and time it (no reference to the engine
    outlives this call, so shutting ``llm`` down frees the device)."""
    engine = llm.engine
    num_warmup = warmup_prompts(cfg, cfg.num_prompts if entries is None else len(entries))
    workload = build_workload(cfg, engine, entries, num_warmup)
    check_workload_fits(workload.requests, engine.max_model_len)
    facts = llm.describe()
    resolved = engine.resolved
    peer_settings = {
        "model_dir": str(resolved.model_dir),
        "device": str(facts["device"]),
        "dtype": facts["dtype"],
        "max_model_len": engine.max_model_len,
        "eos_token_ids": set(engine.eos_token_ids),
        "executor": str(resolved.executor),
        "pp_size": len(resolved.layer_partition),
        "max_num_batched_tokens": resolved.max_num_batched_tokens,
        "prefix_caching": bool(facts["prefix_caching"]),
    }
    logger.info("bench: %d %s requests (%s), timing pprun", len(workload.requests), cfg.workload, workload.source)
    metrics, tokens = run_pprun(llm, workload, cfg.ignore_eos)
    return PprunRun(workload, facts, peer_settings, metrics, tokens)


def run(cfg: BenchAppConfig) -> dict[str, Any]:
    """Benchmark pprun (and the peer) on ``cfg``'s workload; print and return the result object."""
    from pprun.engine.llm import LLM

    entries = check_bench_config(cfg)
    resolved = check_model_for_workload(cfg)
    peer = PEERS[cfg.peer]
    if peer is not None:
        peer.check(cfg)  # a peer that is not there fails the run before pprun spends any time
    llm = LLM(config=resolved)
    device = str(cfg.device)
    try:
        device = str(llm.describe()["device"])
        ours = time_pprun(cfg, llm, entries)
    finally:
        # The peer loads a second copy of the weights: free pprun's stages (and KV cache) first.
        llm.shutdown()
        del llm
        free_device_memory(device)
    workload, pprun_result, pprun_tokens = ours.workload, ours.metrics, ours.tokens
    pprun_result.update(workload_rates(cfg, workload.requests, pprun_result["elapsed_s"]))
    result: dict[str, Any] = {
        "workload": workload_facts(cfg, workload),
        "config": config_facts(cfg, ours.facts),
        "pprun": pprun_result,
        "peer": None,
        "ratio": None,
    }
    overrides = job_overrides()
    if overrides is not None:
        # What the user set for this run: `pprun report` tells the swept settings by them.
        result["overrides"] = overrides
    if peer is not None:
        logger.info("bench: timing the peer (%s, batch %d)", peer.name, cfg.scheduler.max_num_seqs)
        job = PeerJob(
            cfg=cfg, requests=workload.requests, warmup=workload.warmup, batch_size=cfg.scheduler.max_num_seqs,
            **ours.peer_settings,
        )  # fmt: skip
        try:
            peer_result = peer.run(job)
        except PeerSkipped as e:
            logger.warning("bench: peer %s skipped: %s", peer.name, e)
            result["peer"] = {"name": peer.name, "peer_skipped": str(e)}
        except PeerFailed as e:
            logger.error("bench: peer %s failed: %s", peer.name, e)
            result["peer"] = {"name": peer.name, "peer_error": str(e)}
        else:
            result["peer"], result["ratio"] = peer_entry(
                pprun_result, pprun_tokens, peer_result, job.eos_token_ids, cfg.ignore_eos
            )
        free_device_memory(device)
    emit(result, cfg.output_json)
    return result


def main() -> None:
    """Entry point of ``pprun bench``: ``sys.argv[1:]`` are Hydra overrides."""
    from pprun.apps import run_hydra_app

    run_hydra_app("bench", run)
