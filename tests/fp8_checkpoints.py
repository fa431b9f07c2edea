"""FP8 checkpoints for tests, written in the layouts published checkpoints use, each beside its
dequantized twin (the same weights as plain float32, the reference transformers loads).

The quantization and the dequantization here are written independently of pprun's loader:
scales from each block's, row's or tensor's largest magnitude over 448 (float8 e4m3's largest
finite value), weights divided and rounded to float8, the twin float8 x scale in float32.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

FP8_MAX = 448.0

LAYOUTS = ("block", "channel", "tensor", "ct-block")
"""``block``: ``quant_method: fp8`` with ``weight_block_size`` and ``weight_scale_inv``;
``channel``: compressed-tensors FP8-dynamic (per-row ``weight_scale``, dynamic per-token
activations); ``tensor``: ``quant_method: fp8`` per tensor with static ``input_scale``;
``ct-block``: compressed-tensors block-wise weights with per-group dynamic activations."""


def _is_quantized(name: str, layout: str) -> bool:
    """The linear weights a published checkpoint of ``layout`` quantizes: every decoder linear
    but the router (kept dense by both tools' recipes) and the LM head."""
    if not name.endswith(".weight") or ".layers." not in name or name.endswith("norm.weight"):
        return False
    return not (name.endswith(".mlp.gate.weight") or name.endswith(".block_sparse_moe.gate.weight"))


def _scales(w: torch.Tensor, layout: str, block: tuple[int, int]) -> torch.Tensor:
    rows, cols = w.shape
    if layout in ("block", "ct-block"):
        br, bc = block
        s = torch.empty((rows + br - 1) // br, (cols + bc - 1) // bc)
        for i in range(s.shape[0]):
            for j in range(s.shape[1]):
                s[i, j] = w[i * br:(i + 1) * br, j * bc:(j + 1) * bc].abs().max() / FP8_MAX
        return s
    if layout == "channel":
        return w.abs().amax(dim=1, keepdim=True) / FP8_MAX
    return (w.abs().max() / FP8_MAX).reshape(1)


def _expand(s: torch.Tensor, shape: torch.Size, layout: str, block: tuple[int, int]) -> torch.Tensor:
    if layout in ("block", "ct-block"):
        rows, cols = shape
        return s.repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    return s if layout == "channel" else s.reshape(())


def quantization_config(layout: str, block: tuple[int, int]) -> dict:
    """``config.json``'s ``quantization_config`` for ``layout``, as the publishing tools write it."""
    if layout == "block":
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": list(block)}
    if layout == "tensor":
        return {"quant_method": "fp8", "activation_scheme": "static"}
    weights = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False,
               "strategy": "channel" if layout == "channel" else "block"}
    acts = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": True,
            "strategy": "token" if layout == "channel" else "group"}
    if layout == "ct-block":
        weights["block_structure"] = list(block)
        acts["group_size"] = block[1]
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": acts}},
            "ignore": ["lm_head", "re:.*mlp.gate$", "re:.*block_sparse_moe.gate$"], "kv_cache_scheme": None}


def write_fp8(src: Path, dst: Path, layout: str, block: tuple[int, int] = (16, 16)) -> tuple[Path, Path]:
    """Quantize the float checkpoint ``src`` into ``dst`` in ``layout``; write the dequantized
    twin into ``dst`` + ``-dequantized``. Returns ``(fp8_dir, dequantized_dir)``."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r}: one of {LAYOUTS}")
    twin = dst.with_name(dst.name + "-dequantized")
    for d in (dst, twin):
        shutil.copytree(src, d)
    tensors = load_file(str(src / "model.safetensors"))
    fp8, deq = {}, {}
    for name, w in tensors.items():
        if not _is_quantized(name, layout):
            fp8[name] = deq[name] = w
            continue
        s = _scales(w.float(), layout, block)
        q = (w.float() / _expand(s, w.shape, layout, block)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        base = name.removesuffix("weight")
        fp8[name] = q
        fp8[base + ("weight_scale_inv" if layout == "block" else "weight_scale")] = s
        if layout == "tensor":
            fp8[base + "input_scale"] = torch.tensor([0.05])
        deq[name] = q.to(torch.float32) * _expand(s, w.shape, layout, block)
    save_file(fp8, str(dst / "model.safetensors"), metadata={"format": "pt"})
    save_file(deq, str(twin / "model.safetensors"), metadata={"format": "pt"})
    config_path = dst / "config.json"
    config = json.loads(config_path.read_text())
    config["quantization_config"] = quantization_config(layout, block)
    config_path.write_text(json.dumps(config, indent=2))
    return dst, twin
