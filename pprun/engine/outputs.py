"""What ``LLM.generate`` returns, in the field's convention (vLLM's ``RequestOutput``)."""

from __future__ import annotations

from dataclasses import dataclass

from pprun.core.outputs import Logprobs


@dataclass
class RequestMetrics:
    """Timings of one request (seconds; wall clock from ``time.time``)."""

    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None
    num_output_tokens: int = 0

    @property
    def time_to_first_token(self) -> float | None:
        """Arrival to first output token."""
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def time_per_output_token(self) -> float | None:
        """Mean time between output tokens after the first (None with fewer than two)."""
        if self.finished_time is None or self.first_token_time is None or self.num_output_tokens < 2:
            return None
        return (self.finished_time - self.first_token_time) / (self.num_output_tokens - 1)


@dataclass
class CompletionOutput:
    """One completion of a prompt."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    """"stop", "length", "abort", "error", or None while running."""
    stop_reason: int | str | None = None
    logprobs: list[Logprobs | None] | None = None
    """Per output token, when ``SamplingParams.logprobs`` was set."""


@dataclass
class RequestOutput:
    """A request's prompt, its completion(s) and metrics."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    error: str | None = None
    """Why the request ended with finish_reason "error"."""
