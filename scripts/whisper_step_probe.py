"""Where a batch of Whisper windows spends its time on a GPU (a one-off probe).

    PPRUN_STEP_TRACE=/tmp/tr/w python scripts/bench_whisper.py --device cuda --dtype float16 \\
        --num-clips 64 --seconds 30 --batch 64 --skip-transformers
    python scripts/whisper_step_probe.py trace /tmp/tr/w      # medians of the decode steps (>= 40 rows)
    python scripts/whisper_step_probe.py graph                # device time of one decode graph replay

``trace`` reads the stage's and the engine's step rows of the timed (second) run: the admission
step's phases, the decode steps' host phases, the engine's scheduling and output handling and
its period.  ``graph`` transcribes 64 clips once, then replays the captured full decode graphs
for 64 and 1 rows back to back and times them with CUDA events.
"""

from __future__ import annotations

import json
import statistics
import sys
import time


def trace(prefix: str, min_rows: int = 40) -> dict:
    """Medians of the traced run's decode steps with at least ``min_rows`` rows."""
    stage = json.load(open(prefix + ".stage0.json"))["steps"]
    engine = json.load(open(prefix + ".engine.json"))["steps"]
    timed = stage[len(stage) // 2:]
    decode = [r for r in timed if r["num_reqs"] >= min_rows and r["num_tokens"] == r["num_reqs"]]
    out: dict = {"decode_steps": len(decode)}
    out.update({k: round(statistics.median(r[k] for r in decode), 1) for k in decode[0] if k.endswith("_us")})
    out["admission_steps"] = [{k: round(v, 1) for k, v in r.items() if k != "t0"}
                              for r in timed if r["num_tokens"] > r["num_reqs"]]
    rows = engine[len(engine) // 2:]
    out["engine_schedule_submit_us"] = round(statistics.median((r[1] - r[0]) * 1e6 for r in rows), 1)
    out["engine_between_steps_us"] = round(statistics.median((b[0] - a[2]) * 1e6 for a, b in zip(rows, rows[1:])), 1)
    out["engine_period_us"] = round(statistics.median((b[2] - a[2]) * 1e6 for a, b in zip(rows, rows[1:])), 1)
    return out


def graph() -> None:
    """Device and host time of the 64- and 1-row full decode graphs, replayed back to back."""
    sys.path.insert(0, "scripts")
    import torch
    from bench_whisper import make_clips

    from pprun import LLM
    from pprun.models.demo import resolve_model
    from pprun.sampling.params import SamplingParams

    llm = LLM(str(resolve_model("whisper-tiny.en")), dtype="float16", max_num_seqs=64, max_num_batched_tokens=2048)
    llm.transcribe([(c, 16000) for c in make_clips(64, 30.0)], SamplingParams(temperature=0.0, max_tokens=200))
    runner = llm.engine.executor.worker.runner
    for size in (64, 1):
        g = runner.graphs.full[size].graph
        for _ in range(10):
            g.replay()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(200):
            g.replay()
        end.record()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(200):
            g.replay()
        host_us = (time.perf_counter() - t0) / 200 * 1e6
        torch.cuda.synchronize()
        print(f"graph {size} rows: device {start.elapsed_time(end) / 200 * 1e3:.1f} us per replay, host launch {host_us:.1f} us")
    llm.shutdown()


if __name__ == "__main__":
    if sys.argv[1] == "trace":
        print(json.dumps(trace(sys.argv[2]), indent=1))
    else:
        graph()
