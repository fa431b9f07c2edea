"""The executor interface the engine drives, and the errors it raises."""

from __future__ import annotations

from abc import ABC, abstractmethod

from pprun.core.outputs import ModelRunnerOutput, SchedulerOutput


class StageFailedError(RuntimeError):
    """A pipeline stage raised, died or stopped answering; the engine is unusable afterwards."""


class Executor(ABC):
    """Runs SchedulerOutputs through the stages and hands back the last stage's outputs in order.

    ``submit`` does not wait for the step to finish (except in process); up to ``max_in_flight``
    steps may be outstanding, so every stage computes a different batch at once.
    """

    name: str = "?"
    max_in_flight: int = 1
    num_blocks: int = 0
    """KV blocks every stage allocated (the minimum over stages)."""
    stage_params: list[int]
    """Parameter count of each stage's model."""

    @abstractmethod
    def submit(self, so: SchedulerOutput) -> None:
        """Start a step on every stage."""

    @abstractmethod
    def get_output(self) -> ModelRunnerOutput:
        """Wait (bounded by the stage timeout) for the oldest outstanding step's output."""

    @abstractmethod
    def shutdown(self) -> None:
        """Stop every stage process and release its resources; safe to call twice."""

    def describe(self) -> str:
        """One line for summaries: executor and stage placement."""
        return self.name
