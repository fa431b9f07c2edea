"""A warm ``pprun`` command line for the doc-snippet harness: commands forked from a template.

A ``pprun`` command is a fresh interpreter that spends seconds of CPU importing torch,
transformers, Hydra and pprun's engine before it does anything; the docs show several of them in
one block (the README's command-line block shows seven).  :class:`WarmCli` is one process that has
made those imports already and forks a command on request: from the fork on, the child runs what
``python -m pprun ARGS`` runs (``pprun.cli.main`` with that argv, in the snippet's working folder
and environment, its standard output and error in files), then exits as the interpreter would (its
threads joined, its ``atexit`` handlers run) with main's status.  The start of a fresh interpreter
itself is checked by the snippet's first ``pprun`` command, which runs through bash as written
(``tests/test_doc_snippets.py``).
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from child_process import close_child

TEMPLATE = r"""
import atexit, gc, json, os, sys, threading, traceback

# What the apps import before their work: torch, transformers' tokenizers and models, Hydra,
# pprun's apps, engine, worker and models (an app on the `uni` executor runs its stage in-process).
import numpy, safetensors.torch, torch, torch.distributed  # noqa: E401, F401
import transformers  # noqa: F401
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer  # noqa: F401
import hydra, omegaconf  # noqa: E401, F401
import pprun, pprun.cli, pprun.apps.bench, pprun.apps.generate, pprun.apps.transcribe  # noqa: E401, F401
import pprun.engine.llm_engine, pprun.worker.model_loader, pprun.worker.worker  # noqa: E401, F401
import pprun.worker.v1.runner, pprun.worker.v2.runner  # noqa: E401, F401

# What is frozen here is not walked by the collector again in each command (nor copied on write).
gc.collect()
gc.freeze()

replies = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)  # nothing of the template's own goes to the reply channel


def child(req):
    replies.close()  # the reply channel is the template's alone
    os.setsid()  # the test kills the command's process group on a timeout
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, req["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
                            (2, req["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)):
        opened = os.open(path, flags, 0o644)
        os.dup2(opened, fd)
        os.close(opened)
    sys.argv = ["pprun", *req["argv"]]
    status = 1
    try:
        status = pprun.cli.main(req["argv"])
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            status = e.code or 0
        else:
            print(e.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    # As the interpreter ends: non-daemon threads joined, then the atexit handlers.
    try:
        threading._shutdown()
        atexit._run_exitfuncs()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)


for line in sys.stdin:
    req = json.loads(line)
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        child(req)
    replies.write(json.dumps({"pid": pid}) + "\n")
    replies.flush()
    _, wait_status = os.waitpid(pid, 0)
    replies.write(json.dumps({"status": os.waitstatus_to_exitcode(wait_status)}) + "\n")
    replies.flush()
"""


class WarmCli:
    """The template process (started by the first :meth:`run`, which forks one ``pprun`` command
    from it)."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = env
        self.proc: subprocess.Popen | None = None
        self._buffer = b""
        self._scratch = tempfile.TemporaryDirectory(prefix="warm_cli_")

    def _reply(self, deadline: float) -> dict:
        """The template's next reply line, or TimeoutError past the deadline (read from the pipe
        itself, unbuffered, so a line already read never hides behind ``select``)."""
        assert self.proc is not None and self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buffer:
            ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                raise TimeoutError
            chunk = os.read(fd, 65536)
            if not chunk:
                raise RuntimeError(f"the warm pprun template exited (status {self.proc.wait()})")
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return json.loads(line)

    def run(self, argv: list[str], cwd: Path, env: dict[str, str], timeout_s: float) -> subprocess.CompletedProcess:
        """``pprun ARGV`` forked from the template, in ``cwd`` with exactly ``env``: its status
        and what it printed, as :func:`subprocess.run` gives them (TimeoutExpired past the
        timeout, the command's process group killed)."""
        if self.proc is None:
            self.proc = subprocess.Popen([sys.executable, "-c", TEMPLATE], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, env=self.env)  # fmt: skip
        assert self.proc.stdin is not None
        out, err = Path(self._scratch.name) / "stdout", Path(self._scratch.name) / "stderr"
        request = {"argv": argv, "cwd": str(cwd), "env": env, "stdout": str(out), "stderr": str(err)}
        self.proc.stdin.write((json.dumps(request) + "\n").encode())
        self.proc.stdin.flush()
        deadline = time.monotonic() + timeout_s
        pid = self._reply(deadline)["pid"]
        try:
            status = self._reply(deadline)["status"]
        except TimeoutError:
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:  # not yet its own group leader
                os.kill(pid, signal.SIGKILL)
            self._reply(time.monotonic() + 30)
            raise subprocess.TimeoutExpired(["pprun", *argv], timeout_s) from None
        return subprocess.CompletedProcess(["pprun", *argv], status, out.read_text(), err.read_text())

    def close(self) -> None:
        """End the template (its stdin closed, then killed if it lingers)."""
        if self.proc is not None and self.proc.stdin is not None:
            close_child(self.proc, timeout_s=30)
        self._scratch.cleanup()
