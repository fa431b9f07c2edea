"""Which ``tensor_parallel_size`` a model's architecture admits (the model-side check that config
validation calls before any process starts)."""

from __future__ import annotations

from pprun.models.hf_config import ModelArchConfig


def check_tensor_parallel(arch: ModelArchConfig, tp_size: int) -> None:
    """Refuse a ``tensor_parallel_size`` the model cannot be split by, naming the value and the
    counts it must divide.

    Every rank holds ``num_attention_heads / tp`` query heads and the widths split with them
    (the MLP's intermediate width, each expert's, Whisper's feed-forward); the KV heads are split
    where ``tp`` divides them and replicated where ``tp`` is a multiple of them (Qwen3 with one
    or two KV heads).  The vocabulary is padded to a multiple of ``tp``, so it never refuses.
    A quantized checkpoint runs at tp 1 only."""
    if not isinstance(tp_size, int) or isinstance(tp_size, bool) or tp_size < 1:
        raise ValueError(f"tensor_parallel_size={tp_size!r} must be a positive integer")
    if tp_size == 1:
        return
    heads, kv_heads = arch.num_attention_heads, arch.num_key_value_heads
    where = f"{arch.architecture} has num_attention_heads={heads}, num_key_value_heads={kv_heads}"
    if heads % tp_size:
        raise ValueError(
            f"tensor_parallel_size={tp_size} does not divide the attention heads: {where}; "
            f"allowed: a divisor of {heads}"
        )
    if kv_heads % tp_size and tp_size % kv_heads:
        raise ValueError(
            f"tensor_parallel_size={tp_size} neither divides nor is a multiple of the KV heads: "
            f"{where}; allowed: a divisor of {heads} that divides {kv_heads} or is a multiple of it"
        )
    widths = {"intermediate_size": arch.intermediate_size}
    if arch.moe is not None:
        widths["moe_intermediate_size"] = arch.moe.expert_intermediate_size
    if arch.audio_encoder is not None:
        widths["hidden_size"] = arch.hidden_size  # Whisper's decoder splits hidden by heads
    for field, width in widths.items():
        if width % tp_size:
            raise ValueError(
                f"tensor_parallel_size={tp_size} does not divide {arch.architecture}'s {field}={width}"
            )
    if arch.quantization is not None:
        raise ValueError(
            f"tensor_parallel_size={tp_size} with a quantized checkpoint "
            f"({arch.quantization.method}) is not supported; allowed: tensor_parallel_size=1"
        )
    if arch.vocab_size < tp_size:
        raise ValueError(
            f"tensor_parallel_size={tp_size} exceeds {arch.architecture}'s vocab_size={arch.vocab_size}"
        )
