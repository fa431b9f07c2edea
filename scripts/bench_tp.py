"""Tensor parallelism's two per-step choices, measured: how a hop reaches a stage's tp group, and
how each step's SchedulerOutput reaches every worker.  Prints one JSON object (``--out`` writes it).

``hop``      A world of ``2 x tp`` processes (two stages of ``tp`` workers, gloo on CPU, NCCL with
             ``--device cuda`` and ``2 x tp`` GPUs) moves a ``[tokens, hidden]`` tensor from stage 0
             to stage 1 two ways: *rank to rank* (tp rank i of stage 0 sends its copy to tp rank i
             of stage 1, every pair at once: what pprun does) and *once + broadcast* (tp rank 0
             sends, stage 1's tp rank 0 broadcasts inside its group).  Per shape, the median of
             ``--iters`` hops (each ended by a barrier of the world, subtracted as measured alone).
``control``  The driver's side of a step's message: the same pickled bytes (``--control-bytes``,
             a decode step's SchedulerOutput is about 1-3 KB) written to ``n`` authenticated local
             sockets and read by ``n`` worker processes (what pprun does: one socket per worker),
             against one socket read by tp rank 0 followed by a gloo broadcast of the bytes in the
             tp group (the alternative).  Median time until the last worker holds the message.

    python scripts/bench_tp.py --tp 2 --out bench_tp_cpu.json
    python scripts/bench_tp.py --device cuda --tp 2 --parts hop     # 4 GPUs
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import statistics
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SHAPES = [(1, 4096), (32, 4096), (512, 4096), (2048, 4096)]
"""(tokens, hidden): decode steps of 1 and 32 requests, prefill chunks of 512 and 2048 tokens."""


def _hop_worker(rank: int, world: int, tp: int, init: str, device: str, iters: int, out_path: str) -> None:
    if device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=init, rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    dev = torch.device(device, rank) if device == "cuda" else torch.device("cpu")
    backend = "nccl" if device == "cuda" else "gloo"
    groups = [dist.new_group([s * tp + i for i in range(tp)], backend=backend) for s in range(2)]
    stage, tp_rank = divmod(rank, tp)
    my_group = groups[stage]

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize(dev)
        dist.barrier()

    def timed(fn) -> float:
        samples = []
        for _ in range(iters):
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            samples.append(time.perf_counter() - t0)
        return statistics.median(samples)

    results = {}
    barrier_s = timed(lambda: None)
    for tokens, hidden in SHAPES:
        x = torch.randn(tokens, hidden, device=dev)

        def rank_to_rank(x: torch.Tensor = x) -> None:
            if stage == 0:
                dist.send(x, rank + tp)
            else:
                dist.recv(x, rank - tp)

        def once_broadcast(x: torch.Tensor = x) -> None:
            if stage == 0 and tp_rank == 0:
                dist.send(x, tp)
            elif stage == 1:
                if tp_rank == 0:
                    dist.recv(x, 0)
                dist.broadcast(x, src=tp, group=my_group)

        for fn in (rank_to_rank, once_broadcast):  # warm the pairs and the group
            fn()
        results[f"{tokens}x{hidden}"] = {
            "bytes": x.numel() * x.element_size(),
            "rank_to_rank_us": round((timed(rank_to_rank) - barrier_s) * 1e6, 1),
            "once_broadcast_us": round((timed(once_broadcast) - barrier_s) * 1e6, 1),
        }
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({"barrier_us": round(barrier_s * 1e6, 1), "shapes": results}, f)
    dist.destroy_process_group()


def bench_hop(tp: int, device: str, iters: int) -> dict:
    world = 2 * tp
    with tempfile.TemporaryDirectory() as d:
        out_path = os.path.join(d, "hop.json")
        mp.spawn(_hop_worker, args=(world, tp, f"file://{d}/store", device, iters, out_path), nprocs=world)
        with open(out_path) as f:
            result = json.load(f)
    return {"world": world, "tp": tp, "device": device, **result}


def _control_worker(rank: int, n: int, address, key: bytes, init: str, mode: str, iters: int) -> None:
    from multiprocessing.connection import Client

    conn = Client(address, authkey=key)
    conn.send(rank)
    if mode == "broadcast":
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=n, timeout=timedelta(seconds=120))
    size = torch.zeros(1, dtype=torch.int64)
    for _ in range(iters):
        if mode == "sockets" or rank == 0:
            data = conn.recv_bytes()
        if mode == "broadcast":
            size[0] = len(data) if rank == 0 else 0
            dist.broadcast(size, src=0)
            buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if rank == 0 else torch.empty(int(size), dtype=torch.uint8)
            dist.broadcast(buf, src=0)
        conn.send_bytes(b"k")  # this worker holds the step
    if mode == "broadcast":
        dist.destroy_process_group()


def bench_control(n: int, num_bytes: int, iters: int) -> dict:
    from multiprocessing.connection import Listener

    payload = pickle.dumps(("step", os.urandom(num_bytes)))
    out = {"workers": n, "message_bytes": len(payload)}
    ctx = mp.get_context("spawn")
    for mode in ("sockets", "broadcast"):
        key = os.urandom(16)
        with tempfile.TemporaryDirectory() as d, Listener(("127.0.0.1", 0), authkey=key) as listener:
            procs = [ctx.Process(target=_control_worker, args=(r, n, listener.address, key, f"file://{d}/s", mode, iters))
                     for r in range(n)]
            for p in procs:
                p.start()
            conns = [None] * n
            for _ in range(n):
                c = listener.accept()
                conns[c.recv()] = c  # by rank: tp rank 0 reads the step in "broadcast"
            samples = []
            for _ in range(iters):
                t0 = time.perf_counter()
                for c in conns if mode == "sockets" else conns[:1]:
                    c.send_bytes(payload)
                for c in conns:
                    c.recv_bytes()
                samples.append(time.perf_counter() - t0)
            for p in procs:
                p.join(60)
        out[f"{mode}_us"] = round(statistics.median(samples) * 1e6, 1)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", default="hop,control")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--control-bytes", type=int, default=2048)
    ap.add_argument("--out")
    args = ap.parse_args()
    parts = set(args.parts.split(","))
    result = {"torch": torch.__version__, "cpu_count": os.cpu_count()}
    if "hop" in parts:
        result["hop"] = bench_hop(args.tp, args.device, args.iters)
    if "control" in parts:
        result["control"] = bench_control(args.tp, args.control_bytes, args.iters * 4)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
