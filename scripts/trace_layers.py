"""Per-layer mean end-to-end time of each kernel position in the traced decode graphs."""
import json, sys
NAMES = ["norm", "qkv", "attn", "o_proj", "norm2", "gate_up", "down"]
for path in sys.argv[1:]:
    r = json.load(open(path))
    print("==", path, "set", r.get("set"))
    for k, d in r.items():
        if not k.startswith("decode_"):
            continue
        t = d.get("graph_trace")
        line = f"{k:60s} step {d['engine_step_ms']:.4f} graph {d.get('graph_replay_ms')}"
        if not t:
            print(line); continue
        ev = t["last_replay"]
        ends = [e["start_us"] + e["dur_us"] for e in ev]
        deltas = [None] + [b - a for a, b in zip(ends, ends[1:])]
        names = [e["kernel"] for e in ev]
        first = names.index("_add_rms_norm_kernel")
        if "b1" in k or names[first + 1] != "_skinny_kernel" or names[first + 2] != "_skinny_kernel":
            pass
        # batch > 1: norm, qkv, decode, o_proj, norm, gate_up, down per layer
        per = len(NAMES) if names[first + 2] == "_decode_kernel" else None
        out = {}
        if per:
            i = first
            rows = []
            while i + per <= len(names) and names[i] == "_add_rms_norm_kernel" and names[i + 2] == "_decode_kernel":
                rows.append(deltas[i:i + per]); i += per
            out = {n: round(sum(r[j] for r in rows) / len(rows), 2) for j, n in enumerate(NAMES)}
            out["layers"] = len(rows)
            out["per_layer"] = round(sum(v for kk, v in out.items() if kk != "layers"), 2)
            out["tail"] = [(names[j][:20], round(deltas[j], 2)) for j in range(i, len(names))]
        print(line, "span", t.get("span_us"), "kernels", t.get("kernels_per_replay"))
        if out:
            print("   ", out)
