"""Split-K matmuls for decode-sized batches (``pprun.layers.skinny``) against torch.

Runs on CUDA, or on CPU under the Triton interpreter (the default without CUDA).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from triton_env import DEVICE, HAS_CUDA, triton_only  # noqa: E402  (sets TRITON_INTERPRET)

# The interpreter's low-precision dots are not faithful: it runs fp32 only.
DTYPES = [torch.float32, torch.bfloat16] if HAS_CUDA else [torch.float32]
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


def _inputs(m: int, n: int, k: int, dtype: torch.dtype, bias: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype).to(DEVICE)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype).to(DEVICE)
    b = torch.randn(n, generator=g).to(dtype).to(DEVICE) if bias else None
    return x, w, b


@triton_only
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 3, 17, 64])
@pytest.mark.parametrize("split_k", [1, 3])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("swap_ab", [False, True])
def test_skinny_linear_matches_torch(dtype, m, split_k, bias, swap_ab):
    from pprun.kernels.grid import arrival_counters
    from pprun.layers.skinny import SkinnyConfig, skinny_linear

    # Ragged everywhere: 100 columns over 16-wide tiles (64-wide swapped), K = 200 over 64-wide
    # tiles and 3 splits.
    x, w, b = _inputs(m, 100, 200, dtype, bias)
    cfg = SkinnyConfig(block_n=64 if swap_ab else 16, block_k=64, split_k=split_k, swap_ab=swap_ab)
    want = F.linear(x, w, b)
    for _ in range(2):  # the arrival counters must be back at zero after each launch
        got = skinny_linear(x, w, b, config=cfg)
        torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])
    assert got.dtype == dtype and got.shape == (m, 100)
    assert not arrival_counters(x.device, 1).any()


@triton_only
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 5, 33])
@pytest.mark.parametrize("split_k", [1, 4])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("swap_ab", [False, True])
def test_skinny_swiglu_matches_linear_then_silu_and_mul(dtype, m, split_k, bias, swap_ab):
    from pprun.layers.skinny import SkinnyConfig, skinny_linear

    inter = 40
    x, w, b = _inputs(m, 2 * inter, 256, dtype, bias, seed=1)
    gate, up = F.linear(x, w, b).split(inter, dim=-1)
    want = F.silu(gate) * up
    cfg = SkinnyConfig(block_n=64 if swap_ab else 16, block_k=64, split_k=split_k, swap_ab=swap_ab)
    got = skinny_linear(x, w, b, swiglu=True, config=cfg)
    assert got.shape == (m, inter)
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])


@triton_only
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [False, True])
def test_skinny_weights_ahead_one_row(dtype, bias, monkeypatch):
    """weights_ahead at one row: the whole weight slice in one K tile, loaded before the wait;
    the same product as torch (ragged: 100 columns over 8-wide tiles, K = 200 in a 256 tile);
    off above one row, for SwiGLU, beyond WEIGHTS_AHEAD_MAX_K, or switched off."""
    from pprun.layers import skinny

    x, w, b = _inputs(1, 100, 200, dtype, bias, seed=3)
    cfg = skinny.default_config(1, 100, 200, False, x.device, weights_ahead=True)
    assert cfg.preload and cfg.split_k == 1 and cfg.block_k >= 200
    got = skinny.skinny_linear(x, w, b, weights_ahead=True)
    torch.testing.assert_close(got.float(), F.linear(x, w, b).float(), atol=TOL[dtype], rtol=TOL[dtype])
    assert not skinny.default_config(2, 100, 200, False, x.device, weights_ahead=True).preload
    assert not skinny.default_config(1, 100, 200, True, x.device, weights_ahead=True).preload
    assert not skinny.default_config(1, 100, 8192, False, x.device, weights_ahead=True).preload
    if HAS_CUDA:  # the 1.1B model's o_proj (a 2048-wide row held in registers)
        xo, wo, bo = _inputs(1, 2048, 2048, dtype, bias, seed=4)
        got = skinny.skinny_linear(xo, wo, bo, weights_ahead=True)
        torch.testing.assert_close(got.float(), F.linear(xo, wo, bo).float(), atol=TOL[dtype], rtol=TOL[dtype])
    monkeypatch.setattr(skinny, "WEIGHTS_AHEAD_ENABLED", False)
    assert not skinny.default_config(1, 100, 200, False, x.device, weights_ahead=True).preload
    with pytest.raises(ValueError, match=r"one K tile per split \(block_k \* split_k >= K=200\)"):
        skinny.skinny_linear(x, w, b, config=skinny.SkinnyConfig(8, 64, 1, preload=True))
    with pytest.raises(ValueError, match="no SwiGLU"):
        skinny.skinny_linear(x, w, b, swiglu=True, config=skinny.SkinnyConfig(8, 256, 1, preload=True))


@triton_only
@pytest.mark.parametrize("m", [2, 17, 32])
@pytest.mark.parametrize("split_k", [1, 4])
@pytest.mark.parametrize("bias", [False, True])
def test_skinny_weights_ahead_swapped_rows(m, split_k, bias, monkeypatch):
    """The weights-ahead form above one row: the swapped product over one K tile per split
    (K = 200: one 256 tile, or four 64 tiles merged), 100 ragged columns over 64-wide tiles."""
    from pprun.layers import skinny

    dtype = DTYPES[-1]
    x, w, b = _inputs(m, 100, 200, dtype, bias, seed=5)
    cfg = skinny.SkinnyConfig(64, 256 if split_k == 1 else 64, split_k, num_stages=1, swap_ab=True, preload=True)
    got = skinny.skinny_linear(x, w, b, config=cfg)
    torch.testing.assert_close(got.float(), F.linear(x, w, b).float(), atol=TOL[dtype], rtol=TOL[dtype])
    assert not skinny.default_config(m, 100, 200, False, x.device, weights_ahead=True).preload
    monkeypatch.setattr(skinny, "WEIGHTS_AHEAD_MAX_ROWS", 32)
    cfg = skinny.default_config(m, 100, 200, False, x.device, weights_ahead=True)
    assert cfg.preload and cfg.swap_ab and cfg.block_k * cfg.split_k >= 200
    got = skinny.skinny_linear(x, w, b, weights_ahead=True)
    torch.testing.assert_close(got.float(), F.linear(x, w, b).float(), atol=TOL[dtype], rtol=TOL[dtype])


@triton_only
@pytest.mark.parametrize("m", [2, 17, 32])
@pytest.mark.parametrize("split_k", [1, 3, 4])
@pytest.mark.parametrize("swiglu", [False, True])
def test_skinny_hold_last_is_bit_identical(m, split_k, swiglu):
    """``hold_last``: each program's last weight tile loaded before the wait and multiplied
    after its loop gives the same bits as the plain loop (same order of accumulation), with
    one-tile splits (nothing left for the loop), ragged K and ragged columns."""
    from pprun.layers import skinny

    dtype = DTYPES[-1]
    x, w, b = _inputs(m, 2 * 50, 200, dtype, True, seed=8)  # K = 200: 4 tiles of 64, the last ragged
    for block_k in (64, 256):
        plain = skinny.SkinnyConfig(64, block_k, split_k, swap_ab=True)
        held = skinny.SkinnyConfig(64, block_k, split_k, swap_ab=True, hold_last=True)
        want = skinny.skinny_linear(x, w, b, swiglu=swiglu, config=plain)
        got = skinny.skinny_linear(x, w, b, swiglu=swiglu, config=held)
        assert torch.equal(got, want), (block_k, (got.float() - want.float()).abs().max())


@pytest.mark.parametrize("swiglu", [False, True])
def test_default_config_holds_last_except_swiglu_qkv_and_one_row(swiglu, monkeypatch):
    """Where ``default_config`` holds the last tile: the swapped form without SwiGLU, unless the
    caller says not to (qkv ahead of the fused decode attention), never at one row; a config that
    holds outside the swapped form is refused."""
    pytest.importorskip("triton")
    from pprun.layers import skinny

    x, w, b = _inputs(32, 2 * 50, 200, DTYPES[-1], True, seed=8)
    m = x.shape[0]
    monkeypatch.setattr(skinny, "HOLD_LAST_ENABLED", True)
    cfg = skinny.default_config(m, 100, 200, swiglu, x.device, defer_merge=None if swiglu else "norm")
    assert cfg.hold_last == (not swiglu) and cfg.num_stages == skinny.SWAPPED_NUM_STAGES - cfg.hold_last
    assert not skinny.default_config(m, 100, 200, False, x.device, defer_merge="attention", hold_last=False).hold_last
    assert not skinny.default_config(1, 100, 200, swiglu, x.device).hold_last
    with pytest.raises(ValueError, match="hold_last needs the swapped form"):
        skinny.skinny_linear(x, w, b, config=skinny.SkinnyConfig(16, 64, 1, hold_last=True))


@triton_only
def test_linear_passes_hold_last_whatever_the_deferral_switch(monkeypatch, switch):
    """``linear(..., then="attention")`` (qkv ahead of the decode attention, which loads its own
    K/V before its wait) holds no weight tile, with the deferred merge switched off too: what
    follows the matmul decides, not whether its partials are deferred."""
    from pprun import layers
    from pprun.layers import skinny

    configs = []
    default_config = skinny.default_config
    monkeypatch.setattr(skinny, "default_config",
                        lambda *a, **kw: configs.append(default_config(*a, **kw)) or configs[-1])
    switch("PPRUN_DISABLE_DEFER_MERGE", False)
    monkeypatch.setattr(skinny, "HOLD_LAST_ENABLED", True)
    monkeypatch.setattr(layers, "_skinny_for", lambda layer, x: skinny)  # the dispatch itself needs CUDA
    layer = torch.nn.Linear(256, 96, bias=False).to(DEVICE, DTYPES[-1]).requires_grad_(False)
    x = torch.randn(4, 256).to(DEVICE, DTYPES[-1])
    layers.linear(layer, x, then="attention")
    layers.linear(layer, x, then="norm")
    assert [c.hold_last for c in configs] == [False, True]


@triton_only
@pytest.mark.parametrize("m", [2, 17, 32])
@pytest.mark.parametrize("bias", [False, True])
def test_skinny_deferred_merge_matches_in_kernel_merge(m, bias):
    """``defer_merge``: the partials, merged by torch or by the norm's kernel, give what the
    matmul's own merge writes, bit for bit."""
    from pprun.kernels.grid import arrival_counters
    from pprun.layers import SplitPartials
    from pprun.layers.fused import fused_add_rms_norm
    from pprun.layers.skinny import SkinnyConfig, skinny_linear

    dtype = DTYPES[-1]
    x, w, b = _inputs(m, 100, 200, dtype, bias, seed=6)
    cfg = SkinnyConfig(64, 64, 3, swap_ab=True)
    want = skinny_linear(x, w, b, config=cfg)
    parts = skinny_linear(x, w, b, config=cfg, defer_merge="norm")
    # Three splits asked for over K = 200 in 64-wide tiles: two of 128 (the last one ragged).
    assert isinstance(parts, SplitPartials) and parts.parts.shape == (2, m, 100) and parts.shape == (m, 100)
    assert parts.parts.dtype == torch.float32 and parts.dtype == dtype
    assert torch.equal(parts.merge(), want)
    assert not arrival_counters(x.device, 1).any()  # the deferred launch touched no counter
    g = torch.Generator().manual_seed(7)
    residual = torch.randn(m, 100, generator=g).to(dtype).to(DEVICE)
    norm_w = torch.randn(100, generator=g).to(dtype).to(DEVICE)
    got_out, got_res = fused_add_rms_norm(parts, residual, norm_w, 1e-5)
    want_out, want_res = fused_add_rms_norm(want, residual, norm_w, 1e-5)
    assert torch.equal(got_res, want_res) and torch.equal(got_out, want_out)
    # Without a residual the norm merges them first (torch), then normalises.
    got_out, got_res = fused_add_rms_norm(parts, None, norm_w, 1e-5)
    want_out, _ = fused_add_rms_norm(want, None, norm_w, 1e-5)
    assert torch.equal(got_res, want) and torch.equal(got_out, want_out)
    with pytest.raises(ValueError, match="defer_merge must be one of"):
        skinny_linear(x, w, b, config=cfg, defer_merge="o_proj")
    # One split has nothing to defer: the output itself.
    one = skinny_linear(x, w, b, config=SkinnyConfig(64, 256, 1, swap_ab=True), defer_merge="attention")
    assert isinstance(one, torch.Tensor)
    torch.testing.assert_close(one.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])


@triton_only
def test_skinny_deferred_merge_of_eight_splits():
    """Eight splits (down's at batch 32) merged by the norm's kernel, bit for bit as in-kernel."""
    from pprun.layers.fused import fused_add_rms_norm
    from pprun.layers.skinny import SkinnyConfig, skinny_linear

    dtype = DTYPES[-1]
    x, w, b = _inputs(5, 64, 512, dtype, True, seed=8)
    cfg = SkinnyConfig(64, 64, 8, swap_ab=True)
    parts = skinny_linear(x, w, b, config=cfg, defer_merge="norm")
    assert parts.parts.shape == (8, 5, 64)
    want = skinny_linear(x, w, b, config=cfg)
    residual = torch.randn(5, 64, generator=torch.Generator().manual_seed(9)).to(dtype).to(DEVICE)
    norm_w = torch.rand(64, generator=torch.Generator().manual_seed(10)).to(dtype).to(DEVICE)
    got = fused_add_rms_norm(parts, residual, norm_w, 1e-6)
    expected = fused_add_rms_norm(want, residual, norm_w, 1e-6)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


def test_skinny_deferred_split_targets(monkeypatch):
    """A norm merges each row's partials once, so partials it takes may be split further
    (DEFERRED_TARGET_PROGRAMS); the decode attention re-merges per program and keeps the usual
    split."""
    pytest.importorskip("triton")
    from pprun.layers import skinny

    dev = torch.device("cpu")
    monkeypatch.setattr(skinny, "DEFERRED_TARGET_PROGRAMS", 256)  # the default, pinned here
    # down at 32 rows: 32 column blocks of 64, K = 8192 in 128-wide tiles.
    assert skinny.default_config(32, 2048, 8192, False, dev, defer_merge="norm").split_k == 8
    assert skinny.default_config(32, 2048, 8192, False, dev, defer_merge="attention").split_k == 4
    assert skinny.default_config(32, 2048, 8192, False, dev).split_k == 4


@triton_only
def test_skinny_default_config_splits_long_k():
    from pprun.layers.skinny import default_config, skinny_linear

    cfg = default_config(1, 2048, 8192, False, torch.device(DEVICE))
    assert cfg.split_k > 1  # K = 8192 is split
    x, w, _ = _inputs(2, 64, 1024, torch.float32, False)
    torch.testing.assert_close(skinny_linear(x, w), F.linear(x, w), atol=1e-4, rtol=1e-4)


@triton_only
def test_skinny_rejects_bad_shapes():
    from pprun.layers.skinny import MAX_M, skinny_linear

    x, w, _ = _inputs(MAX_M + 1, 16, 32, torch.float32, False)
    with pytest.raises(ValueError, match="MAX_M"):
        skinny_linear(x, w)
    with pytest.raises(ValueError, match=r"weight \[N, K\]"):
        skinny_linear(x[:2], w[:, :16])
    with pytest.raises(ValueError, match="even number"):
        skinny_linear(x[:2], w[:15], swiglu=True)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA (shapes too large for the interpreter)")
@pytest.mark.parametrize("m", [1, 8, 17, 32])
@pytest.mark.parametrize("name,n,k", [("qkv", 3072, 2048), ("o_proj", 2048, 2048), ("gate_up", 16384, 2048),
                                      ("down", 2048, 8192), ("lm_head", 32000, 2048)])
def test_skinny_default_configs_at_1b_shapes_gpu(m, name, n, k):
    from pprun.layers.skinny import skinny_linear

    x, w, _ = _inputs(m, n, k, torch.bfloat16, False, seed=2)
    if name == "gate_up":
        gate, up = F.linear(x, w).split(n // 2, dim=-1)
        want = F.silu(gate) * up
        got = skinny_linear(x, w, swiglu=True)
    else:
        want = F.linear(x, w)
        got = skinny_linear(x, w)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_linear_dispatch_falls_back_for_what_the_kernel_cannot_take():
    import pprun.layers as layers
    from pprun.layers import skinny

    class Scaled(torch.nn.Linear):
        def forward(self, x):
            return 2 * super().forward(x)

    x = torch.randn(1, 64, device="cuda", dtype=torch.bfloat16)
    plain = torch.nn.Linear(64, 32, bias=False, device="cuda", dtype=torch.bfloat16).requires_grad_(False)
    assert layers._skinny_for(plain, x) is skinny
    assert layers._skinny_for(plain, torch.randn(skinny.DISPATCH_MAX_M, 64, device="cuda", dtype=torch.bfloat16)) is skinny
    too_many = torch.randn(skinny.DISPATCH_MAX_M + 1, 64, device="cuda", dtype=torch.bfloat16)
    assert layers._skinny_for(plain, too_many) is None  # cuBLAS's rows
    sub = Scaled(64, 32, bias=False, device="cuda", dtype=torch.bfloat16).requires_grad_(False)
    assert layers._skinny_for(sub, x) is None
    torch.testing.assert_close(layers.linear(sub, x), sub(x))  # its own forward ran
    hooked = torch.nn.Linear(64, 32, device="cuda", dtype=torch.bfloat16).requires_grad_(False)
    hooked.register_forward_hook(lambda m, i, o: o + 1)
    assert layers._skinny_for(hooked, x) is None
    other_dtype = torch.nn.Linear(64, 32, device="cuda", dtype=torch.float16).requires_grad_(False)
    assert layers._skinny_for(other_dtype, x) is None
    trained = torch.nn.Linear(64, 32, device="cuda", dtype=torch.bfloat16)  # requires grad, grad mode on
    assert layers._skinny_for(trained, x) is None


@pytest.mark.parametrize("swiglu", [False, True])
@pytest.mark.parametrize("hold_last", [False, True])
def test_skinny_swapped_compiles_for_sm90(swiglu, hold_last):
    """The swapped form at the 1.1B model's batch-32 settings compiles for an H100/H200 without a
    GPU (``sm90_compile``): nothing is loaded from global memory before the PDL wait but, with
    ``hold_last``, the held weight tile(s), and the weight stream is ``cp.async`` into ``wgmma``."""
    pytest.importorskip("triton")
    from sm90_compile import compile_sm90

    from pprun.layers import skinny

    const = dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=128, SPLIT_K=1 if swiglu else 2, HAS_BIAS=False, SWIGLU=swiglu,
                 USE_DOT=True, SWAP_AB=True, DOT_F32=False, PRECISE_EXP=True, PRELOAD_W=False, HOLD_LAST=hold_last,
                 USE_PDL=True, NORM=False, HAS_RESIDUAL=False, BLOCK_ROW=1, EXACT_MUL=True,
                 DEFER_MERGE=not swiglu, W_SCALE=0, SCALE_BLOCK=128)
    ptx = compile_sm90("pprun.layers.skinny", "_skinny_kernel", const,
                       pointers={"part_ptr": "*fp32", "counter_ptr": "*i32", "ws_ptr": "*fp32"}, default_pointer="*bf16",
                       float_args=("inv_hidden", "eps"), divisible=("K", "N_OUT", "K_PER"),
                       options={"num_warps": 4, "num_stages": skinny.SWAPPED_NUM_STAGES - hold_last, "enable_fp_fusion": False})
    before_wait = ptx[:ptx.index("griddepcontrol.wait")]
    assert "cp.async" not in before_wait
    # 64 x 128 bf16 over 128 threads: 8 loads of 16 bytes each per held tile
    assert before_wait.count("ld.global") == (8 * (2 if swiglu else 1) if hold_last else 0)
    assert "cp.async.cg.shared.global" in ptx and "wgmma.mma_async" in ptx
