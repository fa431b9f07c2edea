"""What the stages of a pipeline set up together before their first step, beside the transport.

Two agreements, each a pipeline concern rather than a runner's:

- whether full decode CUDA graphs carry the hop to the next stage (:func:`agree_on_graph_hops`):
  one stage sending inside a graph while its neighbour receives outside would hang, so every
  stage decides from every stage's graph set-up;
- the channel on which an async pipeline's last stage sends its sampled ids straight to the
  first (:func:`open_sample_feedback`, ``pprun.distributed.feedback``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch

from pprun.distributed.feedback import SampleFeedback
from pprun.distributed.intermediate import IntermediateTensors
from pprun.distributed.layout import StageLayout
from pprun.distributed.transport import PipelineTransport
from pprun.switches import enabled_unless

logger = logging.getLogger(__name__)

GRAPH_HOP_ENABLED: bool = enabled_unless("PPRUN_DISABLE_GRAPH_HOP")
"""Whether full decode graphs of a pipeline carry the hop to the next stage (the send at the end
of a stage's graph, the receive at the start of the next one's): a decode hop then costs no host
time and no copy.  ``PPRUN_DISABLE_GRAPH_HOP=1`` sends and receives outside the graphs (a
debugging switch: every stage must agree, and they check, see :func:`agree_on_graph_hops`)."""


def agree_on_graph_hops(
    transport: PipelineTransport | None,
    layout: StageLayout,
    device: torch.device,
    graph_mode: str,
    graph_sizes: Sequence[int],
    make_sample: Callable[[], IntermediateTensors],
    buffers: IntermediateTensors | None,
) -> bool:
    """Whether this stage's decode graphs carry the hops: only when every stage captures full
    graphs of the same sizes with the switch on.  A collective: every stage of a CUDA pipeline
    calls it before capturing.  When they agree, one eager hop of one token goes down the
    pipeline first, so that the receivers check what they will be sent and NCCL connects each
    pair outside any capture.

    ``make_sample``: what this stage sends, one row (called on non-last stages only);
    ``buffers``: where it receives (the graphs' input buffers; None on the first stage).
    """
    if transport is None or layout.pp_size == 1 or device.type != "cuda":
        return False
    mine = (graph_mode, tuple(graph_sizes), GRAPH_HOP_ENABLED)
    agreed = transport.agree(mine)
    if not (agreed and graph_mode in ("full", "full_and_piecewise") and GRAPH_HOP_ENABLED):
        return False
    sample = None if layout.is_last else make_sample()
    transport.warm_up(sample, buffers)
    torch.cuda.synchronize(device)
    logger.info("stage %d: decode graphs carry the pipeline hops", layout.pp_rank)
    return True


def open_sample_feedback(
    transport: PipelineTransport | None,
    layout: StageLayout,
    max_num_reqs: int,
    num_slots: int,
    spin_s: float = 0.0,
) -> SampleFeedback | None:
    """This stage's end of the sampled-ids channel of async pipeline steps: the first and the
    last stage of a pipeline with ``num_slots > 0`` get one (the last sends, the first reads),
    every other stage None.  ``spin_s``: how long the first stage polls for the ids before a
    blocking read.  The channel is opened by its ``warm_up``, before graphs are captured."""
    if not num_slots or layout.pp_size == 1 or not (layout.is_first or layout.is_last):
        return None
    if transport is None or transport.feedback_group is None:
        raise ValueError(
            f"stage {layout.pp_rank}: sample_feedback_slots needs a transport with a feedback group "
            "(pprun's own executors make one)"
        )
    peer = transport.global_ranks[-1 if layout.is_first else 0]
    return SampleFeedback(
        transport.feedback_group, peer, layout.is_first, max_num_reqs, num_slots,
        host=transport.feedback_host, timeout_s=transport.timeout_s, spin_s=spin_s,
        authkey=transport.authkey,
    )
