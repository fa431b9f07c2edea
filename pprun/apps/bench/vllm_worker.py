"""The vLLM side of ``pprun bench peer=vllm``, run as a script in its own process:
``python vllm_worker.py SPEC.json ARRAYS.npz RESULT.json``.

It imports only the standard library, NumPy, Pillow and vLLM (never pprun), so it runs in an
environment that has vLLM and nothing of pprun's.  It builds ``vllm.LLM(**engine_args)`` (with
vLLM's request statistics on: ``disable_log_stats=False``, so each output carries its
``metrics``), warms up on the warm-up requests (one ``LLM.generate``), empties its caches, then
times the requests ``repeats`` times, each pass from empty caches, through the loop
``LLM.generate`` runs (``LLM._run_engine``: every request queued through
``llm_engine.add_request``, then ``llm_engine.step()`` until none is unfinished, final outputs
only), timed once more when their rates spread past ``spread_limit``.  Per pass it records when
each ``step()`` returned (``steps``, ``time.perf_counter``), the pass's ``start`` on that clock,
and per request (``requests``): its token ids, prompt length, the prompt tokens vLLM found cached,
the index of the step that returned it finished, and vLLM's own request metrics:
``first_token_latency`` (from its arrival to its first token, seconds), ``first_token_ts`` /
``last_token_ts`` (engine-core clock, ``time.monotonic``) and ``num_generation_tokens``;
``monotonic_offset`` is ``perf_counter() - monotonic()`` (zero on Linux, where both read
CLOCK_MONOTONIC).  pprun computes every figure from that
(``pprun.apps.bench.peers.vllm_peer``), with the rules it applies to its own timed passes.  On any
error it writes ``{"error": ..., "traceback": ...}`` and exits with status 1.

The spec (JSON): ``engine_args`` (keyword arguments of ``vllm.LLM``), ``ignore_eos``,
``stop_token_ids`` (EOS ids, used when not ``ignore_eos``), ``encoder_decoder`` (Whisper: the
audio goes to the encoder prompt, the token ids are the decoder prompt), and ``requests`` /
``warmup``: lists of ``{"prompt_token_ids": [...], "max_tokens": n, "images": [key, ...],
"audio": key}`` whose keys name arrays in the ``.npz`` file (images HxWx3 uint8, audio float32 at
``sample_rate``).  A spec with ``runs`` (a list of ``{"requests", "warmup"}``) instead runs each on
the one engine in turn and returns ``runs``, each with the ``passes`` a single run has at the top.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

if __name__ in ("__main__", "__mp_main__"):
    # Run by path, Python puts this folder first on sys.path: drop it, so that the names of
    # pprun's bench modules next to this file never shadow a module vLLM imports.
    _here = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if not p or Path(p).resolve() != _here]


def _prompt(req: dict[str, Any], arrays: Any, encoder_decoder: bool, sample_rate: int) -> dict[str, Any]:
    """The vLLM prompt of one request: token ids, with its images or audio."""
    ids = {"prompt_token_ids": list(req["prompt_token_ids"])}
    if encoder_decoder:
        audio = (arrays[req["audio"]], sample_rate)
        return {"encoder_prompt": {"prompt": "", "multi_modal_data": {"audio": audio}}, "decoder_prompt": ids}
    if req.get("images"):
        from PIL import Image

        ids["multi_modal_data"] = {"image": [Image.fromarray(arrays[k]) for k in req["images"]]}
    return ids


def _metric(metrics: Any, name: str) -> float | None:
    """One of a request's vLLM metrics (None where this release or its settings give none)."""
    value = getattr(metrics, name, None)
    return float(value) if isinstance(value, (int, float)) else None


def _timed_pass(engine: Any, tag: str, prompts: list[dict[str, Any]], params: list[Any]) -> dict[str, Any]:
    """One pass as ``LLM.generate`` runs it (request ids ``tag`` + index, so no pass reuses
    another's): what came back, when each step returned, and each request's vLLM metrics."""
    n = len(prompts)
    index = {f"{tag}{i}": i for i in range(n)}
    finals: list[Any] = [None] * n
    finished_step: list[int | None] = [None] * n
    prompt_lens = [len(p.get("decoder_prompt", p)["prompt_token_ids"]) for p in prompts]
    monotonic_offset = time.perf_counter() - time.monotonic()
    start = time.perf_counter()
    for i, (prompt, sp) in enumerate(zip(prompts, params)):
        engine.add_request(f"{tag}{i}", prompt, sp)
    steps: list[float] = []
    while engine.has_unfinished_requests():
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            if out.finished:
                i = index[out.request_id]
                finals[i], finished_step[i] = out, len(steps)
        steps.append(now)
    elapsed = time.perf_counter() - start
    requests = []
    for i, out in enumerate(finals):
        m = getattr(out, "metrics", None)
        requests.append({
            "tokens": [int(t) for t in out.outputs[0].token_ids],
            # The prompt as vLLM processed it (image placeholders expanded), where it says.
            "prompt_len": len(getattr(out, "prompt_token_ids", None) or ()) or prompt_lens[i],
            "num_cached": max(int(getattr(out, "num_cached_tokens", None) or 0), 0),
            "finished_step": finished_step[i],
            **{k: _metric(m, k) for k in ("first_token_latency", "first_token_ts", "last_token_ts",
                                          "num_generation_tokens")},
        })  # fmt: skip
    return {"elapsed_s": elapsed, "start": start, "monotonic_offset": monotonic_offset, "steps": steps,
            "requests": requests}


def _effective_settings(llm: Any) -> dict[str, Any]:
    """A few of the settings vLLM resolved (what it chose where we left its defaults), as text.
    Reporting only: a field a vLLM release lacks is left out."""
    out: dict[str, Any] = {}
    config = getattr(llm.llm_engine, "vllm_config", None)
    for section, name in (
        ("compilation_config", "cudagraph_mode"), ("compilation_config", "mode"), ("compilation_config", "level"),
        ("scheduler_config", "async_scheduling"), ("scheduler_config", "max_num_batched_tokens"),
        ("scheduler_config", "enable_chunked_prefill"), ("cache_config", "enable_prefix_caching"),
        ("cache_config", "num_gpu_blocks"), ("cache_config", "gpu_memory_utilization"),
        ("parallel_config", "pipeline_parallel_size"), ("parallel_config", "distributed_executor_backend"),
        ("model_config", "dtype"), ("model_config", "max_model_len"), ("model_config", "enforce_eager"),
    ):  # fmt: skip
        value = getattr(getattr(config, section, None), name, None)
        if value is not None:
            out[f"{section}.{name}"] = value if isinstance(value, (bool, int, float)) else str(value)
    return out


def main(argv: list[str]) -> int:
    """Run the spec in ``argv[0]`` with the arrays in ``argv[1]``; write the result to ``argv[2]``."""
    spec_path, arrays_path, out_path = argv
    try:
        import numpy as np
        import vllm
        from vllm import LLM, SamplingParams
        from vllm.sampling_params import RequestOutputKind

        spec = json.loads(Path(spec_path).read_text())
        arrays = np.load(arrays_path)
        enc_dec = bool(spec["encoder_decoder"])
        sample_rate = int(spec["sample_rate"])

        def job(requests: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[Any]]:
            prompts = [_prompt(r, arrays, enc_dec, sample_rate) for r in requests]
            params = [
                SamplingParams(
                    temperature=0.0, max_tokens=int(r["max_tokens"]), ignore_eos=bool(spec["ignore_eos"]),
                    stop_token_ids=None if spec["ignore_eos"] else list(spec["stop_token_ids"]),
                    detokenize=False,
                    # Final outputs only, as LLM.generate asks for them.
                    output_kind=RequestOutputKind.FINAL_ONLY,
                )
                for r in requests
            ]  # fmt: skip
            return prompts, params

        def forget_cached() -> None:
            """Drop what vLLM keeps of finished requests: prompts' KV blocks, processed images or
            audio (the multimodal processor cache) and the encoder cache on the GPU, which keeps
            a vision tower's outputs by image hash (the methods are looked up: releases differ)."""
            llm.reset_prefix_cache()  # on by vLLM's default; a no-op where it is off
            if hasattr(llm, "reset_mm_cache"):
                llm.reset_mm_cache()
            if hasattr(llm.llm_engine, "reset_encoder_cache"):
                llm.llm_engine.reset_encoder_cache()

        repeats = int(spec.get("repeats", 1))
        spread_limit = float(spec.get("spread_limit", 0.15))

        def timed_passes(run: dict[str, Any], tag: str) -> list[dict[str, Any]]:
            """``repeats`` timed passes, each from an empty cache."""
            passes = []
            for k in range(repeats):
                passes.append(_timed_pass(llm.llm_engine, f"{tag}pass{k}-", *job(run["requests"])))
                forget_cached()
            return passes

        def spread(passes: list[dict[str, Any]]) -> float:
            rates = [1.0 / p["elapsed_s"] for p in passes]
            return (max(rates) - min(rates)) / statistics.median(rates)

        def timed(run: dict[str, Any], tag: str) -> dict[str, Any]:
            """Warm up on ``run``'s warm-up requests, empty the caches, then time its requests
            ``repeats`` times (again once if their rates spread past ``spread_limit``)."""
            if run["warmup"]:
                llm.generate(*job(run["warmup"]), use_tqdm=False)
            # Timed from the state pprun's timed passes start from: nothing cached.
            forget_cached()
            passes = timed_passes(run, tag)
            out: dict[str, Any] = {}
            if repeats > 1 and spread(passes) > spread_limit:
                out["retimed_after_spread"] = spread(passes)
                passes = timed_passes(run, tag + "again-")
            out["passes"] = passes
            return out

        t0 = time.perf_counter()
        # Request metrics on each output (vLLM's default for LLM is off).
        llm = LLM(**{"disable_log_stats": False, **spec["engine_args"]})
        load_s = time.perf_counter() - t0
        result = {
            "vllm_version": vllm.__version__,
            "engine_args": spec["engine_args"],
            "effective": _effective_settings(llm),
            "load_s": load_s,
        }
        if "runs" in spec:
            # Several workloads on this one engine, in turn (pprun bench batch_sizes=[...]).
            result["runs"] = [timed(run, f"run{k}-request-") for k, run in enumerate(spec["runs"])]
        else:
            result.update(timed(spec, "request-"))
    except BaseException as e:  # everything goes back to pprun, which reports it
        Path(out_path).write_text(
            json.dumps({"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()})
        )
        print(traceback.format_exc(), file=sys.stderr, flush=True)
        return 1
    Path(out_path).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
