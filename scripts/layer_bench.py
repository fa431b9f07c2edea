"""Per-part timings of one decode layer of the 1.1B model on this GPU, graph-replayed (JSON).

    python scripts/layer_bench.py [--out result.json]

- ``attention``: a decode step's attention part per layer at context 512 — rotary, cache write,
  decode kernel and split reduce as separate launches vs the one fused launch;
- ``skinny``: the split-K kernels of ``pprun.layers.skinny`` (default launch settings, and the
  best of a sweep) against cuBLAS, at batch 1, 8 and 32; gate_up includes the SwiGLU.

Synthetic tensors; no model directory is needed.  Each timed call reads its own copy of the
weights or KV cache (256 MB in all), so nothing is served from L2 that a model would read
from HBM.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import json
from collections.abc import Callable
from pathlib import Path

import torch

from pprun.attention.triton_ops import paged_attention, paged_decode_attention_rope
from pprun.layers.fused import rotary_qk, silu_and_mul
from pprun.layers.skinny import SkinnyConfig, default_config, skinny_linear

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, VOCAB = 2048, 32, 8, 64, 8192, 32000
SHAPES = {
    "qkv": (HIDDEN, (HEADS + 2 * KV_HEADS) * HEAD_DIM),
    "o_proj": (HEADS * HEAD_DIM, HIDDEN),
    "gate_up": (HIDDEN, 2 * INTER),
    "down": (INTER, HIDDEN),
    "lm_head": (HIDDEN, VOCAB),
}


L2_FLUSH_BYTES = 256 * 2**20
"""Each timed call reads its own copy of the weights (or KV cache) until the copies add up to
this much, five times the H200's 50 MB L2: otherwise repeated calls would read small weights
from L2 instead of HBM, as they never do inside a model."""


def write_result(result: dict, out: str | Path | None) -> None:
    """Print the result object as JSON, and write it to ``out`` when given."""
    text = json.dumps(result, indent=1)
    print(text)
    if out:
        Path(out).write_text(text)


def copies_for(nbytes: int) -> int:
    return max(1, -(-L2_FLUSH_BYTES // nbytes))


def time_us(fns, iters: int = 10, calls: int = 400) -> float:
    """Mean µs per call, replayed from one CUDA graph that calls ``fns`` (one callable, or a list
    cycled through: one per copy of the data) about ``calls`` times in all (at least twice each)."""
    fns = fns if isinstance(fns, list) else [fns]
    rounds = max(2, calls // len(fns))
    for fn in fns:
        fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(rounds):
            for fn in fns:
                fn()
    g.replay()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(iters):
        g.replay()
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e) * 1e3 / (rounds * len(fns) * iters)


def bench_skinny(sweep: bool = True) -> dict:
    """Split-K kernels (``pprun.layers.skinny``): the default config, and at one row the best of
    a sweep, against cuBLAS (+ ``silu_and_mul`` for gate_up, which the kernel folds in).  More
    rows take the swapped form, swept by ``scripts/sweep_skinny.py``."""
    out: dict = {}
    one_row_sweep = itertools.product((8, 16, 32), (256, 512, 1024), (1, 2, 4, 8))
    for m in (1, 8, 32):
        candidates = list(one_row_sweep) if sweep and m == 1 else []
        for name, (k, n) in SHAPES.items():
            swiglu = name == "gate_up"
            ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5 for _ in range(copies_for(n * k * 2))]
            w = ws[0]
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            cublas = _cublas_swiglu if swiglu else torch.nn.functional.linear
            cublas_us = time_us([functools.partial(cublas, x, w_i) for w_i in ws])
            default = default_config(m, n // 2 if swiglu else n, k, swiglu, x.device)

            def skinny(cfg, ws=ws, x=x, swiglu=swiglu):
                return time_us([functools.partial(skinny_linear, x, w_i, swiglu=swiglu, config=cfg) for w_i in ws])

            row = {"cublas_us": round(cublas_us, 2),
                   "default": {**dataclasses.asdict(default), "us": round(skinny(default), 2)}}
            best = None
            for block_n, block_k, split in candidates:
                if block_k > k or k // split < block_k:
                    continue
                cfg = SkinnyConfig(block_n, block_k, split)
                us = skinny(cfg)
                if best is None or us < best["us"]:
                    best = {**dataclasses.asdict(cfg), "us": round(us, 2)}
            if best is not None:
                row["best"] = best
            row["default_tb_s"] = round(w.numel() * 2 / row["default"]["us"] / 1e6, 2)
            out[f"{name}/b{m}"] = row
    return out


def _cublas_swiglu(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return silu_and_mul(torch.nn.functional.linear(x, w))


@dataclasses.dataclass
class DecodeAttentionInputs:
    """One decode step's attention inputs at ``batch`` requests of ``ctx`` tokens (random, on the
    GPU), with ``kvs``: copies of the paged KV cache, one per timed call (see ``copies_for``)."""

    kvs: list
    kv_bytes: int
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    pos: torch.Tensor
    slots: torch.Tensor
    table: torch.Tensor
    seq_lens: torch.Tensor
    o: torch.Tensor
    block_size: int
    """Tokens per KV block (``table`` is in blocks)."""


def qkv_views(src: torch.Tensor, batch: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k and v as ``[batch, heads, head_dim]`` views of a qkv output (or its first partial)."""
    q, k, v = src.split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], dim=-1)
    return q.view(batch, HEADS, HEAD_DIM), k.view(batch, KV_HEADS, HEAD_DIM), v.view(batch, KV_HEADS, HEAD_DIM)


def decode_attention_inputs(batch: int, ctx: int = 512, max_len: int = 2048, block: int = 16) -> DecodeAttentionInputs:
    blocks_per_req = max_len // block
    num_blocks = batch * blocks_per_req + 1
    kv_bytes = batch * ctx * KV_HEADS * HEAD_DIM * 2 * 2
    kvs = [torch.randn(2, num_blocks, block, KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
           for _ in range(copies_for(kv_bytes))]
    table = (torch.randperm(num_blocks - 1, device="cuda")[: batch * blocks_per_req] + 1).view(batch, -1).int()
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    slots = table[:, (ctx - 1) // block].long() * block + (ctx - 1) % block
    qkv = torch.randn(batch, (HEADS + 2 * KV_HEADS) * HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    q, k, v = qkv_views(qkv, batch)
    inv = 1.0 / (10000.0 ** (torch.arange(0, HEAD_DIM, 2, device="cuda").float() / HEAD_DIM))
    freqs = torch.outer(torch.arange(max_len, device="cuda").float(), inv)
    cos, sin = torch.cat((freqs, freqs), -1).cos(), torch.cat((freqs, freqs), -1).sin()
    return DecodeAttentionInputs(
        kvs, kv_bytes, q, k, v, cos, sin, (seq_lens - 1).long(), slots, table, seq_lens, torch.empty_like(q), block,
    )


def qkv_before_attention(batch: int, kvs: list) -> tuple[list, Callable, list]:
    """The qkv matmul at ``batch`` decode rows as a layer runs it before the decode attention
    (split-K partials left for the attention to merge): copies of its weight (``copies_for``),
    the call ``qkv(weight)``, and (weight, KV cache) pairs cycling through both sets of copies,
    one per timed call of the pair."""
    hidden, width = SHAPES["qkv"]
    x = torch.randn(batch, hidden, device="cuda", dtype=torch.bfloat16)
    ws = [torch.randn(width, hidden, device="cuda", dtype=torch.bfloat16) * hidden**-0.5
          for _ in range(copies_for(width * hidden * 2))]

    def qkv(w: torch.Tensor):
        return skinny_linear(x, w, weights_ahead=True, defer_merge="attention", hold_last=False)

    pairs = [(ws[i % len(ws)], kvs[i % len(kvs)]) for i in range(max(len(ws), len(kvs)))]
    return ws, qkv, pairs


def bench_attention(ctx: int = 512, max_len: int = 2048, block: int = 16) -> dict:
    out: dict = {}
    scale = HEAD_DIM**-0.5
    for batch in (1, 32):
        d = decode_attention_inputs(batch, ctx, max_len, block)
        qsl = torch.arange(batch + 1, dtype=torch.int32, device="cuda")

        def separate(kv, d=d, qsl=qsl):
            rotary_qk(d.q, d.k, d.cos, d.sin, d.pos)
            paged_attention(d.q, d.k, d.v, kv, d.slots, qsl, d.seq_lens, d.table, scale, d.o, 1)

        def fused(kv, d=d):
            paged_decode_attention_rope(d.q, d.k, d.v, d.cos, d.sin, d.pos, kv, d.slots, d.table, d.seq_lens, scale, d.o)

        for name, fn in (("separate", separate), ("fused", fused)):
            us = time_us([functools.partial(fn, kv) for kv in d.kvs])
            out[f"b{batch}/{name}"] = {"us": round(us, 2), "kv_tb_s": round(d.kv_bytes / us / 1e6, 2)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path)
    ap.add_argument("--no-sweep", action="store_true", help="time the default launch settings only")
    args = ap.parse_args()
    res = {"device": torch.cuda.get_device_name()}
    res["attention"] = bench_attention()
    res["skinny"] = bench_skinny(sweep=not args.no_sweep)
    write_result(res, args.out)


if __name__ == "__main__":
    main()
