"""``pprun.layers.fp8_block_gemm``: the Triton W8A8 matmul of 1x128-quantized activations by
128x128 block-scaled float8 weights, against the product of the dequantized operands (on CPU
under Triton's interpreter, whose float8 products are exact: fp32 accumulation order is all that
differs), its errors, ``Fp8Linear``'s dispatch to it, and its compilation for sm_90 (FP8 tensor-core
MMAs on e4m3 operands)."""

from __future__ import annotations

import pytest
import torch
from triton_env import DEVICE, triton_only  # noqa: E402  (sets TRITON_INTERPRET)

GROUP = 128


def block_quantized(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``w [N, K]`` -> (float8 weight, scales ``[ceil(N / 128), K / 128]``, the dequantized weight)."""
    n, k = w.shape
    nb, kb = -(-n // GROUP), k // GROUP
    padded = torch.zeros(nb * GROUP, k, dtype=torch.float32, device=w.device)
    padded[:n] = w.float()
    blocks = padded.view(nb, GROUP, kb, GROUP)
    scale = (blocks.abs().amax(dim=(1, 3)) / 448.0).clamp(min=1e-10)
    q = (blocks / scale[:, None, :, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
    deq = (q.float() * scale[:, None, :, None]).view(nb * GROUP, k)[:n]
    return q.view(nb * GROUP, k)[:n].contiguous(), scale, deq


def activations(m: int, k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=g).to(device=DEVICE, dtype=dtype)


@triton_only
@pytest.mark.parametrize("m, n, k", [(1, 256, 512), (2, 384, 256), (16, 128, 128), (40, 200, 384), (130, 256, 256)])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_the_dequantized_product(m, n, k, bias):
    """Rows from one to past a 128-row tile, widths off the column tile (200) and off a scale block,
    K of one to four groups; fp32 out: the error is fp32 rounding of the same sums."""
    from pprun.layers.fp8_block_gemm import block_fp8_matmul
    from pprun.layers.fp8_quant import quantize_groups

    torch.manual_seed(m * 1000 + n)
    x = activations(m, k, torch.float32, seed=m + k)
    wq, ws, w_deq = block_quantized(torch.randn(n, k, device=DEVICE))
    b = torch.randn(n, device=DEVICE) if bias else None
    xq, xs = quantize_groups(x, GROUP)  # column-major scales, as Fp8Linear passes them
    got = block_fp8_matmul(xq, xs, wq, ws, torch.float32, b)
    x_deq = (xq.float().view(m, -1, GROUP) * xs[..., None]).view(m, k)
    want = x_deq @ w_deq.T + (b if bias else 0)
    assert got.shape == (m, n)
    # The interpreter multiplies in fp32; Hopper's FP8 MMA keeps fewer bits while it sums a K tile
    # (the scales are applied, and the tiles summed, in fp32 outside it).
    tol = 1e-4 if DEVICE == "cpu" else 3e-3
    torch.testing.assert_close(got, want, rtol=10 * tol, atol=tol * want.abs().max().item())


@triton_only
def test_bf16_out_and_padded_rows():
    """bf16 activations' scales, a bf16 output, and quantization's padded rows left out (``num_rows``)."""
    from pprun.layers.fp8_block_gemm import block_fp8_matmul
    from pprun.layers.fp8_quant import quantize_groups

    m, n, k = 5, 256, 256
    x = activations(m, k, torch.bfloat16, seed=3)
    wq, ws, w_deq = block_quantized(torch.randn(n, k, device=DEVICE))
    xq, xs = quantize_groups(x, GROUP, row_multiple=16)
    assert xq.shape[0] == 16
    got = block_fp8_matmul(xq, xs, wq, ws, torch.bfloat16, num_rows=m)
    x_deq = (xq[:m].float().view(m, -1, GROUP) * xs[:m, :, None]).view(m, k)
    want = x_deq @ w_deq.T
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=1e-2 * want.abs().max().item())


def test_shapes_that_do_not_fit_are_named():
    pytest.importorskip("triton")
    from pprun.layers.fp8_block_gemm import block_fp8_matmul

    xq = torch.zeros(4, 256, dtype=torch.float8_e4m3fn)
    xs = torch.ones(4, 2)
    wq = torch.zeros(128, 256, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="x has 200 columns, the weight 256"):
        block_fp8_matmul(torch.zeros(4, 200, dtype=torch.float8_e4m3fn), xs, wq, torch.ones(1, 2), torch.float32)
    with pytest.raises(ValueError, match=r"scales \(4, 2\) and \(2, 2\) do not fit"):
        block_fp8_matmul(xq, xs, wq, torch.ones(2, 2), torch.float32)
    with pytest.raises(ValueError, match="contiguous along K"):
        block_fp8_matmul(xq, xs, torch.zeros(256, 128, dtype=torch.float8_e4m3fn).t(), torch.ones(1, 2), torch.float32)


@triton_only
@pytest.mark.parametrize("max_m, expect_triton", [(0, False), (64, True)])
def test_fp8_linear_takes_it_up_to_its_row_limit(monkeypatch, max_m, expect_triton):
    """A block-scaled ``Fp8Linear`` of 8 rows runs the Triton kernel when ``TRITON_MAX_M`` admits
    them (its output then the dequantized product's), and cuBLAS's matmul otherwise (0, the default)."""
    from pprun.layers import fp8_block_gemm
    from pprun.layers.fp8_linear import Fp8Linear

    n, k = 256, 512
    wq, ws, w_deq = block_quantized(torch.randn(n, k, device=DEVICE))
    lin = Fp8Linear(k, n, bias=True, block_scaled=True).to(DEVICE)
    lin.weight.data.copy_(wq)
    lin.weight_scale.data.copy_(ws)
    lin.bias.data.copy_(torch.randn(n))
    calls = []
    original = fp8_block_gemm.block_fp8_matmul
    monkeypatch.setattr(fp8_block_gemm, "block_fp8_matmul", lambda *a, **kw: calls.append(a) or original(*a, **kw))
    monkeypatch.setattr(fp8_block_gemm, "TRITON_MAX_M", max_m)
    if not expect_triton:
        monkeypatch.setattr(torch, "_scaled_mm", lambda *a, **kw: (_ for _ in ()).throw(RuntimeError("cuBLAS path")))
        with pytest.raises(RuntimeError, match="cuBLAS path"):
            lin(activations(8, k, torch.bfloat16, seed=1))
        assert not calls
        return
    x = activations(8, k, torch.bfloat16, seed=1)
    got = lin(x.view(2, 4, k))
    assert got.shape == (2, 4, n) and got.dtype == torch.bfloat16 and len(calls) == 1
    xq, xs = calls[0][0], calls[0][1]  # what the layer quantized its activations to
    x_deq = (xq.float().view(8, -1, GROUP) * xs[..., None]).view(8, k)
    want = torch.nn.functional.linear(x_deq, w_deq, lin.bias.float())
    torch.testing.assert_close(got.view(8, n).float(), want, rtol=1e-2, atol=1e-2 * want.abs().max().item())


@pytest.mark.parametrize("rows", [16, 64, 256])
def test_compiles_for_sm90_to_fp8_tensor_core_mmas(rows):
    """Each row class's tiles compile for sm_90 into warpgroup MMAs on e4m3 operands (no conversion)."""
    from sm90_compile import compile_sm90

    pytest.importorskip("triton")
    from pprun.layers.fp8_block_gemm import GROUP as group
    from pprun.layers.fp8_block_gemm import launch_config

    cfg = launch_config(rows)
    options = {"num_warps": cfg.pop("num_warps"), "num_stages": cfg.pop("num_stages")}
    ptx = compile_sm90("pprun.layers.fp8_block_gemm", "_block_fp8_matmul_kernel",
                       {**cfg, "HAS_BIAS": False, "GROUP_K": group}, options=options,
                       pointers={"xq_ptr": "*fp8e4nv", "w_ptr": "*fp8e4nv", "xs_ptr": "*fp32", "ws_ptr": "*fp32"},
                       default_pointer="*bf16", divisible=("K",))
    # Hopper's warpgroup MMA on float8 operands (a 16-row tile would give mma.sync on fp16 converts).
    assert "wgmma.mma_async" in ptx and ".f32.e4m3.e4m3" in ptx
    assert "cvt.rn.bf16x2.e4m3x2" not in ptx and "cvt.rn.f16x2.e4m3x2" not in ptx
