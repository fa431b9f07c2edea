"""The V2 model runner: input building by tensor indexing, padded rows, parity with V1, CUDA graphs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import pprun
from pprun.attention.backend import get_backend
from pprun.config.config import PprunConfig
from pprun.config.validate import validate_config
from pprun.core.outputs import CachedRequestData, NewRequestData, SchedulerOutput
from pprun.core.scheduler import Scheduler
from pprun.distributed.layout import StageLayout
from pprun.sampling.params import SamplingParams
from pprun.worker.kv_cache import allocate_kv_caches
from pprun.worker.model_loader import load_stage_model
from pprun.worker.v1.runner import V1ModelRunner
from pprun.worker.v2.cuda_graphs import GraphPlan
from pprun.worker.v2.inputs import InputBuffers, prepare_step
from pprun.worker.v2.request_state import RequestTable
from pprun.worker.v2.runner import V2ModelRunner

BLOCK = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tiny_llama_dir):
    """The session's 4-layer random Llama (``tests/tiny_models.make_tiny_llama``)."""
    return tiny_llama_dir


def prompts_of(lengths: list[int]) -> list[list[int]]:
    return [[(7 * i + 3 * j) % 250 + 3 for j in range(n)] for i, n in enumerate(lengths)]


# ---------------------------------------------------------------------------------------------
# Input building (pure host logic)
# ---------------------------------------------------------------------------------------------


def new_req(req_id: str, tokens: list[int], blocks: list[int], num_computed: int = 0) -> NewRequestData:
    return NewRequestData(req_id, tokens, GREEDY, blocks, num_computed)


def python_inputs(reqs: dict[str, tuple[list[int], list[int], int]], sched: dict[str, int]):
    """V1-style construction: loops over tokens.  ``reqs[id] = (tokens, blocks, num_computed)``."""
    ids, pos, slots, qsl, seq_lens, tables = [], [], [], [0], [], []
    for req_id, n in sched.items():
        tokens, blocks, start = reqs[req_id]
        for p in range(start, start + n):
            ids.append(tokens[p])
            pos.append(p)
            slots.append(blocks[p // BLOCK] * BLOCK + p % BLOCK)
        qsl.append(qsl[-1] + n)
        seq_lens.append(start + n)
        tables.append(blocks)
    return ids, pos, slots, qsl, seq_lens, tables


def test_prepare_step_matches_python_construction_and_pads_inertly():
    table = RequestTable(
        max_num_reqs=6,
        max_model_len=64,
        max_num_blocks_per_req=8,
        device=torch.device("cpu"),
        make_generators=False,
    )
    bufs = InputBuffers(
        max_num_tokens=48,
        max_num_reqs=6,
        max_num_blocks_per_req=8,
        block_size=BLOCK,
        device=torch.device("cpu"),
    )
    # Dirty the buffers so that stale values would show through if padding were not rewritten.
    for b in (bufs.input_ids, bufs.positions, bufs.slot_mapping, bufs.seq_lens, bufs.query_start_loc):
        b.host.fill_(77)
    bufs.block_table.host.fill_(77)
    reqs = {
        "a": (list(range(100, 120)), [5, 9, 2], 8),  # chunk 8..14 of a 20-token prompt
        "b": (list(range(200, 211)), [3, 4], 10),  # decode: last token of 11
        "c": (list(range(30, 35)), [7], 0),  # whole 5-token prompt
    }
    so = SchedulerOutput(
        step_id=1,
        scheduled_new_reqs=[new_req(r, t, b, c) for r, (t, b, c) in reqs.items()],
        scheduled_cached_reqs=CachedRequestData(),
        num_scheduled_tokens={"a": 7, "b": 1, "c": 5},
        total_num_scheduled_tokens=13,
    )
    for new in so.scheduled_new_reqs:
        table.add(
            new.req_id, new.prompt_token_ids, new.block_ids, new.num_computed_tokens, new.sampling_params
        )
    batch = prepare_step(table, so, bufs, num_reqs_padded=5, num_tokens_padded=16)
    ids, pos, slots, qsl, seq_lens, tables = python_inputs(reqs, so.num_scheduled_tokens)

    assert (batch.num_reqs, batch.num_reqs_padded, batch.num_tokens, batch.num_tokens_padded) == (
        3,
        5,
        13,
        16,
    )
    assert batch.max_query_len == 7
    assert bufs.input_ids.host[:16].tolist() == ids + [0] * 3
    assert bufs.positions.host[:16].tolist() == pos + [0] * 3
    assert bufs.slot_mapping.host[:16].tolist() == slots + [-1] * 3
    assert bufs.query_start_loc.host[:6].tolist() == qsl + [13, 13]
    assert bufs.seq_lens.host[:5].tolist() == seq_lens + [0, 0]
    # Each request's table row as far as any request of the step reads (ceil(longest seq_len /
    # block size) columns: 2 here; a fresh row is 0 past its blocks); columns past that keep
    # whatever they held (never read).
    num_cols = -(-max(seq_lens) // BLOCK)
    assert num_cols < max(len(t) for t in tables)
    for i, t in enumerate(tables):
        assert bufs.block_table.host[i, :num_cols].tolist() == (t + [0] * num_cols)[:num_cols]
    assert bufs.block_table.host[:3, num_cols:].eq(77).all()
    assert bufs.block_table.host[3:5].eq(0).all()
    # "a" stops short of its prompt's end: only "b" and "c" sample, from their last token's row.
    assert batch.sample_batch_idx.tolist() == [1, 2]
    assert bufs.logits_indices.host[:2].tolist() == [7, 12]
    assert batch.num_leading_decodes == 0  # "a" (a prompt chunk) comes first
    meta = bufs.attn_metadata(3, 5, 13, 16, batch.max_query_len)
    assert meta.slot_mapping.shape == (16,) and meta.seq_lens.shape == (5,)
    assert meta.query_start_loc.shape == (6,) and meta.block_table.shape == (5, 8)


@pytest.mark.parametrize("order, prefix", [(("b", "d", "a", "c"), 2), (("b", "a", "d"), 1), (("b", "d"), 0)])
def test_prepare_step_counts_the_decodes_ahead_of_prompt_chunks(order, prefix):
    """``num_leading_decodes``: the leading one-token requests of a step with a longer query (the
    Triton backend attends them with its decode kernel); 0 in a pure decode step."""
    table = RequestTable(max_num_reqs=6, max_model_len=64, max_num_blocks_per_req=8, device=torch.device("cpu"),
                         make_generators=False)
    bufs = InputBuffers(max_num_tokens=48, max_num_reqs=6, max_num_blocks_per_req=8, block_size=BLOCK,
                        device=torch.device("cpu"))
    reqs = {
        "a": (list(range(100, 120)), [5, 9, 2], 8),  # chunk 8..14 of a 20-token prompt
        "b": (list(range(200, 211)), [3, 4], 10),  # decode: last token of 11
        "c": (list(range(30, 35)), [7], 0),  # whole 5-token prompt
        "d": (list(range(40, 46)), [8], 5),  # decode: last token of 6
    }
    counts = {"a": 7, "b": 1, "c": 5, "d": 1}
    so = SchedulerOutput(
        step_id=1,
        scheduled_new_reqs=[new_req(r, *reqs[r]) for r in order],
        scheduled_cached_reqs=CachedRequestData(),
        num_scheduled_tokens={r: counts[r] for r in order},
        total_num_scheduled_tokens=sum(counts[r] for r in order),
    )
    for new in so.scheduled_new_reqs:
        table.add(new.req_id, new.prompt_token_ids, new.block_ids, new.num_computed_tokens, new.sampling_params)
    batch = prepare_step(table, so, bufs, num_reqs_padded=len(order), num_tokens_padded=so.total_num_scheduled_tokens)
    assert batch.num_leading_decodes == prefix
    meta = bufs.attn_metadata(batch.num_reqs, batch.num_reqs_padded, batch.num_tokens, batch.num_tokens_padded,
                              batch.max_query_len, batch.num_leading_decodes)
    assert meta.num_leading_decodes == prefix


def test_request_table_deltas_rows_and_unknown_finished_ids():
    table = RequestTable(4, 32, 4, torch.device("cpu"), make_generators=True)
    table.add("x", [1, 2, 3], [4], 0, SamplingParams(temperature=0.7, top_k=5, seed=3, logprobs=2))
    row_x = table.row_of["x"]
    table.update_cached(
        CachedRequestData(req_ids=["x"], new_block_ids=[[6]], num_computed_tokens=[3], new_token_ids=[[9]]),
        step_id=2,
    )
    assert table.token_ids[row_x, :4].tolist() == [1, 2, 3, 9]
    assert table.block_table[row_x, :2].tolist() == [4, 6]
    assert int(table.num_computed_tokens[row_x]) == 3
    assert table.generators[row_x] is not None
    assert table.remove("never-seen") is None  # finished/preempted ids may be unknown
    assert table.remove("x") == row_x and table.num_live_reqs == 0
    # A reused row holds nothing of its previous owner.
    assert table.add("y", [5], [2], 0, GREEDY) == row_x
    assert table.block_table[row_x].tolist() == [2, 0, 0, 0]
    assert table.generators[row_x] is None
    with pytest.raises(RuntimeError, match="unknown to this runner"):
        table.update_cached(
            CachedRequestData(req_ids=["z"], new_block_ids=[[]], num_computed_tokens=[1], new_token_ids=[[]]),
            step_id=3,
        )


def test_sampling_tensors_match_build():
    from pprun.sampling.sampler import SamplingTensors

    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.8, top_k=7, top_p=0.9, seed=1, logprobs=3),
        SamplingParams(temperature=1.2, min_p=0.1, logprobs=1),
    ]
    table = RequestTable(4, 16, 2, torch.device("cpu"), make_generators=False)
    for i, p in enumerate(params):
        table.add(str(i), [1], [1], 0, p)
    rows = torch.tensor([table.row_of[str(i)] for i in (2, 0, 1)])
    got = table.sampling_tensors(rows)
    want = SamplingTensors.build([params[i] for i in (2, 0, 1)], [None] * 3, "cpu")
    for name in ("temperature", "top_k", "top_p", "min_p"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    for name in ("all_greedy", "all_random", "no_top_k", "no_top_p", "no_min_p", "max_num_logprobs"):
        assert getattr(got, name) == getattr(want, name), name


def test_all_greedy_rows_skip_the_parameter_gathers():
    """Every row greedy: no per-row tensors are gathered, and the sampler still takes the argmax."""
    from pprun.sampling.sampler import Sampler

    table = RequestTable(4, 16, 2, torch.device("cpu"), make_generators=False)
    for i, p in enumerate([SamplingParams(temperature=0.0, top_k=5), SamplingParams(temperature=0.0, logprobs=2)]):
        table.add(str(i), [1], [1], 0, p)
    t = table.sampling_tensors(torch.tensor([table.row_of["1"], table.row_of["0"]]))
    assert t.all_greedy and t.num_reqs == 2 and t.max_num_logprobs == 2
    assert t.temperature.numel() == t.top_k.numel() == t.top_p.numel() == t.min_p.numel() == 0
    logits = torch.randn(2, 11, generator=torch.Generator().manual_seed(3))
    out = Sampler()(logits, t)
    assert out.sampled_token_ids.tolist() == logits.argmax(-1).tolist()
    assert out.topk_ids.shape == (2, 2)


def test_update_cached_writes_every_request_at_once():
    """Several requests, uneven deltas (none, one, several tokens/blocks) in one vectorised write;
    each lands after its own row's entries and nowhere else."""
    table = RequestTable(4, 16, 4, torch.device("cpu"), make_generators=False)
    table.add("a", [1, 2], [5], 0, GREEDY)
    table.add("b", [3], [6], 0, GREEDY)
    table.add("c", [4, 4, 4], [7], 0, GREEDY)
    table.update_cached(
        CachedRequestData(
            req_ids=["c", "a", "b"],
            new_block_ids=[[], [8, 9], [10]],
            num_computed_tokens=[3, 2, 1],
            new_token_ids=[[11, 12, 13], [], [14]],
        ),
        step_id=1,
    )
    ra, rb, rc = (table.row_of[r] for r in "abc")
    assert table.token_ids[ra, :3].tolist() == [1, 2, 0] and int(table.num_tokens[ra]) == 2
    assert table.token_ids[rb, :3].tolist() == [3, 14, 0] and int(table.num_tokens[rb]) == 2
    assert table.token_ids[rc, :7].tolist() == [4, 4, 4, 11, 12, 13, 0] and int(table.num_tokens[rc]) == 6
    assert table.block_table[ra].tolist() == [5, 8, 9, 0]
    assert table.block_table[rb].tolist() == [6, 10, 0, 0]
    assert table.block_table[rc].tolist() == [7, 0, 0, 0]
    assert [int(table.num_computed_tokens[r]) for r in (ra, rb, rc)] == [2, 1, 3]
    with pytest.raises(RuntimeError, match="'b' would hold 17 tokens, more than max_model_len=16"):
        table.update_cached(
            CachedRequestData(["a", "b"], [[], []], [2, 2], [[1], list(range(15))]), step_id=2
        )


def test_input_buffers_are_disjoint_views_and_ranges_merge():
    from pprun.worker.v2.inputs import merge_ranges

    bufs = InputBuffers(max_num_tokens=10, max_num_reqs=3, max_num_blocks_per_req=4, block_size=BLOCK,
                        device=torch.device("cpu"))
    fields = [bufs.query_start_loc, bufs.seq_lens, bufs.logits_indices, bufs.sample_rows,
              bufs.input_ids, bufs.positions, bufs.slot_mapping, bufs.block_table]
    for i, f in enumerate(fields):
        f.host.fill_(i + 1)
    for i, f in enumerate(fields):
        assert f.host.eq(i + 1).all() and f.device.eq(i + 1).all(), i
    assert merge_ranges([(0, 8), (8, 8), (10, 20), (100, 120), (124, 130)], max_gap=4) == [
        (0, 20),
        (100, 130),
    ]


def test_table_sampling_tensors_sample_like_build_seeded_mixed_batch():
    """Host hints (greedy rows, largest top-k) change no token: the same seeded draws as tensors
    from ``SamplingTensors.build``, for top-k alone and with top-p."""
    from pprun.sampling.sampler import Sampler, SamplingTensors, make_generator

    for top_p in (1.0, 0.9):
        params = [
            SamplingParams(temperature=0.0, top_k=3, seed=1),
            SamplingParams(temperature=0.9, top_k=5, top_p=top_p, seed=2),
            SamplingParams(temperature=1.1, top_k=9, top_p=top_p, seed=3),
            SamplingParams(temperature=0.7, top_k=-1, top_p=top_p, seed=4),
        ]
        logits = torch.randn(4, 40, generator=torch.Generator().manual_seed(0))
        for drop_disabled in (False, True):
            # Fresh generators for both sides; without request 3 no row has top-k disabled.
            table = RequestTable(4, 16, 2, torch.device("cpu"), make_generators=True)
            for i, p in enumerate(params):
                table.add(str(i), [1], [1], 0, p)
            pick = [0, 2, 1] if drop_disabled else [3, 0, 2, 1]
            got_t = table.sampling_tensors(torch.tensor([table.row_of[str(i)] for i in pick]))
            assert got_t.is_greedy_host == [params[i].temperature == 0.0 for i in pick]
            assert got_t.top_k_max_host == (9 if drop_disabled else 0)
            want_t = SamplingTensors.build(
                [params[i] for i in pick], [make_generator(params[i].seed, "cpu") for i in pick], "cpu"
            )
            got = Sampler()(logits[: len(pick)].clone(), got_t).sampled_token_ids
            want = Sampler()(logits[: len(pick)].clone(), want_t).sampled_token_ids
            assert got.tolist() == want.tolist(), (top_p, drop_disabled)


# ---------------------------------------------------------------------------------------------
# Runner-level: hand-driven steps (V1 vs V2, padded rows)
# ---------------------------------------------------------------------------------------------


def resolved_for(model_dir, device: str, dtype: str, **kwargs):
    kwargs.setdefault("max_model_len", 128)
    cfg = PprunConfig.from_kwargs(
        model=str(model_dir),
        device=device,
        dtype=dtype,
        block_size=BLOCK,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        **kwargs,
    )
    return validate_config(cfg)


def build_runner(kind: str, rc, backend: str = "auto", num_blocks: int = 64):
    device = torch.device("cuda" if rc.device == "cuda" else "cpu")
    layout = StageLayout.single(rc.arch.num_hidden_layers)
    model = load_stage_model(
        rc.model_dir,
        rc.arch,
        layout,
        device=device,
        dtype=rc.dtype,
        max_positions=rc.max_model_len,
        attn_backend=get_backend(backend, device),
    )
    caches = allocate_kv_caches(rc.arch, layout.num_layers, num_blocks, BLOCK, rc.dtype, device)
    model.bind_kv_caches(caches)
    if kind == "v1":
        return V1ModelRunner(model, layout, device, BLOCK), caches
    return V2ModelRunner(model, layout, device, rc, num_blocks), caches


def drive(
    runner, prompts: list[list[int]], num_decode_steps: int, before_step=None
) -> tuple[list[list[int]], list]:
    """Prefill every prompt in one step, then decode; blocks handed out like the scheduler would."""
    next_block = [1]  # block 0 is the null block

    def blocks_for(n_tokens: int, have: int) -> list[int]:
        need = -(-n_tokens // BLOCK) - have
        out = list(range(next_block[0], next_block[0] + need))
        next_block[0] += need
        return out

    ids = [f"r{i}" for i in range(len(prompts))]
    num_blocks = {}
    new = []
    for r, p in zip(ids, prompts):
        b = blocks_for(len(p), 0)
        num_blocks[r] = len(b)
        new.append(NewRequestData(r, list(p), GREEDY, b, 0))
    sched = {r: len(p) for r, p in zip(ids, prompts)}
    so = SchedulerOutput(0, new, CachedRequestData(), sched, sum(sched.values()))
    outputs = [[] for _ in prompts]
    lengths = {r: len(p) for r, p in zip(ids, prompts)}
    for step in range(num_decode_steps + 1):
        if before_step is not None:
            before_step(step, so)
        out = runner.execute_model(so, None).output
        for i, r in enumerate(ids):
            outputs[i] += out.sampled_token_ids[out.req_ids.index(r)]
        cached = CachedRequestData()
        for i, r in enumerate(ids):
            cached.req_ids.append(r)
            cached.num_computed_tokens.append(lengths[r])
            cached.new_token_ids.append([outputs[i][-1]])
            lengths[r] += 1
            b = blocks_for(lengths[r], num_blocks[r])
            num_blocks[r] += len(b)
            cached.new_block_ids.append(b)
        so = SchedulerOutput(step + 1, [], cached, {r: 1 for r in ids}, len(ids))
    return outputs, next_block[0]


def test_v2_matches_v1_step_by_step_cpu(model_dir):
    rc = resolved_for(model_dir, "cpu", "float32")
    prompts = prompts_of([5, 13, 3])
    v1, _ = build_runner("v1", rc)
    v2, _ = build_runner("v2", rc)
    want, _ = drive(v1, prompts, 6)
    got, _ = drive(v2, prompts, 6)
    assert got == want


def test_padded_rows_change_neither_outputs_nor_kv_cache_cpu(model_dir):
    """Force padding on CPU (eager, reference backend): decode steps of 3 requests run as 5 padded
    request rows / 7 padded token rows.  Real rows' tokens and the cache must match an unpadded run;
    slots no request owns (the null block, never-allocated blocks) must stay untouched (zero)."""
    rc = resolved_for(model_dir, "cpu", "float32")
    prompts = prompts_of([6, 11, 4])
    plain, plain_caches = build_runner("v2", rc)
    padded, padded_caches = build_runner("v2", rc)
    seen = []

    def pad_plan(num_reqs, num_tokens, max_query_len):
        if max_query_len == 1:
            seen.append(num_reqs)
            return GraphPlan("eager", num_reqs + 2, num_tokens + 4)
        return GraphPlan("eager", num_reqs, num_tokens)

    padded.graphs.plan = pad_plan
    want, used_blocks = drive(plain, prompts, 5)
    got, _ = drive(padded, prompts, 5)
    assert seen == [3] * 5
    assert got == want
    for a, b in zip(plain_caches, padded_caches):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
        assert b[:, 0].eq(0).all(), "a padded row wrote into the null block"
        assert b[:, used_blocks:].eq(0).all(), "a padded row wrote into an unowned block"


# ---------------------------------------------------------------------------------------------
# Through the engine (CPU): greedy and seeded parity, chunked prefill, staggered arrivals, preemption
# ---------------------------------------------------------------------------------------------


def run_engine(model_dir, runner: str, requests, *, stagger: bool, **kwargs) -> tuple[dict, int]:
    """Run ``requests`` = [(id, prompt, params)]; with ``stagger`` three new requests arrive every
    other step.  Returns ({id: (token_ids, logprobs)}, number of preemptions)."""
    preemptions = [0]
    original = Scheduler._preempt

    def counting(self, req):
        preemptions[0] += 1
        return original(self, req)

    Scheduler._preempt = counting
    try:
        with pprun.LLM(str(model_dir), runner=runner, dtype="float32", **kwargs) as llm:
            eng = llm.engine
            pending = list(requests)
            results = {}
            step = 0
            while pending or eng.has_unfinished_requests():
                if pending and (not stagger or step % 2 == 0 or not eng.has_unfinished_requests()):
                    for _ in range(len(pending) if not stagger else 3):
                        if pending:
                            rid, prompt, params = pending.pop(0)
                            eng.add_request(prompt, params, request_id=rid)
                for out in eng.step():
                    c = out.outputs[0]
                    results[out.request_id] = (c.token_ids, c.logprobs, c.finish_reason)
                step += 1
    finally:
        Scheduler._preempt = original
    return results, preemptions[0]


def test_engine_greedy_parity_chunked_staggered_preempted(model_dir):
    prompts = prompts_of([3, 17, 9, 30, 5, 22, 12, 41, 7])
    requests = [
        (f"q{i}", p, SamplingParams(temperature=0.0, max_tokens=8 + i % 4, ignore_eos=True))
        for i, p in enumerate(prompts)
    ]
    # 16-token budget: chunked prefill; 14 blocks of 8 for
    # requests of up to 52 tokens (7 blocks): preemption.
    kw = dict(
        executor="uni",
        max_num_batched_tokens=16,
        max_num_seqs=8,
        block_size=BLOCK,
        max_model_len=64,
        kv_cache_memory_bytes=14 * 2 * 4 * BLOCK * 2 * 16 * 4,
    )
    v1, pre1 = run_engine(model_dir, "v1", requests, stagger=True, **kw)
    v2, pre2 = run_engine(model_dir, "v2", requests, stagger=True, **kw)
    assert pre1 > 0 and pre2 > 0, (pre1, pre2)
    assert set(v1) == {r[0] for r in requests}
    assert v2 == v1
    assert all(len(v1[r][0]) == 8 + i % 4 for i, r in enumerate(sorted(v1, key=lambda s: int(s[1:]))))


def test_engine_seeded_sampling_and_logprobs_parity(model_dir):
    prompts = prompts_of([4, 19, 8, 27, 6, 14, 10, 3])
    requests = [
        (
            f"s{i}",
            p,
            SamplingParams(
                temperature=[0.0, 0.7, 1.0, 1.3][i % 4],
                top_k=[-1, 20, -1, 50][i % 4],
                top_p=[1.0, 0.9, 0.8, 1.0][i % 4],
                min_p=0.05 if i == 5 else 0.0,
                seed=100 + i,
                max_tokens=8,
                ignore_eos=True,
                logprobs=2 if i % 3 == 0 else None,
            ),
        )
        for i, p in enumerate(prompts)
    ]
    kw = dict(executor="uni", max_num_batched_tokens=24, max_num_seqs=8, block_size=BLOCK, max_model_len=64)
    v1, _ = run_engine(model_dir, "v1", requests, stagger=False, **kw)
    v2, _ = run_engine(model_dir, "v2", requests, stagger=False, **kw)
    # Tokens, top ids and finish reasons are identical; logprob values may differ in the last
    # float bits when the runners batch a step differently (matmul shapes change the rounding).
    assert set(v2) == set(v1)
    for r in v1:
        (tok1, lp1, fin1), (tok2, lp2, fin2) = v1[r], v2[r]
        assert (tok2, fin2) == (tok1, fin1), r
        assert (lp1 is None) == (lp2 is None)
        for a, b in zip(lp1 or [], lp2 or []):
            assert a.top_token_ids == b.top_token_ids
            assert a.sampled_logprob == pytest.approx(b.sampled_logprob, abs=1e-5)
            assert a.top_logprobs == pytest.approx(b.top_logprobs, abs=1e-5)
    assert any(v1[r][1] for r in v1), "no request returned logprobs"


def test_sampling_from_graph_logits_matches_sampling_from_hidden_cpu(model_dir, monkeypatch):
    """``sample(..., full_graph=True)`` — the path after a full decode graph that computed the
    logits and the greedy argmax itself — stood in for on CPU: every step's logits and argmax are
    written where a graph would write them, then read by that path (views for decode steps, a
    gather for prefill chunks).  Greedy (the argmax taken as the sample), seeded sampling and
    logprobs give what sampling from the hidden states gives."""
    from pprun.worker.v2.runner import V2ModelRunner

    greedy = [(f"g{i}", p, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
              for i, p in enumerate(prompts_of([4, 19, 8, 27]))]  # fmt: skip
    mixed = [
        (f"s{i}", p, SamplingParams(temperature=[0.0, 0.8][i % 2], top_k=20, seed=7 + i, max_tokens=8,
                                    ignore_eos=True, logprobs=2 if i % 3 == 0 else None))  # fmt: skip
        for i, p in enumerate(prompts_of([6, 13, 9, 21, 5]))
    ]
    kw = dict(executor="uni", max_num_batched_tokens=24, max_num_seqs=8, block_size=BLOCK, max_model_len=64)
    want = {name: run_engine(model_dir, "v2", reqs, stagger=True, **kw)[0] for name, reqs in (("g", greedy), ("m", mixed))}

    original = V2ModelRunner.sample
    graph_steps = [0]

    def as_after_a_graph(self, so, batch, hidden, full_graph=False):
        logits = self.model.compute_logits(hidden[: batch.num_tokens])  # every row, as a graph does
        self.graph_logits = logits.clone()
        self.graph_greedy = logits.argmax(dim=-1)
        graph_steps[0] += 1
        return original(self, so, batch, hidden, True)

    monkeypatch.setattr(V2ModelRunner, "sample", as_after_a_graph)
    got = {name: run_engine(model_dir, "v2", reqs, stagger=True, **kw)[0] for name, reqs in (("g", greedy), ("m", mixed))}
    assert graph_steps[0] > 0
    assert got["g"] == want["g"]
    for r, (tokens, logprobs, finish) in want["m"].items():
        assert got["m"][r][0] == tokens and got["m"][r][2] == finish, r
        for a, b in zip(got["m"][r][1] or [], logprobs or []):
            assert a.top_token_ids == b.top_token_ids
            assert a.sampled_logprob == pytest.approx(b.sampled_logprob, abs=1e-5)


def test_request_table_suppressed_ids_first_output_and_row_reuse():
    """A row's begin ids apply at the sample that ends its original prompt (a resumed request's
    row holds its outputs too: later samples are not first); a freed row suppresses nothing."""
    table = RequestTable(4, 16, 2, torch.device("cpu"), make_generators=False)
    assert table.suppressed_ids(np.array([0]), np.array([3])) is None
    ra = table.add("a", [1, 2, 3], [1], 0, SamplingParams(suppress_token_ids=[7], begin_suppress_token_ids=[8, 9]))
    rb = table.add("b", [1, 2, 3, 4, 5], [2], 0, SamplingParams(begin_suppress_token_ids=[6]), num_prompt_tokens=3)
    rc = table.add("c", [1], [3], 0, GREEDY)
    assert table.num_suppressing == 2
    got = table.suppressed_ids(np.array([ra, rb, rc]), np.array([3, 5, 1]))
    assert [g.tolist() for g in got] == [[7, 8, 9], [], []]
    got = table.suppressed_ids(np.array([rb, ra]), np.array([3, 4]))
    assert [g.tolist() for g in got] == [[6], [7]]
    assert table.suppressed_ids(np.array([rb, rc]), np.array([6, 2])) is None
    table.remove("a")
    assert table.num_suppressing == 1
    assert table.add("d", [1, 2], [1], 0, GREEDY) == ra
    assert table.suppressed_ids(np.array([ra]), np.array([2])) is None
    table.add("b", [1, 2, 3], [2], 0, GREEDY)  # resumed: same row, parameters replaced
    assert table.num_suppressing == 0


SUPPRESS_PROMPTS = prompts_of([3, 17, 9, 30, 5, 22])


def suppress_params(i: int, **extra) -> SamplingParams:
    seeded = i % 3 == 2
    return SamplingParams(temperature=0.9 if seeded else 0.0, seed=50 + i if seeded else None,
                          max_tokens=10, ignore_eos=True, **extra)


@pytest.fixture(scope="module")
def unsuppressed(model_dir):
    """Each request's tokens without suppression (V2, one stage)."""
    requests = [(f"q{i}", p, suppress_params(i)) for i, p in enumerate(SUPPRESS_PROMPTS)]
    kw = dict(executor="uni", max_num_batched_tokens=16, max_num_seqs=8, block_size=BLOCK, max_model_len=64)
    return run_engine(model_dir, "v2", requests, stagger=True, **kw)[0]


@pytest.mark.parametrize(("pp", "executor"), [(1, "uni"), pytest.param(2, "mp", marks=pytest.mark.slow)])
def test_engine_suppression_parity_v1_v2(model_dir, unsuppressed, pp, executor):
    """``suppress_token_ids`` / ``begin_suppress_token_ids`` give identical tokens on V1 and V2
    (greedy and seeded, chunked prefill; at pp = 1 preemption too: a resumed request's first
    sample after recompute is not its first output).  The ids suppressed are ones each request
    samples without suppression, so a runner that ignored them would differ.  At pp = 2 the same
    engines also run plain greedy requests of assorted lengths (V1 == V2 over two mp stages)."""
    kw = dict(executor=executor, pipeline_parallel_size=pp, max_num_batched_tokens=16, max_num_seqs=8,
              block_size=BLOCK, max_model_len=64)
    if pp == 1:
        kw["kv_cache_memory_bytes"] = 14 * 2 * 4 * BLOCK * 2 * 16 * 4  # 14 blocks: preemption
    requests = []
    for i, p in enumerate(SUPPRESS_PROMPTS):
        tokens = unsuppressed[f"q{i}"][0]
        suppress = sorted(set(tokens[1:4]) - {tokens[0]})
        requests.append((f"q{i}", p, suppress_params(i, suppress_token_ids=suppress,
                                                     begin_suppress_token_ids=[tokens[0]])))
    plain = []
    if pp == 2:
        plain = [(f"p{i}", p, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
                 for i, p in enumerate(prompts_of([5, 18, 9, 26, 3, 12, 31, 7]))]
    v1, pre1 = run_engine(model_dir, "v1", requests + plain, stagger=True, **kw)
    v2, pre2 = run_engine(model_dir, "v2", requests + plain, stagger=True, **kw)
    if pp == 1:
        assert pre1 > 0 and pre2 > 0, (pre1, pre2)
    assert v2 == v1 and len(v1) == len(requests) + len(plain)
    for rid, _, sp in requests:
        tokens = v2[rid][0]
        assert tokens[0] not in sp.begin_suppress_token_ids, rid
        assert not set(tokens) & set(sp.suppress_token_ids), rid
        assert tokens != unsuppressed[rid][0], rid


# ---------------------------------------------------------------------------------------------
# GPU: CUDA graphs (triton backend, bf16)
# ---------------------------------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("mode", ["full", "piecewise", "full_and_piecewise"])
def test_graphs_match_eager_and_v1_gpu(model_dir, mode):
    """3 requests: the prefill step (21 tokens) replays the piecewise graph of 32 tokens in the
    piecewise modes (captured over the runner's 8 request rows: more tokens than rows) and runs
    eagerly under ``full``; decode steps pad to the captured size 4, full or piecewise."""
    prompts = prompts_of([6, 11, 4])
    eager_rc = resolved_for(model_dir, "cuda", "bfloat16", cudagraph_mode="none")
    piecewise = mode != "full"
    graph_rc = resolved_for(
        model_dir, "cuda", "bfloat16", cudagraph_mode=mode, cudagraph_capture_sizes=[1, 2, 4, 8],
        piecewise_capture_sizes=[4, 8, 32],
    )
    assert graph_rc.cudagraph_capture_sizes == [1, 2, 4, 8]
    assert graph_rc.piecewise_capture_sizes == ([4, 8, 32] if piecewise else [])
    v1, _ = build_runner("v1", eager_rc, backend="triton")
    eager, eager_caches = build_runner("v2", eager_rc, backend="triton")
    graphed, graph_caches = build_runner("v2", graph_rc, backend="triton")
    assert graphed.graphs.mode == mode
    assert sorted(graphed.graphs.piecewise) == ([4, 8, 32] if piecewise else [])
    assert sorted(graphed.graphs.full) == ([] if mode == "piecewise" else [1, 2, 4, 8])
    plans = []
    original = graphed.graphs.plan

    def recording(*args):
        plan = original(*args)
        plans.append(plan)
        return plan

    graphed.graphs.plan = recording
    want_v1, _ = drive(v1, prompts, 6)
    want, used_blocks = drive(eager, prompts, 6)
    got, _ = drive(graphed, prompts, 6)
    prefill_plan, decode_plans = plans[0], plans[1:]
    if piecewise:
        assert (prefill_plan.mode, prefill_plan.num_tokens_padded) == ("piecewise", 32), plans
    else:
        assert prefill_plan.mode == "eager", plans
    decode_mode = "piecewise" if mode == "piecewise" else "full"
    assert all(p.mode == decode_mode and p.num_tokens_padded == 4 for p in decode_plans), plans
    assert got == want == want_v1
    for a, b in zip(eager_caches, graph_caches):
        torch.testing.assert_close(b.float(), a.float(), rtol=2e-2, atol=2e-2)
        assert b[:, 0].eq(0).all(), "a padded row wrote into the null block"
        assert b[:, used_blocks:].eq(0).all(), "a padded row wrote into an unowned block"


@pytest.mark.gpu
@needs_cuda
def test_fused_decode_matches_separate_kernels_gpu(model_dir, monkeypatch, switch):
    """Decode with rotary + cache write + split merge in one kernel (replayed from full graphs)
    against rotary, cache write and attention as separate kernels (eager)."""
    from pprun.attention import triton_ops

    calls = [0]
    fused_fn = triton_ops.paged_decode_attention_rope

    def counted(*args, **kwargs):
        calls[0] += 1
        return fused_fn(*args, **kwargs)

    monkeypatch.setattr(triton_ops, "paged_decode_attention_rope", counted)
    prompts = prompts_of([6, 30, 20])
    # A long max_model_len makes the decode launch split each context (merged in-kernel).
    kw = dict(max_model_len=1024)
    separate_rc = resolved_for(model_dir, "cuda", "float32", cudagraph_mode="none", **kw)
    fused_rc = resolved_for(model_dir, "cuda", "float32", cudagraph_mode="full", cudagraph_capture_sizes=[4], **kw)
    switch("PPRUN_DISABLE_FUSED_DECODE", False)
    separate, separate_caches = build_runner("v2", separate_rc, backend="triton", num_blocks=160)
    want, _ = drive(separate, prompts, 8)
    assert calls[0] == 0
    switch("PPRUN_DISABLE_FUSED_DECODE", True)
    fused, fused_caches = build_runner("v2", fused_rc, backend="triton", num_blocks=160)
    assert triton_ops.num_decode_splits(4, fused.model.arch.num_key_value_heads, 1024, torch.device("cuda")) > 1
    got, _ = drive(fused, prompts, 8)
    assert calls[0] > 0
    assert got == want
    for a, b in zip(separate_caches, fused_caches):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("lengths", [[9], [6, 11, 4]])  # one row: split-K matmuls; three: cuBLAS
def test_pdl_graphs_match_plain_launches_gpu(model_dir, monkeypatch, switch, lengths):
    """Full graphs whose Triton kernels overlap through programmatic dependent launch give the
    same tokens and KV cache, bit for bit, as the same kernels launched one after another.  Each
    side's launches are counted through ``pdl_options`` (what every PDL-capable kernel asks before
    its launch): PDL launches on the PDL side only, PDL-capable launches on both."""
    import sys

    import pprun.attention.triton_ops  # noqa: F401  (every module whose kernels take PDL, loaded
    import pprun.layers.fused  # noqa: F401            before their pdl_options is wrapped)
    import pprun.layers.head_norm  # noqa: F401
    import pprun.layers.skinny  # noqa: F401
    import pprun.sampling.greedy_kernel  # noqa: F401
    from pprun.kernels import triton_utils

    launches = {"pdl": 0, "plain": 0}
    original = triton_utils.pdl_options

    def counted(device):
        options = original(device)
        launches["pdl" if options.get("launch_pdl") else "plain"] += 1
        return options

    users = [m for name, m in list(sys.modules.items())
             if name.startswith("pprun.") and getattr(m, "pdl_options", None) is original]  # fmt: skip
    assert users, "no module launches kernels through pdl_options"
    for module in users:
        monkeypatch.setattr(module, "pdl_options", counted)

    prompts = prompts_of(lengths)
    rc = resolved_for(model_dir, "cuda", "bfloat16", cudagraph_mode="full", cudagraph_capture_sizes=[1, 4])
    results = {}
    counts = {}
    for pdl in (False, True):
        switch("PPRUN_DISABLE_PDL", pdl)
        launches.update(pdl=0, plain=0)
        runner, caches = build_runner("v2", rc, backend="triton")
        tokens, _ = drive(runner, prompts, 12)
        results[pdl] = (tokens, [c.clone() for c in caches])
        counts[pdl] = dict(launches)
    # The plain side launched the same kernels without PDL; the PDL side captured PDL launches.
    assert counts[False]["pdl"] == 0 and counts[False]["plain"] > 0, counts
    assert counts[True]["pdl"] > 0, counts
    assert results[True][0] == results[False][0]
    for a, b in zip(results[False][1], results[True][1]):
        assert torch.equal(a, b)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("setting", [
    ("pprun.layers.skinny", "WEIGHTS_AHEAD_MAX_ROWS", 32),
    ("pprun.layers.skinny", "SWAPPED_TARGET_PROGRAMS", 256),
    ("pprun.attention.triton_ops", "DECODE_PROGRAMS_PER_SM", 8),
])
def test_batch_settings_keep_tokens_gpu(model_dir, monkeypatch, setting):
    """The batch-32 settings that ``scripts/gpu_speed.py --ab`` tries (weights read ahead above
    one row, more split-K programs, more decode splits) give the default's tokens through full
    graphs with PDL, three requests at a time (fp32: only the sums' order differs)."""
    import importlib

    prompts = prompts_of([6, 30, 20])
    rc = resolved_for(model_dir, "cuda", "float32", cudagraph_mode="full", cudagraph_capture_sizes=[4],
                      max_model_len=1024)
    want, _ = drive(build_runner("v2", rc, backend="triton")[0], prompts, 8)
    module_name, name, value = setting
    monkeypatch.setattr(importlib.import_module(module_name), name, value)
    got, _ = drive(build_runner("v2", rc, backend="triton")[0], prompts, 8)
    assert got == want


@pytest.mark.gpu
@needs_cuda
def test_capture_leaves_kv_cache_and_requests_untouched_gpu(model_dir):
    rc = resolved_for(model_dir, "cuda", "bfloat16", cudagraph_mode="full", cudagraph_capture_sizes=[1, 4, 8])
    runner, caches = build_runner("v2", rc, backend="triton")
    assert sorted(runner.graphs.full) == [1, 4, 8]
    assert all(c.eq(0).all() for c in caches)
    assert runner.table.num_live_reqs == 0


@pytest.mark.gpu
@needs_cuda
def test_engine_full_graphs_match_v1_gpu(model_dir):
    prompts = prompts_of([3, 17, 9, 30, 5, 22, 12, 41, 7])
    requests = [
        (f"g{i}", p, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
        for i, p in enumerate(prompts)
    ]
    kw = dict(
        executor="uni",
        device="cuda",
        max_num_batched_tokens=32,
        max_num_seqs=8,
        block_size=16,
        max_model_len=128,
    )
    v1, _ = run_engine(model_dir, "v1", requests, stagger=True, **kw)
    v2, _ = run_engine(model_dir, "v2", requests, stagger=True, cudagraph_mode="full", **kw)
    assert v2 == v1
    # The default: staggered prefill chunks and mixed steps replay piecewise graphs as well.
    both, _ = run_engine(model_dir, "v2", requests, stagger=True, cudagraph_mode="full_and_piecewise", **kw)
    assert both == v1


@pytest.mark.gpu
@needs_cuda
def test_logits_in_full_graphs_match_eager_sampling_gpu(model_dir):
    """The last stage's full decode graphs compute the logits and a greedy argmax themselves:
    seeded random sampling (top-k, top-p, min-p), greedy rows and logprobs read those logits and
    give what eager steps give; an all-greedy batch takes the graph's argmax."""
    prompts = prompts_of([5, 9, 13, 7])
    params = [
        SamplingParams(temperature=0.8, top_k=20, seed=1, max_tokens=10, ignore_eos=True),
        SamplingParams(temperature=1.0, top_p=0.9, min_p=0.05, seed=2, max_tokens=10, ignore_eos=True),
        SamplingParams(temperature=0.0, logprobs=3, max_tokens=10, ignore_eos=True),
        SamplingParams(temperature=0.7, seed=3, logprobs=2, max_tokens=10, ignore_eos=True),
    ]
    # Four requests decoding together: every decode step is the captured size 4, so the eager
    # LM head sees the same row count as the graph's.
    kw = dict(executor="uni", device="cuda", max_num_seqs=4, max_model_len=128, cudagraph_capture_sizes=[4])
    mixed = [(f"m{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, params))]
    eager, _ = run_engine(model_dir, "v2", mixed, stagger=False, cudagraph_mode="none", **kw)
    graphed, _ = run_engine(model_dir, "v2", mixed, stagger=False, cudagraph_mode="full", **kw)
    for rid, (tokens, logprobs, _) in eager.items():
        assert graphed[rid][0] == tokens, rid
        if logprobs is not None:
            for a, b in zip(graphed[rid][1], logprobs):
                assert a.top_token_ids == b.top_token_ids
                assert a.sampled_logprob == pytest.approx(b.sampled_logprob, abs=1e-5)
    greedy = [(f"g{i}", p, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)) for i, p in enumerate(prompts)]
    want, _ = run_engine(model_dir, "v2", greedy, stagger=False, cudagraph_mode="none", **kw)
    got, _ = run_engine(model_dir, "v2", greedy, stagger=False, cudagraph_mode="full", **kw)
    assert got == want


@pytest.mark.gpu
@needs_cuda
def test_suppression_with_full_graphs_matches_v1_gpu(model_dir, unsuppressed):
    """Suppressing requests on full decode graphs (the step samples outside the graph, from the
    graph's logits with the ids at -inf) give V1's tokens."""
    requests = []
    for i, p in enumerate(SUPPRESS_PROMPTS):
        tokens = unsuppressed[f"q{i}"][0]
        requests.append((f"q{i}", p, suppress_params(i, suppress_token_ids=sorted(set(tokens[1:4]) - {tokens[0]}),
                                                     begin_suppress_token_ids=[tokens[0]])))
    kw = dict(executor="uni", device="cuda", max_num_batched_tokens=32, max_num_seqs=8, block_size=16,
              max_model_len=128, cudagraph_capture_sizes=[4, 8])
    v1, _ = run_engine(model_dir, "v1", requests, stagger=True, **kw)
    v2, _ = run_engine(model_dir, "v2", requests, stagger=True, cudagraph_mode="full", **kw)
    assert v2 == v1
    # The default: staggered prefill chunks and mixed steps replay piecewise graphs as well.
    both, _ = run_engine(model_dir, "v2", requests, stagger=True, cudagraph_mode="full_and_piecewise", **kw)
    assert both == v1
    for rid, _, sp in requests:
        assert v2[rid][0][0] not in sp.begin_suppress_token_ids
        assert not set(v2[rid][0]) & set(sp.suppress_token_ids)


def test_request_table_suppression_mask_equals_mask_token_ids():
    """The per-row device mask a decode step reads gives the logits ``mask_token_ids`` gives with
    each row's ``suppress_token_ids`` (ids past the vocabulary dropped), after rows are taken,
    freed and reused, and for rows in any order; rows with no suppression are untouched."""
    from pprun.sampling.sampler import mask_token_ids

    table = RequestTable(4, 16, 2, torch.device("cpu"), make_generators=False)
    logits = torch.randn(3, 12)

    def check(rows):
        got = table.mask_suppressed(logits, torch.tensor(rows))
        want = mask_token_ids(logits, [table.suppress_ids[r] if table.suppress_ids[r] is not None
                                       else np.zeros(0, np.int64) for r in rows])
        assert torch.equal(got, want), rows
        assert table.suppresses_np[rows].tolist() == [table.suppress_ids[r] is not None for r in rows]

    ra = table.add("a", [1, 2], [1], 0, SamplingParams(suppress_token_ids=[7, 30], begin_suppress_token_ids=[8]))
    rb = table.add("b", [1, 2], [2], 0, GREEDY)
    rc = table.add("c", [1], [3], 0, SamplingParams(suppress_token_ids=[0, 11]))
    check([ra, rb, rc])
    check([rc, ra, rb])
    table.remove("a")
    rd = table.add("d", [1, 2], [1], 0, GREEDY)  # a's row, now without suppression
    assert rd == ra
    check([rd, rb, rc])
    table.remove("b")
    re_ = table.add("e", [1, 2], [2], 0, SamplingParams(suppress_token_ids=[3]))
    check([rc, re_, rd])
    assert table.begin_suppression_due(np.array([rc, re_]), np.array([1, 2])) is False
    table.add("f", [1, 2, 3], [3], 0, SamplingParams(begin_suppress_token_ids=[4]))
    assert table.begin_suppression_due(np.array([table.row_of["f"]]), np.array([3])) is True
    assert table.begin_suppression_due(np.array([table.row_of["f"]]), np.array([4])) is False
