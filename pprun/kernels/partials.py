"""A split-K matmul's output still as its fp32 partial sums, merged by whichever kernel reads it next.

Here, apart from the kernels: the kernels' modules import Triton, while every caller (CPU ones
too) may need to recognise or merge partials.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SplitPartials:
    """A decode matmul's output still as the fp32 partial sums of its K splits.

    ``skinny.skinny_linear(..., defer_merge=...)`` returns it where K is split, so that the
    kernel after the matmul merges the partials (in split order, plus the bias, rounded once to
    ``dtype``: what the matmul's own merge would write) and the matmul's launch ends as soon as
    its programs have stored them.  ``fused.fused_add_rms_norm`` takes it as its ``x``;
    anything else calls :meth:`merge` first.
    """

    parts: torch.Tensor
    """``[splits, M, N]``, float32 (a mixture-of-experts layer's weighted expert rows may be in
    ``dtype``: ``pprun.layers.moe_triton.PARTIALS_IN_DTYPE``); summed in float32."""
    bias: torch.Tensor | None
    dtype: torch.dtype
    """The matmul's output dtype."""

    @property
    def shape(self) -> torch.Size:
        return self.parts.shape[1:]

    def merge(self) -> torch.Tensor:
        """The ``[M, N]`` output the matmul would have written, rounded the same way."""
        total = torch.zeros_like(self.parts[0], dtype=torch.float32)
        for part in self.parts:
            total += part
        if self.bias is not None:
            total += self.bias.float()
        return total.to(self.dtype)


def merged(x: torch.Tensor | SplitPartials) -> torch.Tensor:
    """``x`` itself, or the output its partials stand for."""
    return x.merge() if isinstance(x, SplitPartials) else x


DEFER_MERGERS = ("norm", "attention")
"""The kernels that may merge a matmul's deferred partials (``defer_merge``)."""


def check_defer_merge(defer_merge: str | None) -> None:
    """Raise ValueError unless ``defer_merge`` is None or one of :data:`DEFER_MERGERS` (every device
    checks it, and only CUDA runs import the kernels)."""
    if defer_merge is not None and defer_merge not in DEFER_MERGERS:
        raise ValueError(f"defer_merge must be one of {DEFER_MERGERS} or None, got {defer_merge!r}")
