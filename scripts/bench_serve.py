"""Serving overhead: throughput through gRPC or the OpenAI HTTP API against offline generation on
the same workload, and the time to first token the server adds.  Prints one JSON object.

    python scripts/bench_serve.py --model smollm2-135m-instruct --clients 16 --input-len 64 --output-len 32
    python scripts/bench_serve.py --model smollm2-135m-instruct --pp 2 --executor mp --clients 16 ...
    python scripts/bench_serve.py --model /tmp/llama1b --dtype bfloat16 --clients 64 --num-prompts 256 \
        --input-len 512 --output-len 128 --protocol both

Both sides run the same random token-id prompts (seeded, EOS ignored, greedy) in one run: first
offline (``LLM.generate`` with every prompt submitted at once, as ``pprun bench`` times it, after
a warm-up batch), then — with the offline engine shut down — a ``pprun serve`` server process with
the same engine settings and ``--clients`` concurrent streaming ``Generate`` calls (one prompt
each, or ``--num-prompts`` taken in turn: a client whose call ends starts the next prompt; after
the same warm-up through the server).  With one prompt per client the run is the start-up burst
(every request arriving at once) and little else; ``--num-prompts`` of four times ``--clients``
or more measures the steady state the throughput target is about, and the JSON's ``notes`` say
so when it is not given.  Throughput is output tokens over wall time.

The clients are spread over ``--client-procs`` processes (default: a quarter of the cores, 1 to
8), each with its share of the clients on its own event loop and channels, connected before the
clock starts: one client process would add its own work to what is measured (a 64-call burst
sent, and 64 streams read, one after another by one event loop).

``same_tokens`` says whether every served output equals the offline one; ``tokens_compared``
counts the equal ones and says where the others first differ.  On CPU in float32 they are equal.
In bfloat16 on a GPU they need not be: served requests arrive over time and join batches of
other sizes and compositions than the offline ones (the first one alone), and the kernels'
results depend on the batch (split-K, tile choices, CUDA graphs per batch size) by rounding
errors, which flip a greedy pick where two logits are that close — a random model's logits are
nearly flat, so they are often.

The TTFT the server adds is, per request, what the client saw (call start to first response)
minus what the engine saw (the request accepted by the async engine to its first token, from the
final response's timings), split into ``ingress`` (call start to accepted: the client's send,
gRPC, parsing and validation) and ``egress`` (first token sampled to the client holding it: the
hand-over back, serialization, gRPC).  ``turnaround_ms`` (medians over every request but each
client's first) is the gap between a client's request finishing in the engine and its next one
accepted, while the batch runs a request short: ``final_egress`` (the last answer reaching the
client), ``client_gap`` (the client starting its next call) and ``next_ingress``; ``turnaround_p90``
its 90th percentile.  CPU time per output token (the process and its stage
processes, with psutil) is reported for both sides, and per thread (the server's event loop,
gRPC's poller, the engine thread or the reader of the engine process's reports, and the rest:
torch's and OpenMP's; with an engine process also its main thread, which steps the engine, and its
other threads): on a machine that other work shares it shows what the server adds when wall times
are noise.  ``--no-engine-process`` serves with ``serve.engine_process=false`` (the engine on a
thread of the server process), to compare the two layouts on one machine.

``--protocol http`` sends the same prompts as streamed OpenAI ``/v1/completions`` requests (token-id
prompts, server-sent events read by a minimal HTTP/1.1 client on asyncio's streams, one keep-alive
connection per client opened before the clock starts; pprun's ``return_token_ids`` and ``return_timings`` extensions give the token ids and
the engine's timings); ``--protocol both`` measures gRPC, then HTTP, on one server, each after its
own warm-up, and names each figure by its protocol.

The server is started without Hydra (``pprun.serve.server.serve`` on a config built here), so
with ``--executor uni|mp`` neither Hydra nor Ray is needed; the gRPC packages are.
``--switch-interval-ms`` sets the server process's ``sys.setswitchinterval`` (the event loop and
the engine thread, or the reader of the engine process's reports, share the GIL: how long one
waits for the other when both run Python).  The
script sets ``OMP_WAIT_POLICY=PASSIVE`` unless it is set (it matters where OpenMP runs the model:
on CPU): the offline engine steps on its main thread, the server on its engine thread, and on a
machine whose cores other processes share, an OpenMP team spinning while it waits for a
descheduled peer slows one side far more than the other.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (nearest rank) of ``values``."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def cpu_seconds(pid: int | None = None) -> float | None:
    """User + system CPU seconds of a process and its children (stage processes) so far; None
    without psutil."""
    try:
        import psutil
    except ImportError:
        return None
    root = psutil.Process(pid)
    total = 0.0
    for proc in (root, *root.children(recursive=True)):
        try:
            t = proc.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


def thread_cpu_seconds(pid: int, names: dict[int, str]) -> dict[str, float]:
    """CPU seconds of a process's threads so far, by name (``names``: native id -> name; the
    threads not named, torch's and OpenMP's, together as "other")."""
    totals: dict[str, float] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended
            continue
        seconds = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        name = names.get(int(task.name), "other")
        totals[name] = totals.get(name, 0.0) + seconds
    return totals


def engine_process_pid(server_pid: int) -> int | None:
    """The server's engine process (``serve.engine_process``), None when it steps in process."""
    try:
        import psutil
    except ImportError:
        return None
    for child in psutil.Process(server_pid).children():
        if "pprun.engine.engine_process" in child.cmdline():
            return child.pid
    return None


def server_thread_cpu_seconds(server_pid: int, names: dict[int, str], engine_pid: int | None) -> dict[str, float]:
    """:func:`thread_cpu_seconds` of the server process, and of its engine process when it has
    one (its main thread, which steps the engine, as "engine process: main"; the rest, torch's and
    OpenMP's, as "engine process: other")."""
    totals = thread_cpu_seconds(server_pid, names)
    if engine_pid is not None:
        engine = thread_cpu_seconds(engine_pid, {engine_pid: "main"})
        totals.update({f"engine process: {name}": t for name, t in engine.items()})
    return totals


def thread_names(path: Path) -> dict[int, str]:
    """The server's Python threads as its serve child last wrote them (native id -> name)."""
    try:
        return {int(k): v for k, v in json.loads(path.read_text()).items()}
    except (OSError, ValueError):
        return {}


def per_token_us(cpu_before: float | None, cpu_after: float | None, num_tokens: int) -> float | None:
    """CPU microseconds per output token between two :func:`cpu_seconds` readings."""
    return None if cpu_before is None or cpu_after is None else 1e6 * (cpu_after - cpu_before) / num_tokens


def make_prompts(num: int, input_len: int, vocab_size: int, seed: int) -> list[list[int]]:
    """Random token-id prompts (ids 10.. to stay clear of special tokens)."""
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab_size) for _ in range(input_len)] for _ in range(num)]


def engine_kwargs(args) -> dict:
    """LLM keyword arguments shared by both sides."""
    kw = {"model": args.model, "pipeline_parallel_size": args.pp, "max_num_seqs": max(args.clients, 1)}
    for name in ("executor", "runner", "dtype"):
        if getattr(args, name):
            kw[name] = getattr(args, name)
    return kw


def run_offline(args, prompts: list[list[int]]) -> tuple[dict, list[list[int]]]:
    """Offline throughput and TTFT on the prompts, and the outputs."""
    from pprun import LLM
    from pprun.sampling.params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    warm = SamplingParams(temperature=0.0, max_tokens=min(16, args.output_len), ignore_eos=True)
    with LLM(**engine_kwargs(args)) as llm:
        llm.generate([{"prompt_token_ids": p} for p in prompts], warm)
        names = {threading.main_thread().native_id: "main"}
        cpu0, threads0, t0 = cpu_seconds(), thread_cpu_seconds(os.getpid(), names), time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        wall, cpu1, threads1 = time.perf_counter() - t0, cpu_seconds(), thread_cpu_seconds(os.getpid(), names)
        facts = llm.describe()
        reordered = None
        if args.reorder_check:  # the same prompts in reverse order: other batches, same engine
            rev = llm.generate([{"prompt_token_ids": p} for p in reversed(prompts)], params)
            reordered = [list(o.outputs[0].token_ids) for o in reversed(rev)]
    num_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    ttfts = [o.metrics.time_to_first_token for o in outs if o.metrics.time_to_first_token is not None]
    result = {"output_tokens": num_tokens, "wall_s": wall, "output_tok_s": num_tokens / wall,
              "cpu_us_per_token": per_token_us(cpu0, cpu1, num_tokens),
              "thread_cpu_us_per_token": {name: per_token_us(threads0.get(name, 0.0), t, num_tokens)
                                          for name, t in sorted(threads1.items())},
              "ttft_p50_ms": 1e3 * statistics.median(ttfts), "engine": facts}
    ids = [list(o.outputs[0].token_ids) for o in outs]
    if reordered is not None:
        result["reordered_same_tokens"] = reordered == ids
        result["reordered_tokens_compared"] = compare_tokens(ids, reordered)
    return result, ids


async def stream_all(address: str, prompts: list[list[int]], max_tokens: int, clients: int,
                     start_at: float | None = None, protocol: str = "grpc") -> tuple[list[dict], float]:
    """Every prompt as a streaming call (``protocol``: a pprun.v1 ``Generate`` over gRPC, or an
    OpenAI ``/v1/completions`` over HTTP), ``clients`` at a time; per call its tokens and
    timestamps, and the wall time of all (from ``start_at``, a ``time.time()``, when given: the
    calls start then)."""
    if protocol == "http":
        return await stream_all_http(address, prompts, max_tokens, clients, start_at)
    import grpc

    from pprun.serve._proto.pprun.v1 import pprun_pb2 as pb
    from pprun.serve._proto.pprun.v1 import pprun_pb2_grpc as pb_grpc

    # A local subchannel pool: each channel its own connection (a process's channels to one address
    # otherwise share one), which the kernel spreads over serve.api_servers front ends.
    channels = [grpc.aio.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])
                for _ in range(max(1, min(clients, 8)))]
    stubs = [pb_grpc.PprunStub(c) for c in channels]
    # One slot per client, taken in turn (FIFO, as a semaphore's): a slot remembers when its last
    # request ended, in the engine and at the client, for the turnaround to its next one.
    slots: asyncio.Queue[dict] = asyncio.Queue()
    for _ in range(clients):
        slots.put_nowait({})
    sampling = pb.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)

    async def one(i: int) -> dict:
        slot = await slots.get()
        try:
            t_send = time.time()
            t_first, token_ids, final = None, [], None
            async for resp in stubs[i % len(stubs)].Generate(
                pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompts[i]), sampling=sampling)
            ):
                if t_first is None and resp.token_ids:
                    t_first = time.time()
                token_ids += resp.token_ids
                if resp.HasField("final"):
                    final = resp.final
            t_end = time.time()
            t = final.timings
            result = {"token_ids": token_ids, "t_send": t_send, "t_first": t_first,
                      "t_arrival": t.arrival_time, "t_first_token": t.first_token_time,
                      "prev_finished": slot.get("finished"), "prev_end": slot.get("end")}
            slot["finished"], slot["end"] = t.finished_time, t_end
            return result
        finally:
            slots.put_nowait(slot)

    for c in channels:  # connected before the clock starts (as the offline engine is built first)
        await c.channel_ready()
    if start_at is not None:
        await asyncio.sleep(max(0.0, start_at - time.time()))
    t0 = time.time()
    try:
        results = await asyncio.gather(*(one(i) for i in range(len(prompts))))
    finally:
        for c in channels:
            await c.close()
    return results, time.time() - (t0 if start_at is None else start_at)


class SseConnection:
    """One keep-alive HTTP/1.1 connection that posts JSON and reads a streamed answer's
    server-sent events: a few lines on asyncio's streams, so that the client's own cost per
    event (a chunk's size line, its bytes, one ``json.loads``) stays small next to the server's.
    A general HTTP client would add its own per-request and per-line work, in the one client
    process a 2-core machine runs, to the ingress and egress measured."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, host: str) -> None:
        self.reader, self.writer, self.host = reader, writer, host
        self.last_finished: float | None = None
        """The engine's finished time of the last answer on this connection (None before one)."""
        self.last_end: float | None = None
        """When the client had read that answer's end."""

    @classmethod
    async def open(cls, address: str) -> SseConnection:
        """Connect to ``host:port``."""
        host, port = address.rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        return cls(reader, writer, address)

    async def post_events(self, path: str, body: dict):
        """POST ``body``; yield each event's JSON (``data: {...}``) until ``data: [DONE]``."""
        payload = json.dumps(body).encode()
        self.writer.write(f"POST {path} HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: application/json\r\n"
                          f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
        head = await self.reader.readuntil(b"\r\n\r\n")
        if not head.startswith(b"HTTP/1.1 200") or b"transfer-encoding: chunked" not in head.lower():
            raise RuntimeError(f"unexpected answer: {head[:200]!r}")
        pending = b""
        while True:
            size = int((await self.reader.readuntil(b"\r\n"))[:-2], 16)
            if size == 0:
                await self.reader.readuntil(b"\r\n")
                return
            pending += (await self.reader.readexactly(size + 2))[:-2]
            *events, pending = pending.split(b"\n\n")
            for event in events:
                data = event.removeprefix(b"data: ")
                if data == b"[DONE]":
                    continue  # the chunked body's end follows
                yield json.loads(data)

    def close(self) -> None:
        """Close the connection."""
        self.writer.close()


async def stream_all_http(address: str, prompts: list[list[int]], max_tokens: int, clients: int,
                          start_at: float | None = None) -> tuple[list[dict], float]:
    """:func:`stream_all` over the OpenAI HTTP API: streamed ``/v1/completions`` with token-id
    prompts on ``clients`` keep-alive connections (:class:`SseConnection`, opened before the clock
    starts).  ``return_token_ids`` and ``return_timings`` (pprun's extensions) give each answer's
    token ids and, with its last chunk, the engine's timings."""
    conns: asyncio.Queue[SseConnection] = asyncio.Queue()

    async def one(i: int) -> dict:
        body = {"model": "bench", "prompt": prompts[i], "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True, "return_token_ids": True, "return_timings": True}
        conn = await conns.get()
        t_send = time.time()
        t_first, token_ids, timings = None, [], None
        async for chunk in conn.post_events("/v1/completions", body):
            if "error" in chunk:
                raise RuntimeError(f"the server failed the request: {chunk['error']}")
            choice = chunk["choices"][0]
            if choice.get("token_ids"):
                if t_first is None:
                    t_first = time.time()
                token_ids += choice["token_ids"]
            if choice.get("finish_reason") is not None:
                timings = choice["timings"]
        t_end = time.time()
        result = {"token_ids": token_ids, "t_send": t_send, "t_first": t_first,
                  "t_arrival": timings["arrival_time"], "t_first_token": timings["first_token_time"],
                  "prev_finished": conn.last_finished, "prev_end": conn.last_end}
        conn.last_finished, conn.last_end = timings["finished_time"], t_end
        conns.put_nowait(conn)
        return result

    opened = await asyncio.gather(*(SseConnection.open(address) for _ in range(clients)))
    for conn in opened:
        conns.put_nowait(conn)
    try:
        if start_at is not None:
            await asyncio.sleep(max(0.0, start_at - time.time()))
        t0 = time.time()
        results = await asyncio.gather(*(one(i) for i in range(len(prompts))))
    finally:
        for conn in opened:
            conn.close()
    return results, time.time() - (t0 if start_at is None else start_at)


def client_process(address: str, prompts: list[list[int]], max_tokens: int, clients: int, start_at: float,
                   protocol: str = "grpc"):
    """One client process's share (:func:`stream_all` on its own event loop)."""
    return asyncio.run(stream_all(address, prompts, max_tokens, clients, start_at, protocol))


def stream_from_processes(pool, procs: int, address: str, prompts: list[list[int]], max_tokens: int,
                          clients: int, protocol: str = "grpc") -> tuple[list[dict], float]:
    """:func:`stream_all` spread over the pool's processes: prompt i goes to process i % P,
    each process runs its share of the clients, all start at the same instant.  One client
    process would add its own serialization to the server's (a 64-call burst is sent, and 64
    streams are read, one after another by one event loop): spread over processes, the ingress
    and egress measured are the server's and the network's."""
    if pool is None or procs == 1:
        return asyncio.run(stream_all(address, prompts, max_tokens, clients, protocol=protocol))
    start_at = time.time() + 2.0  # every process has connected by then
    shares = [list(range(k, len(prompts), procs)) for k in range(procs)]
    per_proc = [len(range(k, clients, procs)) for k in range(procs)]
    jobs = [pool.apply_async(client_process, (address, [prompts[i] for i in share], max_tokens, per_proc[k], start_at,
                                              protocol))
            for k, share in enumerate(shares) if share]
    results: list[dict | None] = [None] * len(prompts)
    wall = 0.0
    for share, job in zip([s for s in shares if s], jobs):
        part, part_wall = job.get()
        wall = max(wall, part_wall)
        for i, r in zip(share, part):
            results[i] = r
    return results, wall


def run_served(args, prompts: list[list[int]], protocols: list[str]) -> dict[str, tuple[dict, list[list[int]]]]:
    """Throughput and TTFT through one server process on loopback, and the outputs, for each
    protocol in turn (each after its own warm-up)."""
    import multiprocessing

    from serve_helpers import ServerProcess

    kwargs = engine_kwargs(args)
    kwargs.setdefault("executor", "uni" if args.pp == 1 else "ray")
    procs = min(args.client_procs, args.clients)
    pool = multiprocessing.get_context("spawn").Pool(procs) if procs > 1 else None
    measured = {}
    with tempfile.TemporaryDirectory() as tmp:
        names_path = Path(tmp) / "threads.json"
        child = {"engine": kwargs, "switch_interval_ms": args.switch_interval_ms, "thread_names": str(names_path),
                 "engine_process": args.engine_process, "http": "http" in protocols, "api_servers": args.api_servers}
        command = [sys.executable, str(Path(__file__).resolve()), "--serve-child", json.dumps(child)]
        server = ServerProcess(Path(tmp), [], startup_timeout_s=1800, command=command)
        try:
            for protocol in protocols:
                address = server.info["http_address"] if protocol == "http" else server.address
                stream_from_processes(pool, procs, address, prompts, min(16, args.output_len), args.clients,
                                      protocol)  # warm-up
                names = thread_names(names_path)
                engine_pid = engine_process_pid(server.proc.pid)
                cpu0 = cpu_seconds(server.proc.pid)
                threads0 = server_thread_cpu_seconds(server.proc.pid, names, engine_pid)
                results, wall = stream_from_processes(pool, procs, address, prompts, args.output_len, args.clients,
                                                      protocol)
                cpu1 = cpu_seconds(server.proc.pid)
                threads1 = server_thread_cpu_seconds(server.proc.pid, names, engine_pid)
                measured[protocol] = (results, wall, cpu0, cpu1, threads0, threads1)
        finally:
            rc = server.terminate()
            if pool is not None:
                pool.terminate()
    return {protocol: summarize_served(*m, rc) for protocol, m in measured.items()}


def summarize_served(results: list[dict], wall: float, cpu0: float | None, cpu1: float | None,
                     threads0: dict[str, float], threads1: dict[str, float], rc: int) -> tuple[dict, list[list[int]]]:
    """One protocol's figures from its calls' timestamps and the server's CPU readings."""
    num_tokens = sum(len(r["token_ids"]) for r in results)
    ms = [{"client": r["t_first"] - r["t_send"], "engine": r["t_first_token"] - r["t_arrival"],
           "ingress": r["t_arrival"] - r["t_send"], "egress": r["t_first"] - r["t_first_token"]} for r in results]
    added = [1e3 * (m["client"] - m["engine"]) for m in ms]

    def p50(key: str) -> float:
        return 1e3 * statistics.median(m[key] for m in ms)

    result = {"output_tokens": num_tokens, "wall_s": wall, "output_tok_s": num_tokens / wall,
              "server_cpu_us_per_token": per_token_us(cpu0, cpu1, num_tokens),
              "server_thread_cpu_us_per_token": {name: per_token_us(threads0.get(name, 0.0), t, num_tokens)
                                                 for name, t in sorted(threads1.items())},
              "client_ttft_p50_ms": p50("client"), "engine_ttft_p50_ms": p50("engine"),
              "added_ttft_p50_ms": statistics.median(added), "added_ttft_p90_ms": percentile(added, 90),
              "ingress_p50_ms": p50("ingress"), "egress_p50_ms": p50("egress"), "server_exit_status": rc}
    # A client's turnaround: its last request finished in the engine -> the next one accepted
    # (the batch runs a request short meanwhile), split into the last answer's end reaching the
    # client, the client starting its next call, and that call's ingress.
    turns = [{"turnaround": r["t_arrival"] - r["prev_finished"], "final_egress": r["prev_end"] - r["prev_finished"],
              "client_gap": r["t_send"] - r["prev_end"], "next_ingress": r["t_arrival"] - r["t_send"]}
             for r in results if r["prev_finished"] is not None]
    if turns:
        result["turnaround_ms"] = {key: 1e3 * statistics.median(t[key] for t in turns) for key in turns[0]}
        result["turnaround_ms"]["turnaround_p90"] = 1e3 * percentile([t["turnaround"] for t in turns], 90)
    return result, [r["token_ids"] for r in results]


def compare_tokens(offline: list[list[int]], served: list[list[int]]) -> dict:
    """How served outputs differ from offline ones: how many are equal, and for the others where
    the first differing token is (0: the first token, which the prompt's prefill computes)."""
    firsts = []
    for a, b in zip(offline, served):
        if a != b:
            firsts.append(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b))))
    return {"equal_outputs": len(offline) - len(firsts), "outputs": len(offline),
            "first_difference_min": min(firsts, default=None),
            "first_difference_p50": statistics.median(firsts) if firsts else None}


def write_thread_names(path: Path) -> None:
    """Every second, the process's Python threads (native id -> name, the event loop's as
    "event loop") into ``path``, for :func:`thread_cpu_seconds`."""
    while True:
        names = {t.native_id: "event loop" if t is threading.main_thread()
                 else "grpc poller" if "_poll_wrapper" in t.name else t.name
                 for t in threading.enumerate()}
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(names))
        tmp.replace(path)
        time.sleep(1.0)


def serve_child(child_json: str) -> None:
    """The server side: ``pprun serve`` on an engine built from LLM keywords, port 0, no Hydra."""
    import dataclasses
    import logging

    from pprun.config.config import PprunConfig, ServeAppConfig, ServeConfig
    from pprun.serve.launch import serve

    logging.basicConfig(level=logging.INFO, format="[%(asctime)s][%(name)s][%(levelname)s] %(message)s")
    child = json.loads(child_json)
    if child["switch_interval_ms"] is not None:
        sys.setswitchinterval(child["switch_interval_ms"] / 1e3)
    threading.Thread(target=write_thread_names, args=(Path(child["thread_names"]),), name="bench", daemon=True).start()
    engine = PprunConfig.from_kwargs(**child["engine"])
    cfg = ServeAppConfig(**{f.name: getattr(engine, f.name) for f in dataclasses.fields(PprunConfig)},
                         serve=ServeConfig(port=0, model_name="bench", engine_process=child["engine_process"],
                                           http_port=0 if child.get("http") else None,
                                           api_servers=child["api_servers"]))
    serve(cfg)


def main() -> int:
    """Run both sides and print the comparison as JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct", help="model directory or alias")
    parser.add_argument("--pp", type=int, default=1, help="pipeline stages")
    parser.add_argument("--executor", default=None, help="uni|mp|ray (default: the config's auto)")
    parser.add_argument("--runner", default=None, help="auto|v1|v2")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--clients", type=int, default=16, help="concurrent streaming clients")
    parser.add_argument("--num-prompts", type=int, default=None,
                        help="prompts (default: --clients, one each); more queue for the next free client")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--client-procs", type=int, default=max(1, min(8, (os.cpu_count() or 1) // 4)),
                        help="processes the clients are spread over (default: a quarter of the cores, 1 to 8)")
    parser.add_argument("--reorder-check", action="store_true",
                        help="also run the prompts offline in reverse order and compare (is a difference "
                             "between served and offline tokens the batches' doing?)")
    parser.add_argument("--switch-interval-ms", type=float, default=None,
                        help="the server process's sys.setswitchinterval (default: Python's, 5 ms)")
    parser.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=True,
                        help="the server steps its engine in a process of its own (serve.engine_process; "
                             "default) or on a thread of the server process (--no-engine-process)")
    parser.add_argument("--api-servers", type=int, default=1,
                        help="front-end processes over the engine process (serve.api_servers); with more than 1 "
                             "the per-thread CPU figures are the parent's, which serves nothing")
    parser.add_argument("--protocol", choices=("grpc", "http", "both"), default="grpc",
                        help="how the clients call the server: pprun.v1 Generate over gRPC, the OpenAI "
                             "/v1/completions over HTTP (server-sent events), or both in turn on one server")
    parser.add_argument("--serve-child", metavar="JSON", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_child is not None:
        serve_child(args.serve_child)
        return 0
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads OpenMP (see above)
    from pprun.config.config import PprunConfig
    from pprun.engine.resolve import resolve_config

    vocab = resolve_config(PprunConfig.from_kwargs(**engine_kwargs(args))).arch.vocab_size
    prompts = make_prompts(args.num_prompts or args.clients, args.input_len, vocab, args.seed)
    protocols = ["grpc", "http"] if args.protocol == "both" else [args.protocol]
    offline, offline_ids = run_offline(args, prompts)
    served = run_served(args, prompts, protocols)
    notes = []
    if len(prompts) < 4 * args.clients:
        notes.append(f"{len(prompts)} prompts for {args.clients} clients: the start-up burst is much of the run; "
                     f"the throughput target is measured with --num-prompts {4 * args.clients} or more")
    report = {
        "workload": {"model": args.model, "pp": args.pp, "executor": offline["engine"]["executor"],
                     "clients": args.clients, "client_procs": min(args.client_procs, args.clients),
                     "num_prompts": len(prompts), "input_len": args.input_len, "output_len": args.output_len,
                     "engine_process": args.engine_process, "api_servers": args.api_servers,
                     "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
                     "server_switch_interval_ms": args.switch_interval_ms, "protocols": protocols},
        "offline": offline,
    }  # fmt: skip
    for protocol, (figures, ids) in served.items():
        # One protocol keeps the keys it always had; with both, each key names its protocol.
        suffix = "" if len(served) == 1 else f"_{protocol}"
        report[protocol] = figures
        report["same_tokens" + suffix] = ids == offline_ids
        report["tokens_compared" + suffix] = compare_tokens(offline_ids, ids)
        report[f"{protocol}_over_offline_throughput"] = figures["output_tok_s"] / offline["output_tok_s"]
        report["added_ttft_p50_ms" + suffix] = figures["added_ttft_p50_ms"]
    report["notes"] = notes
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
