"""Pixtral's vision tower as Hugging Face checkpoints describe it (``PixtralVisionModel``, the
encoder of a Pixtral-form ``LlavaForConditionalGeneration``, run on the first pipeline stage).

Unlike CLIP/SigLIP, an image keeps its own size: the processor resizes it to whole patches (the
longest edge capped), and the tower turns it into a ``rows x cols`` grid of patches, flattened
row by row.  Positions are a 2-D rotary embedding (half of each head's frequencies turn with the
patch row, half with the column), so no position table limits the grid.  Several images run as
one packed sequence through the norms and linear layers; attention stays inside each image (the
block-diagonal mask transformers builds), computed image by image so its cost grows with each
image's patches squared rather than the batch's.

Blocks are pre-norm: ``x + attention(attention_norm(x))``, then ``+ feed_forward(ffn_norm(.))``
with RMSNorms and a gated MLP (``down(act(gate(x)) * up(x))``); no linear layer has a bias.
Module names match the checkpoint's (``patch_conv``, ``ln_pre``, ``transformer.layers.N.
{attention_norm, attention.{q,k,v,o}_proj, ffn_norm, feed_forward.{gate,up,down}_proj}``), so
tensors load by name after :func:`pprun.models.llava.canonical_name`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pprun.layers.norm import RMSNorm
from pprun.models.clip import activation

NORM_EPS = 1e-5
"""Every RMSNorm of the tower (transformers hard-codes it; the config has no field for it)."""


def rope_theta(cfg: dict[str, Any]) -> float:
    """The tower's RoPE base: transformers 5's ``rope_parameters`` or the older ``rope_theta``.
    Raises ValueError for a RoPE type other than Pixtral's axial one."""
    params = cfg.get("rope_parameters") or {}
    rope_type = params.get("rope_type", "axial")
    if rope_type != "axial":
        raise ValueError(
            f"vision_config.rope_parameters.rope_type={rope_type!r}: a Pixtral tower takes only 'axial'"
        )
    return float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))


def rotary_cos_sin(rows: int, cols: int, head_dim: int, theta: float, device: torch.device
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos, sin [rows * cols, head_dim]`` (float32) for a patch grid flattened row by row.

    The even-indexed inverse frequencies turn with the row, the odd-indexed with the column;
    the two halves are laid out ``[row | col]`` and repeated for ``rotate_half``'s pairing
    (the layout the checkpoint's q/k weights were permuted for)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    r, c = torch.meshgrid(torch.arange(rows, device=device), torch.arange(cols, device=device), indexing="ij")
    rows_angles = r.reshape(-1, 1).float() * inv_freq[0::2]
    cols_angles = c.reshape(-1, 1).float() * inv_freq[1::2]
    angles = torch.cat([rows_angles, cols_angles], dim=-1)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``[-x2, x1]`` for ``x = [x1, x2]`` split along the last dimension."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


class Attention(nn.Module):
    """Bidirectional multi-head attention with 2-D RoPE, restricted to each image's patches."""

    def __init__(self, hidden: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = hidden // num_heads
        self.q_proj = nn.Linear(hidden, hidden, bias=False)
        self.k_proj = nn.Linear(hidden, hidden, bias=False)
        self.v_proj = nn.Linear(hidden, hidden, bias=False)
        self.o_proj = nn.Linear(hidden, hidden, bias=False)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_patches: list[int]
    ) -> torch.Tensor:
        """``x [patches, hidden]`` (the images packed one after another) -> same shape."""
        n = x.shape[0]
        q, k, v = (proj(x).view(n, self.num_heads, self.head_dim)
                   for proj in (self.q_proj, self.k_proj, self.v_proj))
        cos, sin = cos[:, None], sin[:, None]  # broadcast over heads
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        q, k, v = (t.transpose(0, 1) for t in (q, k, v))  # [heads, patches, head_dim]
        out = torch.cat([
            F.scaled_dot_product_attention(qi, ki, vi)
            for qi, ki, vi in zip(q.split(num_patches, 1), k.split(num_patches, 1), v.split(num_patches, 1))
        ], dim=1)
        return self.o_proj(out.transpose(0, 1).reshape(n, -1))


class FeedForward(nn.Module):
    """``down_proj(act(gate_proj(x)) * up_proj(x))``."""

    def __init__(self, hidden: int, intermediate: int, act: str) -> None:
        super().__init__()
        self.act = activation(act)
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The block's gated feed-forward."""
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    """One pre-norm transformer block of the tower."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        hidden = cfg["hidden_size"]
        self.attention_norm = RMSNorm(hidden, NORM_EPS)
        self.attention = Attention(hidden, cfg["num_attention_heads"])
        self.ffn_norm = RMSNorm(hidden, NORM_EPS)
        self.feed_forward = FeedForward(hidden, cfg["intermediate_size"], cfg.get("hidden_act", "gelu"))

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_patches: list[int]
    ) -> torch.Tensor:
        """``x + attention(norm(x))``, then ``+ feed_forward(norm(.))``."""
        h, _ = self.attention_norm(x)
        # One fused norm-and-add: h = norm(x + attention), x = x + attention.
        h, x = self.ffn_norm(self.attention(h, cos, sin, num_patches), x)
        return x + self.feed_forward(h)


class PixtralVisionModel(nn.Module):
    """A Pixtral vision tower with ``num_layers`` blocks built (the deepest the projector reads)."""

    def __init__(self, cfg: dict[str, Any], num_layers: int) -> None:
        super().__init__()
        hidden, self.patch_size = int(cfg["hidden_size"]), int(cfg["patch_size"])
        if hidden % cfg["num_attention_heads"] or (hidden // cfg["num_attention_heads"]) % 2:
            raise ValueError(
                f"vision_config: hidden_size={hidden} must split into num_attention_heads="
                f"{cfg['num_attention_heads']} heads of an even width (2-D RoPE rotates pairs)"
            )
        self.num_channels = int(cfg.get("num_channels", 3))
        self.head_dim = hidden // cfg["num_attention_heads"]
        self.rope_theta = rope_theta(cfg)
        self.patch_conv = nn.Conv2d(
            self.num_channels, hidden, self.patch_size, stride=self.patch_size, bias=False
        )
        self.ln_pre = RMSNorm(hidden, NORM_EPS)
        self.transformer = nn.Module()
        self.transformer.layers = nn.ModuleList(Block(cfg) for _ in range(num_layers))

    def patch_grid(self, pixel_values: torch.Tensor) -> tuple[int, int]:
        """``(rows, cols)`` of patches an image ``[channels, height, width]`` gives; ValueError
        for another shape or an image under one patch."""
        if pixel_values.dim() != 3 or pixel_values.shape[0] != self.num_channels:
            raise ValueError(
                f"pixel_values of shape {tuple(pixel_values.shape)}: a Pixtral tower takes one image as "
                f"[{self.num_channels}, height, width]"
            )
        rows, cols = pixel_values.shape[1] // self.patch_size, pixel_values.shape[2] // self.patch_size
        if rows == 0 or cols == 0:
            raise ValueError(
                f"pixel_values of shape {tuple(pixel_values.shape)} is smaller than one "
                f"{self.patch_size}-pixel patch"
            )
        return rows, cols

    def forward(self, images: list[torch.Tensor]) -> list[torch.Tensor]:
        """Hidden states of the images packed into one sequence, ``[sum of rows * cols, hidden]``
        each, as transformers numbers them: ``[0]`` the patch embeddings after ``ln_pre``, ``[i]``
        the output of block ``i``.  Each image is ``[channels, height, width]`` at its own size
        (pixels past the last whole patch are ignored)."""
        grids = [self.patch_grid(img) for img in images]
        dtype = self.patch_conv.weight.dtype
        # Each image through the convolution on its own: their sizes differ.
        x = torch.cat([self.patch_conv(img[None].to(dtype))[0].flatten(1).T for img in images])
        x, _ = self.ln_pre(x)
        cos, sin = zip(*(rotary_cos_sin(r, c, self.head_dim, self.rope_theta, x.device) for r, c in grids))
        cos, sin = torch.cat(cos).to(dtype), torch.cat(sin).to(dtype)
        num_patches = [r * c for r, c in grids]
        states = [x]
        for block in self.transformer.layers:
            x = block(x, cos, sin, num_patches)
            states.append(x)
        return states
