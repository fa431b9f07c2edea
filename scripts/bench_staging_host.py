"""Host cost of moving a decode step's inputs to the GPU (``InputBuffers.to_device``), with the
staging kernel launched through Triton's ``kernel[grid](...)`` and directly
(``pprun.worker.v2.staging.FAST_LAUNCH_ENABLED``).  Needs CUDA.

    python scripts/bench_staging_host.py [--requests 16] [--iters 3000] [--rounds 2]

Prints one JSON line per round: microseconds of host time per call, with and without pending
input ids (async scheduling), for each launch path.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from pprun.worker.v2 import staging
from pprun.worker.v2.inputs import InputBuffers


def host_us(fn, iters: int) -> float:
    """Mean host time of ``fn()`` in us (the device is drained before and after)."""
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    elapsed = time.perf_counter() - t0
    torch.cuda.synchronize()
    return round(elapsed / iters * 1e6, 2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--iters", type=int, default=3000)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_staging_host.py needs a CUDA device")
    num_reqs = args.requests  # decode: one token per request, all sampled, none padded
    bufs = InputBuffers(8192, max(num_reqs, 32), 128, 16, torch.device("cuda"))
    prev = torch.zeros(num_reqs, dtype=torch.int64, device="cuda")
    bufs.pending_token_idx.np[:num_reqs] = np.arange(num_reqs)
    bufs.pending_sample_idx.np[:num_reqs] = np.arange(num_reqs)
    step = {"num_reqs_padded": num_reqs, "num_tokens_padded": num_reqs, "num_sampled": num_reqs}
    for r in range(args.rounds):
        row: dict[str, object] = {"round": r, "requests": num_reqs}
        for direct in (False, True):
            staging.FAST_LAUNCH_ENABLED = direct
            name = "direct" if direct else "triton"
            row[f"pending_{name}_us"] = host_us(
                lambda: bufs.to_device(**step, num_pending=num_reqs, prev_sampled=prev), args.iters)
            row[f"none_pending_{name}_us"] = host_us(lambda: bufs.to_device(**step), args.iters)
        print(json.dumps(row))


if __name__ == "__main__":
    main()
