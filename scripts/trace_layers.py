"""Per-layer kernel times of the decode graphs that ``gpu_speed.py --graph-trace`` traced.

    python scripts/trace_layers.py result.json [more.json ...]   # or docs/gpu_session10.json

For every ``decode_*`` run of each file: engine step and graph replay in ms, and, for a graph
of more than one row (norm, qkv, attention, o_proj, norm, gate_up, down per layer), each
kernel's mean end-to-end time over the layers in us (from the end of the kernel before to its
own end, so what it adds to the replay, overlap included), their sum per layer, and the kernels
after the last layer (final norm, LM head, argmax).
"""

from __future__ import annotations

import json
import sys

LAYER = ("norm", "qkv", "attention", "o_proj", "norm2", "gate_up", "down")
NORM, ATTENTION = "_add_rms_norm_kernel", "_decode_kernel"


def per_layer(events: list[dict]) -> dict | None:
    """Mean end-to-end us of each kernel of a layer, or None for a graph without that layout."""
    ends = [e["start_us"] + e["dur_us"] for e in events]
    deltas = [0.0] + [b - a for a, b in zip(ends, ends[1:])]
    names = [e["kernel"] for e in events]
    if NORM not in names:
        return None
    i = names.index(NORM)
    layers = []
    while (i + len(LAYER) <= len(names) and names[i] == NORM and names[i + 2] == ATTENTION
           and names[i + 4] == NORM):
        layers.append(deltas[i:i + len(LAYER)])
        i += len(LAYER)
    if not layers:
        return None
    out = {name: round(sum(row[j] for row in layers) / len(layers), 2) for j, name in enumerate(LAYER)}
    out["per_layer"] = round(sum(out[name] for name in LAYER), 2)
    out["layers"] = len(layers)
    out["after_layers"] = [(names[j][:24], round(deltas[j], 2)) for j in range(i, len(names))]
    return out


def _is_run(key: str, value) -> bool:
    """A decode run of a ``gpu_speed.py`` result."""
    return key.startswith("decode_") and isinstance(value, dict) and "engine_step_ms" in value


def results(node: dict, name: str):
    """Every ``gpu_speed.py`` result in ``node``: the file itself, or (a ``docs/gpu_session*.json``
    collection) those nested under loans and commands, with the path of keys to each."""
    if any(_is_run(key, value) for key, value in node.items()):
        yield name, node
        return
    for key, value in node.items():
        if isinstance(value, dict):
            yield from results(value, f"{name} / {key}" if name else key)


def main() -> None:
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    for path in sys.argv[1:]:
        with open(path) as f:
            doc = json.load(f)
        for name, result in results(doc, ""):
            print("==", path, name, "set", result.get("set"))
            for key, run in result.items():
                if not _is_run(key, run):
                    continue
                print(f"{key:60s} step {run['engine_step_ms']:.4f} graph {run.get('graph_replay_ms')}")
                trace = run.get("graph_trace")
                layer = per_layer(trace["last_replay"]) if trace and "last_replay" in trace else None
                if layer:
                    print("   ", layer)


if __name__ == "__main__":
    main()
