"""Where a decode step's time goes: graph replay alone vs the whole engine step, plus a profile.

    python scripts/profile_decode.py MODEL_DIR --batch 32 --ctx 512 [--mode full] [--out DIR]

Prints JSON: ms per engine step (wall), ms per bare forward replay (CUDA events), and writes the
top of a cProfile of engine steps to DIR/profile_b{batch}.txt.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import time
from pathlib import Path

import torch

from pprun import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--mode", default="full")
    ap.add_argument("--runner", default="v2")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--out", type=Path, default=Path("."))
    args = ap.parse_args()
    llm = LLM(args.model, runner=args.runner, cudagraph_mode=args.mode, max_num_seqs=max(args.batch, 1),
              max_model_len=args.ctx + 2 * args.steps + 64)
    eng = llm.engine
    g = torch.Generator().manual_seed(0)
    sp = SamplingParams(temperature=0, max_tokens=2 * args.steps + 32, ignore_eos=True)
    for _ in range(args.batch):
        ids = torch.randint(10, 30000, (args.ctx,), generator=g).tolist()
        eng.add_request(ids, sp)
    # Prefill until every request decodes.
    for _ in range(50):
        eng.step()
        if all(r.num_computed_tokens >= len(r.prompt_token_ids) for r in eng.scheduler._running) and len(eng.scheduler._running) == args.batch:
            break
    for _ in range(5):
        eng.step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(args.steps // 2):
        eng.step()
    torch.cuda.synchronize()
    step_ms = (time.perf_counter() - t0) * 1e3 / (args.steps // 2)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.steps // 2):
        eng.step()
    prof.disable()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(30)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"profile_{args.runner}_{args.mode}_b{args.batch}.txt").write_text(s.getvalue())
    result = {"batch": args.batch, "ctx": args.ctx, "runner": args.runner, "mode": args.mode,
              "engine_step_ms": round(step_ms, 4)}
    runner = eng.executor.worker.runner
    graphs = getattr(runner, "graphs", None)
    if graphs is not None and getattr(graphs, "full", None):
        size = min(s for s in graphs.full if s >= args.batch)
        graph = graphs.full[size].graph
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for _ in range(10):
            graph.replay()
        start.record()
        for _ in range(100):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        result["graph_replay_ms"] = round(start.elapsed_time(end) / 100, 4)
    print(json.dumps(result))
    llm.shutdown()


if __name__ == "__main__":
    main()
