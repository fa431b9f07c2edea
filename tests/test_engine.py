"""The engine end to end on one stage: parity with transformers, batching invariances, bad input."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import hf_greedy

from pprun import LLM, SamplingParams

RUNNERS = ["v1", "v2"]


def token_prompts(n: int, vocab: int = 256, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    lengths = [1, 3, 7, 12, 20, 33, 50, 64, 9, 17][:n]
    return [{"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(L)]} for L in lengths]


@pytest.fixture(scope="module")
def hf_tiny(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()


@pytest.mark.parametrize("runner", RUNNERS)
def test_tiny_greedy_matches_transformers(tiny_llama_dir, hf_tiny, runner):
    prompts = token_prompts(10)
    with LLM(str(tiny_llama_dir), runner=runner, dtype="float32", max_num_batched_tokens=64) as llm:
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16))
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(hf_tiny, p["prompt_token_ids"], 16)
        assert o.prompt_token_ids == p["prompt_token_ids"]
        assert o.outputs[0].finish_reason in ("stop", "length")


def test_cpu_runs_without_triton(tiny_llama_dir):
    """Triton is optional off CUDA (only CUDA runs import it): a CPU generate, both runners, in a
    process where ``import triton`` fails, gives the tokens the same process gives with it.
    (A check of the matmuls' ``defer_merge`` argument once imported the Triton module on every
    device.)"""
    import json
    import subprocess
    import sys

    code = f"""
import json, sys
sys.modules["triton"] = None  # any import of triton fails, as where it is not installed
from pprun import LLM, SamplingParams
got = {{}}
for runner in ("v1", "v2"):
    with LLM({str(tiny_llama_dir)!r}, runner=runner, dtype="float32") as llm:
        outs = llm.generate({token_prompts(3)!r}, SamplingParams(temperature=0, max_tokens=8))
    got[runner] = [o.outputs[0].token_ids for o in outs]
print(json.dumps(got))
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    with LLM(str(tiny_llama_dir), runner="v2", dtype="float32") as llm:
        want = [o.outputs[0].token_ids for o in llm.generate(token_prompts(3), SamplingParams(temperature=0, max_tokens=8))]
    assert got == {"v1": want, "v2": want}


DEMO_PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "1, 2, 3, 4,",
    "def fibonacci(n):",
    "Once upon a time in a small village there lived",
    "Hi",
    "The quick brown fox jumps over the lazy dog because",
    "What is machine learning? Explain briefly to a child who is five years old and loves dinosaurs.",
]


@pytest.fixture(scope="module")
def demo_llm(demo_model_dir):
    with LLM("smollm2-135m-instruct", dtype="float32", max_model_len=1024) as llm:
        yield llm


def test_demo_greedy_matches_transformers(demo_llm, hf_demo):
    """fp32 on CPU: token-identical to transformers (same converted weights)."""
    model, tok = hf_demo
    outs = demo_llm.generate(DEMO_PROMPTS, SamplingParams(temperature=0, max_tokens=24))
    for text, o in zip(DEMO_PROMPTS, outs):
        ids = tok.encode(text)
        assert o.prompt_token_ids == ids
        assert o.outputs[0].token_ids == hf_greedy(model, ids, 24), text
        assert o.outputs[0].text == tok.decode(o.outputs[0].token_ids, skip_special_tokens=True)
        m = o.metrics
        assert m.time_to_first_token is not None and m.time_to_first_token >= 0
        if len(o.outputs[0].token_ids) > 1:
            assert m.time_per_output_token is not None


def test_demo_chat_template(demo_llm, hf_demo):
    _, tok = hf_demo
    msgs = [{"role": "user", "content": "What is 2+2?"}]
    out = demo_llm.chat(msgs, SamplingParams(temperature=0, max_tokens=20))[0]
    expected = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    if hasattr(expected, "keys"):
        expected = expected["input_ids"]
    assert out.prompt_token_ids == list(expected)
    assert out.outputs[0].text.strip()


def test_stop_strings_tokens_and_logprobs(demo_llm):
    base = demo_llm.generate(["1, 2, 3, 4,"], SamplingParams(temperature=0, max_tokens=20))[0].outputs[0]
    assert " 6" in base.text
    cut = demo_llm.generate(["1, 2, 3, 4,"], SamplingParams(temperature=0, max_tokens=20, stop=[" 6"]))[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == " 6"
    assert cut.text == base.text[: base.text.index(" 6")]
    tok_stop = base.token_ids[2]
    by_tok = demo_llm.generate(
        ["1, 2, 3, 4,"], SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[tok_stop])
    )[0].outputs[0]
    assert by_tok.token_ids == base.token_ids[: base.token_ids.index(tok_stop) + 1]
    assert by_tok.finish_reason == "stop" and by_tok.stop_reason == tok_stop
    lp = demo_llm.generate(["Hi"], SamplingParams(temperature=0, max_tokens=4, logprobs=3))[0].outputs[0]
    assert len(lp.logprobs) == len(lp.token_ids)
    for tok_id, entry in zip(lp.token_ids, lp.logprobs):
        assert entry.top_token_ids[0] == tok_id  # greedy picks the top token
        assert len(entry.top_logprobs) == 3 and entry.sampled_logprob <= 0
        assert entry.top_logprobs == sorted(entry.top_logprobs, reverse=True)


def test_max_tokens_and_ignore_eos(demo_llm):
    out = demo_llm.generate(["Hi"], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 40 and out.outputs[0].finish_reason == "length"


def _run_engine(llm, prompts, params, arrivals: list[int]) -> list[list[int]]:
    """Add request i at engine step arrivals[i]; returns token ids by request."""
    eng = llm.engine
    ids: dict[int, str] = {}
    results: dict[str, list[int]] = {}
    step = 0
    while len(results) < len(prompts):
        for i, at in enumerate(arrivals):
            if at == step and i not in ids:
                ids[i] = eng.add_request(prompts[i]["prompt_token_ids"], params[i])
        for out in eng.step():
            results[out.request_id] = out.outputs[0].token_ids
        step += 1
    return [results[ids[i]] for i in range(len(prompts))]


@pytest.mark.parametrize("runner", RUNNERS)
def test_staggered_arrivals_and_preemption_give_same_tokens(tiny_llama_dir, runner):
    prompts = token_prompts(8, seed=1)
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)] * len(prompts)
    alone = []
    with LLM(str(tiny_llama_dir), runner=runner, dtype="float32") as llm:
        for p, sp in zip(prompts, params):
            alone.append(llm.generate([p], sp)[0].outputs[0].token_ids)
        staggered = _run_engine(llm, prompts, params, arrivals=[0, 0, 1, 3, 3, 5, 8, 13])
    assert staggered == alone
    # A cache of ~12 blocks of 16 tokens for 8 requests of up to 88 tokens: preemption must happen.
    per_block = 2 * 4 * 16 * 2 * 16 * 4  # K and V, 4 layers, block 16, 2 kv heads, dim 16, fp32
    with LLM(str(tiny_llama_dir), runner=runner, dtype="float32", max_model_len=96,
             kv_cache_memory_bytes=12 * per_block, max_num_batched_tokens=32) as llm:
        tight = _run_engine(llm, prompts, params, arrivals=[0] * 8)
        preemptions = llm.engine.num_preemptions
    assert tight == alone
    assert preemptions > 0


@pytest.mark.parametrize("runner", RUNNERS)
def test_seeded_request_same_alone_and_in_batch(tiny_llama_dir, runner):
    prompts = token_prompts(6, seed=2)
    seeded = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=1234, max_tokens=20, ignore_eos=True)
    others = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)
    with LLM(str(tiny_llama_dir), runner=runner, dtype="float32") as llm:
        alone = llm.generate([prompts[3]], seeded)[0].outputs[0].token_ids
        batch = llm.generate(prompts, [others, others, others, seeded, others, others])
        again = llm.generate(prompts[::-1], [others, others, seeded, others, others, others])
    assert batch[3].outputs[0].token_ids == alone
    assert again[2].outputs[0].token_ids == alone


# --- bad input -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_llm(tiny_llama_dir):
    with LLM(str(tiny_llama_dir), dtype="float32", max_model_len=128) as llm:
        yield llm


GOOD = {"prompt_token_ids": [5, 6, 7]}


@pytest.mark.parametrize(
    "prompt, params, match",
    [
        ({"prompt_token_ids": []}, SamplingParams(), r"prompts\[1\].*0 tokens"),
        ({"prompt_token_ids": [5] * 200}, SamplingParams(), r"prompts\[1\].*200 tokens.*max_model_len=128"),
        ({"prompt_token_ids": [5, 999]}, SamplingParams(), r"prompts\[1\]\.prompt_token_ids\[1\]=999.*vocabulary"),
        ({"prompt_token_ids": [5, -1]}, SamplingParams(), r"prompt_token_ids\[1\]=-1"),
        (42, SamplingParams(), r"prompts\[1\]=42 has type int"),
        ({"prompt_token_ids": "abc"}, SamplingParams(), r"prompts\[1\]\.prompt_token_ids='abc'"),
        (GOOD, SamplingParams(max_tokens=0), r"sampling_params\[1\].*max_tokens=0"),
        (GOOD, SamplingParams(temperature=-0.5), r"sampling_params\[1\].*temperature=-0.5"),
        (GOOD, SamplingParams(top_p=0.0), r"sampling_params\[1\].*top_p=0.0"),
        (GOOD, SamplingParams(top_p=1.5), r"sampling_params\[1\].*top_p=1.5"),
        (GOOD, SamplingParams(top_k=-2), r"sampling_params\[1\].*top_k=-2"),
        (GOOD, SamplingParams(temperature=float("nan")), r"sampling_params\[1\].*temperature=nan.*finite"),
        (GOOD, SamplingParams(seed=2**70), r"sampling_params\[1\].*seed=1180591620717411303424.*64 bits"),
        (GOOD, SamplingParams(max_tokens=True), r"sampling_params\[1\].*max_tokens=True"),
        (GOOD, SamplingParams(min_tokens=9, max_tokens=4), r"sampling_params\[1\].*min_tokens=9.*max_tokens=4"),
        (GOOD, SamplingParams(stop=5), r"sampling_params\[1\].*stop=5"),
        (GOOD, SamplingParams(ignore_eos="no"), r"sampling_params\[1\].*ignore_eos='no'.*True or False"),
        (GOOD, SamplingParams(logprobs=10**6), r"sampling_params\[1\].*logprobs=1000000.*vocabulary size 256"),
        (GOOD, "greedy", r"sampling_params\[1\] has type str"),
    ],
)
def test_bad_input_fails_the_call_before_any_work(tiny_llm, prompt, params, match):
    good = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    # A request accepted earlier (still unfinished) must survive the bad call.
    eng = tiny_llm.engine
    pending = eng.add_request([9, 10, 11], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    steps_before = eng.num_steps
    with pytest.raises(ValueError, match=match):
        tiny_llm.generate([GOOD, prompt, GOOD], [good, params, good])
    assert eng.num_steps == steps_before  # nothing ran
    assert eng.scheduler.get_request(pending) is not None  # the accepted request is still queued
    assert not eng.dead
    finished = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            finished[o.request_id] = o
    assert len(finished[pending].outputs[0].token_ids) == 5
    outs = tiny_llm.generate([GOOD], good)  # the engine still serves new calls
    assert len(outs[0].outputs[0].token_ids) == 5


def test_text_prompt_errors(demo_llm):
    with pytest.raises(ValueError, match=r"prompts\[0\]: prompt is empty"):
        demo_llm.generate([""])
    with pytest.raises(ValueError, match=r"messages=\[\] must be a non-empty list"):
        demo_llm.chat([])
    with pytest.raises(ValueError, match=r"messages\[1\]='oops' must be a non-empty list"):
        demo_llm.chat([[{"role": "user", "content": "hi"}], "oops"])
    with pytest.raises(ValueError, match=r"prompts\[0\].*max_model_len=1024"):
        demo_llm.generate(["word " * 3000])


STOP_MIX = [
    SamplingParams(temperature=0, max_tokens=30),  # natural EOS stops
    SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),
    SamplingParams(temperature=0, max_tokens=30, stop=["\n"]),
    SamplingParams(temperature=0.8, seed=7, max_tokens=12),
    SamplingParams(temperature=0, max_tokens=1),
    SamplingParams(temperature=0, max_tokens=30, min_tokens=5),
]
"""One demo prompt each (``DEMO_PROMPTS[:6]``): every way a request stops, and seeded sampling
(what async steps, which overshoot a stopping request by one dropped token, must keep)."""


def outcomes(outs) -> list[tuple]:
    """Token ids, text, finish and stop reason of each request: what two runs must agree on."""
    return [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason, o.outputs[0].stop_reason)
            for o in outs]


def test_async_scheduling_gives_the_same_outputs(demo_model_dir):
    """Async steps (V2, one stage) overshoot a stopping request by one dropped token: the
    outputs, stops and finish reasons are those of synchronous steps."""
    got = {}
    for async_on in (False, True):
        with LLM("smollm2-135m-instruct", dtype="float32", max_model_len=512, async_scheduling=async_on) as llm:
            assert llm.engine.async_scheduling is async_on
            got[async_on] = outcomes(llm.generate(DEMO_PROMPTS[:6], STOP_MIX))
    assert got[True] == got[False]


def test_async_logprobs_survive_row_reuse(tiny_llama_dir):
    """A request that stops while its next step is in flight frees its runner row; a request
    admitted into that row with more logprobs must not change how the old step is read."""
    p = [1, 2, 3, 4, 5]
    with LLM(str(tiny_llama_dir), dtype="float32", max_model_len=64, max_num_seqs=1) as llm:
        assert llm.engine.async_scheduling
        first = llm.generate([{"prompt_token_ids": p}], SamplingParams(temperature=0, max_tokens=3))[0]
        stop_at = first.outputs[0].token_ids[0]
        a = SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[stop_at], logprobs=1)
        b = SamplingParams(temperature=0, max_tokens=3, logprobs=5)
        outs = llm.generate([{"prompt_token_ids": p}, {"prompt_token_ids": [7, 8, 9]}], [a, b])
    assert outs[0].outputs[0].token_ids == [stop_at] and outs[0].outputs[0].finish_reason == "stop"
    assert len(outs[0].outputs[0].logprobs[0].top_token_ids) == 1
    assert all(len(lp.top_token_ids) == 5 for lp in outs[1].outputs[0].logprobs)


def test_interrupt_while_waiting_keeps_the_engine_usable(tiny_llama_dir, monkeypatch):
    import pprun.worker.v2.runner as v2

    original = v2.PendingOutput.result
    calls = {"n": 0}

    def interrupted_once(self):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt  # Ctrl-C while the host waits for the device
        return original(self)

    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with LLM(str(tiny_llama_dir), dtype="float32", max_model_len=64) as llm:
        ref = llm.generate([{"prompt_token_ids": [4, 5, 6]}], sp)[0].outputs[0].token_ids
        monkeypatch.setattr(v2.PendingOutput, "result", interrupted_once)
        with pytest.raises(KeyboardInterrupt):
            llm.generate([{"prompt_token_ids": [1, 2, 3]}], sp)
        monkeypatch.setattr(v2.PendingOutput, "result", original)
        for _ in range(2):
            assert llm.generate([{"prompt_token_ids": [4, 5, 6]}], sp)[0].outputs[0].token_ids == ref
        assert not llm.engine.dead
        assert llm.engine.scheduler.num_running == 0 and llm.engine.scheduler.num_waiting == 0


def test_stop_string_on_the_last_allowed_token_wins(demo_llm):
    base = demo_llm.generate(["1, 2, 3, 4,"], SamplingParams(temperature=0, max_tokens=20))[0].outputs[0]
    # Allow exactly the tokens up to the one completing " 6": the stop string still applies.
    n = next(i for i in range(1, 21) if " 6" in demo_llm.engine.inputs.decode(base.token_ids[:i], SamplingParams()))
    out = demo_llm.generate(["1, 2, 3, 4,"], SamplingParams(temperature=0, max_tokens=n, stop=[" 6"]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == " 6"
    assert out.text == base.text[: base.text.index(" 6")]


def test_engine_trace_steady_decode_window():
    """Steady decode: after the last prefill, while the batch is full; tokens over answer times."""
    from pprun.utils.step_trace import EngineStep, EngineTrace

    trace = EngineTrace()
    rows = [(8, 2)] * 3 + [(4, 4)] * 12 + [(3, 3)] * 4  # prefill, full decode, the tail
    for i, (tokens, reqs) in enumerate(rows):
        trace.record(EngineStep(i * 1.0, i + 0.5, i + 0.9, 1, tokens, reqs))
    got = trace.steady_decode()
    assert got == {"decode_tokens_per_s": 4.0, "decode_ms_per_step": 1000.0, "decode_steps": 12, "decode_batch": 4}
    assert trace.steady_decode(since=len(rows) - 4) is None  # the tail alone: 4 steps
    assert EngineTrace().steady_decode() is None
    short = EngineTrace()
    for i in range(5):
        short.record(EngineStep(i, i, i, 1, 2, 2))
    assert short.steady_decode() is None  # fewer than 10 qualifying steps


def test_engine_trace_prefill_phase():
    """The prefill phase: the steps that carried prompt tokens, from the run's start to the last
    of them; each one's period runs from the previous step's answer (a decode step's included)."""
    from pprun.utils.step_trace import EngineStep, EngineTrace

    trace = EngineTrace()
    # (answer time, prompt tokens): prefill, a decode step, two prefills, then decode.
    answers = [(10.5, 100), (10.75, 0), (11.0, 100), (11.75, 50), (12.0, 0), (12.25, 0)]
    for end, prompt in answers:
        trace.record(EngineStep(end - 0.1, end - 0.05, end, 1, prompt + 2, 2, prompt))
    got = trace.prefill_phase(start=10.0)
    # 250 prompt tokens over 10.0 -> 11.75; periods 0.5, 0.25 (from the decode step), 0.75.
    assert got == {"prefill_tokens_per_s": round(250 / 1.75, 1), "prefill_ms_per_step": 500.0, "prefill_steps": 3}
    # From the second prefill on (a later run's rows): its period runs from that run's start.
    assert trace.prefill_phase(start=10.9, since=2) == {
        "prefill_tokens_per_s": round(150 / 0.85, 1), "prefill_ms_per_step": 425.0, "prefill_steps": 2,
    }  # fmt: skip
    assert trace.prefill_phase(start=11.8, since=4) is None  # decode steps only
    assert EngineTrace().prefill_phase(start=0.0) is None


def test_engine_trace_counts_a_resumed_prompt_once():
    """A request back after a preemption with outputs computes its prompt again: not counted
    (vLLM's record counts a prompt once); one preempted before its first output is counted
    again from where it restarts."""
    from pprun.core.outputs import CachedRequestData, NewRequestData, SchedulerOutput
    from pprun.utils.step_trace import EngineTrace

    sp = SamplingParams(temperature=0, max_tokens=4)

    def step(step_id, reqs, counts, finished=()):
        return SchedulerOutput(step_id=step_id, scheduled_new_reqs=reqs, scheduled_cached_reqs=CachedRequestData(),
                               num_scheduled_tokens=counts, total_num_scheduled_tokens=sum(counts.values()),
                               finished_req_ids=set(finished))

    trace = EngineTrace()
    fresh = NewRequestData("a", list(range(10)), sp, [0], 0, num_prompt_tokens=10)
    assert trace.prompt_tokens(step(1, [fresh], {"a": 10})) == 10
    resumed = NewRequestData("a", list(range(12)), sp, [0], 0, num_prompt_tokens=10)  # 2 outputs
    assert trace.prompt_tokens(step(2, [resumed], {"a": 12}, finished=["a"])) == 0
    chunk = NewRequestData("b", list(range(8)), sp, [1], 0, num_prompt_tokens=8)
    assert trace.prompt_tokens(step(3, [chunk], {"b": 5})) == 5
    assert trace.prompt_tokens(step(4, [chunk], {"b": 8}, finished=["b"])) == 8  # restarted, no outputs


def test_engine_trace_counts_the_prompt_tokens_each_step_computes(tiny_llama_dir):
    """Prompts chunked over 32-token steps and a prefix-cache hit: each step records the prompt
    tokens it computed, which add up to the prompts less their cached tokens."""
    from pprun.utils.step_trace import EngineTrace

    rng = random.Random(3)
    prefix = [rng.randrange(3, 256) for _ in range(48)]  # three blocks of 16

    def ids(n: int) -> list[int]:
        return [rng.randrange(3, 256) for _ in range(n)]

    first = [{"prompt_token_ids": prefix + ids(10)}]
    second = [{"prompt_token_ids": prefix + ids(4)}, {"prompt_token_ids": ids(5)}]
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    with LLM(str(tiny_llama_dir), dtype="float32", max_num_batched_tokens=32) as llm:
        trace = llm.engine.trace = EngineTrace()
        outs = llm.generate(first, sp) + llm.generate(second, sp)
    cached = [o.num_cached_tokens for o in outs]
    assert cached == [0, 48, 0]
    prompt_tokens = [r.num_prefill_tokens for r in trace.rows]
    # The first prompt (58 tokens) in two chunks, then its decode steps; the second call's two
    # prompts (4 uncached + 5 tokens) in one step.
    assert [n for n in prompt_tokens if n] == [32, 26, 9]
    assert sum(prompt_tokens) == 58 + 52 + 5 - 48
    assert trace.rows[0].num_tokens == 32 and trace.rows[2].num_prefill_tokens == 0
