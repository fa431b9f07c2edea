"""A decode step's MLP half in one persistent launch (prototype, off by default).

At batch 32 the MLP half of a Llama layer is three kernels: the add + RMSNorm that merges
``o_proj``'s split-K partials, ``gate_up`` with its SwiGLU, and ``down`` leaving its partials
to the next norm (31.5 us per layer on an H200 for ~25 us of bytes; ``docs/performance.md``).
Every kernel boundary drains the GPU and ramps it up again.  Here one launch of about one
program per SM pulls tasks from a global counter in dependency order:

1. norm tasks, one per row: merge the partials, add the residual, RMSNorm (rounded step by step
   as ``fused.fused_add_rms_norm``), write the normed row and the new residual;
2. ``gate_up`` tasks, one per 64-column block of gate and up: wait until every row is normed,
   then the swapped split-K product over the whole of K and the SwiGLU epilogue, as
   ``skinny``'s kernel computes them; each done block counts towards its group (the columns of
   one ``down`` K split);
3. ``down`` tasks, one per (K split, 64-column block), split-major: wait only for the
   ``gate_up`` group of their K range, then store their fp32 partial (``SplitPartials``, merged
   by the next norm).

So the tail of one stage overlaps the start of the next.  Tasks are fetched, never assigned, so
a task waits only for tasks that running programs fetched before it: no deadlock whatever the
grid, and under the Triton interpreter (programs one after another) program 0 takes every task
in order and every wait is already met.  The last program to leave resets the counters, which
persist across launches (CUDA graphs).

Results are bit for bit those of the three launches with the same settings (the norm's fp32
sum order aside on a GPU, where a reduction's order follows the warps; the interpreter sums in
one order).  Prepared, not yet run on a GPU: ``PERSISTENT_MLP_ENABLED`` (``pprun.layers``)
switches the model to it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pprun.layers import SplitPartials
from pprun.layers.fused import silu_mul
from pprun.layers.skinny import _mul_rn, _num_sms, _swapped_product, arrival_counters
from pprun.layers.triton_utils import INTERPRETED as _INTERPRETED
from pprun.layers.triton_utils import _capability, l2_prefetch, pdl_options, pdl_sync

BLOCK_N = 64
"""Weight rows per ``gate_up`` / ``down`` task (one wgmma M tile)."""
MLP_BLOCK_K = 128
"""K tile of the matmul tasks (64 with 4 stages halves the shared memory: two programs per SM)."""
MLP_NUM_STAGES = 4
"""Pipeline stages of the matmul tasks' K loops."""
DOWN_SPLITS = 8
"""``down``'s K splits (the task count of ``down`` is this times its 64-column blocks)."""
MLP_PROGRAMS_PER_SM = 1
"""Programs per SM (at 128-wide K tiles and 4 stages the ``gate_up`` task's pipeline takes 160 KB
of shared memory: one fits; more programs than fit only wait for a free SM)."""

MLP_PREFETCH_BYTES = 0
"""Bytes from the start of each weight row of a matmul task (its K range, for ``down``) asked
of L2 before the task waits for its inputs, so that the wait overlaps the weights' first bytes
(0: none; sm_90 and later; A/B switch)."""
MLP_WAIT_IN_NORM = False
"""Only the norm tasks wait for the kernel before (PDL); the matmul tasks wait only for the
norm tasks' counter, so a program that starts on a ``gate_up`` task asks for its weights while
``o_proj`` still runs (A/B switch)."""

COUNTER_OFFSET = 3072
"""Where this kernel's counters start in ``skinny.arrival_counters``' buffer: past the slots the
other kernels use (a leftover there would hang this one, not just change a result)."""
COUNTER_STRIDE = 32
"""int32 slots between two counters: each on its own 128-byte line, apart from the pollers of
the others.  Slots (in strides): 0 the next task, 1 programs that left, 2 normed rows, 3 + g
the gate_up blocks done in down split g."""


@triton.jit
def _wait_at_least(ptr, target, BACKOFF: tl.constexpr):
    """Spin until the int32 counter at ``ptr`` reaches ``target`` (acquire: what the tasks that
    counted wrote is visible after it), sleeping a little between polls (``BACKOFF``, not under
    the interpreter).  The interpreter runs programs one after another, so every wait there is
    met at once: a target set too low would go unnoticed by its tests, one set too high hangs."""
    seen = tl.atomic_add(ptr, 0, sem="acquire", scope="gpu")
    while seen < target:
        if BACKOFF:
            tl.inline_asm_elementwise("nanosleep.u32 32; mov.u32 $0, 0;", "=r", [], dtype=tl.int32,
                                      is_pure=False, pack=1)
        seen = tl.atomic_add(ptr, 0, sem="acquire", scope="gpu")


@triton.jit
def _persistent_mlp_kernel(
    part_ptr, res_ptr, norm_w_ptr, h_ptr, res_out_ptr,
    gu_w_ptr, act_ptr, down_w_ptr, out_part_ptr, ctr_ptr,
    M, H, INTER, inv_hidden, eps, num_programs,
    NUM_PARTS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr, DOWN_SPLITS: tl.constexpr, DOWN_K_PER: tl.constexpr,
    DOT_F32: tl.constexpr, PRECISE_EXP: tl.constexpr, EXACT_MUL: tl.constexpr, USE_PDL: tl.constexpr,
    CTR: tl.constexpr, GU_PREFETCH: tl.constexpr, DOWN_PREFETCH: tl.constexpr, WAIT_IN_NORM: tl.constexpr,
):
    # The partials come from the kernel before (PDL: wait for it before reading them).  Every
    # other task reads only what the norm tasks wrote, after their counter says so.
    if not WAIT_IN_NORM:
        pdl_sync(USE_PDL)
    dtype = res_out_ptr.dtype.element_ty
    num_gate_up_blocks = tl.cdiv(INTER, BLOCK_N)
    num_down_blocks = tl.cdiv(H, BLOCK_N)
    blocks_per_split = DOWN_K_PER // BLOCK_N
    num_tasks = M + num_gate_up_blocks + DOWN_SPLITS * num_down_blocks
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    task = tl.atomic_add(ctr_ptr, 1, sem="relaxed", scope="gpu")
    while task < num_tasks:
        if task < M:
            # Norm of row ``task``: as fused._add_rms_norm_kernel with NUM_PARTS partials.
            if WAIT_IN_NORM:
                pdl_sync(USE_PDL)
            row = task.to(tl.int64)
            offs = tl.arange(0, BLOCK_H)
            mask = offs < H
            merged = tl.zeros([BLOCK_H], tl.float32)
            for s in tl.static_range(NUM_PARTS):
                merged += tl.load(part_ptr + (s * M + row) * H + offs, mask=mask, other=0.0)
            x = merged.to(dtype)
            r = tl.load(res_ptr + row * H + offs, mask=mask, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(dtype)
            tl.store(res_out_ptr + row * H + offs, x, mask=mask)
            hf = x.to(tl.float32)
            var = _mul_rn(tl.sum(_mul_rn(hf, hf, EXACT_MUL), axis=0), inv_hidden, EXACT_MUL)
            normed = (hf * tl.math.rsqrt(var + eps)).to(dtype)
            w = tl.load(norm_w_ptr + offs, mask=mask, other=0.0)
            out = w.to(tl.float32) * normed.to(tl.float32)
            tl.store(h_ptr + row * H + offs, out.to(dtype), mask=mask)
            tl.debug_barrier()
            tl.atomic_add(ctr_ptr + 2 * CTR, 1, sem="release", scope="gpu")
        elif task < M + num_gate_up_blocks:
            # gate_up block: silu(h @ gate.T) * (h @ up.T) for 64 columns, all of K.
            blk = task - M
            offs_n = blk * BLOCK_N + tl.arange(0, BLOCK_N)
            n_mask = offs_n < INTER
            gate_rows = gu_w_ptr + offs_n.to(tl.int64)[:, None] * H
            up_rows = gu_w_ptr + (offs_n + INTER).to(tl.int64)[:, None] * H
            x_rows = h_ptr + offs_m.to(tl.int64)[:, None] * H
            acc_t = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
            acc_up_t = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
            if GU_PREFETCH > 0:
                l2_prefetch(gu_w_ptr + offs_n.to(tl.int64) * H, n_mask, GU_PREFETCH)
                l2_prefetch(gu_w_ptr + (offs_n + INTER).to(tl.int64) * H, n_mask, GU_PREFETCH)
            _wait_at_least(ctr_ptr + 2 * CTR, M, EXACT_MUL)
            for k0 in tl.range(0, H, BLOCK_K, num_stages=NUM_STAGES):
                offs_k = k0 + tl.arange(0, BLOCK_K)
                k_mask = offs_k < H
                x = tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0,
                            cache_modifier=".cg")
                wk_mask = n_mask[:, None] & k_mask[None, :]
                acc_t += _swapped_product(x, tl.load(gate_rows + offs_k[None, :], mask=wk_mask, other=0.0), DOT_F32)
                acc_up_t += _swapped_product(x, tl.load(up_rows + offs_k[None, :], mask=wk_mask, other=0.0), DOT_F32)
            y = silu_mul(tl.trans(acc_t).to(dtype), tl.trans(acc_up_t).to(dtype), PRECISE_EXP)
            tl.store(act_ptr + offs_m.to(tl.int64)[:, None] * INTER + offs_n[None, :], y,
                     mask=m_mask[:, None] & n_mask[None, :])
            tl.debug_barrier()
            group = tl.minimum(blk // blocks_per_split, DOWN_SPLITS - 1)
            tl.atomic_add(ctr_ptr + (3 + group) * CTR, 1, sem="release", scope="gpu")
        else:
            # down tile: K split ``s`` of the activation against 64 rows of down, fp32 partial.
            d = task - M - num_gate_up_blocks
            s = d // num_down_blocks
            offs_n = (d % num_down_blocks) * BLOCK_N + tl.arange(0, BLOCK_N)
            n_mask = offs_n < H
            k_begin = s * DOWN_K_PER
            k_end = tl.minimum(k_begin + DOWN_K_PER, INTER)
            w_rows = down_w_ptr + offs_n.to(tl.int64)[:, None] * INTER
            x_rows = act_ptr + offs_m.to(tl.int64)[:, None] * INTER
            acc_t = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
            if DOWN_PREFETCH > 0:
                l2_prefetch(down_w_ptr + offs_n.to(tl.int64) * INTER + k_begin, n_mask, DOWN_PREFETCH)
            _wait_at_least(ctr_ptr + (3 + s) * CTR, blocks_per_split, EXACT_MUL)
            for k0 in tl.range(k_begin, k_end, BLOCK_K, num_stages=NUM_STAGES):
                offs_k = k0 + tl.arange(0, BLOCK_K)
                k_mask = offs_k < k_end
                x = tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0,
                            cache_modifier=".cg")
                w = tl.load(w_rows + offs_k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
                acc_t += _swapped_product(x, w, DOT_F32)
            tl.store(out_part_ptr + (s * M + offs_m.to(tl.int64)[:, None]) * H + offs_n[None, :], tl.trans(acc_t),
                     mask=m_mask[:, None] & n_mask[None, :])
        task = tl.atomic_add(ctr_ptr, 1, sem="relaxed", scope="gpu")
    # The last program to leave resets the counters for the next launch: every program has
    # made its last fetch by then.
    tl.debug_barrier()
    left = tl.atomic_add(ctr_ptr + CTR, 1, sem="acq_rel", scope="gpu")
    if left == num_programs - 1:
        for i in tl.static_range(3 + DOWN_SPLITS):
            tl.atomic_xchg(ctr_ptr + i * CTR, 0, sem="relaxed", scope="gpu")


def persistent_mlp(
    x: SplitPartials,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    gate_up_weight: torch.Tensor,
    down_weight: torch.Tensor,
    num_programs: int | None = None,
) -> tuple[SplitPartials, torch.Tensor]:
    """``down(silu(gate(h)) * up(h))`` with ``h = norm(x + residual)``, in one launch.

    Args:
        x: ``o_proj``'s split-K partials (``[splits, M, H]`` float32, no bias), ``2 <= M <= 32``.
        residual: ``[M, H]`` contiguous, of ``x``'s output dtype.
        norm_weight: ``[H]`` contiguous, that dtype too.
        gate_up_weight: ``[2 * I, H]`` contiguous (gate rows, then up rows), that dtype.
        down_weight: ``[H, I]`` contiguous, that dtype; ``I`` a multiple of ``DOWN_SPLITS * 64``.
        num_programs: the grid (default: :data:`MLP_PROGRAMS_PER_SM` per SM, at most one per task).

    Returns ``(down's partials, new residual)``, as ``RMSNorm`` then ``MLP`` with deferred merges
    would: the partials for the next norm to merge, ``x + residual``.
    """
    if not isinstance(x, SplitPartials) or x.bias is not None or x.parts.dtype != torch.float32:
        raise ValueError("x must be SplitPartials of float32 partials without a bias, got "
                         f"{type(x).__name__}" + (f" ({x.parts.dtype}, bias {x.bias is not None})"
                                                  if isinstance(x, SplitPartials) else ""))
    parts = x.parts
    if parts.dim() != 3 or not parts.is_contiguous():
        raise ValueError(f"x.parts must be a contiguous [splits, M, H] tensor, got shape {tuple(parts.shape)}")
    _, m, hidden = parts.shape
    dtype = x.dtype
    if not 2 <= m <= 32:
        raise ValueError(f"persistent_mlp serves 2 to 32 rows, got {m}")
    inter = down_weight.shape[1] if down_weight.dim() == 2 else -1
    expected = {"residual": (residual, (m, hidden)), "norm_weight": (norm_weight, (hidden,)),
                "gate_up_weight": (gate_up_weight, (2 * inter, hidden)), "down_weight": (down_weight, (hidden, inter))}
    for name, (t, shape) in expected.items():
        if tuple(t.shape) != shape or t.dtype != dtype or not t.is_contiguous() or t.device != parts.device:
            raise ValueError(f"{name} must be a contiguous {shape} {dtype} tensor on {parts.device}, got "
                             f"{tuple(t.shape)} {t.dtype} on {t.device}")
    if inter % (DOWN_SPLITS * BLOCK_N):
        raise ValueError(f"the intermediate size {inter} must be a multiple of DOWN_SPLITS * {BLOCK_N} = "
                         f"{DOWN_SPLITS * BLOCK_N}")
    device = parts.device
    h = torch.empty((m, hidden), dtype=dtype, device=device)
    new_residual = torch.empty((m, hidden), dtype=dtype, device=device)
    act = torch.empty((m, inter), dtype=dtype, device=device)
    out_parts = torch.empty((DOWN_SPLITS, m, hidden), dtype=torch.float32, device=device)
    num_tasks = m + triton.cdiv(inter, BLOCK_N) + DOWN_SPLITS * triton.cdiv(hidden, BLOCK_N)
    if num_programs is None:
        num_programs = MLP_PROGRAMS_PER_SM * _num_sms(device)
    num_programs = max(1, min(num_programs, num_tasks))
    gu_prefetch, down_prefetch = _prefetch_bytes(gate_up_weight, down_weight, inter // DOWN_SPLITS)
    counters = arrival_counters(device, COUNTER_OFFSET + (3 + DOWN_SPLITS) * COUNTER_STRIDE)[COUNTER_OFFSET:]
    _persistent_mlp_kernel[(num_programs,)](
        parts, residual, norm_weight, h, new_residual,
        gate_up_weight, act, down_weight, out_parts, counters,
        m, hidden, inter, 1.0 / hidden, eps, num_programs,
        NUM_PARTS=parts.shape[0], BLOCK_H=triton.next_power_of_2(hidden), BLOCK_M=max(16, triton.next_power_of_2(m)),
        BLOCK_N=BLOCK_N, BLOCK_K=MLP_BLOCK_K, NUM_STAGES=MLP_NUM_STAGES, DOWN_SPLITS=DOWN_SPLITS,
        DOWN_K_PER=inter // DOWN_SPLITS, DOT_F32=dtype == torch.float32 or _INTERPRETED,
        PRECISE_EXP=not _INTERPRETED, EXACT_MUL=not _INTERPRETED, CTR=COUNTER_STRIDE,
        GU_PREFETCH=gu_prefetch, DOWN_PREFETCH=down_prefetch, WAIT_IN_NORM=MLP_WAIT_IN_NORM, num_warps=4,
        **pdl_options(device),
    )
    return SplitPartials(out_parts, None, dtype), new_residual


def _prefetch_bytes(gate_up_weight: torch.Tensor, down_weight: torch.Tensor, down_k_per: int) -> tuple[int, int]:
    """Per-row L2 prefetch sizes for the ``gate_up`` and ``down`` tasks (:data:`MLP_PREFETCH_BYTES`,
    cut to a row's K range in whole 16-byte units), 0 where a bulk prefetch cannot run: the
    interpreter, a GPU before sm_90, row starts not 16-byte aligned."""
    device = gate_up_weight.device
    if MLP_PREFETCH_BYTES <= 0 or _INTERPRETED or device.type != "cuda" or _capability(device) < 9:
        return 0, 0
    size = gate_up_weight.element_size()
    sizes = []
    for w, row_elems in ((gate_up_weight, gate_up_weight.shape[1]), (down_weight, down_k_per)):
        aligned = w.data_ptr() % 16 == 0 and (w.stride(0) * size) % 16 == 0 and (down_k_per * size) % 16 == 0
        sizes.append(min(MLP_PREFETCH_BYTES, row_elems * size) // 16 * 16 if aligned else 0)
    return sizes[0], sizes[1]
