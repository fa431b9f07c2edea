"""``peer=vllm``: vLLM's offline engine on the same workload, in its own process, after pprun's
engine is shut down and the device freed (the two never run at once).

vLLM runs at its own defaults but for what the comparison needs shared: the checkpoint, dtype
(``peer_dtype`` may set another), the token-id prompts (with the same images or audio),
``max_tokens`` with EOS ignored or not as pprun, greedy, the same ``max_num_seqs``, a
``max_model_len`` of the workload's longest request (prompt plus output, which bounds pprun's
requests too), CUDA graphs on unless pprun ran without them, the same pipeline and tensor-parallel sizes
(``distributed_executor_backend`` "mp" against pprun's ``mp``, "ray" against ``ray``), one
warm-up pass on the same warm-up requests.  Its token budget per step and prefix caching stay
vLLM's defaults; ``vllm_args`` adds or overrides any ``vllm.LLM`` argument.  The worker runs with
an explicit environment (:func:`worker_env`) on pprun's device.

The worker (``pprun/apps/bench/vllm_worker.py``, run by path with ``vllm_python``) empties vLLM's
caches after the warm-up (as pprun's timed passes start from an empty prefix cache) and times the
requests ``repeats`` times through the loop ``LLM.generate`` runs, with vLLM's request metrics on
(pprun's figures likewise come from its timed ``LLM.generate`` passes).  Every figure comes from
those timed passes, computed here by pprun's rules (:func:`pass_figures`), and is summarised over
the passes as pprun's are: throughput from the pass's time; TTFT from vLLM's
``first_token_latency`` (a request's arrival to its first token), TPOT from its first and last
token times over the tokens between; the steady decode rate and the prefill phase by
``EngineTrace.steady_decode``'s and ``EngineTrace.prefill_phase``'s rules over the pass's steps,
each step's requests and prompt tokens known from when each request's first token came and which
step returned it finished (:func:`steps_from_pass`).

vLLM is never a dependency of pprun: it pins its own torch and needs CUDA.  ``peer=vllm`` without
it fails before pprun starts, saying how to install it.
"""

from __future__ import annotations

import collections
import json
import logging
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from pprun.apps.bench.metrics import (
    PREFILL_KEYS,
    SPREAD_LIMIT,
    STEADY_DECODE_KEYS,
    latency_metrics,
    summarize_runs,
    throughput_metrics,
)
from pprun.apps.bench.peers.base import PeerFailed, PeerJob, PeerOutcome, PeerResult, PeerSkipped
from pprun.apps.bench.workloads import SAMPLE_RATE, workload_rates
from pprun.config.config import BenchAppConfig

logger = logging.getLogger(__name__)

WORKER = Path(__file__).resolve().parents[1] / "vllm_worker.py"
"""The script vLLM runs in (stdlib, NumPy, Pillow and vLLM only)."""

VLLM_VERSION = "0.26.0"
"""The vLLM release the comparison is made with (built for torch 2.11 with CUDA)."""

INSTALL_HINT = (
    "vLLM is a benchmark peer, not a pprun dependency: it pins its own torch and needs a CUDA GPU. "
    f"Install it in a separate environment (python -m venv /opt/vllm && /opt/vllm/bin/pip install "
    f"vllm=={VLLM_VERSION}) and pass vllm_python=/opt/vllm/bin/python, or run in an image that has it"
)

EXECUTOR_BACKENDS = {"mp": "mp", "ray": "ray"}
"""pprun's executor -> vLLM's ``distributed_executor_backend`` for a pipeline (pp > 1)."""

CHECK_TIMEOUT_S = 300
"""Seconds ``import vllm`` may take in the check (a cold start imports torch and CUDA libraries)."""

TAIL_LINES = 60
"""Lines of the worker's output quoted in ``peer_error`` when it fails."""


def vllm_python(cfg: BenchAppConfig) -> str:
    """The interpreter that runs vLLM (``vllm_python``, else this one)."""
    return cfg.vllm_python or sys.executable


def unsupported(job: PeerJob) -> str | None:
    """Why vLLM cannot run this job's workload or configuration (None: it can)."""
    if not str(job.device).startswith("cuda"):
        return f"vLLM runs on CUDA GPUs; pprun ran on device={job.device!r}"
    executor, pp = job.executor, job.pp_size
    if executor == "external_launcher":
        return "pprun ran under torchrun (executor=external_launcher); vLLM's peer runs as one process of its own"
    if pp > 1 and executor not in EXECUTOR_BACKENDS:
        return f"pipeline_parallel_size={pp} with executor={executor!r}: vLLM's pipeline backends are mp and ray"
    if pp * job.tp_size > 1:
        import torch

        num_gpus = torch.cuda.device_count()
        if num_gpus < pp * job.tp_size:
            return (f"vLLM puts each of its pipeline_parallel_size={pp} x tensor_parallel_size={job.tp_size} "
                    f"workers on its own GPU; {num_gpus} visible")
    return None


def workload_len(job: PeerJob) -> int:
    """The longest prompt (as the model sees it, images expanded) plus its output among the job's
    requests and warm-up: the context both engines need, and no more."""
    return max(len(r.model_token_ids) + r.max_tokens for r in [*job.requests, *job.warmup])


def worker_env(device: str, environ: dict[str, str] | None = None) -> dict[str, str]:
    """The worker's environment, explicit: what a Python process and vLLM need (paths, locale,
    ``PYTHONPATH``, CUDA/NCCL/Triton/Hugging Face/vLLM settings) and nothing else of pprun's, with
    ``CUDA_VISIBLE_DEVICES`` naming pprun's device (``cuda:N``: the N-th device pprun saw)."""
    import os

    environ = dict(os.environ if environ is None else environ)
    keep = {k: v for k, v in environ.items()
            if k in WORKER_ENV_NAMES or k.startswith(WORKER_ENV_PREFIXES)}
    index = int(device.split(":", 1)[1]) if ":" in device else 0
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible:
        ids = [d.strip() for d in visible.split(",") if d.strip()]
        keep["CUDA_VISIBLE_DEVICES"] = ids[index] if index < len(ids) else str(index)
    else:
        keep["CUDA_VISIBLE_DEVICES"] = str(index)
    return keep


WORKER_ENV_NAMES = ("PATH", "HOME", "USER", "LANG", "LC_ALL", "TMPDIR", "PYTHONPATH", "LD_LIBRARY_PATH",
                    "CUDA_HOME", "TOKENIZERS_PARALLELISM")
"""Environment variables the vLLM worker keeps as they are."""
WORKER_ENV_PREFIXES = ("VLLM_", "HF_", "TRANSFORMERS_", "NCCL_", "TRITON_", "CUDA_", "TORCH_")
"""Families of variables the worker keeps (vLLM's, Hugging Face's, the CUDA stack's)."""


def engine_args(job: PeerJob) -> dict[str, Any]:
    """The ``vllm.LLM`` keyword arguments for pprun's run: vLLM's own defaults but for what the
    comparison needs shared (``max_num_seqs``, ``max_model_len`` = the workload's longest request,
    CUDA graphs on or off as pprun, the pipeline); its token budget and prefix caching are vLLM's
    unless ``vllm_args`` sets them.  ``vllm_args`` applies over everything."""
    cfg = job.cfg
    args: dict[str, Any] = {
        "model": job.model_dir,
        "dtype": job.dtype,
        # Shared, or the comparison means nothing: the batch and the context the workload needs.
        "max_num_seqs": job.batch_size,
        "max_model_len": workload_len(job),
        "enforce_eager": cfg.compilation.cudagraph_mode == "none",
        "seed": 0,
        # Token-id prompts need no tokenizer (so vLLM's detokenizing is left out, as pprun's is); images
        # and audio go through vLLM's processors, which do.
        "skip_tokenizer_init": cfg.workload not in ("image", "audio"),
    }
    if job.pp_size > 1:
        args["pipeline_parallel_size"] = job.pp_size
        args["distributed_executor_backend"] = EXECUTOR_BACKENDS[job.executor]
    if job.tp_size > 1:  # the same layout: tp workers per stage
        args["tensor_parallel_size"] = job.tp_size
    if cfg.workload == "image":
        args["limit_mm_per_prompt"] = {"image": cfg.num_images}
    if cfg.workload == "audio":
        args["limit_mm_per_prompt"] = {"audio": 1}
    args.update(dict(cfg.vllm_args))
    return args


def build_spec(job: PeerJob, prefix: str = "") -> tuple[dict[str, Any], dict[str, Any]]:
    """The worker's spec (JSON-serialisable) and its arrays (images, audio) by key (each key
    starting with ``prefix``)."""
    arrays: dict[str, Any] = {}

    def entry(tag: str, r: Any) -> dict[str, Any]:
        out: dict[str, Any] = {"prompt_token_ids": [int(t) for t in r.prompt_token_ids], "max_tokens": r.max_tokens}
        mm = r.multi_modal_data or {}
        if "image" in mm:
            out["images"] = []
            for j, image in enumerate(mm["image"]):
                arrays[f"{tag}_image{j}"] = image
                out["images"].append(f"{tag}_image{j}")
        if "audio" in mm:
            samples, rate = mm["audio"]
            if rate != SAMPLE_RATE:
                raise ValueError(f"audio at {rate} Hz: the bench's clips are {SAMPLE_RATE} Hz")
            arrays[f"{tag}_audio"] = samples
            out["audio"] = f"{tag}_audio"
        return out

    spec = {
        "engine_args": engine_args(job),
        "repeats": job.repeats,
        "spread_limit": SPREAD_LIMIT,
        "ignore_eos": job.ignore_eos,
        "stop_token_ids": sorted(job.eos_token_ids),
        "encoder_decoder": job.cfg.workload == "audio",
        "sample_rate": SAMPLE_RATE,
        "requests": [entry(f"{prefix}r{i}", r) for i, r in enumerate(job.requests)],
        "warmup": [entry(f"{prefix}w{i}", r) for i, r in enumerate(job.warmup)],
    }
    return spec, arrays


def build_sweep_spec(jobs: list[PeerJob]) -> tuple[dict[str, Any], dict[str, Any]]:
    """One spec for several jobs run on one ``vllm.LLM`` in turn (``batch_sizes``): the first
    job's engine settings (the jobs share them) and ``runs``, each job's requests and warm-up."""
    spec: dict[str, Any] = {}
    arrays: dict[str, Any] = {}
    runs = []
    for k, job in enumerate(jobs):
        one, one_arrays = build_spec(job, prefix=f"s{k}")
        runs.append({"requests": one.pop("requests"), "warmup": one.pop("warmup")})
        spec = spec or one
        arrays.update(one_arrays)
    spec["runs"] = runs
    if "max_model_len" not in jobs[0].cfg.vllm_args:  # one engine: the longest row's context
        spec["engine_args"]["max_model_len"] = max(workload_len(job) for job in jobs)
    return spec, arrays


def _steps_as_trace(steps: list[list[float]]) -> Any:
    """vLLM's steps as an ``EngineTrace`` (answer time, tokens, requests, prompt tokens computed),
    so that its steady decode rate and prefill phase are computed by the very rules pprun's are.
    A step where a prefill ended carries those prompt tokens too, which marks it as a prefill step
    as pprun's scheduled-token count does; its ``num_prefill_tokens`` are those prompt tokens less
    the ones vLLM found in its prefix cache (the fifth column; a record without it counts none as
    cached).  A step that returned nothing is left out, so that the next step's period covers it."""
    from pprun.utils.step_trace import EngineStep, EngineTrace

    trace = EngineTrace()
    for t, num_tokens, num_reqs, num_prefill_tokens, *cached in steps:
        if not num_reqs:
            continue
        computed = int(num_prefill_tokens) - int(cached[0] if cached else 0)
        trace.record(EngineStep(t, t, t, 1, int(num_tokens + num_prefill_tokens), int(num_reqs), computed))
    return trace


def steps_from_pass(timed: dict[str, Any]) -> list[list[float]]:
    """A timed pass's steps as ``[t, num_tokens, num_reqs, num_prefill_tokens, num_cached]`` rows
    (``_steps_as_trace``'s input), from when each ``step()`` returned and each request's metrics:
    a request's first token came back from the first step that returned at or after its
    ``first_token_ts`` (vLLM's engine-core clock, shifted by ``monotonic_offset`` onto the steps'
    clock), which is where its prefill ended and where its prompt tokens count; from then until
    the step that returned it finished, each step brought one of its tokens.  Without the metrics
    (a vLLM that gives none) there is nothing to place, and no rows."""
    times = [float(t) for t in timed["steps"]]
    offset = float(timed.get("monotonic_offset") or 0.0)
    rows = [[t, 0, 0, 0, 0] for t in times]
    for r in timed["requests"]:
        first_ts, done = r.get("first_token_ts"), r.get("finished_step")
        if first_ts is None or done is None or not times:
            return []
        first = next((i for i, t in enumerate(times) if t >= first_ts + offset), done)
        first = min(first, done)
        rows[first][3] += int(r["prompt_len"])
        rows[first][4] += min(int(r["num_cached"]), int(r["prompt_len"]))
        for i in range(first, done + 1):
            rows[i][1] += 1
            rows[i][2] += 1
    return rows


def pass_figures(timed: dict[str, Any], job: PeerJob) -> dict[str, Any]:
    """pprun's figures for one of vLLM's timed passes (see the module docstring)."""
    reqs = timed["requests"]
    tokens = [r["tokens"] for r in reqs]
    ttfts = [r["first_token_latency"] for r in reqs if r.get("first_token_latency") is not None]
    tpots = [(r["last_token_ts"] - r["first_token_ts"]) / (r["num_generation_tokens"] - 1) for r in reqs
             if r.get("last_token_ts") is not None and r.get("first_token_ts") is not None
             and (r.get("num_generation_tokens") or 0) > 1]
    trace = _steps_as_trace(steps_from_pass(timed))
    elapsed = float(timed["elapsed_s"])
    return {
        **throughput_metrics(elapsed, job.requests, tokens),
        **workload_rates(job.cfg, job.requests, elapsed),
        **latency_metrics(ttfts, tpots),
        **(trace.steady_decode() or dict.fromkeys(STEADY_DECODE_KEYS)),
        **(trace.prefill_phase(float(timed["start"])) or dict.fromkeys(PREFILL_KEYS)),
    }


def metrics_from_worker(result: dict[str, Any], job: PeerJob) -> PeerResult:
    """pprun's figures for vLLM's run, from what the worker recorded: each timed pass's figures
    (:func:`pass_figures`), summarised over the passes as pprun's are; the tokens of the first."""
    passes = result["passes"]
    summary = summarize_runs([pass_figures(p, job) for p in passes])
    if "retimed_after_spread" in result:
        summary["retimed_after_spread"] = round(float(result["retimed_after_spread"]), 4)
        summary["unstable"] = summary["spread"] is not None and summary["spread"] > SPREAD_LIMIT
    metrics: dict[str, Any] = {
        "name": "vllm.LLM",
        "version": result["vllm_version"],
        "settings": result["engine_args"],
        "effective_settings": result.get("effective", {}),
        **summary,
        "load_s": round(float(result.get("load_s", 0.0)), 2),
    }
    return PeerResult(metrics, [list(r["tokens"]) for r in passes[0]["requests"]])


def run_worker(python: str, spec: dict[str, Any], arrays: dict[str, Any], timeout_s: float | None = None,
               env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run the worker on ``spec`` with ``python``; its result object.  The worker's output goes to
    this process's stderr as it comes (stdout carries only the bench JSON); a failure raises
    :class:`PeerFailed` with the worker's error, traceback and last lines of output."""
    import numpy as np

    with tempfile.TemporaryDirectory(prefix="pprun-bench-vllm-") as tmp:
        spec_path, arrays_path, out_path = Path(tmp, "spec.json"), Path(tmp, "arrays.npz"), Path(tmp, "result.json")
        spec_path.write_text(json.dumps(spec))
        np.savez(arrays_path, **arrays)
        cmd = [python, str(WORKER), str(spec_path), str(arrays_path), str(out_path)]
        logger.info("bench: running vLLM: %s", " ".join(cmd))
        tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace",
                                env=env)
        try:
            assert proc.stdout is not None  # PIPE was asked for
            for line in proc.stdout:
                sys.stderr.write(line)
                tail.append(line.rstrip("\n"))
            status = proc.wait(timeout=timeout_s)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        result = json.loads(out_path.read_text()) if out_path.is_file() else None
    if result is None or "error" in result or status != 0:
        why = (result or {}).get("error") or f"the worker exited with status {status} and wrote no result"
        raise PeerFailed(
            f"vLLM failed: {why}\n--- command: {' '.join(cmd)}\n--- last {len(tail)} lines of its output:\n"
            + "\n".join(tail)
        )
    return result


class VllmPeer:
    """``peer=vllm``: vLLM's offline ``LLM`` in its own process (see the module docstring)."""

    name = "vllm"

    def check(self, cfg: BenchAppConfig) -> None:
        """vLLM imports in ``vllm_python``; else a ValueError saying how to install it."""
        python = vllm_python(cfg)
        try:
            probe = subprocess.run(
                [python, "-c", "import vllm; print(vllm.__version__)"],
                capture_output=True, text=True, timeout=CHECK_TIMEOUT_S,
            )  # fmt: skip
        except (OSError, subprocess.TimeoutExpired) as e:
            raise ValueError(f"peer=vllm: cannot run vllm_python={python!r} ({e}). {INSTALL_HINT}") from None
        if probe.returncode != 0:
            lines = (probe.stderr or probe.stdout).strip().splitlines()
            raise ValueError(
                f"peer=vllm: vLLM does not import in {python} ({lines[-1] if lines else 'no output'}). {INSTALL_HINT}"
            )
        version = probe.stdout.strip().splitlines()[-1] if probe.stdout.strip() else "?"
        if version != VLLM_VERSION:
            logger.warning("bench: vLLM %s in %s; the published comparison uses %s", version, python, VLLM_VERSION)

    def run(self, job: PeerJob) -> PeerResult:
        """Skip what vLLM cannot run (the reason in the result), else :meth:`measure`."""
        reason = unsupported(job)
        if reason is not None:
            raise PeerSkipped(reason)
        return self.measure(job)

    def measure(self, job: PeerJob) -> PeerResult:
        """Run the job in the worker and compute its figures."""
        spec, arrays = build_spec(job)
        return metrics_from_worker(run_worker(vllm_python(job.cfg), spec, arrays, env=worker_env(job.device)), job)

    def run_all(self, jobs: list[PeerJob]) -> list[PeerOutcome]:
        """Every job on one ``vllm.LLM`` in one worker (loaded and compiled once), in turn."""
        if not jobs:
            return []
        reason = unsupported(jobs[0])
        if reason is not None:
            return [PeerSkipped(reason) for _ in jobs]
        spec, arrays = build_sweep_spec(jobs)
        try:
            result = run_worker(vllm_python(jobs[0].cfg), spec, arrays, env=worker_env(jobs[0].device))
        except PeerFailed as e:
            return [e for _ in jobs]
        common = {k: v for k, v in result.items() if k != "runs"}
        return [metrics_from_worker({**common, **one}, job) for one, job in zip(result["runs"], jobs)]
