"""Serving overhead: throughput through gRPC against offline generation on the same workload, and
the time to first token the server adds.  Prints one JSON object.

    python scripts/bench_serve.py --model smollm2-135m-instruct --clients 16 --output-len 32
    python scripts/bench_serve.py --model /tmp/llama1b --clients 64 --input-len 512 --output-len 128

Both sides run the same random token-id prompts (seeded, EOS ignored, greedy) in one process
run: first offline (``LLM.generate`` with every prompt submitted at once, as ``pprun bench``
times it, after a warm-up batch), then — with the offline engine shut down — a ``pprun serve``
process with the same engine settings and ``--clients`` concurrent streaming ``Generate`` calls
(after the same warm-up through the server).  Throughput is output tokens over wall time.  The
TTFT the server adds is, per request, what the client saw (call start to first response)
minus what the engine saw (the request reaching the engine thread to its first token, from the
final response's timings): gRPC, serialization, the hand-over to the engine thread and the
delivery back.
"""

from __future__ import annotations

import argparse
import asyncio
import json
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


def make_prompts(num: int, input_len: int, vocab_size: int, seed: int) -> list[list[int]]:
    """Random token-id prompts (ids 10.. to stay clear of special tokens)."""
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab_size) for _ in range(input_len)] for _ in range(num)]


def engine_kwargs(args) -> dict:
    """LLM keyword arguments shared by both sides."""
    kw = {"model": args.model, "pipeline_parallel_size": args.pp, "max_num_seqs": max(args.clients, 1)}
    if args.executor:
        kw["executor"] = args.executor
    if args.runner:
        kw["runner"] = args.runner
    if args.dtype:
        kw["dtype"] = args.dtype
    return kw


def run_offline(args, prompts: list[list[int]]) -> dict:
    """Offline throughput and TTFT on the prompts."""
    from pprun import LLM
    from pprun.sampling.params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    warm = SamplingParams(temperature=0.0, max_tokens=min(16, args.output_len), ignore_eos=True)
    with LLM(**engine_kwargs(args)) as llm:
        llm.generate([{"prompt_token_ids": p} for p in prompts], warm)
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        wall = time.perf_counter() - t0
        facts = llm.describe()
    num_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    ttfts = [o.metrics.time_to_first_token for o in outs if o.metrics.time_to_first_token is not None]
    return {"output_tokens": num_tokens, "wall_s": wall, "output_tok_s": num_tokens / wall,
            "ttft_p50_ms": 1e3 * statistics.median(ttfts), "engine": facts}


async def _stream_all(address: str, prompts: list[list[int]], max_tokens: int, clients: int) -> tuple[list[dict], float]:
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
            t_first, num_tokens, final = None, 0, None
            async for resp in stubs[i % len(stubs)].Generate(
                pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompts[i]), sampling=sampling)
            ):
                if t_first is None and resp.token_ids:
                    t_first = time.time()
                num_tokens += len(resp.token_ids)
                if resp.HasField("final"):
                    final = resp.final
            t = final.timings
            return {"tokens": num_tokens, "client_ttft": t_first - t_send,
                    "engine_ttft": t.first_token_time - t.arrival_time}

    t0 = time.perf_counter()
    try:
        results = await asyncio.gather(*(one(i) for i in range(len(prompts))))
    finally:
        for c in channels:
            await c.close()
    return results, time.perf_counter() - t0


def run_served(args, prompts: list[list[int]]) -> dict:
    """Throughput and TTFT through a ``pprun serve`` process on loopback."""
    from serve_helpers import ServerProcess

    overrides = [f"model.model={args.model}", f"parallel.pipeline_parallel_size={args.pp}",
                 f"scheduler.max_num_seqs={max(args.clients, 1)}"]
    overrides.append(f"parallel.executor={args.executor or ('uni' if args.pp == 1 else 'ray')}")
    if args.runner:
        overrides.append(f"runner={args.runner}")
    if args.dtype:
        overrides.append(f"model.dtype={args.dtype}")
    with tempfile.TemporaryDirectory() as tmp:
        server = ServerProcess(Path(tmp), overrides, startup_timeout_s=1800)
        try:
            asyncio.run(_stream_all(server.address, prompts, min(16, args.output_len), args.clients))  # warm-up
            results, wall = asyncio.run(_stream_all(server.address, prompts, args.output_len, args.clients))
        finally:
            rc = server.terminate()
    num_tokens = sum(r["tokens"] for r in results)
    added = [1e3 * (r["client_ttft"] - r["engine_ttft"]) for r in results]
    return {"output_tokens": num_tokens, "wall_s": wall, "output_tok_s": num_tokens / wall,
            "client_ttft_p50_ms": 1e3 * statistics.median(r["client_ttft"] for r in results),
            "engine_ttft_p50_ms": 1e3 * statistics.median(r["engine_ttft"] for r in results),
            "added_ttft_p50_ms": statistics.median(added), "added_ttft_p90_ms": percentile(added, 90),
            "server_exit_status": rc}


def main() -> int:
    """Run both sides and print the comparison as JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct", help="model directory or alias")
    parser.add_argument("--pp", type=int, default=1, help="pipeline stages")
    parser.add_argument("--executor", default=None, help="uni|mp|ray (default: the config's auto)")
    parser.add_argument("--runner", default=None, help="auto|v1|v2")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--clients", type=int, default=16, help="concurrent streaming clients (= prompts)")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    from pprun.config.config import PprunConfig
    from pprun.config.validate import validate_config

    vocab = validate_config(PprunConfig.from_kwargs(**engine_kwargs(args))).arch.vocab_size
    prompts = make_prompts(args.clients, args.input_len, vocab, args.seed)
    offline = run_offline(args, prompts)
    served = run_served(args, prompts)
    print(json.dumps({
        "workload": {"model": args.model, "pp": args.pp, "clients": args.clients, "input_len": args.input_len,
                     "output_len": args.output_len},
        "offline": offline, "grpc": served,
        "grpc_over_offline_throughput": served["output_tok_s"] / offline["output_tok_s"],
        "added_ttft_p50_ms": served["added_ttft_p50_ms"],
    }, indent=2))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
