"""The staging kernel (``pprun.worker.v2.staging``): a step's inputs copied from the pinned arena
by one kernel, with the previous step's samples put into ``input_ids`` on the way."""

from __future__ import annotations

import pytest
import torch
from triton_env import DEVICE, HAS_CUDA, triton_only  # noqa: E402  (sets TRITON_INTERPRET)

from pprun.worker.v2.inputs import MAX_RANGES, InputBuffers, fit_ranges

try:
    from pprun.worker.v2.staging import stage_inputs
except ModuleNotFoundError as e:  # no Triton: the kernel's own tests skip, the range planning's run
    if e.name != "triton":
        raise
    stage_inputs = None
needs_triton = pytest.mark.skipif(stage_inputs is None, reason="needs triton")


def test_fit_ranges_merges_across_the_smallest_gaps_first():
    ranges = [(0, 8), (100, 108), (112, 120), (1000, 1004)]
    assert fit_ranges(ranges, limit=4) == ranges
    assert fit_ranges(ranges, limit=3) == [(0, 8), (100, 120), (1000, 1004)]
    assert fit_ranges(ranges, limit=2) == [(0, 120), (1000, 1004)]
    assert fit_ranges(ranges, limit=1) == [(0, 1004)]


@needs_triton
def test_stage_inputs_refuses_what_it_cannot_copy():
    arena = torch.zeros(64, dtype=torch.uint8)
    ids = torch.zeros(4, dtype=torch.int64)
    with pytest.raises(ValueError, match="4-byte aligned"):
        stage_inputs(arena, arena.clone(), [(0, 6)], ids, ids.clone(), 4)
    with pytest.raises(ValueError, match=f"at most {MAX_RANGES} ranges"):
        stage_inputs(arena, arena.clone(), [(4 * i, 4 * i + 4) for i in range(MAX_RANGES + 1)], ids, ids.clone(), 4)
    with pytest.raises(ValueError, match="go together"):
        stage_inputs(arena, arena.clone(), [], ids, ids.clone(), 4, token_source=torch.zeros(4, dtype=torch.int32))
    with pytest.raises(ValueError, match="ids must be int64"):
        stage_inputs(arena, arena.clone(), [], ids.int(), ids.int(), 4)
    source, prev = torch.zeros(4, dtype=torch.int32), torch.zeros(8, dtype=torch.int64)
    with pytest.raises(ValueError, match="token_source must be int32"):
        stage_inputs(arena, arena.clone(), [], ids, ids.clone(), 4, source.long(), prev)
    with pytest.raises(ValueError, match="prev_sampled contiguous"):
        stage_inputs(arena, arena.clone(), [], ids, ids.clone(), 4, source, prev[::2])


@triton_only
@pytest.mark.parametrize("pending", [False, True])
def test_stage_inputs_copies_the_ranges_and_takes_pending_ids_from_the_previous_samples(pending):
    g = torch.Generator().manual_seed(0)
    host = torch.randint(0, 256, (8192,), dtype=torch.uint8, generator=g)
    if HAS_CUDA:
        host = host.pin_memory()
    device = torch.zeros(8192, dtype=torch.uint8, device=DEVICE)
    ranges = [(0, 12), (64, 4096 + 8), (6000, 6400)]  # long enough for several programs
    num_tokens = 3000
    ids_host = torch.randint(0, 32000, (4096,), dtype=torch.int64, generator=g)
    if HAS_CUDA:
        ids_host = ids_host.pin_memory()
    ids_device = torch.full((4096,), -7, dtype=torch.int64, device=DEVICE)
    expected_ids = ids_host[:num_tokens].clone()
    source = prev = None
    if pending:
        prev = torch.randint(0, 32000, (64,), dtype=torch.int64, generator=g).to(DEVICE)
        source = torch.full((4096,), -1, dtype=torch.int32)
        rows = torch.randperm(num_tokens, generator=g)[:64]
        source[rows] = torch.arange(64, dtype=torch.int32)
        if HAS_CUDA:
            source = source.pin_memory()
        expected_ids[rows] = prev.cpu()
    stage_inputs(host, device, ranges, ids_host, ids_device, num_tokens, source, prev)
    got = device.cpu()
    expected = torch.zeros(8192, dtype=torch.uint8)
    for s, e in ranges:
        expected[s:e] = host[s:e]
    assert torch.equal(got, expected)  # the ranges, and nothing else
    assert torch.equal(ids_device[:num_tokens].cpu(), expected_ids)
    assert bool((ids_device[num_tokens:] == -7).all())  # past num_tokens: untouched


def test_direct_launch_steps_aside_for_launch_hooks(monkeypatch):
    """A Triton launch hook (a profiler) must see every launch: the direct path is off while one
    is set, also for a specialisation already compiled."""
    triton = pytest.importorskip("triton")
    from pprun.worker.v2 import staging

    chain = getattr(getattr(triton, "knobs", None), "runtime", None)
    if chain is None or not hasattr(chain.launch_enter_hook, "add"):
        pytest.skip("this Triton has no launch hook chains")
    compiled = object()  # stands for a compiled kernel (the launch itself needs CUDA)
    monkeypatch.setattr(staging, "_compiled", {("key",): compiled})
    assert staging._no_launch_hooks()
    assert staging._direct_kernel(("key",)) is compiled and staging._direct_kernel(("other",)) is None

    def hook(*args):
        pass

    chain.launch_enter_hook.add(hook)
    try:
        assert not staging._no_launch_hooks()
        assert staging._direct_kernel(("key",)) is None
    finally:
        chain.launch_enter_hook.remove(hook)
    assert staging._no_launch_hooks()
    assert staging._direct_kernel(("key",)) is compiled


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="the direct launch is for CUDA only")
def test_direct_launch_writes_what_the_jit_launch_writes(monkeypatch, switch):
    """Steps of changing ranges, token counts and pending ids through Triton's launch and through
    the kernels it compiled, launched directly: after every step the device holds exactly the
    step's ranges and ids, whichever way it was launched.  Also a misaligned ``prev_sampled`` (a
    new specialisation, so Triton's launch again)."""
    from pprun.worker.v2 import staging

    g = torch.Generator().manual_seed(3)
    host = torch.randint(0, 256, (8192,), dtype=torch.uint8, generator=g).pin_memory()
    ids_host = torch.randint(0, 32000, (4096,), dtype=torch.int64, generator=g).pin_memory()
    prev_all = torch.randint(0, 32000, (65,), dtype=torch.int64, generator=g).cuda()
    source = torch.full((4096,), -1, dtype=torch.int32)
    # Pending tokens among the first 64 (token 0 one of them), so that short steps have some.
    source[torch.cat([torch.zeros(1, dtype=torch.int64), torch.randperm(63, generator=g)[:39] + 1])] = (
        torch.arange(40, dtype=torch.int32))
    source = source.pin_memory()
    steps = [
        ([(0, 12), (64, 4104)], 3000, None),
        ([(8, 400), (6000, 6400), (7000, 7004)], 17, 0),
        ([(0, 4)], 1, 0),
        ([(16, 2000)], 2000, 1),  # prev_sampled 8 bytes past an aligned address
        ([(0, 8192 - 4)], 4096, None),
    ]
    for fast in (False, True):
        switch("PPRUN_DISABLE_FAST_LAUNCH", fast)
        monkeypatch.setattr(staging, "_compiled", {})
        device = torch.empty(8192, dtype=torch.uint8, device="cuda")
        ids_device = torch.empty(4096, dtype=torch.int64, device="cuda")
        for _ in range(2):  # the second round finds every specialisation compiled
            for ranges, num_tokens, prev_offset in steps:
                device.fill_(0xA5)  # each step's bytes are then its own
                ids_device.fill_(-7)
                prev = None if prev_offset is None else prev_all[prev_offset : prev_offset + 64]
                stage_inputs(host, device, ranges, ids_host, ids_device, num_tokens,
                             None if prev is None else source, prev)  # fmt: skip
                want = torch.full((8192,), 0xA5, dtype=torch.uint8)
                for a, b in ranges:
                    want[a:b] = host[a:b]
                want_ids = torch.full((4096,), -7, dtype=torch.int64)
                want_ids[:num_tokens] = ids_host[:num_tokens]
                if prev is not None:
                    rows = source[:num_tokens].long()
                    pending = rows >= 0
                    want_ids[:num_tokens][pending] = prev.cpu()[rows[pending]]
                assert torch.equal(device.cpu(), want), (fast, ranges)
                assert torch.equal(ids_device.cpu(), want_ids), (fast, num_tokens)
        assert len(staging._compiled) == (3 if fast else 0)  # pending or not, and the misaligned prev


def _fill(bufs: InputBuffers, g: torch.Generator, num_reqs: int, num_tokens: int, num_pending: int) -> None:
    """Random host values in every field a step sends."""
    for field in (bufs.query_start_loc, bufs.seq_lens, bufs.logits_indices, bufs.sample_rows, bufs.input_ids,
                  bufs.positions, bufs.slot_mapping, bufs.block_table):
        field.host.copy_(torch.randint(0, 1000, field.host.shape, generator=g).to(field.host.dtype))
    bufs.pending_token_idx.np[:num_pending] = torch.randperm(num_tokens, generator=g)[:num_pending].numpy()
    bufs.pending_sample_idx.np[:num_pending] = torch.randperm(num_reqs, generator=g)[:num_pending].numpy()


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="the staging kernel runs on CUDA only")
@pytest.mark.parametrize("num_pending", [0, 24])
def test_staging_kernel_sends_what_the_copies_send(monkeypatch, switch, num_pending):
    """The same host buffers through the kernel and through cudaMemcpy + indexed write: every field
    a step reads holds the same rows on the device."""
    num_reqs, num_tokens, device = 32, 40, torch.device("cuda")
    prev = torch.randint(0, 32000, (num_reqs,), dtype=torch.int64, device=device)
    got = []
    for enabled in (True, False):
        switch("PPRUN_DISABLE_STAGING_KERNEL", enabled)
        bufs = InputBuffers(64, 48, 16, 16, device)
        _fill(bufs, torch.Generator().manual_seed(1), num_reqs, num_tokens, num_pending)
        bufs.wait_for_previous_reads()
        bufs.to_device(num_reqs, num_tokens, num_reqs, num_pending, prev if num_pending else None)
        torch.cuda.synchronize()
        got.append({
            "query_start_loc": bufs.query_start_loc.device[: num_reqs + 1].cpu(),
            "seq_lens": bufs.seq_lens.device[:num_reqs].cpu(),
            "logits_indices": bufs.logits_indices.device[:num_reqs].cpu(),
            "sample_rows": bufs.sample_rows.device[:num_reqs].cpu(),
            "input_ids": bufs.input_ids.device[:num_tokens].cpu(),
            "positions": bufs.positions.device[:num_tokens].cpu(),
            "slot_mapping": bufs.slot_mapping.device[:num_tokens].cpu(),
            "block_table": bufs.block_table.device[:num_reqs].cpu(),
        })
        assert bufs.num_copies_last_step == (0 if enabled else 1)
    for name, value in got[0].items():
        assert torch.equal(value, got[1][name]), name
    # With pending tokens the device ids are not the host's: the previous samples went in.
    assert torch.equal(got[0]["input_ids"], bufs.input_ids.host[:num_tokens]) == (num_pending == 0)


def test_staging_kernel_compiles_for_sm90():
    """The kernel compiles for an H100/H200 without a GPU (``sm90_compile``): one variant per
    ``HAS_PENDING``, the ranges and token count not specialised on."""
    from sm90_compile import compile_sm90

    for has_pending in (False, True):
        ptx = compile_sm90(
            "pprun.worker.v2.staging", "_stage_kernel", {"HAS_PENDING": has_pending, "BLOCK": 1024}, options={},
            pointers={"src_ptr": "*i32", "dst_ptr": "*i32", "ids_src_ptr": "*i64", "ids_dst_ptr": "*i64",
                      "token_source_ptr": "*i32", "prev_ptr": "*i64"},
        )
        assert ".entry _stage_kernel" in ptx


def test_staging_ranges_leave_input_ids_and_the_pending_lists_out():
    """Every used byte but input_ids' and the pending lists' is in exactly one range, and no
    range reaches into input_ids, also when the ranges have to be merged to fit one launch."""
    bufs = InputBuffers(64, 48, 16, 16, torch.device("cpu"))
    ids = bufs.input_ids
    used = (
        (bufs.query_start_loc, 33), (bufs.seq_lens, 32), (bufs.logits_indices, 32), (bufs.sample_rows, 32),
        (bufs.host_slot, 1), (ids, 40), (bufs.positions, 40), (bufs.slot_mapping, 40), (bufs.block_table, 32),
        (bufs.pending_token_idx, 24), (bufs.pending_sample_idx, 24),
    )
    ids_bytes = (ids.offset, ids.offset + ids.host.numel() * ids.host.element_size())
    for limit in (MAX_RANGES, 2):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr("pprun.worker.v2.inputs.MAX_RANGES", limit)
            ranges = bufs.staging_ranges([(b, b.span(n)) for b, n in used])
        assert len(ranges) <= limit
        assert all(e <= ids_bytes[0] or s >= ids_bytes[1] for s, e in ranges), ranges
        for b, n in used:
            start, end = b.offset, b.offset + n * b.row_bytes
            covered = any(s <= start and end <= e for s, e in ranges)
            assert covered == (b not in (ids, bufs.pending_token_idx, bufs.pending_sample_idx)), b.offset
