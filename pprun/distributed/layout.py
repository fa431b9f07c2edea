"""The pipeline layout of one stage: one explicit value passed down, never a global."""

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

    @property
    def is_first(self) -> bool:
        """The first stage owns the embedding and receives token ids."""
        return self.pp_rank == 0

    @property
    def is_last(self) -> bool:
        """The last stage owns the final norm and LM head, and samples."""
        return self.pp_rank == self.pp_size - 1

    @property
    def num_layers(self) -> int:
        """Layers owned by this stage."""
        return self.end_layer - self.start_layer

    @property
    def layer_range(self) -> range:
        """Global indices of the layers owned."""
        return range(self.start_layer, self.end_layer)

    @classmethod
    def from_partition(cls, partition: list[int], pp_rank: int) -> StageLayout:
        """Layout of stage ``pp_rank`` given per-stage layer counts."""
        start = sum(partition[:pp_rank])
        return cls(pp_rank, len(partition), start, start + partition[pp_rank])

    @classmethod
    def single(cls, num_layers: int) -> StageLayout:
        """The whole model in one stage."""
        return cls(0, 1, 0, num_layers)
