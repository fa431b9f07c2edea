"""Decode-sized matmuls with float8 weights, one GPU: the split-K kernels reading float8 (W8A16,
``pprun.layers.skinny``) against the same kernels on bf16 weights and against ``Fp8Linear``'s
cuBLAS path (activation quantization + ``torch._scaled_mm``), and, for 128x128 block scales, the
same layers through ``Fp8Linear``'s Triton W8A8 path (``pprun.layers.fp8_block_gemm``: ``fp8_blocks_triton``),
per layer of a model shape, as one JSON object.

    python scripts/fp8_decode_matmuls.py [--shape qwen3-8b] [--rows 1,2,8,32] [--sweep] [--out r.json]

Each timing is the median over CUDA-graph replays of 20 launches, each launch reading another of
enough weight copies that no launch finds its weights in L2; ``gbps`` counts the weight and
scale bytes one launch reads.  Every variant is first checked against the dequantized weights
(``rel_err``: largest error over the largest output).  ``--sweep`` also times other launch
settings of the FP8 kernels (``config``) beside the default ones.
"""

from __future__ import annotations

import argparse
import json
import statistics
from functools import partial
from pathlib import Path

import torch

from pprun.kernels.triton_utils import force_pdl
from pprun.layers import fp8_block_gemm, skinny
from pprun.layers.fp8_linear import BLOCK, Fp8Linear

SHAPES = {
    # name: [(layer, out_features, in_features, swiglu)]
    "qwen3-8b": [("qkv", 6144, 4096, False), ("o_proj", 4096, 4096, False), ("gate_up", 2 * 12288, 4096, True),
                 ("down", 4096, 12288, False)],
    "llama-1b": [("qkv", 3072, 2048, False), ("o_proj", 2048, 2048, False), ("gate_up", 2 * 8192, 2048, True),
                 ("down", 2048, 8192, False)],
}
L2_BYTES = 60 * 2**20


def quantized(w: torch.Tensor, block: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``w``'s float8 weight, scales (per row or 128x128 block) and dequantized bf16 weight."""
    n, k = w.shape
    if block:
        tiles = w.view(n // BLOCK, BLOCK, k // BLOCK, BLOCK)
        s = tiles.abs().amax((1, 3)).float() / 448
        q = (tiles / s[:, None, :, None]).view(n, k).to(torch.float8_e4m3fn)
        full = s.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)
    else:
        s = w.abs().amax(1, keepdim=True).float() / 448
        q = (w / s).to(torch.float8_e4m3fn)
        full = s
    return q, s.contiguous(), (q.float() * full).to(torch.bfloat16)


def time_launches(fns: list, replays: int = 30) -> float:
    """Median microseconds per launch of ``fns`` (each a closure over its own weights), captured
    in one CUDA graph of 20 launches cycling through them."""
    for fn in fns:
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with force_pdl(), torch.cuda.graph(graph):
        for i in range(20):
            fns[i % len(fns)]()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        graph.replay()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) * 1e3 / 20)
    return statistics.median(times)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).abs().max() / want.float().abs().max())


def sweep_configs(m: int, k: int, swiglu: bool) -> list[skinny.SkinnyConfig]:
    """Launch settings to try beside the default at ``m`` rows."""
    if m == 1 and k > 4096:  # long K: split
        return [skinny.SkinnyConfig(block_n, block_k, split) for block_n in (16, 32) for block_k in (256, 512, 1024)
                for split in (k // 2048, k // 1024)]
    if m == 1:
        return [skinny.SkinnyConfig(block_n, block_k, 1, num_warps=w) for block_n in (8, 16) for block_k in (512, 1024)
                for w in (4, 8)]
    return [skinny.SkinnyConfig(64, 128, split, num_warps=4, num_stages=4, swap_ab=True)
            for split in (1, 2, 4, 8) if split * 128 <= k]


def swiglu_of(y: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of a ``[gate | up]`` product, as the SwiGLU epilogue computes it."""
    gate, up = y.float().split(y.shape[1] // 2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).to(y.dtype)


def measure(x: torch.Tensor, ws: list[torch.Tensor], layers: dict, swiglu: bool, sweep: bool) -> dict:
    """One layer at ``x``'s rows: every path's time (and the FP8 paths' error)."""
    n, k = ws[0].shape
    m = x.shape[0]
    act = swiglu_of if swiglu else (lambda y: y)
    entry = {"n": n, "k": k, "rows": m, "swiglu": swiglu}
    us = time_launches([partial(skinny.skinny_linear, x, w, swiglu=swiglu) for w in ws])
    entry["bf16_skinny_us"], entry["bf16_skinny_gbps"] = round(us, 2), round(n * k * 2 / us / 1e3, 1)
    for layout, (made, fp8) in layers.items():
        want = act(torch.nn.functional.linear(x, made[0][2]))
        kw = dict(swiglu=swiglu, scale_block=BLOCK if layout == "blocks" else None)
        fns = [partial(skinny.skinny_linear, x, q, weight_scale=s, **kw) for q, s, _ in made]
        entry[f"fp8_{layout}_skinny_rel_err"] = round(rel_err(fns[0](), want), 5)
        us = time_launches(fns)
        entry[f"fp8_{layout}_skinny_us"] = round(us, 2)
        entry[f"fp8_{layout}_skinny_gbps"] = round((n * k + made[0][1].numel() * 4) / us / 1e3, 1)
        entry[f"fp8_{layout}_scaled_mm_rel_err"] = round(rel_err(act(fp8[0](x)), want), 5)
        entry[f"fp8_{layout}_scaled_mm_us"] = round(time_launches([partial(lambda lin: act(lin(x)), lin)
                                                                   for lin in fp8]), 2)
        if layout == "blocks":  # the same layers with Fp8Linear's Triton path on for these rows
            default, fp8_block_gemm.TRITON_MAX_M = fp8_block_gemm.TRITON_MAX_M, m
            try:
                tfns = [partial(lambda lin: act(lin(x)), lin) for lin in fp8]
                entry["fp8_blocks_triton_rel_err"] = round(rel_err(tfns[0](), want), 5)
                entry["fp8_blocks_triton_us"] = round(time_launches(tfns), 2)
            finally:
                fp8_block_gemm.TRITON_MAX_M = default
        if sweep:
            tried = []
            for cfg in sweep_configs(m, k, swiglu):
                row = {"config": [cfg.block_n, cfg.block_k, cfg.split_k, cfg.num_warps]}
                try:
                    cfns = [partial(skinny.skinny_linear, x, q, weight_scale=s, config=cfg, **kw) for q, s, _ in made]
                    row["rel_err"] = round(rel_err(cfns[0](), want), 5)
                    row["us"] = round(time_launches(cfns), 2)
                except Exception as e:  # noqa: BLE001  (a setting the compiler refuses)
                    row["error"] = str(e)[:120]
                tried.append(row)
            entry[f"fp8_{layout}_sweep"] = sorted(tried, key=lambda t: t.get("us", 1e9))[:5]
    return entry


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-8b", choices=sorted(SHAPES))
    ap.add_argument("--rows", default="1,2,8,32,64")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--layers", default="", help="comma-separated layer names (default: all)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    torch.manual_seed(0)
    res: dict = {"device": torch.cuda.get_device_name(), "shape": args.shape, "layers": []}
    for name, n, k, swiglu in SHAPES[args.shape]:
        if args.layers and name not in args.layers.split(","):
            continue
        copies = max(2, -(-3 * L2_BYTES // (n * k)))  # fp8 bytes: > 3x L2 over the copies (bf16: 6x)
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5 for _ in range(copies)]
        layers = {}
        for layout in ("rows", "blocks"):
            made = [quantized(w, layout == "blocks") for w in ws]
            fp8 = []
            for q, s, _ in made:
                lin = Fp8Linear(k, n, bias=False, block_scaled=layout == "blocks").cuda()
                lin.weight.data.copy_(q)
                lin.weight_scale.data.copy_(s)
                fp8.append(lin)
            layers[layout] = (made, fp8)
        for m in rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            entry = {"layer": name, **measure(x, ws, layers, swiglu, args.sweep)}
            res["layers"].append(entry)
            print(json.dumps(entry), flush=True)
        del ws, layers
        torch.cuda.empty_cache()
    text = json.dumps(res, indent=1)
    if args.out:
        args.out.write_text(text)
    # The table last: per layer and rows, microseconds of each path.
    print(f"{'layer':8} {'rows':>4} {'bf16':>7} {'fp8row':>7} {'fp8blk':>7} {'mm_row':>7} {'mm_blk':>7} {'tri_blk':>7}")
    for e in res["layers"]:
        print(f"{e['layer']:8} {e['rows']:>4} {e['bf16_skinny_us']:>7} {e['fp8_rows_skinny_us']:>7} "
              f"{e['fp8_blocks_skinny_us']:>7} {e['fp8_rows_scaled_mm_us']:>7} {e['fp8_blocks_scaled_mm_us']:>7} "
              f"{e['fp8_blocks_triton_us']:>7}")


if __name__ == "__main__":
    main()
