"""Sweep the decode attention's launch settings at one batch size, alone and behind the qkv matmul.

    python scripts/decode_attn_sweep.py [--batch 32] [--ctx 560] [--out result.json]

For every setting (K/V tile length ``_DECODE_BLOCK_N``, warps per program, context splits via
``DECODE_PROGRAMS_PER_SM``, pipeline stages, which K/V tiles load before the PDL wait) it times,
graph-replayed with each call reading its own copy of the weights and KV cache:

- ``alone``: the fused decode attention (rotary, cache write, attention, split merge) reading
  the qkv matmul's split-K partials, launched back to back;
- ``pair``: the qkv matmul (split K, partials left to the attention) then the attention, as a
  decode layer of the 1.1B model runs them at 32 rows: what a setting is worth in the model.

Each setting's output is compared with the default's (``max_diff``): a setting that breaks the
kernel shows there.  Prints JSON, best pair first.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import layer_bench as lb  # noqa: E402

import pprun.attention.triton_ops as ops  # noqa: E402
from pprun.layers.skinny import skinny_linear  # noqa: E402

KNOBS = ("_DECODE_BLOCK_N", "_DECODE_NUM_WARPS", "DECODE_PROGRAMS_PER_SM", "_DECODE_NUM_STAGES",
         "DECODE_PRELOAD_KV", "DECODE_PRELOAD_SECOND")


def settings(full: bool, tiles: str = "") -> list[dict]:
    """The settings swept: K/V tiles of at most 128 values per thread (2 warps per 64 tokens), and
    twice as many threads."""
    out = []
    chosen = [tuple(int(v) for v in t.split("x")) for t in tiles.split(",")] if tiles else (
        (64, 2), (64, 4), (128, 4), (128, 8), (256, 8), (256, 16), (512, 16))
    preloads = ((True, True), (True, False), (False, False))
    for (bn, w), pps, (pre, second) in itertools.product(chosen, (1, 2, 4, 8) if tiles else (1, 2, 4), preloads):
        out.append(dict(zip(KNOBS, (bn, w, pps, 2, pre, second))))
    if full:
        for stages, pps in itertools.product((1, 3), (1, 2, 4)):
            out.append(dict(zip(KNOBS, (64, 2, pps, stages, True, True))))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--ctx", type=int, default=560, help="cached tokens + the new one (gpu_speed: 512-612)")
    ap.add_argument("--max-len", type=int, default=688, help="the block table's width in tokens (gpu_speed: 688)")
    ap.add_argument("--quick", action="store_true", help="skip the pipeline-stage settings")
    ap.add_argument("--tiles", default="", help="TOKENSxWARPS,...: sweep these tiles (with 1, 2, 4 and 8 programs per "
                                                  "SM) instead of the built-in list")
    ap.add_argument("--inputs", action="store_true",
                    help="instead of the sweep, time the default kernel alone with and without rotary and with q/k/v "
                         "as merged bf16 tensors instead of the matmul's partials (what its prologue costs)")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--rows-out", type=Path, help="also append each setting's row here as it is timed (JSON lines)")
    args = ap.parse_args()
    hidden, width = lb.SHAPES["qkv"]
    d = lb.decode_attention_inputs(args.batch, args.ctx, args.max_len)
    x = torch.randn(args.batch, hidden, device="cuda", dtype=torch.bfloat16)
    ws = [torch.randn(width, hidden, device="cuda", dtype=torch.bfloat16) * hidden**-0.5
          for _ in range(lb.copies_for(width * hidden * 2))]
    scale = lb.HEAD_DIM**-0.5
    qs, ks = lb.HEADS * lb.HEAD_DIM, lb.KV_HEADS * lb.HEAD_DIM

    def attend(parts, kv) -> None:
        src = parts.parts[0]
        q = src[:, :qs].view(args.batch, lb.HEADS, lb.HEAD_DIM)
        k = src[:, qs:qs + ks].view(args.batch, lb.KV_HEADS, lb.HEAD_DIM)
        v = src[:, qs + ks:].view(args.batch, lb.KV_HEADS, lb.HEAD_DIM)
        ops.paged_decode_attention_rope(q, k, v, d.cos, d.sin, d.pos, kv, d.slots, d.table, d.seq_lens, scale,
                                        d.o, qkv_parts=parts)

    def qkv(w):
        return skinny_linear(x, w, weights_ahead=True, defer_merge="attention", hold_last=False)

    fixed = qkv(ws[0])
    if not hasattr(fixed, "parts"):
        raise SystemExit(f"qkv at {args.batch} rows is not split: nothing to merge in the attention")
    if args.inputs:
        lb.write_result(prologue_costs(args, d, fixed, attend, scale), args.out)
        return
    defaults = {name: getattr(ops, name) for name in KNOBS}
    attend(fixed, d.kvs[0])
    reference = d.o.clone()
    pairs = [(ws[i % len(ws)], d.kvs[i % len(d.kvs)]) for i in range(max(len(ws), len(d.kvs)))]
    rows = []
    for setting in [defaults] + settings(not args.quick, args.tiles):
        for name, value in setting.items():
            setattr(ops, name, value)
        row = dict(setting)
        row["splits"] = ops.num_decode_splits(args.batch, lb.KV_HEADS, d.table.shape[1] * 16, x.device)
        try:
            attend(fixed, d.kvs[0])
            row["max_diff"] = (d.o.float() - reference.float()).abs().max().item()
            row["alone_us"] = round(lb.time_us([lambda kv=kv: attend(fixed, kv) for kv in d.kvs]), 2)
            row["pair_us"] = round(lb.time_us([lambda w=w, kv=kv: attend(qkv(w), kv) for w, kv in pairs]), 2)
        except Exception as e:  # a setting the compiler rejects (out of registers or shared memory)
            row["error"] = repr(e)[:200]
        rows.append(row)
        print(row, flush=True)
        if args.rows_out:
            with args.rows_out.open("a") as f:
                f.write(json.dumps(row) + "\n")
    for name, value in defaults.items():
        setattr(ops, name, value)
    qkv_us = lb.time_us([lambda w=w: qkv(w) for w in ws])
    rows.sort(key=lambda r: r.get("pair_us", float("inf")))
    lb.write_result({"device": torch.cuda.get_device_name(), "batch": args.batch, "ctx": args.ctx,
                     "max_len": args.max_len, "kv_bytes": d.kv_bytes, "qkv_alone_us": round(qkv_us, 2),
                     "default": {k: v for k, v in defaults.items()}, "rows": rows}, args.out)


def prologue_costs(args, d, parts, attend, scale) -> dict:
    """The default kernel alone, four ways: with the matmul's partials or merged bf16 q/k/v, with
    rotary or without."""
    merged = parts.merge()
    qs, ks = lb.HEADS * lb.HEAD_DIM, lb.KV_HEADS * lb.HEAD_DIM

    def call(kv, rope: bool, split: bool) -> None:
        cos, sin = (d.cos, d.sin) if rope else (None, None)
        src = parts.parts[0] if split else merged
        extra = {"qkv_parts": parts} if split else {}
        ops.paged_decode_attention_rope(src[:, :qs].view(args.batch, lb.HEADS, lb.HEAD_DIM),
                                        src[:, qs:qs + ks].view(args.batch, lb.KV_HEADS, lb.HEAD_DIM),
                                        src[:, qs + ks:].view(args.batch, lb.KV_HEADS, lb.HEAD_DIM),
                                        cos, sin, d.pos, kv, d.slots, d.table, d.seq_lens, scale, d.o, **extra)

    out = {}
    for again, split, rope in itertools.product(("", "_again"), (True, False), (True, False)):
        name = f"{'parts' if split else 'bf16'}_{'rope' if rope else 'norope'}{again}_us"
        out[name] = lb.time_us([lambda kv=kv, r=rope, s=split: call(kv, r, s) for kv in d.kvs])
    out["parts_rope_script_us"] = lb.time_us([lambda kv=kv: attend(parts, kv) for kv in d.kvs])
    return {k: round(v, 2) if isinstance(v, float) else v for k, v in out.items()}


if __name__ == "__main__":
    main()
