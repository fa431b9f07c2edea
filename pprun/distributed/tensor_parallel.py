"""``TensorParallel``: a worker's place in its stage's tensor-parallel group, and its collectives.

Passed explicitly to the model and the loader (never a process-wide global group). The group is
gloo on CPU and NCCL on GPU; every collective here is a plain ``torch.distributed`` call on that
group, so on GPU the all-reduce is captured inside CUDA graphs like any kernel.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


@dataclass(frozen=True)
class TensorParallel:
    """This worker's place in its stage's tensor-parallel group: one explicit value, never a global."""

    rank: int
    """0..size-1 inside the stage."""
    size: int
    """``tensor_parallel_size``."""
    group: ProcessGroup | None = None
    """The stage's tp group (gloo on CPU, NCCL on GPU); None when size == 1."""

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.size}")
        if not 0 <= self.rank < self.size:
            raise ValueError(f"tp rank {self.rank} outside 0..{self.size - 1}")
        if self.size > 1 and self.group is None:
            raise ValueError(f"tensor_parallel_size={self.size} needs a process group, got None")

    @classmethod
    def single(cls) -> TensorParallel:
        """No tensor parallelism: size 1, every collective a no-op."""
        return cls(0, 1, None)

    @property
    def is_first(self) -> bool:
        """tp rank 0: the rank that samples and talks to the driver."""
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` in place over the group and return it; no-op at size 1."""
        if self.size == 1:
            return x
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's ``x`` (same shape on all ranks) along ``dim``, in rank order."""
        if self.size == 1:
            return x
        x = x.contiguous()
        if x.is_cuda:
            # One buffer, ranks stacked on a new leading dim (capturable in CUDA graphs).
            out = torch.empty((self.size, *x.shape), dtype=x.dtype, device=x.device)
            dist.all_gather_into_tensor(out, x, group=self.group)
            parts = out.unbind(0)
        else:
            parts = [torch.empty_like(x) for _ in range(self.size)]
            dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=dim)

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Overwrite ``x`` on every rank with tp rank ``src``'s ``x`` (in place) and return it."""
        if self.size == 1:
            return x
        dist.broadcast(x, group_src=src, group=self.group)
        return x

    def shard(self, n: int, what: str) -> int:
        """``n // size``, refusing a ``n`` the group does not divide (``what`` names the quantity)."""
        if n % self.size:
            raise ValueError(f"tensor_parallel_size={self.size} does not divide {what}={n}")
        return n // self.size

    def __repr__(self) -> str:
        return f"TensorParallel(rank={self.rank}, size={self.size})"
