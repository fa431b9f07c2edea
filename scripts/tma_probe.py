"""Decode-sized matmuls (32 rows) with the weight tiles fetched by TMA, against pprun's kernels.

pprun's swapped-form skinny matmuls (``pprun.layers.skinny``) stream their weights with
``cp.async`` issued by every thread.  This probe times the same shapes, splits and tiles with
the weight tiles (and optionally the activation tiles) loaded through tensor descriptors
(Hopper's TMA: one instruction per tile, completion on an mbarrier), so that Triton's
pipeliner can keep more tiles in flight per SM for the same registers.  Each matmul is timed
alone inside one CUDA graph of back-to-back launches that cycle through enough weight copies
to defeat L2 (weights come from HBM, as in a decode step), with PDL as in pprun
(``layer_bench.time_us``, as ``scripts/sweep_skinny.py`` times the same kernels).

Prints one JSON object: per shape, the pprun kernel's us and TB/s and each variant's, and each
variant's largest difference from pprun's output.  Needs a Hopper GPU.

    python3 scripts/tma_probe.py [--rows 32] [--stages 3,4,5,6] [--out FILE]
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from pprun.layers import SplitPartials
from pprun.layers.fused import silu_mul
from pprun.layers.skinny import _plan, skinny_linear
from pprun.layers.triton_utils import pdl_options, pdl_sync

sys.path.insert(0, str(Path(__file__).resolve().parent))
from layer_bench import SHAPES, copies_for, time_us, write_result  # noqa: E402

FORMS = {"qkv": (False, "attention"), "o_proj": (False, "norm"), "gate_up": (True, None), "down": (False, "norm"),
         "lm_head": (False, None)}
"""Per matmul of :data:`layer_bench.SHAPES`: (SwiGLU epilogue, ``defer_merge``) as the model runs it
at 32 rows.  It holds the last weight tile except ahead of the fused decode attention, as
``models.llama`` passes it (``hold_last``)."""


@triton.jit
def _tma_kernel(w_desc, x_desc, x_ptr, out_ptr, M, K, N_OUT, stride_xm, K_PER,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
                SWIGLU: tl.constexpr, X_TMA: tl.constexpr, USE_PDL: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    n0 = pid_n * BLOCK_N
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N_OUT
    k_begin = pid_k * K_PER
    k_end = tl.minimum(k_begin + K_PER, K)
    pdl_sync(USE_PDL)
    acc_t = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    acc_up_t = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        if X_TMA:
            x = x_desc.load([0, k0])
        else:
            offs_k = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=m_mask[:, None], other=0.0)
        w = w_desc.load([n0, k0])
        acc_t = tl.dot(w, tl.trans(x), acc_t)
        if SWIGLU:
            wu = w_desc.load([N_OUT + n0, k0])
            acc_up_t = tl.dot(wu, tl.trans(x), acc_up_t)
    acc = tl.trans(acc_t)
    out_mask = m_mask[:, None] & n_mask[None, :]
    if SPLIT_K == 1:
        y = acc.to(out_ptr.dtype.element_ty)
        if SWIGLU:
            y = silu_mul(y, tl.trans(acc_up_t).to(out_ptr.dtype.element_ty), True)
        tl.store(out_ptr + offs_m[:, None] * N_OUT + offs_n[None, :], y, mask=out_mask)
    else:
        tl.store(out_ptr + pid_k * M * N_OUT + offs_m[:, None] * N_OUT + offs_n[None, :], acc, mask=out_mask)


def _tma_linear(x, w, swiglu, plan, out, x_tma: bool, stages: int):
    cfg, k_per, split = plan
    m, k = x.shape
    n_out = w.shape[0] // 2 if swiglu else w.shape[0]
    block_m = max(16, triton.next_power_of_2(m))
    w_desc = TensorDescriptor.from_tensor(w, [cfg.block_n, cfg.block_k])
    x_desc = TensorDescriptor(x, [m, k], [x.stride(0), 1], [block_m, cfg.block_k])
    _tma_kernel[(triton.cdiv(n_out, cfg.block_n), split)](
        w_desc, x_desc, x, out, m, k, n_out, x.stride(0), k_per,
        BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT_K=split, SWIGLU=swiglu, X_TMA=x_tma,
        num_warps=cfg.num_warps, num_stages=stages, **pdl_options(x.device),
    )
    return out


def _probe_shape(name: str, args: argparse.Namespace, dev: torch.device) -> dict:
    """pprun's kernel and each TMA variant on one of :data:`SHAPES`."""
    k, n = SHAPES[name]
    swiglu, defer = FORMS[name]
    hold = defer != "attention"
    n_out = n // 2 if swiglu else n
    ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(copies_for(n * k * 2))]
    x = torch.randn(args.rows, k, device=dev, dtype=torch.bfloat16)
    plan = _plan(args.rows, n_out, k, swiglu, dev, None, False, defer, hold)
    cfg, _, split = plan
    ref = skinny_linear(x, ws[0], swiglu=swiglu, defer_merge=defer, hold_last=hold)
    ref = ref.parts if isinstance(ref, SplitPartials) else ref
    row = {"config": {"block_n": cfg.block_n, "block_k": cfg.block_k, "split": split,
                      "stages": cfg.num_stages, "warps": cfg.num_warps}, "weight_mb": n * k * 2 / 1e6}
    us = time_us([functools.partial(skinny_linear, x, w, swiglu=swiglu, defer_merge=defer, hold_last=hold)
                  for w in ws], args.reps)
    row["pprun"] = {"us": round(us, 2), "tb_s": round(n * k * 2 / us / 1e6, 3)}
    out = torch.empty((args.rows, n_out) if split == 1 else (split, args.rows, n_out), device=dev,
                      dtype=torch.bfloat16 if split == 1 else torch.float32)
    for x_tma in (False, True):
        for stages in (int(s) for s in args.stages.split(",")):
            key = f"tma_w{'_x' if x_tma else ''}_s{stages}"
            try:
                got = _tma_linear(x, ws[0], swiglu, plan, out, x_tma, stages)
                torch.cuda.synchronize()
                diff = (got.float() - ref.float()).abs().max().item()
                us = time_us([functools.partial(_tma_linear, x, w, swiglu, plan, out, x_tma, stages) for w in ws],
                             args.reps)
                row[key] = {"us": round(us, 2), "tb_s": round(n * k * 2 / us / 1e6, 3), "max_diff": diff}
            except Exception as e:  # a setting Triton cannot compile (shared memory) is reported, not fatal
                row[key] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--stages", default="3,4,5,6")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--reps", type=int, default=10, help="graph replays per timing")
    ap.add_argument("--out")
    args = ap.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    result = {"rows": args.rows, "device": torch.cuda.get_device_name(dev), "triton": triton.__version__}
    for name in args.shapes.split(","):
        result[name] = _probe_shape(name, args, dev)
        print(name, json.dumps(result[name]), flush=True)
        torch.cuda.empty_cache()
    write_result(result, args.out)


if __name__ == "__main__":
    main()
