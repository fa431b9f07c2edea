"""What the sampler reports for one sampled position when a request asks for logprobs (plain
data, no torch: it crosses from the last stage to the engine inside ``ModelRunnerOutput``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Logprobs:
    """Log-probabilities for one sampled position."""

    sampled_logprob: float
    top_token_ids: list[int]
    top_logprobs: list[float]
