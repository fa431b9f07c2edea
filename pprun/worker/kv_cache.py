"""Per-stage KV-cache sizing and allocation (a stage allocates blocks for its own layers only)."""

from __future__ import annotations

import math
import mmap

import torch

from pprun.models.hf_config import ModelArchConfig

HEAD_MAJOR = False
"""Store each block's tokens head by head (``[2, num_blocks, num_kv_heads, block_size,
head_dim]`` in memory) while the tensor keeps its logical ``[2, num_blocks, block_size,
num_kv_heads, head_dim]`` shape: one KV head's rows of a block are then contiguous instead of
``num_kv_heads * head_dim`` elements apart.  Every kernel and the reference take the cache by its
strides, so only the bytes' order changes; ``scripts/gpu_speed.py --ab --ab-only HEAD_MAJOR``
measures it."""


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero-filled cache tensor.  On CPU it lives in an anonymous memory mapping, which the
    kernel hands out zeroed page by page on first touch: a stage's start-up does not write its
    whole cache budget (1 GiB by default), and pages of blocks never used cost nothing."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    numel = math.prod(shape)
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype, count=numel).view(shape)


def kv_heads_per_rank(arch: ModelArchConfig, tp_size: int) -> int:
    """KV heads one tensor-parallel rank caches: its share of them, or one (replicated) where
    ``tp_size`` exceeds them (``pprun.layers.parallel_linear.kv_heads_per_rank``)."""
    from pprun.layers.parallel_linear import kv_heads_per_rank as per_rank

    return per_rank(arch.num_key_value_heads, tp_size)


def bytes_per_block(arch: ModelArchConfig, num_layers: int, block_size: int, dtype: torch.dtype,
                    tp_size: int = 1) -> int:
    """Bytes one KV block costs on one tp rank of a stage owning ``num_layers`` layers (keys and
    values of the rank's KV heads)."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * block_size * kv_heads_per_rank(arch, tp_size) * arch.head_dim * elem


def allocate_kv_caches(
    arch: ModelArchConfig,
    num_layers: int,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    tp_size: int = 1,
) -> list[torch.Tensor]:
    """One ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` tensor per owned layer
    (``num_kv_heads``: this tp rank's, :func:`kv_heads_per_rank`).

    Zero-filled so that the reserved null block 0 (target of padded CUDA-graph rows) holds
    finite values.  With :data:`HEAD_MAJOR` the same logical shape over head-major storage.
    """
    heads, dim = kv_heads_per_rank(arch, tp_size), arch.head_dim
    if HEAD_MAJOR:
        shape = (2, num_blocks, heads, block_size, dim)
        return [zeros(shape, dtype, device).transpose(2, 3) for _ in range(num_layers)]
    shape = (2, num_blocks, block_size, heads, dim)
    return [zeros(shape, dtype, device) for _ in range(num_layers)]


def allocate_cross_caches(
    model: torch.nn.Module, num_cross_slots: int, dtype: torch.dtype, device: torch.device
) -> list[torch.Tensor]:
    """One cross-attention cache per owned decoder layer of an encoder-decoder ``model``
    (``model.cross_cache_shape``, see ``pprun.attention.cross``), zero-filled so the reserved
    slot 0 that padding rows point at holds finite values."""
    shape = model.cross_cache_shape(num_cross_slots)
    return [zeros(tuple(shape), dtype, device) for _ in range(len(model.layers))]


def bytes_per_cross_slot(model: torch.nn.Module, dtype: torch.dtype) -> int:
    """Bytes one request's cross K/V cost on a stage (all its decoder layers)."""
    elem = torch.empty((), dtype=dtype).element_size()
    numel = 1
    for dim in model.cross_cache_shape(1):
        numel *= dim
    return numel * elem * len(model.layers)
