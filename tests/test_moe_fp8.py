"""Float8 experts: the grouped expert kernels (``pprun.layers.moe_triton``) reading float8 e4m3
weights with their scales (per weight row, or per 128x128 block), the reference loop on them,
and an FP8 checkpoint's experts kept float8 at load (``LinearFactory.fp8_experts``,
``SparseMoeBlock``).

The reference is the dequantized experts, ``weight.float() * scale`` expanded here (independently
of pprun's helpers) and the plain loop of ``experts_reference`` in float32.  Triton's interpreter
converts every finite float8 e4m3 value to float32 and bfloat16 exactly
(``tests/test_skinny_fp8.py::test_interpreter_converts_every_float8_value_exactly``), so the
kernels run on CPU under it on real float8 tensors (no emulation), as ``test_moe_kernels.py``
runs the bf16 ones.

Tolerances: fp32 activations 1e-5 absolute and relative (outputs of order one; the kernels
multiply exact products in fp32, and only the order of fp32 sums and where the scale multiplies
differ from the reference); bf16 as ``test_moe_kernels.py`` (2e-2 relative, 8e-2 absolute: the
rounding of the SwiGLU output and of each expert's output to bf16).  The ``gpu`` tests run
Qwen3-30B-A3B's widths with the default launch settings, bf16, against the same reference.
"""

from __future__ import annotations

import pytest
import torch
from triton_env import DEVICE, HAS_CUDA, triton_only  # noqa: E402  (sets TRITON_INTERPRET)

from pprun.layers.moe import experts_reference, route

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
LAYOUTS = ("rows", "blocks")

gpu_fp8 = pytest.mark.skipif(not (HAS_CUDA and torch.cuda.get_device_capability() >= (8, 9)),
                             reason="needs a GPU that converts float8 (compute capability 8.9+)")


def _expand(scale: torch.Tensor, rows: int, cols: int, block: int | None, parts: int) -> torch.Tensor:
    """One expert's scales ``[rows', cols']`` as a ``[rows, cols]`` tensor: per row as they are;
    per block each of the ``parts`` stacked tensors (gate, up) over its own block rows."""
    if block is None:
        return scale.expand(rows, cols)
    part_rows = rows // parts
    per_part = scale.shape[0] // parts
    return torch.cat([scale[p * per_part:(p + 1) * per_part].repeat_interleave(block, 0)[:part_rows]
                      .repeat_interleave(block, 1)[:, :cols] for p in range(parts)])


def fp8_experts(num_experts: int, rows: int, cols: int, block: int | None, parts: int, seed: int):
    """Float8 experts ``[E, rows, cols]``, their float32 scales (per row ``[E, rows, 1]``, or per
    block, each part's own block rows), spread over two decades so a misplaced scale shows, and
    the dequantized fp32 experts (outputs of order one for unit activations)."""
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(num_experts, rows, cols, generator=g) * 448 / 4).clamp(-448, 448).to(torch.float8_e4m3fn)
    if block is None:
        scale_rows, scale_cols = rows, 1
    else:
        scale_rows, scale_cols = parts * -(-(rows // parts) // block), -(-cols // block)
    n = num_experts * scale_rows * scale_cols
    scale = torch.logspace(-1, 1, n)[torch.randperm(n, generator=g)].reshape(num_experts, scale_rows, scale_cols)
    scale = scale / (448 / 4) / cols**0.5 / 3
    deq = torch.stack([q[e].float() * _expand(scale[e], rows, cols, block, parts) for e in range(num_experts)])
    return q.to(DEVICE), scale.to(DEVICE), deq.to(DEVICE)


def make_case(num_tokens: int, hidden: int, inter: int, num_experts: int, top_k: int, dtype: torch.dtype,
              block: int | None, seed: int = 0):
    """Activations, float8 experts with their scales and dequantized twins, and a routing."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=gen).to(dtype).to(DEVICE)
    w13, s13, d13 = fp8_experts(num_experts, 2 * inter, hidden, block, 2, seed + 1)
    w2, s2, d2 = fp8_experts(num_experts, hidden, inter, block, 1, seed + 2)
    weights, ids = route(torch.randn(num_tokens, num_experts, generator=gen).to(DEVICE), top_k, True)
    scales = {"w13_scale": s13, "w2_scale": s2, "scale_block": block}
    return x, w13, w2, weights, ids, scales, (d13, d2)


def check_case(num_tokens, hidden, inter, num_experts, top_k, dtype, layout, config=None, block=128, seed=0):
    from pprun.layers.moe_triton import fused_experts

    block = None if layout == "rows" else block
    x, w13, w2, weights, ids, scales, (d13, d2) = make_case(num_tokens, hidden, inter, num_experts, top_k, dtype,
                                                            block, seed)
    got = fused_experts(x, w13, w2, weights, ids, config, **scales)
    want = experts_reference(x.float(), d13, d2, weights, ids)
    assert got.dtype == dtype and got.shape == want.shape
    assert want.abs().max() > 0.1  # outputs of order one: the tolerances mean what they say
    tol = TOL[dtype]
    torch.testing.assert_close(got.float(), want, atol=tol * (4 if dtype == torch.bfloat16 else 1), rtol=tol)
    return x, w13, w2, weights, ids, scales


@triton_only
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("num_tokens, num_experts, top_k", [
    (1, 5, 2),    # one decode row: each assignment its own block, no sort
    (7, 6, 3),    # sorted, a few rows per expert
    (64, 8, 2),   # several 16-row blocks per expert
])
def test_fp8_experts_match_the_dequantized_experts(layout, num_tokens, num_experts, top_k):
    """hidden 272 and inter 136: the last 128-block of each partial (the up rows' blocks start
    after the gate's partial one), K tiles over three blocks; fp32 activations."""
    check_case(num_tokens, 272, 136, num_experts, top_k, torch.float32, layout)


@triton_only
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("num_tokens", [1, 7])
def test_fp8_experts_with_bf16_activations(layout, num_tokens):
    """bf16 activations (upcast float8 tiles in bf16, the GPU's operands): the reference's
    fp32 outputs within bf16's rounding."""
    check_case(num_tokens, 272, 136, 4, 2, torch.bfloat16, layout)


@triton_only
def test_fp8_experts_over_many_small_scale_blocks():
    """32x32 blocks (kernels take any power of two): nine K blocks of hidden, K tiles of one
    block each, column tiles over two row blocks; several tile settings per GEMM."""
    from pprun.layers.moe_triton import ExpertsConfig, GemmConfig

    config = ExpertsConfig(GemmConfig(16, 64, 32, 4), GemmConfig(16, 32, 16, 4))
    check_case(9, 272, 72, 5, 2, torch.float32, "blocks", config=config, block=32)


@triton_only
@pytest.mark.parametrize("layout", LAYOUTS)
def test_fp8_experts_left_to_the_next_norm_as_partials(layout):
    """``then="norm"``: the unsummed rows of float8 experts sum to the summed output."""
    from pprun.kernels.partials import SplitPartials
    from pprun.layers.moe_triton import fused_experts

    x, w13, w2, weights, ids, scales = check_case(7, 144, 136, 5, 3, torch.float32, layout, seed=3)
    parts = fused_experts(x, w13, w2, weights, ids, then="norm", **scales)
    assert isinstance(parts, SplitPartials) and parts.parts.shape == (3, 7, 144)
    torch.testing.assert_close(parts.merge(), fused_experts(x, w13, w2, weights, ids, **scales),
                               atol=1e-6, rtol=1e-6)


@triton_only
def test_fp8_expert_settings_and_scales_are_checked():
    """K tiles of block-scaled experts lie in one block (the default settings cap ``block_k``;
    an explicit wider one is refused); scales must come with float8 experts, in their shapes."""
    from pprun.layers.moe_triton import GemmConfig, experts_config, fused_experts

    x, w13, w2, weights, ids, scales, _ = make_case(3, 144, 40, 4, 2, torch.float32, 32)
    assert all(c.block_k <= 16 for c in experts_config(3, w13, 2, torch.float32, 16))
    assert experts_config(3, w13, 2, torch.float32, 16).gate_up.block_m == experts_config(3, w13, 2,
                                                                                        torch.float32).gate_up.block_m
    with pytest.raises(ValueError, match=r"block_k=64 with 32x32 block-scaled float8 experts"):
        fused_experts(x, w13, w2, weights, ids, GemmConfig(16, 16, 64, 4), **scales)
    with pytest.raises(ValueError, match=r"float8 e4m3 weights take w13_scale and w2_scale"):
        fused_experts(x, w13, w2, weights, ids)
    with pytest.raises(ValueError, match=r"float8 e4m3 weights take w13_scale and w2_scale, others neither"):
        fused_experts(x, w13.float(), w2.float(), weights, ids, **scales)
    with pytest.raises(ValueError, match=r"w2_scale \(4, 5, 2\) torch.float32: .* take float32 \(4, 144, 1\)"):
        fused_experts(x, w13, w2, weights, ids, **{**scales, "scale_block": None,
                                                   "w13_scale": torch.ones(4, 80, 1, device=DEVICE)})


@pytest.mark.parametrize("layout", ("block", "channel", "tensor"))
def test_reference_loop_on_fp8_experts_equals_the_loaders_dequantized_ones(layout):
    """Without the fused kernels (CPU, ``PPRUN_DISABLE_FUSED``) float8 experts are dequantized one
    at a time into the activations' dtype: bit for bit the experts the loader would have made
    (``pprun.models.quantization.dequantize``, per checkpoint tensor), so the outputs are equal."""
    from pprun.models.quantization import dequantize
    from pprun.models.quantization_config import WeightScheme

    block = 128 if layout == "block" else None
    x, w13, w2, weights, ids, scales, _ = make_case(6, 272, 136, 4, 2, torch.bfloat16, block, seed=5)
    x, w13, w2, weights, ids = (t.cpu() for t in (x, w13, w2, weights, ids))
    scales = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in scales.items()}
    if layout == "tensor":  # one scale per checkpoint tensor, kept per row
        scales["w13_scale"] = scales["w13_scale"][:, [0] * 136 + [136] * 136]
        scales["w2_scale"] = scales["w2_scale"][:, [0] * 272]
    scheme = WeightScheme(layout, (128, 128) if block else None, "weight_scale", False)

    def loader_scale(s: torch.Tensor) -> torch.Tensor:
        return s.reshape(-1)[:1] if layout == "tensor" else s

    up_row = 2 if block else 136
    d13 = torch.stack([torch.cat([dequantize(w13[e, :136], loader_scale(scales["w13_scale"][e, :up_row]), scheme),
                                  dequantize(w13[e, 136:], loader_scale(scales["w13_scale"][e, up_row:]), scheme)])
                       for e in range(4)]).to(torch.bfloat16)
    d2 = torch.stack([dequantize(w2[e], loader_scale(scales["w2_scale"][e]), scheme) for e in range(4)]).to(torch.bfloat16)
    assert torch.equal(experts_reference(x, w13, w2, weights, ids, **scales), experts_reference(x, d13, d2, weights, ids))


# --- an FP8 checkpoint's experts kept float8 -------------------------------------------------------


def _moe_arch(num_experts: int = 3, inter: int = 136):
    from pprun.models.hf_config import MoeArch

    return MoeArch(num_experts=num_experts, top_k=2, expert_intermediate_size=inter, norm_topk_prob=True,
                   dense_layers=(), checkpoint_prefix="mlp", expert_names=("gate_proj", "up_proj", "down_proj"))


@pytest.mark.parametrize("layout", ("block", "channel", "tensor"))
def test_sparse_block_loads_fp8_experts_with_their_scales(layout):
    """Each expert's float8 gate, up and down and their scales land in ``w13`` / ``w2`` and their
    scales; dequantized, the block holds what the loader's dequantization of each checkpoint
    tensor makes; allocation keeps float8 and float32; a scale for experts that are not float8 is
    refused by name."""
    from pprun.models.base import allocate
    from pprun.models.moe import SparseMoeBlock
    from pprun.models.quantization import dequantize, quantize
    from pprun.models.quantization_config import WeightScheme

    hidden, inter = 272, 136
    scheme = WeightScheme(layout, (128, 128) if layout == "block" else None,
                          "weight_scale_inv" if layout == "block" else "weight_scale", False)
    with torch.device("meta"):
        block = SparseMoeBlock(_moe_arch(inter=inter), hidden, fp8=scheme)
    allocate(block, "cpu", torch.bfloat16)
    assert block.w13.dtype == block.w2.dtype == torch.float8_e4m3fn
    assert block.w13_scale.dtype == block.w2_scale.dtype == torch.float32 and block.gate.weight.dtype == torch.bfloat16
    g = torch.Generator().manual_seed(0)
    want13, want2 = [], []
    for e in range(3):
        parts = []
        for proj, shape in (("gate_proj", (inter, hidden)), ("up_proj", (inter, hidden)), ("down_proj", (hidden, inter))):
            q, s = quantize(torch.randn(*shape, generator=g) * torch.rand(shape[0], 1, generator=g), scheme)
            block.load_expert(e, proj, q)
            block.load_expert(e, proj, s, scheme.scale_name)
            parts.append(dequantize(q, s, scheme).to(torch.bfloat16))
        want13.append(torch.cat(parts[:2]))
        want2.append(parts[2])
    from pprun.layers.moe import dequantize_experts

    got13 = dequantize_experts(block.w13, block.w13_scale, block.scale_block, torch.bfloat16, parts=2)
    assert torch.equal(got13, torch.stack(want13))
    assert torch.equal(dequantize_experts(block.w2, block.w2_scale, block.scale_block, torch.bfloat16), torch.stack(want2))
    with torch.device("meta"):
        plain = SparseMoeBlock(_moe_arch(inter=inter), hidden)
    with pytest.raises(ValueError, match=r"expert tensor 0.gate_proj.weight_scale has no place .*not float8"):
        plain.load_expert(0, "gate_proj", torch.ones(inter, 1), "weight_scale")


def test_fp8_experts_are_kept_where_fp8_compute_runs(monkeypatch, switch, tmp_path):
    """``LinearFactory.fp8_experts``: experts stay float8 where the run computes in FP8, every
    expert of the block quantized alike with 128x128 blocks or per-row/tensor scales, and
    ``PPRUN_DISABLE_FP8_MOE`` unset; their weights are then handed over as stored."""
    from fp8_checkpoints import write_fp8
    from tiny_models import make_tiny_qwen3_moe

    from pprun.layers import fp8_linear
    from pprun.models.hf_config import load_arch_config
    from pprun.models.quantization import LinearFactory

    src = make_tiny_qwen3_moe(tmp_path / "src", num_layers=1, mlp_only_layers=())
    monkeypatch.setattr(fp8_linear, "fp8_compute_supported", lambda device, dtype: True)

    written = {}

    def scheme(layout: str, block=(128, 128), edit=None):
        if (layout, block) not in written:
            written[layout, block] = write_fp8(src, tmp_path / f"{layout}-{block[0]}", layout, block=block)[0]
        arch = load_arch_config(written[layout, block])
        if edit is not None:
            arch = edit(arch)
        factory = LinearFactory(arch, torch.device("cpu"), torch.bfloat16)
        return factory.fp8_experts("model.layers.0.mlp", arch.moe), factory.fp8_weight_names

    got, names = scheme("block")
    assert got.strategy == "block" and got.block == (128, 128)
    assert names == {f"model.layers.0.mlp.experts.{e}.{p}.weight" for e in range(5)
                     for p in ("gate_proj", "up_proj", "down_proj")}
    assert scheme("channel")[0].strategy == "channel" and scheme("tensor")[0].strategy == "tensor"
    assert scheme("block", block=(16, 16)) == (None, set())  # blocks the kernels do not take

    def ignore_one_expert(arch):
        import dataclasses

        quant = dataclasses.replace(arch.quantization, ignore=("model.layers.0.mlp.experts.3.up_proj",))
        return dataclasses.replace(arch, quantization=quant)

    assert scheme("channel", edit=ignore_one_expert) == (None, set())  # one expert in floating point
    switch("PPRUN_DISABLE_FP8_MOE", False)
    assert scheme("channel") == (None, set())


@pytest.mark.parametrize("layout", ("block", "channel", "tensor"))
def test_fp8_moe_checkpoint_keeps_its_experts_fp8_and_computes_the_dequantized_twin(monkeypatch, switch, tmp_path,
                                                                                   layout):
    """A whole FP8 Qwen3-MoE checkpoint loaded with its experts kept float8 (forced here on CPU,
    the dense linears left to the loader's dequantization): every sparse block's experts are
    float8 with their scales (fewer bytes than the twin's), and the model's logits equal its
    dequantized twin's bit for bit (the reference loop dequantizes as the loader does).  With
    ``PPRUN_DISABLE_FP8_MOE`` the experts load dequantized."""
    from fp8_checkpoints import write_fp8
    from test_fp8_checkpoints import _load
    from test_model_parity import BLOCK, prefill_batch
    from tiny_models import make_tiny_qwen3_moe

    from pprun.layers import fp8_linear
    from pprun.models.moe import SparseMoeBlock
    from pprun.worker.kv_cache import allocate_kv_caches

    monkeypatch.setattr(fp8_linear, "fp8_compute_supported", lambda device, dtype: True)
    monkeypatch.setattr(fp8_linear, "fits_fp8_compute", lambda *a: False)
    src = make_tiny_qwen3_moe(tmp_path / "src", num_layers=3, hidden_size=144, moe_intermediate_size=136)
    fp8_dir, twin = write_fp8(src, tmp_path / layout, layout, block=(128, 128))
    prompts = [[5, 9, 3, 200, 17, 42, 8], [1, 2, 3], [7] * 12]
    ids, pos, meta, num_blocks = prefill_batch(prompts)

    def logits(model_dir):
        model = _load(model_dir)
        arch = model.arch
        model.bind_kv_caches(allocate_kv_caches(arch, arch.num_hidden_layers, num_blocks, BLOCK, torch.float32, "cpu"))
        with torch.inference_mode():
            return model, model.compute_logits(model(ids, pos, None, None, meta))

    model, got = logits(fp8_dir)
    sparse = [layer.mlp for layer in model.layers if isinstance(layer.mlp, SparseMoeBlock)]
    assert len(sparse) == 2  # layer 1 is dense
    assert all(b.w13.dtype == b.w2.dtype == torch.float8_e4m3fn and b.w13_scale is not None for b in sparse)
    twin_model, want = logits(twin)
    twin_sparse = [layer.mlp for layer in twin_model.layers if isinstance(layer.mlp, SparseMoeBlock)]
    assert all(b.w13_scale is None and b.w13.dtype == torch.float32 for b in twin_sparse)
    assert sum(b.w13.nbytes + b.w2.nbytes for b in sparse) * 4 == sum(b.w13.nbytes + b.w2.nbytes for b in twin_sparse)
    assert torch.equal(got, want)
    switch("PPRUN_DISABLE_FP8_MOE", False)
    dequantized, again = logits(fp8_dir)
    assert all(layer.mlp.w13.dtype == torch.float32 for layer in dequantized.layers
               if isinstance(layer.mlp, SparseMoeBlock))
    assert torch.equal(again, want)


# --- compiled for an H100/H200 without a GPU ----------------------------------------------------


@pytest.mark.parametrize("w_scale", [1, 2])
def test_fp8_expert_kernels_compile_for_sm90(w_scale):
    """Both grouped GEMMs on float8 experts compile for sm_90 (``sm90_compile``): the float8 tiles
    converted in registers (``cvt`` from e4m3), then bf16 tensor-core MMAs."""
    from sm90_compile import compile_sm90

    pointers = {"sorted_ptr": "*i32", "block_expert_ptr": "*i32", "num_rows_ptr": "*i32", "weights_ptr": "*fp32",
                "w_ptr": "*fp8e4nv", "s_ptr": "*fp32"}
    gemm = {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "DOT_F32": False, "TOP_K": 8, "DIRECT": False,
            "W_SCALE": w_scale, "SCALE_BLOCK": 128 if w_scale == 2 else 1, "ACT_DTYPE": "tl.bfloat16", "A_FP8": False}
    for kernel, extra in (("_gate_up_kernel", {"PRECISE_EXP": True, "ACT_FP8": False}), ("_down_kernel", {"PARTIALS": True})):
        ptx = compile_sm90("pprun.layers.moe_triton", kernel, {**gemm, **extra},
                           options={"num_warps": 4, "num_stages": 3, "enable_fp_fusion": False}, pointers=pointers,
                           default_pointer="*bf16", divisible=("hidden", "inter"))
        assert "mma" in ptx and "e4m3" in ptx, kernel


# --- on the GPU ------------------------------------------------------------------------------------


@pytest.mark.gpu
@gpu_fp8
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("num_tokens, num_experts, top_k", [
    (1, 128, 8), (7, 128, 8), (64, 128, 8), (3000, 128, 8), (7, 8, 2), (64, 60, 4),
])
def test_fp8_experts_gpu_shapes(layout, num_tokens, num_experts, top_k):
    """Qwen3-30B-A3B's widths (hidden 2048, expert intermediate 768, 128 experts top-8: the
    shipped tuned settings, block_k capped for block scales), Mixtral's 8 experts top-2, an
    expert count off powers of two; decode rows and a prefill past the align kernel; bf16."""
    check_case(num_tokens, 2048, 768, num_experts, top_k, torch.bfloat16, layout)


@pytest.mark.gpu
@gpu_fp8
@pytest.mark.parametrize("layout", LAYOUTS)
def test_fp8_experts_replay_in_a_cuda_graph_for_any_routing(layout):
    """Captured once, the float8 kernels replay for another routing."""
    from pprun.layers.moe_triton import fused_experts

    block = None if layout == "rows" else 128
    x, w13, w2, weights, ids, scales, (d13, d2) = make_case(8, 256, 256, 16, 4, torch.bfloat16, block)
    fused_experts(x, w13, w2, weights, ids, **scales)  # compile before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_experts(x, w13, w2, weights, ids, **scales)
    _, _, _, new_weights, new_ids, _, _ = make_case(8, 256, 256, 16, 4, torch.bfloat16, block, seed=5)
    weights.copy_(new_weights)
    ids.copy_(new_ids)
    graph.replay()
    want = experts_reference(x.float(), d13, d2, weights, ids)
    torch.testing.assert_close(out.float(), want, atol=8e-2, rtol=2e-2)
