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
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import pprun.layers as layers
from pprun.kernels.partials import SplitPartials, check_defer_merge


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


def experts_reference(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """``sum_j weights[t, j] * expert_{ids[t, j]}(x[t])`` for each token ``t`` of ``x [T, hidden]``,
    a loop over the experts chosen (each a SwiGLU MLP): ``transformers``' own loop."""
    out = torch.zeros_like(x)
    inter = w2.shape[2]
    if x.is_cuda and torch.cuda.is_current_stream_capturing():
        # A CUDA graph cannot read the routing on the host: every expert over every token,
        # weighted by zero where not chosen (the fused kernels are the fast path).
        for expert in range(w13.shape[0]):
            weight = (weights * (ids == expert)).sum(dim=-1, keepdim=True)
            gate, up = F.linear(x, w13[expert]).split(inter, dim=-1)
            out += (F.linear(F.silu(gate) * up, w2[expert]) * weight).to(x.dtype)
        return out
    for expert in ids.unique().tolist():
        token, slot = torch.where(ids == expert)
        gate, up = F.linear(x[token], w13[expert]).split(inter, dim=-1)
        y = F.linear(F.silu(gate) * up, w2[expert])
        out.index_add_(0, token, (y * weights[token, slot, None]).to(x.dtype))
    return out


def moe_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    then: str | None = None,
) -> torch.Tensor | SplitPartials:
    """The experts' weighted sum for ``x [T, hidden]`` (see :func:`experts_reference`): the fused
    grouped kernels where the fused ops run, the reference loop elsewhere.  ``then="norm"``: a
    fused add + RMSNorm reads the output, so the fused path leaves the ``top_k`` weighted rows
    of each token unsummed (:class:`~pprun.kernels.partials.SplitPartials`) for it to sum."""
    check_defer_merge(then)
    if layers.fused_ops_for(x) is None:
        return experts_reference(x, w13, w2, weights, ids)
    from pprun.layers import moe_triton

    return moe_triton.fused_experts(x, w13, w2, weights, ids, then=then)
