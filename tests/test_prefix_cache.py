"""Prefix caching end to end: greedy tokens with caching on equal those with it off, token for
token (fp32 on CPU), on every executor (uni, mp, ray, external_launcher under torchrun) and both
runners, pp = 1 and 2, with and without chunked prefill; requests that share none, part or all of their prompt with what is
cached; a cached block evicted and recomputed mid-run; Llava prompts whose blocks differ only in
their image; an encoder-decoder model runs without it."""

from __future__ import annotations

import logging
import random

import pytest
from conftest import fork_mp_stages
from test_llava import PROMPTS, hf_tokens, pprun_prompts
from tiny_models import make_tiny_llava
from whisper_helpers import make_audio_dependent_whisper, ours, prompts, transformers_tokens

from pprun import LLM, SamplingParams

BS = 8
MAX_TOKENS = 6
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
PER_BLOCK = 2 * 4 * BS * 2 * 16 * 4
"""KV bytes of one block of the tiny Llama: K and V, 4 layers, 2 KV heads of 16, fp32 (a stage of
two holds half the layers)."""

_rng = random.Random(41)


def _tokens(n: int) -> list[int]:
    return [_rng.randrange(3, 256) for _ in range(n)]


BASE = _tokens(40)
"""Five full blocks: cached by the first request."""
SECOND = {
    "none": _tokens(21),
    "part": BASE[:20] + _tokens(13),  # two full blocks shared
    "all": list(BASE),  # the same prompt: four blocks (its last token is computed)
    "extends": BASE + _tokens(9),  # five blocks
    "aligned": BASE[:32],  # exactly four blocks: three found
}
EXPECTED_CACHED = {"none": 0, "part": 16, "all": 32, "extends": 40, "aligned": 24}
ONE_LEFT = BASE[:32] + _tokens(1)
"""Four cached blocks and one token to compute: alone, its first step is shaped like a decode
step (one token, one request; a full CUDA graph on GPU)."""


def token_prompts(prompts: list[list[int]]) -> list[dict]:
    return [{"prompt_token_ids": p} for p in prompts]


def two_rounds(llm) -> tuple[list[list[int]], list]:
    """BASE alone (it fills the cache), then every SECOND prompt in one batch, then ONE_LEFT
    alone; returns every output's tokens and the outputs of the last two rounds."""
    first = llm.generate(token_prompts([BASE]), GREEDY)
    second = llm.generate(token_prompts(list(SECOND.values())), GREEDY)
    third = llm.generate(token_prompts([ONE_LEFT]), GREEDY)
    return [o.outputs[0].token_ids for o in first + second + third], second + third


@pytest.fixture(scope="module")
def reference(tiny_llama_dir) -> list[list[int]]:
    """The tokens with prefix caching off (one stage, V1 runner)."""
    with LLM(str(tiny_llama_dir), dtype="float32", runner="v1", executor="uni", block_size=BS,
             enable_prefix_caching=False) as llm:  # fmt: skip
        tokens, _ = two_rounds(llm)
        assert llm.cache_stats()["enabled"] is False and llm.cache_stats()["num_queries"] == 0
    return tokens


CASES = [
    (1, "uni", "v1", None), (1, "uni", "v2", None), (1, "uni", "v2", 16),
    (2, "mp", "v1", 16), (2, "mp", "v2", None), (2, "ray", "v1", None), (2, "ray", "v2", 16),
]  # fmt: skip


def _case_id(case) -> str:
    pp, executor, runner, budget = case
    return f"pp{pp}-{executor}-{runner}" + (f"-chunk{budget}" if budget else "")


FRESH_MP_CASE = (2, "mp", "v1", 16)
"""The module's one ``mp`` engine whose stages start as fresh interpreters; the others fork theirs
from the warm template (``conftest.fork_mp_stages``): what they check is what the stages cache."""


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_caching_on_gives_the_tokens_of_caching_off(tiny_llama_dir, reference, case, request):
    pp, executor, runner, budget = case
    if executor == "ray":
        request.getfixturevalue("ray_cluster")
    if executor == "mp" and case != FRESH_MP_CASE:
        fork_mp_stages(request)
    kwargs = {"max_num_batched_tokens": budget} if budget else {}
    with LLM(str(tiny_llama_dir), dtype="float32", runner=runner, executor=executor, pipeline_parallel_size=pp,
             block_size=BS, **kwargs) as llm:  # fmt: skip
        assert llm.describe()["prefix_caching"] is True
        tokens, second = two_rounds(llm)
        stats = llm.cache_stats()
        # Reset: BASE is computed again, as on a fresh engine.
        assert llm.reset_prefix_cache()
        again = llm.generate(token_prompts([BASE]), GREEDY)[0]
        assert again.num_cached_tokens == 0 and again.outputs[0].token_ids == reference[0]
        assert llm.cache_stats()["num_queries"] == 1
    assert tokens == reference
    assert {name: o.num_cached_tokens for name, o in zip(SECOND, second)} == EXPECTED_CACHED
    assert second[-1].num_cached_tokens == 32  # ONE_LEFT
    # Every request was looked up once.
    assert stats["num_queries"] == 2 + len(SECOND)
    assert stats["num_hit_tokens"] == sum(EXPECTED_CACHED.values()) + 32
    assert stats["num_hits"] == 5 and 0 < stats["hit_rate"] < 1
    assert stats["num_cached_blocks"] > 0 and stats["num_evicted_blocks"] == 0


@pytest.mark.gpu
@pytest.mark.parametrize(("pp", "executor", "mode"), [(1, "uni", "full"), (1, "uni", "piecewise"), (2, "mp", "full")])
def test_caching_on_gives_the_tokens_of_caching_off_under_cuda_graphs_gpu(tiny_llama_dir, pp, executor, mode):
    """On CUDA (V2, fp32, Triton attention, CUDA graphs): the same two rounds with caching on and
    off give the same tokens; decode steps of requests admitted at a cached prefix replay the
    graphs."""
    import torch

    if torch.cuda.device_count() < pp:
        pytest.skip(f"needs {pp} GPUs")
    got = {}
    for on in (False, True):
        with LLM(str(tiny_llama_dir), dtype="float32", device="cuda", runner="v2", executor=executor,
                 pipeline_parallel_size=pp, block_size=BS, cudagraph_mode=mode, enable_prefix_caching=on) as llm:  # fmt: skip
            got[on], second = two_rounds(llm)
    assert got[True] == got[False]
    assert {name: o.num_cached_tokens for name, o in zip(SECOND, second)} == EXPECTED_CACHED
    assert second[-1].num_cached_tokens == 32  # ONE_LEFT


SPMD_SCRIPT = r"""
import json, os, sys
from pprun import LLM, SamplingParams
model_dir, out_dir, rounds, block_size, max_tokens = json.loads(sys.argv[1])
params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
tokens, cached = [], []
with LLM(model=model_dir, dtype="float32", device="cpu", pipeline_parallel_size=2, block_size=block_size,
         cpu_kv_cache_bytes=1 << 22) as llm:
    for prompts in rounds:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        tokens += [o.outputs[0].token_ids for o in outs]
        cached += [o.num_cached_tokens for o in outs]
    stats = llm.cache_stats()
with open(os.path.join(out_dir, f"rank{os.environ['RANK']}.json"), "w") as f:
    json.dump({"tokens": tokens, "cached": cached, "stats": stats}, f)
"""


def test_spmd_ranks_agree_on_cached_blocks_under_torchrun(tiny_llama_dir, reference, tmp_path):
    """executor=external_launcher, pp=2: every rank runs its own scheduler, and both name, find
    and reuse the same blocks (SHA-256 names): each rank's tokens are caching off's."""
    import json

    from test_torchrun import _torchrun

    script = tmp_path / "spmd.py"
    script.write_text(SPMD_SCRIPT)
    rounds = [[BASE], list(SECOND.values()), [ONE_LEFT]]
    _torchrun([str(script), json.dumps([str(tiny_llama_dir), str(tmp_path), rounds, BS, MAX_TOKENS])], cwd=tmp_path)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for res in ranks:
        assert res["tokens"] == reference
        assert res["cached"] == [0, *EXPECTED_CACHED.values(), 32]
        assert res["stats"]["num_hit_tokens"] == sum(EXPECTED_CACHED.values()) + 32
    assert ranks[0]["stats"] == ranks[1]["stats"]


EVICT_PROMPTS = [BASE, _tokens(44), _tokens(44), BASE, BASE[:20] + _tokens(13)]


@pytest.fixture(scope="module")
def evict_reference(tiny_llama_dir) -> list[list[int]]:
    with LLM(str(tiny_llama_dir), dtype="float32", runner="v1", executor="uni", block_size=BS,
             enable_prefix_caching=False) as llm:  # fmt: skip
        return [o.outputs[0].token_ids for o in llm.generate(token_prompts(EVICT_PROMPTS), GREEDY)]


@pytest.mark.parametrize(
    ("pp", "executor", "runner", "max_num_seqs"),
    [(1, "uni", "v1", 1), (1, "uni", "v2", 1), (2, "mp", "v2", 1), (1, "uni", "v2", 2)],
)
def test_an_evicted_block_is_recomputed_mid_run(tiny_llama_dir, evict_reference, pp, executor, runner, max_num_seqs,
                                                request):  # fmt: skip
    """A cache of 11 usable blocks for requests of up to 7.  One request at a time: the two long
    prompts between the copies of BASE evict its blocks, so the second copy computes them
    again.  Two at a time: requests are also preempted, and evicted blocks recomputed."""
    if executor == "mp":
        fork_mp_stages(request)
    with LLM(str(tiny_llama_dir), dtype="float32", runner=runner, executor=executor, pipeline_parallel_size=pp,
             block_size=BS, max_model_len=64, max_num_seqs=max_num_seqs, kv_cache_memory_bytes=12 * PER_BLOCK // pp) as llm:  # fmt: skip
        assert llm.engine.num_blocks == 12
        outs = llm.generate(token_prompts(EVICT_PROMPTS), GREEDY)
        stats = llm.cache_stats()
        num_preemptions = llm.engine.num_preemptions
    assert [o.outputs[0].token_ids for o in outs] == evict_reference
    assert stats["num_evicted_blocks"] > 0
    if max_num_seqs == 1:
        assert outs[3].num_cached_tokens == 0  # BASE again: its blocks were all evicted
        assert outs[4].num_cached_tokens == 16  # BASE's first blocks, cached again by its copy
    else:
        assert num_preemptions > 0


# --- Llava ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory):
    return make_tiny_llava(tmp_path_factory.mktemp("llava-prefix"), "clip")


OTHER_IMAGE = [(PROMPTS[1][0], [3]), (PROMPTS[2][0], [1, 2, 3])]
"""The texts of PROMPTS 1 and 2 with other images: the same token ids up to the first image that
differs, so only the items' hashes tell their blocks apart."""


@pytest.mark.parametrize(("pp", "executor", "runner", "budget"),
                         [(1, "uni", "v1", None), (1, "uni", "v2", 16), (2, "mp", "v2", None)])  # fmt: skip
def test_llava_blocks_are_named_by_their_images(clip_dir, pp, executor, runner, budget, request):
    if executor == "mp":
        fork_mp_stages(request)
    kwargs = {"max_num_batched_tokens": budget} if budget else {}
    with LLM(str(clip_dir), dtype="float32", max_model_len=256, runner=runner, executor=executor,
             pipeline_parallel_size=pp, block_size=BS, kv_cache_memory_bytes=1 << 22, **kwargs) as llm:  # fmt: skip
        first = llm.generate(pprun_prompts(PROMPTS), SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
        again = llm.generate(pprun_prompts(PROMPTS + OTHER_IMAGE), SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
        image_token = llm.engine.resolved.arch.multimodal["image_token_index"]
    want = hf_tokens(clip_dir)
    assert [o.outputs[0].token_ids for o in first] == want
    assert [o.outputs[0].token_ids for o in again] == want + hf_tokens(clip_dir, OTHER_IMAGE)
    # The repeated prompts found every whole block but the last token's.
    assert [o.num_cached_tokens for o in again[:3]] == [(len(o.prompt_token_ids) - 1) // BS * BS for o in again[:3]]
    # Same token ids, other images: the hit ends at the block where the first other image starts.
    for other, same, first_other_item in ((again[3], again[1], 0), (again[4], again[2], 2)):
        assert other.prompt_token_ids == same.prompt_token_ids
        ids = other.prompt_token_ids
        starts = [i for i, t in enumerate(ids) if t == image_token and (i == 0 or ids[i - 1] != image_token)]
        assert other.num_cached_tokens == starts[first_other_item] // BS * BS


# --- encoder-decoder --------------------------------------------------------------------------------


def test_an_encoder_decoder_model_runs_without_it_and_says_so(tmp_path, caplog):
    whisper_dir = make_audio_dependent_whisper(tmp_path / "whisper")
    with caplog.at_level(logging.INFO, logger="pprun.engine.llm_engine"):
        with LLM(str(whisper_dir), dtype="float32", executor="uni") as llm:
            outs = llm.generate(prompts() * 2, SamplingParams(temperature=0.0, max_tokens=4))
            stats, facts = llm.cache_stats(), llm.describe()
    # Every request gets its own clip's transformers tokens, the repeated clips included (with
    # prefix caching on, a repeat would be served the first's blocks of another encoder input).
    assert [ours(o) for o in outs] == transformers_tokens(whisper_dir, max_new_tokens=4) * 2
    assert facts["prefix_caching"] is False and stats["enabled"] is False and stats["num_cached_blocks"] == 0
    said = [r for r in caplog.records if "prefix caching is off" in r.getMessage()]
    assert len(said) == 1 and "encoder-decoder" in said[0].getMessage()


# --- serving: the engine clients ------------------------------------------------------------------


@pytest.mark.parametrize("client", ["AsyncEngine", "EngineProcess"])
def test_engine_clients_report_cached_tokens_and_stats(tiny_llama_dir, reference, client):
    """Through the serving engine (on a thread or in its own process): a stream's last delta says
    how many prompt tokens were cached, and ``cache_stats()`` the hits, as offline."""
    from pprun.config.config import PprunConfig
    from pprun.engine.async_engine import AsyncEngine
    from pprun.engine.engine_process import EngineProcess

    cls = {"AsyncEngine": AsyncEngine, "EngineProcess": EngineProcess}[client]
    engine = cls(PprunConfig.from_kwargs(model=str(tiny_llama_dir), dtype="float32", block_size=BS))
    try:
        assert engine.cache_stats()["enabled"] is True
        first = list(engine.add_request({"prompt_token_ids": BASE}, GREEDY))
        again = list(engine.add_request({"prompt_token_ids": SECOND["extends"]}, GREEDY))
        stats = engine.cache_stats()
    finally:
        engine.shutdown()
    assert [t for d in first for t in d.token_ids] == reference[0]
    assert [t for d in again for t in d.token_ids] == reference[1 + list(SECOND).index("extends")]
    assert (first[-1].num_cached_tokens, again[-1].num_cached_tokens) == (0, EXPECTED_CACHED["extends"])
    assert (stats["num_queries"], stats["num_hit_tokens"]) == (2, EXPECTED_CACHED["extends"])
