"""The engine in a process of its own: the engine process's main loop (``python -m
pprun.engine.engine_process FD [FD ...]``) and the front ends' side of it (:class:`EngineChannel`;
:class:`EngineProcess` when the server process that starts it is its one front end).

A server that steps the model in its own process is bound by one interpreter lock: the engine
loop's Python per step and the gRPC event loop's per response take turns.  Here the engine process
only adds requests (token ids and ``SamplingParams``, validated by a front end), aborts them, steps
the :class:`~pprun.engine.llm_engine.LLMEngine` and sends, per step, one
:class:`~pprun.engine.engine_loop.StepReport` to each front end: the updates of that front end's
requests (new token ids, logprobs when asked; finish reason, stop reason and timings when one
ends) and the engine's counters.  The front ends keep everything else: gRPC, HTTP, validation,
tokenizing, chat templates, incremental detokenizing, stop-string hold-back, the streams
(:class:`~pprun.engine.async_engine.EngineClient`).

Transport: socket pairs made by the process that starts the engine; the child inherits its ends
(``pass_fds``) and nothing listens, so no other process can connect, and what is unpickled on
either side comes from the one peer that was started with it.  The first is the control channel
(the resolved configuration down, ``ready`` or the start-up error up, STOP); each further one is a
front end's (``serve.api_servers`` > 1, ``pprun.serve.api_servers``); with none, the control
channel is the one front end's.  Messages are ``multiprocessing.connection`` frames of pickled
command lists (a front end's commands of one event-loop turn in one frame) and reports (the new
tokens as columns: :class:`~pprun.engine.engine_loop.StepReport`); the engine reads every pending
frame of every channel before a step.  A front end reads reports on a thread
that waits in ``recv`` outside the interpreter lock and turns each step's report into deltas,
handed to the event loop with one ``call_soon_threadsafe``.

The engine process ignores SIGINT and SIGTERM (the server drains it: a Ctrl-C or a SIGTERM sent to
the process group must not end it under running streams) and exits when its control socket
reaches EOF, so it never outlives the process that started it, however that ends; the stages it
started go with it.  When it dies, each front end sees EOF: every stream ends with an error and
health turns NOT_SERVING.  A front end's EOF (of several) aborts that front end's requests.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import select
import signal
import socket
import subprocess
import sys
import threading
from multiprocessing.connection import Connection

from pprun.config.config import PprunConfig
from pprun.config.validate import ResolvedConfig
from pprun.core.block_manager import PrefixCacheStats
from pprun.engine.async_engine import EngineClient, max_unfinished_requests
from pprun.engine.engine_loop import (
    STOP,
    AbortCommand,
    AddCommand,
    Command,
    EngineLoop,
    StepReport,
    serving_facts,
)
from pprun.engine.inputs import InputProcessor
from pprun.engine.resolve import resolve_config
from pprun.utils.startup import freeze_startup_objects

logger = logging.getLogger("pprun.engine.engine_process")  # by name: the engine process runs this module as __main__

SOCKET_BUFFER_BYTES = 4 * 2**20
"""Send and receive buffer asked for each end of the socket pair (the kernel caps it at
``net.core.wmem_max``/``rmem_max``): a burst of requests (or a step's report) is written without
waiting for the reader (the server's sends run on its event loop)."""


class _EngineChild:
    """The engine process as the process that started it holds it: the child, and the control
    channel the configuration went down (``ready`` or the start-up error comes back on it).

    ``num_front_ends`` = 0: the control channel is also the one front end's (one server process,
    ``serve.api_servers=1``); N > 0: N more socket pairs, whose other ends
    (:attr:`front_end_sockets`) the caller hands to its front-end processes.
    """

    def __init__(self, resolved: ResolvedConfig, num_front_ends: int = 0) -> None:
        pairs = [_socket_pair() for _ in range(1 + num_front_ends)]
        theirs = [pair[1] for pair in pairs]
        fds = [str(sock.fileno()) for sock in theirs]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pprun.engine.engine_process", *fds],
            pass_fds=[sock.fileno() for sock in theirs],
            stdin=subprocess.DEVNULL,
            stdout=2,  # the server's stdout carries its one "serving" line; the engine's output is log
        )
        for sock in theirs:
            sock.close()
        self.conn = Connection(pairs[0][0].detach())
        self.front_end_sockets: list[socket.socket] = [pair[0] for pair in pairs[1:]]
        try:
            self.conn.send((resolved, logging.getLogger().getEffectiveLevel()))
        except BaseException:
            self.kill()
            raise

    def recv_ready(self) -> tuple[dict, int]:
        """The engine's facts and free KV blocks once it has started; raises what its
        ``LLMEngine`` raised (a ValueError or TypeError with its message) or RuntimeError."""
        try:
            kind, payload = self.conn.recv()
        except (EOFError, OSError):
            code = self.proc.wait()
            raise RuntimeError(
                f"the engine process exited during start-up (exit code {code}); its log is above"
            ) from None
        if kind == "error":
            category, name, message = payload
            # A configuration's refusal stays a ValueError / TypeError (the server reports it as
            # one); anything else is a RuntimeError that names what the engine process raised.
            if category == "ValueError":
                raise ValueError(message)
            if category == "TypeError":
                raise TypeError(message)
            raise RuntimeError(f"the engine process failed to start: {name}: {message}")
        return payload

    def stop(self, timeout_s: float) -> None:
        """STOP on the control channel, then wait for the exit (kill after ``timeout_s``)."""
        try:
            self.conn.send([STOP])
        except OSError:  # gone already
            pass
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            logger.warning("engine process %d did not stop: killed", self.proc.pid)
            self.proc.kill()
            self.proc.wait()
        self.conn.close()

    def kill(self) -> None:
        """End the child now (a failed start-up)."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.conn.close()
        for sock in self.front_end_sockets:
            sock.close()


def _socket_pair() -> tuple[socket.socket, socket.socket]:
    ours, theirs = socket.socketpair()
    for sock in (ours, theirs):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER_BYTES)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER_BYTES)
    return ours, theirs


class EngineChannel(EngineClient):
    """The serving client over one channel to an engine process: the caller's side of
    :class:`~pprun.engine.async_engine.EngineClient` (validation, streams, detokenizing) whose
    commands go down the channel and whose step reports a reader thread takes from it.

    Commands are sent in batches: those given on an event loop's thread during one turn of the
    loop go in one message at its end (a burst of requests is one send and one wake-up of the
    engine, not one per request); from any other thread at once (after what is pending, in order).
    ``num_steps`` and ``num_free_blocks`` are the engine's as of its last report (sent after every
    step, and after an abort that needed no step): an idle engine's are current.
    """

    def __init__(self, conn: Connection, cfg: PprunConfig, inputs: InputProcessor, max_unfinished: int,
                 ready: tuple[dict, int]) -> None:
        self.cfg = cfg
        self._conn = conn
        self._send_lock = threading.Lock()
        """Callers send from several threads (handlers, the drain); a frame must not interleave."""
        self._pending: list[Command] = []
        self._flush_scheduled = False
        self._stopping = False
        self._facts, self._num_free_blocks = ready
        self._cache_stats = PrefixCacheStats(enabled=bool(self._facts.get("prefix_caching"))).as_dict()
        self._num_steps = 0
        self._num_first_uses_after_ready = 0
        super().__init__(inputs, max_unfinished)
        self._reader = threading.Thread(target=self._read, name="pprun-engine-reader", daemon=True)
        self._reader.start()

    # --- EngineClient -----------------------------------------------------------------------------

    @property
    def num_steps(self) -> int:
        """Steps the engine had submitted at its last report."""
        return self._num_steps

    @property
    def num_first_uses_after_ready(self) -> int:
        """The engine's first uses after ready, as of its last report."""
        return self._num_first_uses_after_ready

    def num_free_blocks(self) -> int:
        """KV blocks free at the engine's last report."""
        return self._num_free_blocks

    def describe(self) -> dict:
        """The engine's facts as the engine process gave them at start-up."""
        return dict(self._facts)

    def cache_stats(self) -> dict:
        """The prefix-cache stats of the engine's last report that carried them (sent when a
        request is admitted or a block evicted)."""
        return dict(self._cache_stats)

    def _send(self, cmd: Command) -> None:
        with self._send_lock:
            self._pending.append(cmd)
            if self._flush_scheduled:
                return
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                loop = None
            if loop is not None:
                self._flush_scheduled = True
                loop.call_soon(self._flush)
                return
            self._flush_locked()

    def _flush(self) -> None:
        with self._send_lock:
            self._flush_locked()

    def _flush_locked(self) -> None:
        self._flush_scheduled = False
        if not self._pending:
            return
        cmds, self._pending = self._pending, []
        try:
            self._conn.send(cmds)
        except OSError:  # the engine process is gone: the reader ends every stream
            pass

    def _on_report(self, report: StepReport) -> None:
        self._num_steps, self._num_free_blocks = report.num_steps, report.num_free_blocks
        self._num_first_uses_after_ready = report.num_first_uses_after_ready
        if report.cache_stats is not None:
            self._cache_stats = report.cache_stats
        super()._on_report(report)

    def _read(self) -> None:
        """The reader thread: each report into deltas, until the engine process's EOF."""
        conn = self._conn
        while True:
            try:
                report = conn.recv()
            except (EOFError, OSError):
                break
            try:
                self._on_report(report)
            except Exception as e:  # a bug here must not leave streams waiting forever
                logger.exception("engine report not delivered")
                self._fail(f"a step's report could not be delivered: {type(e).__name__}: {e}", [])
                break
        if self._stopping or self.dead is not None:  # stopped, or every stream has ended already
            return
        why = self._gone_why()
        logger.error("%s: every running request ends with an error", why)
        self._fail(why, [])

    def _gone_why(self) -> str:
        """What the streams' errors say when the channel reaches EOF unasked."""
        return "the engine process exited"

    def _stop_engine(self) -> None:
        """This front end's part: every command sent, then the channel closed (the engine aborts
        what this front end left, and goes on serving the others)."""
        self._stopping = True
        self._flush()
        # Shut the socket down (the reader's recv returns EOF), then close it: closing it under
        # a reader that waits in recv would pull the handle from under it.
        with socket.fromfd(self._conn.fileno(), socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.shutdown(socket.SHUT_RDWR)
        self._reader.join(timeout=10.0)
        self._conn.close()


class EngineProcess(EngineChannel):
    """An :class:`~pprun.engine.llm_engine.LLMEngine` in a child process, with the interface of
    :class:`~pprun.engine.async_engine.AsyncEngine`: the one front end's channel is the process's
    control channel.

    ``config`` is resolved here, before the child starts (a bad configuration's ValueError comes
    from this process); built once the child's engine has started (stages up, KV cache
    allocated); raises what the child's ``LLMEngine`` raised (a ValueError, with its message) or
    RuntimeError when the child exits during start-up.
    """

    def __init__(self, config: PprunConfig | ResolvedConfig, *, max_queued_requests: int = 1024) -> None:
        # The run's one validation, in the server process: the engine process builds its engine
        # from the resolved config it is sent, and this process's checks use the same one.
        resolved = resolve_config(config)
        max_unfinished = max_unfinished_requests(resolved.cfg, max_queued_requests)
        self._child = _EngineChild(resolved)
        try:
            # The server's own tokenizer and checks load while the child builds its engine.
            inputs = InputProcessor.for_config(resolved)
            ready = self._child.recv_ready()
        except BaseException:
            self._child.kill()
            raise
        super().__init__(self._child.conn, resolved.cfg, inputs, max_unfinished, ready)
        logger.info("engine process %d started", self._child.proc.pid)
        freeze_startup_objects()  # the server's start-up objects (tokenizer, torch) out of the GC's walks

    @property
    def pid(self) -> int:
        """The engine process's id."""
        return self._child.proc.pid

    @property
    def _proc(self) -> subprocess.Popen:
        return self._child.proc

    def _gone_why(self) -> str:
        try:
            code = self._child.proc.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            code = None
        return f"the engine process exited (exit code {code})"

    def _stop_engine(self) -> None:
        self._stopping = True
        self._flush()
        self._child.stop(max(10.0, self.cfg.parallel.stage_timeout_s + 10))
        self._reader.join(timeout=10.0)  # the child's exit is the reader's EOF
        gc.unfreeze()  # the caller's objects frozen at start-up are collectable again

    def _kill(self) -> None:
        self._child.kill()


# --- the engine process ---------------------------------------------------------------------------


class _FrontEnds:
    """The engine process's channels: the loop's ``take`` (every command from every front end,
    waiting up to ``wait_s`` for the first) and ``report`` (each step's report split into one
    message per front end, with that front end's requests only).

    ``control`` carries the configuration and STOP; its EOF (the process that started this one is
    gone) is a STOP and sets :attr:`server_gone`.  With one front end its channel is ``control``.
    With several, a request's id in the engine is its front end's index and its id
    (``"1/cmpl-..."``: ids need only be unique per front end), and a front end's EOF aborts the
    requests it left; the others go on.
    """

    def __init__(self, control: Connection, front_ends: list[Connection]) -> None:
        self.control = control
        self.front_ends: list[Connection | None] = list(front_ends) or [control]
        self.prefixed = len(self.front_ends) > 1
        self.owner: dict[str, tuple[int, str]] = {}
        """Engine request id -> (front end, its id), with several front ends."""
        self.poller = select.poll()
        self.by_fd: dict[int, int] = {}
        """A channel's fd -> its front end (-1: the control channel of several front ends)."""
        for i, conn in enumerate(self.front_ends):
            self.by_fd[conn.fileno()] = i
        if self.prefixed:
            self.by_fd[control.fileno()] = -1
        for fd in self.by_fd:
            self.poller.register(fd, select.POLLIN)
        self.server_gone = False
        self.stopped = False

    def take(self, wait_s: float) -> list[Command]:
        """Every command on every channel, waiting up to ``wait_s`` for the first."""
        cmds: list[Command] = []
        timeout_ms = 1000 * wait_s
        while True:
            ready = self.poller.poll(timeout_ms)
            if not ready:
                return cmds
            for fd, _ in ready:
                i = self.by_fd.get(fd)
                if i is None:
                    continue
                conn = self.control if i < 0 else self.front_ends[i]
                try:
                    frame = conn.recv()
                except (EOFError, OSError):
                    self._closed(i, cmds)
                    continue
                if i < 0 or not self.prefixed:
                    cmds.extend(frame)
                    continue
                for cmd in frame:
                    if cmd is STOP:  # a front end stops only itself (its EOF follows)
                        continue
                    engine_id = f"{i}/{cmd.request_id}"
                    if isinstance(cmd, AddCommand):
                        self.owner[engine_id] = (i, cmd.request_id)
                    cmd.request_id = engine_id
                    cmds.append(cmd)
            timeout_ms = 0

    def _closed(self, i: int, cmds: list[Command]) -> None:
        if i < 0 or not self.prefixed:  # whoever started this process is gone
            self.server_gone = True
            cmds.append(STOP)
            self.poller.unregister(self.control.fileno() if i < 0 else self.front_ends[i].fileno())
            self.by_fd = {fd: j for fd, j in self.by_fd.items() if j != i}
            return
        conn = self.front_ends[i]
        self.poller.unregister(conn.fileno())
        del self.by_fd[conn.fileno()]
        conn.close()
        self.front_ends[i] = None
        left = [engine_id for engine_id, (j, _) in self.owner.items() if j == i]
        if left:
            logger.warning("front end %d is gone: its %d request(s) aborted", i, len(left))
        cmds.extend(AbortCommand(engine_id) for engine_id in left)

    def report(self, report: StepReport) -> None:
        """Each front end its part of ``report`` (every live one gets the counters)."""
        if not self.prefixed:
            self._send(0, report)
            return
        num = len(self.front_ends)
        parts = [StepReport() for _ in range(num)]
        owner = self.owner
        tokens, counts, lps = report.update_tokens, report.update_counts, report.update_logprobs
        if counts is None and lps is None:  # a decode step: one token each
            for req_id, token in zip(report.update_ids, tokens):
                i, own_id = owner[req_id]
                parts[i].update_ids.append(own_id)
                parts[i].update_tokens.append(token)
        else:
            for req_id, new_ids, logprobs in report.updates():
                i, own_id = owner[req_id]
                parts[i].add_update(own_id, new_ids, logprobs)
        for fin in report.finished:
            found = owner.pop(fin.request_id, None)
            if found is None:
                continue
            fin.request_id = found[1]
            parts[found[0]].finished.append(fin)
        for i, part in enumerate(parts):
            if self.front_ends[i] is not None:
                part.failure, part.num_steps, part.num_free_blocks = report.failure, report.num_steps, report.num_free_blocks
                part.num_first_uses_after_ready = report.num_first_uses_after_ready
                part.cache_stats, part.time = report.cache_stats, report.time
                self._send(i, part)

    def _send(self, i: int, report: StepReport) -> None:
        try:
            self.front_ends[i].send(report)
        except OSError:  # that front end is gone: its EOF is read next (the last one's stops the loop)
            if not self.prefixed:
                self.stopped = True


def _ignore_signal(signum: int, frame: object) -> None:
    """SIGINT and SIGTERM in the engine process: the server drains it (see the module docstring)."""


def engine_process_main(fds: list[int]) -> int:
    """Run the engine: build it from the resolved config sent on ``fds[0]`` (the control channel;
    used as is, not validated again), then step on the commands of its front ends (``fds[1:]``,
    or the control channel when there are none) until STOP or EOF; returns the exit status."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        # A handler that does nothing, not SIG_IGN: an ignored signal stays ignored in the
        # programs this process starts (stage processes, a local Ray cluster), which must still
        # stop on SIGTERM; a handler is reset to the default in a new program.
        signal.signal(sig, _ignore_signal)
    conn = Connection(fds[0])
    front_end_conns = [Connection(fd) for fd in fds[1:]]
    try:
        resolved, log_level = conn.recv()
    except EOFError:
        return 1
    logging.basicConfig(level=log_level, stream=sys.stderr,
                        format="[%(asctime)s][%(name)s][%(levelname)s] %(message)s")
    from pprun.engine.llm_engine import LLMEngine

    try:
        engine = LLMEngine(resolved, decode_outputs=False)
    except BaseException as e:  # the server raises it: a bad configuration reads as one
        if not isinstance(e, (ValueError, TypeError)):  # not a configuration error: its traceback helps
            logger.exception("engine start-up failed")
        # By type name and message, not pickled: an exception class whose __init__ takes other
        # arguments pickles here and fails to unpickle in the server, hiding the error.
        category = "ValueError" if isinstance(e, ValueError) else "TypeError" if isinstance(e, TypeError) else ""
        conn.send(("error", (category, type(e).__name__, str(e))))
        return 1
    try:
        ready = ("ready", (serving_facts(engine), engine.scheduler.block_manager.num_free_blocks))
        conn.send(ready)
        for fe in front_end_conns:
            fe.send(ready)
        channels = _FrontEnds(conn, front_end_conns)
        loop = EngineLoop(engine, channels.take, report=lambda r: _report(channels, r, loop))
        loop.run()
    finally:
        engine.shutdown()
    if channels.server_gone:
        logger.warning("engine process: the server is gone; stages stopped")
    return 0


def _report(channels: _FrontEnds, report: StepReport, loop: EngineLoop) -> None:
    channels.report(report)
    if channels.stopped:  # the one front end is gone: stop stepping
        loop.stopped = True


if __name__ == "__main__":
    sys.exit(engine_process_main([int(fd) for fd in sys.argv[1:]]))
