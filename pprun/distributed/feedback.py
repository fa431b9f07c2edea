"""Sampled token ids sent from the last pipeline stage straight to the first (async pipeline steps,
``parallel.async_pipeline``).

Without it, a batch's next step can only start once its sampled ids have gone from the last
stage to the engine and the next step's message from the engine to the first stage: a round
trip through the engine per step that the other batches in flight must cover (on two GPUs
longer than several decode steps of the 1.1B model; docs/performance.md, "Pipeline settings").
With it, the engine schedules
a batch's next step while the current one is still in the pipeline (async scheduling, each
request in at most two steps), the first stage takes that step's input ids for the pending
tokens from the last stage's message, and the engine's work on the output is off that loop.

The ids go host to host, also between GPUs: the last stage has them in host memory anyway (its
answer to the engine), and a second NCCL group between the same GPUs is not an independent
channel — a send on the activations' group waited behind a receive outstanding on the other,
which serialised the stages (docs/performance.md, "Hops and the control path").

**They travel on a plain TCP socket between the two stages** where the stages know a host the
first one can listen on (pprun's own executors: the process group's rendezvous host, which is
the first stage's own), else on a gloo group of the two ranks.  That group exists either way;
with the socket it only carries the socket's port, once, at warm-up.  A gloo point-to-point
operation costs several times the socket's host time per message on each end, and on the first
stage posting its receive sits on the step's critical path (docs/performance.md, "pp=2 at small
batches").
``PPRUN_DISABLE_FEEDBACK_SOCKET=1`` on the first stage keeps every message on gloo; the first
stage decides and tells the last one, so the two ends cannot disagree.  A socket that cannot be
opened is an error that names that switch, not a silent change of channel.  Each socket message
carries its number and its count of ids ahead of them: two ends that disagree on what a step
samples get an error, where gloo would have failed on the size, not shifted ids.

One message per step that samples, in step order on both sides (both take the count of
sampled requests from the same ``SchedulerOutput``): the last stage sends its ids when it
builds the step's answer; the first stage notes (socket) or posts (gloo) the matching receive
into a ring slot as soon as it has launched the step, and reads or waits for it only when a
later step's input reads one of those ids.  The ring has a slot per step in flight plus spare
ones (``WorkerSpec.sample_feedback_slots``, from the executor): an id is only read by a step
scheduled while its own step is in flight, so a slot comes round again only after every reader
of it was prepared.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import struct
import time
from collections import deque
from collections.abc import Sequence
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from pprun.distributed import auth
from pprun.distributed.auth import PeerAuthError, authenticate
from pprun.switches import enabled_unless
from pprun.utils.polling import Spinner
from pprun.utils.step_trace import MAX_STEPS

logger = logging.getLogger(__name__)

SOCKET_ENABLED: bool = enabled_unless("PPRUN_DISABLE_FEEDBACK_SOCKET")
"""Whether the first stage opens the socket channel (see the module docstring); read by the
first stage only, which tells the last."""
_HEADER = struct.Struct("=2q")
"""A socket message's header: its number in step order and its count of ids (native int64, as
the first stage reads it into an int64 array)."""
SPIN_ENABLED: bool = enabled_unless("PPRUN_DISABLE_FEEDBACK_SPIN")
"""Whether the first stage polls the socket before a blocking read when given a ``spin_s``
(``PPRUN_DISABLE_FEEDBACK_SPIN=1``: block at once, the A/B switch)."""


class SampleFeedback:
    """The first or last stage's end of the sampled-ids channel (see the module docstring)."""

    def __init__(
        self,
        group: dist.ProcessGroup,
        peer: int,
        is_first: bool,
        max_num_reqs: int,
        num_slots: int,
        host: str | None = None,
        timeout_s: float = 600.0,
        spin_s: float = 0.0,
        authkey: bytes | None = None,
    ) -> None:
        """``host``: where the first stage may listen for the socket channel, the same string on
        both ends (None: gloo only); ``authkey``: the run's secret, with which the two ends of the
        socket authenticate each other before any id is read (None: gloo only); ``timeout_s``: how long a socket read or the connection may
        take before it is an error (the process groups' timeout); ``spin_s``: how long the first
        stage polls the socket for a message before a blocking read (the control path's
        ``pprun.executor.remote.control_spin_s``; 0: block at once)."""
        self.group = group
        self.authkey = authkey
        self.peer = peer
        """``torch.distributed`` rank of the other end (the last stage for the first, and back)."""
        self.is_first = is_first
        self.max_num_reqs = max_num_reqs
        self.host = host
        self.timeout_s = timeout_s
        self.spin_s = spin_s
        self._spinner: Spinner | None = None
        """First stage, socket channel with ``spin_s``: polls the socket before a read.  A thread that blocks
        in a read sleeps until the ids land, and the step's input copy and launch come right
        after: the pipeline's critical path at small batches.  The runner's host work runs
        slower after a blocking wait than after polling, by a share that depends on the host,
        while the pipeline's throughput shows no measurable difference either way
        (docs/performance.md, "pp=2 at small batches")."""
        self.ring = torch.zeros(num_slots, max_num_reqs, dtype=torch.int64)
        self._flat = self.ring.numpy().reshape(-1)
        self._works: list[dist.Work | None] = [None] * num_slots
        self._slot = -1
        self.sock: socket.socket | None = None
        """The socket channel once :meth:`warm_up` opened it; None: gloo."""
        self._unread: deque[tuple[int, int]] = deque()
        """First stage, socket channel: (ring slot, ids) of the messages expected and not yet read,
        in step order."""
        self._num_sent = 0
        self._num_read = 0
        """Socket channel: messages sent (last stage) or read (first stage) so far; each message
        carries its number and its count of ids ahead of them (:data:`_HEADER`), checked on
        reading."""
        self._header = np.empty(2, dtype=np.int64)
        """First stage, socket channel: where a message's header is read (reused)."""
        self.index: dict[str, int] = {}
        """First stage: request id -> where its newest pending sample lands (flat ring index)."""
        prefix = os.environ.get("PPRUN_STEP_TRACE")
        self.trace_path = f"{prefix}.feedback_{'first' if is_first else 'last'}.json" if prefix else None
        self.trace: list[tuple[float, float]] | None = [] if prefix else None
        """With ``PPRUN_STEP_TRACE``: per send (last stage) or per fill (first stage) the host
        clock before and after it (``time.perf_counter``, comparable between the processes of
        one host), written beside the step trace at :meth:`close`; the first ``MAX_STEPS``, as
        the step trace keeps."""

    def _next_slot(self) -> int:
        """The next ring slot, once whatever last used it is complete (a send must have read
        it; a receive is waited on so that the operations never pile up unbounded)."""
        self._slot = (self._slot + 1) % self.ring.shape[0]
        self._wait_slot(self._slot)
        return self._slot

    def _wait_slot(self, slot: int) -> None:
        """Complete the send or receive outstanding on ``slot``, if any (on the socket channel:
        read the messages in order up to the one landing in ``slot``)."""
        work = self._works[slot]
        if work is not None:
            work.wait()
            self._works[slot] = None
        while any(s == slot for s, _ in self._unread):
            self._read_next()

    def _read_next(self) -> None:
        """First stage, socket channel: read the oldest expected message into its ring slot,
        after checking its header (its number in step order and its count of ids)."""
        slot, n = self._unread[0]
        if self._spinner is not None:
            self._spinner.wait()
        header = self._header
        self._recv_exact(memoryview(header).cast("B"))
        if int(header[0]) != self._num_read or int(header[1]) != n:
            raise RuntimeError(
                f"the sampled-ids socket is out of step: message {int(header[0])} with {int(header[1])} ids "
                f"arrived where message {self._num_read} with {n} ids was due (the first and last stage "
                "disagree on what a step samples)"
            )
        base = slot * self.max_num_reqs
        self._recv_exact(memoryview(self._flat[base : base + n]).cast("B"))
        self._num_read += 1
        self._unread.popleft()

    def _recv_exact(self, view: memoryview) -> None:
        """Fill ``view`` from the socket; a closed socket, a read past the timeout or a socket
        error is a RuntimeError that says which."""
        got = 0
        try:
            while got < len(view):
                k = self.sock.recv_into(view[got:])
                if k == 0:
                    raise RuntimeError(
                        f"the last stage (rank {self.peer}) closed the sampled-ids socket with "
                        f"{got} of {len(view)} bytes of a message read"
                    )
                got += k
        except TimeoutError:
            raise RuntimeError(
                f"no sampled ids from the last stage (rank {self.peer}) within {self.timeout_s} s "
                "(the pipeline's stage timeout)"
            ) from None
        except OSError as e:
            raise RuntimeError(f"reading sampled ids from the last stage (rank {self.peer}) failed: {e}") from e

    def warm_up(self) -> None:
        """Open the channel before any step (both ends call it): the first stage tells the last
        the port it listens on (-1: gloo only), and one id goes from the last to the first, so
        the channel is checked before the first step needs it."""
        port = torch.full((1,), -1, dtype=torch.int64)
        listener = None
        if self.is_first and self.host is not None and self.authkey and SOCKET_ENABLED:
            try:
                family, _, _, _, address = socket.getaddrinfo(self.host, 0, type=socket.SOCK_STREAM)[0]
                listener = socket.create_server(address[:2], family=family, backlog=1)
            except OSError as e:
                raise RuntimeError(
                    f"the first stage cannot listen for the sampled-ids socket on {self.host!r}: {e}; "
                    "PPRUN_DISABLE_FEEDBACK_SOCKET=1 keeps the ids on gloo"
                ) from e
            listener.settimeout(self.timeout_s)
            port[0] = listener.getsockname()[1]
        if self.is_first:
            dist.send(port, self.peer, group=self.group)
        else:
            dist.recv(port, self.peer, group=self.group)
        if int(port) >= 0:
            try:
                if listener is not None:
                    self.sock = self._accept_last_stage(listener)
                else:
                    self.sock = socket.create_connection((self.host, int(port)), timeout=self.timeout_s)
                    authenticate(self.sock, self.authkey, server=False)
                self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                self.sock.settimeout(self.timeout_s)
                if self.is_first and self.spin_s > 0 and SPIN_ENABLED:
                    self._spinner = Spinner([self.sock], self.spin_s)
            except OSError as e:  # a stage reports a RuntimeError; an OSError reads as "driver gone"
                if self.sock is not None:
                    self.sock.close()
                    self.sock = None
                end = f"accepting the last stage (rank {self.peer})" if self.is_first else (
                    f"connecting to the first stage (rank {self.peer}) at {self.host}:{int(port)}")
                raise RuntimeError(
                    f"opening the sampled-ids socket failed {end} within {self.timeout_s} s: {e}; "
                    "PPRUN_DISABLE_FEEDBACK_SOCKET=1 keeps the ids on gloo"
                ) from e
            finally:
                if listener is not None:
                    listener.close()
        probe = self.ring[0, :1]
        if self.is_first:
            self.expect(["probe"], torch.zeros(1, dtype=torch.int64), 1)
            self._wait_slot(self._slot)
            self.index.clear()
        else:
            self._send(probe)
            self._wait_slot(self._slot)

    def _accept_last_stage(self, listener: socket.socket) -> socket.socket:
        """First stage: accept connections until one proves it holds the run's key (the last
        stage); a stranger's is closed unread and logged.  Bounded by ``timeout_s`` in all."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError("no authenticated connection from the last stage")
            listener.settimeout(remaining)
            sock, address = listener.accept()
            try:
                authenticate(sock, self.authkey, server=True, timeout_s=min(remaining, auth.HANDSHAKE_TIMEOUT_S))
                return sock
            except PeerAuthError as e:
                logger.warning("sampled-ids socket: refused a connection from %s: %s", address, e)
                sock.close()

    def send(self, sampled_ids: torch.Tensor) -> None:
        """Last stage: send a step's sampled ids (host ``[num_sampled]``, sampling order, ready
        to read) to the first stage; copied into the ring, which outlives the send."""
        t0 = time.perf_counter()
        self._send(sampled_ids)
        self._record(t0)

    def _send(self, sampled_ids: torch.Tensor) -> None:
        """:meth:`send` without the trace (the warm-up's probe uses it too)."""
        slot = self._next_slot()
        buf = self.ring[slot, : sampled_ids.shape[0]]
        buf.copy_(sampled_ids)
        if self.sock is not None:
            try:
                self.sock.sendall(_HEADER.pack(self._num_sent, buf.shape[0]) + buf.numpy().tobytes())
            except OSError as e:  # a timeout too: the first stage stopped reading
                raise RuntimeError(f"sending sampled ids to the first stage (rank {self.peer}) failed: {e}") from e
            self._num_sent += 1
        else:
            self._works[slot] = dist.isend(buf, self.peer, group=self.group)

    def expect(self, req_ids: Sequence[str], sample_batch_idx: torch.Tensor, num_sampled: int) -> None:
        """First stage, right after launching a step that samples ``num_sampled`` requests (batch
        positions ``sample_batch_idx``, read only when not every request samples): post the
        receive of their ids and remember where each request's lands."""
        slot = self._next_slot()
        if self.sock is not None:
            self._unread.append((slot, num_sampled))  # read when a step needs it (fill)
        else:
            self._works[slot] = dist.irecv(self.ring[slot, :num_sampled], self.peer, group=self.group)
        base = slot * self.max_num_reqs
        if num_sampled == len(req_ids):
            self.index.update(zip(req_ids, range(base, base + num_sampled)))
        else:
            self.index.update((req_ids[i], base + j) for j, i in enumerate(sample_batch_idx.tolist()))

    def forget(self, req_id: str) -> None:
        """First stage: drop a finished (or preempted) request's entry."""
        self.index.pop(req_id, None)

    def fill(self, input_ids: np.ndarray, token_idx: np.ndarray, flat_indices: np.ndarray) -> None:
        """First stage: ``input_ids[token_idx] = the ids at flat_indices``, once the receives of
        every slot they come from are complete (blocks the host until the last stage sent them)."""
        t0 = time.perf_counter()
        for slot in np.unique(flat_indices // self.max_num_reqs).tolist():
            self._wait_slot(slot)
        input_ids[token_idx] = self._flat[flat_indices]
        self._record(t0)

    def _record(self, t0: float) -> None:
        """With ``PPRUN_STEP_TRACE``: one call's host clock, from ``t0`` to now."""
        if self.trace is not None and len(self.trace) < MAX_STEPS:
            self.trace.append((t0, time.perf_counter()))

    def close(self, timeout_s: float = 5.0) -> None:
        """Wait (bounded) for the outstanding sends and receives before the group is torn down;
        one that cannot complete any more (the other end is gone) is left behind."""
        if self.trace_path is not None and self.trace:
            try:
                with open(self.trace_path, "w") as f:
                    json.dump({"end": "first" if self.is_first else "last", "calls": self.trace}, f)
            except OSError:
                pass
            self.trace = None
        for i, work in enumerate(self._works):
            if work is not None:
                try:
                    work.wait(timeout=timedelta(seconds=timeout_s))
                except Exception:  # noqa: BLE001 - shutting down: nothing left to report to
                    pass
                self._works[i] = None
        if self.sock is not None:
            self.sock.close()
            self.sock = None
            self._unread.clear()
