"""The sparse MLP of a mixture-of-experts decoder layer (Qwen3-MoE, Mixtral), as one module.

``SparseMoeBlock`` holds the router (``gate``, a linear map to one logit per expert) and every
expert's SwiGLU weights stacked in two tensors, ``w13 [E, 2 * inter, hidden]`` (gate rows, then
up rows) and ``w2 [E, hidden, inter]``; a checkpoint's per-expert tensors are copied into their
slices by :meth:`SparseMoeBlock.load_expert`.  What it computes (the routing and the experts'
weighted sum, fused kernels where they run) is ``pprun.layers.moe``.

An FP8 checkpoint's experts stay float8 e4m3 where the run keeps FP8 weights
(``pprun.models.quantization.LinearFactory.fp8_experts``): ``w13`` and ``w2`` then hold the
float8 weights as stored and ``w13_scale`` / ``w2_scale`` their float32 scales, per weight row
(``[E, 2 * inter, 1]``, ``[E, hidden, 1]``; a per-tensor scale repeated over its rows) or per
128x128 block (the gate's blocks, then the up's: ``pprun.layers.moe_shapes.expert_scale_shapes``); the
grouped kernels read them as they are (half the bytes of bf16 experts).  Elsewhere the loader
dequantizes them into bf16/fp16 ``w13`` / ``w2``.

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
from pprun.layers.moe_shapes import expert_scale_shapes
from pprun.layers.parallel_linear import Shard, split
from pprun.models.hf_config import MoeArch
from pprun.models.quantization_config import WeightScheme

FP8_DTYPE = torch.float8_e4m3fn
SCALE_BLOCK = 128
"""The only block size whose float8 experts are kept (``LinearFactory.fp8_experts``)."""


class SparseMoeBlock(nn.Module):
    """Router plus experts: each token's output is its ``top_k`` experts' outputs weighted by the
    router's probabilities (renormalised over the ``top_k`` where the model says so)."""

    def __init__(self, moe: MoeArch, hidden_size: int, tp: TensorParallel | None = None,
                 fp8: WeightScheme | None = None) -> None:
        """``fp8``: the scheme of float8 experts kept as stored (module docstring); None: experts in
        the run's dtype."""
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
        num_experts = moe.num_experts
        gate, up, down = moe.expert_names
        self._slices = {gate: ("w13", 0), up: ("w13", inter), down: ("w2", 0)}
        self.scale_block: int | None = None
        """Float8 experts' block size (None: per-row scales, or no float8)."""
        self.scale_kind: str | None = None
        """The checkpoint's scale strategy of float8 experts (``block``, ``channel``, ``tensor``)."""
        if fp8 is None:
            self.w13 = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden_size))
            self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, inter))
            self.w13_scale = self.w2_scale = None
            return
        if fp8.strategy == "block" and fp8.block != (SCALE_BLOCK, SCALE_BLOCK):
            raise ValueError(f"float8 experts with {fp8.block} blocks: kept float8 only with "
                             f"{SCALE_BLOCK}x{SCALE_BLOCK} blocks (others are dequantized at load)")
        self.scale_kind = fp8.strategy
        self.scale_block = SCALE_BLOCK if fp8.strategy == "block" else None
        self.keep_dtypes = ("w13", "w2", "w13_scale", "w2_scale")
        """Parameters ``pprun.models.base.allocate`` leaves in their own dtypes."""
        w13_scale_shape, w2_scale_shape = expert_scale_shapes(num_experts, inter, hidden_size, self.scale_block)
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden_size, dtype=FP8_DTYPE), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, inter, dtype=FP8_DTYPE), requires_grad=False)
        self.w13_scale = nn.Parameter(torch.empty(w13_scale_shape, dtype=torch.float32), requires_grad=False)
        self.w2_scale = nn.Parameter(torch.empty(w2_scale_shape, dtype=torch.float32), requires_grad=False)
        up_scale_row = w13_scale_shape[1] // 2  # the up rows' first scale row: per row or per block
        self._scale_slices = {gate: ("w13_scale", 0), up: ("w13_scale", up_scale_row), down: ("w2_scale", 0)}

    def forward(self, x: torch.Tensor, then: str | None = None) -> torch.Tensor | SplitPartials:
        """The experts' weighted sum for ``x [T, hidden]`` (the post-attention norm's output);
        ``then="norm"`` (:meth:`forward_fused`: a fused norm reads it) may leave it unsummed
        (``pprun.layers.moe.moe_experts``)."""
        # Logits in the activation dtype and softmax in float32, as transformers' routers.
        weights, ids = route(linear(self.gate, x), self.top_k, self.renormalize)
        scales = {"w13_scale": self.w13_scale, "w2_scale": self.w2_scale, "scale_block": self.scale_block}
        if self.tp.size == 1:
            return moe_experts(x, self.w13, self.w2, weights, ids, then=then, **scales)
        # Each rank's experts are partial sums over its intermediate slice: merged, then all-reduced.
        return self.tp.all_reduce(moe_experts(x, self.w13, self.w2, weights, ids, **scales))

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

    def load_expert(self, expert: int, proj: str, tensor: torch.Tensor, param: str = "weight") -> None:
        """Copy one expert's checkpoint tensor (``proj``: its gate, up or down name; ``param``:
        ``weight``, or for float8 experts its scale, ``weight_scale`` / ``weight_scale_inv``) into
        place."""
        if proj not in self._slices or not 0 <= expert < self.num_experts:
            raise ValueError(f"expert tensor {expert}.{proj} has no place in this block "
                             f"({self.num_experts} experts, projections {sorted(self._slices)})")
        if param == "weight":
            name, row0 = self._slices[proj]
            getattr(self, name).data[expert, row0 : row0 + tensor.shape[0]].copy_(tensor)
            return
        if self.scale_kind is None or param not in ("weight_scale", "weight_scale_inv"):
            raise ValueError(f"expert tensor {expert}.{proj}.{param} has no place in this block "
                             f"(its experts are {'float8' if self.scale_kind else 'not float8'})")
        name, row0 = self._scale_slices[proj]
        scale = getattr(self, name).data[expert]
        if self.scale_kind == "block":
            scale[row0 : row0 + tensor.shape[0]].copy_(tensor)
            return
        # One scale per weight row: the rows of this projection (a per-tensor scale over all of them).
        rows = self.intermediate_size if name == "w13_scale" else scale.shape[0]
        scale[row0 : row0 + rows].copy_(tensor.reshape(-1, 1).expand(rows, 1))
