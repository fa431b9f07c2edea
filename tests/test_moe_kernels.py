"""The grouped expert kernels (``pprun.layers.moe_triton``) against the reference loop
(``pprun.layers.moe.experts_reference``), and their sort by expert against torch's.

They run on CUDA (``-m gpu`` runs the larger shapes there), or on CPU under the Triton
interpreter at tiny sizes (the default without CUDA; ``PPRUN_TEST_TRITON_INTERPRET=0`` skips)::

    pytest tests/test_moe_kernels.py
"""

from __future__ import annotations

import itertools

import pytest
import torch
from triton_env import DEVICE, HAS_CUDA, triton_only  # noqa: E402  (sets TRITON_INTERPRET)

from pprun.layers.moe import experts_reference, route

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def make_experts(num_tokens: int, hidden: int, inter: int, num_experts: int, top_k: int, dtype: torch.dtype,
                 seed: int = 0, renormalize: bool = True):
    """Random activations, expert weights and a routing of ``num_tokens`` tokens (on DEVICE)."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(DEVICE)

    x = randn(num_tokens, hidden)
    w13 = randn(num_experts, 2 * inter, hidden, scale=hidden**-0.5)
    w2 = randn(num_experts, hidden, inter, scale=inter**-0.5)
    logits = torch.randn(num_tokens, num_experts, generator=gen).to(DEVICE)
    weights, ids = route(logits, top_k, renormalize)
    return x, w13, w2, weights, ids


def check_alignment(ids: torch.Tensor, num_experts: int, align) -> None:
    """Every entry once, in its expert's blocks, in entry order within an expert; padding rows
    ``N``; blocks past the rows in use ``-1``."""
    flat = ids.reshape(-1).cpu()
    num_entries = flat.numel()
    rows = align.sorted_entries.cpu()
    num_rows = int(align.num_rows.item())
    assert num_rows % align.block_m == 0 and num_rows <= rows.numel()
    block_expert = align.block_expert.cpu()
    real = rows[rows < num_entries]
    assert sorted(real.tolist()) == list(range(num_entries))
    assert (rows[num_rows:] == num_entries).all()
    for block in range(block_expert.numel()):
        part = rows[block * align.block_m : (block + 1) * align.block_m]
        if block * align.block_m >= num_rows:
            assert block_expert[block] == -1
            continue
        expert = int(block_expert[block])
        entries = part[part < num_entries]
        assert (flat[entries.long()] == expert).all()
    for expert in range(num_experts):
        mine = real[flat[real.long()] == expert]
        assert mine.tolist() == sorted(mine.tolist())  # stable: entry order within an expert


@triton_only
@pytest.mark.parametrize("num_tokens, num_experts, top_k, block_m", [
    (1, 5, 2, 16), (7, 6, 3, 16), (40, 3, 2, 16), (33, 128, 8, 16), (9, 7, 7, 32),
    (300, 128, 8, 16),  # padded rows past several of the tail loop's 1,024-row strides
])
def test_align_kernel_sorts_by_expert_as_torch_does(num_tokens, num_experts, top_k, block_m):
    from pprun.layers.moe_triton import align_by_expert, align_by_expert_torch

    _, _, _, _, ids = make_experts(num_tokens, 16, 16, num_experts, top_k, torch.float32, seed=num_tokens)
    got = align_by_expert(ids, num_experts, block_m)
    want = align_by_expert_torch(ids, num_experts, block_m)
    check_alignment(ids, num_experts, got)
    check_alignment(ids, num_experts, want)
    assert torch.equal(got.sorted_entries, want.sorted_entries)
    assert torch.equal(got.block_expert, want.block_expert)
    assert torch.equal(got.num_rows, want.num_rows)


@triton_only
@pytest.mark.parametrize("logits_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens, num_experts, top_k, renormalize", [
    (1, 5, 2, True), (9, 6, 3, False), (4, 128, 8, True), (3, 7, 1, False),
])
def test_route_kernel_matches_torch_routing(logits_dtype, num_tokens, num_experts, top_k, renormalize):
    """One launch per step: the same experts, in the same (descending) order, and their weights."""
    from pprun.layers import moe_triton

    gen = torch.Generator().manual_seed(num_experts)
    logits = (torch.randn(num_tokens, num_experts, generator=gen) * 2).to(logits_dtype)
    want_w, want_ids = route(logits, top_k, renormalize)
    got_w, got_ids = moe_triton.fused_route(logits.to(DEVICE), top_k, renormalize)
    assert got_ids.dtype == torch.int64 and got_w.dtype == torch.float32
    assert torch.equal(got_ids.cpu(), want_ids)
    torch.testing.assert_close(got_w.cpu(), want_w, atol=1e-6, rtol=1e-5)


@triton_only
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's numpy on NaN
def test_route_kernel_names_real_experts_for_a_nan_row():
    """A padding row of NaN (garbage in a captured graph's padded rows) still routes to experts
    that exist, so the kernels after it stay within the weights."""
    from pprun.layers import moe_triton

    logits = torch.randn(3, 6)
    logits[1] = float("nan")
    _, ids = moe_triton.fused_route(logits.to(DEVICE), 2, True)
    assert ((ids >= 0) & (ids < 6)).all()


def run_case(num_tokens, hidden, inter, num_experts, top_k, dtype, config=None, seed=0):
    from pprun.layers.moe_triton import fused_experts

    x, w13, w2, weights, ids = make_experts(num_tokens, hidden, inter, num_experts, top_k, dtype, seed=seed)
    got = fused_experts(x, w13, w2, weights, ids, config)
    want = experts_reference(x.float(), w13.float(), w2.float(), weights, ids).to(dtype)
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
    else:  # the reference in the same dtype rounds alike; the fp32 one bounds both
        same = experts_reference(x, w13, w2, weights, ids)
        torch.testing.assert_close(got.float(), want.float(), atol=TOLERANCE[dtype] * 4, rtol=TOLERANCE[dtype])
        torch.testing.assert_close(got.float(), same.float(), atol=TOLERANCE[dtype] * 4, rtol=TOLERANCE[dtype])


@triton_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens, hidden, inter, num_experts, top_k", [
    (1, 32, 24, 5, 2),     # one decode row, 5 experts
    (6, 40, 36, 6, 3),     # odd widths (masked tiles), top-3
    (19, 32, 20, 3, 1),    # several rows per expert, top-1
])
def test_fused_experts_match_the_reference_loop(dtype, num_tokens, hidden, inter, num_experts, top_k):
    run_case(num_tokens, hidden, inter, num_experts, top_k, dtype)


@triton_only
def test_fused_experts_over_blocks_of_several_experts_and_k_tiles():
    """Rows spanning several 16-row blocks of one expert, and hidden/inter over several K tiles
    (BLOCK_K 32 in fp32)."""
    from pprun.layers.moe_triton import GemmConfig

    run_case(37, 72, 40, 4, 2, torch.float32, config=GemmConfig(block_m=16, block_n=16, block_k=32, num_warps=4))


@triton_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("in_dtype", [False, True])
def test_fused_experts_left_to_the_next_norm_as_partials(dtype, in_dtype, monkeypatch):
    """``then="norm"``: each token's ``top_k`` weighted expert rows come back unsummed,
    ``[top_k, T, hidden]`` split partials (fp32, or with ``PARTIALS_IN_DTYPE`` each row rounded to
    the activation dtype as the summed path rounds it); the fused add + RMSNorm sums them as it
    reads them and gives the norm of the summed output."""
    from pprun.kernels.partials import SplitPartials
    from pprun.layers import fused, moe_triton
    from pprun.layers.moe_triton import fused_experts

    monkeypatch.setattr(moe_triton, "PARTIALS_IN_DTYPE", in_dtype)
    x, w13, w2, weights, ids = make_experts(6, 40, 36, 5, 3, dtype, seed=2)
    parts = fused_experts(x, w13, w2, weights, ids, then="norm")
    assert isinstance(parts, SplitPartials) and parts.parts.shape == (3, 6, 40) and parts.dtype == dtype
    assert parts.parts.dtype == (dtype if in_dtype else torch.float32)
    summed = fused_experts(x, w13, w2, weights, ids)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(parts.merge().float(), summed.float(), atol=tol * 4, rtol=tol)
    if in_dtype and DEVICE == "cpu":
        # The same rows, summed in fp32 and rounded once: the summed path's output (torch's
        # CUDA sum may add them in another order).
        torch.testing.assert_close(parts.merge(), summed, atol=0, rtol=0)
    residual = torch.randn(6, 40, generator=torch.Generator().manual_seed(1)).to(dtype).to(DEVICE)
    norm_weight = torch.rand(40, generator=torch.Generator().manual_seed(2)).add(0.5).to(dtype).to(DEVICE)
    got, got_residual = fused.fused_add_rms_norm(parts, residual, norm_weight, 1e-6)
    want, want_residual = fused.fused_add_rms_norm(parts.merge(), residual, norm_weight, 1e-6)
    # The same rounding steps; in bf16 the interpreter's conversions may land one ulp apart.
    tol = 1e-6 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got_residual, want_residual, atol=tol, rtol=tol)
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


@triton_only
def test_fused_experts_sum_their_rows_past_partials_max_tokens(monkeypatch):
    """Past PARTIALS_MAX_TOKENS a ``then="norm"`` step gets the summed output, not partials."""
    from pprun.kernels.partials import SplitPartials
    from pprun.layers import moe_triton

    x, w13, w2, weights, ids = make_experts(6, 40, 36, 5, 3, torch.float32, seed=2)
    monkeypatch.setattr(moe_triton, "PARTIALS_MAX_TOKENS", 6)
    assert isinstance(moe_triton.fused_experts(x, w13, w2, weights, ids, then="norm"), SplitPartials)
    monkeypatch.setattr(moe_triton, "PARTIALS_MAX_TOKENS", 5)
    summed = moe_triton.fused_experts(x, w13, w2, weights, ids, then="norm")
    assert isinstance(summed, torch.Tensor) and summed.shape == (6, 40)
    torch.testing.assert_close(summed, moe_triton.fused_experts(x, w13, w2, weights, ids))


@triton_only
@pytest.mark.parametrize("chunked", [True, False])
def test_fused_experts_past_the_align_kernel(monkeypatch, chunked):
    """Past ALIGN_KERNEL_MAX_ENTRIES the chunked sort (or, without ALIGN_CHUNKED_ENABLED, torch's)
    lays the rows out for the same kernels."""
    from pprun.layers import moe_triton

    monkeypatch.setattr(moe_triton, "ALIGN_KERNEL_MAX_ENTRIES", 4)
    monkeypatch.setattr(moe_triton, "ALIGN_CHUNKED_ENABLED", chunked)
    monkeypatch.setattr(moe_triton, "ALIGN_CHUNK", 4)
    run_case(5, 32, 24, 5, 2, torch.float32)


@triton_only
@pytest.mark.parametrize("num_tokens, num_experts, top_k, block_m, chunk", [
    (33, 128, 8, 16, 64),   # 264 entries: 4 whole chunks and a partial one
    (40, 3, 2, 16, 16),     # few experts, every chunk hitting each
    (300, 128, 8, 16, 1024),  # one partial chunk; padded rows past the tail loop's strides
    (9, 7, 7, 32, 64),      # 63 entries in one partial chunk
    (64, 12, 4, 64, 128),   # exactly two chunks
])
def test_chunked_sort_lays_out_as_torch_does(monkeypatch, num_tokens, num_experts, top_k, block_m, chunk):
    """The two-launch sort over chunks of entries: the same stable layout as torch's sort."""
    from pprun.layers import moe_triton

    monkeypatch.setattr(moe_triton, "ALIGN_KERNEL_MAX_ENTRIES", 0)
    monkeypatch.setattr(moe_triton, "ALIGN_CHUNK", chunk)
    _, _, _, _, ids = make_experts(num_tokens, 16, 16, num_experts, top_k, torch.float32, seed=num_tokens + 1)
    got = moe_triton.align_by_expert(ids, num_experts, block_m)
    want = moe_triton.align_by_expert_torch(ids, num_experts, block_m)
    check_alignment(ids, num_experts, got)
    assert torch.equal(got.sorted_entries, want.sorted_entries)
    assert torch.equal(got.block_expert, want.block_expert)
    assert torch.equal(got.num_rows, want.num_rows)


@triton_only
@pytest.mark.parametrize("block_n", [32, 16])
def test_fused_experts_with_narrow_tiles_at_small_batches(monkeypatch, block_n):
    """``SPARSE_BLOCK_N`` (fewer assignments than experts: narrower column tiles, more programs)
    computes the same experts' outputs, on widths that leave a partial last tile."""
    from pprun.layers import moe_triton

    monkeypatch.setattr(moe_triton, "SPARSE_BLOCK_N", block_n)
    assert moe_triton.default_config(4, 8, torch.float32).block_n == block_n
    assert moe_triton.default_config(16, 8, torch.float32).block_n == 64  # as many rows as experts
    run_case(2, 40, 36, 8, 2, torch.float32)


@triton_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens, top_k", [(1, 3), (3, 2)])  # (3, 2): experts shared by tokens
def test_fused_experts_without_the_sort_at_a_few_assignments(monkeypatch, dtype, num_tokens, top_k):
    """Up to DIRECT_MAX_ENTRIES assignments each is its own block with its expert read from the
    routing (no sort): the same outputs, also where two tokens chose one expert; and as partials."""
    from pprun.layers import moe_triton

    sorts = []
    monkeypatch.setattr(moe_triton, "align_by_expert", lambda *a: sorts.append(a))
    monkeypatch.setattr(moe_triton, "DIRECT_MAX_ENTRIES", 6)
    run_case(num_tokens, 40, 36, 3, top_k, dtype)
    x, w13, w2, weights, ids = make_experts(num_tokens, 40, 36, 3, top_k, dtype)
    parts = moe_triton.fused_experts(x, w13, w2, weights, ids, then="norm")
    summed = moe_triton.fused_experts(x, w13, w2, weights, ids)  # rounded per row, then summed
    torch.testing.assert_close(parts.merge().float(), summed.float(), atol=TOLERANCE[dtype] * 4, rtol=TOLERANCE[dtype])
    assert sorts == []


@triton_only
def test_fused_experts_with_settings_per_gemm():
    """Each GEMM its own tile widths, warps and stages (one block_m: they share the sort); two
    block_m values are refused before anything runs."""
    from pprun.layers.moe_triton import ExpertsConfig, GemmConfig, fused_experts

    split = ExpertsConfig(GemmConfig(16, 16, 32, 4, 2), GemmConfig(16, 32, 16, 8, 3))
    run_case(9, 40, 36, 5, 2, torch.float32, config=split)
    x, w13, w2, weights, ids = make_experts(3, 32, 24, 4, 2, torch.float32)
    with pytest.raises(ValueError, match=r"block_m 16 \(gate_up\) != 32 \(down\)"):
        fused_experts(x, w13, w2, weights, ids, ExpertsConfig(GemmConfig(16, 16, 32, 4), GemmConfig(32, 16, 32, 4)))


def test_tuned_settings_file(tmp_path, monkeypatch):
    """A tuned-settings file (``PPRUN_MOE_CONFIGS``) gives each token count's settings by shape,
    over the shipped ones token count by token count, on the GPU model it names only; the nearest
    token count on a log scale serves the others; a missing file or a malformed entry is an error
    naming it and the field."""
    import json

    from pprun.layers import moe_triton

    key = moe_triton.shape_key(6, 48, 64, 2, torch.bfloat16)
    assert key == "E=6,N=48,H=64,K=2,bfloat16"
    entry = {"block_m": 16, "gate_up": [32, 64, 4, 3], "down": [64, 128, 8, 2], "gate_up_us": 1.0}
    wide = {"block_m": 32, "gate_up": [128, 64, 8, 4], "down": [128, 64, 8, 4]}
    path = tmp_path / "tuned.json"

    def table(shapes: dict, device: str = "GPU X", name: str = "GPU X", shape: str = key):
        path.write_text(json.dumps({"device": device, "shapes": shapes}))
        monkeypatch.setenv(moe_triton.TUNED_ENV, str(path))
        moe_triton.tuned_table.cache_clear()
        return moe_triton.tuned_table(name, shape)

    got = table({key: {"1": entry, "64": wide}})
    assert got[1] == moe_triton.ExpertsConfig(moe_triton.GemmConfig(16, 32, 64, 4, 3), moe_triton.GemmConfig(16, 64, 128, 8, 2))
    assert [moe_triton.nearest(got, t).gate_up.block_m for t in (1, 7, 8, 9, 64, 4096)] == [16, 16, 16, 32, 32, 32]
    assert table({key: {"1": entry}}, shape="E=8,N=48,H=64,K=2,bfloat16") == {}  # a shape it lacks
    assert table({key: {"1": entry}}, device="GPU Y") == {}  # tuned on another GPU: not used
    shipped = moe_triton.shape_key(128, 768, 2048, 8, torch.bfloat16)
    merged = table({shipped: {"1": entry}}, device="NVIDIA H200", name="NVIDIA H200", shape=shipped)
    assert merged[1].gate_up.block_n == 32 and merged[8192].gate_up.block_m == 128  # the shipped 8,192 stays
    for bad, match in ((entry | {"gate_up": [32]}, "TypeError"), (entry | {"block_m": 48}, "block_m=48 must be a power of two"),
                       (entry | {"down": [64, 128, 3, 2]}, "down.num_warps=3 must be one of")):
        with pytest.raises(ValueError, match=rf"tuned.json: tuned MoE entry '1'=.*{match}"):
            table({key: {"1": bad}})
    with pytest.raises(ValueError, match="token count 0 must be at least 1"):
        table({key: {"0": entry}})
    path.write_text("{not json")
    moe_triton.tuned_table.cache_clear()
    with pytest.raises(ValueError, match="tuned.json: not a readable JSON file"):
        moe_triton.tuned_table("GPU X", key)
    monkeypatch.setenv(moe_triton.TUNED_ENV, str(tmp_path / "absent.json"))
    moe_triton.tuned_table.cache_clear()
    with pytest.raises(FileNotFoundError, match="PPRUN_MOE_CONFIGS=.*absent.json: no such file"):
        moe_triton.tuned_table("GPU X", key)
    moe_triton.tuned_table.cache_clear()


def test_shipped_tuned_settings_parse():
    """Every shipped tuned-settings file parses, one GemmConfig pair per token count (W8A8 keys'
    entries with their constraints)."""
    import json

    from pprun.layers import moe_triton

    for path in sorted(moe_triton.TUNED_DIR.glob("*.json")):
        for key, shape in json.loads(path.read_text())["shapes"].items():
            assert moe_triton.parse_tuned(shape, str(path), moe_triton.w8a8_block_of(key))


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens, num_experts, top_k", [
    (1, 128, 8), (32, 128, 8), (256, 128, 8), (3000, 128, 8), (7, 8, 2), (64, 60, 4),
])
def test_fused_experts_gpu_shapes(dtype, num_tokens, num_experts, top_k):
    """Qwen3-30B-A3B-like widths (hidden 2048, expert intermediate 768), Mixtral's 8 experts
    top-2, an expert count off powers of two; decode rows and a prefill past the align kernel."""
    run_case(num_tokens, 2048, 768, num_experts, top_k, dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_fused_experts_replay_in_a_cuda_graph_for_any_routing():
    """Captured once, the kernels replay for a routing other than the captured one (no host
    sync and no shape depends on the routing)."""
    from pprun.layers.moe_triton import fused_experts

    x, w13, w2, weights, ids = make_experts(8, 256, 128, 16, 4, torch.bfloat16)
    fused_experts(x, w13, w2, weights, ids)  # compile before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_experts(x, w13, w2, weights, ids)
    _, _, _, new_weights, new_ids = make_experts(8, 256, 128, 16, 4, torch.bfloat16, seed=5)
    weights.copy_(new_weights)
    ids.copy_(new_ids)
    graph.replay()
    want = experts_reference(x, w13, w2, weights, ids)
    torch.testing.assert_close(out.float(), want.float(), atol=8e-2, rtol=2e-2)


# --- Qwen3's per-head q/k norm ----------------------------------------------------------------


@triton_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("whole_token", [None, 1])
def test_head_norm_kernel_matches_the_attention_reference(dtype, whole_token, monkeypatch):
    """``head_rms_norm_`` in place equals ``Attention.norm_heads``' plain torch (q and k heads
    each through their RMSNorm, v untouched); head_dim 20 (a masked tile); 6 q and k heads (a
    masked row of the whole-token tile)."""
    from pprun.layers import head_norm
    from pprun.layers.head_norm import head_rms_norm_
    from pprun.layers.norm import RMSNorm

    monkeypatch.setattr(head_norm, "WHOLE_TOKEN_MIN_TOKENS", whole_token)
    num_heads, num_kv_heads, head_dim = 4, 2, 20
    gen = torch.Generator().manual_seed(3)
    qkv = torch.randn(5, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen).to(dtype).to(DEVICE)
    q_norm, k_norm = RMSNorm(head_dim, 1e-6), RMSNorm(head_dim, 1e-6)
    with torch.no_grad():
        q_norm.weight.uniform_(0.5, 1.5, generator=gen)
        k_norm.weight.uniform_(0.5, 1.5, generator=gen)
    q_norm, k_norm = q_norm.to(dtype), k_norm.to(dtype)
    q, k, v = qkv.cpu().split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    want = torch.cat([q_norm(q.reshape(-1, head_dim))[0].reshape(5, -1),
                      k_norm(k.reshape(-1, head_dim))[0].reshape(5, -1), v], dim=-1)
    got = head_rms_norm_(qkv, q_norm.weight.to(DEVICE), k_norm.weight.to(DEVICE), 1e-6, num_heads, num_kv_heads, head_dim)
    assert got.data_ptr() == qkv.data_ptr()
    tol = 1e-6 if dtype == torch.float32 else 2e-2  # bf16: one ulp (rsqrt's last bits)
    torch.testing.assert_close(got.cpu(), want, atol=tol, rtol=tol)
    assert torch.equal(got.cpu()[:, -num_kv_heads * head_dim:], v)


# --- compiled for an H100/H200 without a GPU ----------------------------------------------------

_EXPERT_POINTERS = {"sorted_ptr": "*i32", "block_expert_ptr": "*i32", "num_rows_ptr": "*i32", "ids_ptr": "*i64",
                    "weights_ptr": "*fp32"}


def test_expert_kernels_compile_for_sm90():
    """The routing, the sort, both grouped GEMMs and Qwen3's head norms compile for sm_90
    (``sm90_compile``) in bf16, the GEMMs' K loops on tensor-core MMAs (fp32 differs only in
    taking IEEE fp32 dots); bf16 experts (``W_SCALE`` 0; float8 ones: ``test_moe_fp8.py``)."""
    from sm90_compile import compile_sm90

    options = {"num_warps": 4, "enable_fp_fusion": False}
    compile_sm90("pprun.layers.moe_triton", "_route_kernel",
                 {"TOP_K": 8, "TOP_K_P2": 8, "EXPERTS_P2": 128, "RENORMALIZE": True}, options={"num_warps": 1},
                 pointers={"ids_ptr": "*i64", "weights_ptr": "*fp32"}, default_pointer="*bf16")
    compile_sm90("pprun.layers.moe_triton", "_align_kernel",
                 {"EXPERTS_P2": 128, "BLOCK_M": 16, "CHUNK": 64, "FILL": 1024}, options=options, pointers=_EXPERT_POINTERS)
    chunk_pointers = {**_EXPERT_POINTERS, "chunk_counts_ptr": "*i32"}
    compile_sm90("pprun.layers.moe_triton", "_chunk_counts_kernel", {"EXPERTS_P2": 128, "CHUNK": 1024, "SUB": 64},
                 options=options, pointers=chunk_pointers)
    compile_sm90("pprun.layers.moe_triton", "_chunk_place_kernel",
                 {"EXPERTS_P2": 128, "BLOCK_M": 128, "CHUNK": 1024, "SUB": 64, "FILL": 1024}, options=options,
                 pointers=chunk_pointers)
    # The partials in the activation dtype (PARTIALS_IN_DTYPE) or fp32.
    compile_sm90("pprun.layers.moe_triton", "_down_kernel",
                 {**dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, DOT_F32=False), "TOP_K": 8, "PARTIALS": True,
                  "DIRECT": False, "W_SCALE": 0, "SCALE_BLOCK": 1, "ACT_DTYPE": "tl.bfloat16", "A_FP8": False},
                 options={"num_warps": 8, "num_stages": 4, "enable_fp_fusion": False},
                 pointers=_EXPERT_POINTERS, default_pointer="*bf16", divisible=("hidden", "inter"))
    gemm = {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64, "DOT_F32": False, "W_SCALE": 0, "SCALE_BLOCK": 1,
            "ACT_DTYPE": "tl.bfloat16", "A_FP8": False}
    for (kernel, extra, pointers), direct in itertools.product((
        ("_gate_up_kernel", {"TOP_K": 8, "PRECISE_EXP": True, "ACT_FP8": False}, {}),
        ("_down_kernel", {"TOP_K": 8, "PARTIALS": True}, {"y_ptr": "*fp32"}),  # partials for the next norm
    ), (False, True)):  # direct: the blocks' experts are the routing's int64 ids
        ptx = compile_sm90("pprun.layers.moe_triton", kernel, {**gemm, **extra, "DIRECT": direct}, options=options,
                           pointers={**_EXPERT_POINTERS, **pointers, **({"block_expert_ptr": "*i64"} if direct else {})},
                           default_pointer="*bf16", divisible=("hidden", "inter"))
        assert "mma" in ptx, kernel
    # Qwen3's q/k head norms, per head and per token (Qwen3-30B-A3B: 32 q + 4 k heads of 128).
    for per_program, warps in ((1, 1), (64, 8)):
        compile_sm90("pprun.layers.head_norm", "_head_rms_norm_kernel",
                     {"NUM_HEADS": 32, "NUM_QK_HEADS": 36, "HEADS_PER_PROGRAM": per_program, "BLOCK": 128,
                      "USE_PDL": True},
                     options={"num_warps": warps}, default_pointer="*bf16", float_args=("inv_head_dim", "eps"))

