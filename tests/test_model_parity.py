"""Parity of pprun's Llama-family model with transformers, assembled from 1-4 stage pieces."""

from __future__ import annotations

import pytest
import torch
from tiny_models import make_tiny_llama, make_tiny_qwen2

from pprun.attention.backend import reference_backend
from pprun.attention.metadata import AttentionMetadata
from pprun.config.validate import even_partition
from pprun.distributed.intermediate import IntermediateTensors
from pprun.distributed.layout import StageLayout
from pprun.models.hf_config import load_arch_config
from pprun.worker.kv_cache import allocate_kv_caches
from pprun.worker.model_loader import load_stage_model

BLOCK = 4


def prefill_batch(prompts: list[list[int]]):
    """Flattened ids/positions and metadata for a prefill of every prompt from scratch."""
    ids, pos, slots, starts, table = [], [], [], [0], []
    next_block = 1  # block 0 is the null block
    max_blocks = max((len(p) + BLOCK - 1) // BLOCK for p in prompts)
    for p in prompts:
        nb = (len(p) + BLOCK - 1) // BLOCK
        blocks = list(range(next_block, next_block + nb))
        next_block += nb
        ids += p
        pos += list(range(len(p)))
        slots += [blocks[i // BLOCK] * BLOCK + i % BLOCK for i in range(len(p))]
        starts.append(starts[-1] + len(p))
        table.append(blocks + [0] * (max_blocks - nb))
    meta = AttentionMetadata(
        num_reqs=len(prompts),
        num_reqs_padded=len(prompts),
        num_tokens=len(ids),
        num_tokens_padded=len(ids),
        max_query_len=max(len(p) for p in prompts),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor([len(p) for p in prompts], dtype=torch.int32),
        block_table=torch.tensor(table, dtype=torch.int32),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
    )
    return torch.tensor(ids), torch.tensor(pos), meta, next_block


@torch.inference_mode()
def run_stages(model_dir, pp: int, prompts: list[list[int]]) -> torch.Tensor:
    """Chain the stage models by hand; returns last-token logits of each prompt."""
    arch = load_arch_config(model_dir)
    ids, pos, meta, num_blocks = prefill_batch(prompts)
    partition = even_partition(arch.num_hidden_layers, pp)
    it = None
    for rank in range(pp):
        layout = StageLayout.from_partition(partition, rank)
        model = load_stage_model(
            model_dir, arch, layout, device=torch.device("cpu"), dtype=torch.float32,
            max_positions=256, attn_backend=reference_backend,
        )
        model.bind_kv_caches(allocate_kv_caches(arch, layout.num_layers, num_blocks, BLOCK, torch.float32, torch.device("cpu")))
        out = model(
            input_ids=ids if layout.is_first else None,
            positions=pos,
            inputs_embeds=None,
            intermediate_tensors=it,
            attn_metadata=meta,
        )
        if layout.is_last:
            last = meta.query_start_loc[1:].long() - 1
            return model.compute_logits(out[last])
        assert isinstance(out, IntermediateTensors)
        # Copy like the transport does, so no stage shares storage with another.
        it = IntermediateTensors({k: v.clone() for k, v in out.items()})
    raise AssertionError("unreachable")


def hf_last_logits(model_dir, prompts: list[list[int]]) -> torch.Tensor:
    """transformers' logits at each prompt's last token (one prompt at a time: no padding)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    rows = []
    with torch.no_grad():
        for p in prompts:
            rows.append(model(torch.tensor([p])).logits[0, -1])
    return torch.stack(rows)


PROMPTS = [[5, 17, 42, 9, 100, 3, 7], [11], [200, 201, 202, 7, 7, 7, 7, 7, 7, 13, 14], [1, 2, 3, 4]]

CASES = {
    "llama-untied": dict(kind="llama"),
    "llama-tied": dict(kind="llama", tied=True),
    "llama-rope-llama3": dict(
        kind="llama",
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8},
    ),
    "llama-rope-linear": dict(kind="llama", tied=True, rope_scaling={"rope_type": "linear", "factor": 2.0}),
    "qwen2": dict(kind="qwen2"),
}


@pytest.fixture(scope="module", params=list(CASES))
def model_dir(request, tmp_path_factory):
    spec = dict(CASES[request.param])
    kind = spec.pop("kind")
    path = tmp_path_factory.mktemp(request.param)
    if kind == "qwen2":
        return make_tiny_qwen2(path, num_layers=4)
    return make_tiny_llama(path, num_layers=4, **spec)


@pytest.mark.parametrize("pp", [1, 2, 3, 4])
def test_stage_pieces_match_transformers(model_dir, pp):
    ours = run_stages(model_dir, pp, PROMPTS)
    ref = hf_last_logits(model_dir, PROMPTS)
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)


def test_stage_owns_only_its_tensors(tmp_path):
    path = make_tiny_llama(tmp_path / "m", tied=True, num_layers=4)
    arch = load_arch_config(path)
    partition = even_partition(4, 2)
    names = []
    for rank in range(2):
        layout = StageLayout.from_partition(partition, rank)
        model = load_stage_model(path, arch, layout, device=torch.device("cpu"), dtype=torch.float32,
                                 max_positions=64, attn_backend=reference_backend)
        names.append(set(model.checkpoint_names()))
        assert len(model.layers) == layout.num_layers
        assert (model.embed_tokens is not None) == layout.is_first
        assert (model.lm_head is not None) == layout.is_last
    assert not any(n.startswith(f"model.layers.{i}.") for n in names[0] for i in (2, 3))
    assert not any(n.startswith(f"model.layers.{i}.") for n in names[1] for i in (0, 1))
    # The tied embedding is read by both ends; everything else by exactly one stage.
    assert names[0] & names[1] == {"model.embed_tokens.weight"}


# Measured on the demo model (CPU): fp32 max |diff| 4.6e-5, bf16 0.625 on logits up to ~34
# (bf16 keeps ~3 significant digits: an ulp there is 0.125-0.25). Both pick the same tokens.
DEMO_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 1.0}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_demo_model_logits_per_dtype(demo_model_dir, dtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(demo_model_dir)
    texts = ["The capital of France is", "def fibonacci(n):", "Once upon a time in a small village there lived"]
    prompts = [tok.encode(t) for t in texts]
    arch = load_arch_config(demo_model_dir)
    ids, pos, meta, num_blocks = prefill_batch(prompts)
    model = load_stage_model(demo_model_dir, arch, StageLayout.single(arch.num_hidden_layers),
                             device=torch.device("cpu"), dtype=dtype, max_positions=256,
                             attn_backend=reference_backend)
    model.bind_kv_caches(allocate_kv_caches(arch, arch.num_hidden_layers, num_blocks, BLOCK, dtype, torch.device("cpu")))
    with torch.inference_mode():
        h = model(input_ids=ids, positions=pos, inputs_embeds=None, intermediate_tensors=None, attn_metadata=meta)
        ours = model.compute_logits(h[meta.query_start_loc[1:].long() - 1]).float()
    hf = AutoModelForCausalLM.from_pretrained(demo_model_dir, dtype=dtype).eval()
    with torch.no_grad():
        ref = torch.stack([hf(torch.tensor([p])).logits[0, -1].float() for p in prompts])
    assert (ours - ref).abs().max().item() <= DEMO_TOLERANCE[dtype]
    assert ours.argmax(-1).tolist() == ref.argmax(-1).tolist()


def test_allocate_keeps_shared_tensors_and_casts_only_floating_ones():
    """``allocate`` is ``to_empty(device).to(dtype)``: tensors shared between submodules stay
    shared, floating ones take the dtype, integer buffers keep theirs."""
    from torch import nn

    from pprun.models.base import allocate

    with torch.device("meta"):
        first, second = nn.Linear(4, 4), nn.Linear(4, 4, bias=False)
        second.weight = first.weight
        module = nn.Sequential(first, second)
        module.register_buffer("steps", torch.zeros(2, dtype=torch.int64))
    allocate(module, "cpu", torch.bfloat16)
    assert module[0].weight is module[1].weight
    assert module[0].weight.device.type == "cpu" and module[0].weight.dtype == torch.bfloat16
    assert module[0].bias.dtype == torch.bfloat16 and module.steps.dtype == torch.int64
    assert all(not t.is_meta for t in [*module.parameters(), *module.buffers()])


def test_building_a_stage_imports_neither_sympy_nor_dynamo(tiny_llama_dir):
    """A stage is built and loaded through torch's C++ kernels: no ``to_empty`` (its
    ``empty_like`` of a meta tensor runs a Python reference kernel that imports sympy) and no
    random draw for embeddings (its meta kernel imports torch._dynamo), each a second or more of
    every stage's start-up on CPU (docs/performance.md, "Start-up")."""
    import subprocess
    import sys

    code = f"""
import sys, torch
from pprun.attention.backend import reference_backend
from pprun.distributed.layout import StageLayout
from pprun.models.hf_config import load_arch_config
from pprun.worker.model_loader import load_stage_model
arch = load_arch_config({str(tiny_llama_dir)!r})
for rank in (0, 1):
    load_stage_model({str(tiny_llama_dir)!r}, arch, StageLayout.from_partition([2, 2], rank), device=torch.device("cpu"),
                     dtype=torch.float32, max_positions=64, attn_backend=reference_backend)
print(sorted(m for m in ("sympy", "torch._dynamo") if m in sys.modules))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]"
