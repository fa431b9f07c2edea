"""Config dataclasses, keyword mapping, Hydra composition, validation errors and runner choice."""

from __future__ import annotations

import json
import logging
from dataclasses import fields
from pathlib import Path

import pytest
import torch
from tiny_models import make_tiny_llama, make_tiny_mistral

from pprun.config import (
    PprunConfig,
    UnknownConfigKeyError,
    choose_runner,
    even_partition,
    register_configs,
    resolve_executor,
    runner_choice,
    unsupported_v2_features,
    validate_config,
)
from pprun.config.config import _FLAT_KEY_TO_GROUP, _GROUP_CLASSES, CompilationConfig, default_conf_dir

TORCHRUN_ENV = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 4-layer tiny Llama shared by the validation tests (they never modify it)."""
    return make_tiny_llama(tmp_path_factory.mktemp("llama") / "model")


def _validate(model_dir: Path, env: dict[str, str] | None = None, cuda_available: bool = False, **kwargs):
    """validate_config on a CPU machine with no torchrun environment unless given."""
    cfg = PprunConfig.from_kwargs(model=str(model_dir), **kwargs)
    return validate_config(cfg, cuda_available=cuda_available, env={} if env is None else env)


# --- from_kwargs ------------------------------------------------------------------------------


def test_from_kwargs_maps_every_flat_name_to_its_group() -> None:
    cfg = PprunConfig.from_kwargs(
        model="/m",
        tokenizer="/t",
        dtype="bfloat16",
        max_model_len=512,
        seed=3,
        pipeline_parallel_size=2,
        executor="mp",
        layer_partition=[3, 1],
        ray_address="auto",
        stage_timeout_s=5.0,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        enable_chunked_prefill=False,
        block_size=32,
        kv_cache_memory_bytes=1 << 20,
        gpu_memory_utilization=0.3,
        cudagraph_mode="none",
        cudagraph_capture_sizes=[1, 2],
        runner="v1",
        device="cpu",
    )
    assert (
        cfg.model.model,
        cfg.model.tokenizer,
        cfg.model.dtype,
        cfg.model.max_model_len,
        cfg.model.seed,
    ) == ("/m", "/t", "bfloat16", 512, 3)
    assert (cfg.parallel.pipeline_parallel_size, cfg.parallel.executor, cfg.parallel.layer_partition) == (
        2,
        "mp",
        [3, 1],
    )
    assert (cfg.parallel.ray_address, cfg.parallel.stage_timeout_s) == ("auto", 5.0)
    assert (cfg.scheduler.max_num_seqs, cfg.scheduler.max_num_batched_tokens) == (4, 64)
    assert cfg.scheduler.enable_chunked_prefill is False
    assert (cfg.cache.block_size, cfg.cache.kv_cache_memory_bytes, cfg.cache.gpu_memory_utilization) == (
        32,
        1 << 20,
        0.3,
    )
    assert (cfg.compilation.cudagraph_mode, cfg.compilation.cudagraph_capture_sizes) == ("none", [1, 2])
    assert (cfg.runner, cfg.device) == ("v1", "cpu")


def test_flat_key_table_covers_every_field_once() -> None:
    for group, klass in _GROUP_CLASSES.items():
        for f in fields(klass):
            assert _FLAT_KEY_TO_GROUP[f.name] == group
    assert set(_GROUP_CLASSES) == {"model", "parallel", "scheduler", "cache", "compilation"}


def test_from_kwargs_alias_and_group_dicts() -> None:
    cfg = PprunConfig.from_kwargs(
        distributed_executor_backend="ray", scheduler={"max_num_seqs": 4}, max_num_batched_tokens=99
    )
    assert cfg.parallel.executor == "ray"
    assert (cfg.scheduler.max_num_seqs, cfg.scheduler.max_num_batched_tokens) == (4, 99)
    with pytest.raises(ValueError, match="executor='mp' and distributed_executor_backend='ray'"):
        PprunConfig.from_kwargs(executor="mp", distributed_executor_backend="ray")


def test_from_kwargs_unknown_key_suggests_close_names() -> None:
    with pytest.raises(UnknownConfigKeyError, match=r"'max_num_seq'.*did you mean 'max_num_seqs'"):
        PprunConfig.from_kwargs(max_num_seq=4)
    with pytest.raises(TypeError, match=r"'blok_size' in cache.*'block_size'"):
        PprunConfig.from_kwargs(cache={"blok_size": 8})


def test_capture_sizes_default_capped_at_max_num_seqs() -> None:
    assert CompilationConfig().resolved_capture_sizes(128) == [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128]
    assert CompilationConfig().resolved_capture_sizes(200)[-3:] == [128, 192, 200]
    assert CompilationConfig().resolved_capture_sizes(1024)[-1] == 512
    assert CompilationConfig().resolved_capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert CompilationConfig(cudagraph_capture_sizes=[8, 2, 64]).resolved_capture_sizes(16) == [2, 8]


# --- Hydra ------------------------------------------------------------------------------------


def _compose(config_name: str, overrides: list[str]):
    from hydra import compose, initialize_config_dir

    register_configs()
    with initialize_config_dir(config_dir=str(default_conf_dir()), version_base="1.3"):
        return compose(config_name, overrides=overrides)


def test_hydra_overrides_reach_pprun_config() -> None:
    cfg = _compose(
        "generate", ["parallel.pipeline_parallel_size=2", "scheduler.max_num_seqs=4", "sampling.max_tokens=8"]
    )
    pprun_cfg = PprunConfig.from_omegaconf(cfg)
    assert type(pprun_cfg) is PprunConfig
    assert pprun_cfg.parallel.pipeline_parallel_size == 2
    assert pprun_cfg.scheduler.max_num_seqs == 4
    assert pprun_cfg.model.model == "smollm2-135m-instruct"
    assert cfg.sampling.max_tokens == 8


def test_hydra_preset_and_bench_app() -> None:
    preset = PprunConfig.from_omegaconf(_compose("generate", ["parallel=pp2_ray"]))
    assert (preset.parallel.pipeline_parallel_size, preset.parallel.executor) == (2, "ray")
    bench = _compose("bench", ["num_prompts=3", "cache.block_size=32"])
    assert bench.num_prompts == 3
    assert PprunConfig.from_omegaconf(bench).cache.block_size == 32


@pytest.mark.parametrize("override", ["scheduler.max_num_seq=4", "parallel.pipeline_parallel_size=two"])
def test_hydra_rejects_typo_and_wrong_type(override: str) -> None:
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException, match=override.split("=")[0]):
        _compose("generate", [override])


# --- validation: happy path and resolution ----------------------------------------------------


def test_validate_resolves_defaults(llama_dir: Path) -> None:
    resolved = _validate(llama_dir, pipeline_parallel_size=2)
    assert resolved.model_dir == llama_dir
    assert resolved.tokenizer_dir == llama_dir
    assert resolved.arch.num_hidden_layers == 4
    assert (resolved.device, resolved.dtype) == ("cpu", torch.float32)
    assert resolved.max_model_len == 2048  # the model's max_position_embeddings (< the 8192 cap)
    assert resolved.layer_partition == [2, 2]
    assert [resolved.stage_layer_range(r) for r in range(2)] == [range(0, 2), range(2, 4)]
    assert (resolved.executor, resolved.runner) == ("ray", "v2")
    assert resolved.cudagraph_capture_sizes == []


def test_validate_explicit_partition_and_bf16_on_cpu(llama_dir: Path) -> None:
    resolved = _validate(
        llama_dir, pipeline_parallel_size=2, layer_partition=[3, 1], dtype="bfloat16", executor="mp"
    )
    assert resolved.layer_partition == [3, 1]
    assert resolved.dtype == torch.bfloat16


def test_dtype_auto_uses_half_checkpoint_dtype_on_gpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model_dir = make_tiny_llama(tmp_path / "llama")
    config = json.loads((model_dir / "config.json").read_text())
    config["dtype"] = "bfloat16"
    (model_dir / "config.json").write_text(json.dumps(config))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    resolved = _validate(model_dir, cuda_available=True)
    assert (resolved.device, resolved.dtype) == ("cuda", torch.bfloat16)
    assert resolved.cudagraph_capture_sizes[-1] == 128
    assert _validate(model_dir, cuda_available=False).dtype == torch.float32


def test_max_model_len_default_is_capped(tmp_path: Path) -> None:
    model_dir = make_tiny_llama(tmp_path / "llama", max_position_embeddings=32768, num_layers=1)
    assert _validate(model_dir).max_model_len == 8192


@pytest.mark.parametrize(
    ("num_layers", "pp_size", "expected"),
    [
        (4, 1, [4]),
        (4, 2, [2, 2]),
        (5, 2, [3, 2]),
        (7, 3, [2, 3, 2]),
        (10, 4, [2, 3, 3, 2]),
        (3, 3, [1, 1, 1]),
    ],
)
def test_even_partition_spares_the_last_stage(num_layers: int, pp_size: int, expected: list[int]) -> None:
    assert even_partition(num_layers, pp_size) == expected


def test_resolve_executor() -> None:
    pp1, pp2 = PprunConfig.from_kwargs(), PprunConfig.from_kwargs(pipeline_parallel_size=2)
    assert resolve_executor(pp1, env={}) == "uni"
    assert resolve_executor(pp2, env={}) == "ray"
    assert resolve_executor(pp2, env=TORCHRUN_ENV) == "external_launcher"
    assert resolve_executor(pp1, env={"TORCHELASTIC_RUN_ID": "x"}) == "external_launcher"
    assert resolve_executor(pp2, env={"RANK": "0"}) == "ray"  # a lone RANK is not torchrun
    assert (
        resolve_executor(PprunConfig.from_kwargs(pipeline_parallel_size=2, executor="mp"), env=TORCHRUN_ENV)
        == "mp"
    )


# --- validation: one test per bad value ------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"pipeline_parallel_size": 0}, r"parallel\.pipeline_parallel_size=0.*>= 1"),
        (
            {"pipeline_parallel_size": 5, "executor": "mp"},
            r"parallel\.pipeline_parallel_size=5.*4 layers.*1\.\.4",
        ),
        (
            {"pipeline_parallel_size": 2, "layer_partition": [4]},
            r"layer_partition=\[4\] has 1 entries.*pipeline_parallel_size=2",
        ),
        ({"pipeline_parallel_size": 2, "layer_partition": [4, 0]}, r"layer_partition=\[4, 0\].*>= 1"),
        ({"pipeline_parallel_size": 2, "layer_partition": [5, -1]}, r"layer_partition=\[5, -1\].*>= 1"),
        (
            {"pipeline_parallel_size": 2, "layer_partition": [2, 3]},
            r"layer_partition=\[2, 3\] sums to 5.*4 layers",
        ),
        ({"executor": "slurm"}, r"parallel\.executor='slurm'.*uni, mp, ray, external_launcher"),
        ({"runner": "v3"}, r"runner='v3'.*auto, v1, v2"),
        ({"device": "tpu"}, r"device='tpu'.*auto, cpu, cuda"),
        ({"dtype": "float8"}, r"model\.dtype='float8'.*float32, bfloat16, float16"),
        ({"cudagraph_mode": "partial"},
         r"compilation\.cudagraph_mode='partial'.*none, piecewise, full, full_and_piecewise"),
        ({"piecewise_capture_sizes": [8, 0]}, r"compilation\.piecewise_capture_sizes=\[8, 0\].*integers >= 1"),
        ({"piecewise_capture_sizes": []}, r"compilation\.piecewise_capture_sizes=\[\].*non-empty list"),
        ({"warmup": "yes"}, r"compilation\.warmup='yes'.*auto, full, none"),
        ({"device": "cuda"}, r"device='cuda'.*CUDA is not available"),
        ({"dtype": "float16"}, r"model\.dtype='float16'.*device=cpu.*float32 or bfloat16"),
        ({"max_model_len": 4096}, r"model\.max_model_len=4096.*1\.\.2048"),
        ({"max_model_len": 0}, r"model\.max_model_len=0.*1\.\.2048"),
        ({"max_num_seqs": 0}, r"scheduler\.max_num_seqs=0.*>= 1"),
        ({"max_num_seqs": 2.5}, r"scheduler\.max_num_seqs=2\.5.*integer"),
        ({"max_num_batched_tokens": 0}, r"scheduler\.max_num_batched_tokens=0.*>= 1"),
        ({"block_size": 24}, r"cache\.block_size=24.*8, 16, 32, 64, 128"),
        (
            {"executor": "uni", "pipeline_parallel_size": 2},
            r"parallel\.executor='uni'.*pipeline_parallel_size=2",
        ),
        ({"gpu_memory_utilization": 1.5}, r"cache\.gpu_memory_utilization=1\.5.*\(0, 1\]"),
        ({"kv_cache_memory_bytes": 0}, r"cache\.kv_cache_memory_bytes=0"),
        ({"stage_timeout_s": 0}, r"parallel\.stage_timeout_s=0"),
        (
            {"executor": "mp", "pipeline_parallel_size": 2, "microbatches": 1},
            r"parallel\.microbatches=1.*>= parallel\.pipeline_parallel_size \(2\)",
        ),
        ({"microbatches": 2}, r"parallel\.microbatches=2.*executor 'uni'.*mp and ray"),
        ({"async_pipeline": True}, r"parallel\.async_pipeline=True.*pipeline_parallel_size=1.*executor 'uni'"),
        (
            {"runner": "v1", "executor": "mp", "pipeline_parallel_size": 2, "async_pipeline": True},
            r"parallel\.async_pipeline=True is not allowed with the v1 runner",
        ),
        ({"async_pipeline": "yes"}, r"parallel\.async_pipeline='yes' is invalid: must be true, false or null"),
        ({"cudagraph_capture_sizes": [1, 0]}, r"compilation\.cudagraph_capture_sizes=\[1, 0\]"),
        ({"log_level": "LOUD"}, r"log_level='LOUD'"),
        ({"attention_backend": "flash"}, r"attention_backend='flash'.*auto, reference, triton"),
        ({"attention_backend": "triton"}, r"attention_backend='triton' needs a CUDA device.*device='cpu'"),
        ({"control_spin_us": -1}, r"parallel\.control_spin_us=-1.*microseconds from 0 to 100000"),
        ({"control_spin_us": 2.5}, r"parallel\.control_spin_us=2\.5.*whole number"),
        (
            {"enable_chunked_prefill": False, "max_num_batched_tokens": 512},
            r"scheduler\.max_num_batched_tokens=512.*max_model_len=2048.*enable_chunked_prefill=False",
        ),
        ({"tokenizer": "/no/such/tokenizer"}, r"model\.tokenizer='/no/such/tokenizer'"),
        ({"kv_cache_memory_bytes": 4e9}, r"cache\.kv_cache_memory_bytes=4000000000\.0.*integer number of bytes"),
        ({"stage_timeout_s": float("nan")}, r"parallel\.stage_timeout_s=nan.*seconds > 0"),
        ({"ray_num_cpus_per_stage": float("inf")}, r"parallel\.ray_num_cpus_per_stage=inf"),
        ({"block_size": 16.0}, r"cache\.block_size=16\.0.*8, 16, 32, 64, 128"),
        ({"enable_chunked_prefill": "no"}, r"scheduler\.enable_chunked_prefill='no'.*true or false"),
        ({"seed": 2**64}, r"model\.seed=18446744073709551616.*64 bits"),
        ({"cudagraph_capture_sizes": 8}, r"compilation\.cudagraph_capture_sizes=8.*list of integers"),
        (
            {"cudagraph_capture_sizes": [4, 256], "max_num_seqs": 128},
            r"cudagraph_capture_sizes=\[4, 256\].*\[256\] exceed scheduler\.max_num_seqs=128",
        ),
        ({"pipeline_parallel_size": 2, "executor": "mp", "layer_partition": 5}, r"parallel\.layer_partition=5.*a list"),
        ({"scheduler": 5}, r"scheduler=5 has type int.*dict of its fields or a SchedulerConfig"),
    ],
)
def test_bad_value_is_named(llama_dir: Path, kwargs: dict, pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        _validate(llama_dir, **kwargs)


def test_bf16_rejected_on_gpu_without_bf16(llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    with pytest.raises(ValueError, match=r"model\.dtype='bfloat16'.*not supported by this GPU"):
        _validate(llama_dir, cuda_available=True, dtype="bfloat16")


def test_torchrun_world_size_must_equal_pp(llama_dir: Path) -> None:
    with pytest.raises(ValueError, match=r"pipeline_parallel_size=1.*WORLD_SIZE=2"):
        _validate(llama_dir, env=TORCHRUN_ENV)


def test_missing_model_path(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(ValueError, match=rf"model\.model.*{missing.name}"):
        _validate(missing)


def test_empty_model_name() -> None:
    with pytest.raises(ValueError, match=r"model\.model=''"):
        validate_config(PprunConfig.from_kwargs(model=""), cuda_available=False, env={})


def test_model_dir_without_config_json(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"model\.model=.*no config\.json"):
        _validate(tmp_path)


def test_unsupported_architecture(tmp_path: Path) -> None:
    model_dir = make_tiny_llama(tmp_path / "llama", num_layers=1)
    config = json.loads((model_dir / "config.json").read_text())
    config["architectures"] = ["FalconForCausalLM"]
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        ValueError, match=r"FalconForCausalLM.*LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM"
    ):
        _validate(model_dir)


def test_sliding_window_shorter_than_max_model_len(tmp_path: Path) -> None:
    model_dir = make_tiny_mistral(tmp_path / "mistral", sliding_window=256, num_layers=1)
    with pytest.raises(ValueError, match=r"max_model_len=2048.*sliding_window=256"):
        _validate(model_dir)
    assert _validate(model_dir, max_model_len=256).max_model_len == 256


def test_checkpoint_problems_surface_in_validation(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    model_dir = make_tiny_llama(tmp_path / "llama", num_layers=1)
    tensors = load_file(str(model_dir / "model.safetensors"))
    tensors["model.norm.weight"] = torch.ones(65)
    del tensors["lm_head.weight"]
    save_file(tensors, str(model_dir / "model.safetensors"))
    with pytest.raises(
        ValueError, match=r"lm_head\.weight.*model\.norm\.weight: expected shape \(64,\), found \(65,\)"
    ):
        _validate(model_dir)


# --- runner choice ----------------------------------------------------------------------------


def test_runner_choice(caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runner_choice, "_warned", set())
    pp2 = PprunConfig.from_kwargs(pipeline_parallel_size=2)
    assert unsupported_v2_features(pp2, "ray") == []
    assert choose_runner(pp2, "ray") == ("v2", [])
    reasons = unsupported_v2_features(pp2, "external_launcher")
    assert (
        len(reasons) == 1 and "external_launcher" in reasons[0] and "pipeline_parallel_size=2" in reasons[0]
    )
    assert unsupported_v2_features(PprunConfig.from_kwargs(), "external_launcher") == []

    with caplog.at_level(logging.WARNING, logger="pprun.config.runner_choice"):
        assert choose_runner(pp2, "external_launcher") == ("v1", reasons)
        assert choose_runner(pp2, "external_launcher") == ("v1", reasons)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "external_launcher" in warnings[0].getMessage()

    assert choose_runner(PprunConfig.from_kwargs(pipeline_parallel_size=2, runner="v1"), "ray")[0] == "v1"
    with pytest.raises(ValueError, match=r"runner='v2'.*external_launcher"):
        choose_runner(PprunConfig.from_kwargs(pipeline_parallel_size=2, runner="v2"), "external_launcher")


def test_v2_with_torchrun_pp2_rejected_by_validation(llama_dir: Path) -> None:
    with pytest.raises(ValueError, match=r"runner='v2'.*external_launcher with pipeline_parallel_size=2"):
        _validate(llama_dir, env=TORCHRUN_ENV, pipeline_parallel_size=2, runner="v2")
    assert _validate(llama_dir, env=TORCHRUN_ENV, pipeline_parallel_size=2).runner == "v1"


def test_settings_from_the_environment_override_their_config_fields(llama_dir: Path, monkeypatch) -> None:
    """``PPRUN_ATTN_BACKEND`` and ``PPRUN_CONTROL_SPIN_US`` override ``attention_backend`` and
    ``parallel.control_spin_us`` when set, and are checked like them."""
    from pprun.executor.remote import control_spin_s

    cfg = PprunConfig.from_kwargs(model=str(llama_dir), attention_backend="reference")
    assert validate_config(cfg, cuda_available=False, env={}).attention_backend == "reference"
    assert validate_config(cfg, cuda_available=False, env={"PPRUN_ATTN_BACKEND": "auto"}).attention_backend == "auto"
    with pytest.raises(ValueError, match=r"PPRUN_ATTN_BACKEND='fast'.*auto, reference, triton"):
        validate_config(cfg, cuda_available=False, env={"PPRUN_ATTN_BACKEND": "fast"})
    monkeypatch.delenv("PPRUN_CONTROL_SPIN_US", raising=False)
    assert control_spin_s(3, "cuda", configured_us=300) == pytest.approx(3e-4)
    assert control_spin_s(3, "cuda", configured_us=0) == 0.0
    monkeypatch.setenv("PPRUN_CONTROL_SPIN_US", "50")
    assert control_spin_s(3, "cpu", configured_us=300) == pytest.approx(5e-5)


# --- the resolved config: the step's token budget, frozen, no side effects --------------------


def test_max_num_batched_tokens_default_by_device(llama_dir: Path) -> None:
    """Null resolves to the device's budget (2048 on CPU, 8192 on CUDA); a given value wins on both."""
    assert PprunConfig().scheduler.max_num_batched_tokens is None
    assert _validate(llama_dir).max_num_batched_tokens == 2048
    assert _validate(llama_dir, cuda_available=True).max_num_batched_tokens == 8192
    for cuda in (False, True):
        assert _validate(llama_dir, cuda_available=cuda, max_num_batched_tokens=4096).max_num_batched_tokens == 4096
        assert _validate(llama_dir, cuda_available=cuda, max_num_batched_tokens=64).max_num_batched_tokens == 64


def test_max_num_batched_tokens_default_fits_a_prompt_without_chunked_prefill(tmp_path: Path) -> None:
    """With chunked prefill off a whole prompt must fit one step: the default rises to
    max_model_len, while a given value below it stays an error naming the field."""
    model_dir = make_tiny_llama(tmp_path / "llama", max_position_embeddings=4096, num_layers=1)
    assert _validate(model_dir, enable_chunked_prefill=False).max_num_batched_tokens == 4096
    assert _validate(model_dir, enable_chunked_prefill=False, cuda_available=True).max_num_batched_tokens == 8192
    with pytest.raises(ValueError, match=r"scheduler\.max_num_batched_tokens=2048 is smaller than max_model_len=4096"):
        _validate(model_dir, enable_chunked_prefill=False, max_num_batched_tokens=2048)


def test_resolved_config_is_frozen_and_owns_its_config(llama_dir: Path) -> None:
    """The resolved config cannot be changed, and changing the given config afterwards changes
    nothing that was validated."""
    import dataclasses

    cfg = PprunConfig.from_kwargs(model=str(llama_dir), max_num_seqs=4)
    resolved = validate_config(cfg, cuda_available=False, env={})
    with pytest.raises(dataclasses.FrozenInstanceError):
        resolved.max_model_len = 1  # type: ignore[misc]
    cfg.scheduler.max_num_seqs = 0
    assert resolved.cfg.scheduler.max_num_seqs == 4


def _forbid_conversion(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every converter entry point raises: a test that calls this fails if anything converts."""
    from pprun.models import demo, whisper_ct2

    def converted(*args: object, **kwargs: object) -> None:
        raise AssertionError("validation converted a model")

    for module, name in [(demo, "convert_gguf_to_hf"), (demo, "load_gguf"), (demo, "resolve_model"),
                         (whisper_ct2, "convert_whisper_alias"), (whisper_ct2, "write_hf_whisper_dir")]:
        monkeypatch.setattr(module, name, converted)


@pytest.mark.parametrize("alias", ["smollm2-135m-instruct", "whisper-tiny.en"])
def test_validate_does_not_convert_an_alias(alias: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A known alias not converted yet: validation converts nothing and writes nothing; it says
    how to resolve the model."""
    monkeypatch.setenv("PPRUN_CACHE_DIR", str(tmp_path))
    _forbid_conversion(monkeypatch)
    with pytest.raises(ValueError, match=rf"model\.model='{alias}' is a known alias that has not been converted yet"):
        validate_config(PprunConfig.from_kwargs(model=alias), cuda_available=False, env={})
    assert list(tmp_path.iterdir()) == []


def test_validate_reads_a_converted_alias(llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A converted alias is validated from its cached directory, without converting."""
    import shutil

    alias = "smollm2-135m-instruct"
    monkeypatch.setenv("PPRUN_CACHE_DIR", str(tmp_path))
    out_dir = tmp_path / "models" / alias
    shutil.copytree(llama_dir, out_dir)
    (out_dir / "pprun_source.json").write_text("{}")
    _forbid_conversion(monkeypatch)
    resolved = validate_config(PprunConfig.from_kwargs(model=alias), cuda_available=False, env={})
    assert resolved.model_dir == out_dir
    assert resolved.arch.num_hidden_layers == 4


def test_unknown_model_names_the_aliases() -> None:
    with pytest.raises(ValueError, match=r"model\.model='no-such-model'.*known aliases:.*smollm2-135m-instruct"):
        validate_config(PprunConfig.from_kwargs(model="no-such-model"), cuda_available=False, env={})


def test_piecewise_sizes_default_to_token_counts_up_to_the_budget():
    """Piecewise graphs are sized in tokens: by default every default size up to the step's token
    budget (a 512-token prompt is one replay, and so is a mixed step of it and up to 512 decode
    rows), the decode sizes where only those are given, or
    their own list."""
    comp = CompilationConfig()
    assert comp.cudagraph_mode == "full_and_piecewise"
    assert comp.resolved_piecewise_sizes(8192)[-7:] == [256, 384, 512, 576, 640, 768, 1024]
    assert comp.resolved_piecewise_sizes(700)[-3:] == [512, 576, 640]
    assert comp.resolved_piecewise_sizes(100) == [1, 2, 4, 8, 16, 24, 32, 48, 64, 96]
    assert CompilationConfig(cudagraph_capture_sizes=[4, 1]).resolved_piecewise_sizes(8192) == [1, 4]
    assert CompilationConfig(piecewise_capture_sizes=[64, 8, 8]).resolved_piecewise_sizes(8192) == [8, 64]
