"""Sweep launch settings of the decode matmuls (``pprun.layers.skinny``) and the decode attention
on this GPU, against cuBLAS, at the 1.1B model's shapes (the best of each case on stdout,
every timing as a JSON line in ``--out``).

    python scripts/sweep_skinny.py [--rows 1,16,32,64] [--workers 12] [--out sweep.jsonl]

Compiling hundreds of Triton variants one after another would take most of a GPU session, so
a pool of processes compiles every matmul variant first (each runs it once, with PDL as under
capture, filling Triton's on-disk cache; the attention variants compile as they are timed); one
process then times them all, graph-replayed,
each call reading its own copy of the weights so that nothing comes from L2
(``layer_bench.time_us``).  Rows above one sweep the swapped form (weight tile as the MMA's M
side) and, for reference, the default settings; one row sweeps pipeline stages around the
tuned defaults.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import json
import multiprocessing as mp
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from layer_bench import (  # noqa: E402
    HEAD_DIM,
    KV_HEADS,
    SHAPES,
    _cublas_swiglu,
    copies_for,
    decode_attention_inputs,
    time_us,
)


def candidates(m: int, name: str) -> list:
    from pprun.layers.skinny import SkinnyConfig, default_config

    k, n = SHAPES[name]
    swiglu = name == "gate_up"
    n_out = n // 2 if swiglu else n
    default = default_config(m, n_out, k, swiglu, torch.device("cuda"))
    out = [default]
    if m == 1:
        for stages in (2, 4, 5, 6):
            out.append(dataclasses.replace(default, num_stages=stages))
        for bn, bk in ((8, 256), (16, 256), (16, 512), (32, 256)):
            out.append(dataclasses.replace(default, block_n=bn, block_k=min(bk, k), num_stages=4))
        return list(dict.fromkeys(out))
    # Narrowed by a first full sweep (block_n 64/128, block_k 64-256, split 1-16, stages 3/4/6,
    # warps 4/8): 64-wide column tiles with 4 warps won every shape; splits only pay while the
    # column tiles alone leave SMs idle.
    k_splits = (1,) if n_out >= 8192 else (1, 2) if n_out >= 4096 else (2, 4) if k <= 2048 else (4, 8, 16)
    for bk, split, stages in itertools.product((64, 128), k_splits, (4, 6)):
        out.append(SkinnyConfig(64, bk, split, num_warps=4, num_stages=stages, swap_ab=True))
    return list(dict.fromkeys(out))


def jobs(rows: list[int], shapes: list[str]) -> list[tuple[int, str, object]]:
    return [(m, name, cfg) for m in rows for name in shapes for cfg in candidates(m, name)]


def _compile(batch: list) -> int:
    from pprun.layers.skinny import skinny_linear
    from pprun.layers.triton_utils import force_pdl

    failed = 0
    for m, name, cfg in batch:
        k, n = SHAPES[name]
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        try:
            with force_pdl():
                skinny_linear(x, w, swiglu=name == "gate_up", config=cfg)
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 - a variant that does not compile is skipped later
            failed += 1
            print(f"compile failed m={m} {name} {cfg}: {type(e).__name__}: {str(e)[:200]}", flush=True)
    return failed


def compile_all(all_jobs: list, workers: int) -> None:
    t0 = time.time()
    chunks = [all_jobs[i::workers] for i in range(workers)]
    with mp.get_context("spawn").Pool(workers) as pool:
        failed = sum(pool.map(_compile, chunks))
    print(f"# compiled {len(all_jobs)} variants in {time.time() - t0:.0f} s ({failed} failed)", flush=True)


def time_matmuls(rows: list[int], shapes: list[str], out) -> None:
    from pprun.layers.skinny import skinny_linear

    for name in shapes:
        k, n = SHAPES[name]
        swiglu = name == "gate_up"
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5 for _ in range(copies_for(n * k * 2))]
        nbytes = n * k * 2
        for m in rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            cublas = _cublas_swiglu if swiglu else torch.nn.functional.linear
            cublas_us = time_us([functools.partial(cublas, x, w) for w in ws], iters=5)
            best = None
            for i, cfg in enumerate(candidates(m, name)):
                try:
                    us = time_us([functools.partial(skinny_linear, x, w, swiglu=swiglu, config=cfg) for w in ws],
                                 iters=5)
                except Exception:  # noqa: BLE001
                    continue
                rec = {"shape": name, "m": m, **dataclasses.asdict(cfg), "us": round(us, 2),
                       "tb_s": round(nbytes / us / 1e6, 2), "cublas_us": round(cublas_us, 2),
                       "default": i == 0}
                out(rec)
                if best is None or us < best["us"]:
                    best = rec
            print(json.dumps({"best": best}), flush=True)


def time_attention(out) -> None:
    """Decode attention launch settings at 32 and 64 rows (``decode_attention_inputs``' context),
    compiled as they are timed; the module's defaults are put back whatever happens."""
    import pprun.attention.triton_ops as ops

    defaults = (ops._DECODE_BLOCK_N, ops._DECODE_NUM_WARPS, ops._DECODE_NUM_STAGES)
    real_splits = ops.num_decode_splits
    try:
        _sweep_attention(out, ops, defaults, real_splits)
    finally:
        ops._DECODE_BLOCK_N, ops._DECODE_NUM_WARPS, ops._DECODE_NUM_STAGES = defaults
        ops.num_decode_splits = real_splits


def _sweep_attention(out, ops, defaults, real_splits) -> None:
    for batch in (32, 64):
        d = decode_attention_inputs(batch)
        default_splits = real_splits(batch, KV_HEADS, d.cos.shape[0], d.q.device)  # max_len
        best = None
        for bn, warps, stages, splits in itertools.product((64, 128), (4, 8), (2, 3), sorted({default_splits, 1})):
            ops._DECODE_BLOCK_N, ops._DECODE_NUM_WARPS, ops._DECODE_NUM_STAGES = bn, warps, stages
            ops.num_decode_splits = lambda *a, s=splits: s
            try:
                us = time_us([functools.partial(ops.paged_decode_attention_rope, d.q, d.k, d.v, d.cos, d.sin, d.pos, kv,
                                                d.slots, d.table, d.seq_lens, HEAD_DIM**-0.5, d.o) for kv in d.kvs],
                             iters=5)
            except Exception:  # noqa: BLE001
                continue
            rec = {"attention_batch": batch, "block_n": bn, "warps": warps, "stages": stages, "splits": splits,
                   "us": round(us, 2), "kv_tb_s": round(d.kv_bytes / us / 1e6, 2),
                   "default": (bn, warps, stages, splits) == (*defaults, default_splits)}
            out(rec)
            if best is None or us < best["us"]:
                best = rec
        print(json.dumps({"best": best}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,16,32,64")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--workers", type=int, default=12)
    ap.add_argument("--parts", default="compile,matmul,attention",
                    help="compile: fill Triton's cache in parallel; matmul, attention: time")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    parts = args.parts.split(",")
    shapes = args.shapes.split(",")
    sink = args.out.open("a") if args.out else None

    def record(rec: dict) -> None:  # one JSON line per timing, written as it comes (a timeout keeps them)
        if sink:
            sink.write(json.dumps(rec) + "\n")
            sink.flush()

    if "compile" in parts:
        compile_all(jobs(rows, shapes), args.workers)
    if "matmul" in parts:
        time_matmuls(rows, shapes, record)
    if "attention" in parts:
        time_attention(record)


if __name__ == "__main__":
    main()
