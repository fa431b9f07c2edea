"""Time the expert kernels of a mixture-of-experts layer on one GPU, as one JSON object; tune them.

    python scripts/bench_moe_kernels.py [--hidden 2048] [--inter 768] [--experts 128] [--top-k 8]
        [--tokens 1,32,256,2048] [--tune [--write FILE] [--budget-s 420]] [--fp8 block|channel]
        [--fp8 block --w8a8 [--tune [--write FILE] [--budget-s 420]]]

For each token count: the fused path of one sparse layer (routing launch, sort, the two grouped
GEMMs, the top-k sum) replayed as a CUDA graph, in microseconds per layer, with the settings
pprun picks (``moe_triton.experts_config``: the tuned table for this GPU, else the heuristic)
and with the heuristic alone; the expert weight bytes it must read (each expert some token
chose, read once: ``E_used * 3 * hidden * inter * 2`` in bf16) and the bandwidth that implies;
and the reference loop over experts (eager) for comparison.  Random routing (softmax of N(0, 1)
logits), so the experts used follow the top-k of uniform routers.

``--tune`` searches each GEMM's settings separately (they share ``block_m``, one sort): for each
``block_m`` that suits the rows per expert, first the tile widths at 3 stages (4 warps, 8 for
tiles of 128 x 128 accumulators or more), then warps and stages around the two best widths;
each launch timed alone as a CUDA graph (down with its output in the activation dtype, as past
``PARTIALS_MAX_TOKENS``; fp32 partials write twice the bytes).  The token counts are tuned in
the order given until ``--budget-s`` seconds have gone (compiling each setting is most of the
time).  ``--write FILE`` merges the winners into a tuned-settings file
(``pprun/layers/moe_configs/<GPU>.json`` ships with pprun; ``PPRUN_MOE_CONFIGS=FILE`` puts
another one's entries over those).

``--fp8 block`` (``channel``) times float8 experts instead, the same random experts quantized per
128x128 block (per row) as an FP8 checkpoint stores them, W8A16 (block-scaled ones too, at
every token count, though a step of ``FP8_W8A8_MIN_TOKENS`` tokens or more runs them W8A8:
``--w8a8`` times that beside): the weight bytes are then one per weight, each row also has
``bf16_fused_us`` (the bf16 experts, same routing and settings' rule) and
``max_abs_diff_vs_bf16``; ``--tune`` does not take it alone (W8A16 runs the bf16 table's tiles,
``block_k`` capped at 128 for block scales).

``--fp8 block --w8a8`` also times the block-scaled float8 experts W8A8 (``moe_triton``'s
``FP8_W8A8_MIN_TOKENS`` mode, forced on for these rows): ``w8a8_us`` with the tiles pprun picks
(``moe_triton.w8a8_config``: this GPU's tuned W8A8 entries for the shape, else its rule; they are
the row's ``w8a8_config``), ``w8a8_rule_us`` with the rule's, each the whole layer as a step runs
it (the hidden states' quantization launch included) beside the W8A16 row's ``fused_us``, and
``max_abs_diff_w8a8_vs_w8a16``.  With ``--tune`` it searches the W8A8 tiles instead of the bf16
ones: ``block_m`` among 16/32/64/128 (those that suit the rows per expert, and the rule's),
``block_k`` the scale block (128), first ``block_n`` 64/128 by 4/8 warps at 3 stages, then 2-5
stages around the two best (at most 10 settings per GEMM and ``block_m``, 60 per token count);
gate_up timed on the quantized hidden states with what follows it (a ``block_n`` of 64 splits
the scale blocks, so its SwiGLU output takes a quantization launch: timed with it), down on
float8 activations.  ``--write`` merges the winners under the W8A8 key of the shape
(``moe_triton.w8a8_shape_key``: ``E=128,N=768,H=2048,K=8,float8_w8a8_block128``), which
``w8a8_config`` reads.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import itertools
import json
import os
import sys
import time as time_module
from pathlib import Path

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


def block_ms(rows_per_expert: float) -> tuple[int, ...]:
    """The ``block_m`` values worth timing for this many rows per expert."""
    if rows_per_expert <= 4:
        return (16,)
    if rows_per_expert <= 32:
        return (16, 32)
    return (32, 64) if rows_per_expert <= 128 else (64, 128)


def accumulators(kind: str) -> int:
    """The fp32 accumulator tiles a GEMM's program holds: gate and up for gate_up, one for down."""
    return 2 if kind == "gate_up" else 1


def fits(kind: str, bm: int, bn: int, bk: int, stages: int, itemsize: int = 2) -> bool:
    """Whether a tile fits the registers (the fp32 accumulators) and the shared memory of a
    Hopper SM (each pipeline stage holds an activation and a weight tile of ``itemsize``-byte
    values: 2 for bf16, 1 for W8A8's float8)."""
    acc = bm * bn * accumulators(kind)
    smem = stages * itemsize * (bm * bk + bk * bn * accumulators(kind))
    return acc <= 128 * 256 and smem <= 200 * 1024


def bf16_firsts(kind: str, bm: int) -> list[moe_triton.GemmConfig]:
    """The first pass of the bf16 search: every tile width at 3 stages."""
    firsts = []
    for bn, bk in itertools.product((32, 64, 128, 256), (64, 128, 256)):
        # A large tile on 4 warps spills its accumulators and would drop out here before the
        # second pass could give it 8.
        wide = bm * bn * accumulators(kind) >= 128 * 128
        firsts.append(moe_triton.GemmConfig(bm, bn, bk, 8 if wide else 4, 3))
    return firsts


def bf16_around(c: moe_triton.GemmConfig) -> list[moe_triton.GemmConfig]:
    """The second pass of the bf16 search around one of the best widths: warps and stages."""
    return [c._replace(num_warps=w, num_stages=s) for w, s in itertools.product((4, 8), (2, 3, 4, 5))]


W8A8_BLOCK_MS = (16, 32, 64, 128)
W8A8_BLOCK_NS = (64, 128)


def w8a8_block_ms(num_tokens: int, top_k: int, num_experts: int, scale_block: int) -> tuple[int, ...]:
    """The ``block_m`` values the W8A8 search times: those that suit the rows per expert
    (:func:`block_ms`) and the rule's (``moe_triton.w8a8_config``), so the search never loses
    the rule's tiles."""
    rule = moe_triton.w8a8_config(num_tokens, num_experts, top_k, scale_block).gate_up.block_m
    return tuple(sorted({*block_ms(num_tokens * top_k / num_experts), rule} & set(W8A8_BLOCK_MS)))


def w8a8_firsts(kind: str, bm: int, scale_block: int) -> list[moe_triton.GemmConfig]:
    """The first pass of the W8A8 search: ``block_n`` by warps at 3 stages, K tiles of one
    scale block (at most 128)."""
    bk = min(128, scale_block)
    return [moe_triton.GemmConfig(bm, bn, bk, w, 3) for bn, w in itertools.product(W8A8_BLOCK_NS, (4, 8))]


def w8a8_around(c: moe_triton.GemmConfig) -> list[moe_triton.GemmConfig]:
    """The second pass of the W8A8 search around one of the best: its stages."""
    return [c._replace(num_stages=s) for s in (2, 3, 4, 5)]


def search(kind: str, launch, bm: int, deadline: float, firsts=None, around=bf16_around,
           itemsize: int = 2) -> tuple[moe_triton.GemmConfig, float]:
    """The fastest setting of one GEMM at ``block_m=bm``: the ``firsts`` (default
    :func:`bf16_firsts`), then ``around(c)`` for the two best (module docstring;
    ``launch(config)`` runs it once; ``itemsize``: the operands' bytes, for :func:`fits`);
    raises TimeoutError past ``deadline``."""
    timed: dict[moe_triton.GemmConfig, float] = {}

    def time(c: moe_triton.GemmConfig) -> None:
        if c in timed or not fits(kind, c.block_m, c.block_n, c.block_k, c.num_stages, itemsize):
            return
        if time_module.monotonic() > deadline:
            raise TimeoutError
        try:
            timed[c] = graph_us(lambda: launch(c), replays=20)
        except Exception:  # noqa: BLE001 - a setting this GPU cannot compile or run: skipped
            timed[c] = float("inf")

    for c in bf16_firsts(kind, bm) if firsts is None else firsts:
        time(c)
    for best in sorted(timed, key=timed.get)[:2]:
        for c in around(best):
            time(c)
    best = min(timed, key=timed.get)
    if timed[best] == float("inf"):
        raise RuntimeError(f"no setting of {kind} at block_m={bm} compiled and ran on this GPU")
    return best, timed[best]


def tune_tokens(num_tokens: int, args: argparse.Namespace, w13: torch.Tensor, w2: torch.Tensor,
                gen: torch.Generator, deadline: float) -> dict | None:
    """The fastest settings of both GEMMs for ``num_tokens`` tokens (module docstring), or None
    when the budget ran out before one ``block_m`` was searched in full (or none ran)."""
    dtype = w13.dtype
    x = torch.randn(num_tokens, args.hidden, device=w13.device, generator=gen).to(dtype)
    logits = torch.randn(num_tokens, args.experts, device=w13.device, generator=gen)
    weights, ids = moe_triton.fused_route(logits, args.top_k, True)

    def search_both(bm: int):
        align = moe_triton.layout(ids, args.experts, bm)
        act = moe_triton.gate_up(x, w13, align, args.top_k, moe_triton.GemmConfig(bm, 64, 64, 4))
        up = search("gate_up", functools.partial(moe_triton.gate_up, x, w13, align, args.top_k), bm, deadline)
        return up, search("down", functools.partial(moe_triton.down, act, w2, weights, align, args.top_k), bm, deadline)

    return fastest_entry(num_tokens, block_ms(num_tokens * args.top_k / args.experts), search_both)


def fastest_entry(num_tokens: int, bms, search_both, **tag) -> dict | None:
    """The tuned entry of the fastest ``block_m`` of ``bms``, ``search_both(bm)`` giving each GEMM's
    best setting and time at it (:func:`search`); None when the budget ran out before one
    ``block_m`` was searched in full (or none ran).  A ``block_m`` no setting of which ran is
    skipped with a line on stderr (``tag``: more fields of that line)."""
    best = None
    for bm in bms:
        try:
            up, dn = search_both(bm)
        except TimeoutError:
            break  # the block_m values searched in full still count
        except RuntimeError as exc:
            print(json.dumps({"tokens": num_tokens, **tag, "skipped": str(exc)}), file=sys.stderr, flush=True)
            continue
        if best is None or up[1] + dn[1] < best[0][1] + best[1][1]:
            best = (up, dn)
    if best is None:
        return None
    (up, up_us), (dn, dn_us) = best
    return {"block_m": up.block_m, "gate_up": list(up[1:]), "down": list(dn[1:]),
            "gate_up_us": round(up_us, 2), "down_us": round(dn_us, 2)}


def tune_w8a8_tokens(num_tokens: int, args: argparse.Namespace, fp8: dict, gen: torch.Generator,
                     deadline: float) -> dict | None:
    """The fastest W8A8 settings of both GEMMs for ``num_tokens`` tokens (module docstring), or
    None as :func:`tune_tokens`.  ``fp8``: the block-scaled float8 experts."""
    w13, w2, s13, s2, block = fp8["w13"], fp8["w2"], fp8["w13_scale"], fp8["w2_scale"], fp8["scale_block"]
    x = torch.randn(num_tokens, args.hidden, device=w13.device, generator=gen).to(torch.bfloat16)
    logits = torch.randn(num_tokens, args.experts, device=w13.device, generator=gen)
    weights, ids = moe_triton.fused_route(logits, args.top_k, True)
    xq = moe_triton.quantize_fp8_rows(x, block)
    rule = moe_triton.w8a8_config(num_tokens, args.experts, args.top_k, block).gate_up

    def up_launch(align, c):
        act = moe_triton.gate_up(xq, w13, align, args.top_k, c, s13, block)
        if not isinstance(act, moe_triton.Fp8Rows):  # column tiles split the scale blocks
            moe_triton.quantize_fp8_rows(act, block)

    def search_both(bm: int):
        align = moe_triton.layout(ids, args.experts, bm)
        act = moe_triton.gate_up(xq, w13, align, args.top_k, rule._replace(block_m=bm), s13, block)
        down = functools.partial(moe_triton.down, act, w2, weights, align, args.top_k, partials=False, w2_scale=s2,
                                 scale_block=block)
        up = search("gate_up", functools.partial(up_launch, align), bm, deadline,
                    w8a8_firsts("gate_up", bm, block), w8a8_around, itemsize=1)
        return up, search("down", down, bm, deadline, w8a8_firsts("down", bm, block), w8a8_around, itemsize=1)

    return fastest_entry(num_tokens, w8a8_block_ms(num_tokens, args.top_k, args.experts, block), search_both,
                         w8a8=True)


def write_tuned(path: Path, device_name: str, key: str, tuned: dict[int, dict]) -> None:
    """Merge one shape's tuned entries into a tuned-settings file."""
    data = json.loads(path.read_text()) if path.is_file() else {}
    data["device"] = device_name
    shape = data.setdefault("shapes", {}).setdefault(key, {})
    shape.update({str(t): entry for t, entry in tuned.items()})
    data["shapes"][key] = dict(sorted(shape.items(), key=lambda kv: int(kv[0])))
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [f'{{"device": {json.dumps(device_name)}, "shapes": {{']
    for i, (name, entries) in enumerate(data["shapes"].items()):
        rows = ",\n".join(f"  {json.dumps(t)}: {json.dumps(e)}" for t, e in entries.items())
        lines.append(f" {json.dumps(name)}: {{\n{rows}\n }}" + ("," if i < len(data["shapes"]) - 1 else ""))
    path.write_text("\n".join(lines) + "\n}}\n")


def quantize_experts(w: torch.Tensor, layout: str, parts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Experts ``w [E, rows, cols]`` as float8 e4m3 and float32 scales in the layout the grouped
    kernels read (``pprun.layers.moe.expert_scale_shapes``): per ``channel`` (row) or 128x128
    ``block`` of each of the ``parts`` stacked tensors (w13: gate, up), as a checkpoint's."""
    from pprun.models.quantization import quantize
    from pprun.models.quantization_config import WeightScheme

    scheme = WeightScheme(layout, (128, 128) if layout == "block" else None, "weight_scale", False)
    qs, ss = [], []
    for expert in w:
        pieces = [quantize(part, scheme) for part in expert.chunk(parts)]
        qs.append(torch.cat([q for q, _ in pieces]))
        ss.append(torch.cat([s.reshape(s.shape[0], -1) for _, s in pieces]))
    return torch.stack(qs), torch.stack(ss)


@contextlib.contextmanager
def w8a8_mode(on: bool):
    """Block-scaled float8 experts run W8A8 at every token count inside (``on``), W8A16 else."""
    saved = moe_triton.FP8_W8A8_MIN_TOKENS
    moe_triton.FP8_W8A8_MIN_TOKENS = 1 if on else None
    try:
        yield
    finally:
        moe_triton.FP8_W8A8_MIN_TOKENS = saved


def time_tokens(num_tokens: int, args: argparse.Namespace, w13: torch.Tensor, w2: torch.Tensor,
                gen: torch.Generator, fp8: dict | None = None, w8a8: bool = False) -> dict:
    """One token count's row of the report (module docstring); ``fp8``: the float8 experts
    (``w13``, ``w2`` and their scales) timed instead of ``w13`` / ``w2``, which are then the bf16
    comparison; ``w8a8`` (block-scaled ``fp8``): also W8A8."""
    device, dtype = w13.device, w13.dtype
    x = torch.randn(num_tokens, args.hidden, device=device, generator=gen).to(dtype)
    logits = torch.randn(num_tokens, args.experts, device=device, generator=gen).to(dtype)
    weights, ids = route(logits.float(), args.top_k, True)
    used = int(ids.unique().numel())
    weight_bytes = used * 3 * args.hidden * args.inter * (1 if fp8 else dtype.itemsize)
    experts = fp8 or {"w13": w13, "w2": w2}
    scale_block = experts.get("scale_block")

    def layer(config: moe_triton.GemmConfig | moe_triton.ExpertsConfig | None = None, on=experts) -> torch.Tensor:
        w, i = moe_triton.fused_route(logits, args.top_k, True)
        return moe_triton.fused_experts(x, on["w13"], on["w2"], w, i, config,
                                        **{k: v for k, v in on.items() if k not in ("w13", "w2")})

    us = graph_us(layer)
    heuristic = moe_triton.default_config(num_tokens * args.top_k, args.experts, dtype)
    picked = moe_triton.experts_config(num_tokens, w13, args.top_k, dtype, scale_block)
    # The picked settings compute what the heuristic's do (fp32 accumulation either way; the
    # K loop's order may differ, so a bf16 ulp or so).
    diff = (layer(picked).float() - layer(heuristic).float()).abs().max().item()
    scales = {k: v for k, v in experts.items() if k not in ("w13", "w2")}
    row = {
        "tokens": num_tokens, "experts_used": used, "expert_weight_mb": round(weight_bytes / 1e6, 2),
        "fused_us": round(us, 2), "fused_gbps": round(weight_bytes / us / 1e3, 1),
        "config": {"gate_up": picked.gate_up._asdict(), "down": picked.down._asdict()},
        "heuristic_us": round(graph_us(lambda: layer(heuristic)), 2),
        "max_abs_diff_vs_heuristic": diff,
        "reference_loop_us": round(eager_us(lambda: experts_reference(x, experts["w13"], experts["w2"], weights, ids,
                                                                      **scales)), 1),
    }
    if fp8:
        bf16 = {"w13": w13, "w2": w2}
        row["bf16_fused_us"] = round(graph_us(lambda: layer(on=bf16)), 2)
        row["max_abs_diff_vs_bf16"] = (layer().float() - layer(on=bf16).float()).abs().max().item()
    if w8a8:
        w8a8_picked = moe_triton.experts_config(num_tokens, fp8["w13"], args.top_k, dtype, scale_block, w8a8=True)
        rule = moe_triton.w8a8_config(num_tokens, args.experts, args.top_k, scale_block)
        with w8a8_mode(True):
            row["w8a8_us"] = round(graph_us(layer), 2)
            row["w8a8_config"] = {"gate_up": w8a8_picked.gate_up._asdict(), "down": w8a8_picked.down._asdict()}
            row["w8a8_rule_us"] = round(graph_us(lambda: layer(rule)), 2)
            got = layer().float()
        row["max_abs_diff_w8a8_vs_w8a16"] = (got - layer().float()).abs().max().item()
    return row


def main() -> None:
    """Parse the command line, time each token count, print the JSON."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=768)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--tokens", default="1,32,256,2048")
    ap.add_argument("--tune", action="store_true", help="search each GEMM's settings (module docstring)")
    ap.add_argument("--write", type=Path, help="with --tune: merge the winners into this tuned-settings file")
    ap.add_argument("--budget-s", type=float, default=420.0, help="with --tune: stop tuning after this long")
    ap.add_argument("--fp8", choices=("block", "channel"),
                    help="time float8 experts with 128x128 block or per-row scales (module docstring)")
    ap.add_argument("--w8a8", action="store_true",
                    help="with --fp8 block: also time the experts W8A8 (float8 activations) beside W8A16; "
                         "with --tune, tune the W8A8 tiles (module docstring)")
    args = ap.parse_args()
    if args.w8a8 and args.fp8 != "block":
        raise SystemExit(f"--w8a8 runs block-scaled float8 experts W8A8: it takes --fp8 block "
                         f"(got {'--fp8 ' + args.fp8 if args.fp8 else 'no --fp8'})")
    if args.fp8 and args.tune and not args.w8a8:
        raise SystemExit("--fp8 times float8 experts; --tune tunes bf16 ones: run them apart "
                         "(--fp8 block --w8a8 --tune tunes the W8A8 tiles)")
    if args.write and not args.tune:
        raise SystemExit("--write writes what --tune found: it takes --tune")
    device, dtype = torch.device("cuda"), torch.bfloat16
    gen = torch.Generator(device=device).manual_seed(0)
    w13 = (torch.randn(args.experts, 2 * args.inter, args.hidden, device=device, generator=gen) * 0.02).to(dtype)
    w2 = (torch.randn(args.experts, args.hidden, args.inter, device=device, generator=gen) * 0.02).to(dtype)
    tokens = [int(t) for t in args.tokens.split(",")]
    report = {"device": torch.cuda.get_device_name(), "hidden": args.hidden, "inter": args.inter,
              "experts": args.experts, "top_k": args.top_k}
    fp8 = None
    if args.fp8:
        (q13, s13), (q2, s2) = quantize_experts(w13, args.fp8, 2), quantize_experts(w2, args.fp8, 1)
        fp8 = {"w13": q13, "w2": q2, "w13_scale": s13, "w2_scale": s2,
               "scale_block": 128 if args.fp8 == "block" else None}
        report["fp8"] = args.fp8
        report["w8a8"] = args.w8a8
    if args.tune:
        deadline, tuned = time_module.monotonic() + args.budget_s, {}
        for t in tokens:
            if args.w8a8:
                entry = tune_w8a8_tokens(t, args, fp8, gen, deadline)
            else:
                entry = tune_tokens(t, args, w13, w2, gen, deadline)
            if entry is None:
                break
            tuned[t] = entry
            print(json.dumps({"tuned": t, "w8a8": args.w8a8, **entry}), file=sys.stderr, flush=True)
        report["tuned"] = tuned
        report["untuned_for_lack_of_time"] = tokens[len(tuned):]
        if args.w8a8:
            key = moe_triton.w8a8_shape_key(args.experts, args.inter, args.hidden, args.top_k, fp8["scale_block"])
        else:
            key = moe_triton.shape_key(args.experts, args.inter, args.hidden, args.top_k, dtype)
        report["tuned_key"] = key
        if args.write and tuned:
            write_tuned(args.write, report["device"], key, tuned)
            moe_triton.tuned_table.cache_clear()
            os.environ[moe_triton.TUNED_ENV] = str(args.write)
    with w8a8_mode(False):  # W8A16 but where a row says W8A8
        report["layers"] = [time_tokens(t, args, w13, w2, gen, fp8, args.w8a8) for t in tokens]
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
