"""Pure-torch paged attention: the correctness reference and pprun's CPU backend.

Readable rather than fast.  It loops over requests, gathers each request's K/V from its
cache blocks and runs a dense causal attention with the chunked-prefill offset.  The
host reads ``query_start_loc`` and ``seq_lens`` (it syncs), so it is never used under
CUDA-graph capture; the Triton backend in ``triton_ops`` is the one for graphs.

Layouts (shared with ``triton_ops``):

- ``kv_cache``: ``[2, num_blocks, block_size, num_kv_heads, head_dim]``; index 0 holds K,
  index 1 holds V.  Block 0 is a reserved null block.  A token's slot is
  ``block_id * block_size + offset``.
- ``q``: ``[num_tokens_padded, num_heads, head_dim]``; ``k``/``v``:
  ``[num_tokens_padded, num_kv_heads, head_dim]``.
- ``query_start_loc``: ``[num_reqs_padded + 1]`` cumulative query lengths (padded
  requests have length 0); ``seq_lens``: ``[num_reqs_padded]`` context length after this
  step's tokens (0 for padded requests); ``block_table``:
  ``[num_reqs_padded, max_num_blocks_per_req]``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_SDPA_HAS_GQA = "enable_gqa" in (F.scaled_dot_product_attention.__doc__ or "")
"""torch >= 2.5: SDPA takes grouped K/V heads directly (one fused kernel, about twice as fast
as the einsums on CPU; the same fp32 math up to summation order)."""


def check_kv_cache(kv_cache: torch.Tensor, num_kv_heads: int, head_dim: int) -> None:
    """Raise ValueError unless ``kv_cache`` has the paged layout for these heads."""
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise ValueError(
            f"kv_cache must have shape [2, num_blocks, block_size, num_kv_heads, head_dim], "
            f"got {tuple(kv_cache.shape)}"
        )
    if kv_cache.shape[3] != num_kv_heads or kv_cache.shape[4] != head_dim:
        raise ValueError(
            f"kv_cache heads/head_dim {tuple(kv_cache.shape[3:])} do not match the "
            f"inputs' (num_kv_heads={num_kv_heads}, head_dim={head_dim})"
        )


def write_kv_cache(
    k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write each token's K/V into its cache slot in place; tokens with slot < 0 are skipped.

    Args:
        k, v: ``[num_tokens_padded, num_kv_heads, head_dim]``.
        kv_cache: ``[2, num_blocks, block_size, num_kv_heads, head_dim]``.
        slot_mapping: ``[num_tokens_padded]`` int64; -1 marks padded tokens.
    """
    if k.shape != v.shape or k.dim() != 3:
        raise ValueError(f"k and v must share a 3-d shape, got k={tuple(k.shape)} v={tuple(v.shape)}")
    if slot_mapping.shape != (k.shape[0],):
        raise ValueError(
            f"slot_mapping must have shape ({k.shape[0]},) (one slot per token), "
            f"got {tuple(slot_mapping.shape)}"
        )
    check_kv_cache(kv_cache, k.shape[1], k.shape[2])
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    block_size = kv_cache.shape[2]
    # (block, offset) indexing, not a flat view: the cache may be stored head-major
    # (pprun.worker.kv_cache.HEAD_MAJOR), where blocks x offsets is not one dimension.
    blocks, offsets = slots // block_size, slots % block_size
    kv_cache[0, blocks, offsets] = k[valid].to(kv_cache.dtype)
    kv_cache[1, blocks, offsets] = v[valid].to(kv_cache.dtype)


def paged_attention_ref(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
    num_reqs: int,
) -> torch.Tensor:
    """Causal paged attention over the first ``num_reqs`` requests, computed in fp32.

    Query token ``j`` of a request with ``qlen`` query tokens and context ``seq_len`` sees
    context positions ``< seq_len - qlen + j + 1``.  Head ``i`` reads KV head
    ``i // (num_heads // num_kv_heads)``.

    Returns:
        ``[num_tokens_padded, num_heads, head_dim]`` in ``q.dtype``; rows of tokens that
        belong to no real request are zero.
    """
    if q.dim() != 3:
        raise ValueError(f"q must be [num_tokens_padded, num_heads, head_dim], got {tuple(q.shape)}")
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = kv_cache.shape[3] if kv_cache.dim() == 5 else -1
    check_kv_cache(kv_cache, num_kv_heads, head_dim)
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads}")
    if not 0 <= num_reqs <= seq_lens.shape[0]:
        raise ValueError(f"num_reqs={num_reqs} must be in [0, {seq_lens.shape[0]}] (num_reqs_padded)")
    group = num_heads // num_kv_heads
    block_size = kv_cache.shape[2]
    k_cache, v_cache = kv_cache[0], kv_cache[1]

    out = torch.zeros_like(q)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    if num_reqs and all(starts[r + 1] - starts[r] == 1 for r in range(num_reqs)):
        _decode_batched(q, k_cache, v_cache, block_table, lens[:num_reqs], starts, scale, out)
        return out
    for req in range(num_reqs):
        q_start, q_end, seq_len = starts[req], starts[req + 1], lens[req]
        query_len = q_end - q_start
        if query_len == 0:
            continue
        if seq_len < query_len:
            raise ValueError(
                f"request {req}: seq_len={seq_len} is shorter than its query_len={query_len}; "
                "seq_lens must count the context including this step's tokens"
            )
        num_blocks = -(-seq_len // block_size)
        blocks = block_table[req, :num_blocks].long()
        # [num_blocks, block_size, kv_heads, d] -> [seq_len, kv_heads, d]
        keys = k_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len].float()
        values = v_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len].float()
        context_len = seq_len - query_len
        q_pos = torch.arange(query_len, device=q.device)[:, None] + context_len
        k_pos = torch.arange(seq_len, device=q.device)[None, :]
        if _SDPA_HAS_GQA:
            ctx = F.scaled_dot_product_attention(
                q[q_start:q_end].float().transpose(0, 1)[None],
                keys.transpose(0, 1)[None],
                values.transpose(0, 1)[None],
                attn_mask=(k_pos <= q_pos)[None, None],
                scale=scale,
                enable_gqa=True,
            )[0].transpose(0, 1)
        else:
            # Query heads grouped by their KV head: no repeated copy of K/V.
            query = q[q_start:q_end].float().view(query_len, num_kv_heads, group, head_dim)
            scores = torch.einsum("qhgd,khd->hgqk", query, keys) * scale
            scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
            ctx = torch.einsum("hgqk,khd->qhgd", torch.softmax(scores, dim=-1), values)
        out[q_start:q_end] = ctx.reshape(query_len, num_heads, head_dim).to(q.dtype)
    return out


def _decode_batched(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    lens: list[int],
    starts: list[int],
    scale: float,
    out: torch.Tensor,
) -> None:
    """One query token per request: every request at once, padded to the longest context.

    Same math as the per-request path (fp32, masked softmax), in a handful of batched ops.
    """
    num_reqs = len(lens)
    block_size, num_kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    num_heads = q.shape[1]
    group = num_heads // num_kv_heads
    max_len = max(lens)
    num_blocks = -(-max_len // block_size)
    blocks = block_table[:num_reqs, :num_blocks].long()
    keys = k_cache[blocks].reshape(num_reqs, num_blocks * block_size, num_kv_heads, head_dim)[:, :max_len].float()
    values = v_cache[blocks].reshape(num_reqs, num_blocks * block_size, num_kv_heads, head_dim)[:, :max_len].float()
    rows = torch.tensor(starts[:num_reqs], device=q.device)
    k_pos = torch.arange(max_len, device=q.device)[None, :]
    too_far = k_pos >= torch.tensor(lens, device=q.device)[:, None]
    if _SDPA_HAS_GQA:
        # One fused kernel (about twice as fast as the einsums on CPU; same fp32 math up to
        # summation order).
        ctx = F.scaled_dot_product_attention(
            q[rows].float().view(num_reqs, num_heads, 1, head_dim),
            keys.transpose(1, 2),
            values.transpose(1, 2),
            attn_mask=~too_far[:, None, None, :],
            scale=scale,
            enable_gqa=True,
        )
    else:
        query = q[rows].float().view(num_reqs, num_kv_heads, group, head_dim)
        scores = torch.einsum("rhgd,rkhd->rhgk", query, keys) * scale
        scores = scores.masked_fill(too_far[:, None, None, :], float("-inf"))
        ctx = torch.einsum("rhgk,rkhd->rhgd", torch.softmax(scores, dim=-1), values)
    out[rows] = ctx.reshape(num_reqs, num_heads, head_dim).to(q.dtype)

