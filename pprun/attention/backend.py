"""Attention backends: the reference (any device) and the Triton one (CUDA).

A backend is one function ``forward(q, k, v, kv_cache, meta, scale) -> out`` that writes this
step's keys and values into the paged cache and attends over it.  Layouts:
``q [num_tokens_padded, num_heads, head_dim]``, ``k``/``v`` ``[num_tokens_padded,
num_kv_heads, head_dim]``, ``kv_cache [2, num_blocks, block_size, num_kv_heads, head_dim]``.

Every backend also carries a ``rope_decode`` attribute (:class:`AttentionBackend`): None, or a
function that does a pure decode step (``meta.max_query_len == 1``) with the rotary embedding
folded in, from the un-rotated q and k (see :func:`triton_rope_decode`).  Attention layers call
it when it is set (``pprun.layers.attend``), and otherwise rotate q and k themselves before
calling the backend.  It takes ``qkv_parts=``: a decode-sized qkv matmul's unmerged split-K
partials (``pprun.layers.SplitPartials``), which q, k and v are then float32 views of.
"""

from __future__ import annotations

from typing import Protocol

import torch

from pprun.attention.metadata import AttentionMetadata
from pprun.kernels.partials import SplitPartials

BACKENDS = ("reference", "triton")


class RopeDecode(Protocol):
    """A backend's one-kernel decode step: rotary, cache write and attention (see
    :func:`triton_rope_decode`)."""

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cos: torch.Tensor | None,
        sin: torch.Tensor | None,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        qkv_parts: SplitPartials | None = None,
    ) -> torch.Tensor: ...


class AttentionBackend(Protocol):
    """What every backend is: the attention call, and its one-kernel decode step or None."""

    rope_decode: RopeDecode | None
    """The one-kernel decode step, or None where the backend has none (the layer then rotates q
    and k itself and calls the backend)."""

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
        num_leading_decodes=meta.num_leading_decodes,
    )
    return out


def triton_rope_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    positions: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    qkv_parts: SplitPartials | None = None,
) -> torch.Tensor:
    """A decode step in one kernel: rotary, cache write, attention and split merge (CUDA);
    with ``qkv_parts`` also the merge of the qkv matmul's split-K partials, which ``q``, ``k``
    and ``v`` are views of."""
    from pprun.attention.triton_ops import paged_decode_attention_rope

    if meta.max_query_len != 1:
        raise ValueError(f"rope_decode serves decode steps only, got max_query_len={meta.max_query_len}")
    return paged_decode_attention_rope(
        q,
        k,
        v,
        cos,
        sin,
        positions,
        kv_cache,
        meta.slot_mapping,
        meta.block_table,
        meta.seq_lens,
        scale,
        torch.empty(q.shape, dtype=qkv_parts.dtype if qkv_parts is not None else q.dtype, device=q.device),
        qkv_parts=qkv_parts,
    )


reference_backend.rope_decode = None  # type: ignore[attr-defined]
triton_backend.rope_decode = triton_rope_decode  # type: ignore[attr-defined]


def get_backend(name: str, device: torch.device) -> AttentionBackend:
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
