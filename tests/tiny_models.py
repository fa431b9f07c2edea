"""Tiny random Hugging Face checkpoints for tests (seeded, float32, a few hundred KB each).

Import from a test as ``from tiny_models import make_tiny_llama`` (pytest puts ``tests/`` on
``sys.path``). Every helper writes ``config.json``, ``generation_config.json`` and
``model.safetensors`` under ``path`` with ``transformers``' own ``save_pretrained`` (so the files
are exactly what real checkpoints look like) and returns ``path``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


def _save(model_cls: type, config: Any, path: Path, seed: int) -> Path:
    """Build ``model_cls(config)`` with seeded float32 weights and save it to ``path``."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    # Fork the RNG so building a tiny model leaves the caller's torch seed untouched.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config).to(torch.float32).eval()
        # HF initialises norms to ones; random norms make parity tests sensitive to norm bugs.
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("norm.weight"):
                    param.uniform_(0.5, 1.5)
    model.save_pretrained(path)
    return path


def make_tiny_llama(
    path: Path | str,
    tied: bool = False,
    rope_scaling: dict[str, Any] | None = None,
    num_layers: int = 4,
    *,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    vocab_size: int = 256,
    max_position_embeddings: int = 2048,
    attention_bias: bool = False,
    seed: int = 0,
    **config_kwargs: Any,
) -> Path:
    """A random ``LlamaForCausalLM`` checkpoint in ``path`` (tied embeddings / RoPE scaling optional)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        vocab_size=vocab_size,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tied,
        rope_scaling=rope_scaling,
        attention_bias=attention_bias,
        bos_token_id=1,
        eos_token_id=2,
        **config_kwargs,
    )
    return _save(LlamaForCausalLM, config, Path(path), seed)


def make_tiny_qwen2(
    path: Path | str,
    tied: bool = False,
    num_layers: int = 4,
    *,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    vocab_size: int = 256,
    max_position_embeddings: int = 2048,
    seed: int = 0,
    **config_kwargs: Any,
) -> Path:
    """A random ``Qwen2ForCausalLM`` checkpoint in ``path`` (q/k/v projections carry biases)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        vocab_size=vocab_size,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tied,
        bos_token_id=1,
        eos_token_id=2,
        **config_kwargs,
    )
    return _save(Qwen2ForCausalLM, config, Path(path), seed)


def make_tiny_mistral(
    path: Path | str,
    num_layers: int = 4,
    *,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    vocab_size: int = 256,
    max_position_embeddings: int = 2048,
    sliding_window: int | None = None,
    seed: int = 0,
    **config_kwargs: Any,
) -> Path:
    """A random ``MistralForCausalLM`` checkpoint in ``path`` (no sliding window unless given)."""
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        vocab_size=vocab_size,
        max_position_embeddings=max_position_embeddings,
        sliding_window=sliding_window,
        bos_token_id=1,
        eos_token_id=2,
        **config_kwargs,
    )
    return _save(MistralForCausalLM, config, Path(path), seed)


def make_tiny_whisper(path: Path | str, *, decoder_layers: int = 3, seed: int = 0) -> Path:
    """A tiny random Whisper of odd sizes (36 wide, 3 heads of 12, 7 mel bins, 15 encoder
    positions, 101 tokens), with a generation config like tiny.en's."""
    import json

    from transformers import WhisperConfig, WhisperFeatureExtractor, WhisperForConditionalGeneration

    config = WhisperConfig(
        vocab_size=101, num_mel_bins=7, d_model=36, encoder_layers=2, decoder_layers=decoder_layers,
        encoder_attention_heads=3, decoder_attention_heads=3, encoder_ffn_dim=44, decoder_ffn_dim=52,
        max_source_positions=15, max_target_positions=40, bos_token_id=98, eos_token_id=97,
        pad_token_id=97, decoder_start_token_id=98, begin_suppress_tokens=None, suppress_tokens=None,
    )
    config.architectures = ["WhisperForConditionalGeneration"]
    path = _save(WhisperForConditionalGeneration, config, path, seed)
    generation = {
        "decoder_start_token_id": 98, "bos_token_id": 98, "eos_token_id": 97, "pad_token_id": 97,
        "forced_decoder_ids": [[1, 100]], "no_timestamps_token_id": 100, "return_timestamps": False,
        "is_multilingual": False, "suppress_tokens": [3, 5, 99], "begin_suppress_tokens": [4, 97],
        "max_length": 40,
    }
    (Path(path) / "generation_config.json").write_text(json.dumps(generation, indent=2))
    # 3 s windows of 30 frames (hop 1600 samples): what 15 encoder positions take.
    WhisperFeatureExtractor(feature_size=7, chunk_length=3, hop_length=1600, n_fft=400).save_pretrained(path)
    return path
