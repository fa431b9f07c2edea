"""Building the keyword arguments of a model's forward: docs/design.md contracts 1 and 2, in one place.

Both runners call :func:`build_model_inputs`, so the contract cannot drift between them.
"""

from __future__ import annotations

from typing import Any

import torch

from pprun.attention.metadata import AttentionMetadata
from pprun.distributed.intermediate import IntermediateTensors
from pprun.models.base import PprunModel


def uses_inputs_embeds(model: PprunModel) -> bool:
    """True when the first stage computes ``inputs_embeds`` itself (multimodal models, where
    item embeddings are merged into the token embeddings before the first layer)."""
    return model.supports_multimodal


def build_model_inputs(
    model: PprunModel,
    *,
    is_first_stage: bool,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    intermediate_tensors: IntermediateTensors | None,
    attn_metadata: AttentionMetadata,
    inputs_embeds: torch.Tensor | None = None,
) -> dict[str, Any]:
    """Return the forward kwargs; the four contract keys are always present.

    First stage: ``intermediate_tensors`` is ``None``; when ``inputs_embeds`` is given (or the
    model embeds itself, see :func:`uses_inputs_embeds`), ``input_ids`` is ``None`` unless the
    model declares ``requires_raw_input_tokens = True``.  Other stages: ``input_ids`` and
    ``inputs_embeds`` are ``None`` and ``intermediate_tensors`` are the received buffers.
    """
    if not is_first_stage:
        if intermediate_tensors is None:
            raise ValueError("a non-first stage needs the received intermediate_tensors")
        return {
            "input_ids": None,
            "positions": positions,
            "inputs_embeds": None,
            "intermediate_tensors": intermediate_tensors,
            "attn_metadata": attn_metadata,
        }
    if inputs_embeds is None and uses_inputs_embeds(model):
        inputs_embeds = model.embed_input_ids(input_ids)
    keep_ids = inputs_embeds is None or model.requires_raw_input_tokens
    return {
        "input_ids": input_ids if keep_ids else None,
        "positions": positions,
        "inputs_embeds": inputs_embeds,
        "intermediate_tensors": None,
        "attn_metadata": attn_metadata,
    }
