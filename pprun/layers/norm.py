"""RMSNorm with the residual add fused in: one Triton launch on CUDA, plain torch elsewhere."""

from __future__ import annotations

import torch
from torch import nn

import pprun.layers as layers
from pprun.kernels.partials import SplitPartials, merged


class RMSNorm(nn.Module):
    """RMSNorm with the residual add fused in, computed in float32 like the HF reference."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(
        self, x: torch.Tensor | SplitPartials, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(norm(x + residual), x + residual)``; with no residual, ``x`` is it.

        ``x`` may be a decode matmul's unmerged partials (a ``linear(..., then="norm")``): the
        fused kernel merges them as it reads them."""
        # Looked up at call time: ``pprun.layers.fused_ops_for`` is the one switch point.
        fused = layers.fused_ops_for(x.parts if isinstance(x, SplitPartials) else x)
        if fused is not None:  # CUDA: one Triton launch with the same rounding steps
            return fused.fused_add_rms_norm(x, residual, self.weight, self.eps)
        x = merged(x)
        if residual is not None:
            x = x + residual
        residual = x
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype), residual
