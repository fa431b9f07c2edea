"""``pprun bench``'s run: check, time pprun, shut it down, time the peer, report."""

from __future__ import annotations

import copy
import gc
import logging
from dataclasses import dataclass
from typing import Any

from pprun.apps.bench.checks import check_bench_config, check_model_for_workload, resolved_repeats
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


def load_average() -> list[float] | None:
    """The host's 1, 5 and 15 minute load averages (None where the OS has none)."""
    import os

    try:
        return [round(v, 2) for v in os.getloadavg()]
    except OSError:
        return None


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
        "tp_size": resolved.cfg.parallel.tensor_parallel_size,
        "max_num_batched_tokens": resolved.max_num_batched_tokens,
        "prefix_caching": bool(facts["prefix_caching"]),
    }
    logger.info("bench: %d %s requests (%s), timing pprun", len(workload.requests), cfg.workload, workload.source)
    metrics, tokens = run_pprun(llm, workload, cfg.ignore_eos, resolved_repeats(cfg))
    return PprunRun(workload, facts, peer_settings, metrics, tokens)


def row_configs(cfg: BenchAppConfig) -> list[BenchAppConfig]:
    """The configuration of each timed row: ``cfg`` itself, or with ``batch_sizes`` one copy per
    batch size B (``num_prompts`` = B, ``scheduler.max_num_seqs`` = the largest B)."""
    if cfg.batch_sizes is None:
        return [cfg]
    top = max(cfg.batch_sizes)
    rows = []
    for size in cfg.batch_sizes:
        row = copy.deepcopy(cfg)
        row.num_prompts, row.scheduler.max_num_seqs = int(size), top
        row.batch_sizes = row.peer_batch_sizes = None
        rows.append(row)
    return rows


def row_result(cfg: BenchAppConfig, ours: PprunRun, swept: bool) -> dict[str, Any]:
    """One row's result object (pprun's side; the peer's is filled in later)."""
    pprun_result = dict(ours.metrics)
    pprun_result.update(workload_rates(cfg, ours.workload.requests, pprun_result["elapsed_s"]))
    config = config_facts(cfg, ours.facts)
    if swept:
        # The row's batch is its requests, all submitted at once; the engine's limit is the sweep's.
        config["batch"], config["max_num_seqs"] = cfg.num_prompts, cfg.scheduler.max_num_seqs
    result: dict[str, Any] = {
        "workload": workload_facts(cfg, ours.workload),
        "config": config,
        "pprun": pprun_result,
        "peer": None,
        "ratio": None,
    }
    overrides = job_overrides()
    if overrides is not None:
        # What the user set for this run: `pprun report` tells the swept settings by them.
        result["overrides"] = overrides
    return result


def sweep_summary(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One line per row of a ``batch_sizes`` run: the figures a table of it shows."""
    out = []
    for row in rows:
        ours, peer = row["pprun"], row["peer"] or {}
        out.append({
            "batch": row["config"]["batch"],
            "pprun_output_tokens_per_s": ours.get("output_tokens_per_s"),
            "peer_output_tokens_per_s": peer.get("output_tokens_per_s"),
            "ratio": row["ratio"],
            "pprun_ttft_ms_p50": ours.get("ttft_ms_p50"),
            "peer_ttft_ms_p50": peer.get("ttft_ms_p50"),
            "pprun_decode_ms_per_step": ours.get("decode_ms_per_step"),
            "peer_decode_ms_per_step": peer.get("decode_ms_per_step"),
            "pprun_prefill_tokens_per_s": ours.get("prefill_tokens_per_s"),
            "peer_prefill_tokens_per_s": peer.get("prefill_tokens_per_s"),
            "pprun_prefill_ms_per_step": ours.get("prefill_ms_per_step"),
            "peer_prefill_ms_per_step": peer.get("prefill_ms_per_step"),
            "pprun_prefill_steps": ours.get("prefill_steps"),
            "peer_prefill_steps": peer.get("prefill_steps"),
            "pprun_spread": ours.get("spread"),
            "peer_spread": peer.get("spread"),
            "unstable": bool(ours.get("unstable") or peer.get("unstable")),
        })  # fmt: skip
    return out


def run(cfg: BenchAppConfig) -> dict[str, Any]:
    """Benchmark pprun (and the peer) on ``cfg``'s workload, or on each of its ``batch_sizes``;
    print and return the result object."""
    from pprun.engine.llm import LLM

    entries = check_bench_config(cfg)
    load_start = load_average()
    rows = row_configs(cfg)
    swept = cfg.batch_sizes is not None
    resolved = check_model_for_workload(rows[0])
    peer = PEERS[cfg.peer]
    if peer is not None:
        peer.check(cfg)  # a peer that is not there fails the run before pprun spends any time
    llm = LLM(config=resolved)
    device = str(cfg.device)
    try:
        device = str(llm.describe()["device"])
        ours = [time_pprun(row, llm, entries) for row in rows]
    finally:
        # The peer loads a second copy of the weights: free pprun's stages (and KV cache) first.
        llm.shutdown()
        del llm
        free_device_memory(device)
    results = [row_result(row, run_, swept) for row, run_ in zip(rows, ours)]
    if peer is not None:
        # The rows the peer runs: every row, or those of peer_batch_sizes.
        asked = cfg.peer_batch_sizes
        picked = [i for i, row in enumerate(rows) if asked is None or row.num_prompts in asked]
        for i, row in enumerate(rows):
            if asked is not None and row.num_prompts not in asked:
                results[i]["peer"] = {
                    "name": peer.name, "peer_skipped": f"batch {row.num_prompts} is not in peer_batch_sizes={list(asked)}"
                }  # fmt: skip
        jobs = [
            PeerJob(
                cfg=rows[i], requests=ours[i].workload.requests, warmup=ours[i].workload.warmup,
                batch_size=rows[i].scheduler.max_num_seqs, repeats=resolved_repeats(cfg),
                **{**ours[i].peer_settings, "dtype": cfg.peer_dtype or ours[i].peer_settings["dtype"]},
            )
            for i in picked
        ]  # fmt: skip
        batches = ", ".join(str(job.cfg.num_prompts) for job in jobs) if swept else cfg.scheduler.max_num_seqs
        logger.info("bench: timing the peer (%s, batch %s)", peer.name, batches)
        for i, job, outcome in zip(picked, jobs, peer.run_all(jobs)):
            if isinstance(outcome, PeerSkipped):
                logger.warning("bench: peer %s skipped: %s", peer.name, outcome)
                results[i]["peer"] = {"name": peer.name, "peer_skipped": str(outcome)}
            elif isinstance(outcome, PeerFailed):
                logger.error("bench: peer %s failed: %s", peer.name, outcome)
                results[i]["peer"] = {"name": peer.name, "peer_error": str(outcome)}
            else:
                results[i]["peer"], results[i]["ratio"] = peer_entry(
                    results[i]["pprun"], ours[i].tokens, outcome, job.eos_token_ids, cfg.ignore_eos
                )
        free_device_memory(device)
    # What else the machine ran: a loaded host moves host-bound figures.
    load = {"start": load_start, "end": load_average()}
    if not swept:
        results[0]["load_average"] = load
        emit(results[0], cfg.output_json)
        return results[0]
    result = {"batch_sizes": list(cfg.batch_sizes), "rows": results, "summary": sweep_summary(results),
              "load_average": load}
    emit(result, cfg.output_json)
    return result


def main() -> None:
    """Entry point of ``pprun bench``: ``sys.argv[1:]`` are Hydra overrides."""
    from pprun.apps import run_hydra_app

    run_hydra_app("bench", run)
