"""The add + RMSNorm folded into the one-row split-K matmul (``skinny.skinny_norm_linear``,
``pprun.layers.norm_linear``) against the two launches it replaces.

The reference is ``fused.fused_add_rms_norm`` followed by ``skinny.skinny_linear`` (themselves
tested against torch in ``test_fused_ops.py`` and ``test_skinny.py``), and a ``DecoderLayer``
with the fold switched off.  Runs on CUDA, or on CPU under the Triton interpreter::

    pytest tests/test_norm_linear.py

At one row the kernel multiplies and sums (no ``tl.dot``), so bf16 runs on the interpreter too;
there both sides share the interpreter's truncating bf16 casts, and every step of the fold is
the same as the two launches', so results are bitwise equal.  On CUDA the order of the fp32
sums may differ, so the matmul output is checked to the tolerance of ``test_skinny.py``.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from triton_env import DEVICE, HAS_CUDA, count_calls_by_form, triton_only  # noqa: E402  (sets TRITON_INTERPRET)

import pprun.layers
from pprun.attention.metadata import AttentionMetadata
from pprun.models.hf_config import load_arch_config
from pprun.models.llama import DecoderLayer, RMSNorm, RotaryEmbedding

TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}  # as test_skinny.py


def _inputs(n: int, k: int, dtype: torch.dtype, residual: bool, bias: bool, seed: int = 0):
    """One hidden row (and residual), a norm weight near 1, a linear weight and bias."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(1, k, generator=g) * 3).to(dtype).to(DEVICE)
    r = torch.randn(1, k, generator=g).to(dtype).to(DEVICE) if residual else None
    nw = (torch.rand(k, generator=g) + 0.5).to(dtype).to(DEVICE)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype).to(DEVICE)
    b = torch.randn(n, generator=g).to(dtype).to(DEVICE) if bias else None
    return x, r, nw, w, b


def _check_against_two_launches(x, r, nw, w, b, swiglu, cfg, eps=1e-5):
    from pprun.kernels.grid import arrival_counters
    from pprun.layers.fused import fused_add_rms_norm
    from pprun.layers.skinny import skinny_linear, skinny_norm_linear

    normed, want_res = fused_add_rms_norm(x, r, nw, eps)
    want = skinny_linear(normed, w, b, swiglu=swiglu, config=cfg)
    for _ in range(2):  # split-K arrival counters must be back at zero after each launch
        got, got_res = skinny_norm_linear(x, r, nw, eps, w, b, swiglu=swiglu, config=cfg)
        assert got.dtype == want.dtype and got.shape == want.shape
        torch.testing.assert_close(got.float(), want.float(), atol=TOL[x.dtype], rtol=TOL[x.dtype])
        if not HAS_CUDA:
            assert torch.equal(got, want)  # same steps, same interpreter
        if r is None:
            assert got_res is x
        else:
            assert got_res.dtype == x.dtype and torch.equal(got_res, want_res)
    assert not arrival_counters(x.device, 1).any()


@triton_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("swiglu", [False, True])
@pytest.mark.parametrize("split_k,bias", [(1, False), (3, True)])
def test_skinny_norm_linear_matches_norm_then_linear(dtype, with_residual, swiglu, split_k, bias):
    from pprun.layers.skinny import SkinnyConfig

    # Ragged everywhere: 100 columns (50 with SwiGLU) over 16-wide tiles, K = 200 over 64-wide
    # tiles (and 3 splits: programs with pid_k > 0 need the whole row's norm too).
    x, r, nw, w, b = _inputs(100, 200, dtype, with_residual, bias)
    _check_against_two_launches(x, r, nw, w, b, swiglu, SkinnyConfig(block_n=16, block_k=64, split_k=split_k))


@triton_only
@pytest.mark.parametrize("swiglu", [False, True])
def test_skinny_norm_linear_default_config_long_k(swiglu):
    from pprun.layers.skinny import default_config

    k = 4608  # > 4096: the default config splits K; the row is read as one 8192-wide block
    assert default_config(1, 16, k, swiglu, torch.device(DEVICE)).split_k > 1
    x, r, nw, w, b = _inputs(32, k, torch.bfloat16, True, False, seed=1)
    _check_against_two_launches(x, r, nw, w, b, swiglu, None)


@triton_only
def test_skinny_norm_linear_rejects_bad_inputs():
    from pprun.layers.skinny import skinny_norm_linear

    x, r, nw, w, _ = _inputs(16, 32, torch.float32, True, False)
    with pytest.raises(ValueError, match=r"2 rows.*exactly one"):
        skinny_norm_linear(x.expand(2, 32), None, nw, 1e-5, w)
    with pytest.raises(ValueError, match=r"norm_weight must be a contiguous \(32,\)"):
        skinny_norm_linear(x, r, nw[:16], 1e-5, w)
    with pytest.raises(ValueError, match="norm_weight must have x's dtype"):
        skinny_norm_linear(x, r, nw.double(), 1e-5, w)
    with pytest.raises(ValueError, match=r"residual must be a \(1, 32\) tensor"):
        skinny_norm_linear(x, r[:, :16], nw, 1e-5, w)
    with pytest.raises(ValueError, match=r"residual must be a \(1, 32\) tensor of x's dtype"):
        skinny_norm_linear(x, r.double(), nw, 1e-5, w)
    with pytest.raises(ValueError, match=r"weight \[N, K\]"):
        skinny_norm_linear(x, r, nw, 1e-5, w[:, :16])
    with pytest.raises(ValueError, match="even number"):
        skinny_norm_linear(x, r, nw, 1e-5, w[:15], swiglu=True)


# ---------------------------------------------------------------- the model's dispatch


@pytest.fixture
def fused_on_this_device(monkeypatch):
    """The fused-op switch as on CUDA, for this test's device: on CPU (interpreter) the Triton
    paths of ``pprun.layers`` (the plan's fold among them) are taken for CPU tensors too."""
    if not HAS_CUDA:

        def fused_ops_for(t: torch.Tensor):
            return pprun.layers._load_fused() if pprun.layers.FUSED_ENABLED else None

        monkeypatch.setattr(pprun.layers, "fused_ops_for", fused_ops_for)


@pytest.fixture
def fold_calls(monkeypatch):
    """Counts ``skinny_norm_linear`` launches by SwiGLU form."""
    from pprun.layers import skinny

    return count_calls_by_form(monkeypatch, skinny, "skinny_norm_linear")


def _stub_backend(q, k, v, kv_cache, meta, scale):
    """Stands in for attention (not under test here): a function of all of q, k and v."""
    group = q.shape[1] // k.shape[1]
    return q * scale + k.repeat_interleave(group, dim=1) + v.repeat_interleave(group, dim=1)


_stub_backend.rope_decode = None  # no one-kernel decode (pprun.attention.backend.AttentionBackend)


def _decode_meta() -> AttentionMetadata:
    """One request decoding one token (the stub backend reads none of it)."""
    i32 = {"dtype": torch.int32, "device": DEVICE}
    return AttentionMetadata(
        num_reqs=1,
        num_reqs_padded=1,
        num_tokens=1,
        num_tokens_padded=1,
        max_query_len=1,
        query_start_loc=torch.tensor([0, 1], **i32),
        seq_lens=torch.tensor([8], **i32),
        block_table=torch.zeros(1, 1, **i32),
        slot_mapping=torch.tensor([7], dtype=torch.int64, device=DEVICE),
    )


@triton_only
@pytest.mark.parametrize("with_residual", [False, True])
def test_decoder_layer_norm_fold_matches_unfolded(
    monkeypatch, switch, fused_on_this_device, fold_calls, tiny_llama_dir, with_residual
):
    """A bf16 one-row DecoderLayer as its ``forward_fused`` launches it, with the fold on (qkv
    and gate_up take their norms) and off (each norm its own launch, then the split-K matmuls)."""
    # Biased q/k/v, as Qwen2 has: the fold's bias path too.
    arch = dataclasses.replace(load_arch_config(tiny_llama_dir), attention_bias=True)
    dtype = torch.bfloat16
    rotary = RotaryEmbedding(arch, max_positions=16, device=torch.device(DEVICE))
    torch.manual_seed(0)
    layer = DecoderLayer(arch, rotary, _stub_backend).to(device=DEVICE, dtype=dtype)
    with torch.no_grad():
        for name, param in layer.named_parameters():
            param.copy_(torch.rand_like(param) + 0.5 if name.endswith("norm.weight") else torch.randn_like(param) * 0.2)
    hidden = torch.randn(1, arch.hidden_size, device=DEVICE).to(dtype)
    residual = torch.randn(1, arch.hidden_size, device=DEVICE).to(dtype) if with_residual else None
    positions = torch.tensor([7], device=DEVICE)
    meta = _decode_meta()

    def run(fold: bool) -> tuple[torch.Tensor, torch.Tensor]:
        switch("PPRUN_DISABLE_NORM_FOLD", fold)
        with torch.inference_mode():
            return layer.forward_fused(positions, hidden, residual, meta, feeds_norm=True)

    want_h, want_res = run(False)
    assert fold_calls == {"plain": 0, "swiglu": 0}
    got_h, got_res = run(True)
    assert fold_calls == {"plain": 1, "swiglu": 1}
    if HAS_CUDA:  # the second residual adds the attention output, whose sums may be ordered apart
        for got, want in ((got_h, want_h), (got_res, want_res)):
            torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])
    else:
        assert torch.equal(got_h, want_h) and torch.equal(got_res, want_res)
    # More than one row: no fold (the norms run on their own).
    norm, qkv_proj = layer.input_layernorm, layer.self_attn.qkv_proj
    assert pprun.layers.norm_linear(norm, qkv_proj, hidden.expand(2, -1).contiguous(), None) is None


@triton_only
def test_norm_linear_falls_back_for_what_the_fold_cannot_take(fused_on_this_device, fold_calls):
    from pprun.layers import norm_linear

    hidden, dtype = 64, torch.bfloat16
    norm = RMSNorm(hidden, eps=1e-5).to(device=DEVICE, dtype=dtype).requires_grad_(False)
    proj = torch.nn.Linear(hidden, 32, bias=False, device=DEVICE, dtype=dtype).requires_grad_(False)
    x = torch.randn(1, hidden, device=DEVICE).to(dtype)
    residual = torch.randn(1, hidden, device=DEVICE).to(dtype)
    assert norm_linear(norm, proj, x, residual) is not None
    assert norm_linear(norm, proj, x.float(), residual.float()) is None  # skinny serves bf16/fp16 only
    assert norm_linear(norm, proj, x, residual.float()) is None  # residual of another dtype
    assert norm_linear(norm, proj, x, torch.randn(1, 2 * hidden, device=DEVICE).to(dtype)[:, ::2]) is None
    odd = torch.nn.Linear(hidden, 31, bias=False, device=DEVICE, dtype=dtype).requires_grad_(False)
    assert norm_linear(norm, odd, x, residual, swiglu=True) is None  # no gate | up halves
    fp32_norm = RMSNorm(hidden, eps=1e-5).to(device=DEVICE).requires_grad_(False)
    assert norm_linear(fp32_norm, proj, x, residual) is None  # normed row would be fp32
    trainable = RMSNorm(hidden, eps=1e-5).to(device=DEVICE, dtype=dtype)  # grad mode is on
    assert norm_linear(trainable, proj, x, residual) is None
    hooked = RMSNorm(hidden, eps=1e-5).to(device=DEVICE, dtype=dtype).requires_grad_(False)
    hooked.register_forward_hook(lambda m, i, o: o)
    assert norm_linear(hooked, proj, x, residual) is None
    assert fold_calls == {"plain": 1, "swiglu": 0}


def test_norm_linear_switch_and_cpu_decline(monkeypatch, switch):
    """Off by ``NORM_FOLD_ENABLED``; and without the Triton path (CPU tensors) it declines, so
    llama.py runs its plain torch reference."""
    norm = RMSNorm(16, eps=1e-5).to(torch.bfloat16).requires_grad_(False)
    proj = torch.nn.Linear(16, 8, bias=False, dtype=torch.bfloat16).requires_grad_(False)
    x = torch.randn(1, 16).to(torch.bfloat16)
    monkeypatch.setattr(pprun.layers, "fused_ops_for", lambda t: None)
    assert pprun.layers.norm_linear(norm, proj, x, None) is None
    switch("PPRUN_DISABLE_NORM_FOLD", False)
    assert pprun.layers.norm_linear(norm, proj, x, None) is None
