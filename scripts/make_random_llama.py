"""Write a Llama-shaped checkpoint with random weights (config.json + model.safetensors).

Default shape: the 1.1B model of the GPU benchmarks (hidden 2048, 16 layers, 32 heads / 8 KV
heads, intermediate 8192, vocab 32000), bf16.  Weights ~ N(0, 0.02), norms 1: speed does not
depend on the values, and the output stays finite.

    python scripts/make_random_llama.py /tmp/llama-1b [--device cuda] [--layers 16] ...
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import save_file


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--intermediate", type=int, default=8192)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--max-pos", type=int, default=4096)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    from pprun.models.hf_config import expected_tensor_shapes, load_arch_config

    args.out.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": args.hidden,
        "intermediate_size": args.intermediate,
        "num_hidden_layers": args.layers,
        "num_attention_heads": args.heads,
        "num_key_value_heads": args.kv_heads,
        "vocab_size": args.vocab,
        "max_position_embeddings": args.max_pos,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "torch_dtype": args.dtype,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "hidden_act": "silu",
    }
    (args.out / "config.json").write_text(json.dumps(config, indent=2))
    arch = load_arch_config(args.out)
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator(device=args.device).manual_seed(args.seed)
    tensors = {}
    for name, shape in expected_tensor_shapes(arch).items():
        if name.endswith("norm.weight"):
            t = torch.ones(shape, dtype=dtype, device=args.device)
        else:
            t = torch.randn(shape, generator=gen, device=args.device, dtype=torch.float32).mul_(0.02).to(dtype)
        tensors[name] = t.cpu().contiguous()
    save_file(tensors, str(args.out / "model.safetensors"), metadata={"format": "pt"})
    n = sum(t.numel() for t in tensors.values())
    print(json.dumps({"path": str(args.out), "parameters": n, "dtype": args.dtype}))


if __name__ == "__main__":
    main()
