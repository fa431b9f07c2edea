"""What a pipeline may leave behind, checked rather than assumed: processes, shared memory,
sockets and temporary directories (the fault tests' "nothing left" check)."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import psutil

LOOPBACK = ("127.0.0.1", "::1", "::ffff:127.0.0.1")


def _ray_listen_ports() -> set[int]:
    """Ports Ray's own processes listen on (its connections are Ray's business, not pprun's)."""
    ports = set()
    for c in psutil.net_connections("inet"):
        if c.status != psutil.CONN_LISTEN or c.pid is None:
            continue
        try:
            cmd = " ".join(psutil.Process(c.pid).cmdline())
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if "ray" in cmd and "pprun.executor.stage_main" not in cmd:
            ports.add(c.laddr.port)
    return ports


def _connections(listeners_before: frozenset[int] = frozenset()) -> set[tuple]:
    """This process's TCP sockets other than its connections to Ray (listening ones included).

    ``listeners_before``: ports this process listened on before the run.  A connection accepted
    on one of them belongs to that listener's owner, which predates the run (Ray's core-worker
    server in a Ray driver, which Ray's own processes connect to and keep): pprun's listeners
    are made by the run itself, so connections to them still count."""
    ray_ports = _ray_listen_ports()
    out = set()
    for c in psutil.Process().net_connections("tcp"):
        if c.raddr and c.raddr.port in ray_ports:
            continue
        if c.raddr and c.laddr.port in listeners_before:
            continue
        if c.status in (psutil.CONN_TIME_WAIT, psutil.CONN_CLOSE):
            continue  # closed by us; the kernel keeps the tuple a while
        out.add((c.status, tuple(c.laddr), tuple(c.raddr) if c.raddr else ()))
    return out


def _children() -> set[int]:
    """Live child processes of this one (recursively), Ray's pooled idle workers left out."""
    pids = set()
    for p in psutil.Process().children(recursive=True):
        try:
            if p.status() == psutil.STATUS_ZOMBIE:
                continue
            cmd = " ".join(p.cmdline())
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if "ray::IDLE" in cmd or "raylet" in cmd or "gcs_server" in cmd or "ray/" in cmd and "StageActor" not in cmd:
            continue
        pids.add(p.pid)
    return pids


@dataclass
class Snapshot:
    """What exists before a pipeline starts; :meth:`left_behind` lists what is new after."""

    children: set[int] = field(default_factory=_children)
    connections: set[tuple] = field(default_factory=_connections)

    @property
    def listeners(self) -> frozenset[int]:
        """Ports this process listened on at the snapshot."""
        return frozenset(c[1][1] for c in self.connections if c[0] == psutil.CONN_LISTEN)

    def new_sockets(self) -> list[tuple]:
        """This process's TCP sockets made since the snapshot (Ray's left out)."""
        return sorted(_connections(self.listeners) - self.connections)

    def left_behind(
        self, stage_pids: list[int | None] = (), temp_dirs: list[str | None] = (), within_s: float = 15.0
    ) -> list[str]:
        """Everything started since the snapshot that is still there after ``within_s``: child
        processes, stage processes, TCP sockets of this process, the given temporary directories
        (the executor's own: other runs on the machine make theirs), and shared-memory segments
        named after this process or a stage."""
        deadline = time.monotonic() + within_s
        while True:
            found = self._new(stage_pids) + [f"temp dir {d}" for d in temp_dirs if d and os.path.exists(d)]
            if not found or time.monotonic() > deadline:
                return found
            time.sleep(0.2)

    def _new(self, stage_pids) -> list[str]:
        found = [f"child process {pid}" for pid in sorted(_children() - self.children)]
        for pid in stage_pids:
            if pid is not None and psutil.pid_exists(pid):
                try:
                    if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                        found.append(f"stage process {pid}")
                except psutil.NoSuchProcess:
                    pass
        found += [f"socket {c}" for c in self.new_sockets()]
        pids = {str(os.getpid())} | {str(p) for p in stage_pids if p is not None}
        try:
            shm = os.listdir("/dev/shm")
        except OSError:
            shm = []
        found += [f"/dev/shm/{n}" for n in shm if any(pid in n.split("_") for pid in pids)]
        return found


def listening_addresses(pid: int) -> list[str]:
    """The addresses process ``pid`` listens on (TCP)."""
    return [c.laddr.ip for c in psutil.Process(pid).net_connections("tcp") if c.status == psutil.CONN_LISTEN]


def job_left_behind(pids: list[int], ports: list[int], tmpdir: str | None = None, within_s: float = 15.0) -> list[str]:
    """What a finished job of other processes (torchrun's ranks, a killed driver's stages) left
    behind after ``within_s``: any of ``pids`` still alive, a socket listening or connected on one
    of ``ports`` (the job's own: its store, its ranks' sockets) held by one of them or by no
    process, a shared-memory segment named after one of them, and any file in ``tmpdir`` (the
    job's private temporary directory)."""
    deadline = time.monotonic() + within_s
    pid_set, port_set = set(pids), set(ports)
    while True:
        found = []
        for pid in pids:
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    found.append(f"process {pid}")
            except psutil.NoSuchProcess:
                pass
        for c in psutil.net_connections("tcp"):
            if c.laddr and c.laddr.port in port_set and c.status in (psutil.CONN_LISTEN, psutil.CONN_ESTABLISHED):
                if c.pid is None or c.pid in pid_set:
                    found.append(f"socket {c.status} {tuple(c.laddr)} of process {c.pid}")
        try:
            shm = os.listdir("/dev/shm")
        except OSError:
            shm = []
        found += [f"/dev/shm/{n}" for n in shm if any(str(pid) in n.split("_") for pid in pids)]
        if tmpdir is not None:
            found += [f"temp file {os.path.join(tmpdir, n)}" for n in os.listdir(tmpdir)]
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.2)
