"""pprun: pipeline-parallel transformer inference.

``from pprun import LLM, SamplingParams``; see README.md.
"""

from pprun.sampling.params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name: str):
    # Lazy: importing pprun (e.g. for SamplingParams in the scheduler) must not import torch.
    if name == "LLM":
        from pprun.engine.llm import LLM

        return LLM
    if name == "RequestOutput":
        from pprun.engine.outputs import RequestOutput

        return RequestOutput
    raise AttributeError(name)
