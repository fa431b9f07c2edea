"""The persistent MLP-half launch (``pprun.layers.persistent``) against the three launches it
replaces, on CUDA or under the Triton interpreter (the default without CUDA)."""

from __future__ import annotations

import pytest
import torch
from triton_env import DEVICE, HAS_CUDA, RUN_TRITON  # noqa: E402  (sets TRITON_INTERPRET)

triton_only = pytest.mark.skipif(
    not RUN_TRITON, reason="needs CUDA or triton (the interpreter, unless PPRUN_TEST_TRITON_INTERPRET=0)"
)
DTYPE = torch.bfloat16 if HAS_CUDA else torch.float32  # the interpreter's low-precision dots are not faithful


def _three_launches(parts, residual, norm_w, eps, gate_up, down, block_k, splits):
    from pprun.layers.fused import fused_add_rms_norm
    from pprun.layers.skinny import SkinnyConfig, skinny_linear

    h, new_residual = fused_add_rms_norm(parts, residual, norm_w, eps)
    act = skinny_linear(h, gate_up, swiglu=True, config=SkinnyConfig(64, block_k, 1, swap_ab=True))
    out = skinny_linear(act, down, config=SkinnyConfig(64, block_k, splits, swap_ab=True), defer_merge="norm")
    return out, new_residual


@triton_only
@pytest.mark.parametrize("m", [2, 17, 32])
@pytest.mark.parametrize("num_programs", [1, 3, 7, None, 1000])  # 1000: more than the tasks
@pytest.mark.parametrize("wait_in_norm", [False, True])
def test_persistent_mlp_matches_three_launches(m, num_programs, wait_in_norm, monkeypatch):
    from pprun.layers import SplitPartials, fused, persistent

    monkeypatch.setattr(persistent, "MLP_WAIT_IN_NORM", wait_in_norm)
    from pprun.layers.skinny import arrival_counters

    monkeypatch.setattr(persistent, "MLP_BLOCK_K", 64)
    monkeypatch.setattr(fused, "NORM_PARTS_NUM_WARPS", 4)  # the persistent norm's warps (GPU sum order)
    hidden, inter, splits = 192, 1024, persistent.DOWN_SPLITS  # K: 3 tiles for gate_up, 2 per down split
    g = torch.Generator().manual_seed(m)
    parts = SplitPartials(torch.randn(4, m, hidden, generator=g).to(DEVICE), None, DTYPE)
    residual = torch.randn(m, hidden, generator=g).to(DTYPE).to(DEVICE)
    norm_w = (torch.rand(hidden, generator=g) + 0.5).to(DTYPE).to(DEVICE)
    gate_up = (torch.randn(2 * inter, hidden, generator=g) / hidden**0.5).to(DTYPE).to(DEVICE)
    down = (torch.randn(hidden, inter, generator=g) / inter**0.5).to(DTYPE).to(DEVICE)
    want_parts, want_res = _three_launches(parts, residual, norm_w, 1e-5, gate_up, down, 64, splits)
    for _ in range(2):  # the counters must be back at zero after each launch
        got_parts, got_res = persistent.persistent_mlp(parts, residual, norm_w, 1e-5, gate_up, down,
                                                       num_programs=num_programs)
        assert torch.equal(got_res, want_res)
        assert got_parts.parts.shape == want_parts.parts.shape
        assert torch.equal(got_parts.parts, want_parts.parts)
        assert torch.equal(got_parts.merge(), want_parts.merge())
    assert not arrival_counters(parts.parts.device, 1).any()


@triton_only
def test_persistent_mlp_rejects_bad_input():
    from pprun.layers import SplitPartials, persistent

    hidden, inter = 64, 1024
    parts = SplitPartials(torch.zeros(2, 4, hidden, device=DEVICE), None, DTYPE)
    residual = torch.zeros(4, hidden, dtype=DTYPE, device=DEVICE)
    norm_w = torch.ones(hidden, dtype=DTYPE, device=DEVICE)
    gate_up = torch.zeros(2 * inter, hidden, dtype=DTYPE, device=DEVICE)
    down = torch.zeros(hidden, inter, dtype=DTYPE, device=DEVICE)
    with pytest.raises(ValueError, match="2 to 32 rows"):
        persistent.persistent_mlp(SplitPartials(torch.zeros(2, 1, hidden, device=DEVICE), None, DTYPE),
                                  residual[:1], norm_w, 1e-5, gate_up, down)
    with pytest.raises(ValueError, match="gate_up_weight must be"):
        persistent.persistent_mlp(parts, residual, norm_w, 1e-5, gate_up[:-1], down)
    with pytest.raises(ValueError, match="multiple of DOWN_SPLITS"):
        persistent.persistent_mlp(parts, residual, norm_w, 1e-5, gate_up[: 2 * 1000], down[:, :1000].contiguous())
    with pytest.raises(ValueError, match="without a bias"):
        persistent.persistent_mlp(SplitPartials(parts.parts, norm_w, DTYPE), residual, norm_w, 1e-5, gate_up, down)


@pytest.mark.gpu
def test_tiny_llama_persistent_mlp_matches_three_launches(monkeypatch, tmp_path):
    """A whole bf16 model on CUDA, three one-token requests: every layer's MLP half as one
    persistent launch gives the logits of the three launches, bit for bit, with their launch
    settings pinned to the persistent kernel's (gate_up unsplit, the norm's warps)."""
    from test_fused_ops import _tiny_llama_on_cuda
    from tiny_models import make_tiny_llama

    import pprun.layers
    from pprun.layers import fused, persistent, skinny

    monkeypatch.setattr(fused, "NORM_PARTS_NUM_WARPS", 4)
    monkeypatch.setattr(skinny, "SWAPPED_TARGET_PROGRAMS", 16)  # gate_up's 16 column blocks: one split
    model_dir = make_tiny_llama(tmp_path / "wide", num_layers=2, hidden_size=256, intermediate_size=1024)
    arch, model_logits = _tiny_llama_on_cuda(model_dir, torch.bfloat16, [[42], [7], [9]], "triton")
    want = model_logits()
    calls = []
    real = persistent.persistent_mlp

    def spy(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(persistent, "persistent_mlp", spy)
    monkeypatch.setattr(pprun.layers, "PERSISTENT_MLP_ENABLED", True)
    got = model_logits()
    assert len(calls) == arch.num_hidden_layers
    assert torch.equal(got, want)


@pytest.mark.parametrize("prefetch, wait_in_norm", [(0, False), (1024, True)])
def test_persistent_mlp_compiles_for_sm90(prefetch, wait_in_norm):
    """The persistent kernel compiles for an H100/H200 without a GPU (``sm90_compile``) at the
    1.1B model's batch-32 settings: its matmul tasks on ``wgmma`` fed by ``cp.async``, its
    counters on atomics, and a PDL wait; with the L2 prefetch before the tasks' waits, the bulk
    prefetches assemble."""
    from sm90_compile import compile_sm90

    const = dict(NUM_PARTS=8, BLOCK_H=2048, BLOCK_M=32, BLOCK_N=64, BLOCK_K=128, NUM_STAGES=4, DOWN_SPLITS=8,
                 DOWN_K_PER=1024, DOT_F32=False, PRECISE_EXP=True, EXACT_MUL=True, USE_PDL=True, CTR=32,
                 GU_PREFETCH=prefetch, DOWN_PREFETCH=prefetch, WAIT_IN_NORM=wait_in_norm)
    ptx = compile_sm90("pprun.layers.persistent", "_persistent_mlp_kernel", const,
                       pointers={"part_ptr": "*fp32", "out_part_ptr": "*fp32", "ctr_ptr": "*i32"},
                       default_pointer="*bf16", float_args=("inv_hidden", "eps"), divisible=("H", "INTER"),
                       options={"num_warps": 4})
    assert "wgmma.mma_async" in ptx and "cp.async.cg.shared.global" in ptx
    assert "atom.global" in ptx and "griddepcontrol.wait" in ptx
    assert ("cp.async.bulk.prefetch.L2" in ptx) == bool(prefetch)
