"""The split-K decode matmuls (``pprun.layers.skinny``) reading float8 e4m3 weights with their
scales (W8A16), and the dispatch that sends an ``Fp8Linear``'s decode rows to them.

The reference is the dequantized weight, ``weight.float() * scale`` (per row, or per 128x128
block), then the same matmul in torch.  Converting float8 to float32 or bfloat16 is exact in
Triton's interpreter (all 254 finite e4m3 values, checked below), so these tests run on CPU under
the interpreter too (the default without CUDA), with fp32 activations for the tensor-core forms
(the interpreter's low-precision dots are not faithful, as in ``test_skinny.py``).

Tolerances: fp32 activations 1e-4 (outputs of order one; only the order of fp32 sums and where
the scale multiplies differ from the reference); bf16 2e-2, as ``test_skinny.py`` (the output's
rounding to bf16).  The ``gpu`` tests run the default launch settings at 1, 2, 8 and 32 rows.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from triton_env import DEVICE, HAS_CUDA, triton_only  # noqa: E402  (sets TRITON_INTERPRET)

TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}
DTYPE = torch.bfloat16 if HAS_CUDA else torch.float32
"""The activations' dtype of the interpreted-or-CUDA tests."""
BLOCK = 128
LAYOUTS = ["rows", "blocks"]

gpu_fp8 = pytest.mark.skipif(not (HAS_CUDA and torch.cuda.get_device_capability() >= (8, 9)),
                             reason="needs a GPU that converts float8 (compute capability 8.9+)")


def _fp8_weight(n: int, k: int, layout: str, seed: int = 0):
    """A float8 weight ``[n, k]``, its scales in ``layout`` (``[n, 1]`` or ``[ceil(n/128),
    ceil(k/128)]``, spread over two decades so that a misplaced scale shows) and the dequantized
    fp32 weight."""
    g = torch.Generator().manual_seed(seed)
    if layout == "rows":
        scale = torch.logspace(-3, -1, n)[torch.randperm(n, generator=g)].reshape(n, 1)
        full = scale
    else:
        nb, kb = -(-n // BLOCK), -(-k // BLOCK)
        scale = torch.logspace(-3, -1, nb * kb)[torch.randperm(nb * kb, generator=g)].reshape(nb, kb)
        full = scale.repeat_interleave(BLOCK, 0)[:n].repeat_interleave(BLOCK, 1)[:, :k]
    # Values across e4m3's range (subnormals included), the scale chosen so rows stay O(1).
    q = (torch.randn(n, k, generator=g) * 448 / 4).clamp(-448, 448).to(torch.float8_e4m3fn)
    deq = q.float() * full / (448 / 4) / k**0.5
    scale = scale / (448 / 4) / k**0.5
    return q.to(DEVICE), scale.to(DEVICE), deq.to(DEVICE)


def _scale_args(layout: str, scale: torch.Tensor) -> dict:
    return {"weight_scale": scale, "scale_block": BLOCK if layout == "blocks" else None}


def _x(m: int, k: int, dtype: torch.dtype, seed: int = 1) -> torch.Tensor:
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).to(dtype).to(DEVICE)


def _reference(x, deq, bias, swiglu: bool) -> torch.Tensor:
    want = F.linear(x.float(), deq, None if bias is None else bias.float())
    if swiglu:
        gate, up = want.split(want.shape[1] // 2, dim=-1)
        want = F.silu(gate.to(x.dtype).float()) * up.to(x.dtype).float()
    return want


def _assert_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.dtype == dtype and got.shape == want.shape
    torch.testing.assert_close(got.float(), want, atol=TOL[dtype], rtol=TOL[dtype])


@triton_only
def test_interpreter_converts_every_float8_value_exactly():
    """The premise of the interpreted tests: every finite e4m3 value converts exactly."""
    import triton
    import triton.language as tl

    @triton.jit
    def convert(w_ptr, f32_ptr, bf16_ptr, N: tl.constexpr):
        offs = tl.arange(0, N)
        w = tl.load(w_ptr + offs)
        tl.store(f32_ptr + offs, w.to(tl.float32))
        tl.store(bf16_ptr + offs, w.to(tl.bfloat16))

    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).to(DEVICE)
    f32 = torch.empty(256, device=DEVICE)
    bf16 = torch.empty(256, device=DEVICE, dtype=torch.bfloat16)
    convert[(1,)](codes, f32, bf16, N=256)
    want = codes.float()
    finite = ~want.isnan()
    assert finite.sum() == 254
    assert torch.equal(f32[finite], want[finite]) and torch.equal(bf16.float()[finite], want[finite])


@triton_only
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("m,block_n,block_k,swap_ab,split_k,swiglu", [
    (1, 16, 64, False, 3, True),  # one row: multiply and sum, K split, SwiGLU
    (1, 8, 512, False, 1, False),  # one row, a K tile across four scale blocks
    (3, 64, 64, True, 3, True),  # the swapped dot, K split, SwiGLU
    (3, 64, 64, True, 1, False),
    (3, 16, 64, False, 2, False),  # the plain dot
])
def test_fp8_skinny_matches_dequantized_weights(layout, m, block_n, block_k, swap_ab, split_k, swiglu):
    """Every form (one row's multiply-and-sum, with K tiles inside a scale block or across
    several; the swapped and plain dots) with and without split-K and SwiGLU, against the
    dequantized weights.  Ragged: K = 300 (a partial last block and tile); without SwiGLU 200
    rows (a partial last row block)."""
    from pprun.kernels.grid import arrival_counters
    from pprun.layers.skinny import SkinnyConfig, skinny_linear

    n, k = (256 if swiglu else 200), 300
    q, scale, deq = _fp8_weight(n, k, layout)
    x = _x(m, k, DTYPE)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(2)).to(DTYPE).to(DEVICE)
    cfg = SkinnyConfig(block_n, block_k, split_k, swap_ab=swap_ab)
    got = skinny_linear(x, q, bias, swiglu=swiglu, config=cfg, **_scale_args(layout, scale))
    _assert_close(got, _reference(x, deq, bias, swiglu), DTYPE)
    assert not arrival_counters(x.device, 1).any()


@triton_only
@pytest.mark.parametrize("layout", LAYOUTS)
def test_fp8_skinny_deferred_partials_and_held_tile(layout):
    """From two rows: partials left to the norm (``defer_merge``) are the scaled sums the
    in-kernel merge adds, bit for bit; the held last tile (``hold_last``) changes no bit; both
    match the dequantized weights."""
    from pprun.layers import SplitPartials
    from pprun.layers.skinny import SkinnyConfig, skinny_linear

    q, scale, deq = _fp8_weight(192, 384, layout, seed=3)
    x = _x(5, 384, DTYPE, seed=4)
    scales = _scale_args(layout, scale)
    cfg = SkinnyConfig(64, 64, 3, swap_ab=True)
    want = skinny_linear(x, q, None, config=cfg, **scales)
    _assert_close(want, _reference(x, deq, None, False), DTYPE)
    parts = skinny_linear(x, q, None, config=cfg, defer_merge="norm", **scales)
    assert isinstance(parts, SplitPartials) and parts.parts.shape == (3, 5, 192)
    assert torch.equal(parts.merge(), want)
    held = skinny_linear(x, q, None, config=SkinnyConfig(64, 64, 3, swap_ab=True, hold_last=True), **scales)
    assert torch.equal(held, want)


@triton_only
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("swiglu", [False, True])
def test_fp8_skinny_norm_prologue(layout, swiglu):
    """The add + RMSNorm prologue at one row over a float8 weight: the norm's outputs then the
    dequantized matmul (the norm by ``fused.fused_add_rms_norm``, itself tested against torch)."""
    from pprun.layers.fused import fused_add_rms_norm
    from pprun.layers.skinny import SkinnyConfig, skinny_norm_linear

    k = 256
    q, scale, deq = _fp8_weight(256, k, layout, seed=5)
    g = torch.Generator().manual_seed(6)
    x = (torch.randn(1, k, generator=g) * 3).to(DTYPE).to(DEVICE)
    residual = torch.randn(1, k, generator=g).to(DTYPE).to(DEVICE)
    norm_w = (torch.rand(k, generator=g) + 0.5).to(DTYPE).to(DEVICE)
    normed, want_res = fused_add_rms_norm(x, residual, norm_w, 1e-5)
    for cfg in (None, SkinnyConfig(16, 64, 2)):  # the default, and split K
        got, got_res = skinny_norm_linear(x, residual, norm_w, 1e-5, q, None, swiglu=swiglu, config=cfg,
                                          **_scale_args(layout, scale))
        assert torch.equal(got_res, want_res)
        _assert_close(got, _reference(normed, deq, None, swiglu), DTYPE)


@triton_only
@pytest.mark.parametrize("layout", LAYOUTS)
def test_fp8_skinny_weights_ahead_one_row(layout):
    """One row with ``weights_ahead``: the whole K in one tile (crossing every block boundary),
    loaded before the wait."""
    from pprun.layers import skinny

    q, scale, deq = _fp8_weight(100, 640, layout, seed=7)
    x = _x(1, 640, DTYPE, seed=8)
    assert skinny.default_config(1, 100, 640, False, x.device, weights_ahead=True).preload
    got = skinny.skinny_linear(x, q, None, weights_ahead=True, **_scale_args(layout, scale))
    _assert_close(got, _reference(x, deq, None, False), DTYPE)


def test_fp8_skinny_refuses_what_it_cannot_read():
    """Bad scales, dtypes and launch settings are named before any launch."""
    pytest.importorskip("triton")
    from pprun.layers.skinny import SkinnyConfig, skinny_linear

    q, scale, _ = _fp8_weight(256, 256, "blocks")
    rows = torch.ones(256, 1, device=DEVICE)
    x = _x(2, 256, DTYPE)
    with pytest.raises(ValueError, match=r"weight_scale must be a float32 \(2, 2\) tensor"):
        skinny_linear(x, q, weight_scale=rows, scale_block=BLOCK)
    with pytest.raises(ValueError, match=r"weight_scale must be a float32 \(256, 1\) tensor"):
        skinny_linear(x, q, weight_scale=scale)
    with pytest.raises(ValueError, match="weight_scale must be a float32"):
        skinny_linear(x, q, weight_scale=rows.double())
    with pytest.raises(ValueError, match="scale_block must be None .* or 128, got 64"):
        skinny_linear(x, q, weight_scale=scale, scale_block=64)
    with pytest.raises(ValueError, match="scale_block=128 needs a weight_scale"):
        skinny_linear(x, q.to(DTYPE), scale_block=BLOCK)
    with pytest.raises(ValueError, match="or be torch.float8_e4m3fn with a weight_scale"):
        skinny_linear(x, q)
    with pytest.raises(ValueError, match="a weight_scale goes with a torch.float8_e4m3fn weight"):
        skinny_linear(x, q.to(DTYPE), weight_scale=rows)
    with pytest.raises(ValueError, match="whole 128-row blocks"):
        skinny_linear(x, q[:192], weight_scale=scale, scale_block=BLOCK, swiglu=True)  # 96-row halves
    with pytest.raises(ValueError, match="above one row, block_k dividing it"):
        skinny_linear(x, q, weight_scale=scale, scale_block=BLOCK, config=SkinnyConfig(64, 256, 1, swap_ab=True))
    with pytest.raises(ValueError, match="block_n dividing 128"):
        skinny_linear(x[:1], q, weight_scale=scale, scale_block=BLOCK, config=SkinnyConfig(256, 64, 1))


def test_fp8_skinny_compiles_for_sm90():
    """For an H100/H200, without a GPU (``sm90_compile``), with block scales (the per-row ones
    differ only after the K loop): at one row the float8 weights load 16 bytes (16 values) per
    thread and instruction and convert two per instruction in hardware; from two rows the
    swapped form streams them with ``cp.async`` into ``wgmma``."""
    pytest.importorskip("triton")
    from sm90_compile import compile_sm90

    def compile_form(m: int, block_n: int, block_k: int, split: int) -> str:
        const = dict(BLOCK_M=1 if m == 1 else 32, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split, HAS_BIAS=False,
                     SWIGLU=False, USE_DOT=m > 1, SWAP_AB=m > 1, DOT_F32=False, PRECISE_EXP=True, PRELOAD_W=False,
                     HOLD_LAST=False, USE_PDL=True, NORM=False, HAS_RESIDUAL=False, BLOCK_ROW=1, EXACT_MUL=True,
                     DEFER_MERGE=False, W_SCALE=2, SCALE_BLOCK=128)
        return compile_sm90("pprun.layers.skinny", "_skinny_kernel", const,
                            pointers={"part_ptr": "*fp32", "counter_ptr": "*i32", "ws_ptr": "*fp32",
                                      "w_ptr": "*fp8e4nv"}, default_pointer="*bf16",
                            float_args=("inv_hidden", "eps"), divisible=("K", "N_OUT", "K_PER"),
                            options={"num_warps": 4, "num_stages": 3 if m == 1 else 4, "enable_fp_fusion": False})

    one_row = compile_form(1, 8, 512, 1)
    # 8 x 512 float8 over 128 threads: 32 bytes each, two 16-byte loads (the bf16 row: 8-byte loads).
    assert one_row.count("ld.global.v4.b32") == 2
    assert "cvt.rn.f16x2.e4m3x2" in one_row
    swapped = compile_form(32, 64, 128, 2)
    assert "cp.async" in swapped and "wgmma.mma_async" in swapped and "cvt.rn.f16x2.e4m3x2" in swapped


def _fp8_linear(n: int, k: int, layout: str, dtype: torch.dtype, seed: int = 9):
    """An ``Fp8Linear`` holding ``_fp8_weight``'s weight and scales, with a ``dtype`` bias, and
    its dequantized weight."""
    from pprun.layers.fp8_linear import Fp8Linear

    q, scale, deq = _fp8_weight(n, k, layout, seed)
    layer = Fp8Linear(k, n, bias=True, block_scaled=layout == "blocks").to(DEVICE)
    layer.weight.data.copy_(q)
    layer.weight_scale.data.copy_(scale)
    layer.bias.data = torch.randn(n, generator=torch.Generator().manual_seed(seed)).to(dtype).to(DEVICE)
    return layer, deq


@triton_only
@pytest.mark.parametrize("layout", LAYOUTS)
def test_dispatch_sends_fp8_linear_decode_rows_to_the_split_k_kernels(layout, monkeypatch, switch):
    """``pprun.layers.linear`` / ``linear_swiglu`` / ``norm_linear`` treat an ``Fp8Linear`` as an
    ``nn.Linear`` with scales: decode rows go to ``skinny`` with the layer's scales; more rows than
    ``DISPATCH_MAX_M`` (block scales: ``FP8_BLOCK_DISPATCH_MAX_M``), the switch off, or hooks keep
    ``layer(x)`` (cuBLAS's scaled FP8 matmul)."""
    from pprun import layers
    from pprun.layers import fused, skinny
    from pprun.layers.norm import RMSNorm

    if not HAS_CUDA:  # the dispatch takes CUDA tensors only: let it take the interpreter's CPU ones
        monkeypatch.setattr(layers, "fused_ops_for", lambda t: fused)
    dtype = torch.bfloat16  # what the dispatch takes (at one row the interpreter runs bf16 too)
    layer, deq = _fp8_linear(256, 256, layout, dtype)
    seen = []
    skinny_linear = skinny.skinny_linear
    monkeypatch.setattr(skinny, "skinny_linear",
                        lambda *a, **kw: seen.append(kw.get("weight_scale") is layer.weight_scale and
                                                     kw.get("scale_block") == (BLOCK if layout == "blocks" else None))
                        or skinny_linear(*a, **kw))
    x = _x(1, 256, dtype)
    _assert_close(layers.linear(layer, x, after="attention", then="norm"), _reference(x, deq, layer.bias, False),
                  dtype)
    _assert_close(layers.linear_swiglu(layer, x), _reference(x, deq, layer.bias, True), dtype)
    assert seen == [True, True]
    norm = RMSNorm(256, 1e-5).to(DEVICE, dtype).requires_grad_(False)
    got, _ = layers.norm_linear(norm, layer, x, None)
    want = _reference(norm(x, None)[0], deq, layer.bias, False)
    _assert_close(got, want, dtype)
    # Rows up to DISPATCH_MAX_M (per-row scales) or FP8_BLOCK_DISPATCH_MAX_M (block scales).
    max_rows = skinny.FP8_BLOCK_DISPATCH_MAX_M if layout == "blocks" else skinny.DISPATCH_MAX_M
    if HAS_CUDA and max_rows >= 4:  # the swapped form's bf16 dot: faithful on CUDA only
        x4 = _x(4, 256, dtype)
        _assert_close(layers.merged(layers.linear(layer, x4)), _reference(x4, deq, layer.bias, False), dtype)
    assert layers._skinny_for(layer, _x(max_rows, 256, dtype)) is skinny
    assert layers._skinny_for(layer, _x(max_rows + 1, 256, dtype)) is None
    switch("PPRUN_DISABLE_FP8_SKINNY", False)
    assert layers._skinny_for(layer, x) is None
    switch("PPRUN_DISABLE_FP8_SKINNY", True)
    layer.register_forward_hook(lambda mod, i, o: o + 1)
    assert layers._skinny_for(layer, x) is None


@pytest.mark.gpu
@gpu_fp8
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("m", [1, 2, 8, 32])
@pytest.mark.parametrize("name,n,k", [("qkv", 1536, 1024), ("o_proj", 1024, 1024), ("gate_up", 2 * 1536, 1024),
                                      ("down", 1024, 4608), ("lm_head_like", 1000, 1024)])
def test_fp8_skinny_default_configs_gpu(layout, m, name, n, k):
    """The launch settings the dispatch picks, on shapes like a small model's: one row's long K
    split (down), weights ahead (o_proj), partials left to the norm and to the attention, the
    held tile, SwiGLU, a ragged row block (lm_head_like), against the dequantized weights."""
    from pprun.layers import merged
    from pprun.layers.skinny import skinny_linear, skinny_norm_linear

    q, scale, deq = _fp8_weight(n, k, layout, seed=m)
    x = _x(m, k, torch.bfloat16, seed=m + 1)
    scales = _scale_args(layout, scale)
    if name == "gate_up":
        _assert_close(skinny_linear(x, q, swiglu=True, **scales), _reference(x, deq, None, True), torch.bfloat16)
        if m == 1:
            norm_w = torch.rand(k, device="cuda", dtype=torch.bfloat16) + 0.5
            got, res = skinny_norm_linear(x, x, norm_w, 1e-6, q, swiglu=True, **scales)
            h = (x.float() + x.float()).to(torch.bfloat16)
            normed = (h.float() * torch.rsqrt(h.float().pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16)
            normed = (norm_w.float() * normed.float()).to(torch.bfloat16)
            assert torch.equal(res, h)
            _assert_close(got, _reference(normed, deq, None, True), torch.bfloat16)
        return
    want = _reference(x, deq, None, False)
    _assert_close(skinny_linear(x, q, **scales), want, torch.bfloat16)
    for kw in ({"weights_ahead": True}, {"defer_merge": "norm"}, {"defer_merge": "attention", "hold_last": False}):
        _assert_close(merged(skinny_linear(x, q, **kw, **scales)), want, torch.bfloat16)


@pytest.mark.gpu
@gpu_fp8
@pytest.mark.parametrize("layout", ["block", "channel"])
def test_fp8_model_decodes_through_the_split_k_kernels_as_its_dequantized_twin(tmp_path, monkeypatch, layout):
    """A whole FP8 model, greedy decoding in CUDA graphs: the decode steps' FP8 linears take the
    split-K kernels (with their scales), and the tokens are the dequantized twin's, which runs
    the same kernels on bf16 weights (W8A16 adds no activation rounding: logits differ by the
    twin's bf16 rounding of the weights and fp32 sum orders only, so a random tiny model's near-tied
    logits may still flip one prompt's greedy path)."""
    from test_fp8_compute import _fp8_pair

    from pprun import LLM, SamplingParams
    from pprun.layers import skinny

    fp8_calls = []
    skinny_linear = skinny.skinny_linear
    monkeypatch.setattr(skinny, "skinny_linear",
                        lambda *a, **kw: fp8_calls.append(kw.get("weight_scale") is not None) or skinny_linear(*a, **kw))
    fp8_dir, twin = _fp8_pair(tmp_path, "qwen3", layout)
    prompts = [[5, 9, 3, 200, 17], [1, 2, 3], [400, 401, 402, 403], [7] * 9]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = {}
    for name, path in (("fp8", fp8_dir), ("twin", twin)):
        with LLM(str(path), dtype="bfloat16", device="cuda", runner="v2", cudagraph_mode="full", executor="uni",
                 max_model_len=64, max_num_seqs=4) as llm:
            outs[name] = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts],
                                                                       params)]
        if name == "fp8":
            assert any(fp8_calls)
    assert sum(a != b for a, b in zip(outs["fp8"], outs["twin"])) <= 1, outs
