"""Pipeline benchmark on this machine: throughput, memory per stage, hop cost, control-path cost.

Prints one JSON object (and writes it to ``--out``).  Four parts, each selectable with
``--parts``:

``throughput``  ``python -m pprun bench`` (peer=none) for the demo model at pp=1 (uni) and
                pp=2 (mp, ray); the exact commands are in the output.
``memory``      resident memory of every stage process (``Worker.memory_stats`` through
                ``executor.call_all``) with the mp executor at pp=1, 2, 4 and a small KV cache,
                and a least-squares fit ``rss = fixed + slope * param_bytes`` over all stages.
``hop``         two gloo processes ping-pong decode-sized IntermediateTensors through
                ``PipelineTransport.send``/``recv``; one hop = round trip / 2.  The same tensors
                through bare ``dist.send``/``recv`` (one message each) show what the transport adds.
                What a Llama stage sends: one [tokens, hidden] tensor, the residual stream
                (``--hop-tensors 2``: the (hidden_states, residual) pair, twice the bytes).
``control``     a 2-layer, hidden-64 random model; SchedulerOutputs are fed to the executor
                directly (``submit`` + ``get_output``, one step in flight): an *empty* step
                (nothing to compute: the control path alone) and a 1-request decode step, for
                uni, mp pp=2 and ray pp=2.

    python scripts/bench_pipeline.py --out bench_pipeline_cpu.json
    python scripts/bench_pipeline.py --parts hop,control

On a machine with two GPUs (docs/performance.md's pipeline figures)::

    python scripts/make_random_model.py /tmp/llama1b --device cuda
    python scripts/bench_pipeline.py --device cuda --model /tmp/llama1b --parts throughput,hop,control \
        --num-prompts 64 --input-len 512 --output-len 512
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # run as a file from anywhere, like the other scripts
DEMO_MODEL = "smollm2-135m-instruct"
HIDDEN_SIZE = 576
"""Hidden size of the demo model: the hop benchmark's row width."""
HOP_NUM_TOKENS = (1, 32, 256)
HOP_LARGE_BYTES = 64 * 2**20
HOP_KEYS = ("hidden_states", "residual")
"""Keys of the hop's tensors, the first ``--hop-tensors`` of them (a Llama stage sends the first)."""
MEMORY_KV_BYTES = 64 * 2**20
"""KV-cache bytes per stage in the memory part: small, so the weights dominate RSS."""
PARTS = ("throughput", "memory", "hop", "control")


def load_info() -> dict[str, Any]:
    """Machine load when a part starts (other jobs on a 2-core box skew every number)."""
    one, five, fifteen = os.getloadavg()
    return {"loadavg_1m": round(one, 2), "loadavg_5m": round(five, 2), "cpus": os.cpu_count()}


def _stats_us(samples_s: list[float]) -> dict[str, float]:
    us = sorted(s * 1e6 for s in samples_s)
    return {
        "median_us": round(statistics.median(us), 1),
        "p10_us": round(us[len(us) // 10], 1),
        "p90_us": round(us[(len(us) * 9) // 10], 1),
        "n": len(us),
    }


# --- 1. throughput ------------------------------------------------------------------------------


def bench_throughput(
    num_prompts: int,
    input_len: int,
    output_len: int,
    device: str = "cpu",
    model: str = DEMO_MODEL,
    microbatches: tuple[int, ...] = (3,),
    pp2_executors: tuple[str, ...] = ("mp", "ray"),
    ab_env: tuple[tuple[str, str], ...] = (),
) -> list[dict[str, Any]]:
    """``pprun bench`` at pp=1 (uni) and pp=2 (mp, ray), one subprocess each.

    On ``cuda`` the model runs in bf16.  ``num_prompts`` is the batch of one step: pp=1 runs it
    as one batch; pp=2 keeps ``m`` batches of that size in flight (one GPU per stage) for each
    ``m`` in ``microbatches`` (the first with every executor of ``pp2_executors``, the others
    with the first executor), so it holds ``m`` times as many requests — pp=1 at the largest
    number of requests runs too (equal concurrency).  Each run reports ``pprun bench``'s steady
    decode rate (``decode_tokens_per_s``: the steps after the last prefill while the batch is
    full) beside its whole-run rate.  Each ``(name, value)`` of ``ab_env`` adds the first pp=2 run
    again with that environment variable set (an A/B switch such as ``PPRUN_DISABLE_GRAPH_HOP=1``).
    The last entry has the ratios.
    """
    results = []
    if device == "cpu":
        # Ray gives each actor OMP_NUM_THREADS=1 (its CPU share); mp stages inherit the default
        # (every core), so two mp stages on two cores run four spinning OpenMP threads: the
        # OMP_NUM_THREADS=1 mp run shows what that oversubscription costs.
        runs = (("single", {}, num_prompts, []), ("pp2_mp", {}, num_prompts, []),
                ("pp2_mp", {"OMP_NUM_THREADS": "1"}, num_prompts, []), ("pp2_ray", {}, num_prompts, []))  # fmt: skip
        extra = ["model.dtype=float32"]
    else:
        runs = [("single", {}, num_prompts, [])]
        for i, m in enumerate(microbatches):
            for ex in pp2_executors if i == 0 else pp2_executors[:1]:
                runs.append((f"pp2_{ex}", {}, num_prompts * m, [f"parallel.microbatches={m}"]))
            for name, value in ab_env if i == 0 else ():
                runs.append((f"pp2_{pp2_executors[0]}", {name: value}, num_prompts * m, [f"parallel.microbatches={m}"]))
        runs.append(("single", {}, num_prompts * max(microbatches), []))
        extra = ["model.dtype=bfloat16"]
    for parallel, env_extra, n, more in runs:
        with tempfile.TemporaryDirectory() as tmp:
            out_json = Path(tmp) / "bench.json"
            cmd = [
                sys.executable, "-m", "pprun", "bench",
                f"model.model={model}", *extra, f"device={device}",
                f"parallel={parallel}", "peer=none", *more,
                f"num_prompts={n}", f"scheduler.max_num_seqs={n}",
                f"input_len={input_len}", f"output_len={output_len}",
                f"hydra.run.dir={tmp}/hydra", f"output_json={out_json}",
            ]  # fmt: skip
            load = load_info()
            env = {**_child_env(), **env_extra}
            proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
            if proc.returncode != 0:
                results.append({"parallel": parallel, "command": _shell(cmd), "error": proc.stderr[-2000:]})
                continue
            bench = json.loads(out_json.read_text())
            label = f"{parallel} {n} requests" + (f" in {n // num_prompts} batches" if more else "")
            results.append(
                {
                    "parallel": parallel,
                    "label": label + "".join(f" {k}={v}" for k, v in env_extra.items()),
                    "command": " ".join([f"{k}={v}" for k, v in env_extra.items()] + ["python", *cmd[1:-1]]),
                    "load_before": load,
                    "executor": bench["config"]["executor"],
                    "pp": bench["config"]["pp"],
                    "layer_partition": bench["config"]["layer_partition"],
                    **{
                        k: bench["pprun"][k]
                        for k in (
                            "elapsed_s",
                            "output_tokens_per_s",
                            "total_tokens_per_s",
                            "ttft_ms_p50",
                            "tpot_ms_p50",
                            "tpot_ms_p99",
                            "decode_tokens_per_s",
                            "decode_ms_per_step",
                            "decode_batch",
                        )
                    },
                }  # fmt: skip
            )
        print(json.dumps(results[-1]), file=sys.stderr, flush=True)  # progress, kept if a later run hangs
    ok = [r for r in results if "error" not in r]
    base = next((r for r in ok if r["pp"] == 1), None)
    if base is not None:
        ratios: dict[str, Any] = {}
        for key in ("output_tokens_per_s", "decode_tokens_per_s"):
            if base.get(key):
                ratios[key] = {
                    f"{r['label']} / {base['label']}": round(r[key] / base[key], 3)
                    for r in ok if r is not base and r.get(key)
                }  # fmt: skip
        results.append({"ratios": ratios})
    return results


def _child_env() -> dict[str, str]:
    """The environment of child scripts: this checkout first on the import path."""
    path = os.environ.get("PYTHONPATH")
    return dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{path}" if path else str(REPO))


def _shell(cmd: list[str]) -> str:
    return " ".join(cmd)


# --- 2. memory per stage ------------------------------------------------------------------------


def bench_memory(pp_sizes: tuple[int, ...]) -> dict[str, Any]:
    """Stage-process RSS with the mp executor at each pp, and the fit rss = fixed + slope*weights."""
    from pprun.engine.llm import LLM
    from pprun.sampling.params import SamplingParams

    runs = []
    for pp in pp_sizes:
        llm = LLM(
            DEMO_MODEL,
            dtype="float32",
            device="cpu",
            executor="mp",
            pipeline_parallel_size=pp,
            kv_cache_memory_bytes=MEMORY_KV_BYTES,
            max_model_len=512,  # 64 MiB holds a 512-token request even at pp=1
            max_num_seqs=16,
        )
        try:
            # Run real steps first so the runner's buffers and gloo's are touched too.
            llm.generate(
                [{"prompt_token_ids": list(range(10, 74))}] * 4,
                SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
            )
            stages = llm.engine.executor.call_all("memory_stats")
            partition = list(llm.engine.resolved.layer_partition)
        finally:
            llm.shutdown()
        runs.append({"pp": pp, "layer_partition": partition, "stages": stages})
    points = [
        (s["param_bytes"] + s["kv_cache_bytes"], s["peak_rss_bytes"], s["rss_bytes"])
        for r in runs
        for s in r["stages"]
    ]
    fit_peak = _linear_fit([p[0] for p in points], [p[1] for p in points])
    fit_rss = _linear_fit([p[0] for p in points], [p[2] for p in points])
    overhead = [s["rss_bytes"] - s["param_bytes"] - s["kv_cache_bytes"] for r in runs for s in r["stages"]]
    mib = 2**20
    return {
        "bare_process_rss_mib": _bare_process_rss_mib(),
        "executor": "mp",
        "kv_cache_memory_bytes": MEMORY_KV_BYTES,
        "max_model_len": 512,
        "runs": runs,
        "fit_over_stages": "rss = fixed + slope * (param_bytes + kv_cache_bytes), least squares over every stage",
        "fit_rss": {"fixed_mib": round(fit_rss[0] / mib, 1), "slope": round(fit_rss[1], 3)},
        "fit_peak_rss": {"fixed_mib": round(fit_peak[0] / mib, 1), "slope": round(fit_peak[1], 3)},
        "rss_minus_weights_and_kv_mib": {
            "min": round(min(overhead) / mib, 1),
            "median": round(statistics.median(overhead) / mib, 1),
            "max": round(max(overhead) / mib, 1),
        },
    }


def _bare_process_rss_mib() -> dict[str, float]:
    """RSS of a fresh interpreter after ``import torch`` and after also joining a 1-rank gloo group."""
    from pprun.executor.mp import free_port

    code = (
        "import torch, torch.distributed as dist\n"
        "def rss():\n"
        "    for line in open('/proc/self/status'):\n"
        "        if line.startswith('VmRSS:'): return int(line.split()[1]) / 1024\n"
        "a = rss()\n"
        f"dist.init_process_group('gloo', init_method='tcp://127.0.0.1:{free_port()}', world_size=1, rank=0)\n"
        "print(a, rss())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    torch_only, with_gloo = (float(x) for x in out.split())
    return {"python_import_torch": round(torch_only, 1), "plus_gloo_group": round(with_gloo, 1)}


def _linear_fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares ``y = a + b x``; returns ``(a, b)``."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    return my - b * mx, b


# --- 3. one pipeline hop ------------------------------------------------------------------------


def bench_hop(iters: int, device: str = "cpu", hidden: int = HIDDEN_SIZE, num_tensors: int = 1) -> dict[str, Any]:
    """Start two processes (this script, ``--hop-rank``) and collect rank 0's timings: gloo on
    CPU, NCCL between GPU 0 and GPU 1 on ``cuda`` (bf16 tensors, metadata still on gloo)."""
    from pprun.executor.mp import free_port

    init_method = f"tcp://127.0.0.1:{free_port()}"
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--hop-rank",
                str(rank),
                "--init-method",
                init_method,
                "--iters",
                str(iters),
                "--device",
                device,
                "--hidden",
                str(hidden),
                "--hop-tensors",
                str(num_tensors),
            ],
            cwd=REPO,
            env=_child_env(),
            stdout=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    outs = [p.communicate(timeout=900)[0] for p in procs]
    for p in procs:
        if p.returncode != 0:
            raise RuntimeError(f"hop benchmark rank exited with {p.returncode}")
    return json.loads(outs[0])


STREAMED_HOPS = 200
"""64 MiB hops in the one-way stream: tens of milliseconds over NVLink, enough that the barriers
around it weigh little (with 30 hops the wall-clock figure moves by up to a factor of two between
runs)."""
GRAPH_HOP_MAX_TOKENS = 512
"""Largest hop timed inside CUDA graphs (the largest decode graph the runner captures by default)."""


def _graph_round(rank, forward, backward, tensors, buffers, warm_up, sync):
    """A round trip replayed from CUDA graphs, as a decode step's hop runs when the graphs carry
    it (``PipelineTransport.send_in_graph`` / ``recv_in_graph``): no host work per message."""
    import torch

    warm_up()  # an eager round first: metadata known, NCCL connected (not possible in a capture)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        if rank == 0:
            forward.send_in_graph(tensors)
            backward.recv_in_graph(buffers)
        else:
            forward.recv_in_graph(buffers)
            backward.send_in_graph(buffers)

    def graph_round() -> None:
        graph.replay()
        sync()

    return graph_round


def _streamed_hops(rank, forward, tensors, buffers, num_tokens, nbytes, n_iter, sync) -> dict[str, Any]:
    """Large hops back to back in one direction, as a prefill's chunks leave a stage: rank 0
    sends ``n_iter`` through ``PipelineTransport.send``, rank 1 receives them.

    Two figures: ``us_per_hop`` is the whole stream by the host clock, from a barrier to the
    barrier after rank 1's last receive completed, over ``n_iter`` (the barriers' latency is
    counted in, so this understates the link a little); on GPUs ``device_us_per_hop`` is the
    receiver's stream from the start of its first receive to the end of its last, over
    ``n_iter`` (what the link delivers once hops queue up; the first receive may wait a little
    for the sender to start, which is counted in)."""
    import torch
    import torch.distributed as dist

    group = forward.cpu_group
    cuda = forward.device.type == "cuda"
    if cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    dist.barrier(group=group)
    t0 = time.perf_counter()
    if cuda and rank == 1:
        start.record()
    for _ in range(n_iter):
        if rank == 0:
            forward.send(tensors)
        else:
            forward.recv(buffers, num_tokens)
    if cuda and rank == 1:
        end.record()
    sync()
    dist.barrier(group=group)
    us = (time.perf_counter() - t0) / n_iter * 1e6
    out = {"hops": n_iter, "us_per_hop": round(us, 1), "GBps": round(nbytes / us / 1e3, 3)}
    if cuda:
        received = [None, None]
        dist.all_gather_object(received, start.elapsed_time(end) * 1e3 / n_iter if rank == 1 else None, group=group)
        device_us = received[1]
        out.update(device_us_per_hop=round(device_us, 1), device_GBps=round(nbytes / device_us / 1e3, 3))
    return out


def hop_rank_main(
    rank: int, init_method: str, iters: int, device_type: str = "cpu", hidden: int = HIDDEN_SIZE, num_tensors: int = 1
) -> None:
    """One side of the ping-pong: rank 0 sends and waits for the echo, rank 1 echoes."""
    import torch
    import torch.distributed as dist

    from pprun.distributed.intermediate import IntermediateTensors
    from pprun.distributed.layout import StageLayout
    from pprun.distributed.transport import PipelineTransport

    if device_type == "cuda":
        device, dtype = torch.device("cuda", rank), torch.bfloat16
        torch.cuda.set_device(device)
    else:
        device, dtype = torch.device("cpu"), torch.float32
    layouts = [StageLayout.from_partition([1, 1], r) for r in (0, 1)]
    forward = PipelineTransport.init(layouts[rank], device, init_method, 120.0)
    group = forward.device_group
    # The way back: the same groups, with the stage order reversed (rank 1 acts as stage 0).
    backward = PipelineTransport(layouts[1 - rank], device, forward.cpu_group, group, [1, 0])

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    element = torch.empty((), dtype=dtype).element_size()
    cases = [(f"{n}_tokens", n) for n in HOP_NUM_TOKENS]
    keys = HOP_KEYS[:num_tensors]
    large_tokens = HOP_LARGE_BYTES // (len(keys) * hidden * element)
    cases.append((f"{large_tokens}_tokens_64MiB", large_tokens))
    results: dict[str, Any] = {}
    for name, num_tokens in cases:
        tensors = IntermediateTensors(
            {k: torch.randn(num_tokens, hidden, device=device).to(dtype) for k in keys}
        )
        buffers = IntermediateTensors({k: torch.empty_like(v) for k, v in tensors.items()})
        n_iter = iters if num_tokens <= 256 else max(30, iters // 10)
        n_warm = max(3, n_iter // 10)

        def transport_round(tensors=tensors, buffers=buffers, num_tokens=num_tokens) -> None:
            if rank == 0:
                forward.send(tensors)
                backward.recv(buffers, num_tokens)
            else:
                forward.recv(buffers, num_tokens)
                backward.send(buffers)
            sync()

        def bare_round(tensors=tensors, buffers=buffers) -> None:
            peer = 1 - rank
            if rank == 0:
                for v in tensors.values():
                    dist.send(v, peer, group=group)
                for v in buffers.values():
                    dist.recv(v, peer, group=group)
            else:
                for v in buffers.values():
                    dist.recv(v, peer, group=group)
                for v in buffers.values():
                    dist.send(v, peer, group=group)
            sync()

        row: dict[str, Any] = {
            "num_tokens": num_tokens,
            "bytes": sum(v.numel() * v.element_size() for v in tensors.values()),
        }
        rounds = [("transport", transport_round), ("tensors_only", bare_round)]
        if device.type == "cuda" and num_tokens <= GRAPH_HOP_MAX_TOKENS:
            rounds.append(("in_graph", _graph_round(rank, forward, backward, tensors, buffers, transport_round, sync)))
        for label, fn in rounds:
            for _ in range(n_warm):
                fn()
            samples = []
            for _ in range(n_iter):
                t0 = time.perf_counter()
                fn()
                samples.append((time.perf_counter() - t0) / 2)  # one hop = half a round trip
            row[label] = _stats_us(samples)
        if num_tokens == large_tokens:  # the 64 MiB case: also one way, back to back
            row["transport_streamed"] = _streamed_hops(
                rank, forward, tensors, buffers, num_tokens, row["bytes"], STREAMED_HOPS, sync
            )
        # What PipelineTransport adds to bare sends (stacking small hops into one message).
        row["transport_minus_bare_us"] = round(row["transport"]["median_us"] - row["tensors_only"]["median_us"], 1)
        for label, _ in rounds:
            row[f"{label}_GBps"] = round(row["bytes"] / (row[label]["median_us"] * 1e-6) / 1e9, 3)
        results[name] = row
    dist.barrier(group=forward.cpu_group)
    if rank == 0:
        link = "NCCL between GPU 0 and GPU 1, metadata on gloo" if device.type == "cuda" else "gloo (loopback TCP)"
        print(
            json.dumps(
                {
                    "what": f"PipelineTransport.send + recv of {' and '.join(keys)} [num_tokens, {hidden}] "
                    f"{str(dtype).removeprefix('torch.')} over {link}, ping-pong, µs per hop = round trip / 2",
                    "num_tensors": len(keys),
                    "cases": results,
                }
            ),
            flush=True,
        )
    forward.close()


# --- 4. control path ----------------------------------------------------------------------------


def make_tiny_model(out_dir: Path) -> None:
    """A 2-layer, hidden-64 random Llama (fp32): stage compute is tiny next to the control path."""
    cmd = [
        sys.executable, str(REPO / "scripts" / "make_random_model.py"), str(out_dir),
        "--hidden", "64", "--layers", "2", "--heads", "4", "--kv-heads", "2",
        "--intermediate", "128", "--vocab", "256", "--max-pos", "2048", "--dtype", "float32",
    ]  # fmt: skip
    subprocess.run(cmd, cwd=REPO, env=_child_env(), check=True, capture_output=True)


def bench_control(num_steps: int, device: str = "cpu") -> dict[str, Any]:
    """Per-step round trip engine -> stages -> engine, with empty steps and 1-request decode steps."""
    import torch

    # One intra-op thread everywhere: on a tiny model extra OpenMP threads only spin against
    # the other stage processes for the same cores.  Stage processes inherit the variable.
    saved = (os.environ.get("OMP_NUM_THREADS"), torch.get_num_threads())
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    try:
        runs = _control_runs(num_steps, device)
    finally:
        if saved[0] is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = saved[0]
        torch.set_num_threads(saved[1])
    for name in ("mp_pp2", "ray_pp2"):
        r = runs[name]
        # Decode step minus the same work done in one process: control path + one hop.
        r["decode_minus_uni_us"] = round(
            r["decode_step"]["median_us"] - runs["uni_pp1"]["decode_step"]["median_us"], 1
        )
    return {
        "model": "random Llama, 2 layers, hidden 64, 4 heads / 2 KV heads, vocab 256, fp32; OMP_NUM_THREADS=1",
        "what": "executor.submit(so) + executor.get_output() per step, one step in flight; empty_step: "
        "a SchedulerOutput with nothing scheduled (pickle, one socket write per stage, the last stage "
        "answers an empty ModelRunnerOutput); decode_step: 1 request, 1 token (stage compute, one "
        "hop at pp=2 and greedy sampling included)",
        "runs": runs,
    }


def _control_runs(num_steps: int, device: str = "cpu") -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "tiny-llama"
        make_tiny_model(model_dir)
        runs = {}
        for name, executor, pp in (("uni_pp1", "uni", 1), ("mp_pp2", "mp", 2), ("ray_pp2", "ray", 2)):
            runs[name] = _control_run(model_dir, executor, pp, num_steps, device)
    return runs


def _control_run(model_dir: Path, executor: str, pp: int, num_steps: int, device: str = "cpu") -> dict[str, Any]:
    from pprun.core.outputs import CachedRequestData, NewRequestData, SchedulerOutput
    from pprun.engine.llm import LLM
    from pprun.sampling.params import SamplingParams

    block_size = 16
    prompt = list(range(1, 9))
    num_warmup_steps = 20
    max_len = len(prompt) + num_warmup_steps + num_steps + 1  # only decode steps add tokens
    llm = LLM(
        str(model_dir),
        dtype="float32",
        device=device,
        executor=executor,
        pipeline_parallel_size=pp,
        kv_cache_memory_bytes=8 * 2**20,
        max_model_len=1024,
        max_num_seqs=4,
        block_size=block_size,
    )
    load = load_info()
    try:
        ex = llm.engine.executor
        step_ids = iter(range(10**9))
        block_ids = list(range(1, (max_len + block_size - 1) // block_size + 1))
        req = "r0"
        # Engine-free driving: the runner state is keyed by request id, so a hand-made prefill
        # then decode SchedulerOutputs look exactly like the engine's.
        prefill = SchedulerOutput(
            step_id=next(step_ids),
            scheduled_new_reqs=[
                NewRequestData(req, prompt, SamplingParams(temperature=0.0, max_tokens=max_len), block_ids, 0)
            ],
            scheduled_cached_reqs=CachedRequestData(),
            num_scheduled_tokens={req: len(prompt)},
            total_num_scheduled_tokens=len(prompt),
        )
        ex.submit(prefill)
        last_token = ex.get_output().sampled_token_ids[0][-1]
        num_computed = len(prompt)

        def decode_step() -> None:
            nonlocal last_token, num_computed
            so = SchedulerOutput(
                step_id=next(step_ids),
                scheduled_new_reqs=[],
                scheduled_cached_reqs=CachedRequestData([req], [[]], [num_computed], [[last_token]]),
                num_scheduled_tokens={req: 1},
                total_num_scheduled_tokens=1,
            )
            ex.submit(so)
            last_token = ex.get_output().sampled_token_ids[0][-1]
            num_computed += 1

        def empty_step() -> None:
            ex.submit(SchedulerOutput(next(step_ids), [], CachedRequestData(), {}, 0))
            ex.get_output()

        result: dict[str, Any] = {"executor": executor, "pp": pp, "load_before": load}
        for label, fn in (("empty_step", empty_step), ("decode_step", decode_step)):
            for _ in range(num_warmup_steps):
                fn()
            samples = []
            for _ in range(num_steps):
                t0 = time.perf_counter()
                fn()
                samples.append(time.perf_counter() - t0)
            result[label] = _stats_us(samples)
        # The engine's own loop on the same model (scheduler, detokenising-free token ids).
        out = llm.generate(
            [{"prompt_token_ids": prompt}], SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
        )[0]
        tpot = out.metrics.time_per_output_token
        result["engine_tpot_us_1_request"] = None if tpot is None else round(tpot * 1e6, 1)
        return result
    finally:
        llm.shutdown()


# --- main ---------------------------------------------------------------------------------------


def _env_pair(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise ValueError(f"--ab-env {text!r} is invalid: expected NAME=VALUE")
    return name, value


def main() -> None:
    """Run the selected parts and print one JSON object."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, help="also write the JSON here")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--memory-pp", default="1,2,4", help="pipeline sizes of the memory part")
    ap.add_argument("--hop-iters", type=int, default=500)
    ap.add_argument("--control-steps", type=int, default=300)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="cuda: throughput with one GPU per stage, hop over NCCL between GPUs 0 and 1, "
                         "control path with stages on GPUs (needs two GPUs)")
    ap.add_argument("--model", default=DEMO_MODEL, help="model of the throughput part")
    ap.add_argument("--microbatches", default="3",
                    help="cuda: comma-separated counts of --num-prompts-request batches pp=2 keeps in flight")
    ap.add_argument("--pp2-executors", default="mp,ray", help="cuda: executors of the pp=2 runs")
    ap.add_argument("--ab-env", action="append", default=[], metavar="NAME=VALUE",
                    help="cuda: run the first pp=2 case again with this environment variable set "
                         "(e.g. PPRUN_DISABLE_GRAPH_HOP=1); repeatable")
    ap.add_argument("--hidden", type=int, help=f"hop row width (default {HIDDEN_SIZE}; 2048 on cuda)")
    ap.add_argument("--hop-tensors", type=int, choices=(1, 2), default=1,
                    help="tensors per hop: 1, what a Llama stage sends (the residual stream); 2, the "
                         "(hidden_states, residual) pair")
    ap.add_argument("--hop-rank", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--init-method", help=argparse.SUPPRESS)
    ap.add_argument("--iters", type=int, default=500, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.ab_env and args.device != "cuda":
        raise SystemExit("--ab-env applies to --device cuda runs only")
    hidden = args.hidden or (2048 if args.device == "cuda" else HIDDEN_SIZE)
    if args.hop_rank is not None:
        hop_rank_main(args.hop_rank, args.init_method, args.iters, args.device, hidden, args.hop_tensors)
        return
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    for p in parts:
        if p not in PARTS:
            raise ValueError(f"--parts entry {p!r} is unknown; choose from {', '.join(PARTS)}")
    import torch

    result: dict[str, Any] = {
        "machine": {
            **load_info(),
            "torch": torch.__version__,
            "torch_num_threads": torch.get_num_threads(),
            "python": sys.version.split()[0],
        },
    }
    if "throughput" in parts:
        result["throughput"] = {
            "model": args.model,
            "device": args.device,
            "dtype": "float32" if args.device == "cpu" else "bfloat16",
            "workload": {
                "num_prompts": args.num_prompts,
                "input_len": args.input_len,
                "output_len": args.output_len,
            },
            "runs": bench_throughput(
                args.num_prompts, args.input_len, args.output_len, args.device, args.model,
                tuple(int(m) for m in args.microbatches.split(",")), tuple(args.pp2_executors.split(",")),
                tuple(_env_pair(e) for e in args.ab_env),
            ),
        }
    if "memory" in parts:
        result["memory"] = bench_memory(tuple(int(x) for x in args.memory_pp.split(",")))
    if "hop" in parts:
        result["hop"] = {"load_before": load_info(), **bench_hop(args.hop_iters, args.device, hidden, args.hop_tensors)}
    if "control" in parts:
        result["control"] = bench_control(args.control_steps, args.device)
    result["machine"]["loadavg_1m_at_end"] = round(os.getloadavg()[0], 2)
    text = json.dumps(result, indent=2)
    print(text, flush=True)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
