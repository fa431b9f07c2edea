"""The sparse MLP of a mixture-of-experts decoder layer (Qwen3-MoE, Mixtral), as one module.

``SparseMoeBlock`` holds the router (``gate``, a linear map to one logit per expert) and every
expert's SwiGLU weights stacked in two tensors, ``w13 [E, 2 * inter, hidden]`` (gate rows, then
up rows) and ``w2 [E, hidden, inter]``; a checkpoint's per-expert tensors are copied into their
slices by :meth:`SparseMoeBlock.load_expert`.  What it computes (the routing and the experts'
weighted sum, fused kernels where they run) is ``pprun.layers.moe``.

Under tensor parallelism every rank holds every expert, split along its intermediate width
(``inter / tp`` of the gate, up and down rows/columns: :meth:`SparseMoeBlock.expert_shards`); the
router is replicated, so each rank routes alike, and the experts' partial sums are all-reduced
once per block.
"""

from __future__ import annotations

import torch
from torch import nn

from pprun.distributed.tensor_parallel import TensorParallel
from pprun.kernels.partials import SplitPartials
from pprun.layers import linear
from pprun.layers.moe import moe_experts, route
from pprun.layers.parallel_linear import Shard, split
from pprun.models.hf_config import MoeArch


class SparseMoeBlock(nn.Module):
    """Router plus experts: each token's output is its ``top_k`` experts' outputs weighted by the
    router's probabilities (renormalised over the ``top_k`` where the model says so)."""

    def __init__(self, moe: MoeArch, hidden_size: int, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.tp = tp if tp is not None else TensorParallel.single()
        self.top_k = moe.top_k
        self.num_experts = moe.num_experts
        self.renormalize = moe.norm_topk_prob
        self.expert_names = moe.expert_names
        self.inter_shard = split(moe.expert_intermediate_size, self.tp)
        """The rows of each expert's gate and up (columns of its down) this tp rank holds."""
        self.intermediate_size = inter = self.inter_shard.size
        self.gate = nn.Linear(hidden_size, moe.num_experts, bias=False)
        self.w13 = nn.Parameter(torch.empty(moe.num_experts, 2 * inter, hidden_size))
        self.w2 = nn.Parameter(torch.empty(moe.num_experts, hidden_size, inter))
        gate, up, down = moe.expert_names
        self._slices = {gate: ("w13", 0), up: ("w13", inter), down: ("w2", 0)}

    def forward(self, x: torch.Tensor, then: str | None = None) -> torch.Tensor | SplitPartials:
        """The experts' weighted sum for ``x [T, hidden]`` (the post-attention norm's output);
        ``then="norm"`` (:meth:`forward_fused`: a fused norm reads it) may leave it unsummed
        (``pprun.layers.moe.moe_experts``)."""
        # Logits in the activation dtype and softmax in float32, as transformers' routers.
        weights, ids = route(linear(self.gate, x), self.top_k, self.renormalize)
        if self.tp.size == 1:
            return moe_experts(x, self.w13, self.w2, weights, ids, then=then)
        # Each rank's experts are partial sums over its intermediate slice: merged, then all-reduced.
        return self.tp.all_reduce(moe_experts(x, self.w13, self.w2, weights, ids))

    def forward_fused(
        self, norm: nn.Module, h: torch.Tensor | SplitPartials, residual: torch.Tensor, then: str | None,
    ) -> tuple[torch.Tensor | SplitPartials, torch.Tensor]:
        """``norm`` (the post-attention norm) and then :meth:`forward` where the fused ops run: the
        router, the grouped expert kernels, each token's expert outputs left to the next norm to
        sum when ``then="norm"`` (the interface of ``pprun.models.llama.MLP.forward_fused``)."""
        x, residual = norm(h, residual)
        return self(x, then=then), residual

    def expert_shards(self, prefix: str) -> dict[str, Shard]:
        """``checkpoint name -> Shard`` of every expert's tensors under ``prefix`` (the block's
        name in the checkpoint) this tp rank reads; empty at tp 1."""
        if self.tp.size == 1:
            return {}
        gate, up, down = self.expert_names
        rows, cols = self.inter_shard, Shard(1, self.inter_shard.start, self.inter_shard.size)
        return {f"{prefix}.experts.{e}.{proj}.weight": shard for e in range(self.num_experts)
                for proj, shard in ((gate, rows), (up, rows), (down, cols))}

    def load_expert(self, expert: int, proj: str, tensor: torch.Tensor) -> None:
        """Copy one expert's checkpoint tensor (``proj``: its gate, up or down name) into place."""
        if proj not in self._slices or not 0 <= expert < self.num_experts:
            raise ValueError(f"expert tensor {expert}.{proj} has no place in this block "
                             f"({self.num_experts} experts, projections {sorted(self._slices)})")
        name, row0 = self._slices[proj]
        param = getattr(self, name)
        param.data[expert, row0 : row0 + tensor.shape[0]].copy_(tensor)
