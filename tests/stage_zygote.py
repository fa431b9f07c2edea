"""Warm stage processes for the random-fault harness: ``mp`` stages forked from a template process.

An ``mp`` stage is a fresh interpreter (``python -m pprun.executor.stage_main``) that spends about
4.5 s of CPU importing torch before it runs anything: the harness, which starts one pipeline per
fault, would spend most of its time there.  :class:`Zygote` is one process that has made those
imports already and forks a stage on request; :func:`use_zygote` makes the ``mp`` executor start
its stages through it instead of ``subprocess.Popen``.  From the fork on, a stage runs exactly what
``stage_main`` runs (``worker_main`` with the driver's address, rank, environment and key), and
the driver watches, kills and reaps it through the same ``poll``/``wait``/``kill`` calls, so
everything the faults exercise (the stage's steps, its death or silence, the driver's detection
and clean-up) is the product's code.  The fresh-interpreter start itself is the fault matrix's
business (``tests/test_faults.py``, ``tests/test_pipeline.py``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import types

from child_process import close_child

TEMPLATE = r"""
import json, os, select, signal, sys, traceback

# What a stage imports before its first step: torch and pprun's stage code, the model loader
# and its models, both runners, and sympy (imported by ``to_empty`` of a model built on the meta
# device, as Whisper's still is; ``pprun.models.base.allocate`` does not).
import gc
import pprun.attention.ref_ops, pprun.executor.remote, pprun.models.checkpoint, pprun.worker.encoder_decoder  # noqa: E401
import pprun.worker.kv_cache, pprun.worker.model_loader, pprun.worker.v1.runner, pprun.worker.v2.runner  # noqa: E401
import pprun.worker.worker  # noqa: F401
import torch.distributed
import torch.fx.experimental.symbolic_shapes  # noqa: F401

# The stages freeze their start-up objects (pprun.utils.startup): what is frozen here already
# is not walked again in each of them.
gc.collect()
gc.freeze()

out_fd = os.dup(1)
os.dup2(2, 1)  # the stages' own output goes where the template's errors go
wake_r, wake_w = os.pipe()
os.set_blocking(wake_w, False)
signal.set_wakeup_fd(wake_w)
signal.signal(signal.SIGCHLD, lambda *_: None)


def say(line):
    os.write(out_fd, (line + "\n").encode())


def stage(cmd):
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for fd in (wake_r, wake_w, out_fd):
        os.close(fd)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    os.environ.clear()
    os.environ.update(cmd["env"])
    host, port, rank = cmd["argv"][-3:]
    code = 0
    try:
        pprun.executor.remote.worker_main((host, int(port)), bytes.fromhex(os.environ.pop("PPRUN_AUTHKEY")), int(rank))
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


say("ready")
buf = b""
while True:
    try:
        ready, _, _ = select.select([0, wake_r], [], [])
    except InterruptedError:
        continue
    if wake_r in ready:
        os.read(wake_r, 4096)
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            say(f"exit {pid} {os.waitstatus_to_exitcode(status)}")
    if 0 in ready:
        data = os.read(0, 65536)
        if not data:
            break
        buf += data
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            pid = os.fork()
            if pid == 0:
                stage(json.loads(line))
            say(f"pid {pid}")
"""


class Zygote:
    """A template process (a child of this one) that forks ``mp`` stage processes on request."""

    def __init__(self, env: dict[str, str] | None = None) -> None:
        env = dict(os.environ if env is None else env)
        repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the checkout under test
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [repo, env.get("PYTHONPATH")]))
        self.proc = subprocess.Popen(
            [sys.executable, "-c", TEMPLATE], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env
        )
        self._lock = threading.Condition()
        self._pids: list[int] = []
        self.exits: dict[int, int] = {}
        """Exit code of each forked stage that has exited (negative: the signal that ended it)."""
        if self.proc.stdout.readline().strip() != b"ready":
            raise RuntimeError("the stage template process did not start")
        self._reader = threading.Thread(target=self._read, name="zygote-reader", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            kind, pid, *code = line.decode().split()
            with self._lock:
                if kind == "pid":
                    self._pids.append(int(pid))
                else:
                    self.exits[int(pid)] = int(code[0])
                self._lock.notify_all()

    def popen(self, args: list[str], env: dict[str, str] | None = None, **_) -> ForkedStage:
        """Fork a stage for ``python -m pprun.executor.stage_main HOST PORT RANK`` (``args``)."""
        with self._lock:
            self.proc.stdin.write(json.dumps({"argv": list(args), "env": dict(env or os.environ)}).encode() + b"\n")
            self.proc.stdin.flush()
            if not self._lock.wait_for(lambda: self._pids, timeout=30):
                raise RuntimeError("the stage template process forked nothing")
            return ForkedStage(self, self._pids.pop(0))

    def close(self) -> None:
        """Stop the template process (its forked stages are the executor's to stop)."""
        close_child(self.proc, timeout_s=10)


class ForkedStage:
    """The part of ``subprocess.Popen`` the ``mp`` executor uses, for a stage the zygote forked."""

    def __init__(self, zygote: Zygote, pid: int) -> None:
        self.zygote = zygote
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        """The exit code once the stage has exited (and been reaped), else None."""
        if self.returncode is None:
            self.returncode = self.zygote.exits.get(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the exit; raises ``subprocess.TimeoutExpired`` after ``timeout``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.zygote._lock:
            while self.poll() is None:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise subprocess.TimeoutExpired(f"stage {self.pid}", timeout)
                self.zygote._lock.wait(left)
        return self.returncode

    def kill(self) -> None:
        """SIGKILL the stage (nothing if it has already been reaped)."""
        if self.poll() is None:
            try:
                os.kill(self.pid, 9)
            except ProcessLookupError:
                pass


def use_zygote(monkeypatch, zygote: Zygote) -> None:
    """Make the ``mp`` executor start its stages through ``zygote`` for the rest of the test."""
    import pprun.executor.mp as mp

    monkeypatch.setattr(
        mp,
        "subprocess",
        types.SimpleNamespace(Popen=zygote.popen, DEVNULL=subprocess.DEVNULL, TimeoutExpired=subprocess.TimeoutExpired),
    )
