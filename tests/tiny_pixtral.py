"""A tiny random Pixtral-form ``LlavaForConditionalGeneration`` checkpoint for tests, and
transformers' own ``PixtralProcessor`` as the reference for what its prompts and pixels become.

Import from a test as ``from tiny_pixtral import make_tiny_pixtral`` (pytest puts ``tests/`` on
``sys.path``).
"""

from __future__ import annotations

import importlib
import sys
import types
from pathlib import Path

import torch

IMAGE_TOKENS = ("[IMG]", "[IMG_BREAK]", "[IMG_END]")
"""The tokenizer's image tokens (ids 4, 5, 6)."""

WORDS = "USER ASSISTANT : ? . , what is this a the image of and compare them describe left right".split()
"""The tokenizer's words (ids from 7 on; anything else is ``<unk>``)."""

PATCH_SIZE = 5
"""The tower's patch size (pixels a side)."""

LONGEST_EDGE = 40
"""The image processor resizes an image whose longest edge is longer to this (aspect kept)."""


def make_tiny_pixtral(path: Path | str, *, num_layers: int = 4, tied: bool = False, seed: int = 0) -> Path:
    """A random Pixtral-form Llava of odd sizes with its processor in ``path``.

    The tower: 36 wide (3 heads of 12), 3 blocks, gated SiLU MLP 52 wide, 5-pixel patches; the
    projector reads its last block (``vision_feature_layer=-1``, ``full``), as Pixtral-12B's
    does.  The language model: a Mistral 40 wide (4 heads of 10, 2 KV heads), ``num_layers``
    layers, 61-token vocabulary.  Images keep their aspect, the longest edge at most 40 pixels,
    each side rounded up to whole patches: a 23x37 image becomes 5x8 patches (45 placeholder
    tokens with the breaks), a 60x18 one 8x3 patches (32 tokens).  Weights are drawn with std 0.2
    (transformers' default is 0.02) so that an image's content moves the greedy tokens.
    """
    from transformers import (
        LlavaConfig,
        LlavaForConditionalGeneration,
        MistralConfig,
        PixtralImageProcessorPil,
        PixtralVisionConfig,
    )

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = make_pixtral_tokenizer(path)
    text = MistralConfig(
        hidden_size=40, intermediate_size=68, num_hidden_layers=num_layers, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=61, max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
        pad_token_id=3, tie_word_embeddings=tied, sliding_window=None, initializer_range=0.2,
    )
    vision = PixtralVisionConfig(
        hidden_size=36, intermediate_size=52, num_hidden_layers=3, num_attention_heads=3,
        patch_size=PATCH_SIZE, image_size=LONGEST_EDGE, hidden_act="silu", initializer_range=0.2,
        rope_parameters={"rope_type": "axial", "rope_theta": 10000.0},
    )
    config = LlavaConfig(
        vision_config=vision, text_config=text, image_token_index=tokenizer.convert_tokens_to_ids("[IMG]"),
        vision_feature_layer=-1, vision_feature_select_strategy="full", projector_hidden_act="gelu",
        tie_word_embeddings=tied,
    )
    config.architectures = ["LlavaForConditionalGeneration"]
    # Forked RNG: building the model leaves the caller's torch seed untouched.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlavaForConditionalGeneration(config).to(torch.float32).eval()
        with torch.no_grad():  # random norms (ln_pre too): parity then catches a misplaced norm
            for name, param in model.named_parameters():
                if name.endswith(("norm.weight", "ln_pre.weight")):
                    param.uniform_(0.5, 1.5)
    model.save_pretrained(path)
    image_processor = PixtralImageProcessorPil(
        size={"longest_edge": LONGEST_EDGE}, patch_size={"height": PATCH_SIZE, "width": PATCH_SIZE},
    )
    processor = pixtral_processor_class()(image_processor=image_processor, tokenizer=tokenizer, patch_size=PATCH_SIZE)
    processor.save_pretrained(str(path))
    # Also the layout of published Pixtral checkpoints: the image processor in its own file.
    image_processor.save_pretrained(str(path))
    return path


def make_pixtral_tokenizer(path: Path | str):
    """A word-level fast tokenizer (``<unk> <s> </s> <pad>``, :data:`IMAGE_TOKENS` as special
    tokens, :data:`WORDS`) that puts ``<s>`` in front like Mistral's; saved in ``path``."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(["<unk>", "<s>", "</s>", "<pad>", *IMAGE_TOKENS, *WORDS])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Split(Regex(r"[:?.,]"), behavior="isolated"),
    ])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<pad>",
        additional_special_tokens=list(IMAGE_TOKENS),
    )
    fast.save_pretrained(str(path))
    return fast


def pixtral_processor_class() -> type:
    """transformers' ``PixtralProcessor`` class.

    Its module imports one helper from the torchvision-backed image processor; without
    torchvision (pprun does not depend on it) the PIL image processor's identical helper stands
    in, so the class itself (placeholder expansion, tokenising) is transformers' own code."""
    name = "transformers.models.pixtral.image_processing_pixtral"
    try:
        importlib.import_module(name)
    except ImportError:
        pil = importlib.import_module("transformers.models.pixtral.image_processing_pil_pixtral")
        stand_in = types.ModuleType(name)
        stand_in.get_resize_output_image_size = pil.get_resize_output_image_size
        sys.modules[name] = stand_in
    return importlib.import_module("transformers.models.pixtral.processing_pixtral").PixtralProcessor


def load_pixtral_processor(path: Path | str):
    """The checkpoint's ``PixtralProcessor`` with the PIL image processor, the one pprun runs
    (where torchvision is installed, transformers would pick its torchvision processor, whose
    bicubic resize gives other pixels)."""
    import json

    from transformers import AutoTokenizer, PixtralImageProcessorPil

    config = json.loads((Path(path) / "processor_config.json").read_text())
    return pixtral_processor_class()(
        image_processor=PixtralImageProcessorPil.from_pretrained(str(path)),
        tokenizer=AutoTokenizer.from_pretrained(str(path)),
        patch_size=config["patch_size"], spatial_merge_size=config.get("spatial_merge_size", 1),
    )
