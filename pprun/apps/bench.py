"""``pprun bench``: offline throughput and latency of pprun, and of a peer on the same workload.

The workload is ``num_prompts`` random prompts of ``input_len`` token ids (seeded) generating
``output_len`` tokens each, greedy and past EOS, or a JSONL file. pprun warms up on its first
requests (``num_warmup_prompts``: one full batch by default, 16 tokens each), then runs it timed;
its engine is then shut down and Hugging Face transformers' ``generate()`` (the peer, ``peer=hf``)
warms up the same way and runs the same token ids on the same device and dtype, in batches of
``max_num_seqs`` prompts of equal length (so nothing is padded). One JSON object is printed:
pprun's tokens/s, request throughput, TTFT and TPOT percentiles, its steady decode rate
(``decode_tokens_per_s``: the steps after the last prefill while the batch is full, so prefill and
the tail do not dilute it), the configuration facts, the peer's tokens/s and the ratio pprun/peer.
"""

from __future__ import annotations

import gc
import json
import logging
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pprun.apps import iter_jsonl, job_output_dir, job_output_path
from pprun.checks import is_int
from pprun.config.config import BenchAppConfig
from pprun.sampling.params import SamplingParams

logger = logging.getLogger(__name__)

PEERS = ("hf", "none")
"""Allowed values of ``peer``."""

STEADY_DECODE_KEYS = ("decode_tokens_per_s", "decode_ms_per_step", "decode_steps", "decode_batch")
"""Keys of ``EngineTrace.steady_decode`` in the result (null when the run has too few such steps)."""

WARMUP_MAX_TOKENS = 16
"""Warm-up requests generate at most this many tokens: enough to run prefill and decode."""


@dataclass
class BenchRequest:
    """One request of the workload: its prompt token ids and how many tokens to generate."""

    prompt_token_ids: list[int]
    max_tokens: int


FILE_KEYS = ("prompt", "prompt_token_ids", "max_tokens")
"""The keys a line of ``input_file`` may hold."""


def check_bench_config(cfg: BenchAppConfig) -> list[tuple[str, dict, int]] | None:
    """Reject workload settings no run can use (ValueError naming the field), and an
    ``input_file`` whose lines are malformed, before the engine starts; returns that file's
    entries (:func:`read_workload_file`), None without one."""
    if cfg.peer not in PEERS:
        raise ValueError(f"peer={cfg.peer!r} is not allowed: choose one of {', '.join(PEERS)}")
    for name in ("num_prompts", "input_len", "output_len"):
        value = getattr(cfg, name)
        if not is_int(value) or value < 1:
            raise ValueError(f"{name}={value!r} must be an integer of at least 1")
    warmup = cfg.num_warmup_prompts
    if warmup is not None and (not is_int(warmup) or warmup < 0):
        raise ValueError(f"num_warmup_prompts={warmup!r} must be an integer of at least 0 (or null: one full batch)")
    return read_workload_file(cfg.input_file, cfg.output_len) if cfg.input_file is not None else None


def check_workload_fits(workload: list[BenchRequest], max_model_len: int) -> None:
    """Every request's prompt and output fit the engine's context: else pprun would stop it short
    while the peer generates it in full, and the two would time different work."""
    for i, r in enumerate(workload):
        if len(r.prompt_token_ids) + r.max_tokens > max_model_len:
            raise ValueError(
                f"request {i}: {len(r.prompt_token_ids)} prompt tokens + {r.max_tokens} output tokens exceed "
                f"max_model_len={max_model_len}; raise model.max_model_len or shorten input_len / output_len"
            )


def warmup_prompts(cfg: BenchAppConfig, num_requests: int) -> int:
    """How many requests warm up (``num_warmup_prompts``; None: one full batch of the workload)."""
    if cfg.num_warmup_prompts is not None:
        return cfg.num_warmup_prompts
    return min(num_requests, cfg.scheduler.max_num_seqs)


def random_workload(
    num_prompts: int, input_len: int, output_len: int, vocab_size: int, seed: int
) -> list[BenchRequest]:
    """``num_prompts`` prompts of ``input_len`` uniformly random token ids from a seeded generator."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (num_prompts, input_len), generator=generator)
    return [BenchRequest(row.tolist(), output_len) for row in ids]


def read_workload_file(path: str, output_len: int) -> list[tuple[str, dict, int]]:
    """``(where, line object, max_tokens)`` for each line of a JSONL workload, checked for what
    needs no model: only :data:`FILE_KEYS`, ``{"prompt": str}`` (non-empty) or
    ``{"prompt_token_ids": [int >= 0, ...]}`` (non-empty), ``"max_tokens"`` (else ``output_len``)
    an integer of at least 1."""
    entries = []
    for where, obj in iter_jsonl(path):
        unknown = sorted(set(obj) - set(FILE_KEYS))
        if unknown:
            raise ValueError(f"{where}: unknown keys {unknown}; a line may hold {', '.join(FILE_KEYS)}")
        if "prompt_token_ids" in obj:
            ids = obj["prompt_token_ids"]
            if not isinstance(ids, list) or not ids or not all(is_int(t) and t >= 0 for t in ids):
                raise ValueError(f"{where}: prompt_token_ids must be a non-empty list of ints >= 0")
        elif not (isinstance(obj.get("prompt"), str) and obj["prompt"]):
            raise ValueError(f"{where}: needs 'prompt' (a non-empty string) or 'prompt_token_ids'")
        max_tokens = obj.get("max_tokens", output_len)
        if not is_int(max_tokens) or max_tokens < 1:
            raise ValueError(f"{where}: max_tokens={max_tokens!r} must be an int of at least 1")
        entries.append((where, obj, max_tokens))
    if not entries:
        raise ValueError(f"input_file={path!r} holds no requests")
    return entries


def file_workload(entries: list[tuple[str, dict, int]], tokenizer: Any, vocab_size: int) -> list[BenchRequest]:
    """The requests of a JSONL file's entries (:func:`read_workload_file`), token ids checked
    against the vocabulary and text prompts tokenized."""
    requests = []
    for where, obj, max_tokens in entries:
        if "prompt_token_ids" in obj:
            ids = obj["prompt_token_ids"]
            if any(t >= vocab_size for t in ids):
                raise ValueError(
                    f"{where}: prompt_token_ids must be a non-empty list of ints in [0, {vocab_size})"
                )
        else:
            if tokenizer is None:
                raise ValueError(f"{where}: a text prompt needs a tokenizer and this model has none")
            ids = list(tokenizer.encode(obj["prompt"]))
        requests.append(BenchRequest(ids, max_tokens))
    return requests


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (linear interpolation), or None without values."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000.0, 3)


def run_pprun(
    llm: Any, workload: list[BenchRequest], num_warmup_prompts: int, ignore_eos: bool
) -> tuple[dict[str, Any], list[list[int]]]:
    """Warm up, then time ``workload`` through ``llm.generate``: throughput and latency metrics,
    and each request's output token ids."""

    def params(max_tokens: int) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos)

    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in workload]
    warmup = workload[:num_warmup_prompts]
    if warmup:
        llm.generate(prompts[: len(warmup)], [params(min(r.max_tokens, WARMUP_MAX_TOKENS)) for r in warmup])
    from pprun.utils.step_trace import EngineTrace

    # The engine's step trace over the timed run (host clock: three reads per step); the one of
    # PPRUN_STEP_TRACE when set, else one for this run only.
    engine = llm.engine
    own_trace = engine.trace is None
    trace = engine.trace = engine.trace or EngineTrace()
    first_step = len(trace.rows)
    try:
        start = time.perf_counter()
        outputs = llm.generate(prompts, [params(r.max_tokens) for r in workload])
        elapsed_s = time.perf_counter() - start
    finally:
        if own_trace:
            engine.trace = None
    num_prompt_tokens = sum(len(r.prompt_token_ids) for r in workload)
    num_output_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    ttfts = [o.metrics.time_to_first_token for o in outputs if o.metrics.time_to_first_token is not None]
    tpots = [o.metrics.time_per_output_token for o in outputs if o.metrics.time_per_output_token is not None]
    metrics = {
        "elapsed_s": round(elapsed_s, 4),
        "num_output_tokens": num_output_tokens,
        "output_tokens_per_s": round(num_output_tokens / elapsed_s, 2),
        "total_tokens_per_s": round((num_prompt_tokens + num_output_tokens) / elapsed_s, 2),
        "requests_per_s": round(len(workload) / elapsed_s, 3),
        "ttft_ms_p50": _ms(percentile(ttfts, 50)),
        "ttft_ms_p99": _ms(percentile(ttfts, 99)),
        "tpot_ms_p50": _ms(percentile(tpots, 50)),
        "tpot_ms_p99": _ms(percentile(tpots, 99)),
        # Steady decode: answered steps after the last prefill while the batch is full (None
        # when too few such steps); the whole-run rates above include prefill and the tail.
        **(trace.steady_decode(since=first_step) or dict.fromkeys(STEADY_DECODE_KEYS)),
    }
    return metrics, [list(o.outputs[0].token_ids) for o in outputs]


def peer_batches(workload: list[BenchRequest], batch_size: int) -> list[list[BenchRequest]]:
    """Requests grouped by (prompt length, max_tokens), in chunks of at most ``batch_size``, so each
    batch runs unpadded and every row generates the same number of tokens."""
    groups: dict[tuple[int, int], list[BenchRequest]] = {}
    for r in workload:
        groups.setdefault((len(r.prompt_token_ids), r.max_tokens), []).append(r)
    return [g[i : i + batch_size] for g in groups.values() for i in range(0, len(g), batch_size)]


def run_hf_peer(
    model_dir: str,
    device: str,
    dtype: str,
    workload: list[BenchRequest],
    batch_size: int,
    num_warmup_prompts: int,
) -> tuple[dict[str, Any], list[list[int]]]:
    """Time transformers' ``generate`` (greedy, exactly ``max_tokens`` new tokens) on ``workload``:
    throughput metrics, and each request's output token ids (in workload order)."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    torch_dtype = getattr(torch, dtype)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype).to(device).eval()
    eos = model.config.eos_token_id
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else eos
    if isinstance(pad, list):
        pad = pad[0]

    def generate(batch: list[BenchRequest], max_new_tokens: int) -> Any:
        ids = torch.tensor([r.prompt_token_ids for r in batch], device=device)
        # min_new_tokens == max_new_tokens suppresses EOS: every row runs the full length, as
        # pprun's ignore_eos does.
        gen_cfg = GenerationConfig(
            do_sample=False,
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            pad_token_id=pad,
            eos_token_id=eos,
        )
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=gen_cfg
            )
        return out[:, ids.shape[1] :]

    def sync() -> None:
        if str(device).startswith("cuda"):
            torch.cuda.synchronize()

    batches = peer_batches(workload, batch_size)
    if num_warmup_prompts > 0:
        first = batches[0][: max(1, min(num_warmup_prompts, batch_size))]
        generate(first, min(first[0].max_tokens, WARMUP_MAX_TOKENS))
        sync()
    start = time.perf_counter()
    batch_outputs = [generate(b, b[0].max_tokens) for b in batches]
    sync()
    elapsed_s = time.perf_counter() - start
    num_output_tokens = sum(o.numel() for o in batch_outputs)
    tokens_by_request = {id(r): row.tolist() for b, o in zip(batches, batch_outputs) for r, row in zip(b, o)}
    num_prompt_tokens = sum(len(r.prompt_token_ids) for r in workload)
    return {
        "name": "transformers.generate",
        "elapsed_s": round(elapsed_s, 4),
        "num_batches": len(batches),
        "num_output_tokens": num_output_tokens,
        "output_tokens_per_s": round(num_output_tokens / elapsed_s, 2),
        "total_tokens_per_s": round((num_prompt_tokens + num_output_tokens) / elapsed_s, 2),
        "requests_per_s": round(len(workload) / elapsed_s, 3),
    }, [tokens_by_request[id(r)] for r in workload]


def _free_device_memory(device: str) -> None:
    gc.collect()
    if str(device).startswith("cuda"):
        import torch

        torch.cuda.empty_cache()


def run(cfg: BenchAppConfig) -> dict[str, Any]:
    """Benchmark pprun (and the peer) on ``cfg``'s workload; print and return the result object."""
    from pprun.engine.llm import LLM

    entries = check_bench_config(cfg)
    llm = LLM(config=cfg.pprun_config())
    try:
        engine = llm.engine
        if cfg.input_file is not None:
            workload = file_workload(entries, engine.tokenizer, engine.vocab_size)
            source = str(cfg.input_file)
        else:
            workload = random_workload(
                cfg.num_prompts, cfg.input_len, cfg.output_len, engine.vocab_size, cfg.workload_seed
            )
            source = "random"
        check_workload_fits(workload, engine.max_model_len)
        facts = llm.describe()
        model_dir = str(engine.resolved.model_dir)
        logger.info("bench: %d requests (%s), timing pprun", len(workload), source)
        num_warmup = warmup_prompts(cfg, len(workload))
        pprun_result, pprun_tokens = run_pprun(llm, workload, num_warmup, cfg.ignore_eos)
    finally:
        # The peer loads a second copy of the weights: free pprun's stages (and KV cache) first.
        llm.shutdown()
        del llm
        _free_device_memory(str(cfg.device))
    result: dict[str, Any] = {
        "workload": {
            "source": source,
            "num_prompts": len(workload),
            "num_warmup_prompts": num_warmup,
            "input_len": cfg.input_len if source == "random" else None,
            "output_len": cfg.output_len if source == "random" else None,
            "num_prompt_tokens": sum(len(r.prompt_token_ids) for r in workload),
            "ignore_eos": cfg.ignore_eos,
            "seed": cfg.workload_seed if source == "random" else None,
        },
        "config": {
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
            "cudagraph_mode": cfg.compilation.cudagraph_mode
            if str(facts.get("device")).startswith("cuda")
            else "none",
        },
        "pprun": pprun_result,
        "peer": None,
        "ratio": None,
    }
    overrides = job_overrides()
    if overrides is not None:
        # What the user set for this run: `pprun report` tells the swept settings by them.
        result["overrides"] = overrides
    if cfg.peer == "hf":
        logger.info("bench: timing the peer (transformers generate, batch %d)", cfg.scheduler.max_num_seqs)
        peer, peer_tokens = run_hf_peer(
            model_dir,
            facts["device"],
            facts["dtype"],
            workload,
            cfg.scheduler.max_num_seqs,
            num_warmup,
        )
        _free_device_memory(facts["device"])
        # Both are greedy on the same ids: a low fraction flags a correctness problem (small
        # numeric differences can flip a near-tie, so 1.0 is not guaranteed in half precision).
        peer["greedy_match_fraction"] = round(
            sum(a == b for a, b in zip(pprun_tokens, peer_tokens)) / len(workload), 3
        )
        result["peer"] = peer
        result["ratio"] = round(pprun_result["output_tokens_per_s"] / peer["output_tokens_per_s"], 3)
    text = json.dumps(result, indent=2)
    print(text, flush=True)
    out_paths = [p for p in (job_output_path(cfg.output_json),) if p is not None]
    sweep_dir = job_output_dir()
    if sweep_dir is not None and not out_paths:
        # A sweep prints one object per job; keep each in its job folder too.
        out_paths.append(sweep_dir / "bench.json")
    for path in out_paths:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")
        logger.info("bench: wrote %s", path)
    return result


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


def main() -> None:
    """Entry point of ``pprun bench``: ``sys.argv[1:]`` are Hydra overrides."""
    from pprun.apps import run_hydra_app

    run_hydra_app("bench", run)


if __name__ == "__main__":
    main()
