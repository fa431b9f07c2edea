"""Per-head RMSNorm of q and k inside a fused q/k/v projection, in place, in one Triton launch
(Qwen3's ``q_norm`` / ``k_norm``, applied before RoPE).

``qkv [T, (H + 2 * KVH) * D]`` holds each token's ``H`` query heads, then ``KVH`` key heads,
then the values; each q head is normalised over its ``D`` entries with ``q_weight [D]`` and each
k head with ``k_weight [D]``, rounded as ``pprun.layers.norm.RMSNorm`` (the plain-torch
reference, ``pprun.models.llama.Attention.norm_heads``) rounds: fp32 mean of squares, the
normalised value rounded to the activation dtype, then times the weight.  The values are not
touched.  One program per (token, head), or from :data:`WHOLE_TOKEN_MIN_TOKENS` tokens on one
program per token over all its q and k heads (one kernel, ``HEADS_PER_PROGRAM`` 1 or all);
capture-safe (grid from shapes, written in place).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pprun.kernels.triton_utils import NO_FMA, pdl_options, pdl_sync

WHOLE_TOKEN_MIN_TOKENS: int | None = 512
"""From this many tokens on, one program normalises all of a token's q and k heads (a ``[heads,
head_dim]`` tile on 4 warps, 8 past 8,192 entries) instead of one program per head.  On the H200,
8,192-token prefill steps (``python scripts/gpu_speed.py MODEL --no-decode --ab --ab-prefill
--prefill-shape 512,32,8192 --prefill-trace --ab-only WHOLE_TOKEN_MIN_TOKENS=None``): the head
norms take 2.5 ms over Qwen3-30B-A3B's 48 layer-steps one program per token, 8.6 ms one per head
(295k one-warp programs a step); Qwen3-8B's 72, 4.2 against 14.3 ms.  Below 512 tokens (decode
steps, whose full CUDA graphs were timed per head) one program per head; None: per head at every
size."""


@triton.jit
def _head_rms_norm_kernel(
    qkv_ptr,
    q_w_ptr,
    k_w_ptr,
    stride_t,
    head_dim,
    inv_head_dim,
    eps,
    NUM_HEADS: tl.constexpr,
    NUM_QK_HEADS: tl.constexpr,
    HEADS_PER_PROGRAM: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """``HEADS_PER_PROGRAM`` of one token's q and k heads (program ``(token, head block)``), each
    row of the tile a head: fp32 mean of squares, the normalised value rounded to the
    activation dtype, then times the weight."""
    token = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * HEADS_PER_PROGRAM + tl.arange(0, HEADS_PER_PROGRAM)
    offs = tl.arange(0, BLOCK)
    col_ok = offs < head_dim
    mask = (heads < NUM_QK_HEADS)[:, None] & col_ok[None, :]
    q_w = tl.load(q_w_ptr + offs, mask=col_ok, other=0.0).to(tl.float32)
    k_w = tl.load(k_w_ptr + offs, mask=col_ok, other=0.0).to(tl.float32)
    w = tl.where((heads < NUM_HEADS)[:, None], q_w[None, :], k_w[None, :])
    pdl_sync(USE_PDL)
    ptr = qkv_ptr + token * stride_t + heads[:, None] * head_dim + offs[None, :]
    x = tl.load(ptr, mask=mask, other=0.0)
    h = x.to(tl.float32)
    var = tl.sum(h * h, axis=1) * inv_head_dim
    normed = (h * tl.math.rsqrt(var + eps)[:, None]).to(x.dtype)
    tl.store(ptr, (w * normed.to(tl.float32)).to(x.dtype), mask=mask)


def head_rms_norm_(
    qkv: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
) -> torch.Tensor:
    """Normalise ``qkv``'s q and k heads in place (module docstring); returns ``qkv``."""
    if qkv.dim() != 2 or qkv.stride(1) != 1 or qkv.shape[1] != (num_heads + 2 * num_kv_heads) * head_dim:
        raise ValueError(f"qkv must be a [tokens, {(num_heads + 2 * num_kv_heads) * head_dim}] tensor "
                         f"contiguous in its last dim, got shape {tuple(qkv.shape)}, strides {qkv.stride()}")
    if q_weight.shape != (head_dim,) or k_weight.shape != (head_dim,):
        raise ValueError(f"q/k norm weights must be ({head_dim},), got {tuple(q_weight.shape)} "
                         f"and {tuple(k_weight.shape)}")
    num_tokens = qkv.shape[0]
    if num_tokens == 0:
        return qkv
    qk_heads, block = num_heads + num_kv_heads, triton.next_power_of_2(head_dim)
    whole_token = WHOLE_TOKEN_MIN_TOKENS is not None and num_tokens >= WHOLE_TOKEN_MIN_TOKENS
    per_program = triton.next_power_of_2(qk_heads) if whole_token else 1
    _head_rms_norm_kernel[(num_tokens, triton.cdiv(qk_heads, per_program))](
        qkv, q_weight, k_weight, qkv.stride(0), head_dim, 1.0 / head_dim, eps,
        NUM_HEADS=num_heads, NUM_QK_HEADS=qk_heads, HEADS_PER_PROGRAM=per_program, BLOCK=block,
        num_warps=1 if per_program == 1 else 4 if per_program * block <= 8192 else 8,
        **pdl_options(qkv.device), **NO_FMA,
    )
    return qkv
