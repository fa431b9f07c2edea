"""Read a Hugging Face ``config.json`` into one normalised, frozen architecture description.

Both layouts of ``config.json`` are understood: the older one (``rope_theta`` at top level and a
``rope_scaling`` dict keyed by ``type`` or ``rope_type``) and the transformers-5 one (a single
``rope_parameters`` dict holding ``rope_type``, ``rope_theta`` and the scaling parameters).
Nothing here imports torch, so the engine and validation can read a model's shape cheaply.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from pprun.models.quantization_config import QuantizationArch, read_quantization_config

SUPPORTED_ARCHITECTURES: tuple[str, ...] = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "MixtralForCausalLM",
    "WhisperForConditionalGeneration",
    "LlavaForConditionalGeneration",
)
"""Architectures (``config.json``'s ``architectures[0]``) pprun can run."""

SUPPORTED_VISION_TOWERS: tuple[str, ...] = ("clip_vision_model", "siglip_vision_model", "pixtral")
"""``vision_config.model_type`` values a Llava-form model may use."""

SUPPORTED_ROPE_TYPES: tuple[str, ...] = ("default", "linear", "llama3")
"""RoPE variants the rotary embedding implements."""

# Parameters each scaled RoPE type needs; all are required (a missing one is a broken config).
_ROPE_TYPE_PARAMS: dict[str, tuple[str, ...]] = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}

# Older or hand-written configs sometimes omit ``architectures``; model_type names it as well.
_MODEL_TYPE_TO_ARCHITECTURE: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "whisper": "WhisperForConditionalGeneration",
}

_DEFAULT_ROPE_THETA = 10000.0


@dataclass(frozen=True)
class ModelArchConfig:
    """A decoder-only model's architecture, normalised from ``config.json`` (+ ``generation_config.json``)."""

    architecture: str
    """``config.json``'s ``architectures[0]`` (or derived from ``model_type``), e.g. ``LlamaForCausalLM``."""
    model_type: str
    """``config.json``'s ``model_type`` (``llama``, ``mistral``, ``qwen2``, ``qwen3``, ``qwen3_moe``, ``mixtral``)."""
    vocab_size: int
    """Rows of the embedding table and of the LM head."""
    hidden_size: int
    """Width of the residual stream."""
    intermediate_size: int
    """Width of the MLP's gate/up projections (a mixture-of-experts model's dense layers'; its experts': ``moe``)."""
    num_hidden_layers: int
    """Number of decoder layers (what pipeline stages split)."""
    num_attention_heads: int
    """Query heads per layer."""
    num_key_value_heads: int
    """Key/value heads per layer (grouped-query attention); equals the query heads when not set."""
    head_dim: int
    """Per-head width: ``config.json``'s ``head_dim`` or ``hidden_size // num_attention_heads``."""
    rms_norm_eps: float
    """Epsilon of every RMSNorm."""
    rope_theta: float
    """RoPE base frequency."""
    rope_scaling: dict[str, Any] | None
    """None for plain RoPE; else ``{"rope_type": "linear"|"llama3", <that type's parameters>}``."""
    max_position_embeddings: int
    """Longest context the model was built for."""
    tie_word_embeddings: bool
    """The LM head reuses the embedding matrix (no ``lm_head.weight`` in the checkpoint)."""
    attention_bias: bool
    """q/k/v projections carry a bias (always for Qwen2; ``attention_bias`` for Llama)."""
    o_proj_bias: bool
    """The output projection carries a bias (Llama's ``attention_bias``; never for Qwen2/Mistral)."""
    mlp_bias: bool
    """gate/up/down projections carry a bias (Llama's ``mlp_bias``; False otherwise)."""
    torch_dtype: str | None
    """The dtype the checkpoint was saved in (``dtype``/``torch_dtype`` key), e.g. ``bfloat16``."""
    bos_token_id: int | None
    """Beginning-of-sequence token id, if the model has one."""
    eos_token_ids: tuple[int, ...]
    """Every end-of-sequence id from ``config.json`` and ``generation_config.json``, deduplicated."""
    sliding_window: int | None
    """Sliding attention window if any layer uses one, else None (validation compares it to max_model_len)."""
    audio_encoder: AudioEncoderArch | None = None
    """An encoder-decoder speech model's encoder (Whisper); None for decoder-only models.  The
    fields above then describe the decoder, which is what pipeline stages split."""
    qk_norm: bool = False
    """Each attention head's q and k go through an RMSNorm over ``head_dim`` before RoPE
    (``self_attn.q_norm`` / ``k_norm``: Qwen3, Qwen3-MoE)."""
    moe: MoeArch | None = None
    """Mixture-of-experts decoders (Qwen3-MoE, Mixtral): the experts and which layers have them;
    None for dense models."""
    multimodal: dict[str, Any] | None = None
    """Vision-language models (``LlavaForConditionalGeneration``): the fields above describe the
    language model (``text_config``); this holds the rest, normalised by ``transformers``'
    ``LlavaConfig``: ``image_token_index``, ``vision_feature_layer``,
    ``vision_feature_select_strategy``, ``projector_hidden_act``, ``multimodal_projector_bias``,
    ``vision_config`` (the full dict) and ``text_architecture``.  None for text-only models."""
    num_mtp_layers: int = 0
    """Multi-token-prediction layers the checkpoint stores past ``num_hidden_layers``
    (``num_nextn_predict_layers``), which pprun does not run; 0 for the supported families."""
    quantization: QuantizationArch | None = None
    """The checkpoint's quantization method (``quantization_config``, read and checked by
    :func:`pprun.models.quantization_config.read_quantization_config`); None: floating-point
    weights."""


@dataclass(frozen=True)
class MoeArch:
    """The sparse MLP of a mixture-of-experts decoder: a router picks ``top_k`` of ``num_experts``
    SwiGLU experts per token and sums their outputs weighted by the router's probabilities."""

    num_experts: int
    """Experts per sparse layer (Qwen3-MoE's ``num_experts``, Mixtral's ``num_local_experts``)."""
    top_k: int
    """Experts each token is routed to (``num_experts_per_tok``)."""
    expert_intermediate_size: int
    """Width of each expert's gate/up projections (Qwen3-MoE's ``moe_intermediate_size``,
    Mixtral's ``intermediate_size``)."""
    norm_topk_prob: bool
    """The top-k probabilities are renormalised to sum to one (always for Mixtral)."""
    dense_layers: tuple[int, ...]
    """Layers with a dense MLP of ``intermediate_size`` instead (Qwen3-MoE's ``mlp_only_layers``
    and the layers ``decoder_sparse_step`` skips); empty for Mixtral."""
    checkpoint_prefix: str
    """The sparse block's name in a layer's tensor names: ``mlp`` (Qwen3-MoE) or
    ``block_sparse_moe`` (Mixtral)."""
    expert_names: tuple[str, str, str]
    """An expert's gate, up and down projections as the checkpoint names them:
    ``gate_proj, up_proj, down_proj`` (Qwen3-MoE) or ``w1, w3, w2`` (Mixtral)."""

    def is_sparse(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` (global index) has the experts."""
        return layer not in self.dense_layers


@dataclass(frozen=True)
class AudioEncoderArch:
    """The audio encoder of a Whisper-style encoder-decoder (``config.json``'s encoder fields)."""

    num_mel_bins: int
    """Log-mel channels of the input features."""
    num_layers: int
    """Encoder layers (all on the first stage)."""
    num_attention_heads: int
    """Encoder attention heads."""
    ffn_dim: int
    """Encoder feed-forward width."""
    max_source_positions: int
    """Encoder output length (frames after the stride-2 convolution): what cross-attention reads."""


def _as_int_tuple(value: Any) -> tuple[int, ...]:
    """An eos field (None, int or list of ints) as a tuple of ints."""
    if value is None:
        return ()
    if isinstance(value, (list, tuple)):
        return tuple(int(v) for v in value)
    return (int(value),)


def _normalise_rope(config: dict[str, Any], source: Path) -> tuple[float, dict[str, Any] | None]:
    """Return ``(rope_theta, rope_scaling)`` from either config layout; unsupported types raise ValueError."""
    rope_parameters = config.get("rope_parameters")
    if isinstance(rope_parameters, dict) and rope_parameters:
        if all(isinstance(v, dict) for v in rope_parameters.values()):
            # transformers 5 keys per-layer-type parameters this way (Gemma-style); none of the
            # supported architectures mixes RoPE kinds across layers.
            raise ValueError(
                f"{source}: per-layer-type rope_parameters ({sorted(rope_parameters)}) are not supported"
            )
        rope_theta = float(rope_parameters.get("rope_theta", config.get("rope_theta", _DEFAULT_ROPE_THETA)))
        scaling: dict[str, Any] | None = dict(rope_parameters)
    else:
        rope_theta = float(config.get("rope_theta") or _DEFAULT_ROPE_THETA)
        scaling = dict(config["rope_scaling"]) if config.get("rope_scaling") else None

    if scaling is None:
        return rope_theta, None
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"{source}: rope_type={rope_type!r} is not supported; supported rope types: "
            f"{', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type == "default":
        return rope_theta, None
    normalised: dict[str, Any] = {"rope_type": rope_type}
    for name in _ROPE_TYPE_PARAMS[rope_type]:
        if scaling.get(name) is None:
            raise ValueError(f"{source}: rope_type={rope_type!r} needs {name!r}, which the config lacks")
        value = scaling[name]
        normalised[name] = int(value) if name == "original_max_position_embeddings" else float(value)
    return rope_theta, normalised


def _architecture(config: dict[str, Any], source: Path) -> str:
    """The architecture name, checked against :data:`SUPPORTED_ARCHITECTURES`."""
    architectures = config.get("architectures") or []
    if architectures:
        architecture = architectures[0]
    else:
        architecture = _MODEL_TYPE_TO_ARCHITECTURE.get(config.get("model_type", ""), "")
    if architecture not in SUPPORTED_ARCHITECTURES:
        shown = architecture or f"(none; model_type={config.get('model_type')!r})"
        raise ValueError(
            f"{source}: architecture {shown} is not supported; supported architectures: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return architecture


def _sliding_window(config: dict[str, Any], architecture: str) -> int | None:
    """The window of the model's sliding-attention layers, or None when every layer attends fully."""
    window = config.get("sliding_window")
    if window is None:
        return None
    if architecture in ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM"):
        # Qwen2 and Qwen3 ship a sliding_window value even when it is switched off; it only applies to layers
        # marked sliding (transformers 5's layer_types, or use_sliding_window + max_window_layers).
        layer_types = config.get("layer_types")
        if layer_types is not None:
            return int(window) if "sliding_attention" in layer_types else None
        max_window_layers = config.get("max_window_layers", 0)
        if config.get("use_sliding_window") and max_window_layers < config["num_hidden_layers"]:
            return int(window)
        return None
    if architecture in ("MistralForCausalLM", "MixtralForCausalLM"):
        return int(window)
    return None


def _whisper_as_decoder(config: dict[str, Any], source: Path) -> dict[str, Any]:
    """A Whisper config.json in the decoder-only field names, plus ``audio_encoder``."""
    required = (
        "vocab_size", "d_model", "decoder_layers", "decoder_attention_heads", "decoder_ffn_dim",
        "encoder_layers", "encoder_attention_heads", "encoder_ffn_dim", "num_mel_bins",
        "max_source_positions", "max_target_positions",
    )
    missing = [key for key in required if config.get(key) is None]
    if missing:
        raise ValueError(f"{source}: required Whisper field(s) {', '.join(missing)} missing")
    return {
        **config,
        "hidden_size": config["d_model"],
        "intermediate_size": config["decoder_ffn_dim"],
        "num_hidden_layers": config["decoder_layers"],
        "num_attention_heads": config["decoder_attention_heads"],
        "num_key_value_heads": config["decoder_attention_heads"],
        "head_dim": config["d_model"] // config["decoder_attention_heads"],
        "max_position_embeddings": config["max_target_positions"],
        # Every Whisper checkpoint ties the output projection to the decoder embeddings.
        "tie_word_embeddings": config.get("tie_word_embeddings", True),
        "rope_parameters": None,
        "rope_scaling": None,
        "_audio_encoder": AudioEncoderArch(
            num_mel_bins=int(config["num_mel_bins"]),
            num_layers=int(config["encoder_layers"]),
            num_attention_heads=int(config["encoder_attention_heads"]),
            ffn_dim=int(config["encoder_ffn_dim"]),
            max_source_positions=int(config["max_source_positions"]),
        ),
    }


def load_arch_config(model_dir: Path) -> ModelArchConfig:
    """Read ``model_dir/config.json`` (and ``generation_config.json`` if present) into a ModelArchConfig.

    Raises ValueError when the file is missing, the architecture or RoPE type is unsupported, or a
    required field is absent.
    """
    model_dir = Path(model_dir)
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise ValueError(
            f"model.model={str(model_dir)!r} has no config.json (expected a Hugging Face model directory)"
        )
    config = json.loads(config_path.read_text())
    architecture = _architecture(config, config_path)
    # Before anything else: a quantized checkpoint pprun does not run is refused by name.
    quantization = read_quantization_config(config, model_dir, config_path, architecture)
    if quantization is None and isinstance(config.get("text_config"), dict):
        quantization = read_quantization_config(config["text_config"], model_dir, config_path, architecture)
    if architecture == "LlavaForConditionalGeneration":
        arch = _load_llava_config(model_dir, config_path)
    else:
        arch = _decoder_arch(config, architecture, model_dir, config_path)
    return arch if quantization is None else replace(arch, quantization=quantization)


def _load_llava_config(model_dir: Path, config_path: Path) -> ModelArchConfig:
    """A Llava-form config: the language model from ``text_config``, the rest in ``multimodal``.

    ``transformers``' ``LlavaConfig`` fills the defaults a published config leaves out (the
    sub-configs of llava-1.5 name only what differs from their model type's defaults).
    """
    from transformers import LlavaConfig

    full = LlavaConfig.from_pretrained(str(model_dir), local_files_only=True).to_dict()
    text, vision = dict(full["text_config"]), dict(full["vision_config"])
    text_architecture = _MODEL_TYPE_TO_ARCHITECTURE.get(text.get("model_type", ""))
    if text_architecture not in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"):
        raise ValueError(
            f"{config_path}: text_config.model_type={text.get('model_type')!r} is not supported; supported: "
            "llama, mistral, qwen2"
        )
    if vision.get("model_type") not in SUPPORTED_VISION_TOWERS:
        raise ValueError(
            f"{config_path}: vision_config.model_type={vision.get('model_type')!r} is not supported; supported: "
            f"{', '.join(SUPPORTED_VISION_TOWERS)}"
        )
    strategy = full.get("vision_feature_select_strategy", "default")
    if strategy not in ("default", "full"):
        raise ValueError(f"{config_path}: vision_feature_select_strategy={strategy!r} must be 'default' or 'full'")
    if vision["model_type"] == "pixtral" and strategy != "full":
        raise ValueError(f"{config_path}: vision_feature_select_strategy={strategy!r}: a Pixtral tower has "
                         "no class token to drop, so it must be 'full'")
    text["tie_word_embeddings"] = bool(full.get("tie_word_embeddings", text.get("tie_word_embeddings", False)))
    for key in ("eos_token_id", "bos_token_id"):
        if text.get(key) is None and full.get(key) is not None:
            text[key] = full[key]
    arch = _decoder_arch(text, text_architecture, model_dir, config_path)
    multimodal = {
        "image_token_index": int(full.get("image_token_index", full.get("image_token_id"))),
        "vision_feature_layer": full.get("vision_feature_layer", -2),
        "vision_feature_select_strategy": strategy,
        "projector_hidden_act": full.get("projector_hidden_act", "gelu"),
        "multimodal_projector_bias": bool(full.get("multimodal_projector_bias", True)),
        "vision_config": vision,
        "text_architecture": text_architecture,
    }
    return replace(arch, architecture="LlavaForConditionalGeneration", model_type="llava",
                   torch_dtype=arch.torch_dtype or full.get("dtype") or full.get("torch_dtype"),
                   multimodal=multimodal)


def _decoder_arch(config: dict[str, Any], architecture: str, model_dir: Path, config_path: Path) -> ModelArchConfig:
    """A decoder's fields from its config dict (``config.json``'s top level, or a ``text_config``)."""
    if architecture == "WhisperForConditionalGeneration":
        config = _whisper_as_decoder(config, config_path)

    missing = [
        key
        for key in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
        )
        if config.get(key) is None
    ]
    if missing:
        raise ValueError(f"{config_path}: required field(s) {', '.join(missing)} missing")

    hidden_size = int(config["hidden_size"])
    num_attention_heads = int(config["num_attention_heads"])
    num_key_value_heads = int(config.get("num_key_value_heads") or num_attention_heads)
    head_dim = int(config.get("head_dim") or hidden_size // num_attention_heads)
    rope_theta, rope_scaling = _normalise_rope(config, config_path)

    if architecture == "Qwen2ForCausalLM":
        attention_bias, o_proj_bias = True, False
    elif architecture in ("LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM"):
        attention_bias = o_proj_bias = bool(config.get("attention_bias", False))
    else:
        attention_bias = o_proj_bias = False
    mlp_bias = bool(config.get("mlp_bias", False)) if architecture == "LlamaForCausalLM" else False

    eos_token_ids = list(_as_int_tuple(config.get("eos_token_id")))
    bos_token_id = config.get("bos_token_id")
    generation_config_path = model_dir / "generation_config.json"
    if generation_config_path.is_file():
        generation_config = json.loads(generation_config_path.read_text())
        for token_id in _as_int_tuple(generation_config.get("eos_token_id")):
            if token_id not in eos_token_ids:
                eos_token_ids.append(token_id)
        if bos_token_id is None:
            bos_token_id = generation_config.get("bos_token_id")

    return ModelArchConfig(
        architecture=architecture,
        model_type=str(config.get("model_type", "")),
        vocab_size=int(config["vocab_size"]),
        hidden_size=hidden_size,
        intermediate_size=int(config["intermediate_size"]),
        num_hidden_layers=int(config["num_hidden_layers"]),
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        head_dim=head_dim,
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        attention_bias=attention_bias,
        o_proj_bias=o_proj_bias,
        mlp_bias=mlp_bias,
        torch_dtype=config.get("dtype") or config.get("torch_dtype"),
        bos_token_id=None if bos_token_id is None else int(bos_token_id),
        eos_token_ids=tuple(eos_token_ids),
        sliding_window=_sliding_window(config, architecture),
        audio_encoder=config.get("_audio_encoder"),
        qk_norm=architecture in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
        moe=_moe_arch(config, architecture, config_path),
        num_mtp_layers=int(config.get("num_nextn_predict_layers") or 0),
    )


def _positive_int(config: dict[str, Any], key: str, source: Path) -> int:
    """``config[key]`` as an int of at least 1; ValueError naming the field otherwise."""
    value = config.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{source}: {key}={value!r} must be an integer of at least 1")
    return value


def _moe_arch(config: dict[str, Any], architecture: str, source: Path) -> MoeArch | None:
    """The experts of a Qwen3-MoE or Mixtral config (None for other architectures), checked:
    ``top_k`` between 1 and the expert count, every ``mlp_only_layers`` entry a layer."""
    if architecture == "MixtralForCausalLM":
        num_experts = _positive_int(config, "num_local_experts", source)
        top_k = _positive_int(config, "num_experts_per_tok", source)
        expert_intermediate = int(config["intermediate_size"])
        norm_topk_prob, dense_layers = True, ()
        prefix, names = "block_sparse_moe", ("w1", "w3", "w2")
    elif architecture == "Qwen3MoeForCausalLM":
        # Published checkpoints say num_experts; transformers 5 saves num_local_experts.
        key = "num_experts" if config.get("num_experts") is not None else "num_local_experts"
        num_experts = _positive_int(config, key, source)
        top_k = _positive_int(config, "num_experts_per_tok", source)
        expert_intermediate = _positive_int(config, "moe_intermediate_size", source)
        norm_topk_prob = bool(config.get("norm_topk_prob", False))
        num_layers = int(config["num_hidden_layers"])
        step = _positive_int({"decoder_sparse_step": config.get("decoder_sparse_step", 1)},
                             "decoder_sparse_step", source)
        mlp_only = config.get("mlp_only_layers") or []
        bad = [i for i in mlp_only if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < num_layers]
        if bad:
            raise ValueError(f"{source}: mlp_only_layers={mlp_only!r} names {bad}, not layers of "
                             f"the model's {num_layers} (0 to {num_layers - 1})")
        # As transformers' Qwen3MoeDecoderLayer chooses: dense where listed or off the step.
        dense_layers = tuple(i for i in range(num_layers) if i in mlp_only or (i + 1) % step)
        prefix, names = "mlp", ("gate_proj", "up_proj", "down_proj")
    else:
        return None
    if top_k > num_experts:
        raise ValueError(f"{source}: num_experts_per_tok={top_k} must be at most the expert count {num_experts}")
    return MoeArch(
        num_experts=num_experts, top_k=top_k, expert_intermediate_size=expert_intermediate,
        norm_topk_prob=norm_topk_prob, dense_layers=dense_layers, checkpoint_prefix=prefix,
        expert_names=names,
    )


def expected_tensor_shapes(
    arch: ModelArchConfig,
    layer_range: range | None = None,
    first: bool = True,
    last: bool = True,
) -> dict[str, tuple[int, ...]]:
    """The HF checkpoint tensors one stage needs, by name, with their shapes.

    ``layer_range`` is the stage's decoder layers (None: all of them, and then the whole model).
    The first stage needs the embedding; the last needs the final norm and the LM head, which is
    the embedding matrix itself when ``tie_word_embeddings`` (so ``lm_head.weight`` is not expected).
    """
    if layer_range is None:
        layer_range = range(arch.num_hidden_layers)
    if arch.audio_encoder is not None:
        return _whisper_tensor_shapes(arch, arch.audio_encoder, layer_range, first, last)
    hidden = arch.hidden_size
    q_size = arch.num_attention_heads * arch.head_dim
    kv_size = arch.num_key_value_heads * arch.head_dim
    shapes: dict[str, tuple[int, ...]] = {}
    if first or (last and arch.tie_word_embeddings):
        shapes["model.embed_tokens.weight"] = (arch.vocab_size, hidden)
    for i in layer_range:
        prefix = f"model.layers.{i}"
        shapes[f"{prefix}.input_layernorm.weight"] = (hidden,)
        shapes[f"{prefix}.self_attn.q_proj.weight"] = (q_size, hidden)
        shapes[f"{prefix}.self_attn.k_proj.weight"] = (kv_size, hidden)
        shapes[f"{prefix}.self_attn.v_proj.weight"] = (kv_size, hidden)
        shapes[f"{prefix}.self_attn.o_proj.weight"] = (hidden, q_size)
        if arch.attention_bias:
            shapes[f"{prefix}.self_attn.q_proj.bias"] = (q_size,)
            shapes[f"{prefix}.self_attn.k_proj.bias"] = (kv_size,)
            shapes[f"{prefix}.self_attn.v_proj.bias"] = (kv_size,)
        if arch.o_proj_bias:
            shapes[f"{prefix}.self_attn.o_proj.bias"] = (hidden,)
        if arch.qk_norm:
            shapes[f"{prefix}.self_attn.q_norm.weight"] = (arch.head_dim,)
            shapes[f"{prefix}.self_attn.k_norm.weight"] = (arch.head_dim,)
        shapes[f"{prefix}.post_attention_layernorm.weight"] = (hidden,)
        moe = arch.moe
        if moe is not None and moe.is_sparse(i):
            block = f"{prefix}.{moe.checkpoint_prefix}"
            gate, up, down = moe.expert_names
            inter = moe.expert_intermediate_size
            shapes[f"{block}.gate.weight"] = (moe.num_experts, hidden)
            for e in range(moe.num_experts):
                shapes[f"{block}.experts.{e}.{gate}.weight"] = (inter, hidden)
                shapes[f"{block}.experts.{e}.{up}.weight"] = (inter, hidden)
                shapes[f"{block}.experts.{e}.{down}.weight"] = (hidden, inter)
            continue
        shapes[f"{prefix}.mlp.gate_proj.weight"] = (arch.intermediate_size, hidden)
        shapes[f"{prefix}.mlp.up_proj.weight"] = (arch.intermediate_size, hidden)
        shapes[f"{prefix}.mlp.down_proj.weight"] = (hidden, arch.intermediate_size)
        if arch.mlp_bias:
            shapes[f"{prefix}.mlp.gate_proj.bias"] = (arch.intermediate_size,)
            shapes[f"{prefix}.mlp.up_proj.bias"] = (arch.intermediate_size,)
            shapes[f"{prefix}.mlp.down_proj.bias"] = (hidden,)
    if last:
        shapes["model.norm.weight"] = (hidden,)
        if not arch.tie_word_embeddings:
            shapes["lm_head.weight"] = (arch.vocab_size, hidden)
    return shapes


def _whisper_tensor_shapes(
    arch: ModelArchConfig, enc: AudioEncoderArch, layer_range: range, first: bool, last: bool
) -> dict[str, tuple[int, ...]]:
    """A Whisper stage's checkpoint tensors: the encoder and decoder embeddings on the first
    stage, its decoder layers, the final norm (and an untied projection) on the last."""
    hidden = arch.hidden_size
    shapes: dict[str, tuple[int, ...]] = {}

    def block(prefix: str, attns: tuple[str, ...], ffn: int) -> None:
        for attn in attns:
            for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
                shapes[f"{prefix}.{attn}.{proj}.weight"] = (hidden, hidden)
                if proj != "k_proj":  # Whisper's k projections have no bias
                    shapes[f"{prefix}.{attn}.{proj}.bias"] = (hidden,)
            shapes[f"{prefix}.{attn}_layer_norm.weight"] = (hidden,)
            shapes[f"{prefix}.{attn}_layer_norm.bias"] = (hidden,)
        shapes[f"{prefix}.fc1.weight"] = (ffn, hidden)
        shapes[f"{prefix}.fc1.bias"] = (ffn,)
        shapes[f"{prefix}.fc2.weight"] = (hidden, ffn)
        shapes[f"{prefix}.fc2.bias"] = (hidden,)
        shapes[f"{prefix}.final_layer_norm.weight"] = (hidden,)
        shapes[f"{prefix}.final_layer_norm.bias"] = (hidden,)

    if first:
        shapes["model.encoder.conv1.weight"] = (hidden, enc.num_mel_bins, 3)
        shapes["model.encoder.conv1.bias"] = (hidden,)
        shapes["model.encoder.conv2.weight"] = (hidden, hidden, 3)
        shapes["model.encoder.conv2.bias"] = (hidden,)
        shapes["model.encoder.embed_positions.weight"] = (enc.max_source_positions, hidden)
        for i in range(enc.num_layers):
            block(f"model.encoder.layers.{i}", ("self_attn",), enc.ffn_dim)
        shapes["model.encoder.layer_norm.weight"] = (hidden,)
        shapes["model.encoder.layer_norm.bias"] = (hidden,)
        shapes["model.decoder.embed_positions.weight"] = (arch.max_position_embeddings, hidden)
    if first or (last and arch.tie_word_embeddings):
        shapes["model.decoder.embed_tokens.weight"] = (arch.vocab_size, hidden)
    for i in layer_range:
        block(f"model.decoder.layers.{i}", ("self_attn", "encoder_attn"), arch.intermediate_size)
    if last:
        shapes["model.decoder.layer_norm.weight"] = (hidden,)
        shapes["model.decoder.layer_norm.bias"] = (hidden,)
        if not arch.tie_word_embeddings:
            shapes["proj_out.weight"] = (arch.vocab_size, hidden)
    return shapes
