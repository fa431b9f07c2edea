"""Sockets polled before a blocking read.

A process blocked in a socket read is woken by the kernel when the bytes land; on GPU hosts
(virtual machines, idle cores in deep sleep) each wake-up costs tens of microseconds, and a
pipeline's control path and sampled-ids channel wait on sockets every step.  Polling for a
bounded time first keeps the reader on its core.  Who polls, and for how long, is decided by
the caller (the control path's ``pprun.executor.remote.control_spin_s``).
"""

from __future__ import annotations

import select
import time


class Spinner:
    """Polls a set of sockets (anything with ``fileno()``) without blocking for up to ``budget_s``."""

    def __init__(self, conns: list, budget_s: float) -> None:
        self.budget_s = budget_s
        self._poller = select.poll()
        for conn in conns:
            self._poller.register(conn.fileno(), select.POLLIN)

    def wait(self, limit_s: float | None = None) -> bool:
        """True as soon as one socket is readable (or closed); False after the budget (or
        ``limit_s``, when shorter)."""
        poll = self._poller.poll
        budget = self.budget_s if limit_s is None else min(self.budget_s, limit_s)
        deadline = time.perf_counter() + budget
        while True:
            if poll(0):
                return True
            if time.perf_counter() >= deadline:
                return False
