"""Per-step attention metadata: what every attention layer of a stage reads.

Real and padded counts are named apart.  Tensors may be views into a runner's persistent
buffers (V2, CUDA graphs): rows past the real counts are padding and are kept inert —
``seq_lens`` 0 and ``slot_mapping`` -1, so a padded row neither reads nor writes the cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from pprun.attention.cross import CrossAttentionMetadata


@dataclass
class AttentionMetadata:
    """Metadata for one forward step over a flattened batch of tokens."""

    num_reqs: int
    """Requests in the step (real)."""
    num_reqs_padded: int
    """Rows of the per-request tensors (>= num_reqs; CUDA-graph padding)."""
    num_tokens: int
    """Tokens in the step (real)."""
    num_tokens_padded: int
    """Rows of the per-token tensors (>= num_tokens)."""
    max_query_len: int
    """Longest query in the step; 1 means a pure decode step."""
    query_start_loc: torch.Tensor
    """[num_reqs_padded + 1] int32: cumulative query lengths (padded requests add 0)."""
    seq_lens: torch.Tensor
    """[num_reqs_padded] int32: context length after this step's tokens (0 for padding)."""
    block_table: torch.Tensor
    """[num_reqs_padded, max_num_blocks_per_req] int32: KV blocks of each request."""
    slot_mapping: torch.Tensor
    """[num_tokens_padded] int64: cache slot of each token (-1 for padding: not written)."""
    num_leading_decodes: int = 0
    """In a step with a longer query (``max_query_len > 1``), how many of the first (real)
    requests have one query token each (decodes scheduled ahead of prompt chunks): tokens
    ``0..n-1`` are theirs, so a backend may attend them as a decode batch (the Triton one does:
    its varlen prefill kernel spends a whole query tile and a K/V read per query head on each
    one-token request).  0: none, or not known (:func:`count_leading_decodes`)."""
    cross: CrossAttentionMetadata | None = None
    """Cross-attention lengths and slots of an encoder-decoder model's step (None otherwise)."""


def count_leading_decodes(num_scheduled: Sequence[int] | np.ndarray) -> int:
    """:attr:`AttentionMetadata.num_leading_decodes` of a step whose requests, in batch order,
    compute ``num_scheduled`` tokens each: the one-token requests before the first longer one
    (0 when there is none: a pure decode step)."""
    longer = np.flatnonzero(np.asarray(num_scheduled) != 1)
    return int(longer[0]) if len(longer) else 0
