"""The fused Triton ops (add+RMSNorm, RoPE, SiLU-and-mul) against the torch code in llama.py.

The reference is the model's own torch path (``RMSNorm``, ``RotaryEmbedding`` with fusion off,
``F.silu(gate) * up`` as ``MLP.forward`` writes it).  The kernel tests run on CUDA, or on CPU
under the Triton interpreter, the default without CUDA (shapes stay tiny)::

    pytest tests/test_fused_ops.py

The interpreter truncates fp32->bf16 casts instead of rounding to nearest even, so there bf16
is only checked to a tolerance; on CUDA bf16 norm and SiLU-and-mul must also be (almost
always) bit-identical to torch.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from triton_env import DEVICE, HAS_CUDA, count_calls_by_form, triton_only  # noqa: E402  (sets TRITON_INTERPRET)

from pprun.models.hf_config import load_arch_config
from pprun.models.llama import RMSNorm, RotaryEmbedding

# bf16: one ulp is 2**-8..2**-7 relative.  The interpreter truncates at each of up to three
# fp32->bf16 roundings, so it may land up to three ulps away.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2 if HAS_CUDA else 3e-2}


@pytest.fixture
def torch_path(switch):
    """Force llama.py's plain torch code even for CUDA tensors (the reference)."""
    switch("PPRUN_DISABLE_FUSED", False)


def assert_matches(actual: torch.Tensor, expected: torch.Tensor, *, bit_exact_on_cuda: bool) -> None:
    """Within the dtype's tolerance; on CUDA bf16, also at most one ulp off and nearly all equal."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    tol = TOLERANCE[expected.dtype]
    torch.testing.assert_close(actual, expected, rtol=tol, atol=tol)
    if bit_exact_on_cuda and HAS_CUDA and expected.dtype == torch.bfloat16:
        # Same rounding steps as torch; only fp32 sum order / exp / rsqrt last bits may differ.
        ulp_gap = (actual.view(torch.int16).int() - expected.view(torch.int16).int()).abs()
        assert ulp_gap.max().item() <= 1
        assert (ulp_gap == 0).float().mean().item() >= 0.99


@triton_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden", [64, 80])
@pytest.mark.parametrize("with_residual", [False, True])
def test_fused_add_rms_norm(torch_path, dtype, hidden, with_residual):
    from pprun.layers.fused import fused_add_rms_norm

    torch.manual_seed(0)
    norm = RMSNorm(hidden, eps=1e-5).to(device=DEVICE, dtype=dtype)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    # x is a strided view (every other row of a wider buffer), as a row slice would be.
    x = (torch.randn(5, 2 * hidden, device=DEVICE) * 3).to(dtype)[:, :hidden]
    residual = torch.randn(5, hidden, device=DEVICE).to(dtype) if with_residual else None
    with torch.no_grad():
        want_out, want_res = norm(x, residual)
        got_out, got_res = fused_add_rms_norm(x, residual, norm.weight, norm.eps)
    assert_matches(got_out, want_out, bit_exact_on_cuda=True)
    if with_residual:
        if HAS_CUDA or dtype == torch.float32:
            assert torch.equal(got_res, want_res)  # one add, rounded once like torch's
        else:
            assert_matches(got_res, want_res, bit_exact_on_cuda=True)  # interpreter truncates
    else:
        assert got_res is x


@triton_only
def test_fused_add_rms_norm_rejects_bad_weight():
    from pprun.layers.fused import fused_add_rms_norm

    x = torch.randn(2, 16, device=DEVICE)
    with pytest.raises(ValueError, match="weight"):
        fused_add_rms_norm(x, None, torch.ones(8, device=DEVICE), 1e-6)


@triton_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim,rope_scaling",
    [
        (4, 2, 16, None),
        # Odd head counts make a head group straddle q and k; half = 10 is not a power of two.
        (
            3,
            1,
            20,
            {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        ),
    ],
)
def test_rotary_qk_in_place_on_qkv_views(
    torch_path, tiny_llama_dir, dtype, num_heads, num_kv_heads, head_dim, rope_scaling
):
    from pprun.layers.fused import rotary_qk

    arch = dataclasses.replace(
        load_arch_config(tiny_llama_dir),
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        rope_scaling=rope_scaling,
    )
    rotary = RotaryEmbedding(arch, max_positions=128, device=torch.device(DEVICE))
    num_tokens = 6
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    torch.manual_seed(0)
    qkv = torch.randn(num_tokens, q_size + 2 * kv_size, device=DEVICE).to(dtype)
    positions = torch.tensor([0, 1, 2, 37, 90, 127], device=DEVICE)
    # Exactly what Attention.forward hands the rotary: strided views of the qkv output.
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q = q.view(num_tokens, num_heads, head_dim)
    k = k.view(num_tokens, num_kv_heads, head_dim)
    want_q, want_k = rotary(positions, q, k)
    v_before = v.clone()

    got_q, got_k = rotary_qk(q, k, rotary.cos, rotary.sin, positions)
    assert got_q.data_ptr() == q.data_ptr() and got_k.data_ptr() == k.data_ptr()
    assert_matches(got_q, want_q, bit_exact_on_cuda=False)
    assert_matches(got_k, want_k, bit_exact_on_cuda=False)
    assert torch.equal(v, v_before)  # in place on q and k only


@triton_only
def test_rotary_qk_rejects_odd_head_dim():
    from pprun.layers.fused import rotary_qk

    q = torch.randn(2, 2, 5, device=DEVICE)
    table = torch.randn(8, 5, device=DEVICE)
    with pytest.raises(ValueError, match="head_dim"):
        rotary_qk(q, q.clone(), table, table, torch.zeros(2, dtype=torch.long, device=DEVICE))


@triton_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("inter", [48, 1536])  # 1536: several column blocks, a ragged last one
def test_silu_and_mul(dtype, inter):
    from pprun.layers.fused import silu_and_mul

    torch.manual_seed(0)
    gate_up = (torch.randn(3, 2 * inter, device=DEVICE) * 4).to(dtype)
    gate, up = gate_up.split(inter, dim=-1)
    want = F.silu(gate) * up  # as MLP.forward writes it
    assert_matches(silu_and_mul(gate_up), want, bit_exact_on_cuda=True)


def _tiny_llama_on_cuda(tiny_llama_dir, dtype: torch.dtype, prompts: list[list[int]], backend: str = "reference"):
    """The tiny model on CUDA with the reference attention (or ``backend``), and ``logits()`` of
    one prefill step over ``prompts`` (fresh KV caches each call)."""
    from test_model_parity import BLOCK, prefill_batch

    from pprun.attention.backend import get_backend
    from pprun.distributed.layout import StageLayout
    from pprun.worker.kv_cache import allocate_kv_caches
    from pprun.worker.model_loader import load_stage_model

    device = torch.device("cuda")
    arch = load_arch_config(tiny_llama_dir)
    ids, pos, meta, num_blocks = prefill_batch(prompts)
    meta = dataclasses.replace(
        meta,
        **{
            f.name: getattr(meta, f.name).to(device)
            for f in dataclasses.fields(meta)
            if isinstance(getattr(meta, f.name), torch.Tensor)
        },
    )
    layout = StageLayout.from_partition([arch.num_hidden_layers], 0)
    model = load_stage_model(
        tiny_llama_dir, arch, layout, device=device, dtype=dtype, max_positions=256,
        attn_backend=get_backend(backend, device),
    )

    def logits() -> torch.Tensor:
        model.bind_kv_caches(allocate_kv_caches(arch, layout.num_layers, num_blocks, BLOCK, dtype, device))
        with torch.inference_mode():
            h = model(ids.to(device), pos.to(device), None, None, meta)
            return model.compute_logits(h).float()

    return arch, logits


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiny_llama_fused_matches_torch_path(monkeypatch, switch, tiny_llama_dir, dtype):
    """A whole model on CUDA: fused ops on vs off (reference attention both times)."""
    from pprun.layers import fused

    arch, model_logits = _tiny_llama_on_cuda(tiny_llama_dir, dtype, [[5, 9, 3, 200, 17, 42, 8], [1, 2, 3]])
    # The elementwise kernels only: decode-sized matmuls keep cuBLAS (and silu_and_mul) here.
    switch("PPRUN_DISABLE_SKINNY_GEMM", False)
    calls = {"norm": 0, "rotary": 0, "silu": 0}

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(fused, "fused_add_rms_norm", counted("norm", fused.fused_add_rms_norm))
    monkeypatch.setattr(fused, "rotary_qk", counted("rotary", fused.rotary_qk))
    monkeypatch.setattr(fused, "silu_and_mul", counted("silu", fused.silu_and_mul))

    def logits(enabled: bool) -> torch.Tensor:
        switch("PPRUN_DISABLE_FUSED", enabled)
        return model_logits()

    want = logits(False)
    assert calls == {"norm": 0, "rotary": 0, "silu": 0}
    got = logits(True)
    num_layers = arch.num_hidden_layers
    assert calls == {"norm": 2 * num_layers + 1, "rotary": num_layers, "silu": num_layers}
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


@pytest.mark.gpu
@pytest.mark.parametrize("prompts", [[[42]], [[42, 7, 9], [13, 5], [8]]], ids=["one_row", "six_rows"])
def test_tiny_llama_skinny_matmuls_match_cublas(monkeypatch, switch, tiny_llama_dir, prompts):
    """A whole bf16 model on CUDA with a batch of a few tokens: split-K matmuls (SwiGLU folded
    into gate_up; the swapped form above one row) vs cuBLAS + silu_and_mul."""
    from pprun.layers import skinny

    # At most DISPATCH_MAX_M tokens: what pprun.layers.linear sends to the split-K kernels.
    arch, model_logits = _tiny_llama_on_cuda(tiny_llama_dir, torch.bfloat16, prompts)
    calls = count_calls_by_form(monkeypatch, skinny, "skinny_linear")
    # Every matmul through skinny_linear (the norm fold's kernel is tested in test_norm_linear.py,
    # and with it on below).
    switch("PPRUN_DISABLE_NORM_FOLD", False)

    def logits(enabled: bool) -> torch.Tensor:
        switch("PPRUN_DISABLE_SKINNY_GEMM", enabled)
        return model_logits()

    want = logits(False)
    assert calls == {"plain": 0, "swiglu": 0}
    got = logits(True)
    num_layers = arch.num_hidden_layers
    # qkv, o_proj and down per layer plus the LM head; gate_up with its activation.
    assert calls == {"plain": 3 * num_layers + 1, "swiglu": num_layers}
    torch.testing.assert_close(got, want, rtol=3e-2, atol=3e-2)


@pytest.mark.gpu
def test_tiny_llama_norm_fold_matches_separate_norms(monkeypatch, switch, tiny_llama_dir):
    """A whole bf16 model on CUDA with a one-token batch: add + RMSNorm folded into the qkv and
    gate_up split-K matmuls vs the norms as their own launches.  The folded launches are counted
    (``skinny.skinny_norm_linear``): none with the fold off, qkv and gate_up of every layer with
    it on, so the comparison is of two paths, not of one with itself."""
    from pprun.layers import skinny

    arch, model_logits = _tiny_llama_on_cuda(tiny_llama_dir, torch.bfloat16, [[42]])
    calls = count_calls_by_form(monkeypatch, skinny, "skinny_norm_linear")
    # The split-K matmuls the fold lives in (they take one row; merges never deferred at one row).
    switch("PPRUN_DISABLE_SKINNY_GEMM", True)

    def logits(enabled: bool) -> torch.Tensor:
        switch("PPRUN_DISABLE_NORM_FOLD", enabled)
        return model_logits()

    want = logits(False)
    assert calls == {"plain": 0, "swiglu": 0}
    got = logits(True)
    num_layers = arch.num_hidden_layers
    # qkv after input_layernorm; gate_up (with its SwiGLU) after post_attention_layernorm.
    assert calls == {"plain": num_layers, "swiglu": num_layers}
    torch.testing.assert_close(got, want, rtol=3e-2, atol=3e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_tiny_llama_deferred_merges_match_in_kernel_merges(monkeypatch, switch, tmp_path, backend):
    """A whole bf16 model on CUDA, three one-token requests: o_proj's and down's split-K
    partials merged by the next norm's kernel (and with the Triton backend's one-kernel decode,
    qkv's by the attention kernel) give the logits of the matmuls merging them, bit for bit (a
    model wide enough for their K to be split: hidden 256, intermediate 1024).  The split counts
    and the norm's warps are pinned to the in-kernel merge's, so that where the merge runs is
    all that changes (those settings change fp32 sum orders, as any launch setting does)."""
    from tiny_models import make_tiny_llama

    from pprun.layers import SplitPartials, fused, skinny

    monkeypatch.setattr(fused, "NORM_PARTS_NUM_WARPS", 4)
    monkeypatch.setattr(skinny, "DEFERRED_TARGET_PROGRAMS", skinny.SWAPPED_TARGET_PROGRAMS)

    model_dir = make_tiny_llama(tmp_path / "wide", num_layers=2, hidden_size=256, intermediate_size=1024)
    arch, model_logits = _tiny_llama_on_cuda(model_dir, torch.bfloat16, [[42], [7], [9]], backend)
    seen = []
    real_norm = fused.fused_add_rms_norm

    def spy(x, *args, **kwargs):
        seen.append(isinstance(x, SplitPartials))
        return real_norm(x, *args, **kwargs)

    monkeypatch.setattr(fused, "fused_add_rms_norm", spy)
    from pprun.attention import triton_ops

    qkv_parts = []
    real_decode = triton_ops.paged_decode_attention_rope

    def spy_decode(*args, **kwargs):
        qkv_parts.append(kwargs.get("qkv_parts") is not None)
        return real_decode(*args, **kwargs)

    monkeypatch.setattr(triton_ops, "paged_decode_attention_rope", spy_decode)
    switch("PPRUN_DISABLE_DEFER_MERGE", False)
    want = model_logits()
    assert not any(seen) and not any(qkv_parts)
    seen.clear()
    qkv_parts.clear()
    switch("PPRUN_DISABLE_DEFER_MERGE", True)
    got = model_logits()
    # Every norm after the first layer's input norm takes partials: 2 per layer - 1, plus the final one.
    assert sum(seen) == 2 * arch.num_hidden_layers
    assert qkv_parts == ([True] * arch.num_hidden_layers if backend == "triton" else [])
    assert torch.equal(got, want)
