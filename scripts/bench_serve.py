"""Serving overhead: throughput through gRPC against offline generation on the same workload, and
the time to first token the server adds.  Prints one JSON object.

    python scripts/bench_serve.py --model smollm2-135m-instruct --clients 16 --input-len 64 --output-len 32
    python scripts/bench_serve.py --model smollm2-135m-instruct --pp 2 --executor mp --clients 16 ...
    python scripts/bench_serve.py --model /tmp/llama1b --clients 64 --input-len 512 --output-len 128

Both sides run the same random token-id prompts (seeded, EOS ignored, greedy) in one run: first
offline (``LLM.generate`` with every prompt submitted at once, as ``pprun bench`` times it, after
a warm-up batch), then — with the offline engine shut down — a ``pprun serve`` server process with
the same engine settings and ``--clients`` concurrent streaming ``Generate`` calls (one prompt
each, or ``--num-prompts`` taken in turn; after the same warm-up through the server).  Throughput is output tokens over wall time;
``same_tokens`` says whether every served output equals the offline one.

The TTFT the server adds is, per request, what the client saw (call start to first response)
minus what the engine saw (the request accepted by the async engine to its first token, from the
final response's timings), split into ``ingress`` (call start to accepted: the client's send,
gRPC, parsing and validation) and ``egress`` (first token sampled to the client holding it: the
hand-over back, serialization, gRPC).  CPU time per output token (the process and its stage
processes, with psutil) is reported for both sides: on a machine that other work shares it
shows what the server adds when wall times are noise.

The server is started without Hydra (``pprun.serve.server.serve`` on a config built here), so
with ``--executor uni|mp`` neither Hydra nor Ray is needed; the gRPC packages are.  The script
sets ``OMP_WAIT_POLICY=PASSIVE`` unless it is set (it matters where OpenMP runs the model: on
CPU): the offline engine steps on its main thread, the server on its engine thread, and on a
machine whose cores other processes share, an OpenMP team spinning while it waits for a
descheduled peer slows one side far more than the other.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (nearest rank) of ``values``."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def cpu_seconds(pid: int | None = None) -> float | None:
    """User + system CPU seconds of a process and its children (stage processes) so far; None
    without psutil."""
    try:
        import psutil
    except ImportError:
        return None
    root = psutil.Process(pid)
    total = 0.0
    for proc in (root, *root.children(recursive=True)):
        try:
            t = proc.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


def per_token_us(cpu_before: float | None, cpu_after: float | None, num_tokens: int) -> float | None:
    """CPU microseconds per output token between two :func:`cpu_seconds` readings."""
    return None if cpu_before is None or cpu_after is None else 1e6 * (cpu_after - cpu_before) / num_tokens


def make_prompts(num: int, input_len: int, vocab_size: int, seed: int) -> list[list[int]]:
    """Random token-id prompts (ids 10.. to stay clear of special tokens)."""
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab_size) for _ in range(input_len)] for _ in range(num)]


def engine_kwargs(args) -> dict:
    """LLM keyword arguments shared by both sides."""
    kw = {"model": args.model, "pipeline_parallel_size": args.pp, "max_num_seqs": max(args.clients, 1)}
    for name in ("executor", "runner", "dtype"):
        if getattr(args, name):
            kw[name] = getattr(args, name)
    return kw


def run_offline(args, prompts: list[list[int]]) -> tuple[dict, list[list[int]]]:
    """Offline throughput and TTFT on the prompts, and the outputs."""
    from pprun import LLM
    from pprun.sampling.params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    warm = SamplingParams(temperature=0.0, max_tokens=min(16, args.output_len), ignore_eos=True)
    with LLM(**engine_kwargs(args)) as llm:
        llm.generate([{"prompt_token_ids": p} for p in prompts], warm)
        cpu0, t0 = cpu_seconds(), time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        wall, cpu1 = time.perf_counter() - t0, cpu_seconds()
        facts = llm.describe()
    num_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    ttfts = [o.metrics.time_to_first_token for o in outs if o.metrics.time_to_first_token is not None]
    result = {"output_tokens": num_tokens, "wall_s": wall, "output_tok_s": num_tokens / wall,
              "cpu_us_per_token": per_token_us(cpu0, cpu1, num_tokens),
              "ttft_p50_ms": 1e3 * statistics.median(ttfts), "engine": facts}
    return result, [list(o.outputs[0].token_ids) for o in outs]


async def stream_all(address: str, prompts: list[list[int]], max_tokens: int, clients: int) -> tuple[list[dict], float]:
    """Every prompt as a streaming Generate call, ``clients`` at a time; per call its tokens and
    timestamps, and the wall time of all."""
    import grpc

    from pprun.serve._proto.pprun.v1 import pprun_pb2 as pb
    from pprun.serve._proto.pprun.v1 import pprun_pb2_grpc as pb_grpc

    channels = [grpc.aio.insecure_channel(address) for _ in range(max(1, min(clients, 8)))]
    stubs = [pb_grpc.PprunStub(c) for c in channels]
    limit = asyncio.Semaphore(clients)
    sampling = pb.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)

    async def one(i: int) -> dict:
        async with limit:
            t_send = time.time()
            t_first, token_ids, final = None, [], None
            async for resp in stubs[i % len(stubs)].Generate(
                pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompts[i]), sampling=sampling)
            ):
                if t_first is None and resp.token_ids:
                    t_first = time.time()
                token_ids += resp.token_ids
                if resp.HasField("final"):
                    final = resp.final
            t = final.timings
            return {"token_ids": token_ids, "t_send": t_send, "t_first": t_first,
                    "t_arrival": t.arrival_time, "t_first_token": t.first_token_time}

    t0 = time.perf_counter()
    try:
        results = await asyncio.gather(*(one(i) for i in range(len(prompts))))
    finally:
        for c in channels:
            await c.close()
    return results, time.perf_counter() - t0


def run_served(args, prompts: list[list[int]]) -> tuple[dict, list[list[int]]]:
    """Throughput and TTFT through a server process on loopback, and the outputs."""
    from serve_helpers import ServerProcess

    kwargs = engine_kwargs(args)
    kwargs.setdefault("executor", "uni" if args.pp == 1 else "ray")
    with tempfile.TemporaryDirectory() as tmp:
        command = [sys.executable, str(Path(__file__).resolve()), "--serve-child", json.dumps(kwargs)]
        server = ServerProcess(Path(tmp), [], startup_timeout_s=1800, command=command)
        try:
            asyncio.run(stream_all(server.address, prompts, min(16, args.output_len), args.clients))  # warm-up
            cpu0 = cpu_seconds(server.proc.pid)
            results, wall = asyncio.run(stream_all(server.address, prompts, args.output_len, args.clients))
            cpu1 = cpu_seconds(server.proc.pid)
        finally:
            rc = server.terminate()
    num_tokens = sum(len(r["token_ids"]) for r in results)
    ms = [{"client": r["t_first"] - r["t_send"], "engine": r["t_first_token"] - r["t_arrival"],
           "ingress": r["t_arrival"] - r["t_send"], "egress": r["t_first"] - r["t_first_token"]} for r in results]
    added = [1e3 * (m["client"] - m["engine"]) for m in ms]

    def p50(key: str) -> float:
        return 1e3 * statistics.median(m[key] for m in ms)

    result = {"output_tokens": num_tokens, "wall_s": wall, "output_tok_s": num_tokens / wall,
              "server_cpu_us_per_token": per_token_us(cpu0, cpu1, num_tokens), "client_ttft_p50_ms": p50("client"), "engine_ttft_p50_ms": p50("engine"),
              "added_ttft_p50_ms": statistics.median(added), "added_ttft_p90_ms": percentile(added, 90),
              "ingress_p50_ms": p50("ingress"), "egress_p50_ms": p50("egress"), "server_exit_status": rc}
    return result, [r["token_ids"] for r in results]


def serve_child(kwargs_json: str) -> None:
    """The server side: ``pprun serve`` on an engine built from LLM keywords, port 0, no Hydra."""
    import dataclasses
    import logging

    from pprun.config.config import PprunConfig, ServeAppConfig, ServeConfig
    from pprun.serve.server import serve

    logging.basicConfig(level=logging.INFO, format="[%(asctime)s][%(name)s][%(levelname)s] %(message)s")
    engine = PprunConfig.from_kwargs(**json.loads(kwargs_json))
    cfg = ServeAppConfig(**{f.name: getattr(engine, f.name) for f in dataclasses.fields(PprunConfig)},
                         serve=ServeConfig(port=0, model_name="bench"))
    serve(cfg)


def main() -> int:
    """Run both sides and print the comparison as JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct", help="model directory or alias")
    parser.add_argument("--pp", type=int, default=1, help="pipeline stages")
    parser.add_argument("--executor", default=None, help="uni|mp|ray (default: the config's auto)")
    parser.add_argument("--runner", default=None, help="auto|v1|v2")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--clients", type=int, default=16, help="concurrent streaming clients")
    parser.add_argument("--num-prompts", type=int, default=None,
                        help="prompts (default: --clients, one each); more queue for the next free client")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--serve-child", metavar="JSON", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_child is not None:
        serve_child(args.serve_child)
        return 0
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads OpenMP (see above)
    from pprun.config.config import PprunConfig
    from pprun.config.validate import validate_config

    vocab = validate_config(PprunConfig.from_kwargs(**engine_kwargs(args))).arch.vocab_size
    prompts = make_prompts(args.num_prompts or args.clients, args.input_len, vocab, args.seed)
    offline, offline_ids = run_offline(args, prompts)
    served, served_ids = run_served(args, prompts)
    print(json.dumps({
        "workload": {"model": args.model, "pp": args.pp, "executor": offline["engine"]["executor"],
                     "clients": args.clients, "num_prompts": len(prompts), "input_len": args.input_len,
                     "output_len": args.output_len,
                     "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY")},
        "offline": offline, "grpc": served,
        "same_tokens": served_ids == offline_ids,
        "grpc_over_offline_throughput": served["output_tok_s"] / offline["output_tok_s"],
        "added_ttft_p50_ms": served["added_ttft_p50_ms"],
    }, indent=2))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
