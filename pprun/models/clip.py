"""CLIP and SigLIP vision towers as Hugging Face checkpoints describe them (the encoder a
vision-language model runs on its first pipeline stage).

Both are the same pre-norm ViT: patch convolution plus learned position embeddings (CLIP adds a
class token and a LayerNorm before the encoder), then ``layer_norm1 -> attention -> add,
layer_norm2 -> MLP -> add`` blocks.  Module names match the checkpoint's, so tensors load by name.
Only the blocks up to the deepest feature layer the model reads are built (Llava reads the
second-to-last block's output: the last block is never run, as in vLLM).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pprun.layers.embedding import Embedding

ACTIVATIONS = {
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_fast": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
    "relu": F.relu,
}
"""The ``hidden_act`` names vision towers and projectors use."""


def activation(name: str):
    """The activation function named by a config's ``hidden_act``; ValueError names the allowed ones."""
    if name not in ACTIVATIONS:
        raise ValueError(f"hidden_act={name!r} is not supported: must be one of {sorted(ACTIVATIONS)}")
    return ACTIVATIONS[name]


class VisionAttention(nn.Module):
    """Bidirectional multi-head attention over one image's patches (no KV cache)."""

    def __init__(self, hidden: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = hidden // num_heads
        self.q_proj = nn.Linear(hidden, hidden)
        self.k_proj = nn.Linear(hidden, hidden)
        self.v_proj = nn.Linear(hidden, hidden)
        self.out_proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [batch, patches, hidden]`` -> same shape."""
        b, n, _ = x.shape
        q, k, v = (p(x).view(b, n, self.num_heads, self.head_dim).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        out = F.scaled_dot_product_attention(q, k, v)
        return self.out_proj(out.transpose(1, 2).reshape(b, n, -1))


class VisionMLP(nn.Module):
    """``fc2(act(fc1(x)))``."""

    def __init__(self, hidden: int, intermediate: int, act: str) -> None:
        super().__init__()
        self.act = activation(act)
        self.fc1 = nn.Linear(hidden, intermediate)
        self.fc2 = nn.Linear(intermediate, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The block's feed-forward."""
        return self.fc2(self.act(self.fc1(x)))


class VisionBlock(nn.Module):
    """One pre-norm encoder block."""

    def __init__(self, cfg: dict[str, Any], act: str) -> None:
        super().__init__()
        hidden, eps = cfg["hidden_size"], cfg["layer_norm_eps"]
        self.layer_norm1 = nn.LayerNorm(hidden, eps=eps)
        self.self_attn = VisionAttention(hidden, cfg["num_attention_heads"])
        self.layer_norm2 = nn.LayerNorm(hidden, eps=eps)
        self.mlp = VisionMLP(hidden, cfg["intermediate_size"], act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x + attn(norm(x))``, then ``+ mlp(norm(.))``."""
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class VisionEmbeddings(nn.Module):
    """Patch convolution + position embeddings (+ CLIP's class token)."""

    def __init__(self, cfg: dict[str, Any], class_token: bool) -> None:
        super().__init__()
        hidden, patch = cfg["hidden_size"], cfg["patch_size"]
        self.num_patches = (cfg["image_size"] // patch) ** 2
        self.class_embedding = nn.Parameter(torch.zeros(hidden)) if class_token else None
        # CLIP's convolution has no bias, SigLIP's has one.
        self.patch_embedding = nn.Conv2d(cfg.get("num_channels", 3), hidden, patch, stride=patch, bias=not class_token)
        self.position_embedding = Embedding(self.num_patches + int(class_token), hidden)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``[batch, 3, H, W]`` -> ``[batch, patches (+1), hidden]``."""
        x = self.patch_embedding(pixel_values.to(self.patch_embedding.weight.dtype)).flatten(2).transpose(1, 2)
        if x.shape[1] != self.num_patches:
            raise ValueError(
                f"pixel_values of shape {tuple(pixel_values.shape)} give {x.shape[1]} patches; the vision tower "
                f"was built for {self.num_patches} (image_size {int(math.isqrt(self.num_patches))} patches a side)"
            )
        if self.class_embedding is not None:
            x = torch.cat([self.class_embedding.expand(x.shape[0], 1, -1), x], dim=1)
        return x + self.position_embedding.weight


class VisionTransformer(nn.Module):
    """A CLIP (``class_token=True``) or SigLIP vision tower with ``num_layers`` blocks built."""

    def __init__(self, cfg: dict[str, Any], num_layers: int, *, clip: bool) -> None:
        super().__init__()
        act = cfg.get("hidden_act", "quick_gelu" if clip else "gelu_pytorch_tanh")
        cfg = {"layer_norm_eps": 1e-5 if clip else 1e-6, **cfg}
        self.embeddings = VisionEmbeddings(cfg, class_token=clip)
        self.pre_layrnorm = nn.LayerNorm(cfg["hidden_size"], eps=cfg["layer_norm_eps"]) if clip else None
        self.encoder = nn.Module()
        self.encoder.layers = nn.ModuleList(VisionBlock(cfg, act) for _ in range(num_layers))

    def forward(self, pixel_values: torch.Tensor) -> list[torch.Tensor]:
        """Hidden states as Hugging Face numbers them: ``[0]`` the embeddings (after CLIP's
        pre-LayerNorm), ``[i]`` the output of block ``i``, for every block built."""
        x = self.embeddings(pixel_values)
        if self.pre_layrnorm is not None:
            x = self.pre_layrnorm(x)
        states = [x]
        for block in self.encoder.layers:
            x = block(x)
            states.append(x)
        return states
