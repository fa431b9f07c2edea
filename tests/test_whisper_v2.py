"""Whisper on the V2 runner: contract 4 after real steps (persistent cross metadata written for
the padded request count, real rows first, padding rows zero), full and piecewise CUDA graphs
against eager steps, and the scheduler's encoder budget for audio items."""

from __future__ import annotations

import pytest
import torch
from whisper_helpers import CLIPS, MAX_TOKENS, make_audio_dependent_whisper, prompts, transformers_tokens

from pprun import LLM
from pprun.sampling.params import SamplingParams
from pprun.worker.v2.cuda_graphs import GraphPlan

SOURCE_LEN = 15
"""The tiny Whisper's encoder positions (every window is padded to them)."""


@pytest.fixture(scope="module")
def whisper_dir(tmp_path_factory):
    return make_audio_dependent_whisper(tmp_path_factory.mktemp("whisper-v2"))


@pytest.fixture(scope="module")
def hf_tokens(whisper_dir):
    return transformers_tokens(whisper_dir)


def uneven_params() -> list[SamplingParams]:
    """Requests that stop after different numbers of tokens, so decode batches shrink 5 -> 4 ->
    3 -> 2: a later, smaller step's padding rows held real rows of an earlier one."""
    return [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (2, 9, 3, 9, 5)]


def record_steps(runner) -> list[dict]:
    """Wrap the Whisper plug-in's per-step hook: after it wrote the cross buffers, copy what the
    step's graph or eager forward reads (the plug-in's and the runner's per-request rows)."""
    state = runner.model_state
    original = state.extra_model_kwargs
    steps: list[dict] = []

    def recording(batch):
        extra = original(batch)
        n_pad = batch.num_reqs_padded
        bufs = runner.bufs
        steps.append({
            "req_ids": list(batch.req_ids), "num_reqs": batch.num_reqs, "num_reqs_padded": n_pad,
            "num_tokens": batch.num_tokens, "slot_of": dict(state.encoder_decoder.slot_of),
            "lens": state.encoder_seq_lens.device[:n_pad].tolist(),
            "slots": state.cross_slots.device[:n_pad].tolist(),
            "seq_lens": bufs.seq_lens.device[:n_pad].tolist(),
            "query_start_loc": bufs.query_start_loc.device[: n_pad + 1].tolist(),
            "block_table": bufs.block_table.device[:n_pad].tolist(),
            "cross": extra["cross_metadata"],
        })
        return extra

    state.extra_model_kwargs = recording
    return steps


def test_cross_metadata_padded_rows_after_real_v2_steps(whisper_dir, hf_tokens):
    """Contract 4 on CPU: decode steps are forced to run with num_reqs_padded = num_reqs + 3
    (the runner's padding policy, ``graphs.plan``, as a graph capture size would pad them).
    After each real step the persistent buffers hold the real rows (encoder length, the
    request's slot) first and zeros in every padding row, though larger earlier steps left real
    values there; the model gets views of those very buffers; and the tokens equal an unpadded
    V1 run and transformers."""
    with LLM(str(whisper_dir), dtype="float32", max_num_seqs=8, runner="v1") as llm:
        want = [o.outputs[0].token_ids for o in llm.generate(prompts(), uneven_params())]
    with LLM(str(whisper_dir), dtype="float32", max_num_seqs=8, runner="v2") as llm:
        runner = llm.engine.executor.worker.runner

        def pad_decode_steps(num_reqs, num_tokens, max_query_len):
            if max_query_len == 1:
                return GraphPlan("eager", num_reqs + 3, num_tokens + 3)
            return GraphPlan("eager", num_reqs, num_tokens)

        runner.graphs.plan = pad_decode_steps
        steps = record_steps(runner)
        got = [o.outputs[0].token_ids for o in llm.generate(prompts(), uneven_params())]
        state = runner.model_state
    assert got == want
    for tokens, ref in zip(got, hf_tokens, strict=True):
        n = min(len(tokens), len(ref))
        assert tokens[:n] == ref[:n]
    # Some padded step had fewer requests than an earlier step: its padding rows held real ones.
    shrunk = [s for i, s in enumerate(steps) if i and s["num_reqs_padded"] > s["num_reqs"]
              and s["num_reqs"] < max(p["num_reqs"] for p in steps[:i])]
    assert shrunk, [(s["num_reqs"], s["num_reqs_padded"]) for s in steps]
    for s in steps:
        n, n_pad = s["num_reqs"], s["num_reqs_padded"]
        assert s["lens"] == [SOURCE_LEN] * n + [0] * (n_pad - n), s
        assert s["slots"] == [s["slot_of"][r] for r in s["req_ids"]] + [0] * (n_pad - n), s
        assert 0 not in s["slots"][:n] and len(set(s["slots"][:n])) == n
        assert s["seq_lens"][n:] == [0] * (n_pad - n)
        assert s["query_start_loc"][n + 1 :] == [s["num_tokens"]] * (n_pad - n)
        assert all(row == [0] * len(row) for row in s["block_table"][n:])
        cross = s["cross"]
        assert cross.encoder_seq_lens.data_ptr() == state.encoder_seq_lens.device.data_ptr()
        assert cross.cross_slots.data_ptr() == state.cross_slots.device.data_ptr()
        assert cross.encoder_seq_lens.shape == (n_pad,) and cross.cross_slots.shape == (n_pad,)


@pytest.mark.parametrize("max_windows", [None, 2])
def test_a_steps_windows_share_one_encoder_call(whisper_dir, hf_tokens, monkeypatch, max_windows):
    """The five windows a step brings in go through the log-mel front end and the encoder in one
    call (``ENCODER_MAX_WINDOWS`` at its default), or in calls of at most that many when it is
    lowered; the tokens are transformers' either way."""
    import pprun.worker.encoder_decoder as encoder_decoder

    if max_windows is not None:
        monkeypatch.setattr(encoder_decoder, "ENCODER_MAX_WINDOWS", max_windows)
    with LLM(str(whisper_dir), dtype="float32", max_num_seqs=8, runner="v2") as llm:
        state = llm.engine.executor.worker.encoder_decoder
        model = state.model
        calls = []
        original_encode = model.encode

        def encode(features):
            calls.append(features.shape[0])
            return original_encode(features)

        model.encode = encode
        outs = llm.generate(prompts(), SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    assert calls == ([5] if max_windows is None else [2, 2, 1])
    got = [o.outputs[0].token_ids for o in outs]
    assert [t[:-1] if t and t[-1] == 97 else t for t in got] == hf_tokens


def test_v2_encoder_step_needs_the_stage_state(whisper_dir):
    """The plug-in refuses to run without the stage's EncoderDecoderState (the worker builds it
    with the cross caches): a clear error, not a missing attribute later."""
    from pprun.worker.v2.encoder_decoder_state import EncoderDecoderModelState

    with pytest.raises(ValueError, match="needs the stage's EncoderDecoderState"):
        EncoderDecoderModelState(torch.nn.Linear(1, 1), None, torch.device("cpu"), torch.float32, 4, 8)


# ---------------------------------------------------------------------------------------------
# GPU: full and piecewise graphs
# ---------------------------------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("mode", ["full", "piecewise"])
def test_graph_transcription_equals_eager_gpu(whisper_dir, hf_tokens, mode):
    """3 requests decode on the graph captured for 4, 5 on the one for 8 (padding rows inert);
    the tokens equal eager V2 steps and transformers (fp32)."""
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    kw = dict(dtype="float32", device="cuda", max_num_seqs=8, runner="v2", cudagraph_capture_sizes=[4, 8])
    for num_reqs, size in ((3, 4), (5, 8)):
        clips = prompts(CLIPS[:num_reqs])
        with LLM(str(whisper_dir), cudagraph_mode="none", **kw) as llm:
            eager = [o.outputs[0].token_ids for o in llm.generate(clips, greedy)]
        with LLM(str(whisper_dir), cudagraph_mode=mode, **kw) as llm:
            runner = llm.engine.executor.worker.runner
            assert runner.cudagraph_mode == mode
            plans = []
            original = runner.graphs.plan

            def recording(*args, original=original, plans=plans):
                plan = original(*args)
                plans.append((args, plan))
                return plan

            runner.graphs.plan = recording
            got = [o.outputs[0].token_ids for o in llm.generate(clips, greedy)]
        decode = [plan for (nr, nt, mql), plan in plans if mql == 1]
        assert decode, plans
        assert all(p.mode == mode for p in decode), plans
        assert decode[0].num_tokens_padded == size, plans
        if mode == "full":
            assert decode[0].num_reqs_padded == size
        assert got == eager, (num_reqs, size)
        want = hf_tokens[:num_reqs]
        assert [t[:-1] if t and t[-1] == 97 else t for t in got] == want


# ---------------------------------------------------------------------------------------------
# The scheduler's encoder budget for audio (cross-attention) items
# ---------------------------------------------------------------------------------------------


def audio_request(req_id: str, content_hash: str, positions: int = 1500):
    from pprun.core.request import Request
    from pprun.multimodal.items import MultiModalItem, PlaceholderRange

    item = MultiModalItem("audio", content_hash, PlaceholderRange(0, 2, (False, False)),
                          num_encoder_positions=positions)
    return Request(req_id, [98, 100], SamplingParams(temperature=0.0, max_tokens=4), eos_token_ids={97},
                   mm_items=[item])


def run_step(scheduler):
    """Schedule one step and answer it with one sampled token per scheduled request."""
    from pprun.core.outputs import ModelRunnerOutput

    so = scheduler.schedule()
    req_ids = list(so.num_scheduled_tokens)
    scheduler.update_from_output(so, ModelRunnerOutput(so.step_id, req_ids, [[5] for _ in req_ids]))
    return so


def test_audio_items_charge_their_encoder_positions():
    """A Whisper window costs its encoder positions of the step's encoder budget each time its
    request is admitted (equal clips are not deduplicated: each request encodes into its own
    slot); decode steps cost nothing; the default budget grows to a full batch of the largest window, an
    explicit one smaller than a window is an error naming it."""
    from pprun.core.scheduler import Scheduler

    s = Scheduler(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=32, block_size=4, num_blocks=64,
                  max_num_encoder_tokens=3200)
    for i, content in enumerate("aabc"):  # r0 and r1 carry the same clip
        s.add_request(audio_request(f"r{i}", content))
    so = run_step(s)
    assert [n.req_id for n in so.scheduled_new_reqs] == ["r0", "r1"]  # 3000 of 3200; a third: 4500
    so = run_step(s)
    assert [n.req_id for n in so.scheduled_new_reqs] == ["r2", "r3"]
    assert set(so.num_scheduled_tokens) == {"r0", "r1", "r2", "r3"}  # r0, r1 decode for free

    default = Scheduler(max_num_seqs=2, max_num_batched_tokens=64, max_model_len=32, block_size=4, num_blocks=64)
    assert default.max_num_encoder_tokens == 64
    for i in range(3):
        default.add_request(audio_request(f"d{i}", f"h{i}"))
    assert default.max_num_encoder_tokens == 2 * 1500  # a full batch (max_num_seqs) of windows
    assert [n.req_id for n in run_step(default).scheduled_new_reqs] == ["d0", "d1"]
    # A token budget above one window (2048 > 1500) still grows to a full batch: the budget it
    # gave would admit one window per step, and filling the batch would take max_num_seqs steps.
    wide = Scheduler(max_num_seqs=4, max_num_batched_tokens=2048, max_model_len=32, block_size=4, num_blocks=64)
    for i in range(4):
        wide.add_request(audio_request(f"w{i}", f"w{i}"))
    assert wide.max_num_encoder_tokens == 4 * 1500
    assert [n.req_id for n in run_step(wide).scheduled_new_reqs] == ["w0", "w1", "w2", "w3"]

    small = Scheduler(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=32, block_size=4, num_blocks=64,
                      max_num_encoder_tokens=1000)
    with pytest.raises(ValueError, match="1500 encoder rows: must be at most scheduler.max_num_encoder_tokens=1000"):
        small.add_request(audio_request("x", "h"))


def test_resumed_audio_request_is_charged_again():
    """A request admitted again after a preemption is encoded again (its slot was freed): its
    window costs the budget again, although its hash is still held; a later chunk of a request
    already admitted costs nothing."""
    from pprun.multimodal.encoder_budget import EncoderCacheManager, plan_encoder_inputs

    req = audio_request("r", "h")
    cache = EncoderCacheManager()
    cache.add_request("r", req.mm_items)
    cache.mark_encoded("h")
    assert plan_encoder_inputs(req.mm_items, 0, 2, 1500, cache) == (2, [0], 1500)
    assert plan_encoder_inputs(req.mm_items, 0, 2, 1499, cache) == (0, [], 0)
    assert plan_encoder_inputs(req.mm_items, 1, 1, 0, cache) == (1, [], 0)
