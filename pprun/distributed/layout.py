"""Where one worker sits: its pipeline stage (layers) and its place in the stage's tensor-parallel
group; one explicit value passed down, never a global.

A run has ``pp_size x tp_size`` workers.  Worker ``(pp_rank, tp_rank)`` has the global rank
``pp_rank * tp_size + tp_rank``: a stage's tp group is consecutive ranks (one node's GPUs under
torchrun and mp), and tp rank ``i`` of every stage forms pipeline ``i``, whose hops go rank to
rank (every tp rank holds the whole hidden state after its block's all-reduce).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StageLayout:
    """Where a stage sits in the pipeline and which layers it owns."""

    pp_rank: int
    pp_size: int
    start_layer: int
    """First layer owned (global index, inclusive)."""
    end_layer: int
    """One past the last layer owned (global index, exclusive)."""
    tp_rank: int = 0
    """This worker's rank inside its stage's tensor-parallel group (0..tp_size-1)."""
    tp_size: int = 1
    """Workers per stage (``parallel.tensor_parallel_size``)."""

    @property
    def is_first(self) -> bool:
        """The first stage owns the embedding and receives token ids."""
        return self.pp_rank == 0

    @property
    def is_last(self) -> bool:
        """The last stage owns the final norm and LM head, and samples."""
        return self.pp_rank == self.pp_size - 1

    @property
    def samples(self) -> bool:
        """The one worker that samples and answers the driver: the last stage's tp rank 0."""
        return self.is_last and self.tp_rank == 0

    @property
    def global_rank(self) -> int:
        """This worker's ``torch.distributed`` rank: ``pp_rank * tp_size + tp_rank``."""
        return self.pp_rank * self.tp_size + self.tp_rank

    @property
    def world_size(self) -> int:
        """Workers of the run: ``pp_size * tp_size``."""
        return self.pp_size * self.tp_size

    @property
    def pipeline_ranks(self) -> list[int]:
        """Global ranks of this worker's pipeline (tp rank ``tp_rank`` of every stage), first
        stage to last: the neighbours its hops go to and come from."""
        return [pp * self.tp_size + self.tp_rank for pp in range(self.pp_size)]

    @property
    def tp_group_ranks(self) -> list[int]:
        """Global ranks of this stage's tensor-parallel group, tp rank 0 first."""
        return [self.pp_rank * self.tp_size + tp for tp in range(self.tp_size)]

    @property
    def name(self) -> str:
        """How messages name this worker: ``stage 1``, or ``stage 1 tp rank 0`` with tp > 1."""
        return f"stage {self.pp_rank}" + (f" tp rank {self.tp_rank}" if self.tp_size > 1 else "")

    @property
    def num_layers(self) -> int:
        """Layers owned by this stage."""
        return self.end_layer - self.start_layer

    @property
    def layer_range(self) -> range:
        """Global indices of the layers owned."""
        return range(self.start_layer, self.end_layer)

    @classmethod
    def from_partition(cls, partition: list[int], pp_rank: int, tp_rank: int = 0, tp_size: int = 1) -> StageLayout:
        """Layout of worker ``(pp_rank, tp_rank)`` given per-stage layer counts."""
        start = sum(partition[:pp_rank])
        return cls(pp_rank, len(partition), start, start + partition[pp_rank], tp_rank, tp_size)

    @classmethod
    def of_global_rank(cls, partition: list[int], rank: int, tp_size: int) -> StageLayout:
        """Layout of the worker with global rank ``rank`` (``pp_rank * tp_size + tp_rank``)."""
        return cls.from_partition(partition, rank // tp_size, rank % tp_size, tp_size)

    @classmethod
    def single(cls, num_layers: int) -> StageLayout:
        """The whole model in one stage."""
        return cls(0, 1, 0, num_layers)
