"""``mp``: one local process per worker (per tp rank of each stage), controlled over local sockets.

Stages start as fresh interpreters (``python -m pprun.executor.stage_main``), not through
``multiprocessing``: a user's script is never re-imported in the children, so it needs no
``if __name__ == "__main__"`` guard, and no CUDA or thread state is inherited by fork.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import time

from pprun.config.validate import ResolvedConfig
from pprun.distributed.auth import loopback_env
from pprun.distributed.layout import StageLayout
from pprun.executor.remote import RemoteStagesExecutor
from pprun.worker.faults import stage_faults
from pprun.worker.worker import WorkerSpec

logger = logging.getLogger(__name__)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class MpExecutor(RemoteStagesExecutor):
    """Stages as local child processes."""

    name = "mp"

    def __init__(self, resolved: ResolvedConfig, runner: str) -> None:
        super().__init__(resolved, resolved.cfg.parallel.stage_timeout_s, runner)
        # Every stage is on this host: the control listener and the sampled-ids socket on
        # loopback, the rendezvous a file in a private directory, gloo/NCCL on the loopback
        # interface (docs/failures.md, "Sockets").
        listener = self._listen("127.0.0.1")
        init_method = self._local_rendezvous()
        # One process per worker, by global rank (pp_rank * tp + tp_rank): device i for rank i,
        # so a stage's tp group is consecutive GPUs.
        specs = [
            WorkerSpec(
                resolved,
                StageLayout.of_global_rank(resolved.layer_partition, rank, self.tp_size),
                runner,
                init_method=init_method,
                device_index=rank if resolved.device == "cuda" else None,
                sample_feedback_slots=self.sample_feedback_slots,
                control_spin_s=self.spin_s,
                feedback_host="127.0.0.1",
                env=loopback_env(),
                faults=stage_faults(rank),
            )
            for rank in range(self.num_workers)
        ]
        env = dict(os.environ, PPRUN_AUTHKEY=self.authkey.hex())
        host, port = listener.address
        self.procs: list[subprocess.Popen] = []
        try:
            for rank in range(self.num_workers):
                self.procs.append(
                    subprocess.Popen(
                        [sys.executable, "-m", "pprun.executor.stage_main", host, str(port), str(rank)],
                        env=env,
                        stdin=subprocess.DEVNULL,
                    )
                )
            self._accept_all(listener, specs)
            self._setup_stages()
        except BaseException:
            self.shutdown()
            raise

    def describe(self) -> str:
        """Executor and placement."""
        if self.tp_size == 1:
            return f"mp ({self.pp_size} local processes)"
        return f"mp ({self.num_workers} local processes: {self.pp_size} stages x tp {self.tp_size})"

    def _stage_exits(self, crashed_only: bool = False) -> list[tuple[int, str]]:
        return [
            (rank, f"{self.worker_name(rank)} died (process exited with code {p.poll()})")
            for rank, p in enumerate(self.procs)
            if p.poll() is not None and not (crashed_only and p.poll() == 0)
        ]

    def _stop_processes(self, grace_s: float) -> None:
        deadline = time.monotonic() + grace_s
        for p in self.procs:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:  # stuck in the kernel: reported, not waited for
                logger.warning("stage process %d did not exit after SIGKILL", p.pid)
