"""Soak: thousands of requests through one pp=2 pipeline (mp, V2 runner, tiny model on CPU).

Requests arrive in random bursts with random prompt and output lengths, random stop strings,
random seeds (greedy, seeded and unseeded sampling) and random aborts (some before the request
ever runs, some mid-generation), with a KV cache small enough that requests wait for blocks.
Checked: every request ends in exactly one terminal state that matches its parameters
(``length`` with ``max_tokens`` tokens, ``stop`` on a stop string, a stop token or EOS,
``abort`` only when aborted; never ``error``); every KV block is free at the end and nothing is
tracked; the resident memory of the driver and of each stage is flat after warm-up (within
:data:`RSS_TOLERANCE_BYTES`); greedy and seeded requests give, alone, the tokens they gave in the
soak.

``PPRUN_SOAK_REQUESTS`` requests (default 5,000) from ``PPRUN_SOAK_SEED`` (default 0); a failure
names the seed and the request.  The figures (requests, outcomes, RSS, drift, time) are printed
and written to ``soak.json`` in the test's temporary directory.
"""

from __future__ import annotations

import json
import os
import random
import time
from pathlib import Path

import psutil
import pytest
from leftovers import Snapshot
from tiny_tokenizer import LETTERS

from pprun import LLM, SamplingParams
from pprun.engine.outputs import RequestOutput

NUM_REQUESTS = int(os.environ.get("PPRUN_SOAK_REQUESTS", "5000"))
SEED = int(os.environ.get("PPRUN_SOAK_SEED", "0"))
MAX_NUM_SEQS = 32
MAX_UNFINISHED = 2 * MAX_NUM_SEQS
"""Requests the driver keeps unfinished at most (the rest arrive later): half of them wait."""
KV_BYTES = 384 * 1024
"""Per stage: 47 blocks of 16 tokens for the tiny model, fewer than 32 running requests of up to
32 tokens (2 blocks each) may need, so admission waits for blocks and decode may preempt."""
WARMUP_FRACTION = 0.2
"""RSS is taken as the baseline once this share of the requests has finished."""
RSS_TOLERANCE_BYTES = 8 * 2**20
"""How much a process's resident memory may grow from warm-up to the end.  Allocator and
interpreter caches settle after warm-up (0.3-0.4 MiB of growth measured per process over 5,000
requests); 8 MiB over the 4,000 requests after warm-up is about 2 KiB per request, so a leak of
a request's prompt, outputs or logits would trip it."""
NUM_ALONE = 40
"""Greedy and seeded requests replayed alone after the soak."""


@pytest.fixture(scope="module")
def soak_model_dir(tmp_path_factory) -> Path:
    """The 4-layer tiny Llama with a tokenizer (``tests/tiny_tokenizer.py``) beside it."""
    from tiny_models import make_tiny_llama
    from tiny_tokenizer import make_two_letter_tokenizer

    return make_two_letter_tokenizer(make_tiny_llama(tmp_path_factory.mktemp("soak_llama"), num_layers=4))


def draw_request(rng: random.Random) -> dict:
    """One request of the soak: prompt, sampling parameters and when (if ever) it is aborted."""
    kind = rng.choices(["greedy", "seeded", "unseeded"], weights=[5, 4, 1])[0]
    stop = None
    if rng.random() < 0.3:
        stop = ["".join(rng.choice(LETTERS) for _ in range(rng.randint(1, 3))) for _ in range(rng.randint(1, 2))]
    params = SamplingParams(
        temperature=0.0 if kind == "greedy" else rng.choice([0.7, 1.0]),
        top_p=1.0 if kind == "greedy" else rng.choice([1.0, 0.9]),
        top_k=-1 if kind == "greedy" else rng.choice([-1, 20]),
        seed=rng.randrange(2**31) if kind == "seeded" else None,
        max_tokens=rng.randint(1, 16),
        stop=stop,
        stop_token_ids=[rng.randrange(3, 256)] if rng.random() < 0.1 else None,
        ignore_eos=rng.random() < 0.5,
    )
    return {
        "prompt_token_ids": [rng.randrange(3, 256) for _ in range(rng.randint(1, 16))],
        "params": params,
        "kind": kind,
        # Steps after its arrival at which it is aborted (0: before it is ever scheduled).
        "abort_after": rng.randint(0, 12) if rng.random() < 0.1 else None,
    }


def check_output(req: dict, out: RequestOutput, tokenizer, where: str) -> str:
    """The request's one output is terminal and agrees with its parameters; returns its reason."""
    params: SamplingParams = req["params"]
    comp = out.outputs[0]
    reason, ids = comp.finish_reason, comp.token_ids
    assert out.finished and reason in ("length", "stop", "abort"), f"{where}: {reason!r} {out.error}"
    assert len(ids) <= params.max_tokens, where
    if reason == "abort":
        assert req["abort_after"] is not None, f"{where}: aborted without an abort"
    elif reason == "length":
        assert len(ids) == params.max_tokens, where
    else:
        text = tokenizer.decode(ids, skip_special_tokens=True)
        if isinstance(comp.stop_reason, str):
            assert comp.stop_reason in params.stop and comp.stop_reason in text, where
            assert not any(s in comp.text for s in params.stop), f"{where}: {comp.text!r} holds a stop string"
        elif comp.stop_reason is not None:
            assert ids[-1] == comp.stop_reason in params.stop_token_ids, where
        else:
            assert not params.ignore_eos and ids[-1] == 2, f"{where}: stopped on {ids[-1:]} without a stop"
    if reason != "abort" and not (reason == "stop" and isinstance(comp.stop_reason, str)):
        assert comp.text == tokenizer.decode(ids, skip_special_tokens=True), where
    return reason


def rss(pids: dict[str, int]) -> dict[str, int]:
    """Resident memory of each named process, in bytes."""
    return {name: psutil.Process(pid).memory_info().rss for name, pid in pids.items()}


def cpu_seconds(pids: list[int]) -> float:
    """User and system CPU time of the given processes so far."""
    total = 0.0
    for pid in pids:
        t = psutil.Process(pid).cpu_times()
        total += t.user + t.system
    return total


def run_alone(engine, req: dict) -> list[int]:
    """The tokens of one request run with nothing else in the engine."""
    req_id = engine.add_request(list(req["prompt_token_ids"]), req["params"])
    while True:
        for out in engine.step():
            assert out.request_id == req_id
            return out.outputs[0].token_ids


@pytest.mark.slow
def test_soak_pp2_every_request_terminal_blocks_free_memory_flat(soak_model_dir, monkeypatch, tmp_path, capsys):
    # One intra-op thread per stage (what pprun picks for 2 stages on 2 cores): the tests' default
    # of 2 would put four busy threads of the stages on two cores.
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    before = Snapshot()
    rng = random.Random(SEED)
    t_start = time.monotonic()
    llm = LLM(str(soak_model_dir), dtype="float32", executor="mp", pipeline_parallel_size=2, runner="v2",
              max_num_seqs=MAX_NUM_SEQS, max_model_len=64, kv_cache_memory_bytes=KV_BYTES,
              stage_timeout_s=60)  # fmt: skip
    engine = llm.engine
    ex = engine.executor
    stage_pids, rendezvous = list(ex.stage_pids), ex.rendezvous_dir
    pids = {"driver": os.getpid(), **{f"stage{r}": pid for r, pid in enumerate(stage_pids)}}
    cpu_before = cpu_seconds(list(pids.values()))
    t_soak = time.monotonic()
    blocks = engine.scheduler.block_manager
    # Only what the checks need is kept per request (the driver's RSS is measured: a soak that
    # kept every output would measure itself).
    requests: dict[str, dict] = {}  # unfinished requests
    live: dict[str, int | None] = {}  # request id -> steps left before its abort
    done: set[str] = set()
    replay: dict[str, tuple[dict, list[int]]] = {}  # request id -> (request, its tokens in the soak)
    replay_every = max(1, NUM_REQUESTS // NUM_ALONE)
    num_added = num_aborted = 0
    reasons: dict[str, int] = {}
    rss_warm = rss_peak = None
    steps = steps_without_output = 0
    try:
        while len(done) < NUM_REQUESTS:
            for _ in range(rng.randint(0, 12)):  # a burst of arrivals
                if num_added == NUM_REQUESTS or len(live) >= MAX_UNFINISHED:
                    break
                req = draw_request(rng)
                req["index"] = num_added
                req_id = engine.add_request(list(req["prompt_token_ids"]), req["params"])
                num_added += 1
                num_aborted += req["abort_after"] is not None
                requests[req_id] = req
                live[req_id] = req["abort_after"]
            for req_id, left in list(live.items()):
                if left is not None:
                    if left == 0:
                        engine.abort_request(req_id)
                        live[req_id] = None
                    else:
                        live[req_id] = left - 1
            outs = engine.step()
            steps += 1
            steps_without_output = 0 if outs else steps_without_output + 1
            assert steps_without_output < 500, f"PPRUN_SOAK_SEED={SEED}: no request finished in 500 steps"
            for out in outs:
                assert out.request_id not in done, f"PPRUN_SOAK_SEED={SEED}: a second output for {out.request_id}"
                req = requests.pop(out.request_id)
                where = f"PPRUN_SOAK_SEED={SEED}, request {req['index']} ({req})"
                reason = check_output(req, out, engine.tokenizer, where)
                reasons[reason] = reasons.get(reason, 0) + 1
                done.add(out.request_id)
                live.pop(out.request_id, None)
                if req["index"] % replay_every == 0 and req["kind"] != "unseeded" and reason != "abort":
                    replay[out.request_id] = (req, out.outputs[0].token_ids)
            if rss_warm is None and len(done) >= WARMUP_FRACTION * NUM_REQUESTS:
                rss_warm = rss(pids)
            if rss_warm is not None and steps % 200 == 0:
                now = rss(pids)
                rss_peak = {k: max(now[k], (rss_peak or now)[k]) for k in now}
        rss_end = rss(pids)
        soak_s = time.monotonic() - t_soak
        cpu_s = cpu_seconds(list(pids.values())) - cpu_before
        assert not requests and not engine.has_unfinished_requests() and not engine.tracked
        assert blocks.num_free_blocks == blocks.num_usable_blocks, "KV blocks still owned after the soak"
        # Greedy and seeded requests, alone, give the tokens they gave among the others.
        t_alone = time.monotonic()
        for req, soak_tokens in replay.values():
            assert run_alone(engine, req) == soak_tokens, f"PPRUN_SOAK_SEED={SEED}, request {req['index']} ({req})"
        assert blocks.num_free_blocks == blocks.num_usable_blocks
        alone_s = time.monotonic() - t_alone
    finally:
        llm.shutdown()
    assert before.left_behind(stage_pids, [rendezvous]) == []
    drift = {k: rss_end[k] - rss_warm[k] for k in pids}
    figures = {
        "seed": SEED,
        "requests": NUM_REQUESTS,
        "aborted_by_the_driver": num_aborted,
        "finished_by_reason": reasons,
        "preemptions": engine.num_preemptions,
        "steps": steps,
        "replayed_alone": len(replay),
        "kv_blocks": blocks.num_usable_blocks,
        "rss_at_warmup_mib": {k: round(v / 2**20, 1) for k, v in rss_warm.items()},
        "rss_peak_after_warmup_mib": {k: round(v / 2**20, 1) for k, v in (rss_peak or rss_end).items()},
        "rss_at_end_mib": {k: round(v / 2**20, 1) for k, v in rss_end.items()},
        "rss_drift_mib": {k: round(v / 2**20, 1) for k, v in drift.items()},
        "rss_tolerance_mib": RSS_TOLERANCE_BYTES / 2**20,
        "start_s": round(t_soak - t_start, 1),
        "soak_s": round(soak_s, 1),
        "cpu_s_all_processes": round(cpu_s, 1),
        "replay_alone_s": round(alone_s, 1),
    }
    (tmp_path / "soak.json").write_text(json.dumps(figures, indent=1))
    with capsys.disabled():
        print(f"\nsoak figures ({tmp_path / 'soak.json'}): {json.dumps(figures)}")
    assert reasons.get("abort", 0) > 0 and reasons.get("stop", 0) > 0 and reasons.get("length", 0) > 0
    assert sum(reasons.values()) == NUM_REQUESTS
    for name, grew in drift.items():
        assert grew <= RSS_TOLERANCE_BYTES, f"{name}'s RSS grew {grew / 2**20:.1f} MiB after warm-up: {figures}"


@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_seeded_sampling_survives_preemption(tiny_llama_dir, runner):
    """A seeded request preempted (by recompute) and resumed continues its random stream: it
    gives the tokens it gives alone.  (Its resumed generator skips the draws its earlier tokens
    took; restarting the stream gave other tokens after the preemption, which the soak found.)"""
    from test_engine import _run_engine, token_prompts

    prompts = token_prompts(8, seed=1)
    params = [SamplingParams(temperature=1.0, top_k=40, seed=100 + i, max_tokens=24, ignore_eos=True)
              for i in range(len(prompts))]  # fmt: skip
    per_block = 2 * 4 * 16 * 2 * 16 * 4  # K and V, 4 layers, block 16, 2 kv heads, dim 16, fp32
    with LLM(str(tiny_llama_dir), dtype="float32", executor="uni", runner=runner, max_model_len=96,
             kv_cache_memory_bytes=12 * per_block, max_num_batched_tokens=32) as llm:  # fmt: skip
        alone = [llm.generate([p], sp)[0].outputs[0].token_ids for p, sp in zip(prompts, params)]
        tight = _run_engine(llm, prompts, params, arrivals=[0] * len(prompts))
        preemptions = llm.engine.num_preemptions
    assert preemptions > 0
    assert tight == alone
