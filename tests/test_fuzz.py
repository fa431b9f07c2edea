"""Fuzzed inputs (hypothesis): sampling parameters, prompts (text, token ids, dicts, chat messages,
multimodal dicts), ``LLM`` keyword arguments and Hydra overrides.  Bad input is only ever a
``ValueError`` or ``TypeError`` whose message names the field (Hydra's and OmegaConf's own
errors for overrides Hydra refuses, naming the key); never another exception, a crashed stage or
a hang; and the engine still serves the next valid request with the same tokens.

One pp=2 engine (``mp``, V2 runner, the tiny Llama with a tokenizer and a chat template from
``tests/tiny_tokenizer.py``) serves every example of the request fuzzers, so a bad value that
got past validation would fail a stage process, not only the driver; after each example it must
still give the reference tokens.  Valid fuzzed ``LLM`` keyword sets are built into real engines
(a sample).  Example counts are printed at the end of the module.
"""

from __future__ import annotations

import math
import random
import re

import pytest
from conftest import fork_mp_stages

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from pprun import LLM, SamplingParams  # noqa: E402

FUZZ_EXAMPLES = 120
"""Examples per fuzz test (5 tests: ~600 examples in all)."""
FUZZ = settings(max_examples=FUZZ_EXAMPLES, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])  # fmt: skip
CHECK = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
CHECK_PROMPT = {"prompt_token_ids": [1, 50, 34, 31]}
EXAMPLES_TRIED: dict[str, int] = {}
HYDRA_ERRORS: dict[str, int] = {}
"""Exception types the Hydra override fuzzer met, by name."""

# Values of every kind: right and wrong types, edge numbers, NaN and infinities, huge, strings.
ANY = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.integers(-3, 40),
    st.floats(allow_nan=True, allow_infinity=True), st.floats(-2, 3), st.text(max_size=6),
    st.lists(st.integers(-5, 60000), max_size=4), st.lists(st.text(max_size=3), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)  # fmt: skip


@pytest.fixture(scope="module")
def fuzz_model_dir(tmp_path_factory):
    """The 4-layer tiny Llama with the two-letter tokenizer and its chat template."""
    from tiny_models import make_tiny_llama
    from tiny_tokenizer import make_two_letter_tokenizer

    return make_two_letter_tokenizer(make_tiny_llama(tmp_path_factory.mktemp("fuzz_llama"), num_layers=4))


@pytest.fixture(scope="module")
def llm(fuzz_model_dir, request):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OMP_NUM_THREADS", "1")  # the stages' intra-op threads: one each on two cores
        engine = LLM(str(fuzz_model_dir), dtype="float32", executor="mp", pipeline_parallel_size=2, runner="v2",
                     max_model_len=256, max_num_seqs=8, stage_timeout_s=60)  # fmt: skip
    with engine:
        engine.reference = engine.generate(CHECK_PROMPT, CHECK)[0].outputs[0].token_ids
        yield engine
        still_serves(engine)
    summary = f"fuzz examples tried: {EXAMPLES_TRIED} ({sum(EXAMPLES_TRIED.values())} in all)"
    if HYDRA_ERRORS:
        summary += f"; Hydra override errors by type: {HYDRA_ERRORS}"
    say(request, summary)


def say(request, line: str) -> None:
    """Print ``line`` past pytest's output capture (CI logs show it without ``-s``)."""
    capture = request.config.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled():
        print(f"\n{line}", flush=True)


def still_serves(llm) -> None:
    """The engine gives the reference tokens (no stage crashed, nothing was left in it)."""
    assert llm.generate(CHECK_PROMPT, CHECK)[0].outputs[0].token_ids == llm.reference
    assert not llm.engine.has_unfinished_requests()


def _count(name: str) -> None:
    EXAMPLES_TRIED[name] = EXAMPLES_TRIED.get(name, 0) + 1


def _names_a_field(error: Exception, fields) -> bool:
    """The error's message names one of ``fields`` as a whole name: ``n`` is named by "n must be
    at least 1" or "sampling.n", not by any word with an n in it, nor ``stop`` by
    ``stop_token_ids``."""
    text = str(error)
    return any(re.search(rf"(?<![A-Za-z0-9_]){re.escape(str(f))}(?![A-Za-z0-9_])", text) for f in fields)


def test_a_field_is_named_by_its_whole_name():
    """The matcher the fuzz tests rely on: a field is named only by its whole name."""
    assert _names_a_field(ValueError("n must be at least 1, got 0"), ["n"])
    assert _names_a_field(ValueError("sampling.n=0: must be >= 1"), ["n"])
    assert _names_a_field(ValueError("`top_p` must be in (0, 1], got nan"), ["n", "top_p"])
    assert not _names_a_field(ValueError("temperature must be finite"), ["n"])
    assert not _names_a_field(ValueError("stop_token_ids must be a list of ints"), ["stop"])
    assert not _names_a_field(ValueError("max_num_seqs must be positive"), ["max_num_seq"])


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
    else:
        n = kwargs.get("n", 1)
        assert len(outs) == 1 and len(outs[0].outputs) == n
        assert all(len(c.token_ids) <= kwargs["max_tokens"] for c in outs[0].outputs)
    still_serves(llm)


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
    else:
        assert all(o.outputs[0].finish_reason in ("length", "stop") for o in outs)
    still_serves(llm)


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
    else:
        assert all(o.outputs[0].finish_reason in ("length", "stop") for o in outs)
    still_serves(llm)


LLM_KWARGS = ["pipeline_parallel_size", "executor", "dtype", "max_num_seqs", "max_model_len", "block_size",
              "max_num_batched_tokens", "stage_timeout_s", "runner", "seed", "kv_cache_memory_bytes",
              "enable_chunked_prefill", "layer_partition", "microbatches", "async_pipeline", "device",
              "gpu_memory_utilization", "cudagraph_mode", "nonexistent_option"]  # fmt: skip


@FUZZ
@given(kwargs=st.dictionaries(st.sampled_from(LLM_KWARGS), ANY, min_size=1, max_size=3))
def test_fuzzed_llm_keyword_arguments(tiny_llama_dir, kwargs):
    """What ``LLM(...)`` does before any process starts: the config from keyword arguments, then
    its validation (valid sets are built into engines by the next test)."""
    from pprun.config.config import PprunConfig
    from pprun.config.validate import validate_config

    _count("llm_kwargs")
    try:
        validate_config(PprunConfig.from_kwargs(model=str(tiny_llama_dir), **kwargs))
    except (ValueError, TypeError) as e:
        assert _names_a_field(e, kwargs), f"{kwargs}: {e}"


PLAUSIBLE = {
    "pipeline_parallel_size": [1, 2, 3, 0, "2", 2.0],
    "executor": ["uni", "mp", "ray", "external_launcher", "threads"],
    "dtype": ["float32", "bfloat16", "float16", "fp8"],
    "max_num_seqs": [1, 4, 64, 0, -1],
    "max_model_len": [32, 128, 4096, 0],
    "block_size": [8, 16, 32, 7, 0],
    "max_num_batched_tokens": [16, 64, 2048, 0],
    "stage_timeout_s": [5, 60.0, 0, -1, math.inf],
    "runner": ["auto", "v1", "v2", "v3"],
    "seed": [0, 7, None, -1, "x"],
    "kv_cache_memory_bytes": [None, 1 << 20, 4096, -5],
    "enable_chunked_prefill": [True, False, "yes"],
    "layer_partition": [None, [2, 2], [1, 3], [4], [3, 3], [0, 4]],
    "microbatches": [None, 1, 2, 3, 0],
    "async_pipeline": [None, True, False],
    "device": ["cpu", "auto", "cuda", "tpu"],
    "gpu_memory_utilization": [0.5, 0.9, 1.5, 0],
    "cudagraph_mode": ["none", "full", "piecewise", "bogus"],
}
"""Values an ``LLM`` keyword is likely to be given (right ones and near misses), for valid sets."""
ENGINES_BUILT = {"one stage": 3, "pipeline": 3}
"""Valid keyword sets built into real engines (each starts its stages), by pipeline size."""


def test_valid_fuzzed_llm_keyword_arguments_build_engines_that_serve(fuzz_model_dir, llm, request):
    """Random keyword sets from :data:`PLAUSIBLE` (seeded): invalid ones fail validation naming a
    field; the first valid ones (:data:`ENGINES_BUILT`, on this machine) start a real engine that
    serves the check request (the reference tokens where the arithmetic is float32), or refuse
    at start-up with a ValueError naming a field (a KV cache too small), and leave it cleanly."""
    from pprun.config.config import PprunConfig
    from pprun.config.validate import validate_config

    # Their mp stages fork from the warm template (the module's `llm` starts its stages fresh).
    fork_mp_stages(request)
    rng = random.Random(0)
    outcomes = {"invalid": 0, "served": 0, "refused at start-up": 0}
    built: list[dict] = []
    wanted = dict(ENGINES_BUILT)
    for _ in range(2000):
        if not any(wanted.values()):
            break
        names = rng.sample(sorted(PLAUSIBLE), rng.randint(1, 4))
        if "pipeline_parallel_size" not in names and rng.random() < 0.5:
            names.append("pipeline_parallel_size")  # half the sets: pipelines, not only one stage
        kwargs = {n: rng.choice(PLAUSIBLE[n]) for n in names}
        _count("llm_kwargs_built")
        try:
            validate_config(PprunConfig.from_kwargs(model=str(fuzz_model_dir), **kwargs))
        except (ValueError, TypeError) as e:
            assert _names_a_field(e, kwargs), f"{kwargs}: {e}"
            outcomes["invalid"] += 1
            continue
        size = "pipeline" if kwargs.get("pipeline_parallel_size", 1) not in (1, "1") else "one stage"
        if kwargs in built or not wanted[size]:
            continue
        wanted[size] -= 1
        built.append(kwargs)
        if kwargs.get("executor") == "ray":
            request.getfixturevalue("ray_cluster")
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("OMP_NUM_THREADS", "1")
            try:
                engine = LLM(str(fuzz_model_dir), **kwargs)
            except ValueError as e:
                assert _names_a_field(e, [*kwargs, "kv_cache_memory_bytes", "max_model_len"]), f"{kwargs}: {e}"
                outcomes["refused at start-up"] += 1
                continue
        with engine:
            tokens = engine.generate(CHECK_PROMPT, CHECK)[0].outputs[0].token_ids
        if kwargs.get("dtype", "float32") == "float32":
            assert tokens == llm.reference, kwargs
        assert len(tokens) == CHECK.max_tokens, kwargs
        outcomes["served"] += 1
    assert len(built) == sum(ENGINES_BUILT.values()) and outcomes["served"] > 0, (built, outcomes)
    say(request, f"valid LLM keyword sets built: {built} ({outcomes})")


OVERRIDE_KEYS = ["parallel.pipeline_parallel_size", "parallel.executor", "scheduler.max_num_seqs",
                 "cache.block_size", "model.dtype", "model.max_model_len", "sampling.max_tokens",
                 "sampling.temperature", "parallel.stage_timeout_s", "runner", "scheduler.max_num_seq"]  # fmt: skip
VALUES = st.one_of(st.integers(-5, 100).map(str), st.sampled_from(["two", "null", "true", "1e999", "nan", "[1,2]",
                                                                   "float32", "mp", "v3", "''"]))  # fmt: skip


@pytest.fixture
def hydra_configs():
    """pprun's schemas registered and Hydra initialised on its config directory, once for all
    the examples of a test (each example composes its own config)."""
    from hydra import initialize_config_dir

    from pprun.config.config import default_conf_dir, register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(default_conf_dir()), version_base="1.3"):
        yield


@FUZZ
@given(overrides=st.dictionaries(st.sampled_from(OVERRIDE_KEYS), VALUES, min_size=1, max_size=3))
def test_fuzzed_hydra_overrides(tiny_llama_dir, hydra_configs, overrides):
    from hydra import compose
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from pprun.config.config import PprunConfig
    from pprun.config.validate import validate_config

    _count("hydra_overrides")
    args = [f"{k}={v}" for k, v in overrides.items()] + [f"model.model={tiny_llama_dir}"]
    try:
        cfg = compose("generate", overrides=args)
        validate_config(PprunConfig.from_omegaconf(cfg))
    except (ValueError, TypeError, HydraException, OmegaConfBaseException) as e:
        HYDRA_ERRORS[type(e).__name__] = HYDRA_ERRORS.get(type(e).__name__, 0) + 1
        assert _names_a_field(e, [k.split(".")[-1] for k in overrides]), f"{args}: {e}"


def test_nan_and_infinity_never_pass_as_sampling_numbers(llm):
    """A fixed check beside the fuzz: the numbers a fuzzer finds first."""
    for field in ("temperature", "top_p", "min_p"):
        for bad in (math.nan, math.inf, -math.inf):
            with pytest.raises(ValueError, match=field):
                llm.generate(CHECK_PROMPT, SamplingParams(**{field: bad}, max_tokens=2))
