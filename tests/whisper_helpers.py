"""Shared pieces of the Whisper engine tests: clips of different lengths, a tiny Whisper whose
greedy tokens depend on the audio, and transformers' tokens for them (the reference)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from tiny_models import make_tiny_whisper

from pprun.sampling.params import SamplingParams

MAX_TOKENS = 10
EOS = 97
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)


def clip(seconds: float, seed: int) -> tuple[np.ndarray, int]:
    """A reproducible noisy chirp (so different clips give different features)."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * 16000)) / 16000
    tone = np.sin(2 * np.pi * (200 + 300 * seed) * t * (1 + t))
    return (0.3 * tone + 0.05 * rng.standard_normal(t.shape)).astype(np.float32), 16000


CLIPS = [clip(2.5, 0), clip(1.0, 1), clip(1.7, 2), clip(0.4, 3), clip(2.9, 4)]


def make_audio_dependent_whisper(path: Path | str, weight_std: float = 0.6, **sizes) -> Path:
    """``make_tiny_whisper`` with its matrices redrawn (seeded) at ``weight_std``: at the default
    initialisation (std 0.02) every clip decodes to one repeated token, so a request reading
    another request's encoder output, or none, would go unnoticed; at 0.6 each clip decodes to
    its own sequence (seed and scale picked so; tests/test_whisper_engine.py checks it).
    ``sizes``: ``make_tiny_whisper``'s ``d_model`` and ``heads`` (tensor parallelism needs heads
    the tp size divides)."""
    from transformers import WhisperForConditionalGeneration

    path = make_tiny_whisper(path, **sizes)
    model = WhisperForConditionalGeneration.from_pretrained(path, dtype=torch.float32)
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() >= 2 and "embed_positions" not in name:
                param.normal_(0.0, weight_std, generator=gen)
    model.save_pretrained(path)
    return Path(path)


def transformers_tokens(model_dir: Path, clips=CLIPS, max_new_tokens: int = MAX_TOKENS) -> list[list[int]]:
    """transformers' greedy ``generate`` per clip (its generation config: forced ids, suppress
    lists), without the decoder prompt or a final EOS."""
    from transformers import WhisperFeatureExtractor, WhisperForConditionalGeneration

    model = WhisperForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    fe = WhisperFeatureExtractor.from_pretrained(model_dir)
    out = []
    for samples, rate in clips:
        feats = fe(samples, sampling_rate=rate, return_tensors="pt").input_features
        with torch.no_grad():
            ids = model.generate(feats, max_new_tokens=max_new_tokens, do_sample=False)[0].tolist()
        out.append([t for t in ids if t not in (98, 100, EOS)])  # the decoder prompt, if returned
    return out


def ours(o) -> list[int]:
    """A request output's tokens without the final EOS (transformers drops it)."""
    ids = o.outputs[0].token_ids
    return ids[:-1] if ids and ids[-1] == EOS else ids


def prompts(clips=CLIPS) -> list[dict]:
    return [{"multi_modal_data": {"audio": c}} for c in clips]
