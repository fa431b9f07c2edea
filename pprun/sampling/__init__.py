"""Sampling: user parameters (plain Python) and the torch sampler run on the last stage."""

from pprun.sampling.params import SamplingParams

__all__ = ["SamplingParams"]
