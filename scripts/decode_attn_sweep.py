"""Sweep the decode attention's launch settings at one batch size, alone and behind the qkv matmul.

    python scripts/decode_attn_sweep.py [--batch 32] [--ctx 560] [--out result.json]
    python scripts/decode_attn_sweep.py --batch 1 --tiles 32x2,64x2 --min-tokens 64,128,256

For every setting (K/V tile length ``_DECODE_BLOCK_N``, warps per program, context splits via
``DECODE_PROGRAMS_PER_SM`` and ``DECODE_MIN_TOKENS_PER_SPLIT``, pipeline stages, which K/V tiles
load before the PDL wait) it times, graph-replayed with each call reading its own copy of the
weights and KV cache:

- ``alone``: the fused decode attention (rotary, cache write, attention, split merge) reading
  the qkv matmul's output (its split-K partials above one row, as the model runs it), launched
  back to back;
- ``pair``: the qkv matmul then the attention, as a decode layer of the 1.1B model runs them:
  what a setting is worth in the model.

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
from pprun.layers import SplitPartials  # noqa: E402

KNOBS = ("_DECODE_BLOCK_N", "_DECODE_NUM_WARPS", "DECODE_PROGRAMS_PER_SM", "DECODE_MIN_TOKENS_PER_SPLIT",
         "_DECODE_NUM_STAGES", "DECODE_PRELOAD_KV", "DECODE_PRELOAD_SECOND")
TILES = "64x2,64x4,128x4,128x8,256x8,256x16,512x16"
"""The default tiles (TOKENSxWARPS): at most 128 K/V values per thread (2 warps per 64 tokens),
and twice as many threads."""


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",")]


def settings(defaults: dict, tiles: str, programs_per_sm: list[int], min_tokens: list[int], stages: bool) -> list[dict]:
    """Each tile with each programs-per-SM and min-tokens value and three preload forms (two tiles
    ahead, one, none); with ``stages``, also the default setting at 1 and 3 pipeline stages for
    each programs-per-SM value.  ``defaults`` itself (timed first) is left out."""
    chosen = [tuple(int(v) for v in t.split("x")) for t in tiles.split(",")]
    preloads = ((True, True), (True, False), (False, False))
    out = [dict(zip(KNOBS, (bn, w, pps, mt, 2, pre, second)))
           for (bn, w), pps, mt, (pre, second) in itertools.product(chosen, programs_per_sm, min_tokens, preloads)]
    if stages:
        out += [{**defaults, "_DECODE_NUM_STAGES": st, "DECODE_PROGRAMS_PER_SM": pps}
                for st, pps in itertools.product((1, 3), programs_per_sm)]
    return [s for s in out if s != defaults]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--ctx", type=int, default=560, help="cached tokens + the new one (gpu_speed: 512-612)")
    ap.add_argument("--max-len", type=int, default=688, help="the block table's width in tokens (gpu_speed: 688)")
    ap.add_argument("--quick", action="store_true", help="skip the pipeline-stage settings")
    ap.add_argument("--tiles", default=TILES, help="TOKENSxWARPS,...: the K/V tiles swept")
    ap.add_argument("--programs-per-sm", type=_ints, default=[1, 2, 4], help="DECODE_PROGRAMS_PER_SM values swept")
    ap.add_argument("--min-tokens", type=_ints, default=[64], help="DECODE_MIN_TOKENS_PER_SPLIT values swept")
    ap.add_argument("--inputs", action="store_true",
                    help="instead of the sweep, time the default kernel alone with and without rotary and with q/k/v "
                         "as merged bf16 tensors instead of the matmul's partials (what its prologue costs)")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--rows-out", type=Path, help="also append each setting's row here as it is timed (JSON lines)")
    args = ap.parse_args()
    d = lb.decode_attention_inputs(args.batch, args.ctx, args.max_len)
    ws, qkv, pairs = lb.qkv_before_attention(args.batch, d.kvs)
    scale = lb.HEAD_DIM**-0.5

    def attend(qkv_out: torch.Tensor | SplitPartials, kv, rope: bool = True) -> None:
        """The decode attention on the qkv matmul's output: its partials merged as they are read
        where K was split (above one row), else the merged tensor."""
        split = isinstance(qkv_out, SplitPartials)
        cos, sin = (d.cos, d.sin) if rope else (None, None)
        extra = {"qkv_parts": qkv_out} if split else {}
        q, k, v = lb.qkv_views(qkv_out.parts[0] if split else qkv_out, args.batch)
        ops.paged_decode_attention_rope(q, k, v, cos, sin, d.pos, kv, d.slots, d.table, d.seq_lens, scale, d.o,
                                        **extra)

    fixed = qkv(ws[0])
    if args.inputs:
        lb.write_result(prologue_costs(d, fixed, attend), args.out)
        return
    defaults = {name: getattr(ops, name) for name in KNOBS}
    attend(fixed, d.kvs[0])
    reference = d.o.clone()
    rows = []
    for setting in [defaults] + settings(defaults, args.tiles, args.programs_per_sm, args.min_tokens, not args.quick):
        for name, value in setting.items():
            setattr(ops, name, value)
        row = dict(setting)
        row["splits"] = ops.num_decode_splits(args.batch, lb.KV_HEADS, d.table.shape[1] * d.block_size, d.table.device)
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
                     "default": defaults, "rows": rows}, args.out)


def prologue_costs(d, qkv_out, attend) -> dict:
    """The default kernel alone, four ways: with the matmul's output as it comes (partials above
    one row) or merged, with rotary or without."""
    ways = {"parts": qkv_out, "bf16": qkv_out.merge() if isinstance(qkv_out, SplitPartials) else qkv_out}
    out = {}
    for again, (name, src), rope in itertools.product(("", "_again"), ways.items(), (True, False)):
        key = f"{name}_{'rope' if rope else 'norope'}{again}_us"
        out[key] = round(lb.time_us([lambda kv=kv, s=src, r=rope: attend(s, kv, r) for kv in d.kvs]), 2)
    return out


if __name__ == "__main__":
    main()
