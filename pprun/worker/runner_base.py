"""What a worker asks of its stage's model runner (V1 and V2 both implement it).

The worker owns the device, the model, the KV cache and the pipeline channel; the runner owns
one step: the request state between steps, the model inputs, the forward (eager or replayed)
and, on the last stage, sampling.  Everything the worker reads from a runner is declared here.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pprun.core.outputs import ModelRunnerOutput, SchedulerOutput
from pprun.distributed.intermediate import IntermediateTensors

Receive = Callable[..., IntermediateTensors]
"""How a non-first stage's runner gets the previous stage's tensors once its inputs are on the
device: ``receive(into=None, in_graph=False)`` (see ``Worker.execute_model``)."""


class PendingOutput:
    """A step's output whose device-to-host copy may still be running; ``result()`` waits."""

    def __init__(self, build: Callable[[], ModelRunnerOutput], event: torch.cuda.Event | None = None) -> None:
        self._build: Callable[[], ModelRunnerOutput] | None = build
        self._value: ModelRunnerOutput | None = None
        self._event = event
        """Recorded after the step's last device work (its copies to the host), if any."""
        self.first_use: tuple[str, ...] = ()
        """First-use keys the stage met launching this step, copied into the built output."""

    @classmethod
    def of(cls, value: ModelRunnerOutput) -> PendingOutput:
        """An output that is already complete (``ready``)."""
        out = cls(lambda: value)
        out.result()
        return out

    @property
    def ready(self) -> bool:
        """True once the output is built (``result()`` returns at once)."""
        return self._build is None

    def done(self) -> bool:
        """True when ``result()`` would not wait for the device (built, or its event reached)."""
        return self._build is None or self._event is None or self._event.query()

    def result(self) -> ModelRunnerOutput:
        """The ModelRunnerOutput (built once)."""
        if self._build is not None:
            self._value = self._build()
            self._build = None
            if self.first_use:
                self._value.first_use = self.first_use
        return self._value  # type: ignore[return-value]


@dataclass
class StepResult:
    """What one step of a stage's runner hands the worker: on the last stage its output, on
    the others what the next stage receives (nothing for an empty step)."""

    output: ModelRunnerOutput | PendingOutput | None = None
    """The last stage's output: a :class:`PendingOutput` while the sampled ids may still be on
    their way to the host (:meth:`ModelRunner.execute_model_async`); None on other stages."""
    to_send: IntermediateTensors | None = None
    """A non-last stage's tensors for the next stage; None when the step computed nothing or
    its full CUDA graph sent them itself (:attr:`sent_in_graph`)."""
    sent_in_graph: bool = False
    """A non-last stage's decode graph sent its tensors to the next stage inside the replay."""

    def finished(self) -> StepResult:
        """The same result with a pending output waited for (see :func:`resolve`)."""
        if isinstance(self.output, PendingOutput):
            return StepResult(self.output.result(), self.to_send, self.sent_in_graph)
        return self


def resolve(out: ModelRunnerOutput | PendingOutput) -> ModelRunnerOutput:
    """The finished output of a last stage's step (waits for a pending one)."""
    return out.result() if isinstance(out, PendingOutput) else out


class ModelRunner(ABC):
    """One pipeline stage's step runner, as the worker drives it."""

    name: str = "?"
    """``"v1"`` or ``"v2"``."""
    hop_in_graph: bool = False
    """True when this stage's full decode graphs send to / receive from its neighbours themselves."""
    host_times: dict[str, float] | None = None
    """The last step's host time by phase, in us, for the step trace; None when not timed."""

    @property
    def cudagraph_mode(self) -> str:
        """The CUDA-graph mode this runner captured (``"none"``: every step runs eagerly)."""
        return "none"

    @abstractmethod
    def execute_model(
        self,
        so: SchedulerOutput,
        intermediate_tensors: IntermediateTensors | None = None,
        receive: Receive | None = None,
    ) -> StepResult:
        """Run one step and wait for it: non-last stages return what to send, the last its
        ModelRunnerOutput (never pending).  ``receive`` (non-first stages, instead of
        ``intermediate_tensors``) is called once the step's inputs are on the device."""

    def execute_model_async(
        self,
        so: SchedulerOutput,
        intermediate_tensors: IntermediateTensors | None = None,
        receive: Receive | None = None,
    ) -> StepResult:
        """Run one step, returning before the device finishes where the runner can (the last
        stage's output then a :class:`PendingOutput`); by default the same as :meth:`execute_model`."""
        return self.execute_model(so, intermediate_tensors, receive)

    def launches_quickly(self, so: SchedulerOutput) -> bool:
        """True when launching ``so`` takes little host time (a replay of one full CUDA graph),
        so the last stage may launch it before answering the step before."""
        return False

    def close(self) -> None:
        """Release what the runner opened beyond the worker's channel (before that goes away);
        a runner that opens nothing has nothing to release."""
        return None
