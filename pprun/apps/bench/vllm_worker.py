"""The vLLM side of ``pprun bench peer=vllm``, run as a script in its own process:
``python vllm_worker.py SPEC.json ARRAYS.npz RESULT.json``.

It imports only the standard library, NumPy, Pillow and vLLM (never pprun), so it runs in an
environment that has vLLM and nothing of pprun's.  It builds ``vllm.LLM(**engine_args)``, warms up
on the warm-up requests (one ``LLM.generate``), empties its caches, then times the requests through
``LLM.generate`` ``repeats`` times (final outputs only, as vLLM's users run it: the throughput;
``passes_s``, each pass from empty caches, timed once more when their rates spread past
``spread_limit``), then once through ``LLM.llm_engine``'s
``add_request``/``step`` loop with streamed outputs (``RequestOutputKind.DELTA``), recording each
request's token ids, when it was queued, when its first token and its last came back, and per step
(``steps``: ``[t, num_tokens, num_reqs, num_prefill_tokens, num_cached_prompt_tokens]``, ``t`` when
``step()`` returned) how many tokens came back for how many requests, the prompt tokens of the
requests whose first token came back, i.e. whose prefill ended in that step (the prompt as vLLM
processed it, images expanded), and how many of those it found in its prefix cache
(``num_cached_tokens``).  ``start`` is the pass's start (before the first request is queued), on
the steps' clock (``time.perf_counter``).  pprun computes every figure from that
(``pprun.apps.bench.peers.vllm_peer``), the same way as its own.  On any error it writes
``{"error": ..., "traceback": ...}`` and exits with status 1.

The spec (JSON): ``engine_args`` (keyword arguments of ``vllm.LLM``), ``ignore_eos``,
``stop_token_ids`` (EOS ids, used when not ``ignore_eos``), ``encoder_decoder`` (Whisper: the
audio goes to the encoder prompt, the token ids are the decoder prompt), and ``requests`` /
``warmup``: lists of ``{"prompt_token_ids": [...], "max_tokens": n, "images": [key, ...],
"audio": key}`` whose keys name arrays in the ``.npz`` file (images HxWx3 uint8, audio float32 at
``sample_rate``).  A spec with ``runs`` (a list of ``{"requests", "warmup"}``) instead runs each on
the one engine in turn and returns ``runs``, each with the ``generate`` and ``stream`` keys a
single run has at the top.
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


def _run(engine: Any, tag: str, prompts: list[dict[str, Any]], params: list[Any]) -> dict[str, Any]:
    """Queue every prompt (request ids ``tag`` + index, so no run reuses another's), step until
    all finish; what came back and when (perf_counter seconds)."""
    n = len(prompts)
    index = {f"{tag}{i}": i for i in range(n)}
    tokens: list[list[int]] = [[] for _ in range(n)]
    queued = [0.0] * n
    first: list[float | None] = [None] * n
    finished: list[float | None] = [None] * n
    prompt_lens = [len(p.get("decoder_prompt", p)["prompt_token_ids"]) for p in prompts]
    start = time.perf_counter()
    for i, (prompt, sp) in enumerate(zip(prompts, params)):
        engine.add_request(f"{tag}{i}", prompt, sp)
        # As in pprun, a request counts from its queueing, after its own prompt processing.
        queued[i] = time.perf_counter()
    steps = []
    while engine.has_unfinished_requests():
        outputs = engine.step()
        now = time.perf_counter()
        num_tokens = num_reqs = num_prefill_tokens = num_cached = 0
        for out in outputs:
            i = index[out.request_id]
            new = list(out.outputs[0].token_ids) if out.outputs else []
            if new:
                if first[i] is None:
                    first[i] = now
                    # The prompt as vLLM processed it (image placeholders expanded), where it says.
                    prompt_len = len(getattr(out, "prompt_token_ids", None) or ()) or prompt_lens[i]
                    num_prefill_tokens += prompt_len
                    num_cached += min(max(int(getattr(out, "num_cached_tokens", None) or 0), 0), prompt_len)
                tokens[i].extend(int(t) for t in new)
                num_tokens += len(new)
                num_reqs += 1
            if out.finished:
                finished[i] = now
        steps.append([now, num_tokens, num_reqs, num_prefill_tokens, num_cached])
    end = time.perf_counter()
    return {
        "elapsed_s": end - start,
        "start": start,
        "tokens": tokens,
        "queued": queued,
        "first_token": first,
        "finished": finished,
        "steps": steps,
    }


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

        def job(requests: list[dict[str, Any]], stream: bool) -> tuple[list[dict[str, Any]], list[Any]]:
            prompts = [_prompt(r, arrays, enc_dec, sample_rate) for r in requests]
            # Streamed: every step's new tokens come back (DELTA); else vLLM's own offline default.
            kind = {"output_kind": RequestOutputKind.DELTA} if stream else {}
            params = [
                SamplingParams(
                    temperature=0.0, max_tokens=int(r["max_tokens"]), ignore_eos=bool(spec["ignore_eos"]),
                    stop_token_ids=None if spec["ignore_eos"] else list(spec["stop_token_ids"]),
                    detokenize=False, **kind,
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

        def generate_passes(run: dict[str, Any]) -> tuple[list[float], list[list[int]]]:
            """``repeats`` timed ``LLM.generate`` passes, each from an empty cache: their seconds
            and the first pass's tokens."""
            seconds, generated = [], None
            for _ in range(repeats):
                prompts, params = job(run["requests"], stream=False)
                start = time.perf_counter()
                outputs = llm.generate(prompts, params, use_tqdm=False)
                seconds.append(time.perf_counter() - start)
                if generated is None:
                    generated = [[int(t) for t in o.outputs[0].token_ids] for o in outputs]
                forget_cached()
            return seconds, generated or []

        def spread(seconds: list[float]) -> float:
            rates = [1.0 / s for s in seconds]
            return (max(rates) - min(rates)) / statistics.median(rates)

        def timed(run: dict[str, Any], tag: str) -> dict[str, Any]:
            """Warm up on ``run``'s warm-up requests, empty the caches, then time its requests
            ``repeats`` times through ``LLM.generate`` (again once if their rates spread past
            ``spread_limit``), then once streamed."""
            if run["warmup"]:
                llm.generate(*job(run["warmup"], stream=False), use_tqdm=False)
            # Timed from the state pprun's timed passes start from: nothing cached.
            forget_cached()
            # Throughput as vLLM's users get it: LLM.generate, final outputs only.
            seconds, generated = generate_passes(run)
            retimed = None
            if repeats > 1 and spread(seconds) > spread_limit:
                retimed = spread(seconds)
                seconds, generated = generate_passes(run)
            # Latencies and per-step rates: the same requests again, every step's tokens streamed.
            stream = _run(llm.llm_engine, tag, *job(run["requests"], stream=True))
            forget_cached()  # the next run (batch_sizes) finds nothing cached either
            generate = {"elapsed_s": seconds[0], "passes_s": seconds, "tokens": generated}
            if retimed is not None:
                generate["retimed_after_spread"] = retimed
            return {"generate": generate, "stream": stream}

        t0 = time.perf_counter()
        llm = LLM(**spec["engine_args"])
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
