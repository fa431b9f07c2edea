"""The shapes of float8 experts' scales, shared by the reference experts (``pprun.layers.moe``)
and the grouped Triton kernels (``pprun.layers.moe_triton``), which import each other's module
no other way."""

from __future__ import annotations


def expert_scale_shapes(num_experts: int, inter: int, hidden: int,
                        scale_block: int | None) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The shapes of float8 experts' scales, ``(w13_scale, w2_scale)``: one per weight row,
    ``[E, 2 * inter, 1]`` and ``[E, hidden, 1]``, or one per ``scale_block`` x ``scale_block``
    block, the gate's blocks then the up's (each its own: a partial last block stays apart),
    ``[E, 2 * ceil(inter / b), ceil(hidden / b)]`` and ``[E, ceil(hidden / b), ceil(inter / b)]``."""
    if scale_block is None:
        return (num_experts, 2 * inter, 1), (num_experts, hidden, 1)
    inter_blocks, hidden_blocks = -(-inter // scale_block), -(-hidden // scale_block)
    return (num_experts, 2 * inter_blocks, hidden_blocks), (num_experts, hidden_blocks, inter_blocks)
