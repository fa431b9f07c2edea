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


def _save(model_cls: type, config: Any, path: Path, seed: int, adjust: Any = None) -> Path:
    """Build ``model_cls(config)`` with seeded float32 weights (then ``adjust(model)``, if given,
    still under the seed) and save it to ``path``."""
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
        if adjust is not None:
            adjust(model)
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


def make_tiny_qwen3(
    path: Path | str,
    tied: bool = False,
    num_layers: int = 4,
    *,
    hidden_size: int = 48,
    intermediate_size: int = 80,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    head_dim: int = 20,
    vocab_size: int = 256,
    max_position_embeddings: int = 2048,
    seed: int = 0,
    **config_kwargs: Any,
) -> Path:
    """A random ``Qwen3ForCausalLM`` checkpoint in ``path``: per-head q/k norms, and ``head_dim``
    (20) other than ``hidden_size / num_attention_heads`` (12) unless given."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        head_dim=head_dim,
        vocab_size=vocab_size,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tied,
        bos_token_id=1,
        eos_token_id=2,
        **config_kwargs,
    )
    return _save(Qwen3ForCausalLM, config, Path(path), seed)


ROUTER_STD = 0.5
"""Router weights of the tiny mixture-of-experts models: wider than transformers' 0.02, so that
each token's top-k experts are chosen by clear margins (no near-ties that rounding could flip)
and different tokens choose different experts."""


def _spread_routers(model: Any) -> None:
    """Redraw every router (``*.gate.weight`` of a sparse block) with :data:`ROUTER_STD`."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("mlp.gate.weight") or name.endswith("block_sparse_moe.gate.weight"):
                param.normal_(0.0, ROUTER_STD)


def make_tiny_qwen3_moe(
    path: Path | str,
    num_layers: int = 4,
    *,
    hidden_size: int = 48,
    intermediate_size: int = 72,
    moe_intermediate_size: int = 40,
    num_experts: int = 5,
    num_experts_per_tok: int = 2,
    norm_topk_prob: bool = True,
    mlp_only_layers: tuple[int, ...] = (1,),
    decoder_sparse_step: int = 1,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    head_dim: int = 20,
    vocab_size: int = 256,
    tied: bool = False,
    seed: int = 0,
    **config_kwargs: Any,
) -> Path:
    """A random ``Qwen3MoeForCausalLM`` of odd sizes: 5 experts (not a power of two), top-2,
    layer 1 dense (``mlp_only_layers``), ``head_dim`` 20 of a 48-wide model with 4 heads."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        moe_intermediate_size=moe_intermediate_size,
        num_experts=num_experts,
        num_experts_per_tok=num_experts_per_tok,
        norm_topk_prob=norm_topk_prob,
        mlp_only_layers=list(mlp_only_layers),
        decoder_sparse_step=decoder_sparse_step,
        num_hidden_layers=num_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        head_dim=head_dim,
        vocab_size=vocab_size,
        max_position_embeddings=2048,
        tie_word_embeddings=tied,
        bos_token_id=1,
        eos_token_id=2,
        **config_kwargs,
    )
    return _save(Qwen3MoeForCausalLM, config, Path(path), seed, _spread_routers)


def make_tiny_mixtral(
    path: Path | str,
    num_layers: int = 4,
    *,
    hidden_size: int = 48,
    intermediate_size: int = 56,
    num_local_experts: int = 6,
    num_experts_per_tok: int = 3,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    vocab_size: int = 256,
    seed: int = 0,
    **config_kwargs: Any,
) -> Path:
    """A random ``MixtralForCausalLM``: 6 experts (not a power of two), top-3, every layer sparse."""
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_local_experts=num_local_experts,
        num_experts_per_tok=num_experts_per_tok,
        num_hidden_layers=num_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        vocab_size=vocab_size,
        max_position_embeddings=2048,
        bos_token_id=1,
        eos_token_id=2,
        **config_kwargs,
    )
    return _save(MixtralForCausalLM, config, Path(path), seed, _spread_routers)


def make_tiny_whisper(path: Path | str, *, decoder_layers: int = 3, seed: int = 0, d_model: int = 36,
                      heads: int = 3) -> Path:
    """A tiny random Whisper of odd sizes (36 wide, 3 heads of 12, 7 mel bins, 15 encoder
    positions, 101 tokens), with a generation config like tiny.en's; ``d_model`` and ``heads``
    (encoder and decoder alike) may be set, e.g. for tensor parallelism."""
    import json

    from transformers import WhisperConfig, WhisperFeatureExtractor, WhisperForConditionalGeneration

    config = WhisperConfig(
        vocab_size=101, num_mel_bins=7, d_model=d_model, encoder_layers=2, decoder_layers=decoder_layers,
        encoder_attention_heads=heads, decoder_attention_heads=heads, encoder_ffn_dim=44, decoder_ffn_dim=52,
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


TINY_WORDS = (
    "USER ASSISTANT : ? . , ! \n what is this a the image picture of and in on describe two three "
    "same cat dog red green blue left right top small big one color shape compare them it show see"
).split(" ")
"""The words of the tiny tokenizer (anything else is ``<unk>``)."""

TINY_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] | upper }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)
"""A chat template over plain string contents: ``<s>``, ``USER: ...`` lines, then ``ASSISTANT:``
(the BOS comes from the template, as in Llama's: rendered ids are not tokenized with special tokens)."""


def make_tiny_tokenizer(path: Path | str, extra_special: tuple[str, ...] = ("<image>",)):
    """A word-level fast tokenizer of :data:`TINY_WORDS` (ids 0-3 are ``<unk> <s> </s> <pad>``,
    then ``extra_special`` tokens, then the words), adding ``<s>`` in front like Llama's, with
    :data:`TINY_CHAT_TEMPLATE`; saved in ``path`` and returned."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>", "<pad>", *extra_special]
    vocab = {tok: i for i, tok in enumerate(specials + [w for w in TINY_WORDS if w != "\n"] + ["\n"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    # Newlines are tokens (chat templates end lines with them); other whitespace separates words.
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex("\n"), behavior="isolated"),
        pre_tokenizers.Split(Regex(r"[ \t]+"), behavior="removed"),
        pre_tokenizers.Split(Regex(r"[:?.,!]"), behavior="isolated"),
    ])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)])
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<pad>",
        additional_special_tokens=list(extra_special),
    )
    fast.chat_template = TINY_CHAT_TEMPLATE
    fast.save_pretrained(str(path))
    return fast


def make_tiny_llava(
    path: Path | str,
    tower: str = "clip",
    *,
    num_layers: int = 4,
    vision_feature_layer: int | list[int] | None = None,
    vision_feature_select_strategy: str | None = None,
    tied: bool = False,
    seed: int = 0,
    text_heads: int = 3,
) -> Path:
    """A random ``LlavaForConditionalGeneration`` of odd sizes with its processor (tokenizer with
    ``<image>`` = id 4 and a chat template, image processor config) in ``path``.

    ``tower="clip"``: a CLIP tower 40 wide (5 heads of 8), 3 blocks, 30-pixel images in 6-pixel
    patches (25 patches + the class token; ``default`` strategy drops it: 25 image rows).
    ``tower="siglip"``: a SigLIP tower 36 wide (3 heads of 12), 3 blocks, 28-pixel images in
    4-pixel patches (49 rows, ``full`` strategy), the projector reading the last and the first
    block's outputs concatenated (``vision_feature_layer=[-1, -3]``).  The language model is a Llama 48 wide (3 heads
    of 16, 1 KV head; ``text_heads`` heads of ``48 / text_heads``) with ``num_layers`` layers and a
    53-token vocabulary.
    """
    from transformers import (
        CLIPImageProcessorPil,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
        SiglipImageProcessorPil,
        SiglipVisionConfig,
    )

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = make_tiny_tokenizer(path)
    image_token = tokenizer.convert_tokens_to_ids("<image>")
    text = LlamaConfig(
        hidden_size=48, intermediate_size=72, num_hidden_layers=num_layers, num_attention_heads=text_heads,
        num_key_value_heads=1, vocab_size=53, max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
        pad_token_id=3, tie_word_embeddings=tied,
    )
    if tower == "clip":
        vision = CLIPVisionConfig(
            hidden_size=40, intermediate_size=56, num_hidden_layers=3, num_attention_heads=5, image_size=30,
            patch_size=6, projection_dim=40,
        )
        image_processor = CLIPImageProcessorPil(
            size={"shortest_edge": 30}, crop_size={"height": 30, "width": 30},
        )
        strategy, extra_tokens = vision_feature_select_strategy or "default", 1
        feature_layer = -2 if vision_feature_layer is None else vision_feature_layer
    elif tower == "siglip":
        vision = SiglipVisionConfig(
            hidden_size=36, intermediate_size=44, num_hidden_layers=3, num_attention_heads=3, image_size=28,
            patch_size=4,
        )
        image_processor = SiglipImageProcessorPil(size={"height": 28, "width": 28})
        strategy, extra_tokens = vision_feature_select_strategy or "full", 0
        feature_layer = [-1, -3] if vision_feature_layer is None else vision_feature_layer
    else:
        raise ValueError(f"tower={tower!r}: must be 'clip' or 'siglip'")
    config = LlavaConfig(
        vision_config=vision, text_config=text, image_token_index=image_token,
        vision_feature_layer=feature_layer, vision_feature_select_strategy=strategy,
        projector_hidden_act="gelu", tie_word_embeddings=tied,
    )
    config.architectures = ["LlavaForConditionalGeneration"]
    _save(LlavaForConditionalGeneration, config, path, seed)
    processor = LlavaProcessor(
        image_processor=image_processor, tokenizer=tokenizer, patch_size=vision.patch_size,
        vision_feature_select_strategy=strategy, num_additional_image_tokens=extra_tokens,
        chat_template=TINY_CHAT_TEMPLATE,
    )
    processor.save_pretrained(str(path))
    if tower == "clip":
        # Also the older layout (llava-1.5's): the image processor in preprocessor_config.json.
        image_processor.save_pretrained(str(path))
    return path
