"""GPU speed report for one stage (docs/performance.md's one-GPU figures), as one JSON object.

    python scripts/gpu_speed.py MODEL_DIR [--out result.json]

- matmul_tflops: bf16 8192^3 matmul rate on this GPU (the prefill yardstick);
- decode_b{1,32}: ms per engine step, ms per bare graph replay, tokens/s, at context ~512; for an
  FP8 checkpoint also its ``Fp8Linear`` count and which kernels multiply them at that batch
  (``--ab-only FP8_SKINNY_ENABLED``: the split-K kernels reading float8 against cuBLAS's scaled
  FP8 matmul); for an FP8 mixture-of-experts checkpoint the sparse blocks whose experts stay float8
  (``--ab-only FP8_EXPERTS_ENABLED``: against the experts dequantized at load);
- prefill: 8 prompts of 2048 tokens (``--prefill-shape LEN,NUM[,BUDGET]``), achieved TFLOP/s (2 * params * tokens + attention; a
  mixture-of-experts model's params counted as a token uses them: top_k of its experts) and its share
  of the matmul rate (median of three runs);
- memory: weights, KV cache (configured share vs allocated), CUDA-graph pool, and device memory
  in use before/after 1,000 decode steps (flat = nothing allocated in steady state);
- with --graph-trace: every kernel of the decode graph as the profiler sees it inside replays
  (CUPTI traces graph-launched kernels): per kernel name its count and mean time per replay, and
  the replay's span against the sum of its kernels (the rest is launch gaps and dependency waits,
  less any overlap that programmatic dependent launch allows);
- with --prefill-trace: the kernels of one more prefill run by name (launches, time), their busy
  time against the run's wall time.
"""

from __future__ import annotations

import argparse
import ast
import json
import time
from pathlib import Path

import torch

import pprun.layers
import pprun.layers.skinny
from pprun import LLM, SamplingParams
from pprun.layers.fp8_linear import Fp8Linear


def matmul_tflops() -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(20):
        a @ b
    e.record()
    torch.cuda.synchronize()
    return 2 * 8192**3 / (s.elapsed_time(e) / 20 / 1e3) / 1e12


def until_decoding(eng, batch: int) -> None:
    for _ in range(10 * batch + 50):
        eng.step()
        running = eng.scheduler._running
        if len(running) == batch and all(r.num_computed_tokens >= len(r.prompt_token_ids) for r in running):
            return


def profiled_kernels(fn) -> tuple[list[dict], float]:
    """The CUDA kernels the profiler saw while ``fn()`` ran (synchronised before and after), as
    Chrome-trace events in start order, and the run's wall time in microseconds."""
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        wall_us = (time.perf_counter() - t0) * 1e6
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        with open(f.name) as trace:
            events = json.load(trace)["traceEvents"]
    return sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"]), wall_us


def graph_trace(graph, replays: int = 20) -> dict:
    """Kernels of ``replays`` replays of ``graph``, summarised per kernel name and per replay."""
    def replay_all() -> None:
        for _ in range(replays):
            graph.replay()
            torch.cuda.synchronize()  # a gap between replays marks where one ends

    kernels, _ = profiled_kernels(replay_all)
    if not kernels:
        return {"error": "the profiler saw no kernels inside the graph replays"}
    # Split into replays at the largest gaps (the host synchronises between replays).
    gaps = sorted(range(1, len(kernels)), key=lambda i: kernels[i]["ts"] - kernels[i - 1]["ts"] -
                  kernels[i - 1]["dur"], reverse=True)[: replays - 1]
    bounds = [0, *sorted(gaps), len(kernels)]
    runs = [kernels[a:b] for a, b in zip(bounds, bounds[1:])]
    if len(runs) < 2:
        return {"error": f"the trace split into {len(runs)} replay(s); need at least 2"}
    per_name: dict[str, list[float]] = {}
    spans, busy = [], []
    for run in runs[1:]:  # the first replay may pay for cold caches
        spans.append(run[-1]["ts"] + run[-1]["dur"] - run[0]["ts"])
        busy.append(sum(k["dur"] for k in run))
        for k in run:
            per_name.setdefault(k["name"], []).append(k["dur"])
    n = len(runs) - 1
    table = sorted(({"kernel": name[:90], "per_replay": round(len(d) / n, 2),
                     "mean_us": round(sum(d) / len(d), 2), "us_per_replay": round(sum(d) / n, 1)}
                    for name, d in per_name.items()), key=lambda r: -r["us_per_replay"])
    order = [{"kernel": k["name"][:60], "start_us": round(k["ts"] - runs[-1][0]["ts"], 2),
              "dur_us": round(k["dur"], 2)} for k in runs[-1]]
    return {"replays": n, "kernels_per_replay": round(sum(len(r) for r in runs[1:]) / n, 1),
            "span_us": round(sum(spans) / n, 1), "kernel_time_us": round(sum(busy) / n, 1),
            "kernels": table, "last_replay": order}


MAX_MODEL_LEN: int | None = None
"""--max-model-len: the engines' max_model_len (None: context + steps + 64, just enough).  It sets
the decode attention's split count, which graphs fix at capture."""


def decode(model: str, batch: int, ctx: int, steps: int, memory_steps: int = 0,
           measure_memory: bool = True, trace: bool = False) -> dict:
    util = 0.3
    free_before, total = torch.cuda.mem_get_info()
    llm = LLM(model, runner="v2", cudagraph_mode="full", max_num_seqs=batch,
              max_model_len=MAX_MODEL_LEN or ctx + steps + memory_steps + 64, gpu_memory_utilization=util)
    eng = llm.engine
    runner = eng.executor.worker.runner
    g = torch.Generator().manual_seed(0)
    sp = SamplingParams(temperature=0, max_tokens=steps + memory_steps + 32, ignore_eos=True)
    for _ in range(batch):
        eng.add_request(torch.randint(10, 30000, (ctx,), generator=g).tolist(), sp)
    until_decoding(eng, batch)
    for _ in range(5):
        eng.step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        eng.step()
    torch.cuda.synchronize()
    step_ms = (time.perf_counter() - t0) * 1e3 / steps
    out = {"batch": batch, "ctx": ctx, "engine_step_ms": round(step_ms, 4),
           "tokens_per_s": round(batch / step_ms * 1e3, 1)}
    fp8 = sum(isinstance(m, Fp8Linear) for m in runner.model.modules())
    if fp8:
        # Which kernels multiply the float8 weights at this batch (pprun.layers.linear's dispatch).
        skinny_rows = pprun.layers.SKINNY_ENABLED and pprun.layers.FP8_SKINNY_ENABLED
        out["fp8_linears"] = fp8
        block = any(isinstance(m, Fp8Linear) and m.block_scaled for m in runner.model.modules())
        max_rows = pprun.layers.skinny.FP8_BLOCK_DISPATCH_MAX_M if block else pprun.layers.skinny.DISPATCH_MAX_M
        out["fp8_matmul"] = "split-K float8 (W8A16)" if skinny_rows and batch <= max_rows else "cuBLAS scaled_mm"
    fp8_experts = sum(getattr(m, "w13_scale", None) is not None for m in runner.model.modules())
    if fp8_experts:
        out["fp8_expert_blocks"] = fp8_experts  # sparse blocks whose grouped kernels read float8
    graphs = runner.graphs
    if graphs.full:
        size = min(s for s in graphs.full if s >= batch)
        graph = graphs.full[size].graph
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(100):
            graph.replay()
        e.record()
        torch.cuda.synchronize()
        out["graph_replay_ms"] = round(s.elapsed_time(e) / 100, 4)
        out["host_overhead_ms"] = round(step_ms - out["graph_replay_ms"], 4)
        if trace:
            out["graph_trace"] = graph_trace(graph)
    if memory_steps and measure_memory:
        torch.cuda.synchronize()
        used0 = torch.cuda.memory_allocated()
        reserved0 = torch.cuda.memory_reserved()
        free0, _ = torch.cuda.mem_get_info()
        for _ in range(memory_steps):
            eng.step()
        torch.cuda.synchronize()
        worker = eng.executor.worker
        kv_bytes = sum(layer.self_attn.kv_cache.numel() * layer.self_attn.kv_cache.element_size()
                       for layer in worker.model.layers)
        weight_bytes = sum(p.numel() * p.element_size() for p in worker.model.parameters())
        pool = getattr(graphs, "pool", None)
        out["memory"] = {
            "steps": memory_steps,
            "allocated_before_bytes": used0,
            "allocated_after_bytes": torch.cuda.memory_allocated(),
            "reserved_before_bytes": reserved0,
            "reserved_after_bytes": torch.cuda.memory_reserved(),
            "device_free_before_bytes": free0,
            "device_free_after_bytes": torch.cuda.mem_get_info()[0],
            "weights_bytes": weight_bytes,
            "kv_cache_bytes": kv_bytes,
            "kv_cache_configured_share_bytes": int((free_before - weight_bytes) * util),
            "cuda_graph_pool_note": "pool shared by all captured sizes" if pool is not None else None,
        }
    llm.shutdown()
    del llm, eng, runner
    torch.cuda.empty_cache()
    return out


def prefill_trace(llm, prompts, sp) -> dict:
    """Kernels of one prefill run (eager: prefill steps run outside the CUDA graphs) under the
    profiler: per kernel name its launches and time, the kernels' busy time against the run's
    wall time (the rest is the GPU waiting for the host)."""
    kernels, wall_us = profiled_kernels(lambda: llm.generate(prompts, sp))
    if not kernels:
        return {"error": "the profiler saw no kernels"}
    per_name: dict[str, list[float]] = {}
    for k in kernels:
        per_name.setdefault(k["name"], []).append(k["dur"])
    table = sorted(({"kernel": name[:90], "launches": len(d), "us": round(sum(d), 1)} for name, d in per_name.items()),
                   key=lambda r: -r["us"])
    span = kernels[-1]["ts"] + kernels[-1]["dur"] - kernels[0]["ts"]
    return {"wall_us": round(wall_us, 1), "kernel_span_us": round(span, 1),
            "kernel_time_us": round(sum(k["dur"] for k in kernels), 1), "launches": len(kernels),
            "kernels": table[:40]}


def prefill(model: str, prompt_len: int = 2048, num_prompts: int = 8, budget: int | None = None,
            trace: bool = False) -> dict:
    # Prefix caching off: the timed runs repeat the warm-up's and each other's prompts, which a
    # cache would serve without computing them.
    llm = LLM(model, runner="v2", cudagraph_mode="full", max_num_seqs=num_prompts,
              max_num_batched_tokens=budget or prompt_len * 2, max_model_len=prompt_len + 16,
              enable_prefix_caching=False)
    arch = llm.engine.resolved.arch
    g = torch.Generator().manual_seed(0)
    sp = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    prompts = [{"prompt_token_ids": torch.randint(10, 30000, (prompt_len,), generator=g).tolist()}
               for _ in range(num_prompts)]
    llm.generate(prompts[:2], sp)
    # One run is ~65 ms: the median of three (each one listed) keeps a host hiccup out.
    runs = []
    for _ in range(3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        llm.generate(prompts, sp)
        torch.cuda.synchronize()
        runs.append(time.perf_counter() - t0)
    elapsed = sorted(runs)[1]
    # The weights a token multiplies: all of a dense model's; of a mixture-of-experts model's
    # experts (w13 / w2, [num_experts, ...]) the top_k of num_experts it is routed to.
    share = arch.moe.top_k / arch.moe.num_experts if arch.moe is not None else 1.0
    n_params = sum(
        p.numel() * (share if name.endswith((".w13", ".w2")) else 1.0)
        for name, p in llm.engine.executor.worker.model.named_parameters()
    )
    tokens = prompt_len * num_prompts
    # Causal attention: QK^T and PV, each 2 * L^2/2 * d per head per layer.
    attn = 2 * 2 * (prompt_len**2 / 2) * arch.head_dim * arch.num_attention_heads * arch.num_hidden_layers
    flops = 2 * n_params * tokens + attn * num_prompts
    traced = prefill_trace(llm, prompts, sp) if trace else None
    llm.shutdown()
    torch.cuda.empty_cache()
    return {"prompt_len": prompt_len, "num_prompts": num_prompts, "elapsed_s": round(elapsed, 4),
            "elapsed_s_runs": [round(r, 4) for r in runs],
            "tokens_per_s": round(tokens / elapsed, 1), "tflops": round(flops / elapsed / 1e12, 1),
            **({"trace": traced} if traced else {})}


def switches() -> list[tuple]:
    """The A/B switches: (module, flag, the other value, whether batch 1 runs differently with it)."""
    import pprun.attention.triton_ops
    import pprun.kernels.triton_utils
    import pprun.layers
    import pprun.layers.fp8_block_gemm
    import pprun.layers.fused
    import pprun.layers.head_norm
    import pprun.layers.moe
    import pprun.layers.moe_triton
    import pprun.layers.skinny
    import pprun.worker.kv_cache
    import pprun.worker.v2.inputs
    import pprun.worker.v2.runner

    return [(pprun.layers, "SKINNY_ENABLED", False, True),
            (pprun.layers, "FP8_SKINNY_ENABLED", False, True),  # FP8 checkpoints only
            (pprun.layers.skinny, "FP8_BLOCK_DISPATCH_MAX_M", 32, False),  # block-scaled FP8 checkpoints only
            (pprun.layers.fp8_block_gemm, "TRITON_MAX_M", 8192, False),  # the same: Triton's W8A8, not cuBLAS's
            (pprun.layers, "FUSED_DECODE_ENABLED", False, True),
            (pprun.kernels.triton_utils, "PDL_ENABLED", False, True),
            (pprun.layers, "NORM_FOLD_ENABLED", False, True),
            (pprun.worker.v2.runner, "GRAPH_LOGITS_ENABLED", False, True),
            (pprun.layers.skinny, "DISPATCH_MAX_M", 1, False),  # 1: cuBLAS above one row
            (pprun.attention.triton_ops, "DECODE_PRELOAD_KV", False, True),
            (pprun.layers.skinny, "WEIGHTS_AHEAD_ENABLED", False, True),
            (pprun.layers.skinny, "HOLD_LAST_ENABLED", False, False),
            (pprun.layers.skinny, "SWAPPED_NUM_STAGES", 3, False),
            (pprun.attention.triton_ops, "DECODE_MIN_TOKENS_PER_SPLIT", 256, True),
            (pprun.attention.triton_ops, "_DECODE_BLOCK_N", 32, True),
            (pprun.attention.triton_ops, "_DECODE_NUM_WARPS", 4, True),
            (pprun.attention.triton_ops, "_DECODE_NUM_STAGES", 3, True),
            (pprun.attention.triton_ops, "DECODE_PROGRAMS_PER_SM", 4, False),
            (pprun.layers.skinny, "SWAPPED_TARGET_PROGRAMS", 256, False),
            (pprun.layers.skinny, "WEIGHTS_AHEAD_MAX_ROWS", 32, False),
            (pprun.worker.kv_cache, "HEAD_MAJOR", not pprun.worker.kv_cache.HEAD_MAJOR, True),
            (pprun.layers, "DEFER_MERGE_ENABLED", False, False),
            (pprun.layers.skinny, "DEFERRED_TARGET_PROGRAMS", 128, False),
            # Mixture-of-experts models only: narrower expert tiles at small batches (where no tuned
            # settings apply), every step's sort by expert over chunks instead of the one-program
            # kernel, and the sort at batch 1 too (no direct layout).
            (pprun.layers.moe_triton, "SPARSE_BLOCK_N", 32, True),
            (pprun.layers.moe_triton, "ALIGN_KERNEL_MAX_ENTRIES", 0, True),
            (pprun.layers.moe_triton, "DIRECT_MAX_ENTRIES", 0, True),
            (pprun.layers.moe_triton, "PARTIALS_MAX_TOKENS", 1024, False),  # prefill only
            (pprun.layers.moe_triton, "PARTIALS_IN_DTYPE", False, True),
            (pprun.layers.moe_triton, "ALIGN_CHUNKED_ENABLED", False, False),  # prefill only
            # FP8 mixture-of-experts checkpoints only: the experts dequantized at load (bf16 experts);
            # block-scaled float8 experts W8A16 (weights upcast in registers, bf16 MMAs) at every
            # step instead of W8A8 from 32 tokens (FP8_W8A8_MIN_TOKENS=N: W8A8 from N tokens).
            (pprun.layers.moe, "FP8_EXPERTS_ENABLED", False, True),
            (pprun.layers.moe_triton, "FP8_W8A8_MIN_TOKENS", None, False),
            # Qwen3 models: the q/k head norms one program per head at every size.
            (pprun.layers.head_norm, "WHOLE_TOKEN_MIN_TOKENS", None, False),
            (pprun.layers.fused, "NORM_PARTS_NUM_WARPS", 4, False),
            (pprun.attention.triton_ops, "DECODE_PRELOAD_SECOND", False, False),
            # Prefill attention (heads wider than 64): every tile masked, 64-row query blocks, 3 stages.
            (pprun.attention.triton_ops, "PREFILL_SPLIT_DIAGONAL", False, False),
            (pprun.attention.triton_ops, "PREFILL_BLOCK_M", 64, False),
            (pprun.attention.triton_ops, "PREFILL_NUM_STAGES", 3, False),
            (pprun.worker.v2.inputs, "STAGING_KERNEL_ENABLED", False, True)]


def model_config(model: str) -> dict:
    """The checkpoint's (text) ``config.json``."""
    config = json.loads((Path(model) / "config.json").read_text())
    return config.get("text_config", config)


def is_moe(model: str) -> bool:
    """The checkpoint is a mixture-of-experts model (its ``config.json`` names experts)."""
    return any(model_config(model).get(k) for k in ("num_experts", "num_local_experts"))


def parse_settings(text: str) -> list[list[tuple]]:
    """``NAME`` (the switch's other value) or ``NAME=VALUE`` (a Python literal), comma-separated;
    ``A=1+B=2`` is one setting of several switches at once (timed as one A/B run)."""
    by_name = {sw[1]: sw for sw in switches()}
    chosen = []
    for group in text.split(","):
        settings = []
        for item in group.split("+"):
            name, _, value = item.partition("=")
            if name not in by_name:
                raise SystemExit(f"{name!r} unknown; choose from {sorted(by_name)}")
            module, flag, flipped, b1_differs = by_name[name]
            try:
                settings.append((module, flag, ast.literal_eval(value) if value else flipped, b1_differs))
            except (ValueError, SyntaxError):
                raise SystemExit(f"{item!r}: the value must be a Python literal (e.g. {flag}=2)") from None
        chosen.append(settings)
    return chosen


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--memory-steps", type=int, default=1000)
    ap.add_argument("--no-prefill", action="store_true")
    ap.add_argument("--no-decode", action="store_true", help="the prefill alone")
    ap.add_argument("--prefill-shape", default="2048,8",
                    help="LEN,NUM[,BUDGET]: NUM prompts of LEN tokens, BUDGET tokens per step (default 2 x LEN)")
    ap.add_argument("--prefill-trace", action="store_true",
                    help="also profile one prefill run: its kernels by name, their busy time against the wall time")
    ap.add_argument("--graph-trace", action="store_true",
                    help="also trace the kernels inside the batch-1 and batch-32 decode graphs (every A/B run too)")
    ap.add_argument("--ab", action="store_true",
                    help="also run decode with each switch flipped in turn: split-K matmuls "
                         "(PPRUN_DISABLE_SKINNY_GEMM), an FP8 checkpoint's 1-32-row matmuls through cuBLAS's scaled "
                         "FP8 matmul instead of the split-K kernels reading float8 (FP8_SKINNY_ENABLED), block-scaled FP8 "
                         "weights through the split-K kernels up to 32 rows instead of at one row "
                         "(FP8_BLOCK_DISPATCH_MAX_M), block-scaled FP8 matmuls through Triton's W8A8 kernel instead "
                         "of cuBLAS's (TRITON_MAX_M), the fused decode attention "
                         "(PPRUN_DISABLE_FUSED_DECODE), programmatic dependent launch (PPRUN_DISABLE_PDL), "
                         "add + RMSNorm folded into the matmuls (PPRUN_DISABLE_NORM_FOLD), LM head and "
                         "greedy argmax inside the decode graphs (PPRUN_DISABLE_GRAPH_LOGITS), the split-K "
                         "kernels above one row (DISPATCH_MAX_M set to 1: cuBLAS from two rows on), the decode "
                         "attention's first K/V tile loaded before its PDL wait (DECODE_PRELOAD_KV), o_proj's weights "
                         "loaded before its wait at one row (WEIGHTS_AHEAD_ENABLED), decode splits of at least 256 tokens of the longest "
                         "context instead of 64 (DECODE_MIN_TOKENS_PER_SPLIT), 32-token decode K/V tiles instead of 64 "
                         "(_DECODE_BLOCK_N), 4 warps per decode program instead of 2 (_DECODE_NUM_WARPS), 3 pipeline stages for the "
                         "decode K/V tiles instead of 2 (_DECODE_NUM_STAGES), decode splits aiming "
                         "at 4 programs per SM instead of 2 (DECODE_PROGRAMS_PER_SM: more splits above one row), the "
                         "2-32-row matmuls split K until ~256 programs instead of ~128 (SWAPPED_TARGET_PROGRAMS), o_proj's "
                         "weights loaded before its wait up to 32 rows instead of at one row (WEIGHTS_AHEAD_MAX_ROWS), the KV cache "
                         "stored head-major or token-major, whichever is not the default (HEAD_MAJOR), o_proj's and down's split-K partials merged by "
                         "their own launch instead of the next kernel's (DEFER_MERGE_ENABLED), the norm-merged ones split K until ~128 "
                         "programs instead of ~256 (DEFERRED_TARGET_PROGRAMS), 4 warps per row instead of 16 in the norm "
                         "that merges partials (NORM_PARTS_NUM_WARPS), the decode attention's second K/V tile "
                         "loaded in its loop instead of before its PDL wait (DECODE_PRELOAD_SECOND; batch 32 only), a step's "
                         "inputs sent by cudaMemcpy plus indexed writes instead of the staging kernel "
                         "(STAGING_KERNEL_ENABLED); MoE models: narrower expert tiles (SPARSE_BLOCK_N), the sort over "
                         "chunks at every size (ALIGN_KERNEL_MAX_ENTRIES=0), the sort at batch 1 too (DIRECT_MAX_ENTRIES=0), "
                         "the experts' rows summed past 1,024 tokens, not left to the norm (PARTIALS_MAX_TOKENS), "
                         "the partials left to the norm in fp32 (PARTIALS_IN_DTYPE=False), long steps sorted by "
                         "torch ops (ALIGN_CHUNKED_ENABLED=False), an FP8 checkpoint's experts dequantized at load "
                         "instead of kept float8 (FP8_EXPERTS_ENABLED), block-scaled float8 experts W8A16 (bf16 "
                         "MMAs) at every step instead of W8A8 from 32 tokens (FP8_W8A8_MIN_TOKENS=None; =N: W8A8 from N tokens); Qwen3: q/k head norms one program per head at every "
                         "size (head_norm.WHOLE_TOKEN_MIN_TOKENS=None); prefill attention with 64-row query blocks "
                         "(PREFILL_BLOCK_M=64), every tile masked (PREFILL_SPLIT_DIAGONAL=False), 3 stages "
                         "(PREFILL_NUM_STAGES=3)")
    ap.add_argument("--ab-only", default="",
                    help="comma-separated flag names: flip only these (e.g. NORM_FOLD_ENABLED); NAME=VALUE "
                         "sets one to VALUE instead (e.g. DECODE_MIN_TOKENS_PER_SPLIT=128); A=1+B=2 sets "
                         "several for one run")
    ap.add_argument("--ab-prefill", action="store_true",
                    help="with --ab, also time the prefill with each switch flipped (with --no-decode: only the "
                         "prefill; the default-settings "
                         "prefill runs last, as without this flag)")
    ap.add_argument("--max-model-len", type=int, default=None,
                    help="the decode engines' max_model_len (default: context + steps + 64)")
    ap.add_argument("--set", default="",
                    help="NAME=VALUE,...: set these switches for every run (the baseline of --ab too)")
    args = ap.parse_args()
    if args.ab_only and not args.ab:
        raise SystemExit("--ab-only needs --ab")
    if args.no_decode and args.no_prefill:
        raise SystemExit("--no-decode and --no-prefill leave nothing to run")
    if args.no_decode and args.ab and not args.ab_prefill:
        raise SystemExit("--no-decode with --ab times the prefill alone: add --ab-prefill")
    if args.ab_prefill and (not args.ab or args.no_prefill):
        raise SystemExit("--ab-prefill needs --ab and the prefill (no --no-prefill)")
    global MAX_MODEL_LEN
    MAX_MODEL_LEN = args.max_model_len
    res = {"max_model_len": args.max_model_len} if args.max_model_len else {}
    if args.set:
        for settings in parse_settings(args.set):
            for module, flag, value, _ in settings:
                setattr(module, flag, value)
                res.setdefault("set", {})[flag] = value
    res.update({"device": torch.cuda.get_device_name(), "matmul_tflops": round(matmul_tflops(), 1)})
    try:
        shape = [int(v) for v in args.prefill_shape.split(",")]
    except ValueError:
        shape = []
    if len(shape) not in (2, 3) or min(shape) < 1:
        raise SystemExit(f"--prefill-shape {args.prefill_shape!r}: expected LEN,NUM or LEN,NUM,BUDGET (positive)")
    prefill_kw = {"prompt_len": shape[0], "num_prompts": shape[1], "budget": shape[2] if len(shape) == 3 else None}
    if not args.no_decode:
        res["decode_b1"] = decode(args.model, 1, 512, 200, memory_steps=args.memory_steps, trace=args.graph_trace)
        res["decode_b32"] = decode(args.model, 32, 512, 100, trace=args.graph_trace)
    if args.ab:
        chosen = parse_settings(args.ab_only) if args.ab_only else [[sw] for sw in switches()]
        if not args.ab_only and not is_moe(args.model):
            # The expert kernels' switches change nothing in a dense model: not run.
            chosen = [g for g in chosen if g[0][0].__name__ not in ("pprun.layers.moe_triton", "pprun.layers.moe")]
        if not args.ab_only and "quantization_config" not in model_config(args.model):
            # Only FP8 checkpoints hold Fp8Linear layers and float8 experts.
            chosen = [g for g in chosen
                      if g[0][1] not in ("FP8_SKINNY_ENABLED", "FP8_BLOCK_DISPATCH_MAX_M", "TRITON_MAX_M",
                                         "FP8_EXPERTS_ENABLED", "FP8_W8A8_MIN_TOKENS")]
        if not args.ab_only and not model_config(args.model).get("model_type", "").startswith("qwen3"):
            # Only Qwen3's attention has q/k head norms.
            chosen = [g for g in chosen if g[0][0].__name__ != "pprun.layers.head_norm"]
        for settings in chosen:
            defaults = [getattr(module, flag) for module, flag, _, _ in settings]
            for module, flag, value, _ in settings:
                setattr(module, flag, value)
            label = "+".join(f"{flag}={value}" for _, flag, value, _ in settings)
            # Same max_model_len as the runs above (it sets the decode split count).
            if not args.no_decode:
                if any(b1_differs for *_, b1_differs in settings):
                    res[f"decode_b1_{label}"] = decode(args.model, 1, 512, 200, memory_steps=args.memory_steps,
                                                       measure_memory=False, trace=args.graph_trace)
                res[f"decode_b32_{label}"] = decode(args.model, 32, 512, 100, trace=args.graph_trace)
            if args.ab_prefill:
                res[f"prefill_{label}"] = prefill(args.model, **prefill_kw, trace=args.prefill_trace)
            for (module, flag, _, _), default in zip(settings, defaults):
                setattr(module, flag, default)
        if not args.no_decode:
            # Everything on again: the spread between this and the first run is the noise.
            res["decode_b1_again"] = decode(args.model, 1, 512, 200, memory_steps=args.memory_steps,
                                            measure_memory=False)
            res["decode_b32_again"] = decode(args.model, 32, 512, 100)
    if not args.no_prefill:
        res["prefill"] = prefill(args.model, **prefill_kw, trace=args.prefill_trace)
        res["prefill"]["share_of_matmul_rate"] = round(res["prefill"]["tflops"] / res["matmul_tflops"], 3)
    text = json.dumps(res, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
