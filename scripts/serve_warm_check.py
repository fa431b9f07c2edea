"""Ready means warm, checked through a server: start ``pprun serve`` on a model, wait until it
answers, send a mixed workload over the OpenAI HTTP API, and print one JSON object: the first uses
the server logged after ready (``first use after ready: ...``, ``pprun.utils.first_use``), and
the time to first token of the first requests against the later ones.

    python scripts/serve_warm_check.py --model /path/to/model [--rounds 3] [-- extra pprun serve overrides]

The workload, in ``--rounds`` rounds of the same mix (seeded): prompts of 1 to 2,000 token ids,
batches of 1 to 64 concurrent requests, greedy, temperature, top-k, top-p, min-p, seeds and
logprobs.  ``first_round_ttft_ms`` and ``later_rounds_ttft_ms`` are medians and maxima; warm
means ``first_uses_after_ready`` is empty and the first round's tail is no worse than the later
ones'.  The exit status is 1 when the server logged any first use after ready (a pass/fail check;
the tail is for reading).  The server's log is kept in ``--log``.
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import re
import socket
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

FIRST_USE = re.compile(r"first use after ready: (.*)$")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(port: int, proc: subprocess.Popen, timeout_s: float) -> float:
    """Seconds until ``/v1/models`` answers 200 (the server's ready)."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout_s:
        if proc.poll() is not None:
            raise SystemExit(f"pprun serve exited with {proc.returncode} before it was ready")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conn.request("GET", "/v1/models")
            if conn.getresponse().status == 200:
                return time.perf_counter() - t0
        except OSError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"pprun serve was not ready after {timeout_s} s")


def ttft_ms(port: int, model: str, body: dict) -> float:
    """One streamed completion; milliseconds to its first chunk (read to the end)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", json.dumps({"stream": True, **body}),
                 {"Content-Type": "application/json"})  # fmt: skip
    resp = conn.getresponse()
    if resp.status != 200:
        raise SystemExit(f"/v1/completions answered {resp.status}: {resp.read()[:500]!r}")
    first = None
    for line in resp:
        if first is None and line.startswith(b"data:") and b"[DONE]" not in line:
            first = (time.perf_counter() - t0) * 1e3
    return first if first is not None else float("nan")


def workload(rng: random.Random, vocab: int) -> list[list[dict]]:
    """Batches of request bodies: every sampling mix at several prompt lengths and batch sizes."""
    samplings = [
        {"temperature": 0.0}, {"temperature": 0.8}, {"temperature": 0.8, "top_k": 20},
        {"temperature": 0.8, "top_p": 0.9}, {"temperature": 0.8, "top_k": 40, "top_p": 0.8},
        {"temperature": 0.8, "min_p": 0.05}, {"temperature": 0.8, "seed": 7}, {"temperature": 0.0, "logprobs": 3},
    ]  # fmt: skip
    batches = []
    for size in (1, 3, 8, 17, 64):
        batch = []
        for i in range(size):
            n = rng.choice([1, 7, 33, 100, 257, 600, 2000])
            ids = [rng.randrange(100, vocab) for _ in range(n)]
            batch.append({"prompt": ids, "max_tokens": rng.choice([4, 16, 64]), "ignore_eos": True,
                          **samplings[(i + size) % len(samplings)]})  # fmt: skip
        batches.append(batch)
    return batches


def summary(values: list[float]) -> dict:
    return {"median": round(statistics.median(values), 2), "max": round(max(values), 2), "n": len(values)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a model directory (or alias) pprun serves")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--vocab", type=int, default=32000, help="token ids are drawn below this")
    ap.add_argument("--log", default="serve_warm_check.log")
    ap.add_argument("--ready-timeout-s", type=float, default=1800)
    ap.add_argument("overrides", nargs="*", help="more pprun serve overrides (after --)")
    args = ap.parse_args()
    port = free_port()
    cmd = ["pprun", "serve", "parallel=single", "model=local", f"model.model={args.model}",
           f"serve.http_port={port}", f"serve.port={free_port()}", *args.overrides]  # fmt: skip
    with open(args.log, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        try:
            ready_s = wait_ready(port, proc, args.ready_timeout_s)
            rounds: list[list[float]] = []
            for r in range(args.rounds):
                rng = random.Random(r)
                times = []
                for batch in workload(rng, args.vocab):
                    with ThreadPoolExecutor(len(batch)) as pool:
                        times += list(pool.map(lambda body: ttft_ms(port, args.model, body), batch))
                rounds.append(times)
        finally:
            proc.terminate()
            proc.wait(timeout=120)
    with open(args.log) as f:
        text = f.read()
    firsts = [m.group(1) for line in text.splitlines() if (m := FIRST_USE.search(line))]
    startup = [line.split("start-up: ", 1)[1] for line in text.splitlines() if "start-up: " in line]
    later = [t for times in rounds[1:] for t in times]
    print(json.dumps({
        "model": args.model,
        "ready_s": round(ready_s, 1),
        "startup": startup,
        "first_uses_after_ready": firsts,
        "first_round_ttft_ms": summary(rounds[0]),
        "later_rounds_ttft_ms": summary(later) if later else None,
    }, indent=2))  # fmt: skip
    if firsts:
        print(f"FAIL: {len(firsts)} first uses after ready (see {args.log})", file=sys.stderr)
    sys.exit(1 if firsts else 0)


if __name__ == "__main__":
    main()
