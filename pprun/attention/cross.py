"""Cross-attention over a per-request encoder output: its cache home and its metadata.

An encoder-decoder model (Whisper) computes each decoder layer's cross-attention K/V once per
request, from the encoder output, and keeps them until the request ends.  They live in a
*cross cache* per decoder layer, apart from the paged self-attention cache:
``[2, num_cross_slots, max_source_positions, num_heads, head_dim]`` (index 0 K, 1 V), one slot
per running request: the paged cache's layout, a slot being one block of
``max_source_positions`` (or, viewed, several pages of a power-of-two size, see
:func:`cross_decode_attention`).  Slot 0 is reserved and never handed out, so a padding row may point at
it and read nothing that matters (its ``encoder_seq_lens`` is 0).

:class:`CrossAttentionMetadata` is the step's per-request view of that cache; it rides on
``AttentionMetadata.cross`` so every attention module of a step — eager, piecewise cut or full
graph — gets the cross lengths and slots next to the self-attention ones.  Its tensors are
``[num_reqs_padded]``: real rows first, padding rows zero (DESIGN contract 4).

:func:`cross_attention` is written with fixed shapes and no host reads, so it is safe under
CUDA-graph capture, and it runs on any device: it gathers each token's request's K/V, then
attends.  On a GPU, a step whose query rows are its request rows (a decode step, eager or a full
graph: ``CrossAttentionMetadata.one_query_per_row``) runs :func:`cross_decode_attention`
instead, the paged decode kernel reading each slot in place (no gather).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pprun.switches import enabled_unless

CROSS_DECODE_KERNEL_ENABLED: bool = enabled_unless("PPRUN_DISABLE_CROSS_DECODE_KERNEL")
"""Whether GPU decode steps attend over the cross caches in place (:func:`cross_decode_attention`);
``PPRUN_DISABLE_CROSS_DECODE_KERNEL=1`` gathers and attends as on a CPU (the A/B switch)."""


@dataclass
class CrossAttentionMetadata:
    """Per-request cross-attention metadata for one step (views of persistent buffers in V2)."""

    encoder_seq_lens: torch.Tensor
    """[num_reqs_padded] int32: encoder positions each request attends to (0 for padding)."""
    cross_slots: torch.Tensor
    """[num_reqs_padded] int32: each request's slot in the cross caches (0 for padding)."""
    one_query_per_row: bool = False
    """Query row ``i`` is request row ``i``'s only token (a uniform decode step, padded rows
    included): set by the V2 plug-in for such eager steps and for full-graph capture, never for
    piecewise graphs (their segments replay for any batch); the GPU then attends in place."""


def cross_page_size(source_len: int) -> int:
    """The page a slot of ``source_len`` positions is viewed in for the paged decode kernel: the
    largest power of two dividing it, at most 64 (1500 positions: pages of 4)."""
    page = 1
    while page < 64 and source_len % (2 * page) == 0:
        page *= 2
    return page


def cross_decode_attention(
    q: torch.Tensor, cross_cache: torch.Tensor, cross: CrossAttentionMetadata, scale: float
) -> torch.Tensor:
    """``q [num_reqs_padded, H, D]``, row ``i`` request ``i``'s one token, attended over its slot
    by the paged decode kernel (``pprun.attention.triton_ops.paged_decode_attention``): the
    cache viewed as pages of :func:`cross_page_size`, each request's block table its slot's
    pages in order, its context ``encoder_seq_lens`` (0: a padding row, zeros).  Fixed shapes,
    device-side block tables: capture-safe."""
    from pprun.attention.triton_ops import paged_decode_attention

    _, num_slots, source_len, heads, head_dim = cross_cache.shape
    page = cross_page_size(source_len)
    pages = source_len // page
    paged = cross_cache.view(2, num_slots * pages, page, heads, head_dim)
    offsets = torch.arange(pages, dtype=torch.int32, device=q.device)
    block_table = cross.cross_slots[:, None] * pages + offsets[None, :]
    return paged_decode_attention(q, paged, block_table, cross.encoder_seq_lens, scale, torch.empty_like(q))


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
    """Store requests' cross K/V (``[num_new, source_len, num_heads, head_dim]``) in their slots."""
    source_len = k.shape[1]
    cross_cache[0, slots, :source_len] = k.to(cross_cache.dtype)
    cross_cache[1, slots, :source_len] = v.to(cross_cache.dtype)


def cross_attention(
    q: torch.Tensor,
    cross_cache: torch.Tensor,
    cross: CrossAttentionMetadata,
    query_start_loc: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Attend each token's ``q [T, H, D]`` over its request's encoder K/V; returns ``[T, H, D]``.

    Rows whose request has ``encoder_seq_lens`` 0 (padding) return zeros.  On a GPU with one
    query per request row (``cross.one_query_per_row``, and as many query rows as request rows)
    this is :func:`cross_decode_attention`.
    """
    num_tokens = q.shape[0]
    if (cross.one_query_per_row and q.is_cuda and num_tokens == cross.cross_slots.shape[0]
            and CROSS_DECODE_KERNEL_ENABLED):
        return cross_decode_attention(q, cross_cache, cross, scale)
    source_len = cross_cache.shape[2]
    rows = request_of_token(query_start_loc, num_tokens)
    slots = cross.cross_slots.to(torch.int64)[rows]
    lens = cross.encoder_seq_lens[rows]
    k = cross_cache[0].index_select(0, slots).transpose(1, 2)  # [T, H, S, D]
    v = cross_cache[1].index_select(0, slots).transpose(1, 2)
    positions = torch.arange(source_len, device=q.device)
    # A row with no encoder positions would softmax over nothing (NaN): let it see one, then
    # zero its output.
    mask = positions[None, :] < lens.clamp(min=1)[:, None]  # [T, S]
    out = F.scaled_dot_product_attention(
        q.unsqueeze(2), k, v, attn_mask=mask[:, None, None, :], scale=scale
    )  # [T, H, 1, D]
    return out.squeeze(2) * (lens > 0).to(q.dtype)[:, None, None]
