"""Stage layout, intermediate tensors and their transport between pipeline stages."""

from pprun.distributed.intermediate import IntermediateTensors

__all__ = ["IntermediateTensors"]
