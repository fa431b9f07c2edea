"""Ready means warm, counted (issue 49): after ``LLM(...)`` returns, a mixed workload meets nothing
for the first time -- no step class, sampler branch, request feature, and on a GPU no Triton
compile or CUDA-graph capture -- as the first-use records count it (``pprun.utils.first_use``);
an engine without its warm-up, on the same workload, counts first uses (the counter counts).
Counted, not timed.  On CPU the model is the tiny random Llama (the classes, sampler branches and
request features are the engine's, whatever the model; a CPU step of the demo model costs about
a tenth of a second and the two engines run a few hundred), on a GPU the demo model.  The plan's
own rules are unit tests."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

from pprun.engine.warmup import WarmupLimits, eager_decode_rows, plan_warmup, prompt_pattern
from pprun.sampling.params import SamplingParams
from pprun.utils.first_use import FirstUse, count_class, count_class_representatives

# Small limits keep the warm-up to about a hundred steps; the workload below stays within them
# (the classes it meets are the ones these limits allow).
LIMITS = {"max_num_seqs": 3, "max_num_batched_tokens": 16, "max_model_len": 128}

MODELS = [("cpu", "tiny_llama_dir"), pytest.param("cuda", "demo_model_dir", marks=pytest.mark.gpu)]
DTYPES = {"cpu": "float32", "cuda": "bfloat16"}  # the GPU's serving dtype: its kernels' variants


def mixed_workload(llm, seed: int) -> None:
    """Prompt lengths (1 token to chunked), batch sizes (1 to more than max_num_seqs), every
    sampling setting and logprobs, in a few generate calls."""
    rng = random.Random(seed)
    settings = [
        {"temperature": 0.0},
        {"temperature": 0.7},
        {"temperature": 0.7, "top_k": 7},
        {"temperature": 0.7, "top_p": 0.85},
        {"temperature": 0.9, "top_k": 3, "top_p": 0.5},
        {"temperature": 0.7, "min_p": 0.2},
        {"temperature": 0.7, "seed": 11},
        {"temperature": 0.0, "logprobs": 2},
        {"temperature": 0.7, "logprobs": 5},
        {"temperature": 0.0, "suppress_token_ids": [2, 3]},
        {"temperature": 0.0, "min_tokens": 3},
    ]
    for batch_size in (1, 3, 6):
        prompts, params = [], []
        for _ in range(batch_size):
            n = rng.choice([1, 2, 5, 17, 33, 47, 90])
            vocab = llm.engine.vocab_size
            prompts.append({"prompt_token_ids": [rng.randrange(vocab // 4, vocab) for _ in range(n)]})
            params.append(
                SamplingParams(max_tokens=rng.choice([1, 3, 6]), ignore_eos=True, **rng.choice(settings))
            )
        llm.generate(prompts, params)


def first_uses_after_ready(llm) -> list[str]:
    stats = llm.engine.first_use_stats()
    return stats["after_ready"] + [key for stage in stats["stages"] for key in stage["after_ready"]]


@pytest.mark.parametrize(("device", "model"), MODELS)
def test_after_ready_a_mixed_workload_meets_nothing_for_the_first_time(request, device, model):
    from pprun import LLM

    model_dir = request.getfixturevalue(model)
    with LLM(str(model_dir), device=device, dtype=DTYPES[device], warmup="full", **LIMITS) as llm:
        stats = llm.engine.first_use_stats()
        assert stats["ready"] and stats["num_after_ready"] == 0
        assert llm.engine.startup_s["warmup"] > 0
        if device == "cuda":  # the stage's record saw Triton compiles and graph captures
            (stage,) = stats["stages"]
            assert stage["num_keys"] > 0
        mixed_workload(llm, seed=0)
        assert first_uses_after_ready(llm) == []


@pytest.mark.parametrize(("device", "model"), MODELS)
def test_without_warm_up_the_same_workload_counts_first_uses(request, device, model):
    """The negative control: the records do count, so the test above can fail."""
    from pprun import LLM

    model_dir = request.getfixturevalue(model)
    with LLM(str(model_dir), device=device, dtype=DTYPES[device], warmup="none", **LIMITS) as llm:
        assert llm.engine.first_use_stats()["ready"]
        mixed_workload(llm, seed=0)
        after = first_uses_after_ready(llm)
    kinds = {key.split(":")[0] for key in after}
    assert {"step", "request", "sampler"} <= kinds, after
    assert any(key.startswith("step: mixed") for key in after), after


def test_count_classes_and_their_representatives():
    assert [count_class(n) for n in (1, 32, 33, 48, 63, 64, 65, 1000, 1024)] == [
        "1", "32", "<=64", "<=64/16", "<=64", "<=64/16", "<=128", "<=1024", "<=1024/16",
    ]  # fmt: skip
    reps = count_class_representatives(200)
    # Every count up to the limit has its class among the representatives' classes, once each.
    assert {count_class(n) for n in range(1, 201)} == {count_class(n) for n in reps}
    assert len(reps) == len({count_class(n) for n in reps}) and max(reps) <= 200


def test_the_plan_meets_every_class_within_the_limits():
    lim = WarmupLimits(max_num_seqs=8, max_num_batched_tokens=100, max_model_len=64, block_size=16,
                       num_blocks=1000, prefix_caching=True, chunked_prefill=True, max_logprobs=20)  # fmt: skip
    waves = plan_warmup(lim)
    parts = {w.part for w in waves}
    assert parts == {"prefill", "mixed", "sampler", "prefix cache"}  # no prompt exceeds the budget
    (chunked,) = [w for w in plan_warmup(replace(lim, max_model_len=512)) if w.part == "chunked prefill"]
    assert chunked.first[0].num_prompt_tokens > 100
    # A prefix hit needs a whole cached block: with a budget of one block, the prompt is chunked.
    hits = [w for w in plan_warmup(replace(lim, max_num_batched_tokens=16)) if w.part == "prefix cache"]
    assert len(hits) == 2 and hits[0].first == hits[1].first and hits[0].first[0].num_prompt_tokens > 16
    prefill_tokens = {sum(r.num_prompt_tokens for r in w.first) for w in waves if w.part == "prefill"}
    # Prompts fit the context (two samples each), so a 100-token step needs two requests.
    assert {count_class(t) for t in prefill_tokens} == {count_class(n) for n in range(1, 101)}
    assert all(r.num_prompt_tokens <= 62 for w in waves for r in w.requests)
    prefill_reqs = {len(w.first) for w in waves if w.part == "prefill"}
    assert prefill_reqs >= set(range(1, 9))
    # Mixed steps: the decoders of ``first`` with one group of joiners at a time.
    mixed = [(len(w.first), group) for w in waves if w.part == "mixed" for group in w.joiners]
    assert {d + len(g) for d, g in mixed} == set(range(2, 9))
    mixed_tokens = {d + sum(r.num_prompt_tokens for r in g) for d, g in mixed}
    assert max(mixed_tokens) <= 100
    assert {count_class(t) for t in mixed_tokens} == {count_class(n) for n in range(2, 101)}
    # Each sampler variant alone, then all together; the sampling parameters are valid.
    for w in waves:
        for r in w.requests:
            r.params.validate()
    # A KV cache too small for a wave drops it rather than stalling the warm-up.
    small = plan_warmup(replace(lim, num_blocks=4))
    assert small and all(len(w.first) + max(map(len, w.joiners), default=0) <= 3 for w in small)


def test_the_budgets_own_classes_are_met_with_prefix_caching_on(tiny_llama_dir):
    """The budget's classes need several prompts in one step (longer than the context allows one):
    with prefix caching on, prompts sharing a prefix would hit each other's blocks and the step
    would compute fewer tokens than its class (how the top class was missed)."""
    from pprun import LLM

    limits = {"max_num_seqs": 4, "max_num_batched_tokens": 64, "max_model_len": 24, "block_size": 8}
    with LLM(str(tiny_llama_dir), device="cpu", dtype="float32", warmup="full", enable_prefix_caching=True,
             **limits) as llm:  # fmt: skip
        seen = llm.engine.first_use.seen
    for kind in ("prefill", "mixed"):
        for cls in ("<=64", "<=64/16"):
            assert f"step: {kind} {cls} tokens" in seen, sorted(k for k in seen if k.startswith("step"))


def test_warm_up_prompts_share_no_prefix():
    """Each request its own prompt (the prefix-cache wave's pair aside), and distinct keys start
    differently even with a small vocabulary (no block of one is a cached block of another)."""
    lim = WarmupLimits(max_num_seqs=8, max_num_batched_tokens=100, max_model_len=40, block_size=16,
                       num_blocks=1000, prefix_caching=True, chunked_prefill=True, max_logprobs=20,
                       decode_rows=(1, 3, 5))  # fmt: skip
    keys = [r.prompt_key for w in plan_warmup(lim) if w.part != "prefix cache" for r in w.requests]
    assert len(keys) == len(set(keys))
    for vocab in (64, 32000):
        heads = {tuple(prompt_pattern(k, 8, vocab)[:3]) for k in keys}
        assert len(heads) == len(keys)
        assert all(vocab // 4 <= t < vocab for k in keys for t in prompt_pattern(k, 40, vocab))


def _eager_decode_launches(waves) -> tuple[set[int], set[int]]:
    """Row counts of the eager decode launches the plan's waves make: a mixed step's decode rows
    (``first`` decoding while a prompt of two or more tokens joins), a decode step's requests
    (``first`` alone, each sampling twice or more)."""
    mixed = {len(w.first) for w in waves for g in w.joiners if max(r.num_prompt_tokens for r in g) > 1}
    decode = {len(w.first) for w in waves if not w.joiners and min(r.params.max_tokens for r in w.first) > 1}
    return mixed, decode


@pytest.mark.parametrize(
    ("max_num_seqs", "kv_heads", "max_model_len", "block_size", "sms"),
    [(128, 8, 2048, 16, 132), (256, 1, 131072, 16, 132), (64, 4, 4096, 32, 78), (32, 8, 256, 16, 132)],
)
def test_the_plan_meets_every_eager_decode_variant(monkeypatch, max_num_seqs, kv_heads, max_model_len,
                                                    block_size, sms):  # fmt: skip
    """Every (NUM_SPLITS, PRELOAD_SECOND) the eager decode launch can pick -- a mixed step's decode
    rows (1 to max_num_seqs - 1) and a decode step's requests (1 to max_num_seqs) -- is met by a
    wave of the plan, with the launch's own split count (num_decode_splits, on a stand-in SM count)."""
    import pprun.attention.triton_ops as ops

    monkeypatch.setattr(ops, "num_sms", lambda device: sms)
    width = -(-max_model_len // block_size) * block_size  # the block table's, every step

    def variant(rows: int) -> tuple[int, bool]:
        splits = ops.num_decode_splits(rows, kv_heads, width, torch.device("cpu"))
        return splits, ops.preload_second(splits)

    lim = WarmupLimits(max_num_seqs=max_num_seqs, max_num_batched_tokens=8192, max_model_len=max_model_len,
                       block_size=block_size, num_blocks=10**6, prefix_caching=True, chunked_prefill=True,
                       max_logprobs=20, decode_rows=eager_decode_rows(max_num_seqs, kv_heads, width, (sms,)))  # fmt: skip
    mixed, decode = _eager_decode_launches(plan_warmup(lim))
    assert {variant(n) for n in mixed} == {variant(n) for n in range(1, max_num_seqs)}
    assert {variant(n) for n in decode} == {variant(n) for n in range(1, max_num_seqs + 1)}
    assert len(lim.decode_rows) <= 16  # a wave or two per split count: the part stays small


def test_a_key_met_after_ready_is_counted_and_logged_once(caplog):
    record = FirstUse("stage 0")
    assert record.record("triton: a") and not record.record("triton: a")
    assert record.drain() == ("triton: a",) and record.drain() == ()
    record.mark_ready()
    with caplog.at_level("WARNING", logger="pprun.utils.first_use"):
        assert record.record("cuda graph: full 8")
        assert not record.record("cuda graph: full 8")
    assert record.after_ready == ["cuda graph: full 8"]
    assert record.snapshot()["num_after_ready"] == 1
    assert [r.getMessage() for r in caplog.records] == ["stage 0: first use after ready: cuda graph: full 8"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_triton_compiles_reach_the_record():
    """Triton's JIT hook sends a new specialisation of a kernel to every watching record."""
    import triton
    import triton.language as tl

    from pprun.utils.first_use import watch_triton

    @triton.jit
    def add_one(x_ptr, n, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) + 1, mask=offs < n)

    record = FirstUse("test")
    assert watch_triton(record)
    x = torch.zeros(64, device="cuda")
    add_one[(1,)](x, 64, BLOCK=64)
    add_one[(1,)](x, 64, BLOCK=64)
    keys = [k for k in record.seen if k.startswith("triton: add_one")]
    assert len(keys) == 1
    add_one[(1,)](x, 7, BLOCK=64)  # 7 is no multiple of 16: another specialisation
    assert len([k for k in record.seen if k.startswith("triton: add_one")]) == 2
