"""Build one stage's model and fill it from the checkpoint, reading only that stage's tensors."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from pprun.distributed.layout import StageLayout
from pprun.distributed.tensor_parallel import TensorParallel
from pprun.models.hf_config import ModelArchConfig
from pprun.models.llama import LlamaForCausalLM
from pprun.models.llava import LlavaForConditionalGeneration
from pprun.models.whisper import WhisperForConditionalGeneration

logger = logging.getLogger(__name__)

# The Llama code serves these architectures as they are the same network (Qwen3 with its
# per-head q/k norms, Qwen3-MoE and Mixtral with their sparse layers: pprun.models.moe).
MODEL_CLASSES = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "Qwen3MoeForCausalLM": LlamaForCausalLM,
    "MixtralForCausalLM": LlamaForCausalLM,
    "WhisperForConditionalGeneration": WhisperForConditionalGeneration,
    "LlavaForConditionalGeneration": LlavaForConditionalGeneration,
}


def load_stage_model(
    model_dir: Path,
    arch: ModelArchConfig,
    layout: StageLayout,
    *,
    device: torch.device,
    dtype: torch.dtype,
    max_positions: int,
    attn_backend,
    tp: TensorParallel | None = None,
) -> LlamaForCausalLM:
    """Allocate the stage's modules (and nothing else), then copy in exactly its tensors; with
    ``tp`` (size > 1), this tensor-parallel rank's shard of them, reading only that shard."""
    from pprun.models.checkpoint import CheckpointIndex, check_stage_tensors, log_conversions
    from pprun.models.quantization import weight_loader

    t0 = time.perf_counter()
    cls = MODEL_CLASSES[arch.architecture]
    model = cls(
        arch,
        layout,
        device=device,
        dtype=dtype,
        max_positions=max_positions,
        attn_backend=attn_backend,
        tp=tp if tp is not None else TensorParallel.single(),
    )
    names = model.checkpoint_names()
    index = CheckpointIndex.open(model_dir, arch)
    # Exactly or not at all: this stage's unclaimed tensors and float8/integer weights are refused
    # (headers only) before a byte is read; the other stages' tensors are theirs to check.
    where = f", stage {layout.pp_rank}/{layout.pp_size}"
    if tp is not None and tp.size > 1:
        where += f", tp rank {tp.rank}/{tp.size}"
    check_stage_tensors(index, arch, names, lists_first_stage_modules=layout.is_first,
                        layer_range=layout.layer_range, where=where)
    log_conversions(index, names, dtype, where)
    # A quantized checkpoint's method reads its weights with their scales (pprun.models.quantization).
    loader = weight_loader(arch)
    if loader is None:
        tensors = index.iter_tensors(names, device=device, dtype=dtype, shards=model.checkpoint_shards())
    else:
        tensors = loader.iter_tensors(index, names, device=device, dtype=dtype, keep_fp8=model.fp8_weight_names)
    loaded = model.load_weights(tensors)
    missing = sorted(set(names) - loaded)
    if loader is not None:
        # A weight kept in float8 is nothing without its scale.
        missing += sorted(loader.scale_name(n) for n in model.fp8_weight_names if loader.scale_name(n) not in loaded)
    if missing:
        raise ValueError(f"stage {layout.pp_rank}: checkpoint tensors not loaded: {missing[:8]}")
    model.eval().requires_grad_(False)
    n_params = sum(p.numel() for p in model.parameters())
    logger.info(
        "stage %d/%d: layers [%d, %d), %d tensors, %.1fM parameters, loaded in %.2fs",
        layout.pp_rank,
        layout.pp_size,
        layout.start_layer,
        layout.end_layer,
        len(names),
        n_params / 1e6,
        time.perf_counter() - t0,
    )
    return model
