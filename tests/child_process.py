"""Ending a long-lived helper process that a test module started with ``subprocess.Popen``.

The warm templates and the sm_90 compiler (``tests/stage_zygote.py``, ``tests/warm_cli.py``,
``tests/sm90_compile.py``) each run a child that reads requests from its standard input and
exits when that input ends; they all end it the same way, here.
"""

from __future__ import annotations

import subprocess


def close_child(proc: subprocess.Popen, timeout_s: float) -> int:
    """End ``proc``, a child that exits once its standard input ends, and return its exit code.

    Closes its stdin, waits up to ``timeout_s`` seconds for it to exit, and if it has not, kills
    it (SIGKILL) and reaps it.  Its stdout and stderr are neither read nor closed: they are the
    caller's (a reader thread may still be draining them)."""
    proc.stdin.close()
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()
