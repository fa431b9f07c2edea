"""FP8 checkpoints in the layouts published models use, dense and mixture-of-experts: loaded with
their scales (the weights equal the dequantized twin's exactly), token-identical to transformers
on the dequantized weights through every executor and both runners, and refused by name where
the checkpoint and its quantization_config disagree."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from conftest import fork_mp_stages
from fp8_checkpoints import LAYOUTS, write_fp8
from safetensors.torch import load_file, save_file
from test_moe_models import hf_greedy_tokens
from tiny_models import make_tiny_mixtral, make_tiny_qwen3, make_tiny_qwen3_moe

from pprun import LLM, SamplingParams
from pprun.attention.backend import reference_backend
from pprun.config import PprunConfig
from pprun.config.validate import even_partition, validate_config
from pprun.distributed.layout import StageLayout
from pprun.models.hf_config import load_arch_config
from pprun.worker.model_loader import load_stage_model

MAX_TOKENS = 8
PROMPTS = [[3], [5, 17, 42, 9, 100, 3, 7], list(range(30, 52)), [200, 201, 202, 7, 7, 7]]


@pytest.fixture(scope="module")
def float_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fp8_src")
    return {
        "qwen3": make_tiny_qwen3(root / "qwen3"),
        "qwen3_moe": make_tiny_qwen3_moe(root / "qwen3_moe"),
        "mixtral": make_tiny_mixtral(root / "mixtral", num_layers=3),
    }


@pytest.fixture(scope="module")
def fp8_dirs(float_dirs, tmp_path_factory) -> dict[tuple[str, str], tuple[Path, Path]]:
    """(family, layout) -> (FP8 checkpoint, its dequantized twin)."""
    root = tmp_path_factory.mktemp("fp8")
    return {(family, layout): write_fp8(src, root / f"{family}-{layout}", layout)
            for family, src in float_dirs.items() for layout in LAYOUTS}


def _load(model_dir: Path, rank: int = 0, pp: int = 1, dtype: torch.dtype = torch.float32):
    arch = load_arch_config(model_dir)
    layout = StageLayout.from_partition(even_partition(arch.num_hidden_layers, pp), rank)
    return load_stage_model(model_dir, arch, layout, device=torch.device("cpu"), dtype=dtype,
                            max_positions=64, attn_backend=reference_backend)


def _validate(model_dir: Path):
    return validate_config(PprunConfig.from_kwargs(model=str(model_dir), dtype="float32"),
                           cuda_available=False, env={})


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe", "mixtral"])
def test_fp8_weights_load_as_their_dequantized_values(fp8_dirs, family, layout):
    fp8_dir, twin = fp8_dirs[(family, layout)]
    resolved = _validate(fp8_dir)
    assert resolved.arch.quantization.method == ("compressed-tensors" if layout.startswith("ct") or layout == "channel"
                                                 else "fp8")
    for rank, pp in ((0, 1), (1, 2)):
        ours = _load(fp8_dir, rank, pp).state_dict()
        want = _load(twin, rank, pp).state_dict()
        assert ours.keys() == want.keys()
        for name, tensor in want.items():
            assert torch.equal(ours[name], tensor), f"{family} {layout} {name}"
    # The quantized weights did change: the twin is not the float source.
    stored = load_file(str(fp8_dir / "model.safetensors"))
    assert any(t.dtype == torch.float8_e4m3fn for t in stored.values())


@pytest.fixture(scope="module")
def hf_tokens(fp8_dirs) -> dict[tuple[str, str], list[list[int]]]:
    """transformers' greedy tokens on each dequantized twin the engine cases use."""
    from transformers import AutoModelForCausalLM

    out = {}
    for key in {(c[0], c[1]) for c in ENGINE_CASES}:
        model = AutoModelForCausalLM.from_pretrained(fp8_dirs[key][1], dtype=torch.float32).eval()
        out[key] = [hf_greedy_tokens(model, p, MAX_TOKENS) for p in PROMPTS]
    return out


# Both layouts of each family, pp 1-3, every executor, both runners.
ENGINE_CASES = [
    ("qwen3", "block", "uni", 1, "v2"),
    ("qwen3", "channel", "mp", 2, "v1"),
    ("qwen3_moe", "block", "ray", 3, "v1"),
    ("qwen3_moe", "channel", "uni", 1, "v2"),
    ("mixtral", "ct-block", "mp", 3, "v2"),
    ("mixtral", "tensor", "ray", 2, "v2"),
]


@pytest.mark.parametrize("family, layout, executor, pp, runner", ENGINE_CASES,
                         ids=["-".join(map(str, c)) for c in ENGINE_CASES])
def test_fp8_engine_matches_transformers_on_the_dequantized_weights(fp8_dirs, hf_tokens, request, family, layout,
                                                                     executor, pp, runner):
    if executor == "ray":
        request.getfixturevalue("ray_cluster")
    if executor == "mp" and pp > 2:  # the pp=2 mp stages start fresh; the pp=3 ones fork theirs
        fork_mp_stages(request)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    with LLM(str(fp8_dirs[(family, layout)][0]), dtype="float32", executor=executor, pipeline_parallel_size=pp,
             runner=runner, max_model_len=40) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    assert [o.outputs[0].token_ids for o in outs] == hf_tokens[(family, layout)]


# --- the checkpoint and its config disagree ------------------------------------------------------


def _edited(fp8_dirs, tmp_path, key, edit_tensors=None, edit_qc=None) -> Path:
    model_dir = tmp_path / "edited"
    shutil.copytree(fp8_dirs[key][0], model_dir)
    if edit_tensors is not None:
        tensors = load_file(str(model_dir / "model.safetensors"))
        edit_tensors(tensors)
        save_file(tensors, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
    if edit_qc is not None:
        config = json.loads((model_dir / "config.json").read_text())
        edit_qc(config["quantization_config"])
        (model_dir / "config.json").write_text(json.dumps(config))
    return model_dir


Q = "model.layers.0.self_attn.q_proj"


@pytest.mark.parametrize("case, key, edit_tensors, edit_qc, message", [
    ("missing scale", ("qwen3", "block"), lambda t: t.pop(f"{Q}.weight_scale_inv"), None,
     rf"{Q}\.weight_scale_inv: missing"),
    ("scale of another shape", ("qwen3", "block"), lambda t: t.update({f"{Q}.weight_scale_inv": torch.ones(1, 1)}),
     None, rf"{Q}\.weight_scale_inv: shape \(1, 1\).*block-wise scale of a \(80, 48\) weight is \(5, 3\)"),
    ("float weight the config quantizes", ("qwen3", "channel"),
     lambda t: t.update({f"{Q}.weight": t[f"{Q}.weight"].to(torch.float32)}), None,
     rf"{Q}\.weight: stored as float32; the quantization_config \(compressed-tensors, channel\) quantizes it"),
    ("fp8 weight the config leaves dense", ("qwen3", "channel"), None,
     lambda qc: qc["ignore"].append(f"re:{re.escape(Q)}$"),
     rf"{Q}\.weight: stored as float8_e4m3fn, but the quantization_config leaves this module in floating point"),
    ("input scale of a dynamic scheme", ("qwen3", "block"), lambda t: t.update({f"{Q}.input_scale": torch.ones(1)}),
     None, rf"1 tensor\(s\) that no parameter of Qwen3ForCausalLM takes: {Q}\.input_scale"),
    ("a router fp8 where fp8 never quantizes one", ("qwen3_moe", "block"),
     lambda t: t.update({"model.layers.0.mlp.gate.weight": t["model.layers.0.mlp.gate.weight"].to(torch.float8_e4m3fn),
                         "model.layers.0.mlp.gate.weight_scale_inv": torch.ones(1, 3)}), None,
     r"model\.layers\.0\.mlp\.gate\.weight: stored as float8_e4m3fn, but the quantization_config leaves"),
])
def test_a_checkpoint_disagreeing_with_its_quantization_config_is_refused(fp8_dirs, tmp_path, case, key,
                                                                          edit_tensors, edit_qc, message):
    model_dir = _edited(fp8_dirs, tmp_path, key, edit_tensors, edit_qc)
    with pytest.raises(ValueError, match=message):
        _validate(model_dir)
    with pytest.raises(ValueError, match=message):
        _load(model_dir)


def test_compressed_tensors_routers_follow_the_ignore_list(fp8_dirs, tmp_path):
    """compressed-tensors targets every Linear: with the router out of ``ignore`` the checkpoint must
    hold a float8 router, which then loads as its dequantized values."""
    key = ("qwen3_moe", "channel")
    router = "model.layers.0.mlp.gate.weight"

    def quantize_router(t):
        w = t[router].float()
        s = w.abs().amax(dim=1, keepdim=True) / 448.0
        t[router] = (w / s).to(torch.float8_e4m3fn)
        t["model.layers.0.mlp.gate.weight_scale"] = s

    def stop_ignoring(qc):
        qc["ignore"] = ["lm_head", r"re:model\.layers\.[1-9]\d*\.mlp\.gate$"]

    model_dir = _edited(fp8_dirs, tmp_path, key, quantize_router, stop_ignoring)
    _validate(model_dir)
    stored = load_file(str(model_dir / "model.safetensors"))
    ours = _load(model_dir).state_dict()
    want = stored[router].to(torch.float32) * stored["model.layers.0.mlp.gate.weight_scale"]
    assert torch.equal(ours["layers.0.mlp.gate.weight"], want)


@pytest.mark.parametrize("edit, message", [
    (lambda qc: qc.update(format="pack-quantized"), r"quantization_config\.format='pack-quantized'"),
    (lambda qc: qc.update(kv_cache_scheme={"num_bits": 8, "type": "float"}), r"kv_cache_scheme"),
    (lambda qc: qc["config_groups"]["group_0"]["weights"].update(type="int"),
     r"config_groups\.group_0\.weights=.*8-bit float weights"),
    (lambda qc: qc["config_groups"]["group_0"]["weights"].update(strategy="group"),
     r"weights\.strategy='group'.*'channel', 'tensor' or 'block'"),
    (lambda qc: qc["config_groups"]["group_0"].update(targets=["Attention"]), r"targets=\['Attention'\]"),
])
def test_compressed_tensors_settings_pprun_does_not_run_are_refused(fp8_dirs, tmp_path, edit, message):
    model_dir = _edited(fp8_dirs, tmp_path, ("qwen3", "channel"), edit_qc=edit)
    with pytest.raises(ValueError, match=message):
        load_arch_config(model_dir)


@pytest.mark.parametrize("edit, message", [
    (lambda qc: qc.update(fmt="e5m2"), r"quantization_config\.fmt='e5m2'"),
    (lambda qc: qc.update(weight_block_size=[128]), r"weight_block_size=\[128\]"),
    (lambda qc: qc.update(activation_scheme="sometimes"), r"activation_scheme='sometimes'"),
])
def test_fp8_settings_pprun_does_not_run_are_refused(fp8_dirs, tmp_path, edit, message):
    model_dir = _edited(fp8_dirs, tmp_path, ("qwen3", "block"), edit_qc=edit)
    with pytest.raises(ValueError, match=message):
        load_arch_config(model_dir)


def test_bf16_runs_dequantize_into_bf16(fp8_dirs):
    fp8_dir, twin = fp8_dirs[("qwen3", "block")]
    ours = _load(fp8_dir, dtype=torch.bfloat16).state_dict()
    want = _load(twin, dtype=torch.bfloat16).state_dict()
    for name, tensor in want.items():
        assert ours[name].dtype == torch.bfloat16 and torch.equal(ours[name], tensor), name


@pytest.mark.parametrize("layout, scale", [("block", "weight_scale_inv"), ("channel", "weight_scale")])
def test_random_model_script_writes_published_fp8_layouts(tmp_path, layout, scale):
    from test_moe_models import _load_maker

    out = tmp_path / layout
    _load_maker().main([str(out), "--arch", "qwen3-moe", "--hidden", "256", "--layers", "2", "--heads", "4",
                        "--kv-heads", "2", "--head-dim", "64", "--intermediate", "384", "--experts", "4",
                        "--top-k", "2", "--expert-intermediate", "128", "--vocab", "300", "--max-pos", "128",
                        "--fp8", layout])
    stored = load_file(str(out / "model.safetensors"))
    q = "model.layers.0.self_attn.q_proj"
    assert stored[f"{q}.weight"].dtype == torch.float8_e4m3fn
    assert stored[f"{q}.{scale}"].shape == ((2, 2) if layout == "block" else (256, 1))
    assert stored["model.layers.0.mlp.experts.3.down_proj.weight"].dtype == torch.float8_e4m3fn
    assert stored["model.layers.0.mlp.gate.weight"].dtype == torch.bfloat16
    assert stored["lm_head.weight"].dtype == torch.bfloat16
    resolved = _validate(out)
    assert resolved.arch.quantization.method == ("fp8" if layout == "block" else "compressed-tensors")
    _load(out)


# --- online FP8: model.quantization=fp8 on a floating-point checkpoint ---------------------------


def _rounded_twin(src: Path, dst: Path) -> Path:
    """``src`` with every decoder linear (not routers, not the LM head) rounded through float8 per
    output row, as online FP8 stores it: largest magnitude of a row -> 448 (written here
    independently of pprun's quantizer)."""
    shutil.copytree(src, dst)
    tensors = load_file(str(src / "model.safetensors"))
    for name, w in tensors.items():
        linear = (name.endswith("proj.weight") and ".layers." in name) or ".experts." in name
        if linear and not name.endswith("norm.weight"):
            s = w.float().abs().amax(dim=1, keepdim=True) / 448.0
            tensors[name] = (w.float() / s).clamp(-448, 448).to(torch.float8_e4m3fn).to(torch.float32) * s
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe", "mixtral"])
def test_online_fp8_rounds_the_linears_and_matches_transformers_on_them(float_dirs, tmp_path, family):
    from test_moe_models import hf_greedy_tokens
    from transformers import AutoModelForCausalLM

    src = float_dirs[family]
    twin = _rounded_twin(src, tmp_path / "rounded")
    arch = validate_config(PprunConfig.from_kwargs(model=str(src), dtype="float32", quantization="fp8"),
                           cuda_available=False, env={}).arch
    assert arch.quantization.online and arch.quantization.method == "fp8 (online)"
    layout = StageLayout.single(arch.num_hidden_layers)
    ours = load_stage_model(src, arch, layout, device=torch.device("cpu"), dtype=torch.float32,
                            max_positions=64, attn_backend=reference_backend).state_dict()
    want = _load(twin).state_dict()
    plain = _load(src).state_dict()
    assert any(not torch.equal(want[n], plain[n]) for n in want)  # the rounding changed weights
    for name, tensor in want.items():
        assert torch.equal(ours[name], tensor), name
    model = AutoModelForCausalLM.from_pretrained(twin, dtype=torch.float32).eval()
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    with LLM(str(src), dtype="float32", quantization="fp8", max_model_len=40) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy_tokens(model, p, MAX_TOKENS) for p in PROMPTS]


def test_online_fp8_settings_are_checked(fp8_dirs, float_dirs, tmp_path):
    with pytest.raises(ValueError, match=r"model\.quantization='int8' is not allowed; choose one of None, fp8"):
        validate_config(PprunConfig.from_kwargs(model=str(float_dirs["qwen3"]), quantization="int8"),
                        cuda_available=False, env={})
    # An FP8 checkpoint with quantization=fp8 runs as stored.
    fp8_dir = fp8_dirs[("qwen3", "channel")][0]
    arch = validate_config(PprunConfig.from_kwargs(model=str(fp8_dir), quantization="fp8"),
                           cuda_available=False, env={}).arch
    assert arch.quantization.method == "compressed-tensors" and not arch.quantization.online


def test_review_findings_stay_fixed(fp8_dirs, float_dirs, tmp_path):
    """A quantized LM head's scale is the last stage's (stage 0 of 2 does not call it unclaimed);
    decoder layers past num_hidden_layers are refused unless config.json declares MTP layers;
    malformed compressed-tensors groups and an e5m2 norm are named at validation."""
    # A compressed-tensors checkpoint whose LM head is quantized too.
    model_dir = tmp_path / "head"
    shutil.copytree(fp8_dirs[("qwen3", "channel")][0], model_dir)
    tensors = load_file(str(model_dir / "model.safetensors"))
    w = tensors["lm_head.weight"].float()
    s = w.abs().amax(dim=1, keepdim=True) / 448.0
    tensors["lm_head.weight"], tensors["lm_head.weight_scale"] = (w / s).to(torch.float8_e4m3fn), s
    save_file(tensors, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((model_dir / "config.json").read_text())
    config["quantization_config"]["ignore"] = ["re:.*mlp.gate$"]
    (model_dir / "config.json").write_text(json.dumps(config))
    _validate(model_dir)
    _load(model_dir, rank=0, pp=2)
    head = _load(model_dir, rank=1, pp=2).state_dict()["lm_head.weight"]
    assert torch.equal(head, tensors["lm_head.weight"].float() * s)

    # Two more decoder layers than config.json says: refused, unless declared as MTP layers.
    longer = tmp_path / "longer"
    shutil.copytree(float_dirs["qwen3"], longer)
    config = json.loads((longer / "config.json").read_text())
    config["num_hidden_layers"] -= 2
    (longer / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"tensor\(s\) that no parameter of Qwen3ForCausalLM takes: model\.layers\.2"):
        _validate(longer)
    config["num_nextn_predict_layers"] = 2
    (longer / "config.json").write_text(json.dumps(config))
    _validate(longer)

    # Malformed compressed-tensors groups.
    for group, message in [("x", r"config_groups\.g='x'"),
                           ({"targets": ["Linear"], "weights": "w"}, r"config_groups\.g\.weights='w'"),
                           ({"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "block",
                                                                "block_structure": [True, 128]}},
                            r"block_structure=\[True, 128\]")]:
        bad = tmp_path / f"bad{len(list(tmp_path.iterdir()))}"
        shutil.copytree(fp8_dirs[("qwen3", "channel")][0], bad)
        config = json.loads((bad / "config.json").read_text())
        config["quantization_config"]["config_groups"] = {"g": group}
        (bad / "config.json").write_text(json.dumps(config))
        with pytest.raises(ValueError, match=message):
            load_arch_config(bad)

    # An e5m2 norm in an FP8 checkpoint: named at validation, not at load.
    e5m2 = tmp_path / "e5m2"
    shutil.copytree(fp8_dirs[("qwen3", "channel")][0], e5m2)
    tensors = load_file(str(e5m2 / "model.safetensors"))
    norm = "model.layers.0.input_layernorm.weight"
    tensors[norm] = tensors[norm].to(torch.float8_e5m2)
    save_file(tensors, str(e5m2 / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"{re.escape(norm)}: stored as float8_e5m2"):
        _validate(e5m2)


def test_a_quantized_llava_is_refused_even_with_its_config_in_text_config(tmp_path):
    from tiny_models import make_tiny_llava

    model_dir = make_tiny_llava(tmp_path / "llava")
    config = json.loads((model_dir / "config.json").read_text())
    config["text_config"]["quantization_config"] = {
        "quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "dynamic"}
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"a quantized LlavaForConditionalGeneration .* is not supported"):
        load_arch_config(model_dir)
