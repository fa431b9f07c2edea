"""Sweep the Triton decode-attention launch settings on this GPU (graph-replayed timings).

    python scripts/tune_decode.py          # prints one line per setting, best first, per batch
"""

from __future__ import annotations

import itertools

import torch

import pprun.attention.triton_ops as ops
from pprun.attention.ref_ops import paged_attention_ref


def time_us(fn, iters: int = 200) -> float:
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(20):
            fn()
    g.replay()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(iters // 20):
        g.replay()
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e) / iters * 1e3


def main() -> None:
    heads, kv_heads, dim, bs, ctx, max_len = 32, 8, 64, 16, 640, 4096
    max_blocks = max_len // bs
    for batch in (1, 32):
        num_blocks = batch * max_blocks + 1
        kv = torch.randn(2, num_blocks, bs, kv_heads, dim, device="cuda", dtype=torch.bfloat16)
        perm = torch.randperm(num_blocks - 1, device="cuda")[: batch * max_blocks] + 1
        table = perm.view(batch, max_blocks).to(torch.int32)
        seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
        q = torch.randn(batch, heads, dim, device="cuda", dtype=torch.bfloat16)
        out = torch.empty_like(q)
        qsl = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
        ref = paged_attention_ref(q, kv, qsl, seq_lens, table, dim**-0.5, batch)
        results = []
        for bn, warps, stages, min_split in itertools.product((32, 64, 128), (2, 4, 8), (2, 3, 4), (64, 128, 256)):
            ops._DECODE_BLOCK_N, ops._DECODE_NUM_WARPS, ops._DECODE_NUM_STAGES = bn, warps, stages
            ops.DECODE_MIN_TOKENS_PER_SPLIT = min_split
            try:
                def fn(q=q, kv=kv, table=table, seq_lens=seq_lens, out=out) -> None:
                    ops.paged_decode_attention(q, kv, table, seq_lens, dim**-0.5, out)

                fn()
                err = (out.float() - ref.float()).abs().max().item()
                results.append((time_us(fn), bn, warps, stages, min_split, err))
            except Exception as ex:  # a setting the compiler rejects
                results.append((float("inf"), bn, warps, stages, min_split, repr(ex)[:60]))
        results.sort()
        kv_bytes = batch * ctx * 2 * kv_heads * dim * 2
        for t, bn, w, st, ms, err in results[:6]:
            print(f"batch {batch}: {t:6.2f} us ({kv_bytes / t / 1e3:.0f} GB/s) block_n={bn} warps={w} "
                  f"stages={st} min_tokens_per_split={ms} max_err={err}")
        base = [r for r in results if r[1:5] == (64, 4, 2, 256)]
        print(f"batch {batch}: current default {base[0][0]:.2f} us")


if __name__ == "__main__":
    main()
