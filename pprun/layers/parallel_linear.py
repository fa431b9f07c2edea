"""Tensor-parallel layers: each tp rank of a stage holds its shard of a linear or an embedding.

Megatron's split, as vLLM and gpt-fast apply it:

- :class:`ColumnParallelLinear`: this rank's output rows of one or several checkpoint linears
  fused into one matmul (q/k/v: its query heads and its KV heads; gate/up: its slice of the
  intermediate width).  The output stays split; no communication.
- :class:`RowParallelLinear`: this rank's input columns (o_proj, down_proj): a partial sum,
  all-reduced over the group, the bias added once after the sum.  One all-reduce per attention
  block and per MLP block.
- :class:`VocabParallelEmbedding` and :class:`ParallelLMHead`: ``ceil(vocab / tp)`` rows per rank
  (the last rank's tail zero-padded).  The embedding looks up the ids it holds, zeroes the rest
  and all-reduces; the head all-gathers its logits and drops the padding columns.

What a rank reads of each checkpoint tensor is a :class:`Shard` (a row or column range); the
checkpoint reader slices it out of the file (``CheckpointIndex.iter_tensors(shards=...)``), so
a rank reads only its part.  At ``tp.size == 1`` models build plain ``nn.Linear`` /
``nn.Embedding`` instead (``LinearFactory``), and nothing here runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from pprun.layers.embedding import Embedding


class TensorParallel(Protocol):
    """What these layers use of a worker's tensor-parallel group: its place and two collectives
    (``pprun.distributed.tensor_parallel.TensorParallel``, a package above this one)."""

    rank: int
    size: int

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor: ...
    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor: ...
    def shard(self, n: int, what: str) -> int: ...


@dataclass(frozen=True)
class Shard:
    """The part of a checkpoint tensor one tp rank reads: ``size`` rows (``dim=0``) or columns
    (``dim=1``) from ``start``."""

    dim: int
    start: int
    size: int

    def index(self) -> tuple[slice, ...]:
        """The slice of the stored tensor (for ``safetensors``' ``get_slice`` or a tensor)."""
        span = slice(self.start, self.start + self.size)
        return (span,) if self.dim == 0 else (slice(None), span)

    def of(self, tensor: torch.Tensor) -> torch.Tensor:
        """This shard of a whole tensor (a view)."""
        return tensor[self.index()]


def split(n: int, tp: TensorParallel, dim: int = 0) -> Shard:
    """Rank ``tp.rank``'s equal part of ``n`` (``tp.size`` divides ``n``: checked at config time
    by ``check_tensor_parallel``)."""
    size = tp.shard(n, "a split width")
    return Shard(dim, tp.rank * size, size)


def kv_heads_per_rank(num_kv_heads: int, tp_size: int) -> int:
    """KV heads each rank holds: split when ``tp_size`` divides them, one (replicated) when
    ``tp_size`` exceeds them."""
    return max(1, num_kv_heads // tp_size)


def kv_head_shard(num_kv_heads: int, head_dim: int, tp: TensorParallel) -> Shard:
    """The rows of k_proj / v_proj rank ``tp.rank`` reads: its KV heads, or, where tp exceeds the
    KV heads, the one KV head its query heads attend to (ranks ``tp / kv`` apart share it)."""
    per_rank = kv_heads_per_rank(num_kv_heads, tp.size)
    first = tp.rank * num_kv_heads // tp.size
    return Shard(0, first * head_dim, per_rank * head_dim)


class ColumnParallelLinear(nn.Linear):
    """This rank's output rows of ``modules`` (checkpoint linears fused into one matmul, each
    contributing its :class:`Shard`'s rows, in order); ``forward`` is ``nn.Linear``'s."""

    def __init__(self, modules: list[str], in_features: int, shards: list[Shard], bias: bool) -> None:
        super().__init__(in_features, sum(s.size for s in shards), bias=bias)
        self.shards = dict(zip(modules, shards, strict=True))
        """Checkpoint module -> the rows of its tensors this rank reads."""
        offsets = [0]
        for s in shards[:-1]:
            offsets.append(offsets[-1] + s.size)
        self.row_offsets = dict(zip(modules, offsets, strict=True))
        """Checkpoint module -> where its rows start in this layer's weight."""


class RowParallelLinear(nn.Linear):
    """This rank's input columns of one checkpoint linear: ``x`` is this rank's split of the
    input, the product a partial sum all-reduced over the group, the bias added after the sum."""

    def __init__(
        self, module: str, in_features: int, out_features: int, bias: bool, tp: TensorParallel
    ) -> None:
        super().__init__(tp.shard(in_features, f"{module}'s input width"), out_features, bias=bias)
        self.tp = tp
        self.shards = {module: split(in_features, tp, dim=1)}
        """Checkpoint module -> the columns of its weight this rank reads (the bias: whole)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``all_reduce(x W_r^T) + b``."""
        out = self.tp.all_reduce(F.linear(x, self.weight))
        return out if self.bias is None else out + self.bias


def vocab_shard(vocab_size: int, tp: TensorParallel) -> tuple[int, Shard]:
    """``(rows per rank, the checkpoint rows this rank reads)``: ``ceil(vocab / tp)`` rows per
    rank, the last rank's tail past the vocabulary left as zero padding."""
    rows = -(-vocab_size // tp.size)
    start = min(tp.rank * rows, vocab_size)
    return rows, Shard(0, start, min(rows, vocab_size - start))


class VocabParallelEmbedding(nn.Module):
    """This rank's rows of the embedding table: each id is looked up on the rank that holds it
    and the rows summed over the group (one all-reduce)."""

    def __init__(self, vocab_size: int, embedding_dim: int, tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        rows, self.shard = vocab_shard(vocab_size, tp)
        self.vocab_start = self.shard.start
        self.weight = nn.Parameter(torch.empty(rows, embedding_dim))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``[T] -> [T, hidden]``."""
        local = input_ids - self.vocab_start
        mine = (local >= 0) & (local < self.shard.size)
        out = F.embedding(torch.where(mine, local, 0), self.weight)
        out = out * mine.unsqueeze(-1).to(out.dtype)
        return self.tp.all_reduce(out)


class ParallelLMHead(nn.Module):
    """This rank's vocabulary rows of the LM head: local logits all-gathered over the group, the
    padding columns dropped, so every rank holds the full ``[rows, vocab]`` logits."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        rows, self.shard = vocab_shard(vocab_size, tp)
        self.weight = nn.Parameter(torch.empty(rows, hidden_size))

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[rows, hidden] -> [rows, vocab]``."""
        logits = self.tp.all_gather(F.linear(hidden_states, self.weight), dim=-1)
        if logits.shape[-1] == self.vocab_size:
            return logits
        return logits[..., : self.vocab_size].contiguous()


def vocab_embedding(vocab_size: int, hidden_size: int, tp: TensorParallel) -> nn.Module:
    """The token embedding: a plain table at tp 1, else this rank's :class:`VocabParallelEmbedding`."""
    if tp.size == 1:
        return Embedding(vocab_size, hidden_size)
    return VocabParallelEmbedding(vocab_size, hidden_size, tp)


def lm_head(vocab_size: int, hidden_size: int, tp: TensorParallel) -> nn.Module:
    """The LM head: a plain ``nn.Linear`` at tp 1, else this rank's :class:`ParallelLMHead`."""
    if tp.size == 1:
        return nn.Linear(hidden_size, vocab_size, bias=False)
    return ParallelLMHead(vocab_size, hidden_size, tp)


def load_vocab_rows(weight: torch.Tensor, tensor: torch.Tensor) -> None:
    """Copy a vocabulary shard (or the whole table at tp 1) into ``weight``'s first rows; padding
    rows past the vocabulary are zeroed (an embedding masks them by multiplying, so they must be
    finite)."""
    rows = tensor.shape[0]
    weight.data[:rows].copy_(tensor)
    weight.data[rows:].zero_()


def linear_shards(layer: nn.Module) -> dict[str, Shard]:
    """``checkpoint tensor name -> Shard`` of a (possibly) parallel linear: a column layer's
    weights and biases by rows, a row layer's weight by columns (its bias is read whole); empty
    for a whole layer (tp 1)."""
    out: dict[str, Shard] = {}
    if isinstance(layer, (ColumnParallelLinear, RowParallelLinear)):
        for module, shard in layer.shards.items():
            out[f"{module}.weight"] = shard
            if layer.bias is not None and shard.dim == 0:
                out[f"{module}.bias"] = shard
    return out
