"""``uni``: the single stage runs in the engine's own process."""

from __future__ import annotations

from collections import deque

from pprun.config.validate import ResolvedConfig
from pprun.core.outputs import ModelRunnerOutput, SchedulerOutput
from pprun.distributed.layout import StageLayout
from pprun.executor.base import Executor, StageFailedError
from pprun.worker.faults import stage_faults
from pprun.worker.runner_base import resolve
from pprun.worker.worker import Worker, WorkerSpec


class UniExecutor(Executor):
    """pp = 1, in process; steps run synchronously inside ``submit``."""

    name = "uni"
    max_in_flight = 1

    def __init__(self, resolved: ResolvedConfig, runner: str) -> None:
        layout = StageLayout.single(resolved.arch.num_hidden_layers)
        self.async_steps = runner == "v2" and resolved.cfg.scheduler.async_scheduling
        """Submit returns before the device finishes (V2's pending outputs): two steps in flight."""
        self.max_in_flight = 2 if self.async_steps else 1
        self.worker = Worker(WorkerSpec(resolved, layout, runner, faults=stage_faults(0)))
        self.stage_params = [self.worker.load_model()]
        self.num_blocks = self.worker.num_available_blocks()
        self.num_cross_slots = self.worker.num_cross_slots
        self.stage_sms = (self.worker.num_sms,) if self.worker.num_sms else ()
        self.outputs: deque[ModelRunnerOutput] = deque()

    def init_cache(self, num_blocks: int) -> None:
        """Allocate the KV cache (the engine may ask for fewer blocks than available)."""
        self.num_blocks = num_blocks
        self.worker.init_cache(num_blocks)

    def submit(self, so: SchedulerOutput) -> None:
        """Run the step now."""
        try:
            if self.async_steps:
                self.outputs.append(self.worker.execute_model_async(so))
            else:
                self.outputs.append(self.worker.execute_model(so))
        except Exception as e:  # a failing step ends the engine like a dead stage does
            raise StageFailedError(f"stage 0 failed at step {so.step_id}: {e!r}") from e

    def get_output(self) -> ModelRunnerOutput:
        """The oldest submitted step's output (waits for the device when it is still pending)."""
        out = self.outputs[0]
        try:
            result = resolve(out)
        except Exception as e:
            raise StageFailedError(f"stage 0 failed: {e!r}") from e
        # Popped only once the result is in: an interrupt while waiting (Ctrl-C) leaves the
        # step queued, and the next get_output waits for it again.
        self.outputs.popleft()
        return result

    def mark_ready(self) -> None:
        """The worker's first-use record counts from now on."""
        self.worker.mark_ready()

    def first_use_snapshots(self) -> list[dict]:
        """The worker's first-use counts."""
        return [self.worker.first_use_snapshot()]

    def shutdown(self) -> None:
        """Nothing to stop in process but the worker's step trace (``PPRUN_STEP_TRACE``)."""
        if self.worker is not None:
            self.worker.shutdown()
        self.worker = None
