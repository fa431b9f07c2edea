"""How a stage's Llama-family decoder layers launch: the one place that decides folds, deferred
merges and each matmul's launch hints.

``pprun.models.llama`` says what a decoder layer computes (norm, attention, norm, SwiGLU MLP, the
residual carried apart and added by the next norm) in plain torch.  That code is the reference:
it runs wherever the fused ops do not (CPU, ``PPRUN_DISABLE_FUSED=1``), and HF parity is checked
against it.  Where they do (CUDA with Triton), :func:`run_decoder_layers` runs each layer from
the layer's own modules, in the same order, and picks the kernels:

- at one row the residual add + RMSNorm runs as the prologue of the matmul after it
  (:func:`~pprun.layers.norm_linear`: qkv, and gate_up with its SwiGLU);
- each decode matmul is told where it sits (:func:`~pprun.layers.linear`'s ``after`` / ``then``):
  qkv after a norm and before the attention, o_proj after the attention and before a norm,
  down before a norm unless it ends a stage that sends its output on; from that the dispatch
  decides whether the weights load ahead of the PDL wait, whether split-K partials are left to
  the next kernel (:class:`~pprun.layers.SplitPartials`, merged by the norm or by the one-kernel
  decode attention) and whether the last weight tile is held across the wait;
- gate_up and its SwiGLU are one launch where the split-K kernels take the rows.

The tests that keep the two paths together: ``tests/test_norm_linear.py`` (a layer folded and
not), ``tests/test_fused_ops.py`` (whole models, fused against plain torch; on CUDA).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

import pprun.layers as layers
from pprun.attention.metadata import AttentionMetadata
from pprun.kernels.partials import SplitPartials, merged
from pprun.layers.attend import attend, attention_input


def run_decoder_layers(
    decoder_layers: Sequence[nn.Module],
    positions: torch.Tensor,
    hidden_states: torch.Tensor,
    meta: AttentionMetadata,
    *,
    into_norm: bool,
) -> tuple[torch.Tensor | SplitPartials, torch.Tensor]:
    """Run a stage's decoder layers over ``hidden_states``, the residual stream (the first
    layer of every stage starts from it alone); returns the last layer's output and residual,
    not yet added together.

    ``into_norm``: the output goes into a norm (the final one, on the last stage), which may
    merge split partials as it reads them; otherwise (a stage whose output is sent on) the
    output is a merged tensor."""
    residual: torch.Tensor | None = None
    h: torch.Tensor | SplitPartials = hidden_states
    if layers.fused_ops_for(hidden_states) is None:
        for layer in decoder_layers:
            h, residual = layer(positions, h, residual, meta)
        return h, residual
    last = len(decoder_layers) - 1
    for i, layer in enumerate(decoder_layers):
        h, residual = fused_decoder_layer(layer, positions, h, residual, meta, feeds_norm=into_norm or i < last)
    return (h if into_norm else merged(h)), residual


def fused_decoder_layer(
    layer: nn.Module,
    positions: torch.Tensor,
    h: torch.Tensor | SplitPartials,
    residual: torch.Tensor | None,
    meta: AttentionMetadata,
    feeds_norm: bool,
) -> tuple[torch.Tensor | SplitPartials, torch.Tensor]:
    """``layer(positions, h, residual, meta)`` (a ``pprun.models.llama.DecoderLayer``) with the
    kernels picked as the module docstring says, where the fused ops run; ``feeds_norm``: a norm
    reads the output, so it may be split partials."""
    attn, mlp = layer.self_attn, layer.mlp
    folded = layers.norm_linear(layer.input_layernorm, attn.qkv_proj, h, residual)
    if folded is not None:
        qkv, residual = folded
    else:
        x, residual = layer.input_layernorm(h, residual)
        # Per-head q/k norms (Qwen3) read the projection merged; else the attention may merge it.
        then = attention_input(attn.backend, meta, x) if attn.q_norm is None else None
        qkv = layers.linear(attn.qkv_proj, x, after="norm", then=then)
    qkv = attn.norm_heads(qkv)
    out = attend(attn.backend, attn.rotary, positions, qkv, attn.kv_cache, meta, attn.scale,
                 attn.num_heads, attn.num_kv_heads, attn.head_dim)
    h = layers.linear(attn.o_proj, out, after="attention", then="norm")
    down_then = "norm" if feeds_norm else None
    if not hasattr(mlp, "gate_up_proj"):
        # A sparse layer (pprun.models.moe.SparseMoeBlock): the router, the grouped expert
        # kernels, each token's expert outputs left to the next norm to sum.
        x, residual = layer.post_attention_layernorm(h, residual)
        return mlp(x, then=down_then), residual
    folded = layers.norm_linear(layer.post_attention_layernorm, mlp.gate_up_proj, h, residual, swiglu=True)
    if folded is not None:
        act, residual = folded
        return layers.linear(mlp.down_proj, act, then=down_then), residual
    x, residual = layer.post_attention_layernorm(h, residual)
    act = layers.linear_swiglu(mlp.gate_up_proj, x)
    if act is not None:
        return layers.linear(mlp.down_proj, act, then=down_then), residual
    # Rows the split-K kernels do not take (prefill, wide batches): cuBLAS, the fused activation.
    fused = layers.fused_ops_for(x)
    if fused is None:
        return mlp(x), residual
    return mlp.down_proj(fused.silu_and_mul(mlp.gate_up_proj(x))), residual
