"""Mixture-of-experts MLP ops: the router's top-k choice and the experts' weighted sum.

A sparse layer (``pprun.models.moe.SparseMoeBlock``) computes ``router_logits = gate(x)`` and then
:func:`route` and :func:`moe_experts`.  The experts' weights are two stacked tensors, as
``transformers`` holds them: ``w13 [num_experts, 2 * inter, hidden]`` (each expert's gate rows,
then its up rows) and ``w2 [num_experts, hidden, inter]``.

:func:`experts_reference` is the plain-torch path (CPU, HF parity): a loop over the experts the
step's tokens chose, as ``transformers``' ``Qwen3MoeExperts`` / ``MixtralExperts`` compute it.
Where the fused ops run (CUDA with Triton), :func:`moe_experts` takes the grouped kernels of
``pprun.layers.moe_triton`` instead: token -> expert assignments sorted by expert, one grouped
GEMM launch for gate_up (SwiGLU in its epilogue) and one for down (the routing weight in its
epilogue), fixed shapes and no host syncs, so a full CUDA graph can hold them.

Experts may be float8 e4m3 with float32 scales (an FP8 checkpoint's, kept as stored where
:data:`FP8_EXPERTS_ENABLED`: ``pprun.models.moe``): the grouped kernels read them as they are;
the reference loop dequantizes each expert it uses (:func:`dequantize_experts`), as the loader
would have.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import pprun.layers as layers
from pprun.kernels.partials import SplitPartials, check_defer_merge
from pprun.switches import enabled_unless

FP8_EXPERTS_ENABLED: bool = enabled_unless("PPRUN_DISABLE_FP8_MOE")
"""False when ``PPRUN_DISABLE_FP8_MOE`` is set: an FP8 checkpoint's experts are then dequantized
at load into bf16/fp16 experts (twice the memory; the grouped kernels read bf16) instead of kept
in float8 with their scales, which the grouped kernels read where FP8 weights are kept
(``pprun.models.quantization.LinearFactory.fp8_experts``)."""


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``top_k`` experts of each token and their weights, as ``transformers``' routers compute
    them: softmax over the experts in float32, the ``top_k`` largest, renormalised to sum to one
    when ``renormalize`` (Mixtral always; Qwen3-MoE's ``norm_topk_prob``).

    Returns ``(weights [T, top_k] float32, ids [T, top_k] int64)``; one launch where the fused
    ops run."""
    if layers.fused_ops_for(router_logits) is not None:
        from pprun.layers import moe_triton

        return moe_triton.fused_route(router_logits, top_k, renormalize)
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def dequantize_experts(w: torch.Tensor, scale: torch.Tensor | None, scale_block: int | None, dtype: torch.dtype,
                       parts: int = 1) -> torch.Tensor:
    """Float8 experts ``w [E, rows, cols]`` times their float32 ``scale`` (``[E, rows, 1]`` per
    row, or per ``scale_block`` x ``scale_block`` block: :func:`pprun.layers.moe_shapes.expert_scale_shapes`),
    in float32, then ``dtype``: what the loader makes of them when it dequantizes.  ``parts``: the
    rows stack that many tensors of equal height, each with its own block rows (``w13``: gate
    and up, 2).  ``scale`` None: ``w`` as it is."""
    if scale is None:
        return w
    num_experts, rows, cols = w.shape
    s = scale.float()
    if scale_block is not None:
        s = s.view(num_experts, parts, -1, s.shape[-1]).repeat_interleave(scale_block, 2)[:, :, : rows // parts]
        s = s.repeat_interleave(scale_block, 3)[..., :cols].reshape(num_experts, rows, cols)
    return (w.float() * s).to(dtype)


def experts_reference(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
    *, w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None, scale_block: int | None = None,
) -> torch.Tensor:
    """``sum_j weights[t, j] * expert_{ids[t, j]}(x[t])`` for each token ``t`` of ``x [T, hidden]``,
    a loop over the experts chosen (each a SwiGLU MLP): ``transformers``' own loop.  Float8
    experts (``w13_scale``, ``w2_scale``, ``scale_block``: ``moe_triton.fused_experts``) are
    dequantized into ``x``'s dtype one expert at a time."""
    out = torch.zeros_like(x)
    inter = w2.shape[2]

    def expert_weights(e: int) -> tuple[torch.Tensor, torch.Tensor]:
        if w13_scale is None:
            return w13[e], w2[e]
        return (dequantize_experts(w13[e : e + 1], w13_scale[e : e + 1], scale_block, x.dtype, parts=2)[0],
                dequantize_experts(w2[e : e + 1], w2_scale[e : e + 1], scale_block, x.dtype)[0])

    if x.is_cuda and torch.cuda.is_current_stream_capturing():
        # A CUDA graph cannot read the routing on the host: every expert over every token,
        # weighted by zero where not chosen (the fused kernels are the fast path).
        for expert in range(w13.shape[0]):
            weight = (weights * (ids == expert)).sum(dim=-1, keepdim=True)
            e13, e2 = expert_weights(expert)
            gate, up = F.linear(x, e13).split(inter, dim=-1)
            out += (F.linear(F.silu(gate) * up, e2) * weight).to(x.dtype)
        return out
    for expert in ids.unique().tolist():
        token, slot = torch.where(ids == expert)
        e13, e2 = expert_weights(expert)
        gate, up = F.linear(x[token], e13).split(inter, dim=-1)
        y = F.linear(F.silu(gate) * up, e2)
        out.index_add_(0, token, (y * weights[token, slot, None]).to(x.dtype))
    return out


def moe_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    then: str | None = None,
    *,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    scale_block: int | None = None,
) -> torch.Tensor | SplitPartials:
    """The experts' weighted sum for ``x [T, hidden]`` (see :func:`experts_reference`): the fused
    grouped kernels where the fused ops run, the reference loop elsewhere.  ``then="norm"``: a
    fused add + RMSNorm reads the output, so the fused path leaves the ``top_k`` weighted rows
    of each token unsummed (:class:`~pprun.kernels.partials.SplitPartials`) for it to sum.
    ``w13_scale``, ``w2_scale``, ``scale_block``: the scales of float8 experts
    (``moe_triton.fused_experts``)."""
    check_defer_merge(then)
    scales = {"w13_scale": w13_scale, "w2_scale": w2_scale, "scale_block": scale_block}
    if layers.fused_ops_for(x) is None:
        return experts_reference(x, w13, w2, weights, ids, **scales)
    from pprun.layers import moe_triton

    return moe_triton.fused_experts(x, w13, w2, weights, ids, then=then, **scales)
