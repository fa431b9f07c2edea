"""Check a PprunConfig against itself, the machine and the model, before any process starts.

Every bad value raises one ValueError naming the field, the value and what is allowed. What passes
comes back as a :class:`ResolvedConfig`: every ``auto``/``None`` replaced by what will actually run,
frozen, and handed down to every layer below (engine, executors, stage processes), which read it and
never validate again.

Validation has no side effects: it reads the model directory's ``config.json`` (and the
safetensors headers) and converts nothing.  A known model alias names its cached, converted
directory; converting it is model resolution, done once by the entry point before validation
(``pprun.engine.resolve.resolve_config``).
"""

from __future__ import annotations

import copy
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from pprun.checks import SEED_MAX, SEED_MIN, is_int, is_number, is_seed
from pprun.config.config import PprunConfig
from pprun.config.runner_choice import RUNNERS, choose_runner
from pprun.models.hf_config import ModelArchConfig, load_arch_config

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

EXECUTORS: tuple[str, ...] = ("auto", "uni", "mp", "ray", "external_launcher")
"""Allowed values of ``parallel.executor``."""
DEVICES: tuple[str, ...] = ("auto", "cpu", "cuda")
"""Allowed values of ``device``."""
DTYPES: tuple[str, ...] = ("auto", "float32", "bfloat16", "float16")
"""Allowed values of ``model.dtype``."""
CUDAGRAPH_MODES: tuple[str, ...] = ("none", "piecewise", "full", "full_and_piecewise")
"""Allowed values of ``compilation.cudagraph_mode``."""
WARMUP_MODES: tuple[str, ...] = ("auto", "full", "none")
"""Allowed values of ``compilation.warmup``."""
BLOCK_SIZES: tuple[int, ...] = (8, 16, 32, 64, 128)
"""Allowed values of ``cache.block_size``."""
LOG_LEVELS: tuple[str, ...] = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
"""Allowed values of ``log_level``."""
ATTENTION_BACKENDS: tuple[str, ...] = ("auto", "reference", "triton")
"""Allowed values of ``attention_backend`` (and ``PPRUN_ATTN_BACKEND``)."""
ATTN_BACKEND_ENV = "PPRUN_ATTN_BACKEND"
"""Environment variable that overrides ``attention_backend`` when set."""
CONTROL_SPIN_MAX_US = 100_000
"""Largest ``parallel.control_spin_us`` (and ``PPRUN_CONTROL_SPIN_US``): 0.1 s of polling per wait."""
PLACEMENT_STRATEGIES: tuple[str, ...] = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
"""Allowed ``parallel.placement_strategy`` values: Ray's placement group strategies."""
RAY_BUILTIN_RESOURCES: tuple[str, ...] = ("CPU", "GPU", "memory", "object_store_memory")
"""Resources pprun reserves itself or Ray accounts by itself: not for ``parallel.stage_resources``."""

DEFAULT_MAX_NUM_BATCHED_TOKENS: dict[str, int] = {"cuda": 8192, "cpu": 2048}
"""``scheduler.max_num_batched_tokens`` when it is null, by device.  CUDA: measured on an H200 at
256 requests of 512-token prompts, 8192 tokens per step give 37.0k output tokens/s against 22.4k
at 2048 and half the time to first token, while 16384 gives no more and slows decode.  CPU: a
step's time grows with its tokens, and 2048 bounds how long a prefill chunk holds back the
decodes sharing its step."""

_TORCHRUN_ENV_KEYS: tuple[str, ...] = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


@dataclass(frozen=True)
class ResolvedConfig:
    """A validated configuration with every automatic choice made: the one object handed down.

    Frozen: made once by :func:`validate_config`, read by every layer below (the engine, the
    executors, the stage processes it is sent to), never changed or validated again.
    """

    cfg: PprunConfig
    """The configuration as given (the resolver's own copy: read it, do not change it; its
    automatic values, such as a null ``scheduler.max_num_batched_tokens``, stay as given and are
    resolved in the fields below)."""
    model_dir: Path
    """The Hugging Face model directory (an alias resolved to its cached directory)."""
    tokenizer_dir: Path
    """Where the tokenizer is (``model.tokenizer`` or the model directory)."""
    arch: ModelArchConfig
    """The model's architecture, from config.json."""
    device: str
    """``cpu`` or ``cuda``."""
    dtype: torch.dtype
    """Dtype of weights, activations and KV cache."""
    max_model_len: int
    """Longest prompt + output per request, in tokens."""
    layer_partition: list[int]
    """Decoder layers per stage, first to last."""
    executor: str
    """``uni``, ``mp``, ``ray`` or ``external_launcher``."""
    runner: str
    """``v1`` or ``v2``."""
    cudagraph_capture_sizes: list[int]
    """Padded batch sizes captured as full decode graphs (empty on CPU or with cudagraph_mode=none)."""
    max_num_batched_tokens: int
    """The token budget of one step: ``scheduler.max_num_batched_tokens`` where given, else
    ``DEFAULT_MAX_NUM_BATCHED_TOKENS`` of the device (raised to ``max_model_len`` with chunked
    prefill off, so a whole prompt fits a step).  Every reader (scheduler, receive buffers,
    runner inputs) reads this field."""
    piecewise_capture_sizes: list[int] = field(default_factory=list)
    """Padded token counts captured as piecewise graphs (empty on CPU, and unless cudagraph_mode is
    piecewise or full_and_piecewise)."""
    v2_fallback_reasons: tuple[str, ...] = ()
    """Why the V2 runner does not run this configuration (``unsupported_v2_features``); empty
    where it does."""
    attention_backend: str = "auto"
    """``attention_backend``, or ``PPRUN_ATTN_BACKEND`` where set (``auto`` is resolved by each
    stage: whether Triton imports is the stage process's fact)."""
    warmup: bool = False
    """Whether the engine runs its warm-up before it reports ready (``compilation.warmup``: full;
    auto on CUDA; ``pprun.engine.warmup``)."""

    def stage_layer_range(self, pp_rank: int) -> range:
        """The decoder layers stage ``pp_rank`` owns."""
        start = sum(self.layer_partition[:pp_rank])
        return range(start, start + self.layer_partition[pp_rank])


def even_partition(num_layers: int, pp_size: int) -> list[int]:
    """Split ``num_layers`` over ``pp_size`` stages as evenly as possible; returns layers per stage.

    The ``num_layers % pp_size`` extra layers go one each to the stages just before the last,
    walking backwards (vLLM's rule, so splits match what its users know): the last stage is spared
    because it also runs the final norm, the LM head (a vocab x hidden matmul, the largest single
    op) and sampling; the first stage, which also holds the embedding table, gets an extra layer
    only once every middle stage has one. E.g. 10 layers on 4 stages -> [2, 3, 3, 2].
    """
    if pp_size < 1:
        raise ValueError(f"parallel.pipeline_parallel_size={pp_size} must be >= 1")
    if num_layers < pp_size:
        raise ValueError(
            f"parallel.pipeline_parallel_size={pp_size} exceeds the model's {num_layers} layers; "
            f"allowed: 1..{num_layers} (every stage needs at least one layer)"
        )
    partition = [num_layers // pp_size] * pp_size
    for i in range(2, num_layers % pp_size + 2):
        partition[-i] += 1
    return partition


def resolve_executor(cfg: PprunConfig, env: Mapping[str, str] = os.environ) -> str:
    """The executor ``cfg`` runs with: ``auto`` -> external_launcher under torchrun, else uni (one
    process: pp = tp = 1) or ray."""
    executor = cfg.parallel.executor
    if executor not in EXECUTORS:
        raise ValueError(
            f"parallel.executor={executor!r} is not allowed; choose one of {', '.join(EXECUTORS)}"
        )
    if executor != "auto":
        return executor
    if _under_torchrun(env):
        return "external_launcher"
    one_process = cfg.parallel.pipeline_parallel_size == 1 and cfg.parallel.tensor_parallel_size == 1
    return "uni" if one_process else "ray"


def _under_torchrun(env: Mapping[str, str]) -> bool:
    """True when torchrun (torch.distributed.elastic) started this process."""
    return "TORCHELASTIC_RUN_ID" in env or all(key in env for key in _TORCHRUN_ENV_KEYS)


def _check_choice(field_name: str, value: object, allowed: tuple) -> None:
    """Raise ValueError unless ``value`` is one of ``allowed``, of the same type (``16.0`` or
    ``True`` is no block size, though ``16.0 == 16`` and ``True == 1``)."""
    if not any(type(value) is type(a) and value == a for a in allowed):
        raise ValueError(
            f"{field_name}={value!r} is not allowed; choose one of {', '.join(map(str, allowed))}"
        )


def _check_min(field_name: str, value: object, minimum: float, allowed: str) -> None:
    """Raise ValueError unless ``value`` is a finite number >= ``minimum`` (an int when ``allowed``
    says integer; never a bool)."""
    valid = is_int(value) if "integer" in allowed else is_number(value)
    if not valid or value < minimum:
        raise ValueError(f"{field_name}={value!r} is not allowed; it must be {allowed}")


def _check_flags(cfg: PprunConfig) -> None:
    """Every field declared ``bool`` holds True or False (a string such as "no" would read as
    true; ``bool | None`` fields are checked where they are used)."""
    for group in fields(cfg):
        section = getattr(cfg, group.name)
        if not is_dataclass(section):
            continue
        for f in fields(section):
            value = getattr(section, f.name)
            if f.type in (bool, "bool") and not isinstance(value, bool):
                raise ValueError(f"{group.name}.{f.name}={value!r} is not allowed; it must be true or false")


def _check_placement(cfg: PprunConfig, executor: str) -> None:
    """``parallel.placement_strategy`` and ``parallel.stage_resources`` (Ray placement)."""
    par = cfg.parallel
    _check_choice("parallel.placement_strategy", par.placement_strategy, PLACEMENT_STRATEGIES)
    if par.stage_resources is None:
        return
    if executor != "ray":
        raise ValueError(
            f"parallel.stage_resources={par.stage_resources!r} is not allowed with executor {executor!r}: "
            "only the ray executor reserves resources per stage; leave it null or use parallel.executor=ray"
        )
    pp_size = par.pipeline_parallel_size
    if not isinstance(par.stage_resources, list | tuple) or len(par.stage_resources) != pp_size:
        raise ValueError(
            f"parallel.stage_resources={par.stage_resources!r} is invalid: must be a list of "
            f"{pp_size} mappings of custom resource name to amount (one per stage, "
            f"parallel.pipeline_parallel_size={pp_size}; {{}} for a stage that needs none), e.g. "
            f"[{', '.join(f'{{node_{i}: 1}}' for i in range(pp_size))}]"
        )
    for rank, wanted in enumerate(par.stage_resources):
        where = f"parallel.stage_resources[{rank}]"
        if not isinstance(wanted, Mapping):
            raise ValueError(f"{where}={wanted!r} is invalid: must be a mapping of resource name to amount")
        for name, amount in wanted.items():
            if not isinstance(name, str) or not name:
                raise ValueError(f"{where} has the resource name {name!r}: must be a non-empty string")
            if name in RAY_BUILTIN_RESOURCES:
                raise ValueError(
                    f"{where}.{name} is not allowed: pprun sets {name} itself (parallel.ray_num_cpus_per_stage "
                    "for CPU, one GPU per stage on GPU); name custom resources here"
                )
            if not is_number(amount) or not 0 < amount < float("inf") or (amount > 1 and amount != int(amount)):
                raise ValueError(
                    f"{where}.{name}={amount!r} is invalid: must be a number in (0, 1] or a whole number "
                    "above 1 (what Ray can reserve)"
                )


def _check_values(cfg: PprunConfig, env: Mapping[str, str]) -> None:
    """Checks that need neither the model nor the device."""
    _check_choice("runner", cfg.runner, RUNNERS)
    _check_choice("device", cfg.device, DEVICES)
    _check_choice("model.dtype", cfg.model.dtype, DTYPES)
    _check_choice("parallel.executor", cfg.parallel.executor, EXECUTORS)
    _check_choice("compilation.cudagraph_mode", cfg.compilation.cudagraph_mode, CUDAGRAPH_MODES)
    _check_choice("compilation.warmup", cfg.compilation.warmup, WARMUP_MODES)
    _check_choice("cache.block_size", cfg.cache.block_size, BLOCK_SIZES)
    _check_choice("log_level", str(cfg.log_level).upper(), LOG_LEVELS)
    _check_choice("attention_backend", cfg.attention_backend, ATTENTION_BACKENDS)
    if env.get(ATTN_BACKEND_ENV):
        _check_choice(ATTN_BACKEND_ENV, env[ATTN_BACKEND_ENV], ATTENTION_BACKENDS)
    spin_us = cfg.parallel.control_spin_us
    if spin_us is not None and not (is_int(spin_us) and 0 <= spin_us <= CONTROL_SPIN_MAX_US):
        raise ValueError(
            f"parallel.control_spin_us={spin_us!r} is not allowed; it must be a whole number of "
            f"microseconds from 0 to {CONTROL_SPIN_MAX_US}, or null for the default"
        )

    _check_flags(cfg)
    if not is_seed(cfg.model.seed):
        raise ValueError(f"model.seed={cfg.model.seed!r} is not allowed; it must be an integer in "
                         f"[{SEED_MIN}, {SEED_MAX}] (64 bits)")
    _check_min("model.max_logprobs", cfg.model.max_logprobs, 0, "an integer >= 0")
    _check_choice("model.quantization", cfg.model.quantization, (None, "fp8"))
    pp_size = cfg.parallel.pipeline_parallel_size
    _check_min("parallel.pipeline_parallel_size", pp_size, 1, "an integer >= 1")
    tp_size = cfg.parallel.tensor_parallel_size
    _check_min("parallel.tensor_parallel_size", tp_size, 1, "an integer >= 1")
    if cfg.parallel.executor == "uni" and pp_size > 1:
        raise ValueError(
            f"parallel.executor='uni' runs one process, so parallel.pipeline_parallel_size={pp_size} is not "
            "allowed with it; use pipeline_parallel_size=1, or executor mp, ray or external_launcher"
        )
    if cfg.parallel.executor == "uni" and tp_size > 1:
        raise ValueError(
            f"parallel.executor='uni' runs one process, so parallel.tensor_parallel_size={tp_size} is not "
            "allowed with it; use tensor_parallel_size=1, or executor mp, ray or external_launcher (one "
            "process per device)"
        )
    if (
        resolve_executor(cfg, env) == "external_launcher"
        and "WORLD_SIZE" in env
        and int(env["WORLD_SIZE"]) != pp_size * tp_size
    ):
        raise ValueError(
            f"parallel.pipeline_parallel_size={pp_size} x parallel.tensor_parallel_size={tp_size} = "
            f"{pp_size * tp_size} workers but torchrun started WORLD_SIZE={env['WORLD_SIZE']} ranks; with "
            "executor=external_launcher every rank is one worker, so they must be equal"
        )
    _check_min("parallel.stage_timeout_s", cfg.parallel.stage_timeout_s, 1e-9, "a number of seconds > 0")
    _check_min("parallel.ray_num_cpus_per_stage", cfg.parallel.ray_num_cpus_per_stage, 0, "a number >= 0")
    _check_placement(cfg, resolve_executor(cfg, env))
    if cfg.parallel.microbatches is not None:
        _check_min(
            "parallel.microbatches", cfg.parallel.microbatches, pp_size,
            f"an integer >= parallel.pipeline_parallel_size ({pp_size}), or null for one per stage",
        )  # fmt: skip
        executor = resolve_executor(cfg, env)
        if executor not in ("mp", "ray"):
            raise ValueError(
                f"parallel.microbatches={cfg.parallel.microbatches} is not allowed with executor {executor!r}: "
                "only the mp and ray executors keep several batches in flight; leave it null"
            )

    if cfg.parallel.async_pipeline is not None and not isinstance(cfg.parallel.async_pipeline, bool):
        raise ValueError(
            f"parallel.async_pipeline={cfg.parallel.async_pipeline!r} is invalid: must be true, false or "
            "null (on wherever it applies)"
        )
    _check_min("scheduler.max_num_seqs", cfg.scheduler.max_num_seqs, 1, "an integer >= 1")
    if cfg.scheduler.max_num_batched_tokens is not None:
        _check_min(
            "scheduler.max_num_batched_tokens", cfg.scheduler.max_num_batched_tokens, 1,
            "an integer >= 1, or null for the device's default (8192 on CUDA, 2048 on CPU)",
        )  # fmt: skip
    if cfg.scheduler.max_num_encoder_tokens is not None:
        _check_min(
            "scheduler.max_num_encoder_tokens", cfg.scheduler.max_num_encoder_tokens, 1,
            "an integer >= 1, or null for max(max_num_batched_tokens, max_model_len)",
        )  # fmt: skip

    if cfg.cache.kv_cache_memory_bytes is not None:
        _check_min(
            "cache.kv_cache_memory_bytes",
            cfg.cache.kv_cache_memory_bytes,
            1,
            "an integer number of bytes >= 1, or None",
        )
    _check_min("cache.cpu_kv_cache_bytes", cfg.cache.cpu_kv_cache_bytes, 1, "an integer number of bytes >= 1")
    utilization = cfg.cache.gpu_memory_utilization
    if not is_number(utilization) or not 0 < utilization <= 1:
        raise ValueError(f"cache.gpu_memory_utilization={utilization!r} is not allowed; it must be in (0, 1]")

    for key in ("cudagraph_capture_sizes", "piecewise_capture_sizes"):
        sizes = getattr(cfg.compilation, key)
        if sizes is not None and (
            isinstance(sizes, str) or not isinstance(sizes, Sequence) or not sizes
            or not all(is_int(s) and s >= 1 for s in sizes)
        ):
            raise ValueError(
                f"compilation.{key}={sizes!r} is not allowed; it must be a non-empty list of "
                "integers >= 1, or None for the defaults"
            )
    sizes = cfg.compilation.cudagraph_capture_sizes
    if sizes is not None:
        max_num_seqs = cfg.scheduler.max_num_seqs
        too_big = sorted({s for s in sizes if s > max_num_seqs})
        if too_big:
            raise ValueError(
                f"compilation.cudagraph_capture_sizes={list(sizes)!r} is not allowed: {too_big} exceed "
                f"scheduler.max_num_seqs={max_num_seqs}, so no batch would replay them; drop them or raise "
                "max_num_seqs"
            )


def _model_dir(name_or_path: str) -> Path:
    """The model directory ``model.model`` names, found without converting anything: an existing
    directory as is, a known alias as its cached conversion (``pprun.models.demo.converted_alias_dir``)."""
    if not isinstance(name_or_path, str) or not name_or_path:
        raise ValueError(
            f"model.model={name_or_path!r} is not allowed; give a model directory or a known alias"
        )
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise ValueError(
            f"model.model={name_or_path!r} is a file; it must be a model directory or a known alias"
        )
    from pprun.models.demo import converted_alias_dir, known_model_aliases

    aliases = known_model_aliases()
    if name_or_path not in aliases:
        raise ValueError(
            f"model.model={name_or_path!r} is neither an existing directory nor a known model alias "
            f"(no such path); known aliases: {aliases}"
        )
    converted = converted_alias_dir(name_or_path)
    if converted is None:
        raise ValueError(
            f"model.model={name_or_path!r} is a known alias that has not been converted yet, and "
            "validation converts nothing; resolve the model first: pprun.engine.resolve.resolve_config "
            "(what LLM and the pprun apps call) or pprun.models.demo.resolve_model converts it once"
        )
    return converted


def _resolve_device(cfg: PprunConfig, cuda_available: bool) -> str:
    """``cpu`` or ``cuda`` for ``cfg.device``."""
    if cfg.device == "cuda" and not cuda_available:
        raise ValueError("device='cuda' but CUDA is not available on this machine; use device=cpu or auto")
    if cfg.device == "auto":
        return "cuda" if cuda_available else "cpu"
    return cfg.device


def _resolve_dtype(cfg: PprunConfig, arch: ModelArchConfig, device: str) -> torch.dtype:
    """The run dtype: see ModelConfig.dtype; float16 on CPU and bf16 on a GPU without it are rejected."""
    import torch

    name = cfg.model.dtype
    if name == "auto":
        checkpoint_dtype = arch.torch_dtype if arch.torch_dtype in ("float16", "bfloat16") else None
        if device == "cpu" or checkpoint_dtype is None:
            return torch.float32
        if (
            checkpoint_dtype == "bfloat16"
            and torch.cuda.is_available()
            and not torch.cuda.is_bf16_supported()
        ):
            logger.warning(
                "model.dtype=auto: this GPU has no bfloat16 support; running the bfloat16 checkpoint in float16"
            )
            return torch.float16
        return getattr(torch, checkpoint_dtype)
    if device == "cpu" and name == "float16":
        raise ValueError(
            "model.dtype='float16' is not allowed on device=cpu (CPU float16 matmuls are slow and partly "
            "unsupported); use float32 or bfloat16 on CPU"
        )
    if (
        device == "cuda"
        and name == "bfloat16"
        and torch.cuda.is_available()
        and not torch.cuda.is_bf16_supported()
    ):
        raise ValueError("model.dtype='bfloat16' is not supported by this GPU; use float16 or float32")
    return getattr(torch, name)


def _resolve_max_num_batched_tokens(cfg: PprunConfig, device: str, max_model_len: int) -> int:
    """``scheduler.max_num_batched_tokens`` where given (the user's value wins), else the device's
    default, raised to ``max_model_len`` when chunked prefill is off (a prompt must fit one step)."""
    given = cfg.scheduler.max_num_batched_tokens
    if given is not None:
        budget = given
    else:
        budget = DEFAULT_MAX_NUM_BATCHED_TOKENS[device]
        if not cfg.scheduler.enable_chunked_prefill:
            budget = max(budget, max_model_len)
    if not cfg.scheduler.enable_chunked_prefill and budget < max_model_len:
        raise ValueError(
            f"scheduler.max_num_batched_tokens={budget} is smaller than "
            f"max_model_len={max_model_len} with scheduler.enable_chunked_prefill=False, so a long prompt could "
            "never be scheduled; raise max_num_batched_tokens, lower max_model_len or enable chunked prefill"
        )
    return budget


def _resolve_max_model_len(cfg: PprunConfig, arch: ModelArchConfig) -> int:
    """``model.max_model_len`` checked against the model, or its default."""
    from pprun.config.config import DEFAULT_MAX_MODEL_LEN_CAP

    limit = arch.max_position_embeddings
    max_model_len = cfg.model.max_model_len
    if max_model_len is None:
        max_model_len = min(limit, DEFAULT_MAX_MODEL_LEN_CAP)
    elif (
        isinstance(max_model_len, bool)
        or not isinstance(max_model_len, int)
        or not 1 <= max_model_len <= limit
    ):
        raise ValueError(
            f"model.max_model_len={max_model_len!r} is not allowed; it must be in 1..{limit} "
            f"(the model's max_position_embeddings), or None for min({limit}, {DEFAULT_MAX_MODEL_LEN_CAP})"
        )
    if arch.sliding_window is not None and arch.sliding_window < max_model_len:
        raise ValueError(
            f"model.max_model_len={max_model_len} exceeds the model's sliding_window={arch.sliding_window}, and "
            f"sliding-window attention is not supported; set model.max_model_len <= {arch.sliding_window}"
        )
    return max_model_len


def _resolve_layer_partition(cfg: PprunConfig, num_layers: int) -> list[int]:
    """``parallel.layer_partition`` checked against the model, or the even split."""
    pp_size = cfg.parallel.pipeline_parallel_size
    if pp_size > num_layers:
        raise ValueError(
            f"parallel.pipeline_parallel_size={pp_size} exceeds the model's {num_layers} layers; "
            f"allowed: 1..{num_layers} (every stage needs at least one layer)"
        )
    partition = cfg.parallel.layer_partition
    if partition is None:
        return even_partition(num_layers, pp_size)
    if isinstance(partition, str) or not isinstance(partition, Sequence):
        raise ValueError(
            f"parallel.layer_partition={partition!r} is not allowed: give a list of one layer count per stage, "
            "or null for an even split"
        )
    partition = list(partition)
    if len(partition) != pp_size:
        raise ValueError(
            f"parallel.layer_partition={partition} has {len(partition)} entries but "
            f"parallel.pipeline_parallel_size={pp_size}; give one layer count per stage"
        )
    if not all(is_int(n) and n >= 1 for n in partition):
        raise ValueError(
            f"parallel.layer_partition={partition} is not allowed: every stage needs an integer >= 1 layers"
        )
    if sum(partition) != num_layers:
        raise ValueError(
            f"parallel.layer_partition={partition} sums to {sum(partition)} but the model has {num_layers} layers; "
            "the entries must add up to the layer count"
        )
    return partition


def _check_async_pipeline(pp_size: int, executor: str, runner: str, reasons: list[str], tp_size: int = 1) -> None:
    """``parallel.async_pipeline=True`` asks for async pipeline steps: an error where they cannot
    run (null turns them on only where they can)."""
    if tp_size > 1:
        raise ValueError(
            f"parallel.async_pipeline=True is not allowed with tensor_parallel_size={tp_size}: the sampled "
            "ids go from the last stage to the first over one socket per pipeline, and only tp rank 0 "
            "samples; set it to null or false (the sampled ids then reach every worker in the next step)"
        )
    if pp_size < 2 or executor not in ("mp", "ray"):
        raise ValueError(
            f"parallel.async_pipeline=True is not allowed with pipeline_parallel_size={pp_size} and "
            f"executor {executor!r}: it needs pp >= 2 on the mp or ray executor (one stage in process "
            "uses scheduler.async_scheduling instead); set it to null or false"
        )
    if runner != "v2":
        raise ValueError(
            f"parallel.async_pipeline=True is not allowed with the {runner} runner (it needs V2"
            + (f"; V2 is not used because: {'; '.join(reasons)}" if reasons else "")
            + "); set it to null or false"
        )


def _check_tensor_parallel(cfg: PprunConfig, arch: ModelArchConfig, executor: str, device: str) -> None:
    """The model splits ``parallel.tensor_parallel_size`` ways (``check_tensor_parallel``, the
    model's side: heads, KV heads, widths), and on GPUs this host has a device per local worker
    (``mp`` runs every worker here; Ray places them, and torchrun's ranks are checked by it)."""
    from pprun.models.parallelism import check_tensor_parallel

    tp_size = cfg.parallel.tensor_parallel_size
    try:
        check_tensor_parallel(arch, tp_size)
    except ValueError as e:
        message = str(e)
        if not message.startswith("parallel."):
            message = f"parallel.{message}"
        raise ValueError(message) from None
    if device == "cuda" and executor == "mp":
        import torch

        num_workers = tp_size * cfg.parallel.pipeline_parallel_size
        num_gpus = torch.cuda.device_count()
        if num_workers > num_gpus:
            raise ValueError(
                f"parallel.tensor_parallel_size={tp_size} x parallel.pipeline_parallel_size="
                f"{cfg.parallel.pipeline_parallel_size} = {num_workers} workers need as many GPUs, one each, "
                f"but this host has {num_gpus}; lower them, or use executor ray across nodes"
            )


def validate_config(
    cfg: PprunConfig,
    *,
    cuda_available: bool | None = None,
    env: Mapping[str, str] | None = None,
    check_weights: bool = True,
) -> ResolvedConfig:
    """Validate ``cfg`` and resolve every automatic choice; raises ValueError on the first bad value.

    Called once per run, by the entry point (``pprun.engine.resolve.resolve_config``); the
    :class:`ResolvedConfig` it returns is what every layer below takes.  Reads the model
    directory and converts nothing: a known alias must have been resolved (converted) first.

    ``cuda_available`` overrides detection (tests); ``env`` overrides ``os.environ`` for torchrun
    detection; ``check_weights=False`` skips the safetensors header check (config.json is still read).
    """
    env = os.environ if env is None else env
    # The resolved config owns its copy: a caller that changes its object afterwards changes
    # nothing that was validated.
    cfg = copy.deepcopy(cfg)
    _check_values(cfg, env)
    executor = resolve_executor(cfg, env)
    runner, reasons = choose_runner(cfg, executor)
    if cfg.parallel.async_pipeline is True:
        _check_async_pipeline(
            cfg.parallel.pipeline_parallel_size, executor, runner, reasons, cfg.parallel.tensor_parallel_size
        )

    if cuda_available is None:
        import torch

        cuda_available = torch.cuda.is_available()
    device = _resolve_device(cfg, cuda_available)

    model_dir = _model_dir(cfg.model.model)
    arch = load_arch_config(model_dir)
    if cfg.model.quantization is not None:
        from pprun.models.quantization import with_online_quantization

        arch = with_online_quantization(arch, cfg.model.quantization, model_dir)
    _check_tensor_parallel(cfg, arch, executor, device)
    dtype = _resolve_dtype(cfg, arch, device)
    max_model_len = _resolve_max_model_len(cfg, arch)
    max_num_batched_tokens = _resolve_max_num_batched_tokens(cfg, device, max_model_len)
    layer_partition = _resolve_layer_partition(cfg, arch.num_hidden_layers)
    if check_weights:
        from pprun.models.checkpoint import validate_checkpoint

        validate_checkpoint(model_dir, arch)

    tokenizer_dir = Path(cfg.model.tokenizer).expanduser() if cfg.model.tokenizer else model_dir
    if cfg.model.tokenizer and not tokenizer_dir.exists():
        raise ValueError(
            f"model.tokenizer={cfg.model.tokenizer!r} does not exist; give a tokenizer directory or None"
        )

    attention_backend = env.get(ATTN_BACKEND_ENV) or cfg.attention_backend
    if attention_backend == "triton" and device != "cuda":
        name = ATTN_BACKEND_ENV if env.get(ATTN_BACKEND_ENV) else "attention_backend"
        raise ValueError(f"{name}='triton' needs a CUDA device, but device={device!r}; use auto or reference")
    capture_sizes: list[int] = []
    piecewise_sizes: list[int] = []
    if device == "cuda" and cfg.compilation.cudagraph_mode != "none":
        capture_sizes = cfg.compilation.resolved_capture_sizes(cfg.scheduler.max_num_seqs)
        if cfg.compilation.cudagraph_mode in ("piecewise", "full_and_piecewise"):
            # A step never holds more tokens than the budget: a larger graph would never replay.
            piecewise_sizes = [s for s in cfg.compilation.resolved_piecewise_sizes(max_num_batched_tokens)
                               if s <= max_num_batched_tokens]

    resolved = ResolvedConfig(
        cfg=cfg,
        model_dir=model_dir,
        tokenizer_dir=tokenizer_dir,
        arch=arch,
        device=device,
        dtype=dtype,
        max_model_len=max_model_len,
        layer_partition=layer_partition,
        executor=executor,
        runner=runner,
        cudagraph_capture_sizes=capture_sizes,
        piecewise_capture_sizes=piecewise_sizes,
        max_num_batched_tokens=max_num_batched_tokens,
        v2_fallback_reasons=tuple(reasons),
        attention_backend=attention_backend,
        warmup=cfg.compilation.warmup == "full" or (cfg.compilation.warmup == "auto" and device == "cuda"),
    )
    logger.info(
        "pprun config: model=%s (%s, %d layers) device=%s dtype=%s pp=%d tp=%d layer_partition=%s executor=%s runner=%s "
        "max_model_len=%d max_num_batched_tokens=%d",
        model_dir,
        arch.architecture,
        arch.num_hidden_layers,
        device,
        str(dtype).removeprefix("torch."),
        cfg.parallel.pipeline_parallel_size,
        cfg.parallel.tensor_parallel_size,
        layer_partition,
        executor,
        runner,
        max_model_len,
        max_num_batched_tokens,
    )
    return resolved
