"""Attention backends: the reference (any device) and the Triton one (CUDA).

A backend is one function ``forward(q, k, v, kv_cache, meta, scale) -> out`` that writes this
step's keys and values into the paged cache and attends over it.  Layouts:
``q [num_tokens_padded, num_heads, head_dim]``, ``k``/``v`` ``[num_tokens_padded,
num_kv_heads, head_dim]``, ``kv_cache [2, num_blocks, block_size, num_kv_heads, head_dim]``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from pprun.attention.metadata import AttentionMetadata

BACKENDS = ("reference", "triton")


class AttentionBackend(Protocol):
    """Signature every backend implements."""

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor: ...


def reference_backend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Exact, readable attention over the paged cache; loops over requests (not capture-safe)."""
    from pprun.attention.ref_ops import paged_attention_ref, write_kv_cache

    write_kv_cache(k, v, kv_cache, meta.slot_mapping)
    return paged_attention_ref(
        q, kv_cache, meta.query_start_loc, meta.seq_lens, meta.block_table, scale, meta.num_reqs
    )


def triton_backend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Triton paged attention: flash-decoding for decode steps, varlen flash for prefill."""
    from pprun.attention.triton_ops import paged_attention

    out = torch.empty_like(q)
    paged_attention(
        q,
        k,
        v,
        kv_cache,
        meta.slot_mapping,
        meta.query_start_loc,
        meta.seq_lens,
        meta.block_table,
        scale,
        out,
        meta.max_query_len,
    )
    return out


def get_backend(name: str, device: torch.device) -> Callable[..., torch.Tensor]:
    """Return the backend ``name`` ("auto" picks triton on CUDA when importable)."""
    if name == "auto":
        name = "reference"
        if device.type == "cuda":
            try:
                import triton  # noqa: F401

                name = "triton"
            except ImportError:
                pass
    if name == "reference":
        return reference_backend
    if name == "triton":
        if device.type != "cuda":
            raise ValueError(f"attention backend 'triton' needs a CUDA device, got {device}")
        return triton_backend
    raise ValueError(f"attention backend {name!r} is unknown; choose one of {BACKENDS} or 'auto'")
