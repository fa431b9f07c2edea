"""The engine in a process of its own: :class:`EngineProcess` (the server's side) and the engine
process's main loop (``python -m pprun.engine.engine_process FD``).

A server that steps the model in its own process is bound by one interpreter lock: the engine
loop's Python per step and the gRPC event loop's per response take turns.  Here the engine process
only adds requests (token ids and ``SamplingParams``, validated by the server), aborts them, steps
the :class:`~pprun.engine.llm_engine.LLMEngine` and sends, per step, one
:class:`~pprun.engine.engine_loop.StepReport`: every updated request's new token ids (logprobs
when asked; finish reason, stop reason and timings when it ends) and the engine's counters.  The
server process keeps everything else: gRPC, validation, tokenizing, chat templates, incremental
detokenizing, stop-string hold-back, the streams (:class:`~pprun.engine.async_engine.EngineClient`).

Transport: a socket pair made by the server; the child inherits its end (``pass_fds``) and nothing
listens, so no other process can connect, and what is unpickled on either side comes from the one
peer that was started with it.  Messages are ``multiprocessing.connection`` frames of pickled
commands and reports.  The server reads reports on a thread that waits in ``recv`` outside the
interpreter lock and turns each step's report into deltas, handed to the event loop with one
``call_soon_threadsafe``.

The engine process ignores SIGINT and SIGTERM (the server drains it: a Ctrl-C or a SIGTERM sent to
the process group must not end it under running streams) and exits when its socket reaches EOF, so
it never outlives the server, however the server ends; the stages it started go with it.  When it
dies, the server sees EOF: every stream ends with an error and health turns NOT_SERVING.
"""

from __future__ import annotations

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
from pprun.engine.engine_loop import STOP, Command, EngineLoop, StepReport, serving_facts
from pprun.engine.inputs import InputProcessor
from pprun.engine.resolve import resolve_config
from pprun.utils.startup import freeze_startup_objects

logger = logging.getLogger("pprun.engine.engine_process")  # by name: the engine process runs this module as __main__

SOCKET_BUFFER_BYTES = 4 * 2**20
"""Send and receive buffer asked for each end of the socket pair (the kernel caps it at
``net.core.wmem_max``/``rmem_max``): a burst of requests (or a step's report) is written without
waiting for the reader (the server's sends run on its event loop)."""


class EngineProcess(EngineClient):
    """An :class:`~pprun.engine.llm_engine.LLMEngine` in a child process, with the interface of
    :class:`~pprun.engine.async_engine.AsyncEngine`.

    ``config`` is resolved here, before the child starts (a bad configuration's ValueError comes
    from this process); built once the child's engine has started (stages up, KV cache
    allocated); raises what the child's ``LLMEngine`` raised (a ValueError, with its message) or
    RuntimeError when the child exits during start-up.  ``num_steps`` and ``num_free_blocks`` are
    the engine's as of its last report (sent after every step, and after an abort that needed no
    step): an idle engine's are current.
    """

    def __init__(self, config: PprunConfig | ResolvedConfig, *, max_queued_requests: int = 1024) -> None:
        # The run's one validation, in the server process: the engine process builds its engine
        # from the resolved config it is sent, and this process's checks use the same one.
        resolved = resolve_config(config)
        max_unfinished = max_unfinished_requests(resolved.cfg, max_queued_requests)
        cfg = resolved.cfg
        self.cfg = cfg
        ours, theirs = socket.socketpair()
        for sock in (ours, theirs):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER_BYTES)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER_BYTES)
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "pprun.engine.engine_process", str(theirs.fileno())],
            pass_fds=[theirs.fileno()],
            stdin=subprocess.DEVNULL,
            stdout=2,  # the server's stdout carries its one "serving" line; the engine's output is log
        )
        theirs.close()
        self._conn = Connection(ours.detach())
        self._send_lock = threading.Lock()
        """Callers send from several threads (handlers, the drain); a frame must not interleave."""
        self._stopping = False
        try:
            self._conn.send((resolved, logging.getLogger().getEffectiveLevel()))
            # The server's own tokenizer and checks load while the child builds its engine.
            inputs = InputProcessor.for_config(resolved)
            ready = self._recv_ready()
        except BaseException:
            self._kill()
            raise
        self._facts, self._num_free_blocks = ready
        self._cache_stats = PrefixCacheStats(enabled=bool(self._facts.get("prefix_caching"))).as_dict()
        self._num_steps = 0
        super().__init__(inputs, max_unfinished)
        logger.info("engine process %d started", self._proc.pid)
        freeze_startup_objects()  # the server's start-up objects (tokenizer, torch) out of the GC's walks
        self._reader = threading.Thread(target=self._read, name="pprun-engine-reader", daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int:
        """The engine process's id."""
        return self._proc.pid

    def _recv_ready(self) -> tuple[dict, int]:
        try:
            kind, payload = self._conn.recv()
        except (EOFError, OSError):
            code = self._proc.wait()
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

    # --- EngineClient -----------------------------------------------------------------------------

    @property
    def num_steps(self) -> int:
        """Steps the engine had submitted at its last report."""
        return self._num_steps

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
        try:
            with self._send_lock:
                self._conn.send(cmd)
        except OSError:  # the engine process is gone: the reader ends every stream
            pass

    def _on_report(self, report: StepReport) -> None:
        self._num_steps, self._num_free_blocks = report.num_steps, report.num_free_blocks
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
        try:
            code = self._proc.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            code = None
        why = f"the engine process exited (exit code {code})"
        logger.error("%s: every running request ends with an error", why)
        self._fail(why, [])

    def _stop_engine(self) -> None:
        self._stopping = True
        self._send(STOP)
        try:
            self._proc.wait(timeout=max(10.0, self.cfg.parallel.stage_timeout_s + 10))
        except subprocess.TimeoutExpired:
            logger.warning("engine process %d did not stop: killed", self._proc.pid)
            self._proc.kill()
            self._proc.wait()
        self._reader.join(timeout=10.0)  # the child's exit is the reader's EOF
        self._conn.close()
        gc.unfreeze()  # the caller's objects frozen at start-up are collectable again

    def _kill(self) -> None:
        if self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()
        self._conn.close()


# --- the engine process ---------------------------------------------------------------------------


class _SocketCommands:
    """The engine loop's ``take``: every command on the socket, waiting up to ``wait_s`` for the
    first; EOF (the server is gone) is a STOP and sets :attr:`server_gone`."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.poller = select.poll()
        self.poller.register(conn.fileno(), select.POLLIN)
        self.server_gone = False

    def __call__(self, wait_s: float) -> list[Command]:
        cmds: list[Command] = []
        timeout_ms = 1000 * wait_s
        while self.poller.poll(timeout_ms):
            try:
                cmds.append(self.conn.recv())
            except (EOFError, OSError):
                self.server_gone = True
                cmds.append(STOP)
                break
            timeout_ms = 0
        return cmds


def _ignore_signal(signum: int, frame: object) -> None:
    """SIGINT and SIGTERM in the engine process: the server drains it (see the module docstring)."""


def engine_process_main(fd: int) -> int:
    """Run the engine on socket ``fd``: build it from the resolved config the server sends (used
    as is, not validated again), then step on its commands until STOP or EOF; returns the exit
    status."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        # A handler that does nothing, not SIG_IGN: an ignored signal stays ignored in the
        # programs this process starts (stage processes, a local Ray cluster), which must still
        # stop on SIGTERM; a handler is reset to the default in a new program.
        signal.signal(sig, _ignore_signal)
    conn = Connection(fd)
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
        conn.send(("ready", (serving_facts(engine), engine.scheduler.block_manager.num_free_blocks)))
        commands = _SocketCommands(conn)
        loop = EngineLoop(engine, commands, report=lambda r: _send_report(conn, r, loop))
        loop.run()
    finally:
        engine.shutdown()
    if commands.server_gone:
        logger.warning("engine process: the server is gone; stages stopped")
    return 0


def _send_report(conn: Connection, report: StepReport, loop: EngineLoop) -> None:
    try:
        conn.send(report)
    except OSError:  # the server is gone: stop stepping
        loop.stopped = True


if __name__ == "__main__":
    sys.exit(engine_process_main(int(sys.argv[1])))
