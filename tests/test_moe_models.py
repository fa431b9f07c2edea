"""Qwen3, Qwen3-MoE and Mixtral against transformers (fp32 greedy, token for token), on tiny random
checkpoints of odd sizes made with transformers' own config classes (``tiny_models``):

- Qwen3: ``head_dim`` 20 of a 48-wide model with 4 heads, per-head q/k norms, tied and untied
  embeddings, a scaled RoPE;
- Qwen3-MoE: 5 experts, top-2, a dense layer among sparse ones (``mlp_only_layers``, or
  ``decoder_sparse_step``), with and without ``norm_topk_prob``;
- Mixtral: 6 experts, top-3.

Stage pieces chained by hand (pp 1-3) match transformers' logits; each stage reads its own
layers' tensors (experts included) and no others; and whole engines (uni, mp, ray; V1, V2;
pp 1-3; chunked prefill and preemption) generate transformers' greedy tokens, for prompts whose
tokens route to disjoint and to overlapping experts in the same step.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import fork_mp_stages
from test_model_parity import PROMPTS, hf_last_logits, run_stages
from tiny_models import make_tiny_mixtral, make_tiny_qwen3, make_tiny_qwen3_moe

from pprun import LLM, SamplingParams
from pprun.attention.backend import reference_backend
from pprun.config.validate import even_partition
from pprun.distributed.layout import StageLayout
from pprun.models import checkpoint as checkpoint_module
from pprun.models.checkpoint import validate_checkpoint
from pprun.models.hf_config import expected_tensor_shapes, load_arch_config
from pprun.worker.model_loader import load_stage_model

MAKERS = {
    "qwen3": lambda p: make_tiny_qwen3(p),
    "qwen3-tied-rope-linear": lambda p: make_tiny_qwen3(
        p, tied=True, rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 20000.0}),
    "qwen3-moe": lambda p: make_tiny_qwen3_moe(p),
    "qwen3-moe-step2-unnormed": lambda p: make_tiny_qwen3_moe(
        p, mlp_only_layers=(), decoder_sparse_step=2, norm_topk_prob=False, tied=True),
    "mixtral": lambda p: make_tiny_mixtral(p),
}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    """Every tiny checkpoint of :data:`MAKERS`, made once for the module."""
    root = tmp_path_factory.mktemp("moe_models")
    return {name: make(root / name) for name, make in MAKERS.items()}


# --- config and checkpoint -------------------------------------------------------------------


def test_configs_parsed_as_transformers_builds_them(model_dirs):
    """Expected tensors equal what transformers saved; the experts, top-k, renormalisation and
    the dense layers are read as transformers' decoder layers choose them."""
    from safetensors import safe_open

    for name, path in model_dirs.items():
        arch = load_arch_config(path)
        with safe_open(str(path / "model.safetensors"), framework="pt") as f:
            saved = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
        assert expected_tensor_shapes(arch) == saved, name
        validate_checkpoint(path, arch)
    qwen3 = load_arch_config(model_dirs["qwen3"])
    assert qwen3.qk_norm and qwen3.moe is None and qwen3.head_dim == 20 != 48 // 4
    assert load_arch_config(model_dirs["qwen3-tied-rope-linear"]).rope_scaling == {"rope_type": "linear", "factor": 2.0}
    moe = load_arch_config(model_dirs["qwen3-moe"]).moe
    assert (moe.num_experts, moe.top_k, moe.norm_topk_prob, moe.dense_layers) == (5, 2, True, (1,))
    stepped = load_arch_config(model_dirs["qwen3-moe-step2-unnormed"]).moe
    assert (stepped.norm_topk_prob, stepped.dense_layers) == (False, (0, 2))
    mixtral = load_arch_config(model_dirs["mixtral"])
    assert not mixtral.qk_norm
    assert (mixtral.moe.num_experts, mixtral.moe.top_k, mixtral.moe.norm_topk_prob) == (6, 3, True)


def _edit_config(path: Path, **changes) -> None:
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("changes, message", [
    ({"num_experts_per_tok": 6}, r"num_experts_per_tok=6 must be at most the expert count 5"),
    ({"num_experts_per_tok": 0}, r"num_experts_per_tok=0 must be an integer of at least 1"),
    ({"mlp_only_layers": [1, 4]}, r"mlp_only_layers=\[1, 4\] names \[4\], not layers of the model's 4"),
    ({"decoder_sparse_step": 0}, r"decoder_sparse_step=0 must be an integer of at least 1"),
])
def test_bad_expert_config_is_named(tmp_path, model_dirs, changes, message):
    import shutil

    path = Path(shutil.copytree(model_dirs["qwen3-moe"], tmp_path / "m"))
    _edit_config(path, **changes)
    with pytest.raises(ValueError, match=message):
        load_arch_config(path)


def test_published_qwen3_moe_key_num_experts(tmp_path, model_dirs):
    """Published Qwen3-MoE configs name the expert count ``num_experts`` (transformers 5 saves
    ``num_local_experts``); both are read."""
    import shutil

    path = Path(shutil.copytree(model_dirs["qwen3-moe"], tmp_path / "m"))
    config = json.loads((path / "config.json").read_text())
    config["num_experts"] = config.pop("num_local_experts")
    (path / "config.json").write_text(json.dumps(config))
    assert load_arch_config(path).moe.num_experts == 5


@pytest.mark.parametrize("name", ["qwen3-moe", "mixtral"])
def test_each_stage_reads_only_its_own_experts(model_dirs, monkeypatch, name):
    """Three stages: each reads exactly its expected tensors (its layers' experts and router, no
    other stage's), and together they read every expert tensor once."""
    path = model_dirs[name]
    arch = load_arch_config(path)
    read: list[str] = []
    real_safe_open = checkpoint_module.safe_open

    class Recording:
        def __init__(self, *args, **kwargs):
            self._cm = real_safe_open(*args, **kwargs)

        def __enter__(self):
            handle = self._cm.__enter__()

            class Handle:
                def get_tensor(self, tensor_name):
                    read.append(tensor_name)
                    return handle.get_tensor(tensor_name)

                def __getattr__(self, attr):
                    return getattr(handle, attr)

            return Handle()

        def __exit__(self, *exc):
            return self._cm.__exit__(*exc)

    monkeypatch.setattr(checkpoint_module, "safe_open", Recording)
    partition = [1, 2, 1]
    experts_read: list[str] = []
    for rank in range(3):
        layout = StageLayout.from_partition(partition, rank)
        read.clear()
        load_stage_model(path, arch, layout, device=torch.device("cpu"), dtype=torch.float32,
                         max_positions=64, attn_backend=reference_backend)
        expected = expected_tensor_shapes(arch, layout.layer_range, layout.is_first, layout.is_last)
        assert sorted(read) == sorted(expected)
        others = [i for i in range(arch.num_hidden_layers) if i not in layout.layer_range]
        assert not any(n.startswith(tuple(f"model.layers.{i}." for i in others)) for n in read)
        experts_read += [n for n in read if ".experts." in n]
    all_experts = [n for n in expected_tensor_shapes(arch) if ".experts." in n]
    assert sorted(experts_read) == sorted(all_experts)
    assert len(all_experts) == 3 * arch.moe.num_experts * sum(arch.moe.is_sparse(i) for i in range(4))


# --- stage pieces against transformers' logits -----------------------------------------------


@pytest.mark.parametrize("name", list(MAKERS))
def test_stage_pieces_match_transformers(model_dirs, name):
    ref = hf_last_logits(model_dirs[name], PROMPTS)
    for pp in (1, 2, 3):
        torch.testing.assert_close(run_stages(model_dirs[name], pp, PROMPTS), ref, atol=1e-4, rtol=1e-4)


# --- whole engines against transformers' greedy tokens ---------------------------------------

MAX_TOKENS = 8


def hf_greedy_tokens(model, prompt: list[int], max_tokens: int) -> list[int]:
    """transformers' greedy continuation of ``prompt``, ``max_tokens`` long (EOS not special,
    as ``ignore_eos``): the full forward each step, the argmax at the last position."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(max_tokens):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def first_layer_experts(model, tokens: list[int]) -> list[set[int]]:
    """The experts each token alone (a one-token prompt) is routed to in the first sparse layer."""
    with torch.no_grad():
        logits = model(torch.tensor(tokens)[:, None], output_router_logits=True).router_logits[0]
    top_k = model.config.num_experts_per_tok
    return [set(row.topk(top_k).indices.tolist()) for row in logits.view(len(tokens), -1)]


def routed_prompts(model) -> list[list[int]]:
    """One-token prompts two of which route to disjoint experts and two to overlapping (not
    equal) ones in the first sparse layer, then longer prompts (one longer than a chunk)."""
    candidates = list(range(3, 120))
    experts = first_layer_experts(model, candidates)
    disjoint = next((a, b) for a in range(len(candidates)) for b in range(a + 1, len(candidates))
                    if not experts[a] & experts[b])
    overlap = next((a, b) for a in range(len(candidates)) for b in range(a + 1, len(candidates))
                   if experts[a] & experts[b] and experts[a] != experts[b] and {a, b}.isdisjoint(disjoint))
    singles = [[candidates[i]] for i in (*disjoint, *overlap)]
    return singles + [[5, 17, 42, 9, 100, 3, 7], list(range(30, 52)), [200, 201, 202, 7, 7, 7]]


@pytest.fixture(scope="module")
def greedy_reference(model_dirs) -> dict[str, tuple[list[list[int]], list[list[int]]]]:
    """Per family: the routed prompts and transformers' greedy tokens for each."""
    from transformers import AutoModelForCausalLM

    out = {}
    for name in ("qwen3", "qwen3-moe", "mixtral"):
        model = AutoModelForCausalLM.from_pretrained(model_dirs[name], dtype=torch.float32).eval()
        if name == "qwen3":
            prompts = [[3], [4], [5], [6], [5, 17, 42, 9, 100, 3, 7], list(range(30, 52)), [200, 201, 202, 7, 7, 7]]
        else:
            prompts = routed_prompts(model)
            sets = first_layer_experts(model, [p[0] for p in prompts[:4]])
            assert not sets[0] & sets[1] and sets[2] & sets[3] and sets[2] != sets[3]
        out[name] = (prompts, [hf_greedy_tokens(model, p, MAX_TOKENS) for p in prompts])
    return out


# Each family runs at pp 1, 2 and 3, on every executor and both runners; chunked prefill
# (8-token chunks, the 22-token prompt in three) and preemption (a cache of 6 blocks of 8, one the null block,
# tokens for 7 requests needing 15) are spread over them.
ENGINE_CASES = [
    ("qwen3", "uni", 1, "v1", {}),
    ("qwen3", "mp", 2, "v2", {"chunked": True}),
    ("qwen3", "ray", 3, "v1", {"preempt": True}),
    ("qwen3-moe", "uni", 1, "v2", {"chunked": True, "preempt": True}),
    ("qwen3-moe", "mp", 3, "v1", {"chunked": True}),
    ("qwen3-moe", "ray", 2, "v2", {}),
    ("mixtral", "uni", 1, "v1", {"preempt": True}),
    ("mixtral", "mp", 2, "v1", {}),
    ("mixtral", "ray", 3, "v2", {"chunked": True}),
]


@pytest.mark.parametrize("name, executor, pp, runner, mix", ENGINE_CASES,
                         ids=[f"{c[0]}-{c[1]}-pp{c[2]}-{c[3]}" for c in ENGINE_CASES])
def test_engine_greedy_matches_transformers(model_dirs, greedy_reference, request, name, executor, pp, runner, mix):
    from pprun.worker.kv_cache import bytes_per_block

    if executor == "ray":
        request.getfixturevalue("ray_cluster")
    if executor == "mp" and name != "qwen3":  # qwen3's mp stages start fresh; the others fork theirs
        fork_mp_stages(request)
    prompts, want = greedy_reference[name]
    kwargs: dict = {}
    if mix.get("chunked"):
        kwargs["max_num_batched_tokens"] = 8
    if mix.get("preempt"):
        arch = load_arch_config(model_dirs[name])
        most_layers = max(even_partition(arch.num_hidden_layers, pp))
        kwargs["block_size"] = 8
        kwargs["kv_cache_memory_bytes"] = 6 * bytes_per_block(arch, most_layers, 8, torch.float32)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    with LLM(str(model_dirs[name]), dtype="float32", executor=executor, pipeline_parallel_size=pp,
             runner=runner, max_model_len=40, **kwargs) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        preemptions = llm.engine.num_preemptions
    assert [o.outputs[0].token_ids for o in outs] == want
    if mix.get("preempt"):
        assert preemptions > 0


# --- on CUDA: the fused path (grouped expert kernels, head norm) and full CUDA graphs ---------


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["qwen3", "qwen3-moe", "mixtral"])
@pytest.mark.parametrize("prompts", [[[42]], [[42, 7, 9], [13, 5], [8]], PROMPTS], ids=["one_row", "six_rows", "prefill"])
def test_fused_path_matches_torch_path_on_cuda(monkeypatch, switch, model_dirs, name, prompts):
    """A whole fp32 model on CUDA, fused ops on vs off: the head norm and the grouped expert
    kernels run once per layer (per sparse layer) on the fused path and the logits agree.  fp32
    only: in bf16 the two paths' roundings may flip a near-tie in some token's top-k, which
    changes that token's output by design (the kernels' bf16 arithmetic is checked against
    the reference loop on one routing in test_moe_kernels.py)."""
    dtype = torch.float32
    from test_fused_ops import _tiny_llama_on_cuda

    from pprun.layers import head_norm, moe_triton

    arch, model_logits = _tiny_llama_on_cuda(model_dirs[name], dtype, prompts)
    calls = {"head_norm": 0, "experts": 0}

    def counted(key, fn):
        def wrapper(*args, **kwargs):
            calls[key] += 1
            return fn(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(head_norm, "head_rms_norm_", counted("head_norm", head_norm.head_rms_norm_))
    monkeypatch.setattr(moe_triton, "fused_experts", counted("experts", moe_triton.fused_experts))
    switch("PPRUN_DISABLE_FUSED", False)
    want = model_logits()
    assert calls == {"head_norm": 0, "experts": 0}
    switch("PPRUN_DISABLE_FUSED", True)
    got = model_logits()
    num_sparse = sum(arch.moe.is_sparse(i) for i in range(arch.num_hidden_layers)) if arch.moe else 0
    assert calls == {"head_norm": arch.num_hidden_layers if arch.qk_norm else 0, "experts": num_sparse}
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["qwen3", "qwen3-moe", "mixtral"])
def test_full_cuda_graphs_match_transformers(model_dirs, greedy_reference, name):
    """V2 with full decode graphs on one GPU (the grouped expert kernels captured, replayed for
    every step's routing): transformers' greedy tokens."""
    prompts, want = greedy_reference[name]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    with LLM(str(model_dirs[name]), dtype="float32", device="cuda", runner="v2", cudagraph_mode="full",
             executor="uni", max_model_len=40, max_num_seqs=8) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts * 2], params)
    assert [o.outputs[0].token_ids for o in outs] == want * 2


# --- scripts/make_random_model.py --------------------------------------------------------------


def _load_maker():
    import importlib.util

    path = Path(__file__).resolve().parent.parent / "scripts" / "make_random_model.py"
    spec = importlib.util.spec_from_file_location("make_random_model", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_random_model_presets_are_the_published_shapes():
    """Qwen3-30B-A3B and Qwen3-8B as published (``--num-layers`` overrides the depth)."""
    maker = _load_maker()
    a3b = maker.parse_args(["out", "--preset", "qwen3-30b-a3b"])
    assert (a3b.arch, a3b.hidden, a3b.layers, a3b.experts, a3b.top_k, a3b.expert_intermediate) == (
        "qwen3-moe", 2048, 48, 128, 8, 768)
    assert (a3b.heads, a3b.kv_heads, a3b.head_dim, a3b.vocab) == (32, 4, 128, 151936)
    assert maker.parse_args(["out", "--preset", "qwen3-30b-a3b", "--num-layers", "24"]).layers == 24
    dense = maker.parse_args(["out", "--preset", "qwen3-8b"])
    assert (dense.arch, dense.hidden, dense.layers, dense.intermediate, dense.kv_heads) == ("qwen3", 4096, 36, 12288, 8)
    with pytest.raises(SystemExit):
        maker.parse_args(["out", "--preset", "mixtral-8x7b", "--top-k", "9"])


@pytest.mark.parametrize("preset", ["qwen3-30b-a3b", "qwen3-8b", "mixtral-8x7b"])
def test_random_model_script_writes_what_transformers_and_pprun_load_alike(tmp_path, preset):
    """A narrow copy of each preset, sharded: transformers loads it as its architecture and pprun's
    stages (pp 2) give its logits."""
    from transformers import AutoModelForCausalLM

    out = tmp_path / preset
    info = _load_maker().main([str(out), "--preset", preset, "--num-layers", "2", "--hidden", "64", "--heads", "4",
                               "--kv-heads", "2", "--head-dim", "16", "--intermediate", "48", "--expert-intermediate",
                               "32", "--experts", "9", "--top-k", "3", "--vocab", "300", "--dtype", "float32", "--shard-gb", "0.0002"])
    assert info["files"] > 1 and (out / "model.safetensors.index.json").is_file()
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(model).__name__ == load_arch_config(out).architecture == info["architecture"]
    prompts = [[5, 6, 7, 8], [9]]
    with torch.no_grad():
        ref = torch.stack([model(torch.tensor([p])).logits[0, -1] for p in prompts])
    torch.testing.assert_close(run_stages(out, 2, prompts), ref, atol=1e-4, rtol=1e-4)
