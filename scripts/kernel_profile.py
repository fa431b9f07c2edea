"""Per-kernel GPU time of decode steps (eager, so every kernel is visible to the profiler).

    python scripts/kernel_profile.py MODEL_DIR --batch 32 --ctx 512 [--out DIR]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from pprun import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", type=Path, default=Path("."))
    args = ap.parse_args()
    llm = LLM(args.model, runner="v2", cudagraph_mode="none", max_num_seqs=args.batch,
              max_model_len=args.ctx + 4 * args.steps + 64)
    eng = llm.engine
    g = torch.Generator().manual_seed(0)
    sp = SamplingParams(temperature=0, max_tokens=4 * args.steps, ignore_eos=True)
    for _ in range(args.batch):
        eng.add_request(torch.randint(10, 30000, (args.ctx,), generator=g).tolist(), sp)
    for _ in range(args.batch + 10):
        eng.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            eng.step()
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=30, max_name_column_width=70)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"kernels_b{args.batch}.txt").write_text(table)
    total = sum(e.self_device_time_total for e in prof.key_averages()) / args.steps
    print(f"batch {args.batch}: GPU kernel time per step {total / 1e3:.3f} ms")
    print(table[:6000])
    llm.shutdown()


if __name__ == "__main__":
    main()
