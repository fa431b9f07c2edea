"""A checkpoint loads exactly or not at all: a corpus of malformed and quantized checkpoints, each
made by transformers and then rewritten, is refused with an error naming what is wrong, at config
validation and again by the stage that would load it; what the models declare ignorable loads."""

from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import make_tiny_llama, make_tiny_qwen3, make_tiny_qwen3_moe

from pprun.attention.backend import reference_backend
from pprun.config import PprunConfig
from pprun.config.validate import even_partition, validate_config
from pprun.distributed.layout import StageLayout
from pprun.models.checkpoint import CheckpointIndex, check_stage_tensors, validate_checkpoint
from pprun.models.hf_config import expected_tensor_shapes, load_arch_config
from pprun.worker.model_loader import load_stage_model

WEIGHTS = "model.safetensors"


@pytest.fixture(scope="module")
def base_dirs(tmp_path_factory) -> dict[str, Path]:
    """One tiny dense Qwen3 and one tiny Qwen3-MoE (the families the FP8 checkpoints ship in),
    and a tied Llama, as transformers saves them; each case copies one and rewrites it."""
    root = tmp_path_factory.mktemp("exact")
    return {
        "qwen3": make_tiny_qwen3(root / "qwen3", num_layers=2),
        "qwen3_moe": make_tiny_qwen3_moe(root / "qwen3_moe", num_layers=2, mlp_only_layers=()),
        "llama_tied": make_tiny_llama(root / "llama_tied", tied=True, num_layers=2),
    }


def _copy(base: Path, dest: Path) -> Path:
    shutil.copytree(base, dest)
    return dest


def _rewrite(model_dir: Path, edit) -> None:
    """Rewrite the weights file: ``edit(tensors)`` changes the dict in place."""
    tensors = load_file(str(model_dir / WEIGHTS))
    edit(tensors)
    save_file(tensors, str(model_dir / WEIGHTS), metadata={"format": "pt"})


def _set_config(model_dir: Path, **changes) -> None:
    path = model_dir / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def _validate(model_dir: Path):
    """pprun's config validation of a run on ``model_dir`` (what every entry point calls first)."""
    cfg = PprunConfig.from_kwargs(model=str(model_dir), dtype="float32")
    return validate_config(cfg, cuda_available=False, env={})


def _load_stage(model_dir: Path, rank: int = 0, pp: int = 1):
    arch = load_arch_config(model_dir)
    layout = StageLayout.from_partition(even_partition(arch.num_hidden_layers, pp), rank)
    return load_stage_model(model_dir, arch, layout, device=torch.device("cpu"), dtype=torch.float32,
                            max_positions=64, attn_backend=reference_backend)


# --- quantization_config ----------------------------------------------------------------------


@pytest.mark.parametrize("key, qc", [
    ("quantization_config", {"quant_method": "awq", "bits": 4, "group_size": 128}),
    ("quantization_config", {"quant_method": "gptq", "bits": 4}),
    ("quantization_config", {"quant_method": "bitsandbytes", "load_in_4bit": True}),
    ("quantization_config", {"quant_method": "fbgemm_fp8"}),
    ("quantization_config", {"bits": 8}),
    ("compression_config", {"quant_method": "marlin"}),
])
def test_a_quantization_method_pprun_does_not_run_is_refused_at_validation(base_dirs, tmp_path, key, qc):
    model_dir = _copy(base_dirs["qwen3"], tmp_path / "q")
    _set_config(model_dir, **{key: qc})
    with pytest.raises(ValueError) as err:
        _validate(model_dir)
    message = str(err.value)
    method = qc.get("quant_method")
    assert (f"quant_method={method!r}" if method else "no quant_method") in message
    assert str(model_dir) in message and key in message
    assert "supported quantization methods:" in message
    # Refused before any model is built: reading the architecture alone refuses it.
    with pytest.raises(ValueError, match=re.escape(key)):
        load_arch_config(model_dir)


# --- every tensor accounted for -----------------------------------------------------------------


def test_an_unclaimed_tensor_is_refused_by_validation_and_by_the_stage(base_dirs, tmp_path):
    model_dir = _copy(base_dirs["qwen3"], tmp_path / "extra")
    _rewrite(model_dir, lambda t: t.update({
        "model.layers.1.mlp.extra_proj.weight": torch.zeros(4, 4),
        "model.layers.0.self_attn.q_proj.weight_scale_inv": torch.ones(1, 1),
        "model.unknown_head.weight": torch.zeros(3),
    }))
    with pytest.raises(ValueError) as err:
        _validate(model_dir)
    message = str(err.value)
    assert "3 tensor(s) that no parameter of Qwen3ForCausalLM takes" in message
    for name in ("model.layers.1.mlp.extra_proj.weight", "model.layers.0.self_attn.q_proj.weight_scale_inv",
                 "model.unknown_head.weight"):
        assert name in message
    assert "look like quantization scales" in message
    with pytest.raises(ValueError, match="extra_proj"):
        _load_stage(model_dir)


def test_unclaimed_tensors_are_checked_per_stage(base_dirs, tmp_path):
    """A stage reports an unknown tensor inside its own layers or outside every layer; another
    stage's layer is that stage's to check."""
    model_dir = _copy(base_dirs["qwen3"], tmp_path / "staged")
    _rewrite(model_dir, lambda t: t.update({"model.layers.1.self_attn.extra.weight": torch.zeros(2)}))
    arch = load_arch_config(model_dir)
    index = CheckpointIndex.open(model_dir, arch)
    partition = even_partition(arch.num_hidden_layers, 2)
    stage0 = StageLayout.from_partition(partition, 0)
    check_stage_tensors(index, arch, list(expected_tensor_shapes(arch, stage0.layer_range, True, False)),
                        lists_first_stage_modules=True, layer_range=stage0.layer_range)
    with pytest.raises(ValueError, match=r"stage 1/2: 1 tensor\(s\).*model\.layers\.1\.self_attn\.extra\.weight"):
        _load_stage(model_dir, rank=1, pp=2)
    _load_stage(model_dir, rank=0, pp=2)  # its own layer 0 is whole


def test_a_moe_checkpoint_with_an_extra_expert_tensor_is_refused(base_dirs, tmp_path):
    model_dir = _copy(base_dirs["qwen3_moe"], tmp_path / "moe")
    arch = load_arch_config(model_dir)
    extra = f"model.layers.0.mlp.experts.{arch.moe.num_experts}.down_proj.weight"
    _rewrite(model_dir, lambda t: t.update({extra: torch.zeros(arch.hidden_size, arch.moe.expert_intermediate_size)}))
    with pytest.raises(ValueError, match=re.escape(extra)):
        validate_checkpoint(model_dir, arch)


def test_what_a_model_declares_ignorable_loads(base_dirs, tmp_path):
    """Rotary tables, a tied head's stored copy and multi-token-prediction layers past
    num_hidden_layers (where config.json declares them) are declared ignorable with reasons: such
    a checkpoint loads, exactly as the one without them."""
    model_dir = _copy(base_dirs["llama_tied"], tmp_path / "ignorable")
    arch = load_arch_config(model_dir)
    mtp = f"model.layers.{arch.num_hidden_layers}"

    def add(t):
        t["lm_head.weight"] = t["model.embed_tokens.weight"].clone()
        t["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(arch.head_dim // 2)
        t[f"{mtp}.mlp.down_proj.weight"] = torch.zeros(2, 2)
        t["mtp.norm.weight"] = torch.ones(2)

    _rewrite(model_dir, add)
    _set_config(model_dir, num_nextn_predict_layers=1)  # the MTP layer, declared
    _validate(model_dir)
    plain = _load_stage(base_dirs["llama_tied"]).state_dict()
    loaded = _load_stage(model_dir).state_dict()
    assert plain.keys() == loaded.keys()
    for name, tensor in plain.items():
        assert torch.equal(tensor, loaded[name]), name


def test_an_untied_checkpoint_with_an_extra_head_is_not_ignored(base_dirs, tmp_path):
    """The tied head's rule applies only where the config ties: a stray copy elsewhere is refused."""
    model_dir = _copy(base_dirs["qwen3"], tmp_path / "untied")
    _rewrite(model_dir, lambda t: t.update({"model.layers.0.rotary_emb.inv_freq": torch.ones(2),
                                            "lm_head.bias": torch.zeros(2)}))
    with pytest.raises(ValueError, match=r"1 tensor\(s\).*lm_head\.bias"):
        _validate(model_dir)


# --- stored dtypes ------------------------------------------------------------------------------


@pytest.mark.parametrize("stored", [torch.float8_e4m3fn, torch.float8_e5m2, torch.int8, torch.uint8])
def test_a_float8_or_integer_weight_is_never_cast(base_dirs, tmp_path, stored):
    model_dir = _copy(base_dirs["qwen3"], tmp_path / "fp8")
    name = "model.layers.0.mlp.down_proj.weight"

    def quantize(t):
        w = t[name]
        t[name] = w.to(stored) if stored.is_floating_point else (w * 50).round().clamp(-100, 100).to(stored)

    _rewrite(model_dir, quantize)
    dtype_name = str(stored).removeprefix("torch.")
    with pytest.raises(ValueError, match=rf"1 weight\(s\) stored in a dtype a plain cast would corrupt: "
                                         rf"{re.escape(name)} \({dtype_name}"):
        _validate(model_dir)
    with pytest.raises(ValueError, match=re.escape(name)):
        _load_stage(model_dir)
    # The reader itself refuses the cast, whoever calls it.
    arch = load_arch_config(model_dir)
    index = CheckpointIndex.open(model_dir, arch)
    with pytest.raises(ValueError, match=rf"{re.escape(name)}.*stored as {dtype_name}"):
        index.load([name], dtype=torch.bfloat16)
    assert index.load([name])[name].dtype == stored  # read as stored when no cast is asked


@pytest.mark.parametrize("layout", ["block", "channel"])
def test_fp8_checkpoints_in_published_layouts_do_not_load_silently(base_dirs, tmp_path, layout):
    """Both FP8 layouts published checkpoints use, on the dense and the MoE model: never loaded
    as plain weights with their scales ignored; with their quantization_config, accepted."""
    for family in ("qwen3", "qwen3_moe"):
        model_dir = _copy(base_dirs[family], tmp_path / f"{family}-{layout}")
        scale_suffix = "weight_scale_inv" if layout == "block" else "weight_scale"

        def to_fp8(t, scale_suffix=scale_suffix):
            for name in [n for n in t if n.endswith("proj.weight") and ".layers." in n]:
                w = t[name]
                t[name] = w.to(torch.float8_e4m3fn)
                t[name.removesuffix("weight") + scale_suffix] = torch.ones(
                    (1, 1) if layout == "block" else (w.shape[0], 1))

        _rewrite(model_dir, to_fp8)
        if layout == "block":
            qc = {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "dynamic"}
        else:
            qc = {"quant_method": "compressed-tensors", "format": "float-quantized",
                  "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                      "num_bits": 8, "type": "float", "strategy": "channel", "dynamic": False}}},
                  "ignore": ["lm_head", "re:.*mlp.gate$"]}
        # Without its quantization_config: the scales are unclaimed, the float8 weights refused.
        with pytest.raises(ValueError, match="quantization scales"):
            _validate(model_dir)
        # With it, the method that owns the scales reads them (tests/test_fp8_checkpoints.py: the tokens).
        _set_config(model_dir, quantization_config=qc)
        resolved = _validate(model_dir)
        assert resolved.arch.quantization is not None and resolved.arch.quantization.method == qc["quant_method"]


def test_floating_conversions_are_logged_once(base_dirs, caplog):
    arch = load_arch_config(base_dirs["qwen3"])
    layout = StageLayout.single(arch.num_hidden_layers)
    with caplog.at_level(logging.INFO, logger="pprun.models.checkpoint"):
        load_stage_model(base_dirs["qwen3"], arch, layout, device=torch.device("cpu"), dtype=torch.bfloat16,
                         max_positions=64, attn_backend=reference_backend)
    lines = [r.getMessage() for r in caplog.records if "converting" in r.getMessage()]
    assert len(lines) == 1
    assert re.search(r"converting \d+ tensor\(s\) stored as float32 to bfloat16", lines[0]), lines
