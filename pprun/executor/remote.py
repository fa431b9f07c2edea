"""Stages in other processes (``mp`` and ``ray``): the worker loop and the driver's control path.

Control path: the driver opens one authenticated socket per stage
(``multiprocessing.connection``).  Each step it pickles the SchedulerOutput once and writes the
same bytes to every stage; the last stage writes the ModelRunnerOutput back.  No Ray call sits
on the per-step path: Ray only places and starts the stage processes.  A stage that raises sends
its traceback; a stage that dies closes its socket; a stage that hangs trips the stage timeout.
Each of these becomes a :class:`StageFailedError` at the caller, and the driver then stops
every stage process.  With stages on GPUs, readers poll their sockets briefly before blocking
where the host has cores to spare (:func:`control_spin_s`, ``parallel.control_spin_us``).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import shutil
import socket
import time
import traceback
from collections import deque
from multiprocessing.connection import Client, Connection, Listener, wait
from typing import TYPE_CHECKING

from pprun.config.validate import CONTROL_SPIN_MAX_US, ResolvedConfig
from pprun.core.outputs import ModelRunnerOutput, SchedulerOutput
from pprun.distributed.auth import accept_authenticated, new_key
from pprun.executor.base import Executor, StageFailedError
from pprun.switches import enabled_unless
from pprun.utils.polling import Spinner
from pprun.worker.runner_base import PendingOutput, resolve

if TYPE_CHECKING:  # the stage module (torch, the models) is imported only where a stage runs
    from pprun.worker.worker import WorkerSpec

logger = logging.getLogger(__name__)


def set_nodelay(conn: Connection) -> None:
    """Turn Nagle's algorithm off on a control socket.

    The driver writes a small step message to every stage each step, and only the last stage
    writes back: a first stage's socket carries no replies for ACKs to ride on, so the kernel
    delays them (40 ms on Linux) and Nagle holds the driver's next message until one comes: a
    40 ms stall of the whole pipeline every few dozen steps.
    """
    try:
        with socket.fromfd(conn.fileno(), socket.AF_INET, socket.SOCK_STREAM) as sock:  # a dup of the fd
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    except OSError:
        pass  # not a TCP socket (nothing to do)


EARLY_ANSWER: bool = enabled_unless("PPRUN_DISABLE_EARLY_ANSWER")
"""Whether the last stage answers a step the device has finished before launching the next one
(``PPRUN_DISABLE_EARLY_ANSWER=1``: always launch first, the A/B switch of ``serve_steps``)."""


SPIN_ENV = "PPRUN_CONTROL_SPIN_US"
"""Overrides ``parallel.control_spin_us`` when set (see :func:`control_spin_s`)."""
SPIN_MAX_US = CONTROL_SPIN_MAX_US
"""Largest budget accepted, in microseconds (0.1 s of polling per wait)."""


def control_spin_s(num_processes: int, device: str, configured_us: int | None = None) -> float:
    """How long a control-socket reader polls before it blocks, in seconds (the driver decides;
    the stages get it in their ``WorkerSpec``).

    A process blocked in a socket read is woken by the kernel when the bytes land, which on
    GPU hosts (virtual machines, idle cores in deep sleep) costs tens of microseconds per wake,
    twice per step (driver -> stage, stage -> driver).  Polling first keeps the reader on its
    core.  By default it polls up to 1 ms with stages on GPUs on a host with at least two cores
    for each of the ``num_processes`` processes of the pipeline (driver and stages); never with
    stages on CPUs, whose computation needs the cores.  ``configured_us``
    (``parallel.control_spin_us``, validated) sets the budget in microseconds (0: never poll), and
    ``PPRUN_CONTROL_SPIN_US``, when set, overrides it (at most :data:`SPIN_MAX_US`).
    """
    text = os.environ.get(SPIN_ENV)
    if text is not None and text.strip() != "":
        try:
            us = int(text)
        except ValueError:
            us = -1
        if not 0 <= us <= SPIN_MAX_US:
            raise ValueError(
                f"{SPIN_ENV}={text!r} is invalid: expected a whole number of microseconds from 0 to {SPIN_MAX_US}"
            )
        return us * 1e-6
    if configured_us is not None:
        return configured_us * 1e-6
    if device != "cuda":
        return 0.0
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return 1e-3 if cores >= 2 * num_processes else 0.0


def _finished(out) -> bool:
    return EARLY_ANSWER and (not isinstance(out, PendingOutput) or out.done())


def serve_steps(conn: Connection, worker, spin_s: float = 0.0) -> None:
    """A stage's loop over the driver's messages until ``shutdown``: steps, and calls between
    steps (``Worker`` methods, answered with their result).  Only the last stage answers steps.
    ``spin_s``: how long to poll for the next message before blocking (:func:`control_spin_s`)."""
    spinner = Spinner([conn], spin_s) if spin_s > 0 else None

    def send_output(out) -> None:
        out = resolve(out)
        conn.send_bytes(pickle.dumps(("output", out), protocol=pickle.HIGHEST_PROTOCOL))

    # The last stage's newest step, launched on the GPU but not answered: when the next
    # step's message is already here and launching it is quick (a full-graph replay), it is
    # launched before this one's sampled ids are awaited, so the device does not idle while
    # the host prepares it — unless the device has already finished it: then the answer goes
    # first, since the engine's next step for those requests waits on it.  Outputs keep step
    # order; one that is already complete (CPU, V1, logprobs read back) is sent at once.
    pending = None
    while True:
        if pending is not None and not conn.poll():
            send_output(pending)
            pending = None
        if spinner is not None:
            spinner.wait()
        kind, *args = conn.recv()
        if kind == "step":
            so = args[0]
            # An eager step's host work takes milliseconds; a finished one costs no wait.
            if pending is not None and (_finished(pending) or not worker.launches_quickly(so)):
                send_output(pending)
                pending = None
            out = worker.execute_model(so, wait=False)
            if pending is not None:
                send_output(pending)
                pending = None
            if out is not None:
                if not isinstance(out, PendingOutput) or out.ready:
                    send_output(out)
                else:
                    pending = out
            continue
        if pending is not None:
            send_output(pending)
            pending = None
        if kind == "call":
            name, kwargs = args
            conn.send(("result", getattr(worker, name)(**kwargs)))
        elif kind == "shutdown":
            break


def worker_main(address: tuple[str, int], authkey: bytes, rank: int, spec: WorkerSpec | None = None) -> None:
    """Body of a worker process (one tp rank of one stage; ``rank``: its global rank): connect to
    the driver, build the stage, serve steps.

    ``spec`` (a WorkerSpec) is passed directly by Ray; a plain child process gets it as the
    driver's first message.
    """
    from pprun.worker.worker import Worker

    conn = Client(address, authkey=authkey)  # HMAC challenge-response both ways before any read
    set_nodelay(conn)
    conn.send(("hello", rank, os.getpid()))
    if spec is None:
        kind, spec = conn.recv()
    # Before torch.distributed starts: gloo/NCCL on loopback when every stage is on this host.
    os.environ.update(spec.env)
    spec = dataclasses.replace(spec, authkey=authkey)  # the sampled-ids socket authenticates with it
    logging.basicConfig(level=spec.resolved.cfg.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    worker = None
    driver_gone = False
    profile_path = os.environ.get("PPRUN_STAGE_PROFILE")  # cProfile of the whole stage process
    profiler = None
    if profile_path:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    try:
        worker = Worker(spec)
        n_params = worker.load_model()
        conn.send(("loaded", n_params, worker.num_available_blocks(), worker.num_cross_slots,
                   worker.num_sms))  # fmt: skip
        serve_steps(conn, worker, spec.control_spin_s)
    except (EOFError, OSError):
        driver_gone = True  # nothing to report to
    except BaseException:
        try:
            conn.send(("error", rank, traceback.format_exc()))
        except OSError:
            pass
    finally:
        if profiler is not None:
            profiler.disable()
            try:
                profiler.dump_stats(f"{profile_path}.stage{rank}.prof")  # rank: the global rank
            except OSError as e:
                logging.getLogger(__name__).warning("PPRUN_STAGE_PROFILE: cannot write the profile: %s", e)
        if worker is not None:
            try:
                worker.shutdown()
            except Exception:
                pass
        if driver_gone:
            remove_local_rendezvous(spec.init_method)


RENDEZVOUS_PREFIX = "pprun-rdzv-"
"""Name prefix of the private directory holding a ``file://`` rendezvous (:meth:`RemoteStagesExecutor._local_rendezvous`)."""


def remove_local_rendezvous(init_method: str | None) -> None:
    """Remove the private rendezvous directory of a ``file://`` ``init_method``.

    The driver removes it once every stage has joined the process groups; a driver killed
    before that cannot, so each stage that sees its driver gone removes it on the way out (the
    other stage, if still inside the store, fails its next store operation: it is going down
    too)."""
    if not init_method or not init_method.startswith("file://"):
        return
    directory = os.path.dirname(init_method[len("file://") :])
    if os.path.basename(directory).startswith(RENDEZVOUS_PREFIX):
        shutil.rmtree(directory, ignore_errors=True)


class RemoteStagesExecutor(Executor):
    """Driver side of stages living in other processes; subclasses start the processes."""

    max_in_flight = 1
    submits_async = True
    """``submit`` only writes the step to the stages' sockets (the engine may submit before
    its bookkeeping: ``LLMEngine.step``)."""

    def __init__(self, resolved: ResolvedConfig, timeout_s: float, runner: str = "v1") -> None:
        self.resolved = resolved
        self.timeout_s = timeout_s
        self.pp_size = len(resolved.layer_partition)
        self.tp_size = resolved.cfg.parallel.tensor_parallel_size
        self.num_workers = self.pp_size * self.tp_size
        """Worker processes: tp per stage, global rank ``pp_rank * tp + tp_rank`` (each has its own
        control socket and gets every step's message; only the last stage's tp rank 0 answers)."""
        self.answer_rank = (self.pp_size - 1) * self.tp_size
        """The worker that samples and answers each step: the last stage's tp rank 0."""
        batches = resolved.cfg.parallel.microbatches or self.pp_size
        wanted = resolved.cfg.parallel.async_pipeline
        # By default only on GPUs: there the stages' hosts only launch work and a batch's round
        # trip through the engine leaves the devices idle; on CPU the stages compute on their
        # hosts, which the extra channel's work competes with, and nothing idles to hide.
        self.async_steps = (
            runner == "v2" and self.pp_size > 1 and self.tp_size == 1 and (wanted is True or (wanted is None and resolved.device == "cuda"))
        )
        """Async pipeline steps: each batch's next step is submitted while its current one is in
        the pipeline, its input ids sent by the last stage to the first (``WorkerSpec.
        sample_feedback_slots``): two steps per batch in flight, and the engine off the loop."""
        self.max_in_flight = 2 * batches if self.async_steps else batches
        # A step's ids are read only by a step submitted while it is in flight: one ring slot per
        # step in flight, and spares.
        self.sample_feedback_slots = self.max_in_flight + 2 if self.async_steps else 0
        self.authkey = new_key()
        """The run's secret: control connections and the sampled-ids socket authenticate with it."""
        self.rendezvous_dir: str | None = None
        """Private directory of a file rendezvous (stages on this host only), removed once every
        stage has joined the process groups (and at shutdown, should start-up fail first)."""
        self.conns: list[Connection | None] = [None] * self.num_workers
        self.pending: deque[int] = deque()
        self.inbox: list[deque[tuple]] = [deque() for _ in range(self.num_workers)]
        self.dead = False
        self.stage_params: list[int] = []
        self.stage_pids: list[int | None] = [None] * self.num_workers
        """Process id of each worker by global rank (reported by the worker itself)."""
        self.spin_s = control_spin_s(self.num_workers + 1, resolved.device, resolved.cfg.parallel.control_spin_us)
        """How long a wait for a stage's message polls before blocking (:func:`control_spin_s`)."""
        self._spinner: Spinner | None = None

    # --- start-up ------------------------------------------------------------------------------

    def _listen(self, host: str) -> Listener:
        # No authkey here: _accept_all runs the same challenge-response itself, bounded in time,
        # so that a stranger's connection is dropped instead of failing or stalling start-up.
        # A backlog beyond the stages: connections wait there until accepted one by one.
        return Listener((host, 0), backlog=max(16, 2 * self.num_workers))

    def _accept_all(self, listener: Listener, specs: list[WorkerSpec] | None = None) -> None:
        """Accept one authenticated connection per worker (bounded by the timeout), keyed by global
        rank; a connection that fails the handshake is dropped and the stages still get in.

        With ``specs``, each stage is sent its WorkerSpec once it connects.
        """
        deadline = time.monotonic() + max(self.timeout_s, 120.0)
        listener._listener._socket.settimeout(1.0)  # poll so a stage that never starts is seen
        while any(c is None for c in self.conns):
            try:
                conn = accept_authenticated(listener, self.authkey)
            except TimeoutError:
                conn = None
            if conn is None:
                self._check_alive()
                if time.monotonic() > deadline:
                    raise StageFailedError("pipeline stages did not connect in time") from None
                continue
            set_nodelay(conn)
            kind, rank, pid = conn.recv()
            self.conns[rank] = conn
            self.stage_pids[rank] = pid
            if specs is not None:
                conn.send(("spec", specs[rank]))
            logger.debug("%s connected (pid %d)", self.worker_name(rank), pid)
        listener.close()

    def worker_name(self, rank: int) -> str:
        """How messages name the worker of global rank ``rank``: ``stage 1``, or ``stage 1 tp rank
        0`` with tensor parallelism."""
        if self.tp_size == 1:
            return f"stage {rank}"
        return f"stage {rank // self.tp_size} tp rank {rank % self.tp_size}"

    def _gather(self, expect: str) -> list[tuple]:
        """Wait for one ``expect`` message from every worker (by global rank)."""
        return [self._recv(rank, expect, self.timeout_s + 600.0) for rank in range(self.num_workers)]

    def _recv(self, rank: int, expect: str, timeout_s: float) -> tuple:
        """Next message of stage ``rank``; meanwhile any stage's error or death fails fast."""
        deadline = time.monotonic() + timeout_s
        while not self.inbox[rank]:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self._fail(f"{self.worker_name(rank)} sent nothing for {timeout_s:.0f}s (waiting for {expect})")
            if self._spinner is not None and self._spinner.wait(remaining):
                self._poll(0)
            else:
                self._poll(min(remaining, 1.0))
        msg = self.inbox[rank].popleft()
        if msg[0] != expect:
            self._fail(f"{self.worker_name(rank)} sent {msg[0]!r}, expected {expect!r}")
        return msg

    def _poll(self, timeout_s: float) -> None:
        """Read whatever the stages sent into their inboxes; errors and deaths fail here."""
        live = [c for c in self.conns if c is not None]
        ready = wait(live, timeout=timeout_s)
        for conn in ready:
            rank = self.conns.index(conn)
            try:
                msg = pickle.loads(conn.recv_bytes())
            except (EOFError, OSError):
                self._fail(f"{self.worker_name(rank)} died (its process exited or was killed)")
            if msg[0] == "error":
                self._fail_with_error(rank, msg)
            self.inbox[rank].append(msg)
        if not ready:
            self._check_alive()

    def _fail_with_error(self, rank: int, msg: tuple) -> None:
        """Fail with stage ``rank``'s error message (its traceback)."""
        # A stage's error is often the echo of a neighbour's death (a broken pipe in its send);
        # name the dead stage first when there is one.
        dead = self._dead_stages(exclude=rank)
        cause = f"{dead}; then " if dead else ""
        self._fail(f"{cause}{self.worker_name(msg[1])} raised:\n{msg[2]}")

    def _fail_with_unread_error(self) -> None:
        """Fail with an error a stage sent that is not read yet, if there is one: a stage that
        raised sends its traceback and exits, so a write to it may find its socket closed before
        the driver has read why."""
        for rank, conn in enumerate(self.conns):
            if conn is None:
                continue
            try:
                while conn.poll(0):
                    msg = pickle.loads(conn.recv_bytes())
                    if msg[0] == "error":
                        self._fail_with_error(rank, msg)
                    self.inbox[rank].append(msg)
            except (EOFError, OSError):
                continue

    def _fail(self, why: str) -> None:
        self.dead = True
        self.shutdown(graceful=False)
        raise StageFailedError(why)

    def _check_alive(self) -> None:
        """Raise via ``_fail`` when a stage process is gone."""
        dead = self._dead_stages()
        if dead:
            self._fail(dead)

    def _dead_stages(self, exclude: int | None = None, grace_s: float = 0.5) -> str:
        """Describe stages whose process is gone ("" if none); waits up to ``grace_s`` for a
        death that is still being noticed.

        With ``exclude`` (the stage whose error just arrived) only stages that crashed or were
        killed count: a stage that exited cleanly did so after reporting an error of its own
        (the echo of this one), and naming it as the dead one would blame the wrong stage."""
        deadline = time.monotonic() + grace_s
        while True:
            dead = [why for rank, why in self._stage_exits(crashed_only=exclude is not None) if rank != exclude]
            if dead or time.monotonic() >= deadline or exclude is None:
                return "; ".join(dead)
            time.sleep(0.05)

    def _stage_exits(self, crashed_only: bool = False) -> list[tuple[int, str]]:
        """Subclasses: ``(rank, why)`` for each stage whose process has exited (``crashed_only``:
        leave out those that exited cleanly, code 0 or a normal return)."""
        return []

    def _setup_stages(self) -> None:
        if self.spin_s > 0:
            self._spinner = Spinner(self.conns, self.spin_s)
        loaded = self._gather("loaded")
        if self.rendezvous_dir is not None:
            # Every stage has joined every process group (before loading its model), and the
            # file store is not read after that: it goes now rather than at shutdown, which a
            # killed driver never reaches (Ray may end its stages before they notice and
            # remove it themselves).
            shutil.rmtree(self.rendezvous_dir, ignore_errors=True)
        # A stage's parameters are its tp ranks' together (each rank holds its shards and the
        # tensors it keeps whole).
        self.stage_params = [sum(m[1] for m in loaded[pp * self.tp_size : (pp + 1) * self.tp_size]) for pp in range(self.pp_size)]
        self.num_blocks = min(m[2] for m in loaded)
        self.stage_sms = tuple(sorted({m[4] for m in loaded if m[4]}))
        if loaded[0][3] is not None:
            self.num_cross_slots = min(m[3] for m in loaded)

    def init_cache(self, num_blocks: int) -> None:
        """Allocate the same number of KV blocks on every stage."""
        self.num_blocks = num_blocks
        for conn in self.conns:
            conn.send(("call", "init_cache", {"num_blocks": num_blocks}))
        self._gather("result")

    def call_all(self, name: str, **kwargs) -> list:
        """Call a Worker method on every worker between steps (diagnostics, memory stats); the
        results by global rank (one per stage at tp = 1)."""
        for conn in self.conns:
            conn.send(("call", name, kwargs))
        return [m[1] for m in self._gather("result")]

    def mark_ready(self) -> None:
        """Every stage's first-use record counts from now on."""
        self.call_all("mark_ready")

    def first_use_snapshots(self) -> list[dict]:
        """Every stage's first-use counts."""
        return self.call_all("first_use_snapshot")

    # --- per step ------------------------------------------------------------------------------

    def submit(self, so: SchedulerOutput) -> None:
        """Write the step to every stage without waiting."""
        if self.dead:
            raise StageFailedError("the pipeline has failed; start a new LLM")
        data = pickle.dumps(("step", so), protocol=pickle.HIGHEST_PROTOCOL)
        # Multimodal tensors (pixels, audio features) go to the first stage only.
        rest = pickle.dumps(("step", so.without_payload()), protocol=pickle.HIGHEST_PROTOCOL) if so.has_payload() else data
        for rank, conn in enumerate(self.conns):
            try:
                conn.send_bytes(data if rank < self.tp_size else rest)
            except OSError:
                self._fail_with_unread_error()
                self._fail(f"{self.worker_name(rank)} died (its control socket is closed)")
        self.pending.append(so.step_id)

    def get_output(self) -> ModelRunnerOutput:
        """The oldest outstanding step's output from the last stage."""
        step_id = self.pending.popleft()
        try:
            msg = self._recv(self.answer_rank, "output", self.timeout_s)
        except StageFailedError:
            raise
        except BaseException:
            # Interrupted mid-read (Ctrl-C): the socket stream may be cut inside a message, so
            # the pipeline cannot be trusted any more; stop it and let the interrupt through.
            self.dead = True
            self.shutdown(graceful=False)
            raise
        out: ModelRunnerOutput = msg[1]
        if out.step_id != step_id:
            self._fail(f"last stage answered step {out.step_id}, expected {step_id}")
        return out

    def shutdown(self, graceful: bool = True) -> None:
        """Ask every stage to stop, then make sure it has (subclasses kill what lingers).

        After a failure (``graceful=False``) the survivors are killed at once: they may be
        blocked in a receive from the dead stage.
        """
        for conn in self.conns:
            if conn is None:
                continue
            try:
                conn.send(("shutdown",))
            except OSError:
                pass
        self._spinner = None
        self._stop_processes(grace_s=5.0 if graceful else 0.0)
        for conn in self.conns:
            if conn is not None:
                conn.close()
        self.conns = [None] * self.num_workers
        if self.rendezvous_dir is not None:
            shutil.rmtree(self.rendezvous_dir, ignore_errors=True)
            self.rendezvous_dir = None

    def _local_rendezvous(self) -> str:
        """A ``file://`` rendezvous in a private temporary directory, for stages that all run on
        this host: no TCP store, which would listen on every interface."""
        import tempfile

        self.rendezvous_dir = tempfile.mkdtemp(prefix=RENDEZVOUS_PREFIX)  # mode 0700
        return f"file://{os.path.join(self.rendezvous_dir, 'store')}"

    def _stop_processes(self, grace_s: float) -> None:
        """Subclasses: wait up to ``grace_s`` for the stage processes to exit, then kill them."""
