"""What ``LLM.generate`` returns, in the field's convention (vLLM's ``RequestOutput``)."""

from __future__ import annotations

from dataclasses import dataclass

from pprun.core.outputs import Logprobs


@dataclass
class RequestMetrics:
    """Timings of one request (seconds; wall clock from ``time.time``)."""

    arrival_time: float
    first_scheduled_time: float | None = None
    """When a step first took the request (its queue time ends)."""
    first_token_time: float | None = None
    finished_time: float | None = None
    num_output_tokens: int = 0

    @property
    def queue_time(self) -> float | None:
        """Arrival to the first step that took the request (None until one did)."""
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

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

    @property
    def cut_by_stop_string(self) -> bool:
        """A stop string ended it: its text is cut before the string (decoded to find it)."""
        return stopped_by_string(self.finish_reason, self.stop_reason)


def stopped_by_string(finish_reason: str | None, stop_reason: int | str | None) -> bool:
    """Whether a request with these reasons was ended by a stop string (not a stop token)."""
    return finish_reason == "stop" and isinstance(stop_reason, str)


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
    num_cached_tokens: int = 0
    """Prompt tokens whose KV came from the prefix cache (not computed for this request)."""


@dataclass
class RequestDelta:
    """What one engine step added to one request (``pprun.engine.async_engine`` streams these).

    Joined in order, the deltas of a request give its whole output: ``token_ids`` concatenated
    are ``CompletionOutput.token_ids`` and ``text`` concatenated is ``CompletionOutput.text``.
    The last delta has ``finished=True`` and carries the finish reason, usage and timings.
    """

    request_id: str
    token_ids: list[int]
    """Tokens sampled since the previous delta."""
    text: str
    """Text decoded since the previous delta (incrementally; "" without a tokenizer).  Held back
    while it could still be the start of a stop string, or an incomplete UTF-8 character."""
    logprobs: list[Logprobs | None] | None = None
    """Per new token, when ``SamplingParams.logprobs`` was set."""
    finished: bool = False
    finish_reason: str | None = None
    """"stop", "length", "abort" or "error" on the last delta; None before."""
    stop_reason: int | str | None = None
    """The stop string or stop token id that ended the request, if one did."""
    error: str | None = None
    """Why the request ended with finish_reason "error" (a stage failed, the engine stopped)."""
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    """Output tokens so far (all of them on the last delta)."""
    metrics: RequestMetrics | None = None
    """Timings, on the last delta."""
    num_cached_tokens: int = 0
    """Prompt tokens found in the prefix cache, on the last delta."""
