"""Host cost of the async pipeline's sampled-ids channel (``pprun.distributed.feedback``): the
socket channel against the gloo one, two processes on this host, no GPU needed.

    python scripts/bench_feedback.py [--messages 3000] [--ids 16]

The last stage sends ``--messages`` messages of ``--ids`` ids; the first stage posts each one's
receive (``expect``) and then waits for it (``fill``).  Prints one JSON line per channel: median
host microseconds of ``send`` (last stage), ``expect`` and ``fill`` (first stage; ``fill``
includes the wait for the message to arrive).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import time
import traceback
from datetime import timedelta


def _end(rank: int, port: int, socket_on: bool, messages: int, num_ids: int, out) -> None:
    try:
        _time_end(rank, port, socket_on, messages, num_ids, out)
    except BaseException:  # noqa: BLE001 - the parent waits for every rank's answer
        out.put({"error": f"rank {rank}: {traceback.format_exc()}"})


def _time_end(rank: int, port: int, socket_on: bool, messages: int, num_ids: int, out) -> None:
    import numpy as np
    import torch
    import torch.distributed as dist

    from pprun.distributed import feedback as fb

    fb.SOCKET_ENABLED = socket_on
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))  # fmt: skip
    end = fb.SampleFeedback(dist.group.WORLD, 1 - rank, rank == 0, max_num_reqs=max(num_ids, 1), num_slots=4,
                            host="127.0.0.1", timeout_s=60.0)  # fmt: skip
    end.warm_up()
    ids = torch.arange(num_ids, dtype=torch.int64)
    req_ids = [f"r{i}" for i in range(num_ids)]
    times: dict[str, list[float]] = {"send": [], "expect": [], "fill": []}
    row = np.zeros(num_ids, dtype=np.int64)
    positions = np.arange(num_ids)  # where each id goes in the row (fill)
    batch_idx = torch.arange(num_ids)
    for _ in range(messages):
        if rank == 1:
            t0 = time.perf_counter()
            end.send(ids)
            times["send"].append(time.perf_counter() - t0)
        else:
            t0 = time.perf_counter()
            end.expect(req_ids, batch_idx, num_ids)
            t1 = time.perf_counter()
            flat = np.array([end.index[r] for r in req_ids])
            t1b = time.perf_counter()
            end.fill(row, positions, flat)
            t2 = time.perf_counter()
            times["expect"].append(t1 - t0)
            times["fill"].append(t2 - t1b)
    dist.barrier()
    end.close()
    out.put({k: round(statistics.median(v) * 1e6, 2) for k, v in times.items() if v})
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--messages", type=int, default=3000)
    ap.add_argument("--ids", type=int, default=16)
    args = ap.parse_args()
    from pprun.executor.mp import free_port

    ctx = mp.get_context("spawn")
    for socket_on in (True, False):
        out = ctx.Queue()
        port = free_port()
        procs = [ctx.Process(target=_end, args=(r, port, socket_on, args.messages, args.ids, out)) for r in (0, 1)]
        for p in procs:
            p.start()
        result = {"channel": "socket" if socket_on else "gloo", "ids": args.ids}
        for _ in procs:
            got = out.get(timeout=300)
            if "error" in got:
                raise SystemExit(got["error"])
            result.update(got)
        for p in procs:
            p.join(timeout=30)
        print(json.dumps(result))


if __name__ == "__main__":
    main()
