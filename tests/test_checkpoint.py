"""config.json parsing (both layouts) and safetensors indexing/validation against real transformers files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import make_tiny_llama, make_tiny_mistral, make_tiny_qwen2

from pprun.models import checkpoint as checkpoint_module
from pprun.models.checkpoint import CheckpointIndex, validate_checkpoint
from pprun.models.hf_config import SUPPORTED_ARCHITECTURES, expected_tensor_shapes, load_arch_config

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 1024,
}


def _hf_state_shapes(model_dir: Path) -> dict[str, tuple[int, ...]]:
    """Shapes of every tensor transformers itself saved."""
    return {name: tuple(t.shape) for name, t in load_file(str(model_dir / "model.safetensors")).items()}


def _write_config(model_dir: Path, **changes: object) -> None:
    """Edit config.json in place (None deletes a key)."""
    path = model_dir / "config.json"
    config = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    path.write_text(json.dumps(config))


# --- config.json ------------------------------------------------------------------------------


def test_llama_config_parsed_from_transformers_5_layout(tmp_path: Path) -> None:
    model_dir = make_tiny_llama(tmp_path / "llama")
    assert "rope_parameters" in json.loads((model_dir / "config.json").read_text())
    arch = load_arch_config(model_dir)
    assert arch.architecture == "LlamaForCausalLM"
    assert arch.model_type == "llama"
    assert (arch.vocab_size, arch.hidden_size, arch.intermediate_size) == (256, 64, 128)
    assert (arch.num_hidden_layers, arch.num_attention_heads, arch.num_key_value_heads) == (4, 4, 2)
    assert arch.head_dim == 16
    assert arch.rope_theta == 10000.0
    assert arch.rope_scaling is None
    assert arch.max_position_embeddings == 2048
    assert arch.tie_word_embeddings is False
    assert (arch.attention_bias, arch.o_proj_bias, arch.mlp_bias) == (False, False, False)
    assert arch.torch_dtype == "float32"
    assert arch.bos_token_id == 1
    assert arch.eos_token_ids == (2,)
    assert arch.sliding_window is None


@pytest.mark.parametrize(
    ("rope_scaling", "expected"),
    [
        (LLAMA3_ROPE, LLAMA3_ROPE),
        ({"rope_type": "linear", "factor": 2.0}, {"rope_type": "linear", "factor": 2.0}),
    ],
)
def test_rope_scaling_parsed_from_transformers_5_layout(
    tmp_path: Path, rope_scaling: dict, expected: dict
) -> None:
    model_dir = make_tiny_llama(tmp_path / "llama", rope_scaling=dict(rope_scaling), rope_theta=500000.0)
    arch = load_arch_config(model_dir)
    assert arch.rope_scaling == expected
    assert arch.rope_theta == 500000.0


def test_older_layout_rope_theta_and_rope_scaling(tmp_path: Path) -> None:
    model_dir = make_tiny_llama(tmp_path / "llama")
    # Hand-written pre-transformers-5 layout: rope_theta at top level, rope_scaling keyed by "type".
    _write_config(
        model_dir, rope_parameters=None, rope_theta=250000.0, rope_scaling={"type": "linear", "factor": 4}
    )
    arch = load_arch_config(model_dir)
    assert arch.rope_theta == 250000.0
    assert arch.rope_scaling == {"rope_type": "linear", "factor": 4.0}

    _write_config(model_dir, rope_scaling=dict(LLAMA3_ROPE, rope_type="llama3"))
    assert load_arch_config(model_dir).rope_scaling == LLAMA3_ROPE

    _write_config(model_dir, rope_theta=None, rope_scaling=None, head_dim=None, num_key_value_heads=None)
    arch = load_arch_config(model_dir)
    assert arch.rope_theta == 10000.0
    assert arch.rope_scaling is None
    assert arch.head_dim == 64 // 4
    assert arch.num_key_value_heads == arch.num_attention_heads


@pytest.mark.parametrize("layout", ["rope_parameters", "rope_scaling"])
def test_unsupported_rope_type_is_named(tmp_path: Path, layout: str) -> None:
    model_dir = make_tiny_llama(tmp_path / "llama")
    yarn = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}
    if layout == "rope_parameters":
        _write_config(model_dir, rope_parameters=yarn)
    else:
        _write_config(model_dir, rope_parameters=None, rope_scaling=yarn)
    with pytest.raises(ValueError, match=r"rope_type='yarn'.*default, linear, llama3"):
        load_arch_config(model_dir)


def test_llama3_rope_missing_parameter_is_named(tmp_path: Path) -> None:
    model_dir = make_tiny_llama(tmp_path / "llama")
    broken = {k: v for k, v in LLAMA3_ROPE.items() if k != "low_freq_factor"}
    _write_config(model_dir, rope_parameters=dict(broken, rope_theta=1e4))
    with pytest.raises(ValueError, match="low_freq_factor"):
        load_arch_config(model_dir)


def test_qwen2_has_qkv_bias_but_no_o_proj_bias(tmp_path: Path) -> None:
    model_dir = make_tiny_qwen2(tmp_path / "qwen2")
    arch = load_arch_config(model_dir)
    assert arch.architecture == "Qwen2ForCausalLM"
    assert (arch.attention_bias, arch.o_proj_bias) == (True, False)
    assert arch.sliding_window is None  # Qwen2 writes sliding_window only to ignore it
    expected = expected_tensor_shapes(arch)
    assert expected["model.layers.0.self_attn.q_proj.bias"] == (64,)
    assert expected["model.layers.0.self_attn.k_proj.bias"] == (32,)
    assert "model.layers.0.self_attn.o_proj.bias" not in expected
    assert expected == _hf_state_shapes(model_dir)


@pytest.mark.parametrize(
    "make",
    [
        lambda p: make_tiny_llama(p),
        lambda p: make_tiny_llama(p, tied=True),
        lambda p: make_tiny_llama(p, attention_bias=True, mlp_bias=True, head_dim=32),
        lambda p: make_tiny_qwen2(p, tied=True),
        lambda p: make_tiny_mistral(p),
    ],
    ids=["llama", "llama-tied", "llama-bias-headdim", "qwen2-tied", "mistral"],
)
def test_expected_shapes_match_what_transformers_saves(tmp_path: Path, make) -> None:
    model_dir = make(tmp_path / "m")
    arch = load_arch_config(model_dir)
    assert expected_tensor_shapes(arch) == _hf_state_shapes(model_dir)
    validate_checkpoint(model_dir, arch)


def test_expected_shapes_per_stage(tmp_path: Path) -> None:
    untied = load_arch_config(make_tiny_llama(tmp_path / "untied"))
    first = expected_tensor_shapes(untied, range(0, 2), first=True, last=False)
    assert "model.embed_tokens.weight" in first
    assert {"model.norm.weight", "lm_head.weight"}.isdisjoint(first)
    assert not any(name.startswith(("model.layers.2.", "model.layers.3.")) for name in first)
    last = expected_tensor_shapes(untied, range(2, 4), first=False, last=True)
    assert "model.embed_tokens.weight" not in last
    assert last["lm_head.weight"] == (256, 64)
    assert not any(name.startswith(("model.layers.0.", "model.layers.1.")) for name in last)

    tied = load_arch_config(make_tiny_llama(tmp_path / "tied", tied=True))
    tied_last = expected_tensor_shapes(tied, range(2, 4), first=False, last=True)
    # The tied LM head is the embedding matrix, so the last stage needs it and no lm_head.weight.
    assert tied_last["model.embed_tokens.weight"] == (256, 64)
    assert "lm_head.weight" not in tied_last


def test_eos_ids_merge_config_and_generation_config(tmp_path: Path) -> None:
    model_dir = make_tiny_llama(tmp_path / "llama")
    _write_config(model_dir, eos_token_id=[2, 7])
    generation = json.loads((model_dir / "generation_config.json").read_text())
    generation["eos_token_id"] = [7, 9]
    (model_dir / "generation_config.json").write_text(json.dumps(generation))
    assert load_arch_config(model_dir).eos_token_ids == (2, 7, 9)


def test_mistral_sliding_window_is_recorded(tmp_path: Path) -> None:
    model_dir = make_tiny_mistral(tmp_path / "mistral", sliding_window=512)
    assert load_arch_config(model_dir).sliding_window == 512


def test_unsupported_architecture_is_named_with_supported_list(tmp_path: Path) -> None:
    model_dir = make_tiny_llama(tmp_path / "llama")
    _write_config(model_dir, architectures=["GPT2LMHeadModel"], model_type="gpt2")
    with pytest.raises(ValueError, match="GPT2LMHeadModel") as info:
        load_arch_config(model_dir)
    assert all(name in str(info.value) for name in SUPPORTED_ARCHITECTURES)


def test_missing_config_json(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no config.json"):
        load_arch_config(tmp_path)


# --- safetensors ------------------------------------------------------------------------------


def _write_two_shards(model_dir: Path) -> dict[str, torch.Tensor]:
    """Split a tiny Llama's weights over two hand-written shards plus an index; returns the tensors."""
    single = model_dir / "model.safetensors"
    tensors = load_file(str(single))
    single.unlink()
    names = sorted(tensors)
    shard_names = {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}
    split = {shard_names["a"]: names[: len(names) // 2], shard_names["b"]: names[len(names) // 2 :]}
    weight_map = {}
    for file_name, file_tensors in split.items():
        save_file({n: tensors[n].contiguous() for n in file_tensors}, str(model_dir / file_name))
        weight_map.update({n: file_name for n in file_tensors})
    (model_dir / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    return tensors


def test_sharded_index_reads_only_requested_tensors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model_dir = make_tiny_llama(tmp_path / "llama")
    tensors = _write_two_shards(model_dir)
    index = CheckpointIndex.open(model_dir)
    assert set(index.names()) == set(tensors)
    arch = load_arch_config(model_dir)
    validate_checkpoint(model_dir, arch)

    opened: list[str] = []
    read: list[str] = []
    real_safe_open = checkpoint_module.safe_open

    class RecordingHandle:
        def __init__(self, handle):
            self._handle = handle

        def get_tensor(self, name):
            read.append(name)
            return self._handle.get_tensor(name)

        def __getattr__(self, attr):
            return getattr(self._handle, attr)

    class RecordingOpen:
        def __init__(self, path, *args, **kwargs):
            opened.append(Path(path).name)
            self._cm = real_safe_open(path, *args, **kwargs)

        def __enter__(self):
            return RecordingHandle(self._cm.__enter__())

        def __exit__(self, *exc):
            return self._cm.__exit__(*exc)

    monkeypatch.setattr(checkpoint_module, "safe_open", RecordingOpen)
    first_shard = index.file_of("lm_head.weight")
    wanted = [n for n in index.names() if index.file_of(n) == first_shard][:3]
    loaded = index.load(wanted, device="cpu", dtype=torch.bfloat16)
    assert opened == [first_shard]
    assert sorted(read) == sorted(wanted)
    assert set(loaded) == set(wanted)
    for name in wanted:
        assert loaded[name].dtype == torch.bfloat16
        torch.testing.assert_close(loaded[name], tensors[name].to(torch.bfloat16))

    # Tensors from both shards: each file opened exactly once.
    opened.clear()
    both = [
        "model.embed_tokens.weight",
        "model.norm.weight",
        "lm_head.weight",
        "model.layers.3.mlp.up_proj.weight",
    ]
    index.load(both)
    assert sorted(opened) == sorted({index.file_of(n) for n in both})


def test_shape_and_dtype_from_header(tmp_path: Path) -> None:
    save_file(
        {"a": torch.zeros(3, 5, dtype=torch.bfloat16), "b": torch.zeros(7, dtype=torch.int64)},
        str(tmp_path / "model.safetensors"),
    )
    index = CheckpointIndex.open(tmp_path)
    assert index.shape("a") == (3, 5) and index.dtype("a") == torch.bfloat16
    assert index.shape("b") == (7,) and index.dtype("b") == torch.int64
    with pytest.raises(ValueError, match="'c'"):
        index.shape("c")


def test_missing_tensor_is_named(tmp_path: Path) -> None:
    model_dir = make_tiny_llama(tmp_path / "llama")
    tensors = load_file(str(model_dir / "model.safetensors"))
    del tensors["model.layers.2.mlp.down_proj.weight"]
    save_file(tensors, str(model_dir / "model.safetensors"))
    with pytest.raises(
        ValueError, match=r"missing tensor.*model\.layers\.2\.mlp\.down_proj\.weight \(64, 128\)"
    ):
        validate_checkpoint(model_dir, load_arch_config(model_dir))


def test_wrong_shape_names_tensor_shapes_and_file(tmp_path: Path) -> None:
    model_dir = make_tiny_llama(tmp_path / "llama")
    _write_two_shards(model_dir)
    index = CheckpointIndex.open(model_dir)
    name = "model.layers.1.self_attn.k_proj.weight"
    shard = model_dir / index.file_of(name)
    tensors = load_file(str(shard))
    tensors[name] = torch.zeros(16, 64)
    save_file(tensors, str(shard))
    with pytest.raises(ValueError) as info:
        validate_checkpoint(model_dir, load_arch_config(model_dir))
    message = str(info.value)
    assert name in message
    assert "expected shape (32, 64), found (16, 64)" in message
    assert shard.name in message


def test_no_weights_file(tmp_path: Path) -> None:
    model_dir = make_tiny_llama(tmp_path / "llama")
    (model_dir / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="no weights.*model.safetensors"):
        CheckpointIndex.open(model_dir)


def test_index_naming_a_missing_shard(tmp_path: Path) -> None:
    model_dir = make_tiny_llama(tmp_path / "llama")
    _write_two_shards(model_dir)
    (model_dir / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ValueError, match="model-00002-of-00002.safetensors"):
        CheckpointIndex.open(model_dir)


# --- tied checkpoints that store only the LM head ---------------------------------------------


@pytest.mark.parametrize("family", ["llama", "llava"])
def test_tied_checkpoint_storing_only_lm_head_loads_as_transformers_does(tmp_path: Path, family: str) -> None:
    """``safetensors.torch.save_model`` keeps one name of a shared tensor: for a tied model,
    ``lm_head.weight``.  pprun serves the embedding from it, as transformers does: same logits
    as transformers on the same directory, and transformers' greedy tokens."""
    from safetensors import safe_open
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM, LlavaForConditionalGeneration

    from pprun import LLM, SamplingParams

    if family == "llama":
        model_dir, hf_cls = make_tiny_llama(tmp_path / "tied", tied=True, num_layers=2), AutoModelForCausalLM
        prompt = [5, 9, 17, 3, 200, 41]
    else:
        from tiny_models import make_tiny_llava

        model_dir, hf_cls = make_tiny_llava(tmp_path / "tied", "clip", num_layers=2, tied=True), LlavaForConditionalGeneration
        prompt = [1, 5, 7, 12, 13, 14, 8, 6, 7]  # text only: the embedding table is what is tested
    original = hf_cls.from_pretrained(model_dir, dtype=torch.float32).eval()
    save_model(original, str(model_dir / "model.safetensors"))
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        stored = set(f.keys())
    assert "lm_head.weight" in stored and not [n for n in stored if n.endswith("embed_tokens.weight")]

    reloaded = hf_cls.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        want_logits = reloaded(ids).logits[0]
        assert torch.equal(want_logits, original(ids).logits[0])  # transformers ties it back
        want = reloaded.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0)[0, len(prompt):].tolist()

    with LLM(str(model_dir), dtype="float32", executor="uni", runner="v1", kv_cache_memory_bytes=1 << 22) as llm:
        out = llm.generate([{"prompt_token_ids": prompt}],
                           SamplingParams(temperature=0, max_tokens=5, logprobs=3, ignore_eos=True))[0]
        model = llm.engine.executor.worker.runner.model
        embed = model.language_model if family == "llava" else model
        assert torch.equal(embed.embed_input_ids(ids[0]), reloaded.get_input_embeddings()(ids[0]))
    assert out.outputs[0].token_ids == want
    # The first output's top logprobs are those of transformers' last-position logits.
    first = out.outputs[0].logprobs[0]
    want_lp = torch.log_softmax(want_logits[-1], -1)
    assert first.top_token_ids == want_lp.topk(3).indices.tolist()
    assert torch.allclose(torch.tensor(first.top_logprobs), want_lp.topk(3).values, atol=1e-4)
