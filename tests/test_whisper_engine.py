"""Whisper through the engine: greedy parity with transformers for pp = 1, 2, 3 on both runners
(uni, mp, ray), the encoder output sent once per request, windows, preemption, cross-attention
metadata padding (contract 4) and bad input."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import fork_mp_stages
from tiny_models import make_tiny_llama
from whisper_helpers import (
    CLIPS,
    GREEDY,
    MAX_TOKENS,
    make_audio_dependent_whisper,
    ours,
    prompts,
    transformers_tokens,
)

from pprun import LLM
from pprun.sampling.params import SamplingParams


@pytest.fixture(scope="module")
def whisper_dir(tmp_path_factory):
    return make_audio_dependent_whisper(tmp_path_factory.mktemp("whisper-engine"))


@pytest.fixture(scope="module")
def hf_tokens(whisper_dir):
    """transformers' greedy ``generate`` per clip (its generation config: forced ids, suppress lists)."""
    return transformers_tokens(whisper_dir)


def stage_facts(llm) -> list[dict]:
    """Each stage's ``Worker.runner_facts`` (runner, graphs, encoder-output counters)."""
    executor = llm.engine.executor
    if hasattr(executor, "worker"):  # in process
        return [executor.worker.runner_facts()]
    return executor.call_all("runner_facts")


def test_tiny_whisper_tokens_depend_on_the_audio(hf_tokens):
    """The parity tests below would pass for a model that ignored the audio: this one does not."""
    assert len({tuple(t) for t in hf_tokens}) == len(hf_tokens)
    assert all(len(set(t)) > 1 for t in hf_tokens)


# Every (pp, executor) layout, every (pp, runner) and every (executor, runner) pair, each at
# least once: seven engines rather than the twelve of the whole product.
@pytest.mark.parametrize(
    ("pp", "executor", "runner"),
    [(1, "uni", "v1"), (1, "uni", "v2"), (1, "mp", "v2"), (2, "mp", "v1"),
     pytest.param(2, "ray", "v2", marks=pytest.mark.slow), pytest.param(3, "mp", "v2", marks=pytest.mark.slow),
     pytest.param(3, "ray", "v1", marks=pytest.mark.slow)],
)
def test_greedy_matches_transformers_over_stages(whisper_dir, hf_tokens, pp, executor, runner, request):
    """One batch of clips of different lengths: transformers' tokens on every layout; each
    stage but the last sends each request's encoder output once, each stage after the first
    receives it once."""
    if executor == "ray":
        request.getfixturevalue("ray_cluster")
    if executor == "mp" and pp > 1:  # the pp=1 mp stage starts fresh; the others fork (conftest.fork_mp_stages)
        fork_mp_stages(request)
    with LLM(str(whisper_dir), dtype="float32", max_num_seqs=8, pipeline_parallel_size=pp,
             executor=executor, runner=runner) as llm:
        assert llm.describe()["runner"] == runner
        outs = llm.generate(prompts(), GREEDY)
        facts = stage_facts(llm)
    assert [ours(o) for o in outs] == hf_tokens
    n = len(CLIPS)
    assert [f["runner"] for f in facts] == [runner] * pp
    assert [f["num_encoded"] for f in facts] == [n] * pp
    assert [f["encoder_outputs_sent"] for f in facts] == [n] * (pp - 1) + [0]
    assert [f["encoder_outputs_received"] for f in facts] == [0] + [n] * (pp - 1)


def test_auto_runner_is_v2(whisper_dir):
    with LLM(str(whisper_dir), dtype="float32", max_num_seqs=4) as llm:
        assert llm.describe()["runner"] == "v2"


BLOCK_BYTES = 2 * 3 * 8 * 36 * 4
"""One KV block of the tiny Whisper at block_size=8: K and V, 3 layers, 8 tokens, 36 wide, fp32."""
SLOT_BYTES = 2 * 3 * 15 * 36 * 4
"""One cross-attention slot: K and V, 3 layers, 15 encoder positions, 36 wide, fp32."""
REQUEST_KV_BYTES = 5 * BLOCK_BYTES
"""Self-attention of one request of max_model_len=40 tokens: 5 blocks of 8."""


@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_transcribe_windows_and_preemption(whisper_dir, hf_tokens, runner, monkeypatch):
    """A 7 s clip is three 3 s windows; a KV cache of a few blocks preempts (a resumed request
    is encoded again into a new slot), and the tokens stay.  The stage sizes its slots so that
    each one's request has room for max_model_len tokens, which never preempts: here the slots
    are forced to max_num_seqs to reach the preemption path."""
    import pprun.worker.encoder_decoder as encoder_decoder

    monkeypatch.setattr(encoder_decoder, "cross_slots_for_budget", lambda *args: 4)
    long = np.concatenate([CLIPS[0][0][:48000 // 16 * 16], CLIPS[1][0], CLIPS[2][0], CLIPS[0][0]])
    # 7 blocks of 8 tokens (one request of max_model_len=40 needs 5, plus the null block) after
    # the cross caches of 4 + 1 slots: four requests growing to 12 tokens preempt.
    with LLM(str(whisper_dir), dtype="float32", max_num_seqs=4, block_size=8, runner=runner,
             kv_cache_memory_bytes=7 * BLOCK_BYTES + 5 * SLOT_BYTES) as llm:
        assert llm.engine.num_blocks == 7
        result = llm.transcribe([(long, 16000), CLIPS[1]], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
        preempted = llm.engine.num_preemptions
        again = llm.generate(prompts(), GREEDY)
    assert [len(r.windows) for r in result] == [3, 1]
    assert result[0].audio_seconds == pytest.approx(long.shape[0] / 16000)
    assert ours(result[1].windows[0]) == hf_tokens[1]
    assert [ours(o) for o in again] == hf_tokens
    assert preempted > 0 or llm.engine.num_preemptions > 0


@pytest.mark.parametrize(("pp", "executor", "runner"), [(1, "uni", "v1"), (1, "uni", "v2"), (2, "mp", "v2")])
def test_cross_slots_sized_from_the_budget(whisper_dir, hf_tokens, pp, executor, runner, request):
    """A cache budget that holds two requests' cross-attention and self-attention (plus the
    reserved slot and null block) on the heaviest stage, with max_num_seqs=8 and five clips:
    the stages take the slots the budget holds (the scheduler the smallest count of any stage),
    the other requests wait for a slot to free, and every clip decodes to transformers' tokens.
    A stage that ran more requests than it has slots would raise."""
    if executor == "mp":
        fork_mp_stages(request)
    budget = SLOT_BYTES + BLOCK_BYTES + 2 * (SLOT_BYTES + REQUEST_KV_BYTES) + 1000
    with LLM(str(whisper_dir), dtype="float32", max_num_seqs=8, block_size=8, runner=runner, executor=executor,
             pipeline_parallel_size=pp, kv_cache_memory_bytes=budget) as llm:
        slots = llm.engine.executor.num_cross_slots
        # One stage of three layers holds 2; of two stages the one with two of them holds 3.
        assert slots == (2 if pp == 1 else 3)
        assert llm.engine.scheduler.max_num_running == slots
        outs = llm.generate(prompts(), GREEDY)
    assert len(outs) == len(CLIPS) > slots
    assert [ours(o) for o in outs] == hf_tokens


def test_cache_budget_below_one_request_is_an_error(whisper_dir, hf_tokens):
    """A budget that does not hold one request beside the reserved slot and null block: a
    ValueError naming the budget and the settings to change, before any request runs."""
    budget = SLOT_BYTES + BLOCK_BYTES + SLOT_BYTES + REQUEST_KV_BYTES - 1
    with pytest.raises(ValueError, match=r"holds no request of this encoder-decoder model(.|\n)*"
                                         r"cache\.kv_cache_memory_bytes(.|\n)*model\.max_model_len"):
        LLM(str(whisper_dir), dtype="float32", block_size=8, kv_cache_memory_bytes=budget)
    # One byte more holds exactly one.
    with LLM(str(whisper_dir), dtype="float32", block_size=8, kv_cache_memory_bytes=budget + 1) as llm:
        assert llm.engine.executor.num_cross_slots == 1
        assert ours(llm.generate(prompts()[:1], GREEDY)[0]) == hf_tokens[0]


def test_cross_metadata_padding_rows_zeroed():
    """Contract 4: after a step with num_reqs < num_reqs_padded, real rows are right and padding
    rows zero, in the persistent buffers that a larger step filled before."""
    from pprun.worker.encoder_decoder import EncoderDecoderState

    state = EncoderDecoderState.__new__(EncoderDecoderState)
    state.device, state.source_len = torch.device("cpu"), 15
    state.slot_of = {"a": 3, "b": 1, "c": 2, "d": 4}
    lens = torch.zeros(8, dtype=torch.int32)
    slots = torch.zeros(8, dtype=torch.int32)
    state.fill(["a", "b", "c", "d"], 8, lens, slots)  # an earlier, larger step
    lens[4:] = 77  # and whatever else was left there
    slots[4:] = 5
    meta = state.fill(["c", "a", "b"], 4, lens, slots)
    assert meta.encoder_seq_lens.data_ptr() == lens.data_ptr()  # the same persistent buffer
    assert meta.encoder_seq_lens.tolist() == [15, 15, 15, 0]
    assert meta.cross_slots.tolist() == [2, 3, 1, 0]


def test_audio_item_carries_the_window_samples(whisper_dir):
    """A request's audio item holds its window's 16 kHz samples as given (the first stage computes
    the log-mel features, a step's windows in one batch); its key is unique per window, hashing
    nothing (cross-attention items are never shared); a window longer than the front end's, or a
    front end whose frames do not fit the encoder, is a clear error."""
    from pprun.audio import AUDIO_SAMPLES_KEY
    from pprun.engine.speech import SpeechRequests

    speech = SpeechRequests(whisper_dir, 40, 15)
    samples = CLIPS[0][0]
    a, b = speech.audio_item(samples, "x.wav", 2), speech.audio_item(samples, "x.wav", 2)
    assert a.data[AUDIO_SAMPLES_KEY] is samples and a.data["source"] == "x.wav"
    assert a.num_encoder_positions == 15 and a.num_embeds == 0
    assert a.content_hash != b.content_hash
    with pytest.raises(ValueError, match="a window holds at most 48000 samples, got 48001"):
        speech.audio_item(np.zeros(48001, np.float32), "x.wav", 2)
    with pytest.raises(ValueError, match=r"30 mel frames per window, but the encoder takes 2 \* max_source_positions = 32"):
        SpeechRequests(whisper_dir, 40, 16)


def test_bad_input_names_entry_and_field(whisper_dir, tmp_path):
    text_file = tmp_path / "notes.wav"
    text_file.write_text("not audio")
    cases = [
        ({"multi_modal_data": {"audio": str(text_file)}}, "prompts[0].multi_modal_data.audio"),
        ({"multi_modal_data": {"audio": (np.zeros(0, np.float32), 16000)}}, "audio is empty"),
        ({"multi_modal_data": {"audio": (np.array([0.0, np.inf], np.float32), 16000)}}, "NaN or infinity"),
        ({"multi_modal_data": {"audio": (np.ones(100, np.float32), 0)}}, "sample_rate must be > 0, got 0"),
        ({"prompt_token_ids": [98, 100]}, "is a speech model and needs audio"),
        ({"multi_modal_data": {"audio": CLIPS[0], "image": 1}}, "multi_modal_data.image"),
        ({"multi_modal_data": {"audio": (np.ones(16000 * 4, np.float32), 16000)}}, "LLM.transcribe splits"),
    ]
    with LLM(str(whisper_dir), dtype="float32", max_num_seqs=4) as llm:
        first = llm.generate(prompts()[:1], GREEDY)
        for bad, message in cases:
            with pytest.raises(ValueError, match="prompts\\[0\\]") as err:
                llm.generate([bad, prompts()[1]], GREEDY)
            assert message in str(err.value)
        with pytest.raises(ValueError, match=r"prompts\[0\].*max_target_positions=40") as err:
            llm.generate(prompts()[:1], SamplingParams(temperature=0.0, max_tokens=39))
        assert "max_tokens may be at most 38" in str(err.value)
        with pytest.raises(ValueError, match=r"audio\[1\].*does not exist"):
            llm.transcribe([CLIPS[0], str(tmp_path / "missing.flac")])
        # Nothing was queued by the failed calls, and the engine still answers the same.
        assert not llm.engine.has_unfinished_requests()
        assert [o.outputs[0].token_ids for o in llm.generate(prompts()[:1], GREEDY)] == [
            first[0].outputs[0].token_ids
        ]


def test_audio_for_a_text_only_model(tmp_path):
    path = make_tiny_llama(tmp_path / "llama", num_layers=2)
    with LLM(str(path), dtype="float32") as llm:
        with pytest.raises(ValueError, match=r"prompts\[0\]\.multi_modal_data.*text-only") as err:
            llm.generate([{"prompt_token_ids": [1, 2], "multi_modal_data": {"audio": CLIPS[0]}}])
        assert "LlamaForCausalLM" in str(err.value)
        with pytest.raises(ValueError, match="LLM.transcribe needs a speech model"):
            llm.transcribe([CLIPS[0]])


def test_transcribe_cli_jsonl_and_summary(whisper_dir, hf_tokens, tmp_path):
    import json
    import subprocess
    import sys

    import soundfile as sf

    paths = []
    for i in (1, 2):
        path = tmp_path / f"clip{i}.flac"
        sf.write(path, *CLIPS[i])
        paths.append(str(path))
    out = tmp_path / "out.jsonl"
    cmd = [sys.executable, "-m", "pprun.cli", "transcribe", f"model.model={whisper_dir}", "model.dtype=float32",
           f"files=[{','.join(paths)}]", f"output_file={out}", "max_tokens=10", "progress=false",
           f"hydra.run.dir={tmp_path}", "scheduler.max_num_seqs=4"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [line["file"] for line in lines] == paths
    assert [line["windows"] for line in lines] == [1, 1]
    assert [line["num_output_tokens"] for line in lines] == [
        len(hf_tokens[i]) + (len(hf_tokens[i]) < 10) for i in (1, 2)
    ]
    summary = json.loads(done.stderr.strip().splitlines()[-1])
    assert summary["files"] == 2 and summary["audio_seconds"] == pytest.approx(2.7, abs=0.01)
    assert summary["audio_seconds_per_second"] > 0
    bad = subprocess.run([*cmd[:6], f"files=[{tmp_path / 'none.wav'}]", *cmd[7:]],
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "audio[0]" in bad.stderr and "does not exist" in bad.stderr
