"""One-launch logits copy + argmax (``pprun.sampling.greedy_kernel``) against torch.

Runs on CUDA, or on CPU under the Triton interpreter (the default without CUDA).
"""

from __future__ import annotations

import pytest
import torch
from triton_env import DEVICE, HAS_CUDA, triton_only  # noqa: E402  (sets TRITON_INTERPRET)

DTYPES = [torch.float32, torch.bfloat16]


def _logits(rows: int, vocab: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # Few distinct values: ties inside and across chunks are common.
    x = torch.randint(-20, 20, (rows, vocab), generator=g).to(torch.float32) / 4
    return x.to(dtype)


@triton_only
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab,block_v", [(1000, 64), (1000, 1024), (32000, 2048), (37, 16)])
def test_copy_and_argmax_matches_torch(dtype, vocab, block_v):
    from pprun.sampling.greedy_kernel import copy_and_argmax

    rows = 6
    x = _logits(rows, vocab, dtype)
    x[1, vocab - 1] = 100.0  # the best in the ragged last chunk
    x[2, :] = float("-inf")  # torch: index 0
    x[3, 7] = float("nan")  # NaN is the largest: the first NaN wins, also over +inf
    x[3, vocab // 2] = float("nan")
    x[3, 3] = float("inf")
    x[4, vocab // 3] = float("inf")  # +inf twice: the first
    x[4, vocab - 2] = float("inf")
    x[5, 0] = float("inf")  # +inf in the first chunk, NaN only in the last: NaN wins across chunks
    x[5, vocab - 1] = float("nan")
    x = x.to(DEVICE)
    out = torch.full((rows + 2, vocab), 9.0, dtype=dtype, device=DEVICE)[1:-1]  # rows in a bigger buffer
    ids = torch.full((rows,), -1, dtype=torch.int64, device=DEVICE)
    for launch in range(2):  # the arrival counters are left at zero for the next launch
        ids.fill_(-1)
        out.fill_(9.0)
        copy_and_argmax(x, out, ids, block_v=block_v)
        assert torch.equal(ids.cpu(), torch.argmax(x.cpu().float(), dim=-1)), launch
        torch.testing.assert_close(out, x, rtol=0, atol=0, equal_nan=True)
    assert ids[3].item() == 7 and ids[2].item() == 0 and ids[4].item() == vocab // 3
    assert ids[5].item() == vocab - 1


@triton_only
@pytest.mark.parametrize("block_v", [64, 2048])  # several chunks (the merging program writes), one
def test_copy_and_argmax_also_writes_the_host_ring_row_named_by_the_slot(block_v):
    from pprun.sampling.greedy_kernel import copy_and_argmax

    rows = 5
    x = _logits(rows, 1000, torch.float32, seed=2).to(DEVICE)
    ids = torch.empty(rows, dtype=torch.int64, device=DEVICE)
    ring = torch.full((3, 8), -1, dtype=torch.int64, pin_memory=HAS_CUDA)
    slot = torch.tensor([2], dtype=torch.int32, device=DEVICE)
    copy_and_argmax(x, torch.empty_like(x), ids, block_v=block_v, host_out=ring, host_slot=slot)
    if HAS_CUDA:
        torch.cuda.synchronize()
    expected = torch.argmax(x.cpu(), dim=-1)
    assert torch.equal(ring[2, :rows], expected) and torch.equal(ids.cpu(), expected)
    assert bool((ring[:2] == -1).all()) and bool((ring[2, rows:] == -1).all())  # nothing else written


@triton_only
def test_copy_and_argmax_rejects_bad_arguments():
    from pprun.sampling.greedy_kernel import copy_and_argmax

    x = _logits(2, 100, torch.float32).to(DEVICE)
    ids = torch.empty(2, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="logits_out must be"):
        copy_and_argmax(x, torch.empty(2, 100, dtype=torch.bfloat16, device=DEVICE), ids)
    with pytest.raises(ValueError, match="ids_out must be a"):
        copy_and_argmax(x, torch.empty_like(x), ids.to(torch.int32))
    with pytest.raises(ValueError, match="block_v must be a power of two"):
        copy_and_argmax(x, torch.empty_like(x), ids, block_v=100)
    with pytest.raises(ValueError, match="contiguous in vocab"):
        copy_and_argmax(x.t(), torch.empty_like(x.t()), ids)
    slot = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="go together"):
        copy_and_argmax(x, torch.empty_like(x), ids, host_out=torch.zeros(3, 4, dtype=torch.int64))
    with pytest.raises(ValueError, match="host_out must be"):
        copy_and_argmax(x, torch.empty_like(x), ids, host_out=torch.zeros(3, 1, dtype=torch.int64), host_slot=slot)
    with pytest.raises(ValueError, match="host_slot must be"):
        copy_and_argmax(x, torch.empty_like(x), ids, host_out=torch.zeros(3, 4, dtype=torch.int64),
                        host_slot=slot.to(torch.int64))


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_graph_greedy_ids_match_eager_argmax():
    """In a captured graph (PDL on), the ids match torch's argmax of the same logits."""
    from pprun.kernels.triton_utils import force_pdl
    from pprun.sampling.greedy_kernel import copy_and_argmax

    x = _logits(32, 32000, torch.bfloat16, seed=3).to(DEVICE)
    out, ids = torch.empty_like(x), torch.empty(32, dtype=torch.int64, device=DEVICE)
    with force_pdl():
        copy_and_argmax(x, out, ids)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        copy_and_argmax(x, out, ids)
    x.copy_(_logits(32, 32000, torch.bfloat16, seed=4).to(DEVICE))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(ids, torch.argmax(x, dim=-1)) and torch.equal(out, x)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_graph_greedy_ids_reach_the_host_row_the_slot_names_at_replay():
    """Captured once, each replay writes the pinned ring's row that the slot holds at replay."""
    from pprun.kernels.triton_utils import force_pdl
    from pprun.sampling.greedy_kernel import copy_and_argmax

    x = _logits(32, 32000, torch.bfloat16, seed=5).to(DEVICE)
    out, ids = torch.empty_like(x), torch.empty(32, dtype=torch.int64, device=DEVICE)
    ring = torch.full((3, 32), -1, dtype=torch.int64, pin_memory=True)
    slot = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    with force_pdl():
        copy_and_argmax(x, out, ids, host_out=ring, host_slot=slot)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        copy_and_argmax(x, out, ids, host_out=ring, host_slot=slot)
    ring.fill_(-1)
    for s, seed in ((1, 6), (2, 7)):
        x.copy_(_logits(32, 32000, torch.bfloat16, seed=seed).to(DEVICE))
        slot.fill_(s)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(ring[s], torch.argmax(x, dim=-1).cpu()), s
    assert bool((ring[0] == -1).all())
