"""The process groups of a run's workers: the world, each pipeline's hops, each stage's tp group.

A run of ``pp x tp`` workers is one ``torch.distributed`` world (rank ``pp_rank * tp + tp_rank``,
``pprun.distributed.layout``).  Inside it every rank makes the same groups in the same order (a
group's creation is a collective of the whole world, members or not):

1. per pipeline ``i`` (tp rank ``i`` of every stage), with pp > 1: its device group for the
   hops (the world itself when tp = 1) and, between GPUs, a gloo group for the hop metadata and
   the stages' agreements; with async pipeline steps the first and last stage's gloo group;
2. per stage, with tp > 1: its tensor-parallel group (NCCL between GPUs, gloo on CPU), which
   the model's all-reduces and gathers run on (``TensorParallel``).

The hops go rank to rank: tp rank ``i`` of stage ``s`` sends to tp rank ``i`` of stage ``s+1``.
After a block's all-reduce every tp rank holds the whole hidden state, so each sends its own
copy; nothing is broadcast inside the receiving group (docs/parallelism.md, "Tensor
parallelism").
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from pprun.distributed import rendezvous
from pprun.distributed.layout import StageLayout
from pprun.distributed.tensor_parallel import TensorParallel


def backend_for(device: torch.device) -> str:
    """The device group's backend: NCCL between GPUs, gloo on CPU."""
    return "nccl" if device.type == "cuda" else "gloo"


def init_world(
    layout: StageLayout, device: torch.device, init_method: str, timeout_s: float, authkey: bytes | None = None
) -> rendezvous.RendezvousStore | None:
    """Join the run's world of ``layout.world_size`` ranks as ``layout.global_rank`` (pprun's own
    executors); returns the authenticated rendezvous store of a ``pprun://`` rendezvous (stages
    on several hosts, served by stage 0: never torch's open TCP store), which the caller keeps
    referenced while torch holds its C++ half, else None."""
    store = None
    if init_method.startswith(rendezvous.SCHEME):
        store = rendezvous.store_from_init_method(init_method, authkey, timeout_s)
    dist.init_process_group(
        backend=backend_for(device),
        init_method=None if store is not None else init_method,
        store=store,
        world_size=layout.world_size,
        rank=layout.global_rank,
        timeout=timedelta(seconds=timeout_s),
        device_id=device if device.type == "cuda" else None,
    )
    return store


@dataclass(frozen=True)
class PipelineGroups:
    """This worker's pipeline's groups (see the module docstring)."""

    device_group: dist.ProcessGroup
    """The hops' tensors (NCCL between GPUs, gloo on CPU)."""
    cpu_group: dist.ProcessGroup
    """Gloo: hop metadata, the stages' agreements, objects broadcast between SPMD ranks."""
    feedback_group: dist.ProcessGroup | None
    """Gloo between the first and the last stage (async pipeline steps); None without them."""


def pipeline_groups(layout: StageLayout, device: torch.device, timeout_s: float, feedback: bool = False) -> PipelineGroups:
    """Make every pipeline's groups (a collective of the whole world) and return this worker's.
    ``feedback``: also the first and last stage's gloo group (every rank passes the same)."""
    timeout = timedelta(seconds=timeout_s)
    backend = backend_for(device)
    tp_size = layout.tp_size
    mine = None
    for tp_rank in range(tp_size):
        ranks = [pp * tp_size + tp_rank for pp in range(layout.pp_size)]
        device_group = dist.group.WORLD if tp_size == 1 else dist.new_group(ranks, backend=backend, timeout=timeout)
        cpu_group = dist.new_group(ranks, backend="gloo", timeout=timeout) if backend == "nccl" else device_group
        # On gloo also between GPUs: a second NCCL group would not be an independent channel
        # (docs/performance.md, "Hops and the control path").
        feedback_group = dist.new_group([ranks[0], ranks[-1]], backend="gloo", timeout=timeout) if feedback else None
        if tp_rank == layout.tp_rank:
            mine = PipelineGroups(device_group, cpu_group, feedback_group)
    return mine


def tensor_parallel_group(layout: StageLayout, device: torch.device, timeout_s: float) -> TensorParallel:
    """Make every stage's tensor-parallel group (a collective of the whole world; nothing at
    tp = 1) and return this worker's place in its own."""
    if layout.tp_size == 1:
        return TensorParallel.single()
    timeout = timedelta(seconds=timeout_s)
    mine = None
    for pp_rank in range(layout.pp_size):
        ranks = [pp_rank * layout.tp_size + tp for tp in range(layout.tp_size)]
        group = dist.new_group(ranks, backend=backend_for(device), timeout=timeout)
        if pp_rank == layout.pp_rank:
            mine = group
    if device.type == "cuda":
        # NCCL connects a group at its first collective, which must not be inside a CUDA-graph
        # capture (the model's all-reduces are captured): connect it now.
        dist.all_reduce(torch.zeros(1, device=device), group=mine)
        torch.cuda.synchronize(device)
    return TensorParallel(layout.tp_rank, layout.tp_size, mine)


def world_cpu_group(device: torch.device, timeout_s: float) -> dist.ProcessGroup:
    """A gloo group of the whole world (the world itself on CPU): what SPMD ranks share on the
    host (torchrun's agreed KV blocks and every step's output)."""
    if device.type != "cuda":
        return dist.group.WORLD
    return dist.new_group(list(range(dist.get_world_size())), backend="gloo", timeout=timedelta(seconds=timeout_s))
