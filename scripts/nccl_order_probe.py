"""Does a send on one NCCL communicator wait behind a receive still outstanding on another?

    python scripts/nccl_order_probe.py        # two GPUs; prints one JSON line per rank

Two processes, each with the default group (eagerly initialised, as ``PipelineTransport.init``
makes it) and a second group of the same two ranks.  Rank 0 posts a receive on the second
group, then sends a tensor on the default group; rank 1 posts the matching receive on the
default group, waits ``DELAY_S``, looks whether the tensor has arrived, and only then sends
what rank 0's first receive expects.  ``arrived_before_feedback`` false means the default
group's send waited for the other group's receive: two communicators between the same GPUs
are not independent, and a channel from the last pipeline stage back to the first cannot ride
on a second NCCL group without serialising the pipeline (what async pipeline steps measured:
pp=2 at 1.0x of pp=1).
"""

from __future__ import annotations

import json
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

DELAY_S = 2.0


def _rank(rank: int, port: int) -> None:
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", world_size=2, rank=rank,
                            timeout=timedelta(seconds=60), device_id=dev)
    other = dist.new_group([0, 1], backend="nccl")
    token = torch.zeros(8, dtype=torch.int64, device=dev)
    # Open both pairs' connections first (one message each way on each group).
    for group in (None, other):
        if rank == 0:
            dist.send(token, 1, group=group)
        else:
            dist.recv(token, 0, group=group)
    torch.cuda.synchronize()
    payload = torch.full((1024,), float(rank == 0), device=dev)
    out: dict[str, object] = {"rank": rank, "nccl": ".".join(map(str, torch.cuda.nccl.version())),
                              "NCCL_LAUNCH_ORDER_IMPLICIT": os.environ.get("NCCL_LAUNCH_ORDER_IMPLICIT")}
    if rank == 0:
        pending = dist.irecv(token, 1, group=other)
        sent = dist.isend(payload, 1)
        sent.wait()
        pending.wait()
        torch.cuda.synchronize()
        out["token"] = int(token[0])
    else:
        got = dist.irecv(payload, 0)
        done = torch.cuda.Event()
        got.wait()
        done.record()
        time.sleep(DELAY_S)
        out["arrived_before_feedback"] = bool(done.query())
        token.fill_(7)
        dist.isend(token, 0, group=other).wait()
        torch.cuda.synchronize()
        out["payload_ok"] = bool(payload.eq(1.0).all())
    print(json.dumps(out), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    from pprun.executor.mp import free_port

    mp.spawn(_rank, args=(free_port(),), nprocs=2)
