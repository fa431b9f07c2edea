"""Cross-attention over a per-request encoder output: its cache home and its metadata.

An encoder-decoder model (Whisper) computes each decoder layer's cross-attention K/V once per
request, from the encoder output, and keeps them until the request ends.  They live in a
*cross cache* per decoder layer, apart from the paged self-attention cache:
``[2, num_cross_slots, num_heads, max_source_positions, head_dim]`` (index 0 K, 1 V), one slot
per running request.  Slot 0 is reserved and never handed out, so a padding row may point at
it and read nothing that matters (its ``encoder_seq_lens`` is 0).

:class:`CrossAttentionMetadata` is the step's per-request view of that cache; it rides on
``AttentionMetadata.cross`` so every attention module of a step — eager, piecewise cut or full
graph — gets the cross lengths and slots next to the self-attention ones.  Its tensors are
``[num_reqs_padded]``: real rows first, padding rows zero (DESIGN contract 4).

:func:`cross_attention` is written with fixed shapes and no host reads, so it is safe under
CUDA-graph capture, and it runs on any device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class CrossAttentionMetadata:
    """Per-request cross-attention metadata for one step (views of persistent buffers in V2)."""

    encoder_seq_lens: torch.Tensor
    """[num_reqs_padded] int32: encoder positions each request attends to (0 for padding)."""
    cross_slots: torch.Tensor
    """[num_reqs_padded] int32: each request's slot in the cross caches (0 for padding)."""


def request_of_token(query_start_loc: torch.Tensor, num_tokens_padded: int) -> torch.Tensor:
    """Row of the request each token belongs to, ``[num_tokens_padded]`` int64.

    Padding tokens past the last real one map to the last row (a padding row or a real one:
    either way their output is discarded)."""
    ends = query_start_loc[1:].to(torch.int64)
    tokens = torch.arange(num_tokens_padded, device=query_start_loc.device)
    rows = torch.searchsorted(ends, tokens, right=True)
    return rows.clamp_(max=ends.shape[0] - 1)


def write_cross_kv(
    cross_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    """Store requests' cross K/V (``[num_new, num_heads, source_len, head_dim]``) in their slots."""
    source_len = k.shape[2]
    cross_cache[0, slots, :, :source_len] = k.to(cross_cache.dtype)
    cross_cache[1, slots, :, :source_len] = v.to(cross_cache.dtype)


def cross_attention(
    q: torch.Tensor,
    cross_cache: torch.Tensor,
    cross: CrossAttentionMetadata,
    query_start_loc: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Attend each token's ``q [T, H, D]`` over its request's encoder K/V; returns ``[T, H, D]``.

    Rows whose request has ``encoder_seq_lens`` 0 (padding) return zeros.
    """
    num_tokens = q.shape[0]
    source_len = cross_cache.shape[3]
    rows = request_of_token(query_start_loc, num_tokens)
    slots = cross.cross_slots.to(torch.int64)[rows]
    lens = cross.encoder_seq_lens[rows]
    k = cross_cache[0].index_select(0, slots)  # [T, H, S, D]
    v = cross_cache[1].index_select(0, slots)
    positions = torch.arange(source_len, device=q.device)
    # A row with no encoder positions would softmax over nothing (NaN): let it see one, then
    # zero its output.
    mask = positions[None, :] < lens.clamp(min=1)[:, None]  # [T, S]
    out = F.scaled_dot_product_attention(
        q.unsqueeze(2), k, v, attn_mask=mask[:, None, None, :], scale=scale
    )  # [T, H, 1, D]
    return out.squeeze(2) * (lens > 0).to(q.dtype)[:, None, None]
