"""Time the expert kernels of a mixture-of-experts layer on one GPU, as one JSON object.

    python scripts/bench_moe_kernels.py [--hidden 2048] [--inter 768] [--experts 128] [--top-k 8]
        [--tokens 1,32,256,2048] [--tune]

For each token count: the fused path of one sparse layer (routing launch, sort, the two grouped
GEMMs, the top-k sum) replayed as a CUDA graph, in microseconds per layer; the expert weight
bytes it must read (each expert some token chose, read once: ``E_used * 3 * hidden * inter * 2``
in bf16) and the bandwidth that implies, i.e. how close the layer runs to the HBM floor of the
bytes it reads; and the reference loop over experts (eager) for comparison.  ``--tune`` times
each :class:`~pprun.layers.moe_triton.GemmConfig` of a small grid as well and reports the
fastest.  Random routing (softmax of N(0, 1) logits), so the experts used follow the top-k of
uniform routers.
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch

from pprun.layers import moe_triton
from pprun.layers.moe import experts_reference, route


def graph_us(fn, replays: int = 50) -> float:
    """Microseconds per replay of ``fn`` captured in a CUDA graph."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / replays * 1e3


def eager_us(fn, repeats: int = 5) -> float:
    """Microseconds per eager call of ``fn`` (host syncs included)."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats * 1e3


def time_tokens(num_tokens: int, args: argparse.Namespace, w13: torch.Tensor, w2: torch.Tensor,
                gen: torch.Generator) -> dict:
    """One token count's row of the report (module docstring)."""
    device, dtype = w13.device, w13.dtype
    x = torch.randn(num_tokens, args.hidden, device=device, generator=gen).to(dtype)
    logits = torch.randn(num_tokens, args.experts, device=device, generator=gen).to(dtype)
    weights, ids = route(logits.float(), args.top_k, True)
    used = int(ids.unique().numel())
    weight_bytes = used * 3 * args.hidden * args.inter * dtype.itemsize

    def layer(config: moe_triton.GemmConfig | None = None) -> torch.Tensor:
        w, i = moe_triton.fused_route(logits, args.top_k, True)
        return moe_triton.fused_experts(x, w13, w2, w, i, config)

    us = graph_us(layer)
    row = {
        "tokens": num_tokens, "experts_used": used, "expert_weight_mb": round(weight_bytes / 1e6, 2),
        "fused_us": round(us, 2), "fused_gbps": round(weight_bytes / us / 1e3, 1),
        "default_config": moe_triton.default_config(num_tokens * args.top_k, args.experts, dtype)._asdict(),
        "reference_loop_us": round(eager_us(lambda: experts_reference(x, w13, w2, weights, ids)), 1),
    }
    if args.tune:
        timed, failed = [], []
        for bm, bn, bk, warps, stages in itertools.product((16, 32, 64), (32, 64, 128), (64, 128), (4, 8), (3, 4)):
            config = moe_triton.GemmConfig(bm, bn, bk, warps, stages)
            try:
                timed.append((graph_us(lambda c=config: layer(c), replays=20), config))
            except Exception as exc:  # a config this GPU cannot run (shared memory): reported
                failed.append(f"{config}: {type(exc).__name__}")
        best_us, best = min(timed, key=lambda t: t[0])
        row["tuned"] = {"us": round(best_us, 2), "gbps": round(weight_bytes / best_us / 1e3, 1),
                        "config": best._asdict(), "failed": failed}
    return row


def main() -> None:
    """Parse the command line, time each token count, print the JSON."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=768)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--tokens", default="1,32,256,2048")
    ap.add_argument("--tune", action="store_true", help="also time a grid of GemmConfigs")
    args = ap.parse_args()
    device, dtype = torch.device("cuda"), torch.bfloat16
    gen = torch.Generator(device=device).manual_seed(0)
    w13 = (torch.randn(args.experts, 2 * args.inter, args.hidden, device=device, generator=gen) * 0.02).to(dtype)
    w2 = (torch.randn(args.experts, args.hidden, args.inter, device=device, generator=gen) * 0.02).to(dtype)
    rows = [time_tokens(int(t), args, w13, w2, gen) for t in args.tokens.split(",")]
    print(json.dumps({"device": torch.cuda.get_device_name(), "hidden": args.hidden, "inter": args.inter,
                      "experts": args.experts, "top_k": args.top_k, "layers": rows}, indent=2))


if __name__ == "__main__":
    main()
