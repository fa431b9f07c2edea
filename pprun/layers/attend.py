"""Paged attention over a fused q/k/v projection: which kernels a step's attention takes.

A model computes ``qkv = qkv_proj(x)`` and then ``attend(...)``; this module decides whether the
step takes the one-kernel decode (rotary, cache write, attention and split merge in one launch,
which also merges the projection's split-K partials as it reads q, k and v) or rotary (one
kernel where the fused ops run, the model's own torch elsewhere) followed by the backend.
:func:`attention_input` tells ``pprun.models.llama.Attention.forward_fused`` which of the two reads the projection.
"""

from __future__ import annotations

from typing import Protocol

import torch

import pprun.layers as layers
from pprun.attention.backend import AttentionBackend, RopeDecode
from pprun.attention.metadata import AttentionMetadata
from pprun.kernels.partials import SplitPartials
from pprun.layers import fused_decode_enabled


class Rotary(Protocol):
    """Rotary embedding tables and their plain application (a model's own)."""

    cos: torch.Tensor
    sin: torch.Tensor

    def __call__(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


def decode_kernel(backend: AttentionBackend, meta: AttentionMetadata, x: torch.Tensor) -> RopeDecode | None:
    """The backend's one-kernel decode step (``backend.rope_decode``; None where it has none)
    when this step takes it: a pure decode step on the fused path; else None."""
    rope_decode = backend.rope_decode
    if rope_decode is not None and meta.max_query_len == 1 and fused_decode_enabled(x):
        return rope_decode
    return None


def attention_input(backend: AttentionBackend, meta: AttentionMetadata, x: torch.Tensor) -> str | None:
    """What consumes the q/k/v projection of ``x``: ``"attention"`` when the step's attention is
    the one-kernel decode (it takes split partials, ``linear(..., then=...)``), else None."""
    return "attention" if decode_kernel(backend, meta, x) is not None else None


def attend(
    backend: AttentionBackend,
    rotary: Rotary,
    positions: torch.Tensor,
    qkv: torch.Tensor | SplitPartials,
    kv_cache: torch.Tensor | None,
    meta: AttentionMetadata,
    scale: float,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
) -> torch.Tensor:
    """Attention of the ``[T, (num_heads + 2 * num_kv_heads) * head_dim]`` projection ``qkv``
    (or its unmerged partials) over the paged cache: rotary on q and k, the new k/v written to
    ``kv_cache``, and the ``[T, num_heads * head_dim]`` output."""
    parts = qkv if isinstance(qkv, SplitPartials) else None
    src = parts.parts[0] if parts is not None else qkv
    num_tokens = src.shape[0]
    rope_decode = decode_kernel(backend, meta, src)
    if parts is not None and rope_decode is None:
        src, parts = parts.merge(), None
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    q, k, v = src.split([q_size, kv_size, kv_size], dim=-1)
    q = q.view(num_tokens, num_heads, head_dim)
    k = k.view(num_tokens, num_kv_heads, head_dim)
    v = v.view(num_tokens, num_kv_heads, head_dim)
    if rope_decode is not None:
        # One kernel: rotary, cache write, attention (see pprun.attention.backend).
        extra = {"qkv_parts": parts} if parts is not None else {}
        out = rope_decode(q, k, v, rotary.cos, rotary.sin, positions, kv_cache, meta, scale, **extra)
    else:
        fused = layers.fused_ops_for(q)
        if fused is not None:  # in place on the views, one launch
            q, k = fused.rotary_qk(q, k, rotary.cos, rotary.sin, positions)
        else:
            q, k = rotary(positions, q, k)
        out = backend(q, k, v, kv_cache, meta, scale)
    return out.reshape(num_tokens, q_size)
