"""How fast does a 64 MiB hop go between two stage processes when the copy engine moves it over
CUDA IPC instead of NCCL?

    python scripts/ipc_copy_probe.py [--mib 64] [--iters 50]     # two GPUs; prints one JSON line

Two processes, one GPU each (as the pipeline's stages).  Rank 0 owns a source buffer, rank 1 a
destination buffer; each shares its buffer with the other through ``torch.multiprocessing``
(CUDA IPC handles).  Timed on the copying process's stream with CUDA events:

- ``pull``: rank 1 copies rank 0's buffer into its own (``dst.copy_(peer_src)``: a peer copy
  read over NVLink by the copy engine);
- ``push``: rank 0 copies its buffer into rank 1's;
- ``nccl``: a bare ``dist.send``/``dist.recv`` of the same bytes, for the peer in the same run.

The pipeline's large eager hops go over NCCL (a Llama stage's 64 MiB hop, one tensor: 327-329
GB/s streamed through the transport on two H200s, 337 GB/s by the receiver's stream; this probe's
bare NCCL send 340 GB/s and the pull 359 GB/s on the same machine); this says what a copy-engine
path would reach before anyone builds one.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pprun.executor.mp import free_port


def _time(op, iters: int) -> float:
    """Mean µs per ``op()`` on the current stream, after a warm-up, by CUDA events."""
    for _ in range(5):
        op()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        op()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / iters


def _rank(rank: int, port: int, nbytes: int, iters: int, to_peer, from_peer, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=2, device_id=torch.device("cuda", rank))
    mine = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=f"cuda:{rank}")
    to_peer.put(mine)  # an IPC handle travels; the peer maps the same memory
    peer = from_peer.get()
    dist.barrier()
    out = {}
    if rank == 1:
        out["pull_us"] = _time(lambda: mine.copy_(peer, non_blocking=True), iters)
        out["pull_equal"] = bool(torch.equal(mine.cpu(), peer.cpu()))
    dist.barrier()
    if rank == 0:
        mine.random_(0, 255)
        out["push_us"] = _time(lambda: peer.copy_(mine, non_blocking=True), iters)
    dist.barrier()
    out["nccl_us"] = _time(lambda: dist.send(mine, 1) if rank == 0 else dist.recv(mine, 0), iters)
    dist.barrier()
    results.put((rank, out))
    peer = None  # unmap the peer's buffer before the group goes
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--iters", type=int, default=50)
    args = ap.parse_args()
    if torch.cuda.device_count() < 2:
        raise SystemExit("needs two GPUs")
    ctx = mp.get_context("spawn")
    q01, q10, results = ctx.Queue(), ctx.Queue(), ctx.Queue()
    nbytes, port = args.mib << 20, free_port()
    procs = [ctx.Process(target=_rank, args=(0, port, nbytes, args.iters, q01, q10, results)),
             ctx.Process(target=_rank, args=(1, port, nbytes, args.iters, q10, q01, results))]
    for p in procs:
        p.start()
    merged = {}
    for _ in procs:
        merged.update(results.get(timeout=300)[1])
    for p in procs:
        p.join(60)
    report = {"bytes": nbytes, "iters": args.iters}
    for key in ("pull", "push", "nccl"):
        us = merged[f"{key}_us"]
        report[key] = {"us": round(us, 1), "GB_per_s": round(nbytes / us / 1e3, 1)}
    report["pull_equal"] = merged["pull_equal"]
    print(json.dumps(report))


if __name__ == "__main__":
    main()
