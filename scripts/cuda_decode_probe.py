"""Time a decode attention written in CUDA (``scripts/cuda_decode_attn.cu``) against pprun's
Triton one, at batch 32, alone and behind the qkv matmul, as ``decode_attn_sweep.py`` does.

    python scripts/cuda_decode_probe.py [--batch 32] [--ctx 560] [--out result.json]

The fifteenth session found the Triton decode attention latency-bound (~2,800 instructions per
warp, 12 barriers per K/V tile, ~2 warps per scheduler) and concluded that a faster one needs
layouts Triton does not choose.  This probe measures that claim before anything is adopted:
the CUDA kernel reads the same inputs (the qkv matmul's fp32 split partials, rotary tables,
the paged cache, block table), writes the new token's K/V to the cache and the attention
output.  It checks that the cache write is bit-identical to the Triton kernel's and that the
output agrees to bf16 rounding, then times every compiled variant (warps per CTA, blocks in
flight per warp, blocks issued before the PDL wait).  Needs nvcc and an sm_90 GPU (the kernel
is compiled with ``torch.utils.cpp_extension.load_inline``).  Prints JSON.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import layer_bench as lb  # noqa: E402

import pprun.attention.triton_ops as ops  # noqa: E402
from pprun.layers import SplitPartials  # noqa: E402

VARIANTS = [(8, 2, 1), (8, 3, 1), (8, 3, 2), (4, 3, 1), (4, 4, 2), (4, 2, 1), (16, 2, 1)]
"""(warps per CTA, K/V blocks of 16 tokens in flight per warp, of which issued before the PDL
wait): the kernel's settings timed, the launcher's ``variant`` in this order."""

_LAUNCHER = r"""
#include <torch/extension.h>
#include <cuda_runtime.h>

template <int NW, int D, int P>
static void launch_t(const DecodeArgs& a, int batch, cudaStream_t stream) {
  auto fn = decode_attn_kernel<NW, D, P>;
  const int smem = NW * D * 8 * 32 * 16;
  TORCH_CHECK(cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, smem) == cudaSuccess);
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(a.num_kv_heads, batch, 1);
  cfg.blockDim = dim3(NW * 32, 1, 1);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;  // the kernel waits with griddepcontrol
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  TORCH_CHECK(cudaLaunchKernelEx(&cfg, fn, a) == cudaSuccess, "launch failed");
}

void launch(torch::Tensor parts, c10::optional<torch::Tensor> bias, c10::optional<torch::Tensor> cos_t,
            c10::optional<torch::Tensor> sin_t, torch::Tensor positions, torch::Tensor slots,
            torch::Tensor cache, torch::Tensor block_table, torch::Tensor seq_lens, torch::Tensor out,
            double scale, int64_t variant, int64_t stream_handle) {
  DecodeArgs a;
  a.parts = parts.data_ptr<float>();
  a.bias = bias ? reinterpret_cast<const __nv_bfloat16*>(bias->data_ptr()) : nullptr;
  a.num_parts = parts.size(0);
  a.width = parts.size(2);
  a.part_stride = parts.stride(0);
  a.cos_t = cos_t ? cos_t->data_ptr<float>() : nullptr;
  a.sin_t = sin_t ? sin_t->data_ptr<float>() : nullptr;
  a.positions = positions.data_ptr<int64_t>();
  a.slots = slots.data_ptr<int64_t>();
  a.cache = reinterpret_cast<__nv_bfloat16*>(cache.data_ptr());
  a.v_offset = cache.stride(0);
  a.block_table = block_table.data_ptr<int>();
  a.bt_stride = block_table.stride(0);
  a.seq_lens = seq_lens.data_ptr<int>();
  a.out = reinterpret_cast<__nv_bfloat16*>(out.data_ptr());
  a.num_kv_heads = cache.size(3);
  a.scale_log2 = (float)(scale * 1.4426950408889634);
  const int batch = seq_lens.size(0);
  cudaStream_t stream = reinterpret_cast<cudaStream_t>(stream_handle);
  switch (variant) {
{cases}    default: TORCH_CHECK(false, "unknown variant ", variant);
  }
}
"""
LAUNCHER = _LAUNCHER.replace("{cases}", "".join(
    f"    case {i}: launch_t<{nw}, {depth}, {pre}>(a, batch, stream); break;\n"
    for i, (nw, depth, pre) in enumerate(VARIANTS)))
"""The launcher, its ``variant`` switch made from :data:`VARIANTS` (which instantiates them)."""



def build():
    from torch.utils.cpp_extension import load_inline

    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0a")
    src = (Path(__file__).resolve().parent / "cuda_decode_attn.cu").read_text()
    return load_inline(
        name="pprun_cuda_decode_probe",
        cpp_sources="void launch(torch::Tensor parts, c10::optional<torch::Tensor> bias, "
                    "c10::optional<torch::Tensor> cos_t, c10::optional<torch::Tensor> sin_t, torch::Tensor positions, "
                    "torch::Tensor slots, torch::Tensor cache, torch::Tensor block_table, torch::Tensor seq_lens, "
                    "torch::Tensor out, double scale, int64_t variant, int64_t stream_handle);",
        cuda_sources=src + LAUNCHER,
        functions=["launch"],
        extra_cuda_cflags=["-O3", "-std=c++17"],
        verbose=False,
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--ctx", type=int, default=560)
    ap.add_argument("--max-len", type=int, default=688)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        sys.exit("cuda_decode_probe.py needs an sm_90 (Hopper) GPU: the kernel uses griddepcontrol and is built for sm_90a")
    if shutil.which("nvcc") is None:
        sys.exit("cuda_decode_probe.py needs nvcc on PATH: the kernel is compiled at run time")
    ext = build()
    d = lb.decode_attention_inputs(args.batch, args.ctx, args.max_len)
    ws, qkv, pairs = lb.qkv_before_attention(args.batch, d.kvs)
    scale = lb.HEAD_DIM**-0.5

    def triton_attend(parts: SplitPartials, kv) -> None:
        q, k, v = lb.qkv_views(parts.parts[0], args.batch)
        ops.paged_decode_attention_rope(q, k, v, d.cos, d.sin, d.pos, kv, d.slots, d.table, d.seq_lens, scale, d.o,
                                        qkv_parts=parts)

    def cuda_attend(parts: SplitPartials, kv, variant: int, out=None) -> None:
        ext.launch(parts.parts, parts.bias, d.cos, d.sin, d.pos, d.slots, kv, d.table, d.seq_lens,
                   d.o if out is None else out, scale, variant,
                   torch.cuda.current_stream().cuda_stream)

    fixed = qkv(ws[0])
    assert isinstance(fixed, SplitPartials), "batch 32's qkv should split K (deferred merge)"
    kv_t, kv_c = d.kvs[0].clone(), d.kvs[0].clone()
    triton_attend(fixed, kv_t)
    want = d.o.clone()
    res: dict = {"device": torch.cuda.get_device_name(), "batch": args.batch, "ctx": args.ctx,
                 "kv_bytes": d.kv_bytes, "qkv_splits": fixed.parts.shape[0], "variants": []}
    res["triton"] = {
        "alone_us": round(lb.time_us([lambda kv=kv: triton_attend(fixed, kv) for kv in d.kvs]), 2),
        "pair_us": round(lb.time_us([lambda w=w, kv=kv: triton_attend(qkv(w), kv) for w, kv in pairs]), 2),
    }
    res["qkv_alone_us"] = round(lb.time_us([lambda w=w: qkv(w) for w in ws]), 2)
    print(res, flush=True)
    for i, (nw, depth, pre) in enumerate(VARIANTS):
        row = {"warps": nw, "depth": depth, "pre_wait": pre}
        try:
            got = torch.empty_like(d.o)
            kv_c.copy_(d.kvs[0])
            cuda_attend(fixed, kv_c, i, out=got)
            torch.cuda.synchronize()
            row["cache_equal"] = bool(torch.equal(kv_c, kv_t))
            diff = (got.float() - want.float()).abs()
            row["max_diff"] = diff.max().item()
            row["max_rel"] = (diff / want.float().abs().clamp_min(1e-2)).max().item()
            row["alone_us"] = round(lb.time_us([lambda kv=kv, i=i: cuda_attend(fixed, kv, i) for kv in d.kvs]), 2)
            row["pair_us"] = round(lb.time_us([lambda w=w, kv=kv, i=i: cuda_attend(qkv(w), kv, i) for w, kv in pairs]), 2)
            row["kv_tb_s_alone"] = round(d.kv_bytes / row["alone_us"] / 1e6, 2)
        except Exception as e:  # noqa: BLE001 - a variant the device rejects is reported, not fatal
            row["error"] = repr(e)[:300]
        res["variants"].append(row)
        print(row, flush=True)
    lb.write_result(res, args.out)


if __name__ == "__main__":
    main()
