"""``mp``: one local process per stage (spawned), controlled over local sockets."""

from __future__ import annotations

import multiprocessing as mp
import socket

from pprun.distributed.layout import StageLayout
from pprun.executor.remote import RemoteStagesExecutor, worker_main
from pprun.worker.worker import WorkerSpec


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class MpExecutor(RemoteStagesExecutor):
    """Stages as ``multiprocessing`` children (spawn start method: safe with CUDA and threads)."""

    name = "mp"

    def __init__(self, resolved, runner: str, fault_injection: dict[int, dict] | None = None) -> None:
        super().__init__(resolved, resolved.cfg.parallel.stage_timeout_s)
        listener = self._listen("127.0.0.1")
        init_method = f"tcp://127.0.0.1:{free_port()}"
        ctx = mp.get_context("spawn")
        self.procs: list[mp.Process] = []
        for rank in range(self.pp_size):
            spec = WorkerSpec(
                resolved,
                StageLayout.from_partition(resolved.layer_partition, rank),
                runner,
                init_method=init_method,
                device_index=rank if resolved.device == "cuda" else None,
                fault_injection=(fault_injection or {}).get(rank),
            )
            p = ctx.Process(target=worker_main, args=(spec, listener.address, self.authkey), daemon=True, name=f"pprun-stage{rank}")
            p.start()
            self.procs.append(p)
        try:
            self._accept_all(listener)
            self._setup_stages()
        except BaseException:
            self.shutdown()
            raise

    @property
    def stage_pids(self) -> list[int]:
        """Process id of each stage."""
        return [p.pid for p in self.procs]

    def describe(self) -> str:
        """Executor and placement."""
        return f"mp ({self.pp_size} local processes)"

    def _check_alive(self) -> None:
        for rank, p in enumerate(self.procs):
            if p.exitcode is not None:
                self._fail(f"stage {rank} process exited with code {p.exitcode}")

    def _stop_processes(self) -> None:
        for p in self.procs:
            p.join(timeout=5)
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
