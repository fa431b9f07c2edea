"""The executor interface the engine drives, and the errors it raises."""

from __future__ import annotations

from abc import ABC, abstractmethod

from pprun.config.validate import ResolvedConfig
from pprun.core.outputs import ModelRunnerOutput, SchedulerOutput


class StageFailedError(RuntimeError):
    """A pipeline stage raised, died or stopped answering; the engine is unusable afterwards."""


class Executor(ABC):
    """Runs SchedulerOutputs through the stages and hands back the last stage's outputs in order.

    ``submit`` does not wait for the step to finish (except in process); up to ``max_in_flight``
    steps may be outstanding, so every stage computes a different batch at once.
    """

    name: str = "?"
    """The executor's config name (``uni``, ``mp``, ``ray``, ``external_launcher``)."""
    pp_size: int = 1
    """Pipeline stages it drives."""
    max_in_flight: int = 1
    """Steps that may be submitted and not yet answered (the engine keeps this many in flight)."""
    async_steps: bool = False
    """A step is submitted before the previous step of the same requests has been answered: its
    pending input ids are the previous step's samples, taken where they are (on the device at
    pp = 1, sent by the last stage to the first in a pipeline).  The engine schedules for it."""
    submits_async: bool = False
    """``submit`` returns as soon as the step is on its way (it waits for no stage), so the engine
    may submit the next steps before its own bookkeeping of an answered one."""
    dead: bool = False
    """True once the executor has given up on its stages (a stage failed, or a wait was
    interrupted mid-message); it accepts no more steps."""
    num_blocks: int = 0
    """KV blocks every stage allocated (the minimum over stages)."""
    num_cross_slots: int | None = None
    """An encoder-decoder model's cross-attention slots: requests that may run at once (the
    minimum over stages, each sized from its cache budget); None for a decoder-only model."""
    stage_sms: tuple[int, ...] = ()
    """SM counts of the stages' devices, distinct and ascending (empty off CUDA): the warm-up plans
    the decode launch's split counts from them (``pprun.engine.warmup.eager_decode_rows``)."""
    stage_params: list[int]
    """Parameter count of each stage's model."""

    @classmethod
    def prepare(cls, resolved: ResolvedConfig) -> None:
        """Imports the executor's start (``__init__``) will need, done by the engine before it
        starts its own threads (the tokenizer's), whose imports would slow these down (one
        interpreter lock); nothing by default."""
        return None

    @abstractmethod
    def init_cache(self, num_blocks: int) -> None:
        """Allocate ``num_blocks`` KV blocks on every stage and build the stages' runners."""

    @abstractmethod
    def submit(self, so: SchedulerOutput) -> None:
        """Start a step on every stage."""

    @abstractmethod
    def get_output(self) -> ModelRunnerOutput:
        """Wait (bounded by the stage timeout) for the oldest outstanding step's output."""

    @abstractmethod
    def mark_ready(self) -> None:
        """The engine's warm-up is over: every stage's first-use record (``pprun.utils.first_use``)
        counts and logs what it meets from now on."""

    @abstractmethod
    def first_use_snapshots(self) -> list[dict]:
        """Every stage's first-use counts (``FirstUse.snapshot``), first stage first (between steps)."""

    @abstractmethod
    def shutdown(self) -> None:
        """Stop every stage process and release its resources; safe to call twice."""

    def describe(self) -> str:
        """One line for summaries: executor and stage placement."""
        return self.name
