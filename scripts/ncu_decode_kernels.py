"""The batch-32 decode attention (context 512) and the gate_up matmul of the 1.1B model, launched
eagerly on their own, for Nsight Compute (``ncu`` is on the device image and may profile):

    ncu --kernel-name regex:"_decode_kernel|_skinny_kernel" --launch-skip 8 --launch-count 2 \\
        --set full -o decode python3 scripts/ncu_decode_kernels.py
    ncu --import decode.ncu-rep --page details
    ncu --import decode.ncu-rep --page source --csv --print-source sass   # per-instruction stalls

ncu locks the SM clock at its base (1.40 GHz on an H200), so its durations read ~14% longer than
in a decode step.  Findings: ``docs/performance.md`` (thirteenth session).
"""

from __future__ import annotations

import torch

from pprun.attention.triton_ops import paged_decode_attention_rope
from pprun.layers.skinny import skinny_linear


def main() -> None:
    torch.manual_seed(0)
    dev = "cuda"
    batch, heads, kv_heads, dim, page, ctx = 32, 32, 8, 64, 16, 512
    max_blocks = (ctx + 64 + page - 1) // page + 4
    num_blocks = batch * max_blocks + 16
    kv = torch.randn(2, num_blocks, page, kv_heads, dim, device=dev, dtype=torch.bfloat16)
    # Blocks scattered over the cache, as after many requests came and went.
    table = (torch.randperm(num_blocks - 1, device=dev)[: batch * max_blocks].view(batch, max_blocks) + 1).int()
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
    positions = (seq_lens - 1).long()
    slots = table[torch.arange(batch, device=dev), positions // page].long() * page + positions % page
    q = torch.randn(batch, heads, dim, device=dev, dtype=torch.bfloat16)
    k = torch.randn(batch, kv_heads, dim, device=dev, dtype=torch.bfloat16)
    v = torch.randn(batch, kv_heads, dim, device=dev, dtype=torch.bfloat16)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2, device=dev).float() / dim))
    angles = torch.outer(torch.arange(4096, device=dev).float(), inv_freq)
    table_cs = torch.cat([angles, angles], -1)
    cos, sin = table_cs.cos(), table_cs.sin()
    out = torch.empty_like(q)
    w = torch.randn(16384, 2048, device=dev, dtype=torch.bfloat16) * 0.02
    x = torch.randn(32, 2048, device=dev, dtype=torch.bfloat16)
    for _ in range(5):
        paged_decode_attention_rope(q, k, v, cos, sin, positions, kv, slots, table, seq_lens, dim ** -0.5, out)
        skinny_linear(x, w, swiglu=True)
    torch.cuda.synchronize()
    print("done")


if __name__ == "__main__":
    main()
