"""Block-scaled float8 experts run W8A8 (``pprun.layers.moe_triton``, ``FP8_W8A8_MIN_TOKENS``):
activations quantized to float8 e4m3 per token (gate_up) or entry (down) and scale block of
columns, float8-by-float8 products, each K tile scaled by the activations' and the weights'
scales.  On CPU under Triton's interpreter, whose float8 products are exact and whose float8
rounding ``pprun.layers.fp8_quant.to_fp8`` makes exact.

Tolerances:

- each kernel against a torch reference of the same arithmetic, fp32 activations (the
  interpreter's bf16 casts truncate): down on given float8 activations within 1e-5 (relative and
  absolute, outputs of order one: the order of fp32 sums is all that differs); gate_up's float8
  output per value within half a float8 step (plus 1e-5 relative) of the reference SwiGLU over
  the kernel's scale, its scales within 1e-5 of the reference's (a value the sum order moves
  across a rounding boundary rounds either way, and nothing else may differ);
- the whole layer against the dequantized experts in fp32 with unquantized activations: 8% of
  the output's norm and of its largest value (two roundings to 3 mantissa bits, of the hidden
  states and of the SwiGLU output, each within 2**-4 relative: 3.5-5% measured).

The switch's routing is checked with the GEMMs replaced by recorders (no kernel runs), so is
each launch's Triton specialisation across a warm-up class of token counts, and the W8A8
kernels' compilation for sm_90: warpgroup MMAs on e4m3 operands.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_moe_fp8 import make_case
from triton_env import DEVICE, triton_only  # noqa: E402  (sets TRITON_INTERPRET)

from pprun.layers.fp8_quant import quantize_reference
from pprun.layers.moe import experts_reference


def dequantized(q: torch.Tensor, scale: torch.Tensor, group: int) -> torch.Tensor:
    """``q [rows, K]`` times its per-row, per-``group``-column ``scale``, in fp32."""
    rows, k = q.shape
    return (q.float().view(rows, k // group, group) * scale[..., None]).view(rows, k)


def entries(ids: torch.Tensor) -> list[tuple[int, int, int]]:
    """Each assignment as ``(entry, token, expert)``, ``entry = token * top_k + slot``."""
    top_k = ids.shape[1]
    return [(t * top_k + j, t, int(ids[t, j])) for t in range(ids.shape[0]) for j in range(top_k)]


def half_step(v: torch.Tensor) -> torch.Tensor:
    """Half of float8 e4m3's step at ``v`` (3 mantissa bits; a fixed 2**-9 step below 2**-6)."""
    exponent = torch.floor(torch.log2(v.abs().clamp(min=2.0**-6)))
    return 2.0 ** (exponent - 4)


@triton_only
@pytest.mark.parametrize("num_tokens, num_experts, top_k, inter, block_n, block_k", [
    (1, 5, 2, 384, 128, 128),   # one decode row: no sort; three column tiles of one scale block
    (7, 6, 3, 384, 256, 64),    # the last column tile half past inter; two K tiles per scale block
    (40, 8, 2, 256, 128, 128),  # more tokens than experts, several rows per block
])
def test_gate_up_w8a8_quantizes_its_swiglu(num_tokens, num_experts, top_k, inter, block_n, block_k):
    """gate_up on float8 hidden states: each entry's SwiGLU output quantized per 128 columns in
    the epilogue (column tiles of whole scale blocks), against the reference's SwiGLU of the
    dequantized hidden states and experts."""
    from pprun.layers import moe_triton as mt

    hidden, group = 256, 128
    x, w13, _, _, ids, scales, (d13, _) = make_case(num_tokens, hidden, inter, num_experts, top_k, torch.float32, group)
    xq, xs = quantize_reference(x, group)
    cfg = mt.GemmConfig(16, block_n, block_k, 4)
    align = mt.layout(ids, num_experts, cfg.block_m)
    act = mt.gate_up(mt.Fp8Rows(xq, xs, torch.float32), w13, align, top_k, cfg, scales["w13_scale"], group)
    assert isinstance(act, mt.Fp8Rows) and act.q.dtype == torch.float8_e4m3fn and act.dtype == torch.float32
    assert act.q.shape == (num_tokens * top_k, inter) and act.scale.shape == (num_tokens * top_k, inter // group)
    x_deq = dequantized(xq, xs, group)
    want = torch.zeros(num_tokens * top_k, inter, device=DEVICE)
    for entry, token, expert in entries(ids):
        gate, up = (x_deq[token] @ d13[expert].T).split(inter)
        want[entry] = F.silu(gate) * up
    assert want.abs().max() > 0.1
    want_scale = want.view(-1, inter // group, group).abs().amax(dim=2) / 448
    torch.testing.assert_close(act.scale, want_scale, rtol=1e-5, atol=0)
    v = want / act.scale.repeat_interleave(group, dim=1)  # the reference over the kernel's scales
    assert torch.all((act.q.float() - v).abs() <= half_step(v) + 1e-5 * v.abs())


@triton_only
def test_gate_up_w8a8_leaves_split_scale_blocks_to_a_quantization_launch():
    """Column tiles narrower than a scale block cannot quantize a whole group: gate_up then
    returns the SwiGLU output in the activations' dtype (the reference's within 1e-5), which
    ``fused_experts`` quantizes in a launch of its own."""
    from pprun.layers import moe_triton as mt

    hidden, inter, group = 256, 256, 128
    x, w13, _, _, ids, scales, (d13, _) = make_case(9, hidden, inter, 4, 2, torch.float32, group)
    xq, xs = quantize_reference(x, group)
    cfg = mt.GemmConfig(16, 64, 128, 4)
    act = mt.gate_up(mt.Fp8Rows(xq, xs, torch.float32), w13, mt.layout(ids, 4, 16), 2, cfg, scales["w13_scale"], group)
    assert isinstance(act, torch.Tensor) and act.dtype == torch.float32
    x_deq = dequantized(xq, xs, group)
    want = torch.zeros(18, inter, device=DEVICE)
    for entry, token, expert in entries(ids):
        gate, up = (x_deq[token] @ d13[expert].T).split(inter)
        want[entry] = F.silu(gate) * up
    torch.testing.assert_close(act, want, rtol=1e-5, atol=1e-5)


@triton_only
@pytest.mark.parametrize("num_tokens, num_experts, top_k, hidden, block_n, block_k, partials", [
    (1, 5, 2, 384, 128, 128, False),  # direct layout
    (7, 6, 3, 200, 128, 64, True),    # hidden off the column tile and off a scale block; partials
    (40, 8, 2, 256, 64, 128, False),  # more tokens than experts
])
def test_down_w8a8_matches_the_same_arithmetic(num_tokens, num_experts, top_k, hidden, block_n, block_k, partials):
    """down on float8 activations with their scales: each entry's product with its expert's
    dequantized weights, rounded to the activations' dtype and weighted (``partials``: by slot,
    then token)."""
    from pprun.layers import moe_triton as mt

    inter, group = 256, 128
    _, _, w2, weights, ids, scales, (_, d2) = make_case(num_tokens, hidden, inter, num_experts, top_k, torch.float32,
                                                        group)
    gen = torch.Generator().manual_seed(num_tokens)
    act = (torch.randn(num_tokens * top_k, inter, generator=gen) * torch.rand(1, inter, generator=gen)).to(DEVICE)
    aq, a_s = quantize_reference(act, group)
    cfg = mt.GemmConfig(16, block_n, block_k, 4)
    y = mt.down(mt.Fp8Rows(aq, a_s, torch.float32), w2, weights, mt.layout(ids, num_experts, 16), top_k, cfg,
                partials, scales["w2_scale"], group)
    a_deq = dequantized(aq, a_s, group)
    want = torch.zeros(num_tokens * top_k, hidden, device=DEVICE)
    for entry, token, expert in entries(ids):
        row = (entry % top_k) * num_tokens + token if partials else entry
        want[row] = (a_deq[entry] @ d2[expert].T) * weights[token, entry % top_k]
    assert y.dtype == torch.float32 and want.abs().max() > 0.1
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)


@triton_only
@pytest.mark.parametrize("num_tokens, num_experts, top_k, hidden, inter, block, dtype", [
    (1, 5, 2, 256, 384, 128, torch.float32),
    (7, 6, 3, 384, 256, 128, torch.float32),
    (20, 4, 2, 256, 256, 128, torch.bfloat16),  # 64-row blocks (the default tiles past 8 rows per expert)
    (9, 5, 2, 160, 96, 32, torch.float32),      # 32x32 blocks: widths off the 128-column tiles
])
def test_fused_experts_w8a8_against_the_dequantized_experts(monkeypatch, num_tokens, num_experts, top_k, hidden,
                                                            inter, block, dtype):
    """The whole layer with the switch on from one token (default W8A8 tiles, hidden states
    quantized by ``quantize_groups``): the dequantized experts' output within FP8 activations'
    rounding, and not within W8A16's (the activations were rounded)."""
    from pprun.layers import moe_triton as mt

    monkeypatch.setattr(mt, "FP8_W8A8_MIN_TOKENS", 1)
    x, w13, w2, weights, ids, scales, (d13, d2) = make_case(num_tokens, hidden, inter, num_experts, top_k, dtype, block)
    got = mt.fused_experts(x, w13, w2, weights, ids, **scales)
    want = experts_reference(x.float(), d13, d2, weights, ids)
    assert got.dtype == dtype and got.shape == want.shape
    err = got.float() - want
    rel = (err.norm() / want.norm()).item()
    assert 0.01 < rel < 0.08, rel
    assert err.abs().max() < 0.08 * want.abs().max()


@triton_only
def test_fused_experts_w8a8_partials_sum_to_the_output(monkeypatch):
    """``then="norm"`` on the W8A8 path: the unsummed rows sum to the summed output."""
    from pprun.kernels.partials import SplitPartials
    from pprun.layers import moe_triton as mt

    monkeypatch.setattr(mt, "FP8_W8A8_MIN_TOKENS", 1)
    x, w13, w2, weights, ids, scales, _ = make_case(7, 256, 128, 5, 3, torch.float32, 128, seed=3)
    parts = mt.fused_experts(x, w13, w2, weights, ids, then="norm", **scales)
    assert isinstance(parts, SplitPartials) and parts.parts.shape == (3, 7, 256)
    torch.testing.assert_close(parts.merge(), mt.fused_experts(x, w13, w2, weights, ids, **scales),
                               atol=1e-6, rtol=1e-6)


def test_switch_routes_block_scaled_experts(monkeypatch):
    """``FP8_W8A8_MIN_TOKENS``: None runs every step W8A16; N runs W8A8 from N tokens (by the
    count's class: 33 tokens are in 64's) with :func:`w8a8_config`'s tiles, gate_up quantizing
    its output; per-row-scaled (channel) experts and widths off the scale block stay W8A16."""
    pytest.importorskip("triton")
    from pprun.layers import moe_triton as mt

    calls = []

    def fake_gate_up(x, w13, align, top_k, cfg, w13_scale=None, scale_block=None):
        fp8 = isinstance(x, mt.Fp8Rows)
        calls.append(("gate_up", fp8, cfg))
        rows, inter = (x.q if fp8 else x).shape[0] * top_k, w13.shape[1] // 2
        if fp8:
            return mt.Fp8Rows(torch.zeros(rows, inter, dtype=torch.float8_e4m3fn), torch.ones(rows, inter // scale_block),
                              x.dtype)
        return torch.zeros(rows, inter, dtype=x.dtype)

    def fake_down(act, w2, weights, align, top_k, cfg, partials=False, w2_scale=None, scale_block=None):
        calls.append(("down", isinstance(act, mt.Fp8Rows), cfg))
        rows = (act.q if isinstance(act, mt.Fp8Rows) else act).shape[0]
        return torch.zeros(rows, w2.shape[1])

    def fake_quantize(x, group):
        calls.append(("quantize", x.shape[0], group))
        return mt.Fp8Rows(x.to(torch.float8_e4m3fn), torch.ones(x.shape[0], x.shape[1] // group), x.dtype)

    monkeypatch.setattr(mt, "gate_up", fake_gate_up)
    monkeypatch.setattr(mt, "down", fake_down)
    monkeypatch.setattr(mt, "quantize_fp8_rows", fake_quantize)
    monkeypatch.setattr(mt, "layout", lambda ids, num_experts, block_m: None)

    def modes(switch, num_tokens, hidden=256, block=128):
        monkeypatch.setattr(mt, "FP8_W8A8_MIN_TOKENS", switch)
        calls.clear()
        x, w13, w2, weights, ids, scales, _ = make_case(num_tokens, hidden, 256, 8, 2, torch.bfloat16, block)
        mt.fused_experts(x.cpu(), w13.cpu(), w2.cpu(), weights.cpu(), ids.cpu(),
                         **{k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in scales.items()})
        return [c[:2] for c in calls], calls

    w8a16 = [("gate_up", False), ("down", False)]
    w8a8 = [("quantize", None), ("gate_up", True), ("down", True)]
    for switch, num_tokens in ((None, 1), (None, 64), (32, 7), (32, 31)):
        assert modes(switch, num_tokens)[0] == w8a16, (switch, num_tokens)
    for switch, num_tokens in ((1, 1), (32, 32), (32, 33), (64, 33)):
        got, calls = modes(switch, num_tokens)
        assert got == [("quantize", num_tokens)] + w8a8[1:], (switch, num_tokens)
        assert calls[0][2] == 128  # per 128 columns: the weights' scale block
        cfg = calls[1][2]
        assert cfg == mt.w8a8_config(num_tokens, 8, 2, 128).gate_up and cfg.block_n % 128 == 0
    assert modes(1, 7, block=None)[0] == w8a16  # channel scales
    assert modes(1, 7, hidden=272)[0] == w8a16  # hidden off the 128-column groups
    assert modes(1, 7, hidden=64, block=32)[0][1:] == w8a8[1:]  # 32x32 blocks: groups of 32
    # 16x16 blocks: K tiles within a block would be 16 wide, under float8 tl.dot's 32 (the
    # interpreter takes them; the GPU's compiler does not).
    assert not mt.uses_w8a8(64, 256, 256, 16)
    assert modes(1, 7, hidden=64, block=16)[0] == w8a16


def test_w8a8_config_tiles():
    """Decode-sized steps (up to 8 rows per expert by the count's class) take 16-row blocks,
    larger ones 64 (Hopper's warpgroup FP8 MMA); columns whole scale blocks, K tiles within one."""
    pytest.importorskip("triton")
    from pprun.layers.moe_triton import w8a8_config

    assert w8a8_config(32, 128, 8, 128).gate_up.block_m == 16
    assert w8a8_config(256, 128, 8, 128).gate_up.block_m == 64
    assert w8a8_config(129, 128, 8, 128).gate_up.block_m == 64  # 129 is in 256's class
    for cfg in (*w8a8_config(8, 16, 2, 32), *w8a8_config(8192, 128, 8, 128)):
        assert cfg.block_n % 128 == 0 and cfg.block_n >= 128 and cfg.block_k <= 128


def test_w8a8_tuned_tiles_from_the_tuned_file(tmp_path, monkeypatch):
    """``w8a8_config`` takes the tuned W8A8 entries of the GPU and shape (``PPRUN_MOE_CONFIGS``,
    under the shape's W8A8 key), the one nearest the top of the count's class, and its rule
    where there are none: for another GPU model, another shape, off CUDA, or bf16 entries alone.
    ``experts_config`` reads them for W8A8 steps on the GPU (``_tuned_device``), the bf16 ones
    for W8A16 steps."""
    import json

    pytest.importorskip("triton")
    from pprun.layers import moe_triton as mt

    key = mt.w8a8_shape_key(8, 256, 256, 2, 128)
    assert key == "E=8,N=256,H=256,K=2,float8_w8a8_block128"
    assert mt.w8a8_block_of(key) == 128 and mt.w8a8_block_of(mt.shape_key(8, 256, 256, 2, torch.bfloat16)) is None
    small = {"block_m": 32, "gate_up": [64, 128, 8, 2], "down": [128, 64, 4, 5]}
    large = {"block_m": 128, "gate_up": [128, 128, 8, 4], "down": [64, 128, 4, 3]}
    bf16 = {"block_m": 16, "gate_up": [32, 256, 4, 3], "down": [64, 128, 4, 2]}
    path = tmp_path / "tuned.json"
    path.write_text(json.dumps({"device": "GPU X", "shapes": {
        key: {"4": small, "512": large}, mt.shape_key(8, 256, 256, 2, torch.bfloat16): {"4": bf16}}}))
    monkeypatch.setenv(mt.TUNED_ENV, str(path))
    mt.tuned_table.cache_clear()
    try:
        table = mt.w8a8_table("GPU X", 8, 256, 256, 2, 128)
        assert table[4] == mt.ExpertsConfig(mt.GemmConfig(32, 64, 128, 8, 2), mt.GemmConfig(32, 128, 64, 4, 5))
        rule = {n: mt.w8a8_config(n, 8, 2, 128) for n in (1, 33, 600)}
        # By the class's top on a log scale: 33 tokens are in 64's class (8x from 512, 16x from 4),
        # 600 in 1,024's; 20 is its own class (5x from 4).
        assert [mt.w8a8_config(n, 8, 2, 128, table).gate_up.block_m for n in (1, 4, 5, 33, 63, 64, 65, 600)] == \
            [32, 32, 32, 128, 128, 128, 128, 128]
        assert mt.w8a8_config(20, 8, 2, 128, table).gate_up.block_m == 32
        assert mt.w8a8_config(600, 8, 2, 128, {}) == rule[600]
        assert mt.w8a8_table("GPU Y", 8, 256, 256, 2, 128) == {}  # tuned on another GPU model
        assert mt.w8a8_table("GPU X", 8, 256, 512, 2, 128) == {}  # another shape
        assert mt.w8a8_table(None, 8, 256, 256, 2, 128) == {}  # off CUDA, or the interpreter
        assert mt.w8a8_table("GPU X", 8, 256, 256, 2, 64) == {}  # another scale block

        w13 = torch.zeros(8, 512, 256, dtype=torch.float8_e4m3fn)
        assert mt.experts_config(1, w13, 2, torch.bfloat16, 128, w8a8=True) == rule[1]  # CPU: the rule
        monkeypatch.setattr(mt, "_tuned_device", lambda w: "GPU X")
        assert mt.experts_config(1, w13, 2, torch.bfloat16, 128, w8a8=True) == table[4]
        assert mt.experts_config(600, w13, 2, torch.bfloat16, 128, w8a8=True) == table[512]
        # W8A16 steps keep the bf16 entries (block_k capped at the scale block).
        assert mt.experts_config(1, w13, 2, torch.bfloat16, 128).gate_up == mt.GemmConfig(16, 32, 128, 4, 3)
        path.write_text(json.dumps({"device": "GPU X", "shapes": {key: {}}}))
        mt.tuned_table.cache_clear()
        assert mt.experts_config(600, w13, 2, torch.bfloat16, 128, w8a8=True) == rule[600]  # none tuned: the rule
    finally:
        mt.tuned_table.cache_clear()


def test_w8a8_tuned_entries_are_checked(tmp_path, monkeypatch):
    """A W8A8 entry's K tiles take float8 ``tl.dot`` (K >= 32) within one scale block; the error
    names the file, the entry, the field, its value and what is allowed.  The same tiles under
    a bf16 key pass (no float8 dot), and any ``gate_up.block_n`` passes (one that splits the
    scale blocks leaves the SwiGLU output to a quantization launch)."""
    import json

    pytest.importorskip("triton")
    from pprun.layers import moe_triton as mt

    entry = {"block_m": 64, "gate_up": [128, 128, 4, 3], "down": [128, 128, 4, 3]}
    key = mt.w8a8_shape_key(8, 256, 256, 2, 128)
    path = tmp_path / "tuned.json"

    def table(e: dict, shape: str = key) -> dict:
        path.write_text(json.dumps({"device": "GPU X", "shapes": {shape: {"64": e}}}))
        monkeypatch.setenv(mt.TUNED_ENV, str(path))
        mt.tuned_table.cache_clear()
        return mt.tuned_table("GPU X", shape)

    try:
        assert table(entry | {"gate_up": [64, 32, 4, 3]})[64].gate_up == mt.GemmConfig(64, 64, 32, 4, 3)
        for bad, match in (
            (entry | {"gate_up": [128, 16, 4, 3]},
             r"gate_up\.block_k=16 with W8A8 \(128x128 block scales, float8 activations\) must be one of \[32, 64, 128\]"),
            (entry | {"down": [128, 256, 4, 3]}, r"down\.block_k=256 with W8A8 .* must be one of \[32, 64, 128\]"),
        ):
            with pytest.raises(ValueError, match=rf"tuned.json: tuned MoE entry '64'=.*{match}"):
                table(bad)
            bf16_key = mt.shape_key(8, 256, 256, 2, torch.bfloat16)
            assert table(bad, bf16_key)[64] == mt.parse_tuned({"64": bad}, "x")[64]  # bf16 tiles: no such bound
        with pytest.raises(ValueError, match=r"gate_up\.block_k=64 with W8A8 \(32x32 block scales.*must be one of \[32\]"):
            table(entry | {"gate_up": [128, 64, 4, 3]}, mt.w8a8_shape_key(8, 256, 256, 2, 32))
        with pytest.raises(ValueError, match=r"gate_up\.block_m=48 must be a power of two"):  # the shared checks too
            table(entry | {"block_m": 48})
    finally:
        mt.tuned_table.cache_clear()


@triton_only
def test_w8a8_inputs_are_checked():
    """Float8 activations take block-scaled experts, whole scale blocks and scales of their shape."""
    from pprun.layers import moe_triton as mt

    x, w13, w2, weights, ids, scales, _ = make_case(3, 256, 128, 4, 2, torch.float32, 128)
    xq, xs = quantize_reference(x, 128)
    align = mt.layout(ids, 4, 16)
    cfg = mt.GemmConfig(16, 128, 128, 4)
    with pytest.raises(ValueError, match=r"float8 x \(W8A8\) take block-scaled float8 experts"):
        mt.gate_up(mt.Fp8Rows(xq, xs, x.dtype), w13, align, 2, cfg, torch.ones(4, 256, 1, device=DEVICE), None)
    with pytest.raises(ValueError, match=r"float8 x .* with scales \(3, 1\): W8A8 with 128x128 blocks"):
        mt.gate_up(mt.Fp8Rows(xq, xs[:, :1], x.dtype), w13, align, 2, cfg, scales["w13_scale"], 128)
    with pytest.raises(ValueError, match=r"block_k=16 with float8 x \(W8A8\): float8 tl.dot takes K tiles of at least 32"):
        mt.gate_up(mt.Fp8Rows(xq, xs, x.dtype), w13, align, 2, cfg._replace(block_k=16), scales["w13_scale"], 128)
    with pytest.raises(ValueError, match=r"float8 act torch.float32 \(6, 128\)"):
        mt.down(mt.Fp8Rows(torch.zeros(6, 128, device=DEVICE), torch.ones(6, 1, device=DEVICE), x.dtype), w2,
                weights, align, 2, cfg, False, scales["w2_scale"], 128)


def _specialised(kernel, args: tuple) -> tuple:
    """What Triton specialises a launch of ``kernel`` on among its integer arguments ``args``
    (positional, in ``kernel.arg_names`` order): each one's ``== 1`` and multiple of 16, but
    those the kernel declares ``do_not_specialize`` (a JIT function's attribute, an interpreted
    one's keyword)."""
    names = getattr(kernel, "do_not_specialize", None)
    if names is None:
        names = getattr(kernel, "kwargs", {}).get("do_not_specialize")
    free = {kernel.arg_names[n] if isinstance(n, int) else n for n in names or ()}
    return tuple((name, value == 1, value % 16 == 0) for name, value in zip(kernel.arg_names, args)
                 if isinstance(value, int) and not isinstance(value, bool) and name not in free)


@pytest.mark.parametrize("split", [False, True])
def test_w8a8_launches_specialise_alike_across_a_count_class(monkeypatch, split):
    """The warm-up runs one token count per class (``pprun.utils.first_use.count_class``: above 32
    tokens, a power-of-two bucket and whether the count is a multiple of 16), so each kernel a
    W8A8 layer launches must specialise alike on every count of a class, else a count the warm-up
    did not run compiles its variant in traffic.  Checked for the rule's tiles and for column
    tiles that split the scale blocks (``split``: the SwiGLU output quantized in a launch of its
    own over the ``T * top_k`` entries, whose count is a multiple of 16 for some counts of a
    class and not for others).  The kernels are replaced by recorders: none runs."""
    pytest.importorskip("triton")
    from triton.runtime import KernelInterface

    from pprun.layers import fp8_quant
    from pprun.layers import moe_triton as mt
    from pprun.utils.first_use import count_class

    launches: list[tuple[str, tuple]] = []

    class Recorder:
        def __init__(self, name, kernel):
            self.name, self.kernel = name, kernel

        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append((self.name, _specialised(self.kernel, args)))

    for module in (mt, fp8_quant):
        for name, obj in list(vars(module).items()):
            if name.endswith("_kernel") and isinstance(obj, KernelInterface):
                monkeypatch.setattr(module, name, Recorder(name, obj))
    monkeypatch.setattr(mt, "FP8_W8A8_MIN_TOKENS", 1)
    num_experts, top_k, hidden, inter = 16, 8, 256, 256
    w13 = torch.zeros(num_experts, 2 * inter, hidden, dtype=torch.float8_e4m3fn)
    w2 = torch.zeros(num_experts, hidden, inter, dtype=torch.float8_e4m3fn)
    scales = {"w13_scale": torch.ones(num_experts, 2 * inter // 128, hidden // 128),
              "w2_scale": torch.ones(num_experts, hidden // 128, inter // 128), "scale_block": 128}
    config = mt.GemmConfig(16, 64, 128, 4, 3) if split else None
    by_class: dict[str, dict[str, set]] = {}
    for n in range(33, 273):
        launches.clear()
        ids = torch.arange(n * top_k).view(n, top_k) % num_experts
        mt.fused_experts(torch.zeros(n, hidden, dtype=torch.bfloat16), w13, w2, torch.ones(n, top_k), ids, config,
                         **scales)
        names = [name for name, _ in launches]
        assert names.count("_quantize_groups_kernel") == (2 if split else 1)
        assert {"_gate_up_kernel", "_down_kernel"} <= set(names)
        for name, spec in launches:
            by_class.setdefault(count_class(n), {}).setdefault(name, set()).add(spec)
    assert len(by_class) == 8  # 64, 128, 256 and 512's classes, multiples of 16 and not
    for cls, kernels in by_class.items():
        for name, specs in kernels.items():
            assert len(specs) == 1, (cls, name, specs)


@pytest.mark.parametrize("block_m", [16, 64])
def test_w8a8_kernels_compile_for_sm90_to_fp8_tensor_core_mmas(block_m):
    """Both W8A8 GEMMs compile for sm_90 (``sm90_compile``); with 64-row blocks (prefill tiles)
    their K loops are warpgroup MMAs on e4m3 operands, no float8 tile converted (16-row blocks
    take ``mma.sync`` on converted tiles); gate_up's epilogue rounds to e4m3."""
    from sm90_compile import compile_sm90

    pointers = {"sorted_ptr": "*i32", "block_expert_ptr": "*i32", "num_rows_ptr": "*i32", "weights_ptr": "*fp32",
                "x_ptr": "*fp8e4nv", "w_ptr": "*fp8e4nv", "act_ptr": "*fp8e4nv", "s_ptr": "*fp32", "xs_ptr": "*fp32",
                "act_s_ptr": "*fp32"}
    gemm = {"BLOCK_M": block_m, "BLOCK_N": 128, "BLOCK_K": 128, "DOT_F32": False, "TOP_K": 8, "DIRECT": False,
            "W_SCALE": 2, "SCALE_BLOCK": 128, "ACT_DTYPE": "tl.bfloat16", "A_FP8": True}
    options = {"num_warps": 4, "num_stages": 3 if block_m == 16 else 4, "enable_fp_fusion": False}
    for kernel, extra in (("_gate_up_kernel", {"PRECISE_EXP": True, "ACT_FP8": True}),
                          ("_down_kernel", {"PARTIALS": True})):
        ptx = compile_sm90("pprun.layers.moe_triton", kernel, {**gemm, **extra}, options=options, pointers=pointers,
                           default_pointer="*bf16", divisible=("hidden", "inter"))
        assert "mma" in ptx, kernel
        if block_m == 64:
            assert "wgmma.mma_async" in ptx and ".f32.e4m3.e4m3" in ptx, kernel
            assert "cvt.rn.bf16x2.e4m3x2" not in ptx and "cvt.rn.f16x2.e4m3x2" not in ptx, kernel
        if kernel == "_gate_up_kernel":
            assert "e4m3x2.f32" in ptx  # the SwiGLU output rounded to float8


# --- on the GPU ------------------------------------------------------------------------------------

gpu_fp8 = pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)),
                             reason="needs a GPU with FP8 tensor cores (compute capability 8.9+)")


@pytest.mark.gpu
@gpu_fp8
@pytest.mark.parametrize("num_tokens, num_experts, top_k", [(1, 128, 8), (32, 128, 8), (256, 128, 8), (3000, 128, 8)])
def test_fused_experts_w8a8_gpu_shapes(monkeypatch, num_tokens, num_experts, top_k):
    """Qwen3-30B-A3B's widths (hidden 2048, expert intermediate 768, 128 experts top-8) W8A8 in
    bf16 with the default tiles (16-row blocks at decode sizes, 64-row FP8 warpgroup MMAs past),
    a prefill past the align kernel: the dequantized experts' output within the same 8%."""
    from pprun.layers import moe_triton as mt

    monkeypatch.setattr(mt, "FP8_W8A8_MIN_TOKENS", 1)
    x, w13, w2, weights, ids, scales, (d13, d2) = make_case(num_tokens, 2048, 768, num_experts, top_k,
                                                            torch.bfloat16, 128)
    got = mt.fused_experts(x, w13, w2, weights, ids, **scales)
    want = experts_reference(x.float(), d13, d2, weights, ids)
    err = got.float() - want
    assert (err.norm() / want.norm()).item() < 0.08
    assert err.abs().max() < 0.08 * want.abs().max()
