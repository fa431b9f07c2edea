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

import sys
from pathlib import Path

import torch

from pprun.attention.triton_ops import paged_decode_attention_rope
from pprun.layers.skinny import skinny_linear

sys.path.insert(0, str(Path(__file__).resolve().parent))
from layer_bench import HEAD_DIM, SHAPES, decode_attention_inputs  # noqa: E402


def main() -> None:
    torch.manual_seed(0)
    d = decode_attention_inputs(32)  # context 512, blocks scattered over the cache
    k, n = SHAPES["gate_up"]
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    x = torch.randn(32, k, device="cuda", dtype=torch.bfloat16)
    for _ in range(5):
        paged_decode_attention_rope(d.q, d.k, d.v, d.cos, d.sin, d.pos, d.kvs[0], d.slots, d.table, d.seq_lens,
                                    HEAD_DIM**-0.5, d.o)
        skinny_linear(x, w, swiglu=True)
    torch.cuda.synchronize()
    print("done")


if __name__ == "__main__":
    main()
