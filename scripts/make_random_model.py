"""Write a decoder checkpoint with random weights (Llama, Qwen3, Qwen3-MoE, Mixtral), or a
Llava-shaped one (``--llava``).

Default shape: the 1.1B Llama of the GPU benchmarks (hidden 2048, 16 layers, 32 heads / 8 KV
heads, intermediate 8192, vocab 32000), bf16: config.json + safetensors weights and a word
tokenizer (below; ``--no-tokenizer`` leaves it out).
``--preset`` picks a published model's shape instead (any option given explicitly overrides it):

- ``qwen3-30b-a3b``: ``Qwen3MoeForCausalLM``, hidden 2048, 48 layers, 32 heads / 4 KV heads of
  128, 128 experts, top-8 (renormalised), expert intermediate 768, vocab 151936 (61 GB in bf16;
  ``--num-layers 24`` halves it);
- ``qwen3-8b``: ``Qwen3ForCausalLM``, hidden 4096, 36 layers, 32 heads / 8 KV heads of 128,
  intermediate 12288, vocab 151936;
- ``mixtral-8x7b``: ``MixtralForCausalLM``, hidden 4096, 32 layers, 32 heads / 8 KV heads,
  8 experts, top-2, intermediate 14336, vocab 32000;
- ``llama-1b``: the default above.

Weights ~ N(0, 0.02), norms 1 (LayerNorm biases 0): speed does not depend on the values, and
the output stays finite.  Decoders are written shard by shard (``--shard-gb``, with a
``model.safetensors.index.json`` past one shard), each shard's tensors drawn on ``--device`` and
freed once written, so host memory stays near one shard whatever the model's size.

The word tokenizer (``tokenizer.json`` + ``tokenizer_config.json``, a fast tokenizer that
``tokenizers``, transformers' ``AutoTokenizer``, pprun and vLLM load without network) has exactly
the model's vocabulary, so every id the model can produce decodes and text prompts work: ids 0-2
are ``<unk>``, ``<s>``, ``</s>`` (the config's ``bos_token_id`` 1 and ``eos_token_id`` 2), every
other id is one distinct made-up word (consonant-vowel syllables: ``ba``, ``be``, ...,
``zu``, then ``baba``, ...).  Text is split at whitespace and each word looked up (a word outside
the vocabulary is ``<unk>``); decoding joins the words with single spaces; encoding adds ``<s>``
in front.  So any ids without the special ones decode to text that encodes back to the same ids:
vLLM's random benchmark dataset (``vllm bench serve --dataset-name random``), which decodes
runs of ids and re-encodes them, gets prompts of exactly ``--random-input-len`` tokens (its
text, ``--random-input-len`` minus the one ``<s>`` the tokenizer adds, plus that ``<s>``).

``--fp8 block`` writes the decoder layers' linear weights in the fine-grained FP8 layout of
Qwen3-FP8 and DeepSeek-V3 (float8 e4m3, a ``weight_scale_inv`` per 128x128 block), ``--fp8
channel`` in compressed-tensors' FP8-dynamic layout (a ``weight_scale`` per row), each with its
``quantization_config``; routers, norms, embeddings and the LM head stay in ``--dtype``.

``--llava`` wraps that language model into a ``LlavaForConditionalGeneration``: a CLIP
ViT-L/14-336 shaped vision tower (hidden 1024, 24 layers, 16 heads, intermediate 4096, patch 14,
image 336; the ``--vision-*`` options change it), a two-layer GELU projector, projector input
from the tower's second-to-last layer (``vision_feature_layer`` -2) without the class token
(``vision_feature_select_strategy`` "default"), so each image is 576 embedding rows.  It is
saved by ``transformers``' own ``save_pretrained``, its tensors then renamed to the published
checkpoints' layout (``language_model.model.*``, ``vision_tower.vision_model.*``: what
``LlavaForConditionalGeneration``, pprun and vLLM all load), with a ``CLIPImageProcessor`` preprocessor config, a ``LlavaProcessor``
config and a tokenizer that has an ``<image>`` token:

- the tokenizer is a byte-level BPE built without training data: ids 0-2 are ``<unk>``,
  ``<s>``, ``</s>``; then the 256 bytes; then byte pairs (printable ASCII pairs first, each with
  its merge) up to ``--vocab``; ``<image>`` is id ``--vocab``, ``<pad>`` the next, and
  ``<extra_N>`` tokens fill the language model's vocabulary up to a multiple of 64 (as
  llava-1.5's 32064), so every id the model can produce decodes;
- prompts take one ``<image>`` per image (pprun and ``LlavaProcessor`` expand it to the 576
  rows), and the chat template renders ``USER: ... ASSISTANT:`` turns.

    python scripts/make_random_model.py /tmp/llama-1b [--device cuda] [--layers 16] ...
    python scripts/make_random_model.py /tmp/qwen3-30b-a3b --preset qwen3-30b-a3b --device cuda [--num-layers 24]
    python scripts/make_random_model.py /tmp/qwen3-8b --preset qwen3-8b --device cuda
    python scripts/make_random_model.py /tmp/llava-1b --llava [--dtype float32]
    # a tiny Llava for CPU tests:
    python scripts/make_random_model.py /tmp/llava-tiny --llava --dtype float32 --hidden 64 --layers 2 \\
        --heads 4 --kv-heads 2 --intermediate 128 --vocab 320 --vision-hidden 32 --vision-layers 2 \\
        --vision-heads 2 --vision-intermediate 64 --image-size 28
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
from collections.abc import Sequence
from pathlib import Path

import torch

SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")
"""Ids 0, 1, 2 of the Llava tokenizer (``unk``, ``bos``, ``eos``), as in Llama's."""

WORD_CONSONANTS = "bdfghjklmnprstvz"
WORD_VOWELS = "aeiou"
"""The word tokenizer's syllables are a consonant and a vowel (80 of them)."""

IMAGE_TOKEN = "<image>"
PAD_TOKEN = "<pad>"

CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ message['role'] | upper }}: {{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)
"""llava-1.5's turn format after ``<s>`` (a rendered chat is not tokenized with special tokens,
so the BOS comes from the template); an image in a turn is the text ``<image>``."""


ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "qwen3-moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
    "mixtral": ("MixtralForCausalLM", "mixtral"),
}
"""``--arch`` -> (``architectures[0]``, ``model_type``)."""

PRESETS: dict[str, dict] = {
    "llama-1b": dict(arch="llama", hidden=2048, layers=16, heads=32, kv_heads=8, intermediate=8192,
                     vocab=32000, max_pos=4096, rope_theta=10000.0, rms_eps=1e-5),
    "qwen3-30b-a3b": dict(arch="qwen3-moe", hidden=2048, layers=48, heads=32, kv_heads=4, head_dim=128,
                          intermediate=6144, experts=128, top_k=8, expert_intermediate=768,
                          vocab=151936, max_pos=40960, rope_theta=1e6, rms_eps=1e-6),
    "qwen3-8b": dict(arch="qwen3", hidden=4096, layers=36, heads=32, kv_heads=8, head_dim=128,
                     intermediate=12288, vocab=151936, max_pos=40960, rope_theta=1e6, rms_eps=1e-6),
    "mixtral-8x7b": dict(arch="mixtral", hidden=4096, layers=32, heads=32, kv_heads=8, intermediate=14336,
                         experts=8, top_k=2, vocab=32000, max_pos=32768, rope_theta=1e6, rms_eps=1e-5),
}
"""Published models' shapes (the module docstring); explicit options override them."""


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="llama-1b",
                    help="a published model's shape (default llama-1b); the options below override it")
    ap.add_argument("--arch", choices=sorted(ARCHITECTURES))
    ap.add_argument("--hidden", type=int)
    ap.add_argument("--layers", "--num-layers", dest="layers", type=int)
    ap.add_argument("--heads", type=int)
    ap.add_argument("--kv-heads", type=int)
    ap.add_argument("--head-dim", type=int, help="per-head width (default hidden / heads)")
    ap.add_argument("--intermediate", type=int, help="MLP width (a Qwen3-MoE's dense layers'; Mixtral's experts')")
    ap.add_argument("--experts", type=int, help="experts per sparse layer (qwen3-moe, mixtral)")
    ap.add_argument("--top-k", type=int, help="experts per token (qwen3-moe, mixtral)")
    ap.add_argument("--expert-intermediate", type=int, help="each expert's width (qwen3-moe)")
    ap.add_argument("--vocab", type=int,
                    help="language model vocabulary (with --llava: the tokenizer's base vocabulary, at least 259)")
    ap.add_argument("--max-pos", type=int)
    ap.add_argument("--rope-theta", type=float)
    ap.add_argument("--rms-eps", type=float)
    ap.add_argument("--tied", action="store_true", help="tie the LM head to the embeddings")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--shard-gb", type=float, default=4.0, help="most GB of tensors per safetensors file")
    ap.add_argument("--no-tokenizer", dest="tokenizer", action="store_false",
                    help="write no tokenizer (token-id prompts only); default: the word tokenizer over the vocabulary")
    ap.add_argument("--fp8", choices=sorted(FP8_CONFIGS),
                    help="write the decoder linears in a published FP8 layout: block (quant_method fp8, "
                         "128x128 weight_scale_inv, as Qwen3-FP8) or channel (compressed-tensors FP8-dynamic)")
    llava = ap.add_argument_group("Llava (--llava)")
    llava.add_argument("--llava", action="store_true", help="a LlavaForConditionalGeneration with a CLIP tower")
    llava.add_argument("--vision-hidden", type=int, default=1024)
    llava.add_argument("--vision-layers", type=int, default=24)
    llava.add_argument("--vision-heads", type=int, default=16)
    llava.add_argument("--vision-intermediate", type=int, default=4096)
    llava.add_argument("--patch-size", type=int, default=14)
    llava.add_argument("--image-size", type=int, default=336)
    llava.add_argument("--vision-feature-layer", type=int, default=-2)
    llava.add_argument("--vision-feature-select-strategy", default="default", choices=("default", "full"))
    args = ap.parse_args(argv)
    preset = dict(PRESETS[args.preset])
    for key in ("arch", "hidden", "layers", "heads", "kv_heads", "head_dim", "intermediate", "experts", "top_k",
                "expert_intermediate", "vocab", "max_pos", "rope_theta", "rms_eps"):
        if getattr(args, key) is None:
            setattr(args, key, preset.get(key))
    moe = args.arch in ("qwen3-moe", "mixtral")
    if moe:
        args.experts = args.experts or 8
        args.top_k = args.top_k or 2
        if args.arch == "qwen3-moe" and args.expert_intermediate is None:
            args.expert_intermediate = args.intermediate
        if not 1 <= args.top_k <= args.experts:
            ap.error(f"--top-k={args.top_k} must be between 1 and --experts={args.experts}")
    for key in ("hidden", "layers", "heads", "kv_heads", "intermediate", "vocab", "max_pos"):
        if getattr(args, key) < 1:
            ap.error(f"--{key.replace('_', '-')}={getattr(args, key)} must be at least 1")
    if args.heads % args.kv_heads:
        ap.error(f"--heads={args.heads} must be a multiple of --kv-heads={args.kv_heads}")
    if args.tokenizer and not args.llava and args.vocab < len(SPECIAL_TOKENS) + 1:
        ap.error(f"--vocab={args.vocab}: the word tokenizer needs at least {len(SPECIAL_TOKENS) + 1} ids "
                 f"({len(SPECIAL_TOKENS)} special tokens and a word); or pass --no-tokenizer")
    if args.llava:
        if not args.tokenizer:
            ap.error("--no-tokenizer: a Llava checkpoint's processor needs its tokenizer")
        if args.arch != "llama":
            ap.error(f"--llava wraps a Llama language model, not --arch={args.arch}")
        if args.vocab < len(SPECIAL_TOKENS) + 256:
            ap.error(f"--vocab={args.vocab}: a Llava tokenizer needs at least {len(SPECIAL_TOKENS) + 256} "
                     "base tokens (3 special tokens and the 256 bytes)")
        if args.image_size % args.patch_size:
            ap.error(f"--image-size={args.image_size} must be a multiple of --patch-size={args.patch_size}")
        if not -args.vision_layers <= args.vision_feature_layer <= args.vision_layers:
            ap.error(f"--vision-feature-layer={args.vision_feature_layer} must index one of the tower's "
                     f"{args.vision_layers + 1} hidden states")
    return args


def random_tensor(name: str, shape: Sequence[int], dtype: torch.dtype, device: str, gen: torch.Generator) -> torch.Tensor:
    """A parameter's random value: norm weights 1 and norm biases 0 (the checkpoint's own
    convention), anything else N(0, 0.02)."""
    if "norm" in name:  # RMSNorm / LayerNorm, CLIP's pre_layrnorm included
        fill = 1.0 if name.endswith("weight") else 0.0
        return torch.full(tuple(shape), fill, dtype=dtype, device=device)
    return torch.randn(tuple(shape), generator=gen, device=device, dtype=torch.float32).mul_(0.02).to(dtype)


def text_config(args: argparse.Namespace, vocab_size: int) -> dict:
    """The language model's config.json (``--arch``'s architecture, in its own field names)."""
    architecture, model_type = ARCHITECTURES[args.arch]
    config = {
        "architectures": [architecture],
        "model_type": model_type,
        "hidden_size": args.hidden,
        "intermediate_size": args.intermediate,
        "num_hidden_layers": args.layers,
        "num_attention_heads": args.heads,
        "num_key_value_heads": args.kv_heads,
        "vocab_size": vocab_size,
        "max_position_embeddings": args.max_pos,
        "rms_norm_eps": args.rms_eps,
        "rope_theta": args.rope_theta,
        "tie_word_embeddings": args.tied,
        "torch_dtype": args.dtype,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "hidden_act": "silu",
    }
    if args.head_dim is not None:
        config["head_dim"] = args.head_dim
    if args.arch in ("qwen3", "qwen3-moe"):
        config["head_dim"] = args.head_dim or args.hidden // args.heads
        config.update(attention_bias=False, use_sliding_window=False, sliding_window=None)
    if args.arch == "qwen3-moe":
        config.update(num_experts=args.experts, num_experts_per_tok=args.top_k,
                      moe_intermediate_size=args.expert_intermediate, norm_topk_prob=True,
                      decoder_sparse_step=1, mlp_only_layers=[])
    if args.arch == "mixtral":
        config.update(num_local_experts=args.experts, num_experts_per_tok=args.top_k, sliding_window=None)
    return config


FP8_CONFIGS = {
    "block": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
    "channel": {
        "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "strategy": "channel"},
            "input_activations": {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": True,
                                  "strategy": "token"}}},
        "ignore": ["lm_head", "re:.*mlp.gate$", "re:.*block_sparse_moe.gate$"], "kv_cache_scheme": None,
    },
}
"""``quantization_config`` of each ``--fp8`` layout, as the tools that publish them write it."""


def write_decoder(args: argparse.Namespace) -> dict:
    """config.json + safetensors shards (and their index past one) of a random decoder, tensors
    named as pprun and transformers expect them, drawn and written one shard at a time."""
    from safetensors.torch import save_file

    from pprun.models.hf_config import expected_tensor_shapes, load_arch_config
    from pprun.models.quantization import quantize, weight_loader

    config = text_config(args, args.vocab)
    if args.fp8:
        config["quantization_config"] = FP8_CONFIGS[args.fp8]
    (args.out / "config.json").write_text(json.dumps(config, indent=2))
    arch = load_arch_config(args.out)
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator(device=args.device).manual_seed(args.seed)
    shapes = expected_tensor_shapes(arch)
    fp8_loader = weight_loader(arch)  # with --fp8: which weights the layout quantizes, and how
    shard_bytes = int(args.shard_gb * 1e9)
    groups: list[list[str]] = [[]]
    size = 0
    for name, shape in shapes.items():
        nbytes = math.prod(shape) * dtype.itemsize
        if groups[-1] and size + nbytes > shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    files = ["model.safetensors"] if len(groups) == 1 else [
        f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    weight_map: dict[str, str] = {}
    for file_name, names in zip(files, groups):
        tensors = {}
        for name in names:
            tensor = random_tensor(name, shapes[name], dtype, args.device, gen)
            scheme = fp8_loader.scheme(name) if fp8_loader is not None else None
            if scheme is not None:
                tensor, scale = quantize(tensor, scheme)
                tensors[name.removesuffix("weight") + scheme.scale_name] = scale.cpu().contiguous()
            tensors[name] = tensor.cpu().contiguous()
        save_file(tensors, str(args.out / file_name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, file_name))
        del tensors
    if len(files) > 1:
        total = sum(math.prod(shape) * dtype.itemsize for shape in shapes.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (args.out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    if args.tokenizer:
        write_word_tokenizer(args.out, args.vocab, args.max_pos)
    return {"path": str(args.out), "architecture": arch.architecture,
            "parameters": sum(math.prod(shape) for shape in shapes.values()), "dtype": args.dtype,
            "files": len(files), "tokenizer": "words" if args.tokenizer else None}


def vocabulary_words(num_words: int) -> list[str]:
    """The word tokenizer's first ``num_words`` words: every one-syllable word, then every
    two-syllable one, and so on (80, 6,400, 512,000, ...), each distinct and free of whitespace."""
    if num_words < 1:
        raise ValueError(f"num_words={num_words} must be at least 1")
    syllables = [c + v for c in WORD_CONSONANTS for v in WORD_VOWELS]
    words: list[str] = []
    for length in itertools.count(1):
        for parts in itertools.product(syllables, repeat=length):
            words.append("".join(parts))
            if len(words) == num_words:
                return words
    raise AssertionError("unreachable")


def word_tokenizer(vocab_size: int):
    """The word tokenizer (module docstring) as a ``tokenizers.Tokenizer`` of ``vocab_size`` ids."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    for word in vocabulary_words(vocab_size - len(SPECIAL_TOKENS)):
        vocab[word] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    # WordPiece's decoder joins tokens with single spaces; cleanup off, since it would rewrite
    # word pairs (" do not" -> " don't") and break the round trip.
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)])
    if tok.get_vocab_size() != vocab_size:
        raise RuntimeError(f"word tokenizer has {tok.get_vocab_size()} ids, expected {vocab_size}")
    return tok


def write_word_tokenizer(out: Path, vocab_size: int, model_max_length: int) -> None:
    """``tokenizer.json`` and ``tokenizer_config.json`` of the word tokenizer in ``out``."""
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(tokenizer_object=word_tokenizer(vocab_size), bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>", model_max_length=model_max_length)
    fast.save_pretrained(out)
    # transformers 5 names its own backend class here, which transformers 4 (another engine's
    # environment) cannot import; PreTrainedTokenizerFast both load.
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.pop("backend", None)
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(config, indent=2) + "\n")


def byte_pair_tokenizer(base_vocab: int, total_vocab: int):
    """A byte-level BPE ``tokenizers.Tokenizer`` of ``total_vocab`` ids (see the module docstring):
    specials, bytes and byte pairs up to ``base_vocab``, then ``<image>``, ``<pad>`` and
    ``<extra_N>`` fillers."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    from tokenizers.pre_tokenizers import ByteLevel

    byte_char = dict(enumerate(_bytes_to_unicode()))
    if sorted(byte_char.values()) != sorted(ByteLevel.alphabet()):
        raise RuntimeError("the byte table differs from tokenizers' ByteLevel alphabet")
    vocab: dict[str, int] = {t: i for i, t in enumerate(SPECIAL_TOKENS)}
    for b in range(256):
        vocab[byte_char[b]] = len(vocab)
    printable = [byte_char[b] for b in range(32, 127)]
    # Printable pairs first, so ordinary text takes about two characters per token.
    pairs = [(a, b) for a in printable for b in printable]
    pairs += [(byte_char[a], byte_char[b]) for a in range(256) for b in range(256)
              if not (32 <= a < 127 and 32 <= b < 127)]
    merges = []
    for a, b in pairs[: base_vocab - len(vocab)]:
        vocab[a + b] = len(vocab)
        merges.append((a, b))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True) for t in SPECIAL_TOKENS])
    extras = [f"<extra_{i}>" for i in range(total_vocab - base_vocab - 2)]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in [IMAGE_TOKEN, PAD_TOKEN, *extras]])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)])
    if tok.get_vocab_size() != total_vocab or tok.token_to_id(IMAGE_TOKEN) != base_vocab:
        raise RuntimeError(f"tokenizer has {tok.get_vocab_size()} ids, <image>={tok.token_to_id(IMAGE_TOKEN)}: "
                           f"expected {total_vocab} and {base_vocab}")
    return tok


def _bytes_to_unicode() -> list[str]:
    """GPT-2's byte -> printable character table (what ``ByteLevel`` uses), in byte order."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = [], 0
    for b in range(256):
        if b in keep:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars


def llava_config(args: argparse.Namespace):
    """The ``LlavaConfig`` of ``--llava`` (see the module docstring)."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig

    image_token_id = args.vocab
    vocab_size = -(-(args.vocab + 2) // 64) * 64
    text = text_config(args, vocab_size)
    for key in ("architectures", "torch_dtype", "model_type"):
        text.pop(key)
    text["pad_token_id"] = image_token_id + 1
    vision = CLIPVisionConfig(
        hidden_size=args.vision_hidden,
        intermediate_size=args.vision_intermediate,
        num_hidden_layers=args.vision_layers,
        num_attention_heads=args.vision_heads,
        patch_size=args.patch_size,
        image_size=args.image_size,
        projection_dim=768,
        hidden_act="quick_gelu",
        layer_norm_eps=1e-5,
    )
    grid = args.image_size // args.patch_size
    config = LlavaConfig(
        text_config=LlamaConfig(**text),
        vision_config=vision,
        image_token_index=image_token_id,
        vision_feature_layer=args.vision_feature_layer,
        vision_feature_select_strategy=args.vision_feature_select_strategy,
        projector_hidden_act="gelu",
        multimodal_projector_bias=True,
        tie_word_embeddings=False,
        image_seq_length=grid * grid + (args.vision_feature_select_strategy == "full"),
    )
    config.architectures = ["LlavaForConditionalGeneration"]
    return config


PUBLISHED_LLAVA_PREFIXES: tuple[tuple[str, str], ...] = (
    ("model.language_model.", "language_model.model."),
    ("lm_head.", "language_model.lm_head."),
    ("model.vision_tower.vision_model.", "vision_tower.vision_model."),
    ("model.vision_tower.", "vision_tower.vision_model."),
    ("vision_tower.vision_model.", "vision_tower.vision_model."),
    ("vision_tower.", "vision_tower.vision_model."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
)
"""transformers 5's Llava tensor names -> the published checkpoints' (llava-hf's), first match."""


def to_published_layout(out: Path) -> None:
    """Rename the saved Llava tensors to the layout published Llava checkpoints use
    (``language_model.model.*``, ``vision_tower.vision_model.*``, ``multi_modal_projector.*``):
    transformers 5 saves its own module names, which transformers and pprun read but other
    engines (vLLM 0.26) do not; the published layout all of them read."""
    from safetensors.torch import load_file, save_file

    def rename(name: str) -> str:
        for old, new in PUBLISHED_LLAVA_PREFIXES:
            if name.startswith(old):
                return new + name[len(old):]
        return name

    for path in sorted(out.glob("*.safetensors")):
        tensors = load_file(str(path))
        save_file({rename(k): v for k, v in tensors.items()}, str(path), metadata={"format": "pt"})
    index = out / "model.safetensors.index.json"
    if index.is_file():
        data = json.loads(index.read_text())
        data["weight_map"] = {rename(k): v for k, v in data["weight_map"].items()}
        index.write_text(json.dumps(data, indent=2) + "\n")


def write_llava(args: argparse.Namespace) -> dict:
    """A random ``LlavaForConditionalGeneration`` with its tokenizer, image processor and processor."""
    from transformers import (
        CLIPImageProcessorPil,
        LlavaForConditionalGeneration,
        LlavaProcessor,
        PreTrainedTokenizerFast,
    )

    config = llava_config(args)
    image_token_id = config.image_token_index
    vocab_size = config.text_config.vocab_size
    dtype = getattr(torch, args.dtype)
    config.dtype = dtype
    with torch.device("meta"):
        model = LlavaForConditionalGeneration(config)
    model = model.to(dtype).to_empty(device=args.device)
    gen = torch.Generator(device=args.device).manual_seed(args.seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(random_tensor(name, param.shape, dtype, args.device, gen))
    model.generation_config.pad_token_id = image_token_id + 1
    model.save_pretrained(args.out)
    num_params = sum(p.numel() for p in model.parameters())
    del model
    to_published_layout(args.out)

    fast = PreTrainedTokenizerFast(
        tokenizer_object=byte_pair_tokenizer(args.vocab, vocab_size),
        bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token=PAD_TOKEN,
        extra_special_tokens={"image_token": IMAGE_TOKEN},
        chat_template=CHAT_TEMPLATE,
    )
    image_processor = CLIPImageProcessorPil(
        size={"shortest_edge": args.image_size},
        crop_size={"height": args.image_size, "width": args.image_size},
        image_mean=CLIP_MEAN, image_std=CLIP_STD, resample=3,
    )
    processor = LlavaProcessor(
        image_processor=image_processor, tokenizer=fast, patch_size=args.patch_size,
        vision_feature_select_strategy=args.vision_feature_select_strategy, image_token=IMAGE_TOKEN,
        num_additional_image_tokens=1, chat_template=CHAT_TEMPLATE,
    )
    processor.save_pretrained(args.out)
    fast.save_pretrained(args.out)
    # Published Llava checkpoints name the class without the backend suffix; transformers picks
    # the PIL or torchvision backend from it, and pprun its PIL class.
    pre = args.out / "preprocessor_config.json"
    pre_cfg = json.loads(pre.read_text()) if pre.is_file() else image_processor.to_dict()
    pre_cfg["image_processor_type"] = "CLIPImageProcessor"
    pre.write_text(json.dumps(pre_cfg, indent=2) + "\n")
    return {
        "path": str(args.out), "parameters": num_params, "dtype": args.dtype,
        "image_token_id": image_token_id, "vocab_size": vocab_size, "image_embeds": config.image_seq_length,
    }


def main(argv: Sequence[str] | None = None) -> dict:
    """Write the checkpoint; print and return ``{path, parameters, dtype, ...}``."""
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    info = write_llava(args) if args.llava else write_decoder(args)
    print(json.dumps(info))
    return info


if __name__ == "__main__":
    main()
