"""Index a safetensors checkpoint (single file or sharded) and read just the tensors one stage needs.

Shapes and dtypes come from the files' headers, so validating a checkpoint reads no tensor data,
and a stage that loads its layers opens only the shards that hold them.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from pprun.models.hf_config import ModelArchConfig, expected_tensor_shapes

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

_SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


@dataclass
class CheckpointIndex:
    """Where every tensor of a safetensors checkpoint lives, with header-only shape/dtype lookup."""

    model_dir: Path
    """The model directory."""
    weight_map: dict[str, str]
    """Tensor name -> file name (relative to ``model_dir``)."""
    _headers: dict[str, dict[str, tuple[tuple[int, ...], str]]] = field(default_factory=dict, repr=False)
    stored_names: dict[str, str] = field(default_factory=dict, repr=False)
    """The model's name -> the name stored in the file, where they differ (see :meth:`open`)."""

    @classmethod
    def open(cls, model_dir: Path | str, arch: ModelArchConfig | None = None) -> CheckpointIndex:
        """Index ``model_dir``: ``model.safetensors.index.json`` if present, else ``model.safetensors``.

        With ``arch``, tensors are indexed under the model's own names (:func:`name_mapper`), and a
        tied checkpoint that stores only ``lm_head.weight`` (as ``safetensors.torch.save_model``
        keeps one name of a shared tensor) serves ``model.embed_tokens.weight`` from it, as
        ``transformers`` loads it.  Raises ValueError when neither file exists (``*.bin`` PyTorch
        checkpoints are not read).
        """
        index = cls._open_files(Path(model_dir))
        if arch is None:
            return index
        rename = name_mapper(arch)
        if rename is not None:
            for stored in list(index.weight_map):
                name = rename(stored)
                if name != stored:
                    index.weight_map[name] = index.weight_map.pop(stored)
                    index.stored_names[name] = stored
        embed = "model.embed_tokens.weight"
        if arch.tie_word_embeddings and embed not in index.weight_map and "lm_head.weight" in index.weight_map:
            index.weight_map[embed] = index.weight_map["lm_head.weight"]
            index.stored_names[embed] = index.stored_names.get("lm_head.weight", "lm_head.weight")
        return index

    @classmethod
    def _open_files(cls, model_dir: Path) -> CheckpointIndex:
        index_path = model_dir / INDEX_FILE
        if index_path.is_file():
            weight_map = json.loads(index_path.read_text()).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise ValueError(f"{index_path}: no 'weight_map' (tensor name -> shard file)")
            missing_files = sorted({f for f in weight_map.values() if not (model_dir / f).is_file()})
            if missing_files:
                raise ValueError(
                    f"{index_path} names shard file(s) that do not exist: {', '.join(missing_files)}"
                )
            return cls(model_dir=model_dir, weight_map=dict(weight_map))
        single_path = model_dir / SINGLE_FILE
        if single_path.is_file():
            index = cls(model_dir=model_dir, weight_map={})
            index.weight_map = {name: SINGLE_FILE for name in index._header(SINGLE_FILE)}
            return index
        raise ValueError(
            f"model.model={str(model_dir)!r} has no weights: expected {SINGLE_FILE} or {INDEX_FILE} "
            "(only safetensors checkpoints are supported)"
        )

    def _header(self, file_name: str) -> dict[str, tuple[tuple[int, ...], str]]:
        """Name -> (shape, safetensors dtype) for one file, read from its header once."""
        if file_name not in self._headers:
            header: dict[str, tuple[tuple[int, ...], str]] = {}
            with safe_open(str(self.model_dir / file_name), framework="pt") as f:
                for name in f.keys():
                    tensor_slice = f.get_slice(name)
                    header[name] = (tuple(tensor_slice.get_shape()), tensor_slice.get_dtype())
            self._headers[file_name] = header
        return self._headers[file_name]

    def file_of(self, name: str) -> str:
        """The file holding tensor ``name``; ValueError if the checkpoint has no such tensor."""
        try:
            return self.weight_map[name]
        except KeyError:
            raise ValueError(f"tensor {name!r} is not in the checkpoint at {self.model_dir}") from None

    def __contains__(self, name: object) -> bool:
        return name in self.weight_map

    def names(self) -> list[str]:
        """Every tensor name in the checkpoint."""
        return list(self.weight_map)

    def shape(self, name: str) -> tuple[int, ...]:
        """Shape of ``name`` from its file's header (no data read)."""
        file_name = self.file_of(name)
        try:
            return self._header(file_name)[self.stored_names.get(name, name)][0]
        except KeyError:
            raise ValueError(f"{INDEX_FILE} maps {name!r} to {file_name}, which does not hold it") from None

    def dtype(self, name: str) -> torch.dtype:
        """Stored dtype of ``name`` from its file's header (no data read)."""
        file_name = self.file_of(name)
        code = self._header(file_name)[self.stored_names.get(name, name)][1]
        if code not in _SAFETENSORS_DTYPES:
            raise ValueError(f"tensor {name!r} in {file_name} has unsupported dtype {code}")
        return _SAFETENSORS_DTYPES[code]

    def iter_tensors(
        self,
        names: Iterable[str],
        device: torch.device | str = "cpu",
        dtype: torch.dtype | None = None,
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(name, tensor)`` one at a time (each file opened once), so a loader can copy
        each tensor into place before the next is read: peak memory stays near the weights."""
        names_by_file: dict[str, list[str]] = defaultdict(list)
        for name in names:
            names_by_file[self.file_of(name)].append(name)
        for file_name, file_names in names_by_file.items():
            with safe_open(str(self.model_dir / file_name), framework="pt", device="cpu") as f:
                for name in file_names:
                    tensor = f.get_tensor(self.stored_names.get(name, name))
                    if dtype is not None and tensor.is_floating_point():
                        tensor = tensor.to(dtype)
                    yield name, tensor.to(device)

    def load(
        self,
        names: Iterable[str],
        device: torch.device | str = "cpu",
        dtype: torch.dtype | None = None,
    ) -> dict[str, torch.Tensor]:
        """Read only ``names`` (each file opened once), cast floating tensors to ``dtype``, move to ``device``."""
        return dict(self.iter_tensors(names, device, dtype))


def name_mapper(arch: ModelArchConfig) -> Callable[[str], str] | None:
    """The function mapping a checkpoint's stored tensor names onto the model's, where a family
    needs one (each family keeps its mapping in its own module); None: names are used as stored."""
    if arch.multimodal is not None:
        from pprun.models.llava import canonical_name

        return canonical_name
    return None


def validate_checkpoint(
    model_dir: Path | str,
    arch: ModelArchConfig,
    layer_range: range | None = None,
    first: bool = True,
    last: bool = True,
) -> CheckpointIndex:
    """Check every tensor the (stage of the) model needs is present with the right shape.

    Raises one ValueError listing every missing tensor and every shape mismatch (expected vs found,
    and the file), so a broken checkpoint is reported before any process starts. Returns the index.
    """
    index = CheckpointIndex.open(model_dir, arch)
    expected = expected_tensor_shapes(arch, layer_range, first, last)
    missing = [name for name in expected if name not in index]
    mismatched = []
    for name, shape in expected.items():
        if name in index and index.shape(name) != shape:
            mismatched.append(
                f"{name}: expected shape {shape}, found {index.shape(name)} in {index.file_of(name)}"
            )
    if missing or mismatched:
        problems = []
        if missing:
            shown = ", ".join(f"{name} {expected[name]}" for name in missing[:10])
            more = f" (and {len(missing) - 10} more)" if len(missing) > 10 else ""
            problems.append(f"{len(missing)} missing tensor(s): {shown}{more}")
        if mismatched:
            more = f"; (and {len(mismatched) - 10} more)" if len(mismatched) > 10 else ""
            problems.append(f"{len(mismatched)} shape mismatch(es): " + "; ".join(mismatched[:10]) + more)
        raise ValueError(
            f"checkpoint at {model_dir} does not match its config.json ({arch.architecture}): "
            + ". ".join(problems)
        )
    return index
