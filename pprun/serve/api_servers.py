"""``serve.api_servers`` > 1: N front-end processes over one engine process (vLLM's
``--api-server-count``).

The process ``pprun serve`` runs (the *parent*) serves nothing itself: it chooses the ports, starts
the engine process with one channel per front end (``pprun.engine.engine_process``), waits for it
to be ready, then starts N front ends (``multiprocessing`` spawn), each the whole server of
``pprun.serve.server.serve_engine`` — gRPC, the OpenAI HTTP API, parsing, validation, tokenizing,
detokenizing and encoding — over an :class:`~pprun.engine.engine_process.EngineChannel` on its
channel.  The engine sends each front end one message per step with its requests' updates and
reads each front end's commands in batches.

* Ports: the parent binds each port once with SO_REUSEPORT (port 0 resolves here) and keeps that
  socket, not listening, for the run; every front end binds the same port with SO_REUSEPORT and
  listens, and the kernel spreads new connections over the N listeners.
* Ids: each front end names its requests with a random prefix of its own, and the engine keys a
  request by its front end and its id, so a caller's ``request_id`` need only be unique where it
  was sent.
* Ready: a front end starts only once the engine is ready; the parent prints the "serving" line
  once every front end serves.
* ``/metrics``: the engine's gauges and counters come with its step reports (the same in every
  front end); the latency histograms and ``pprun_requests_unfinished`` are summed over the front
  ends by ``prometheus_client``'s multi-process mode (a directory the parent makes and removes).
* SIGTERM or SIGINT to the parent drains every front end (each as one server would), then stops
  the engine; the parent exits 0.  A front end that dies ends the server: the others drain, the
  engine stops (it has aborted the dead one's requests already) and the parent exits 1, for
  whatever supervises it to restart the whole.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from multiprocessing.connection import Connection, wait

from pprun.serve.settings import ServeSettings

logger = logging.getLogger(__name__)

STOP_GRACE_S = 30.0
"""How long a front end gets past ``serve.drain_timeout_s`` to exit on SIGTERM before it is killed."""


def reserve_port(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` with SO_REUSEPORT, not listening: the port the front
    ends share (port 0: a free one), held for the run."""
    host = host.strip("[]")
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def serve_api_servers(settings: ServeSettings) -> None:
    """Serve with ``serve.api_servers`` front-end processes until SIGTERM/SIGINT, then drain them
    and stop the engine; raises SystemExit(1) when a front end died (after stopping the rest)."""
    from pprun.engine.engine_process import _EngineChild

    sc = settings.serve
    num = sc.api_servers
    reserved: list[socket.socket] = []
    try:
        for key, port in (("serve.port", sc.port), ("serve.http_port", sc.http_port)):
            if port is None:
                continue
            try:
                reserved.append(reserve_port(sc.host, port))
            except OSError as e:
                raise ValueError(f"serve.host={sc.host!r} {key}={port}: cannot bind: {e}") from None
        ports = [sock.getsockname()[1] for sock in reserved]
        grpc_port, http_port = ports[0], (ports[1] if sc.http_port is not None else None)
        child = _EngineChild(settings.engine, num_front_ends=num)
        try:
            child.recv_ready()
        except BaseException:
            child.kill()
            raise
        logger.info("engine process %d started for %d front-end processes", child.proc.pid, num)
        metrics_dir = tempfile.mkdtemp(prefix="pprun-metrics-")
        try:
            _run(settings, child, grpc_port, http_port, metrics_dir)
        finally:
            shutil.rmtree(metrics_dir, ignore_errors=True)
    finally:
        for sock in reserved:
            sock.close()


def _run(settings: ServeSettings, child, grpc_port: int, http_port: int | None, metrics_dir: str) -> None:
    sc = settings.serve
    ctx = multiprocessing.get_context("spawn")
    procs: list = []
    status: list[Connection] = []
    # The front ends' prometheus_client reads it when first imported (multi-process mode).
    saved = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
    try:
        for i, sock in enumerate(child.front_end_sockets):
            ours, theirs = ctx.Pipe(duplex=False)
            conn = Connection(sock.detach())
            proc = ctx.Process(target=front_end_main, name=f"pprun-api-server-{i}", daemon=False,
                               args=(settings, conn, i, grpc_port, http_port, theirs,
                                     logging.getLogger().getEffectiveLevel()))
            proc.start()
            conn.close()  # the front end holds its end of the channel now
            theirs.close()
            procs.append(proc)
            status.append(ours)
    finally:
        if saved is None:
            os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
        else:
            os.environ["PROMETHEUS_MULTIPROC_DIR"] = saved
    stopping = False
    died: str | None = None
    wake_r, wake_w = socket.socketpair()
    wake_r.setblocking(False)
    wake_w.setblocking(False)

    def on_signal(signum: int, frame: object) -> None:
        try:
            wake_w.send(b"x")
        except OSError:
            pass

    old_handlers = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        serving: list[dict | None] = [None] * len(procs)
        while any(s is None for s in serving) and died is None and not stopping:
            ready = wait([*status, wake_r, *(p.sentinel for p in procs)])
            if wake_r in ready:
                stopping = True
            for i, conn in enumerate(status):
                if conn in ready and serving[i] is None:
                    try:
                        serving[i] = conn.recv()
                    except (EOFError, OSError):
                        died = f"front end {i} (pid {procs[i].pid}) exited while starting (exit code {procs[i].exitcode})"
        if died is None and not stopping:
            info = dict(serving[0], api_servers=len(procs), api_server_pids=[p.pid for p in procs])
            print(json.dumps(info), flush=True)
            logger.info("pprun serve: %d front-end processes serve (pids %s)", len(procs),
                        " ".join(str(p.pid) for p in procs))
            while died is None and not stopping:
                ready = wait([wake_r, *(p.sentinel for p in procs)])
                if wake_r in ready:
                    stopping = True
                for i, proc in enumerate(procs):
                    if proc.sentinel in ready and died is None:
                        proc.join()
                        died = f"front end {i} (pid {proc.pid}) exited with code {proc.exitcode}"
        if died is not None:
            logger.error("pprun serve: %s: the server stops (the other front ends drain)", died)
        _stop_front_ends(procs, sc.drain_timeout_s + STOP_GRACE_S, metrics_dir)
    finally:
        for sig, handler in old_handlers.items():
            signal.signal(sig, handler)
        wake_r.close()
        wake_w.close()
        for conn in status:
            conn.close()
        child.stop(max(10.0, settings.engine.cfg.parallel.stage_timeout_s + 10))
        logger.info("pprun serve: stopped")
        sys.stdout.flush()
    if died is not None:
        # Logged above; exit status 1 without a traceback, for a supervisor to restart the server.
        raise SystemExit(1)


def _stop_front_ends(procs: list, timeout_s: float, metrics_dir: str) -> None:
    """SIGTERM every live front end (each drains), wait for all, kill what is left."""
    for proc in procs:
        if proc.is_alive():
            os.kill(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for proc in procs:
        proc.join(timeout=max(0.0, deadline - time.monotonic()))
        if proc.is_alive():
            logger.warning("front end %s (pid %d) did not stop: killed", proc.name, proc.pid)
            proc.kill()
            proc.join()
    from prometheus_client import multiprocess

    for proc in procs:
        multiprocess.mark_process_dead(proc.pid, metrics_dir)


def _end_with_parent() -> None:
    """SIGTERM this front end when its parent dies (Linux ``PR_SET_PDEATHSIG``), so that a parent
    killed outright leaves no front end serving behind it; it drains as on any SIGTERM."""
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the parent's SIGTERM still drains it
        return
    if os.getppid() == 1:  # the parent died before the call
        os.kill(os.getpid(), signal.SIGTERM)


def front_end_main(settings: ServeSettings, conn: Connection, index: int, grpc_port: int, http_port: int | None,
                   status: Connection, log_level: int) -> None:
    """One front-end process: an :class:`~pprun.engine.engine_process.EngineChannel` on ``conn``
    and the whole server over it (``pprun.serve.server.serve_engine``), until SIGTERM."""
    import asyncio

    _end_with_parent()
    logging.basicConfig(level=log_level, stream=sys.stderr,
                        format=f"[%(asctime)s][%(name)s][%(levelname)s][api-server {index}] %(message)s")
    logging.getLogger("pprun").setLevel(log_level)
    from pprun.engine.async_engine import max_unfinished_requests
    from pprun.engine.engine_process import EngineChannel
    from pprun.engine.inputs import InputProcessor
    from pprun.serve.server import FrontEnd, serve_engine
    from pprun.utils.startup import freeze_startup_objects

    resolved = settings.engine
    inputs = InputProcessor.for_config(resolved)
    ready = conn.recv()[1]  # the engine's facts, sent on every channel once it started
    engine = EngineChannel(conn, resolved.cfg, inputs,
                           max_unfinished_requests(resolved.cfg, settings.serve.max_queued_requests), ready)
    freeze_startup_objects()
    front_end = FrontEnd(index, grpc_port, http_port, status.send)
    try:
        asyncio.run(serve_engine(engine, settings, front_end=front_end))
    finally:
        engine.shutdown(drain_timeout_s=0.0)
        status.close()
