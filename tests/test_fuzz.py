"""Fuzzed inputs (hypothesis): sampling parameters, prompts (text, token ids, dicts, chat messages,
multimodal dicts), ``LLM`` keyword arguments and Hydra overrides.  Bad input is only ever a
``ValueError`` or ``TypeError`` whose message names the field; never another exception or a hang;
and the engine still serves the next valid request with the same tokens.

One engine (the demo model, ``uni``: it has a tokenizer and a chat template) serves every
example; example counts are modest to fit the CI budget (``FUZZ_EXAMPLES`` below).
"""

from __future__ import annotations

import math

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from pprun import LLM, SamplingParams  # noqa: E402

FUZZ_EXAMPLES = 120
"""Examples per fuzz test (5 tests: ~600 examples in all)."""
FUZZ = settings(max_examples=FUZZ_EXAMPLES, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])  # fmt: skip
CHECK = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
CHECK_PROMPT = {"prompt_token_ids": [1, 504, 3426, 314]}
EXAMPLES_TRIED: dict[str, int] = {}

# Values of every kind: right and wrong types, edge numbers, NaN and infinities, huge, strings.
ANY = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.integers(-3, 40),
    st.floats(allow_nan=True, allow_infinity=True), st.floats(-2, 3), st.text(max_size=6),
    st.lists(st.integers(-5, 60000), max_size=4), st.lists(st.text(max_size=3), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)  # fmt: skip


@pytest.fixture(scope="module")
def llm(demo_model_dir):
    with LLM(str(demo_model_dir), dtype="float32", executor="uni", runner="v1", max_model_len=256,
             max_num_seqs=8) as llm:  # fmt: skip
        llm.reference = llm.generate(CHECK_PROMPT, CHECK)[0].outputs[0].token_ids
        yield llm
        # The engine still serves, with the same tokens, after every fuzz example.
        assert llm.generate(CHECK_PROMPT, CHECK)[0].outputs[0].token_ids == llm.reference
    print(f"\nfuzz examples tried: {EXAMPLES_TRIED} ({sum(EXAMPLES_TRIED.values())} in all)")


def _count(name: str) -> None:
    EXAMPLES_TRIED[name] = EXAMPLES_TRIED.get(name, 0) + 1


def _names_a_field(error: Exception, fields) -> bool:
    text = str(error)
    return any(f in text for f in fields)


SAMPLING_FIELDS = ["n", "temperature", "top_p", "top_k", "min_p", "seed", "min_tokens", "stop", "stop_token_ids",
                   "ignore_eos", "logprobs", "skip_special_tokens", "suppress_token_ids"]  # fmt: skip


@FUZZ
@given(kwargs=st.dictionaries(st.sampled_from(SAMPLING_FIELDS), ANY, max_size=4),
       max_tokens=st.one_of(st.integers(-2, 3), st.sampled_from([True, 2.5, "2", None])))  # fmt: skip
def test_fuzzed_sampling_params(llm, kwargs, max_tokens):
    _count("sampling_params")
    kwargs["max_tokens"] = max_tokens if max_tokens is not None else 2
    if isinstance(kwargs.get("min_tokens"), int) and not isinstance(kwargs.get("min_tokens"), bool):
        kwargs["min_tokens"] = min(kwargs["min_tokens"], 3)  # keep a valid run short
    try:
        params = SamplingParams(**kwargs)
        outs = llm.generate(CHECK_PROMPT, params)
    except (ValueError, TypeError) as e:
        assert _names_a_field(e, kwargs), f"{kwargs}: {e}"
        return
    n = kwargs.get("n", 1)
    assert len(outs) == 1 and len(outs[0].outputs) == n
    assert all(len(c.token_ids) <= kwargs["max_tokens"] for c in outs[0].outputs)


PROMPTS = st.one_of(
    st.text(max_size=40),
    st.lists(st.integers(-3, 2**40), max_size=8).map(lambda ids: {"prompt_token_ids": ids}),
    st.lists(st.booleans(), max_size=3).map(lambda ids: {"prompt_token_ids": ids}),
    st.dictionaries(st.sampled_from(["prompt", "prompt_token_ids", "multi_modal_data", "promt", "x"]), ANY, max_size=3),
    st.builds(lambda img: {"prompt": "<image> what is this?", "multi_modal_data": {"image": img}}, ANY),
    ANY,
)  # fmt: skip


@FUZZ
@given(prompts=st.one_of(PROMPTS, st.lists(PROMPTS, max_size=3)))
def test_fuzzed_prompts(llm, prompts):
    _count("prompts")
    try:
        outs = llm.generate(prompts, CHECK)
    except (ValueError, TypeError) as e:
        assert "prompt" in str(e), f"{prompts!r}: {e}"
        return
    assert all(o.outputs[0].finish_reason in ("length", "stop") for o in outs)


MESSAGE = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system", "robot", ""]),
                           "content": st.one_of(st.text(max_size=20), ANY)}),
    st.dictionaries(st.text(max_size=6), ANY, max_size=2),
    ANY,
)  # fmt: skip


@FUZZ
@given(messages=st.one_of(st.lists(MESSAGE, max_size=3), st.lists(st.lists(MESSAGE, max_size=2), max_size=2), ANY))
def test_fuzzed_chat_messages(llm, messages):
    _count("chat")
    try:
        outs = llm.chat(messages, CHECK)
    except (ValueError, TypeError) as e:
        assert any(w in str(e) for w in ("message", "role", "content", "conversation", "chat")), f"{messages!r}: {e}"
        return
    assert all(o.outputs[0].finish_reason in ("length", "stop") for o in outs)


LLM_KWARGS = ["pipeline_parallel_size", "executor", "dtype", "max_num_seqs", "max_model_len", "block_size",
              "max_num_batched_tokens", "stage_timeout_s", "runner", "seed", "kv_cache_memory_bytes",
              "enable_chunked_prefill", "layer_partition", "microbatches", "async_pipeline", "device",
              "gpu_memory_utilization", "cudagraph_mode", "nonexistent_option"]  # fmt: skip


@FUZZ
@given(kwargs=st.dictionaries(st.sampled_from(LLM_KWARGS), ANY, min_size=1, max_size=3))
def test_fuzzed_llm_keyword_arguments(tiny_llama_dir, kwargs):
    """What ``LLM(...)`` does before any process starts: the config from keyword arguments, then
    its validation (a valid set would start an engine; that part is the other tests' business)."""
    from pprun.config.config import PprunConfig
    from pprun.config.validate import validate_config

    _count("llm_kwargs")
    try:
        validate_config(PprunConfig.from_kwargs(model=str(tiny_llama_dir), **kwargs))
    except (ValueError, TypeError) as e:
        assert _names_a_field(e, kwargs), f"{kwargs}: {e}"


OVERRIDE_KEYS = ["parallel.pipeline_parallel_size", "parallel.executor", "scheduler.max_num_seqs",
                 "cache.block_size", "model.dtype", "model.max_model_len", "sampling.max_tokens",
                 "sampling.temperature", "parallel.stage_timeout_s", "runner", "scheduler.max_num_seq"]  # fmt: skip
VALUES = st.one_of(st.integers(-5, 100).map(str), st.sampled_from(["two", "null", "true", "1e999", "nan", "[1,2]",
                                                                   "float32", "mp", "v3", "''"]))  # fmt: skip


@FUZZ
@given(overrides=st.dictionaries(st.sampled_from(OVERRIDE_KEYS), VALUES, min_size=1, max_size=3))
def test_fuzzed_hydra_overrides(tiny_llama_dir, overrides):
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from pprun.config.config import PprunConfig, default_conf_dir, register_configs
    from pprun.config.validate import validate_config

    _count("hydra_overrides")
    args = [f"{k}={v}" for k, v in overrides.items()] + [f"model.model={tiny_llama_dir}"]
    register_configs()
    try:
        with initialize_config_dir(config_dir=str(default_conf_dir()), version_base="1.3"):
            cfg = compose("generate", overrides=args)
        validate_config(PprunConfig.from_omegaconf(cfg))
    except (ValueError, TypeError, HydraException, OmegaConfBaseException) as e:
        assert _names_a_field(e, [k.split(".")[-1] for k in overrides]), f"{args}: {e}"


def test_nan_and_infinity_never_pass_as_sampling_numbers(llm):
    """A fixed check beside the fuzz: the numbers a fuzzer finds first."""
    for field in ("temperature", "top_p", "min_p"):
        for bad in (math.nan, math.inf, -math.inf):
            with pytest.raises(ValueError, match=field):
                llm.generate(CHECK_PROMPT, SamplingParams(**{field: bad}, max_tokens=2))
