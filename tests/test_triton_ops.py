"""Paged attention: the torch reference against dense SDPA, and the Triton kernels against it.

The reference tests always run (CPU).  The Triton tests run on CUDA, or on CPU under the
Triton interpreter (the default without CUDA; slow: shapes stay tiny)::

    pytest tests/test_triton_ops.py
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from triton_env import DEVICE, triton_only  # noqa: E402  (sets TRITON_INTERPRET)

from pprun.attention.ref_ops import paged_attention_ref, write_kv_cache

TRITON_DEVICE = DEVICE

TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 2e-3}


@dataclass
class Case:
    """One step's attention inputs, plus the dense per-request K/V they were built from."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    kv_cache: torch.Tensor  # holds only the context before this step
    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    num_reqs: int
    max_query_len: int
    dense_k: list[torch.Tensor]  # per request [seq_len, kv_heads, d]
    dense_v: list[torch.Tensor]
    scale: float


def make_case(
    query_lens: list[int],
    context_lens: list[int],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: str = "cpu",
    num_reqs_padded: int | None = None,
    num_tokens_padded: int | None = None,
    max_blocks_per_req: int | None = None,
    seed: int = 0,
    head_major: bool = False,
) -> Case:
    """Random step: each request has ``context_lens[i]`` cached tokens and ``query_lens[i]`` new ones.

    Blocks are handed out in a random order so block tables are non-contiguous; padded
    requests get seq_len 0 and null-block rows, padded tokens get slot -1.  ``head_major``
    stores the cache as ``pprun.worker.kv_cache.HEAD_MAJOR`` does (same shape, other strides).
    """
    gen = torch.Generator().manual_seed(seed)
    num_reqs = len(query_lens)
    num_reqs_padded = num_reqs_padded or num_reqs
    num_tokens = sum(query_lens)
    num_tokens_padded = num_tokens_padded or num_tokens
    seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
    blocks_needed = [-(-s // block_size) for s in seq_lens]
    max_blocks_per_req = max_blocks_per_req or max(blocks_needed)
    num_blocks = sum(blocks_needed) + 3  # + null block 0 and two never used
    free = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype)

    block_table = torch.zeros(num_reqs_padded, max_blocks_per_req, dtype=torch.int32)
    kv_cache = randn(2, num_blocks, block_size, num_kv_heads, head_dim)  # garbage outside context
    if head_major:
        kv_cache = kv_cache.transpose(2, 3).contiguous().transpose(2, 3)
    q = randn(num_tokens_padded, num_heads, head_dim)
    k = randn(num_tokens_padded, num_kv_heads, head_dim)
    v = randn(num_tokens_padded, num_kv_heads, head_dim)
    slot_mapping = torch.full((num_tokens_padded,), -1, dtype=torch.int64)
    dense_k, dense_v = [], []
    token = 0
    for req in range(num_reqs):
        ids = [free.pop() for _ in range(blocks_needed[req])]
        block_table[req, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
        slots = torch.tensor(
            [ids[p // block_size] * block_size + p % block_size for p in range(seq_lens[req])],
            dtype=torch.int64,
        )
        ctx, qlen = context_lens[req], query_lens[req]
        ctx_k = randn(ctx, num_kv_heads, head_dim)
        ctx_v = randn(ctx, num_kv_heads, head_dim)
        write_kv_cache(ctx_k, ctx_v, kv_cache, slots[:ctx])
        slot_mapping[token : token + qlen] = slots[ctx:]
        dense_k.append(torch.cat([ctx_k, k[token : token + qlen]]))
        dense_v.append(torch.cat([ctx_v, v[token : token + qlen]]))
        token += qlen

    query_start_loc = torch.zeros(num_reqs_padded + 1, dtype=torch.int32)
    query_start_loc[1 : num_reqs + 1] = torch.tensor(query_lens).cumsum(0)
    query_start_loc[num_reqs + 1 :] = num_tokens
    seq_lens_t = torch.zeros(num_reqs_padded, dtype=torch.int32)
    seq_lens_t[:num_reqs] = torch.tensor(seq_lens, dtype=torch.int32)
    to = lambda t: t.to(device)  # noqa: E731
    return Case(
        q=to(q),
        k=to(k),
        v=to(v),
        kv_cache=to(kv_cache),
        slot_mapping=to(slot_mapping),
        query_start_loc=to(query_start_loc),
        seq_lens=to(seq_lens_t),
        block_table=to(block_table),
        num_reqs=num_reqs,
        max_query_len=max(query_lens),
        dense_k=dense_k,
        dense_v=dense_v,
        scale=head_dim**-0.5,
    )


def dense_attention(case: Case) -> torch.Tensor:
    """Causal SDPA per request on contiguous K/V (independent of the paged layout)."""
    out = torch.zeros(case.q.shape, dtype=torch.float32)
    starts = case.query_start_loc.tolist()
    num_heads, num_kv_heads = case.q.shape[1], case.dense_k[0].shape[1]
    group = num_heads // num_kv_heads
    for req in range(case.num_reqs):
        q = case.q[starts[req] : starts[req + 1]].cpu().float().transpose(0, 1)  # [h, qlen, d]
        k = case.dense_k[req].float().repeat_interleave(group, 1).transpose(0, 1)
        v = case.dense_v[req].float().repeat_interleave(group, 1).transpose(0, 1)
        qlen, seq_len = q.shape[1], k.shape[1]
        # Bottom-right aligned causal mask: the queries are the last qlen positions.
        allowed = torch.ones(qlen, seq_len, dtype=torch.bool).tril(diagonal=seq_len - qlen)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=case.scale)
        out[starts[req] : starts[req + 1]] = o.transpose(0, 1)
    return out


SHAPES = [
    # (num_heads, num_kv_heads, head_dim, block_size)
    (32, 8, 64, 16),
    (9, 3, 64, 32),
]


# ---------------------------------------------------------------- reference vs dense SDPA


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ref_matches_dense_sdpa(num_heads, num_kv_heads, head_dim, block_size, dtype):
    # Mixed batch: fresh prefill, chunked prefill with context, two decodes, two padded reqs.
    case = make_case(
        [7, 5, 1, 1],
        [0, 37, 20, 3],
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        num_reqs_padded=6,
        num_tokens_padded=18,
        max_blocks_per_req=5,
    )
    write_kv_cache(case.k, case.v, case.kv_cache, case.slot_mapping)
    out = paged_attention_ref(
        case.q,
        case.kv_cache,
        case.query_start_loc,
        case.seq_lens,
        case.block_table,
        case.scale,
        case.num_reqs,
    )
    expected = dense_attention(case)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)
    assert out[14:].abs().sum() == 0, "padded token rows must be zero"


def test_write_kv_cache_skips_padded_slots():
    kv_cache = torch.zeros(2, 3, 4, 1, 2)
    k = torch.ones(3, 1, 2)
    v = 2 * torch.ones(3, 1, 2)
    write_kv_cache(k, v, kv_cache, torch.tensor([5, -1, 8]))
    written = kv_cache[0].reshape(12, 2)[:, 0]
    assert written.nonzero().flatten().tolist() == [5, 8]
    assert kv_cache[1].reshape(12, 2)[8].tolist() == [2.0, 2.0]


def test_write_kv_cache_head_major_storage():
    # The same writes land on the same logical slots whatever the storage order.
    k, v = torch.randn(4, 3, 2), torch.randn(4, 3, 2)
    slots = torch.tensor([5, -1, 8, 0])
    flat = torch.zeros(2, 3, 4, 3, 2)
    head_major = torch.zeros(2, 3, 3, 4, 2).transpose(2, 3)
    write_kv_cache(k, v, flat, slots)
    write_kv_cache(k, v, head_major, slots)
    assert not head_major.is_contiguous()
    assert torch.equal(flat, head_major)
    assert torch.equal(flat[0, 2, 0], k[2]) and torch.equal(flat[1, 1, 1], v[0])


def test_ref_rejects_bad_kv_cache_shape():
    with pytest.raises(ValueError, match="kv_cache"):
        write_kv_cache(torch.zeros(2, 1, 4), torch.zeros(2, 1, 4), torch.zeros(2, 3, 4, 2, 4), torch.zeros(2))


# ---------------------------------------------------------------- triton vs reference



def _run_both(case: Case) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    from pprun.attention.triton_ops import paged_attention

    ref_cache = case.kv_cache.clone()
    write_kv_cache(case.k, case.v, ref_cache, case.slot_mapping)
    expected = paged_attention_ref(
        case.q, ref_cache, case.query_start_loc, case.seq_lens, case.block_table, case.scale, case.num_reqs
    )
    tri_cache = case.kv_cache.clone()
    # NaN-filled: every row, padded ones included, must be written by the kernels.
    out = torch.full_like(case.q, float("nan"))
    paged_attention(
        case.q,
        case.k,
        case.v,
        tri_cache,
        case.slot_mapping,
        case.query_start_loc,
        case.seq_lens,
        case.block_table,
        case.scale,
        out,
        case.max_query_len,
    )
    return out, expected, tri_cache, ref_cache


def _check(case: Case, dtype: torch.dtype) -> None:
    out, expected, tri_cache, ref_cache = _run_both(case)
    torch.testing.assert_close(tri_cache, ref_cache, atol=0, rtol=0)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), expected.float(), atol=tol, rtol=tol)


@triton_only
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_prefill_mixed_batch(num_heads, num_kv_heads, head_dim, block_size, dtype):
    # Fresh prefill spanning two query blocks, chunked prefill after context, decodes,
    # and padding on both requests and tokens.
    case = make_case(
        [70, 9, 1, 1],
        [0, 45, 33, 2],
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        device=TRITON_DEVICE,
        num_reqs_padded=6,
        num_tokens_padded=84,
        max_blocks_per_req=7,
        seed=1,
    )
    _check(case, dtype)


@triton_only
@pytest.mark.parametrize("rope_decode", [False, True])
def test_triton_head_major_cache(rope_decode):
    # pprun.worker.kv_cache.HEAD_MAJOR: the kernels take the cache by its strides; prefill,
    # chunked prefill and decode (and the fused rotary decode) over head-major storage.
    if rope_decode:
        case = make_case(
            [1, 1, 1], [400, 20, 255], num_heads=4, num_kv_heads=2, head_dim=64, block_size=16,
            dtype=torch.float32, device=TRITON_DEVICE, num_reqs_padded=4, num_tokens_padded=4,
            max_blocks_per_req=64, seed=11, head_major=True,
        )
        _check_rope_decode(case, torch.float32)
    else:
        case = make_case(
            [70, 9, 1], [0, 45, 33], num_heads=4, num_kv_heads=2, head_dim=64, block_size=16,
            dtype=torch.float32, device=TRITON_DEVICE, num_reqs_padded=4, num_tokens_padded=84,
            max_blocks_per_req=7, seed=12, head_major=True,
        )
        _check(case, torch.float32)
    assert not case.kv_cache.is_contiguous()


@triton_only
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_decode(num_heads, num_kv_heads, head_dim, block_size, dtype):
    case = make_case(
        [1, 1, 1],
        [40, 0, 90],
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        device=TRITON_DEVICE,
        num_reqs_padded=4,
        num_tokens_padded=4,
        seed=2,
    )
    _check(case, dtype)


@triton_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_decode_split_context(dtype):
    from pprun.attention.triton_ops import num_decode_splits

    # A wide block table allows long contexts, so decode splits the context; one request
    # is longer than a split, one shorter, one padded.
    max_blocks = 64
    assert num_decode_splits(3, 1, max_blocks * 16, torch.device(TRITON_DEVICE)) > 1
    case = make_case(
        [1, 1],
        [400, 20],
        num_heads=4,
        num_kv_heads=1,
        head_dim=64,
        block_size=16,
        dtype=dtype,
        device=TRITON_DEVICE,
        num_reqs_padded=3,
        num_tokens_padded=3,
        max_blocks_per_req=max_blocks,
        seed=3,
    )
    _check(case, dtype)


@triton_only
def test_triton_decode_fewer_token_rows_than_requests():
    # Token padding and request padding need not agree: rows past the tokens do not exist.
    case = make_case(
        [1, 1],
        [5, 17],
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
        block_size=16,
        dtype=torch.float32,
        device=TRITON_DEVICE,
        num_reqs_padded=4,
        num_tokens_padded=3,
        seed=4,
    )
    _check(case, torch.float32)


@triton_only
def test_triton_rejects_head_mismatch():
    from pprun.attention.triton_ops import paged_decode_attention

    q = torch.zeros(2, 6, 64, device=TRITON_DEVICE)
    kv_cache = torch.zeros(2, 4, 16, 4, 64, device=TRITON_DEVICE)
    with pytest.raises(ValueError, match="num_kv_heads"):
        paged_decode_attention(
            q,
            kv_cache,
            torch.zeros(2, 1, dtype=torch.int32, device=TRITON_DEVICE),
            torch.zeros(2, dtype=torch.int32, device=TRITON_DEVICE),
            0.125,
            torch.empty_like(q),
        )


@triton_only
@pytest.mark.parametrize("max_query_len_one", [False, True])
def test_triton_head_dim_128_block_64(max_query_len_one):
    # The other supported config: wider heads and pages larger than one key tile's rows.
    query_lens = [1, 1] if max_query_len_one else [3, 1]
    case = make_case(
        query_lens,
        [70, 130],
        num_heads=4,
        num_kv_heads=2,
        head_dim=128,
        block_size=64,
        dtype=torch.float32,
        device=TRITON_DEVICE,
        seed=5,
    )
    _check(case, torch.float32)


@triton_only
@pytest.mark.parametrize("block_m,block_size", [(64, 16), (128, 16), (128, 64)])
def test_triton_prefill_split_diagonal(block_m, block_size, monkeypatch):
    """``PREFILL_SPLIT_DIAGONAL``: the tiles below a query block's first row run without masks.
    Contexts that end inside a tile, at a tile's edge and past several blocks; a fresh prompt
    over three query blocks; a decode row; padding."""
    from pprun.attention import triton_ops

    monkeypatch.setattr(triton_ops, "PREFILL_BLOCK_M", block_m)
    for split in (False, True):
        monkeypatch.setattr(triton_ops, "PREFILL_SPLIT_DIAGONAL", split)
        case = make_case(
            [150, 9, 20, 1], [0, 45, 128, 70], num_heads=4, num_kv_heads=2, head_dim=128,
            block_size=block_size, dtype=torch.float32, device=TRITON_DEVICE, num_reqs_padded=5,
            num_tokens_padded=184, max_blocks_per_req=(256 // block_size), seed=21,
        )
        _check(case, torch.float32)


@triton_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_mixed_step_leading_decodes_through_the_decode_kernel(dtype):
    """``num_leading_decodes``: a mixed step's first one-token requests attend through the decode kernel,
    the rest through the prefill kernel; the output is the reference's, padded rows zero."""
    from pprun.attention.triton_ops import paged_attention

    case = make_case(
        [1, 1, 1, 70, 9, 1], [33, 130, 2, 0, 45, 20], num_heads=8, num_kv_heads=2, head_dim=64, block_size=16,
        dtype=dtype, device=TRITON_DEVICE, num_reqs_padded=8, num_tokens_padded=88, max_blocks_per_req=12, seed=31,
    )
    ref_cache = case.kv_cache.clone()
    write_kv_cache(case.k, case.v, ref_cache, case.slot_mapping)
    expected = paged_attention_ref(
        case.q, ref_cache, case.query_start_loc, case.seq_lens, case.block_table, case.scale, case.num_reqs
    )
    tol = TOLERANCE[dtype]
    for num_leading_decodes in (0, 3):
        cache = case.kv_cache.clone()
        out = torch.full_like(case.q, float("nan"))
        paged_attention(case.q, case.k, case.v, cache, case.slot_mapping, case.query_start_loc, case.seq_lens,
                        case.block_table, case.scale, out, case.max_query_len, num_leading_decodes=num_leading_decodes)
        torch.testing.assert_close(out.float(), expected.float(), atol=tol, rtol=tol)
    with pytest.raises(ValueError, match="num_leading_decodes"):
        paged_attention(case.q, case.k, case.v, case.kv_cache.clone(), case.slot_mapping, case.query_start_loc,
                        case.seq_lens, case.block_table, case.scale, out, case.max_query_len, num_leading_decodes=8)


def test_prefill_kernel_compiles_for_sm90():
    """The prefill kernel with the unmasked tiles apart compiles for an H100/H200 without a GPU,
    its K/V loads pipelined over ``cp.async`` and its dots on the tensor cores (``wgmma``)."""
    from sm90_compile import compile_sm90

    const = dict(GROUP=4, HEAD_DIM=128, BLOCK_M=128, BLOCK_N=64, BLOCK_D=128, PAGE_SIZE=16, DOT_F32=False,
                 SPLIT_DIAGONAL=True)
    pointers = {"q_ptr": "*bf16", "k_cache_ptr": "*bf16", "v_cache_ptr": "*bf16", "query_start_loc_ptr": "*i32",
                "seq_lens_ptr": "*i32", "block_table_ptr": "*i32", "out_ptr": "*bf16"}
    ptx = compile_sm90("pprun.attention.triton_ops", "_prefill_kernel", const, pointers=pointers,
                       float_args=("scale_log2",), options={"num_warps": 8, "num_stages": 2})
    assert "cp.async" in ptx
    assert "wgmma" in ptx


# ---------------------------------------------------------------- decode with rotary folded in


def _rope_tables(max_positions: int, head_dim: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(device), emb.sin().to(device)


def _rope_decode_once(case: Case, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One ``paged_decode_attention_rope`` over a copy of ``case``'s cache, with the module's
    switches as they are now: ``(output, cache)``."""
    from pprun.attention.triton_ops import paged_decode_attention_rope

    positions = torch.clamp(case.seq_lens.long() - 1, min=0)
    cos, sin = _rope_tables(512, head_dim, TRITON_DEVICE)
    cache, out = case.kv_cache.clone(), torch.empty_like(case.q)
    paged_decode_attention_rope(
        case.q, case.k, case.v, cos, sin, positions, cache, case.slot_mapping, case.block_table,
        case.seq_lens, case.scale, out,
    )
    return out, cache


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    # The model's torch path (HF's formula): tables cast to x's dtype, then three ops.
    c = cos[positions].to(x.dtype).unsqueeze(1)
    s = sin[positions].to(x.dtype).unsqueeze(1)
    x1, x2 = x.chunk(2, dim=-1)
    return x * c + torch.cat((-x2, x1), dim=-1) * s


def _check_rope_decode(case: Case, dtype: torch.dtype, *, rope: bool = True, repeats: int = 1) -> None:
    from pprun.attention.triton_ops import paged_decode_attention_rope

    seq_lens = case.seq_lens.cpu()
    # A decode token sits at the end of its context; padded rows get position 0.
    positions = torch.clamp(seq_lens - 1, min=0).long()
    positions = torch.cat([positions, torch.zeros(case.q.shape[0] - positions.shape[0], dtype=torch.long)])[
        : case.q.shape[0]
    ].to(case.q.device)
    cos = sin = None
    q, k = case.q, case.k
    if rope:
        from pprun.layers.fused import rotary_qk

        cos, sin = _rope_tables(int(seq_lens.max()) + 1, case.q.shape[2], case.q.device.type)
        # The kernels this one replaces: rotary_qk, then the cache write and attention.  Its
        # rotation rounds like the torch formula (checked here too), so the cache must match
        # rotary_qk's bit for bit.
        q, k = rotary_qk(case.q.clone(), case.k.clone(), cos, sin, positions)
        tol = TOLERANCE[dtype]
        torch.testing.assert_close(q, _rotate(case.q, cos, sin, positions), atol=tol, rtol=tol)
    ref_cache = case.kv_cache.clone()
    write_kv_cache(k, case.v, ref_cache, case.slot_mapping)
    expected = paged_attention_ref(
        q, ref_cache, case.query_start_loc, case.seq_lens, case.block_table, case.scale, case.num_reqs
    )
    q_before, k_before = case.q.clone(), case.k.clone()
    for _ in range(repeats):  # the split counters must come back to zero after every launch
        tri_cache = case.kv_cache.clone()
        out = torch.full_like(case.q, float("nan"))
        paged_decode_attention_rope(
            case.q, case.k, case.v, cos, sin, positions, tri_cache, case.slot_mapping,
            case.block_table, case.seq_lens, case.scale, out,
        )
        torch.testing.assert_close(tri_cache, ref_cache, atol=0, rtol=0)
        tol = TOLERANCE[dtype]
        torch.testing.assert_close(out.float(), expected.float(), atol=tol, rtol=tol)
    assert torch.equal(case.q, q_before) and torch.equal(case.k, k_before)  # inputs untouched


@triton_only
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_rope_decode_matches_rotary_then_reference(num_heads, num_kv_heads, head_dim, block_size, dtype):
    # Context 0 (the new token alone), one shorter than a tile, one longer; one padded row.
    case = make_case(
        [1, 1, 1], [40, 0, 90], num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
        block_size=block_size, dtype=dtype, device=TRITON_DEVICE, num_reqs_padded=4,
        num_tokens_padded=4, seed=6,
    )
    _check_rope_decode(case, dtype)


@triton_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("preload", ["first", "second", "none"])
def test_triton_rope_decode_split_context_merged_in_kernel(dtype, preload, monkeypatch):
    from pprun.attention import triton_ops
    from pprun.attention.triton_ops import num_decode_splits

    # The first (and second) K/V tile loaded before the PDL wait, or in the loop.
    monkeypatch.setattr(triton_ops, "DECODE_PRELOAD_KV", preload != "none")
    monkeypatch.setattr(triton_ops, "DECODE_PRELOAD_SECOND", preload == "second")
    monkeypatch.setattr(triton_ops, "DECODE_PRELOAD_SECOND_MAX_SPLITS", triton_ops._MAX_SPLITS)

    max_blocks = 64
    assert num_decode_splits(3, 1, max_blocks * 16, torch.device(TRITON_DEVICE)) > 1
    # 400 cached tokens spread over several splits, 20 in the first split only (the last
    # split then holds just the new token), 256 ending on a split edge; one padded row.
    case = make_case(
        [1, 1, 1], [400, 20, 255], num_heads=4, num_kv_heads=1, head_dim=64, block_size=16,
        dtype=dtype, device=TRITON_DEVICE, num_reqs_padded=4, num_tokens_padded=4,
        max_blocks_per_req=max_blocks, seed=7,
    )
    _check_rope_decode(case, dtype, repeats=2)


@triton_only
@pytest.mark.parametrize("preload", ["first", "second", "none"])
def test_triton_rope_decode_every_split_holding_tokens(preload, monkeypatch):
    from pprun.attention import triton_ops
    from pprun.attention.triton_ops import num_decode_splits

    monkeypatch.setattr(triton_ops, "DECODE_PRELOAD_KV", preload != "none")
    monkeypatch.setattr(triton_ops, "DECODE_PRELOAD_SECOND", preload == "second")
    monkeypatch.setattr(triton_ops, "DECODE_PRELOAD_SECOND_MAX_SPLITS", triton_ops._MAX_SPLITS)
    # Room for 256 tokens: 4 splits of one tile.  249 cached tokens fill all four (the last one
    # also takes the new token), 130 fill three (the last split then holds the new token alone),
    # 0 none (only the last split computes and writes); one padded row.
    assert num_decode_splits(4, 1, 16 * 16, torch.device(TRITON_DEVICE)) == 4
    case = make_case(
        [1, 1, 1], [249, 130, 0], num_heads=4, num_kv_heads=1, head_dim=64, block_size=16,
        dtype=torch.float32, device=TRITON_DEVICE, num_reqs_padded=4, num_tokens_padded=4,
        max_blocks_per_req=16, seed=9,
    )
    _check_rope_decode(case, torch.float32, repeats=2)


@triton_only
@pytest.mark.parametrize("bias", [False, True])
def test_triton_rope_decode_merges_qkv_partials(bias):
    """``qkv_parts``: q/k/v read from a split qkv matmul's fp32 partials (merged with its bias
    as they are read) give what the merged q/k/v give, cache and output bit for bit."""
    from pprun.attention.triton_ops import paged_decode_attention_rope
    from pprun.layers import SplitPartials

    dtype = torch.bfloat16 if TRITON_DEVICE == "cuda" else torch.float32
    heads, kv_heads, dim, tokens = 4, 2, 64, 4
    case = make_case(
        [1, 1, 1], [40, 0, 90], num_heads=heads, num_kv_heads=kv_heads, head_dim=dim, block_size=16,
        dtype=dtype, device=TRITON_DEVICE, num_reqs_padded=tokens, num_tokens_padded=tokens, seed=13,
    )
    width = (heads + 2 * kv_heads) * dim
    g = torch.Generator().manual_seed(3)
    parts = torch.randn(3, tokens, width, generator=g).to(TRITON_DEVICE)
    b = torch.randn(width, generator=g).to(dtype).to(TRITON_DEVICE) if bias else None
    partials = SplitPartials(parts, b, dtype)
    cos, sin = _rope_tables(128, dim, TRITON_DEVICE)
    positions = torch.clamp(case.seq_lens.long() - 1, min=0)

    def run(src: torch.Tensor, qkv_parts: SplitPartials | None) -> tuple[torch.Tensor, torch.Tensor]:
        q, k, v = src.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
        cache = case.kv_cache.clone()
        out = torch.full((tokens, heads, dim), float("nan"), dtype=dtype, device=TRITON_DEVICE)
        paged_decode_attention_rope(
            q.view(tokens, heads, dim), k.view(tokens, kv_heads, dim), v.view(tokens, kv_heads, dim), cos, sin,
            positions, cache, case.slot_mapping, case.block_table, case.seq_lens, case.scale, out,
            qkv_parts=qkv_parts,
        )
        return out, cache

    want_out, want_cache = run(partials.merge(), None)
    got_out, got_cache = run(parts[0], partials)
    assert torch.equal(got_cache, want_cache)
    assert torch.equal(got_out, want_out)
    with pytest.raises(ValueError, match="view of qkv_parts"):
        run(parts[1].clone(), partials)
    # k and v swapped: views of the partials, at the wrong columns.
    q, k, v = parts[0].split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    with pytest.raises(ValueError, match="at column"):
        paged_decode_attention_rope(
            q.view(tokens, heads, dim), v.view(tokens, kv_heads, dim), k.view(tokens, kv_heads, dim), cos, sin,
            positions, case.kv_cache.clone(), case.slot_mapping, case.block_table, case.seq_lens, case.scale,
            torch.empty((tokens, heads, dim), dtype=dtype, device=TRITON_DEVICE), qkv_parts=partials,
        )


@triton_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_rope_decode_second_preloaded_tile_changes_nothing(dtype, monkeypatch):
    """The second K/V tile loaded before the wait gives the same output and cache bit for bit,
    including splits of one tile (the second then all masked) and an empty context."""
    from pprun.attention import triton_ops

    case = make_case(
        [1, 1, 1, 1], [400, 20, 70, 1], num_heads=4, num_kv_heads=1, head_dim=64, block_size=16,
        dtype=dtype, device=TRITON_DEVICE, num_reqs_padded=4, num_tokens_padded=4, max_blocks_per_req=64, seed=16,
    )
    monkeypatch.setattr(triton_ops, "DECODE_PRELOAD_SECOND_MAX_SPLITS", triton_ops._MAX_SPLITS)
    # At context 400: splits of one 64-token tile (the second all masked), of two tiles, and of
    # four (the loop then starts at the third, as at batch 32).
    for min_tokens in (64, 256, 512):
        monkeypatch.setattr(triton_ops, "DECODE_MIN_TOKENS_PER_SPLIT", min_tokens)
        monkeypatch.setattr(triton_ops, "DECODE_PRELOAD_SECOND", False)
        want = _rope_decode_once(case, 64)
        monkeypatch.setattr(triton_ops, "DECODE_PRELOAD_SECOND", True)
        got = _rope_decode_once(case, 64)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    # The default: only for a context cut into few (long) splits.
    monkeypatch.undo()
    assert triton_ops.preload_second(2) and triton_ops.preload_second(4)
    assert not triton_ops.preload_second(8)


@pytest.mark.parametrize("second", [False, True])
def test_decode_kernel_compiles_for_sm90(second):
    """The decode kernel compiles for an H100/H200 without a GPU (``sm90_compile``), with its K/V
    loop pipelined over ``cp.async`` and its PDL wait in."""
    from sm90_compile import compile_sm90

    const = dict(NUM_HEADS=32, NUM_KV_HEADS=8, GROUP=4, HEAD_DIM=64, HALF=32, NEW_TOKEN=True, HAS_ROPE=True,
                 BLOCK_G=16, BLOCK_D=64, BLOCK_N=64, PAGE_SIZE=16, NUM_SPLITS=2, DOT_F32=False, PRELOAD_KV=True,
                 PRELOAD_SECOND=second, USE_PDL=True, QKV_PARTS=2, QKV_BIAS=True)
    pointers = {"pos_ptr": "*i64", "slot_ptr": "*i64", "block_table_ptr": "*i32", "seq_lens_ptr": "*i32",
                "counter_ptr": "*i32", "k_cache_ptr": "*bf16", "v_cache_ptr": "*bf16", "out_ptr": "*bf16",
                "qkv_bias_ptr": "*bf16"}
    ptx = compile_sm90("pprun.attention.triton_ops", "_decode_kernel", const, pointers=pointers,
                       float_args=("scale_log2",), options={"num_warps": 2, "num_stages": 2, "enable_fp_fusion": False})
    assert "cp.async.cg.shared.global" in ptx  # the K/V loop pipelined
    assert "griddepcontrol.wait" in ptx


@triton_only
def test_triton_rope_decode_without_rotary_and_fewer_token_rows():
    # A model without rotary (cos/sin None) takes q and k as they are; token rows past the
    # request rows (padding) come out zero.
    case = make_case(
        [1, 1], [5, 17], num_heads=4, num_kv_heads=2, head_dim=64, block_size=16,
        dtype=torch.float32, device=TRITON_DEVICE, num_reqs_padded=2, num_tokens_padded=3, seed=8,
    )
    _check_rope_decode(case, torch.float32, rope=False)


@triton_only
def test_triton_rope_decode_rejects_mismatched_tables():
    from pprun.attention.triton_ops import paged_decode_attention_rope

    case = make_case([1], [3], num_heads=4, num_kv_heads=2, head_dim=64, block_size=16,
                     dtype=torch.float32, device=TRITON_DEVICE)
    cos, _ = _rope_tables(8, 32, TRITON_DEVICE)  # half the head_dim
    positions = torch.zeros(1, dtype=torch.long, device=TRITON_DEVICE)
    with pytest.raises(ValueError, match=r"cos must be a \[max_positions, 64\]"):
        paged_decode_attention_rope(
            case.q, case.k, case.v, cos, cos, positions, case.kv_cache, case.slot_mapping,
            case.block_table, case.seq_lens, case.scale, torch.empty_like(case.q),
        )
    with pytest.raises(ValueError, match="together"):
        paged_decode_attention_rope(
            case.q, case.k, case.v, cos, None, positions, case.kv_cache, case.slot_mapping,
            case.block_table, case.seq_lens, case.scale, torch.empty_like(case.q),
        )
    with pytest.raises(ValueError, match="k must have q's dtype"):
        paged_decode_attention_rope(
            case.q, case.k.double(), case.v, None, None, positions, case.kv_cache, case.slot_mapping,
            case.block_table, case.seq_lens, case.scale, torch.empty_like(case.q),
        )
    with pytest.raises(ValueError, match="positions must be int32 or int64"):
        paged_decode_attention_rope(
            case.q, case.k, case.v, None, None, positions.float(), case.kv_cache, case.slot_mapping,
            case.block_table, case.seq_lens, case.scale, torch.empty_like(case.q),
        )
