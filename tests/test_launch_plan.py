"""The kernels a Llama decode step launches where the fused ops run (each block's
``forward_fused`` in ``pprun.models.llama``), in order, with the settings each matmul is given
(``weights_ahead``, ``defer_merge``, ``hold_last``, the SwiGLU form) and whether a norm reads
split partials: the sequences the model's CUDA path must keep launching.  Runs on CUDA,
or on CPU under the Triton interpreter with the fused path taken for CPU tensors::

    pytest tests/test_launch_plan.py
"""

from __future__ import annotations

import pytest
import torch
from triton_env import DEVICE, HAS_CUDA, triton_only  # noqa: E402  (sets TRITON_INTERPRET)

import pprun.layers
from pprun.attention.backend import reference_backend
from pprun.attention.metadata import AttentionMetadata
from pprun.distributed.intermediate import IntermediateTensors
from pprun.distributed.layout import StageLayout
from pprun.layers import SplitPartials
from pprun.models.hf_config import load_arch_config
from pprun.worker.kv_cache import allocate_kv_caches
from pprun.worker.model_loader import load_stage_model

BLOCK = 4


@pytest.fixture
def launches(monkeypatch):
    """The fused path on this device (CPU: the interpreter), and the list of launches it records:
    ``(op, weight name or None, settings)`` per call of the kernels' host functions."""
    from pprun.layers import fused, skinny

    if not HAS_CUDA:
        monkeypatch.setattr(pprun.layers, "fused_ops_for",
                            lambda t: pprun.layers._load_fused() if pprun.layers.FUSED_ENABLED else None)
    seen: list[tuple[str, str | None, dict]] = []
    names: dict[int, str] = {}

    def record(module, fn_name, weight_at, keys):
        real = getattr(module, fn_name)

        def wrapper(*args, **kwargs):
            weight = args[weight_at] if weight_at is not None else None
            settings = {k: kwargs.get(k) for k in keys}
            if fn_name == "fused_add_rms_norm":
                settings["partials"] = isinstance(args[0], SplitPartials)
            seen.append((fn_name, names.get(weight.data_ptr()) if weight is not None else None, settings))
            return real(*args, **kwargs)

        monkeypatch.setattr(module, fn_name, wrapper)

    record(skinny, "skinny_linear", 1, ("weights_ahead", "defer_merge", "hold_last", "swiglu"))
    record(skinny, "skinny_norm_linear", 4, ("swiglu",))
    record(fused, "fused_add_rms_norm", 2, ())
    record(fused, "rotary_qk", None, ())
    record(fused, "silu_and_mul", None, ())
    return seen, names


def _decode_step(model_dir, partition, rank, num_reqs, names):
    """One decode step (one token per request, contexts of 5 tokens) of a bf16 stage."""
    arch = load_arch_config(model_dir)
    layout = StageLayout.from_partition(partition, rank)
    device = torch.device(DEVICE)
    model = load_stage_model(model_dir, arch, layout, device=device, dtype=torch.bfloat16, max_positions=64,
                             attn_backend=reference_backend)
    names.update({p.data_ptr(): n for n, p in model.named_parameters()})
    ctx, blocks = 5, 2
    i32 = {"dtype": torch.int32, "device": device}
    meta = AttentionMetadata(
        num_reqs=num_reqs, num_reqs_padded=num_reqs, num_tokens=num_reqs, num_tokens_padded=num_reqs,
        max_query_len=1, query_start_loc=torch.arange(num_reqs + 1, **i32),
        seq_lens=torch.full((num_reqs,), ctx, **i32),
        block_table=torch.arange(1, 1 + num_reqs * blocks, **i32).view(num_reqs, blocks),
        slot_mapping=torch.tensor([(1 + r * blocks) * BLOCK + ctx - 1 for r in range(num_reqs)],
                                  dtype=torch.int64, device=device),
    )
    model.bind_kv_caches(allocate_kv_caches(arch, layout.num_layers, 1 + num_reqs * blocks, BLOCK,
                                            torch.bfloat16, device))
    positions = torch.full((num_reqs,), ctx - 1, device=device)
    with torch.inference_mode():
        if layout.is_first:
            out = model(torch.arange(3, 3 + num_reqs, device=device), positions, None, None, meta)
        else:
            hidden = torch.randn(num_reqs, arch.hidden_size, device=device).bfloat16()
            out = model(None, positions, None, IntermediateTensors({"hidden_states": hidden}), meta)
        if layout.is_last:
            model.compute_logits(out)


def _matmul(weight, ahead=False, defer=None, hold=True):
    return ("skinny_linear", weight, {"weights_ahead": ahead, "defer_merge": defer, "hold_last": hold,
                                      "swiglu": None})


def _gate_up(i):
    return ("skinny_linear", f"layers.{i}.mlp.gate_up_proj.weight",
            {"weights_ahead": None, "defer_merge": None, "hold_last": None, "swiglu": True})


def _norm(weight, partials):
    return ("fused_add_rms_norm", weight, {"partials": partials})


ROTARY = ("rotary_qk", None, {})


def _one_row_layer(i):
    """A layer at one row: each norm folded into the matmul after it, nothing deferred."""
    p = f"layers.{i}"
    return [
        ("skinny_norm_linear", f"{p}.self_attn.qkv_proj.weight", {"swiglu": False}),
        ROTARY,
        _matmul(f"{p}.self_attn.o_proj.weight", ahead=True),
        ("skinny_norm_linear", f"{p}.mlp.gate_up_proj.weight", {"swiglu": True}),
        _matmul(f"{p}.mlp.down_proj.weight"),
    ]


def _rows_layer(i, first_of_stage, last_before_send=False):
    """A layer above one row: the norms on their own, o_proj's and down's partials left to the
    norm after them (not down's where the stage sends its output on)."""
    p = f"layers.{i}"
    return [
        _norm(f"{p}.input_layernorm.weight", partials=not first_of_stage),
        _matmul(f"{p}.self_attn.qkv_proj.weight", ahead=True),
        ROTARY,
        _matmul(f"{p}.self_attn.o_proj.weight", ahead=True, defer="norm"),
        _norm(f"{p}.post_attention_layernorm.weight", partials=True),
        _gate_up(i),
        _matmul(f"{p}.mlp.down_proj.weight", defer=None if last_before_send else "norm"),
    ]


@triton_only
def test_one_row_decode_step_launches(tmp_path, launches):
    from tiny_models import make_tiny_llama

    seen, names = launches
    model_dir = make_tiny_llama(tmp_path / "m", num_layers=2, hidden_size=256, intermediate_size=1024)
    _decode_step(model_dir, [2], 0, 1, names)
    head = [_norm("norm.weight", partials=False), _matmul("lm_head.weight")]
    assert seen == _one_row_layer(0) + _one_row_layer(1) + head


@triton_only
def test_three_row_decode_step_launches(tmp_path, launches):
    from tiny_models import make_tiny_llama

    seen, names = launches
    model_dir = make_tiny_llama(tmp_path / "m", num_layers=2, hidden_size=256, intermediate_size=1024)
    _decode_step(model_dir, [2], 0, 3, names)
    head = [_norm("norm.weight", partials=True), _matmul("lm_head.weight")]
    assert seen == _rows_layer(0, True) + _rows_layer(1, False) + head
    seen.clear()
    # The first of two stages: its last layer's output is sent on, so down merges its own partials.
    _decode_step(model_dir, [1, 1], 0, 3, names)
    assert seen == _rows_layer(0, True, last_before_send=True)
