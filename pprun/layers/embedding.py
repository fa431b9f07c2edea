"""Embedding tables made without a random initialisation."""

from __future__ import annotations

import torch
from torch import nn


def Embedding(num_embeddings: int, embedding_dim: int) -> nn.Embedding:  # noqa: N802 (a module factory)
    """An ``nn.Embedding`` whose weight is left uninitialised: every table pprun builds is filled
    from the checkpoint right after.

    ``nn.Embedding`` draws its initial weight with ``normal_``; on the meta device, where pprun
    builds a stage's modules before allocating them, that draw runs through torch's Python
    reference kernels, whose first use imports ``torch._dynamo`` (seconds of a stage's start-up)."""
    return nn.Embedding(num_embeddings, embedding_dim, _weight=torch.empty(num_embeddings, embedding_dim))
