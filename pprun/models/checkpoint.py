"""Index a safetensors checkpoint (single file or sharded) and read just the tensors one stage needs.

Shapes and dtypes come from the files' headers, so validating a checkpoint reads no tensor data,
and a stage that loads its layers opens only the shards that hold them.

A checkpoint loads exactly or not at all.  Validation (:func:`validate_checkpoint`, before any
process starts) and each stage's load (:func:`check_stage_tensors`) refuse, with the names:

- a tensor the model needs that is missing or has another shape;
- a tensor the checkpoint holds that no parameter takes (an *unclaimed* tensor), unless the model
  declares it ignorable by name with a reason (:class:`IgnoreRule`: rotary tables, a tied head's
  copy, multi-token-prediction layers, a vision tower's unused blocks); another stage's tensors
  are that stage's to check;
- a tensor stored as float8 or an integer where a floating-point weight belongs: a plain cast
  would turn quantized values into wrong weights.  Floating dtypes convert (bf16, fp16, fp32).
"""

from __future__ import annotations

import json
import logging
import re
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from pprun.layers.parallel_linear import Shard
from pprun.models.hf_config import ModelArchConfig, expected_tensor_shapes
from pprun.models.tensor_rules import IgnoreRule

logger = logging.getLogger(__name__)

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
        shards: Mapping[str, Shard] | None = None,
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(name, tensor)`` one at a time (each file opened once), so a loader can copy
        each tensor into place before the next is read: peak memory stays near the weights.

        ``shards``: for a tensor named there, only that row or column range is read from the
        file (a tensor-parallel rank's part, ``pprun.layers.parallel_linear.Shard``); the rest
        are read whole.

        With ``dtype``, each tensor is cast to it, and a tensor stored as float8 or an integer
        raises ValueError naming it: only a quantization method that owns such a tensor reads it
        (``dtype=None`` reads tensors as stored)."""
        names_by_file: dict[str, list[str]] = defaultdict(list)
        for name in names:
            names_by_file[self.file_of(name)].append(name)
        for file_name, file_names in names_by_file.items():
            with safe_open(str(self.model_dir / file_name), framework="pt", device="cpu") as f:
                for name in file_names:
                    stored = self.stored_names.get(name, name)
                    shard = shards.get(name) if shards else None
                    tensor = f.get_tensor(stored) if shard is None else f.get_slice(stored)[shard.index()]
                    if dtype is not None:
                        if not is_plain_float(tensor.dtype):
                            raise ValueError(_cast_refused(name, tensor.dtype, dtype, file_name))
                        tensor = tensor.to(dtype)
                    yield name, tensor.to(device)

    def load(
        self,
        names: Iterable[str],
        device: torch.device | str = "cpu",
        dtype: torch.dtype | None = None,
    ) -> dict[str, torch.Tensor]:
        """Read only ``names`` (each file opened once), cast them to ``dtype`` (floating-point
        tensors only: a float8 or integer tensor raises ValueError), move to ``device``."""
        return dict(self.iter_tensors(names, device, dtype))


def name_mapper(arch: ModelArchConfig) -> Callable[[str], str] | None:
    """The function mapping a checkpoint's stored tensor names onto the model's, where a family
    needs one (each family keeps its mapping in its own module); None: names are used as stored."""
    if arch.multimodal is not None:
        from pprun.models.llava import canonical_name

        return canonical_name
    return None


_PLAIN_FLOATS = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


def is_plain_float(dtype: torch.dtype) -> bool:
    """A dtype a weight may be cast from without changing what it means (not float8, not integer)."""
    return dtype in _PLAIN_FLOATS


def _cast_refused(name: str, stored: torch.dtype, wanted: torch.dtype, file_name: str) -> str:
    return (
        f"checkpoint tensor {name!r} in {file_name} is stored as {str(stored).removeprefix('torch.')}; "
        f"a plain cast to {str(wanted).removeprefix('torch.')} would turn quantized values into wrong "
        "weights, and no quantization method of this checkpoint reads it"
    )


def ignored_tensor_rules(arch: ModelArchConfig) -> tuple[IgnoreRule, ...]:
    """Every tensor name ``arch``'s model declares it does not read (the family's own rules come
    from its module, as :func:`name_mapper` does)."""
    rules = [
        IgnoreRule(r".*\.rotary_emb\.inv_freq",
                   "rotary inverse frequencies: recomputed from config.json's RoPE settings"),
        IgnoreRule(r"mtp\..*", "multi-token-prediction module: pprun does not run speculative heads"),
    ]
    if arch.num_mtp_layers:
        # Only where config.json declares them: else layers past num_hidden_layers are a
        # mislabelled checkpoint, which must not load as a shorter model.
        rules.append(IgnoreRule(r"model\.layers\.(\d+)\..*", "multi-token-prediction layers past "
                                "num_hidden_layers (num_nextn_predict_layers): pprun does not run speculative heads",
                                min_index=arch.num_hidden_layers))
    if arch.tie_word_embeddings:
        head = "proj_out.weight" if arch.audio_encoder is not None else "lm_head.weight"
        rules.append(IgnoreRule(re.escape(head), "tied embeddings: the head is the embedding matrix, "
                                "as transformers ties it"))
    if arch.multimodal is not None:
        from pprun.models.llava import ignored_tensor_rules as llava_rules

        rules += llava_rules(arch)
    return tuple(rules)


def first_stage_prefixes(arch: ModelArchConfig) -> tuple[str, ...]:
    """Name prefixes of modules only the first stage builds and whose tensors only it can list
    (Llava's vision tower and projector): validation and the other stages leave them to it."""
    if arch.multimodal is not None:
        return ("vision_tower.", "multi_modal_projector.")
    return ()


def unclaimed_tensors(
    index: CheckpointIndex,
    arch: ModelArchConfig,
    claimed: Iterable[str],
    *,
    lists_first_stage_modules: bool,
    layer_range: range | None = None,
) -> list[str]:
    """Tensors of the checkpoint that no parameter takes: neither in ``claimed`` (this stage's
    names) nor any stage's decoder tensors, nor ignorable by :func:`ignored_tensor_rules`.

    ``layer_range``: the stage's decoder layers; a tensor of another stage's layer is that
    stage's to check (None: every layer is checked here).

    ``lists_first_stage_modules``: ``claimed`` is the first stage's, built, so it lists the
    modules only that stage builds (:func:`first_stage_prefixes`); otherwise (validation, other
    stages) their tensors are left to the first stage's load.
    """
    known = set(claimed) | set(expected_tensor_shapes(arch))
    deferred = () if lists_first_stage_modules else first_stage_prefixes(arch)
    rules = ignored_tensor_rules(arch)

    def another_stages(name: str) -> bool:
        m = _DECODER_LAYER.match(name)
        if layer_range is None or m is None:
            return False
        layer = int(m.group(1))
        return layer < arch.num_hidden_layers and layer not in layer_range

    return [
        name for name in index.names()
        if name not in known
        and not (deferred and name.startswith(deferred))
        and not another_stages(name)
        and not any(rule.matches(name) for rule in rules)
    ]


_DECODER_LAYER = re.compile(r"model\.(?:decoder\.)?layers\.(\d+)\.")
"""A decoder layer's tensor names (Llama family, Llava's language model, Whisper's decoder)."""


_QUANT_SUFFIXES = ("weight_scale", "weight_scale_inv", "input_scale", "qweight", "qzeros", "scales",
                   "g_idx", "weight_zero_point", "weight_packed")


def _unclaimed_error(model_dir: Path | str, arch: ModelArchConfig, names: list[str], where: str) -> str:
    shown = ", ".join(names[:10]) + (f" (and {len(names) - 10} more)" if len(names) > 10 else "")
    hint = ""
    if arch.quantization is None and any(name.rsplit(".", 1)[-1] in _QUANT_SUFFIXES for name in names):
        hint = (" Some look like quantization scales or packed weights, but config.json names no "
                "quantization_config: the checkpoint is quantized or mislabelled.")
    return (
        f"checkpoint at {model_dir}{where}: {len(names)} tensor(s) that no parameter of "
        f"{arch.architecture} takes: {shown}. pprun loads a checkpoint exactly or not at all.{hint}"
    )


def _dtype_problems(index: CheckpointIndex, names: Iterable[str]) -> list[str]:
    """``name (dtype) in file`` for each of ``names`` stored in a dtype a cast would corrupt."""
    problems = []
    for name in names:
        stored = index.dtype(name)
        if not is_plain_float(stored):
            problems.append(f"{name} ({str(stored).removeprefix('torch.')}, in {index.file_of(name)})")
    return problems


def check_stage_tensors(
    index: CheckpointIndex,
    arch: ModelArchConfig,
    claimed: list[str],
    *,
    lists_first_stage_modules: bool,
    layer_range: range | None = None,
    where: str = "",
) -> None:
    """Refuse, naming them, this stage's unclaimed tensors and its tensors stored as float8 or
    integers (see the module docstring; the keywords: :func:`unclaimed_tensors`).  Reads headers
    only."""
    from pprun.models.quantization import weight_loader

    loader = weight_loader(arch)
    # The scales every stage's weights own (another stage's, e.g. a quantized LM head's, are its).
    owned = loader.owned_names(list(expected_tensor_shapes(arch))) if loader is not None else []
    if loader is not None:
        # First: a weight the config and the checkpoint disagree on explains the scale it leaves over.
        bad = loader.problems(index, claimed)
        if bad:
            shown = "; ".join(bad[:10]) + (f" (and {len(bad) - 10} more)" if len(bad) > 10 else "")
            raise ValueError(
                f"checkpoint at {index.model_dir}{where} does not match its quantization_config "
                f"({arch.quantization.method}): {shown}"
            )
    unclaimed = unclaimed_tensors(index, arch, claimed + owned, lists_first_stage_modules=lists_first_stage_modules,
                                  layer_range=layer_range)
    if unclaimed:
        raise ValueError(_unclaimed_error(index.model_dir, arch, unclaimed, where))
    if loader is not None:
        return
    bad = _dtype_problems(index, claimed)
    if bad:
        shown = "; ".join(bad[:10]) + (f" (and {len(bad) - 10} more)" if len(bad) > 10 else "")
        raise ValueError(
            f"checkpoint at {index.model_dir}{where}: {len(bad)} weight(s) stored in a dtype a plain cast "
            f"would corrupt: {shown}. Only a quantization method that owns such tensors reads them, and "
            "config.json names no quantization_config."
        )


def log_conversions(index: CheckpointIndex, names: Iterable[str], dtype: torch.dtype, where: str) -> None:
    """One log line for the floating-point tensors a load converts (e.g. fp32 stored, bf16 run)."""
    converted: dict[torch.dtype, int] = defaultdict(int)
    for name in names:
        stored = index.dtype(name)
        if stored != dtype:
            converted[stored] += 1
    if converted:
        logger.info(
            "%s: converting %s to %s", where.strip(" ,") or "checkpoint",
            ", ".join(f"{n} tensor(s) stored as {str(d).removeprefix('torch.')}" for d, n in converted.items()),
            str(dtype).removeprefix("torch."),
        )


def validate_checkpoint(
    model_dir: Path | str,
    arch: ModelArchConfig,
    layer_range: range | None = None,
    first: bool = True,
    last: bool = True,
) -> CheckpointIndex:
    """Check every tensor the (stage of the) model needs is present with the right shape, stored
    in a floating-point dtype, and that the checkpoint holds no tensor nothing takes.

    Raises one ValueError listing every missing tensor and every shape mismatch (expected vs found,
    and the file), so a broken checkpoint is reported before any process starts; then one for
    unclaimed tensors or weights stored as float8 or integers (:func:`check_stage_tensors`; the
    first stage's vision tower is checked where it is built).  Returns the index.
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
    check_stage_tensors(index, arch, list(expected), lists_first_stage_modules=False)
    return index
