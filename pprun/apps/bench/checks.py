"""What ``pprun bench`` checks before any engine starts: the workload settings, an input file's
lines, and that the model can run the workload."""

from __future__ import annotations

import json

from pprun.apps.bench.peers import PEERS
from pprun.apps.bench.workloads import (
    AUDIO_SOURCES,
    MAX_IMAGE_SIZE,
    MAX_NUM_IMAGES,
    SPEECH_DIR,
    TOKEN_WORKLOADS,
    WORKLOADS,
    read_workload_file,
)
from pprun.checks import is_int
from pprun.config.config import BenchAppConfig
from pprun.config.validate import ResolvedConfig

PEER_DTYPES = ("float32", "bfloat16", "float16")
"""What ``peer_dtype`` may name."""


def resolved_repeats(cfg: BenchAppConfig) -> int:
    """Timed passes per row: ``repeats``, else 3 when a peer runs and 1 when none does."""
    if cfg.repeats is not None:
        return int(cfg.repeats)
    return 1 if cfg.peer == "none" else 3


def check_bench_config(cfg: BenchAppConfig) -> list[tuple[str, dict, int]] | None:
    """Reject workload settings no run can use (ValueError naming the field, the value and what is
    allowed), and an ``input_file`` whose lines are malformed, before the engine starts; returns
    that file's entries (:func:`read_workload_file`), None without one."""
    if cfg.peer not in PEERS:
        raise ValueError(f"peer={cfg.peer!r} is not allowed: choose one of {', '.join(PEERS)}")
    if cfg.workload not in WORKLOADS:
        raise ValueError(f"workload={cfg.workload!r} is not allowed: choose one of {', '.join(WORKLOADS)}")
    for name in ("num_prompts", "input_len", "output_len"):
        value = getattr(cfg, name)
        if not is_int(value) or value < 1:
            raise ValueError(f"{name}={value!r} must be an integer of at least 1")
    check_batch_sizes(cfg)
    if cfg.repeats is not None and (not is_int(cfg.repeats) or not 1 <= cfg.repeats <= 20):
        raise ValueError(f"repeats={cfg.repeats!r} must be an integer from 1 to 20 (or null: 3 with a peer, else 1)")
    if cfg.peer_dtype is not None and cfg.peer_dtype not in PEER_DTYPES:
        raise ValueError(f"peer_dtype={cfg.peer_dtype!r} is not allowed: choose one of {', '.join(PEER_DTYPES)} "
                         "(or null: pprun's)")
    warmup = cfg.num_warmup_prompts
    if warmup is not None and (not is_int(warmup) or warmup < 0):
        raise ValueError(f"num_warmup_prompts={warmup!r} must be an integer of at least 0 (or null: one full batch)")
    if cfg.workload != "text" and cfg.input_file is not None:
        raise ValueError(
            f"input_file={cfg.input_file!r} is for workload=text; workload={cfg.workload} makes its own "
            "requests (drop input_file)"
        )
    if cfg.peer == "vllm":
        try:
            json.dumps(dict(cfg.vllm_args))
        except (TypeError, ValueError) as e:
            raise ValueError(
                f"vllm_args={cfg.vllm_args!r} must hold JSON values: they cross to vLLM's process as JSON ({e})"
            ) from None
    if cfg.workload == "shared_prefix" and (not is_int(cfg.prefix_len) or cfg.prefix_len < 1):
        raise ValueError(f"prefix_len={cfg.prefix_len!r} must be an integer of at least 1 (workload=shared_prefix)")
    if cfg.workload == "image":
        for name, top in (("num_images", MAX_NUM_IMAGES), ("image_size", MAX_IMAGE_SIZE)):
            value = getattr(cfg, name)
            if not is_int(value) or not 1 <= value <= top:
                raise ValueError(f"{name}={value!r} must be an integer in [1, {top}] (workload=image)")
    if cfg.workload == "audio":
        seconds = cfg.audio_seconds
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 < seconds <= 30:
            raise ValueError(
                f"audio_seconds={seconds!r} must be a number above 0 and at most 30 (one Whisper window; "
                "workload=audio)"
            )
        if cfg.audio_source not in AUDIO_SOURCES:
            raise ValueError(
                f"audio_source={cfg.audio_source!r} is not allowed: choose one of {', '.join(AUDIO_SOURCES)}"
            )
        if cfg.audio_source == "speech" and not any(SPEECH_DIR.glob("*.*")):
            raise ValueError(
                f"audio_source=speech reads the recordings in {SPEECH_DIR} (a pprun checkout), which are not "
                "there; use audio_source=synthetic"
            )
    return read_workload_file(cfg.input_file, cfg.output_len) if cfg.input_file is not None else None


def check_batch_sizes(cfg: BenchAppConfig) -> None:
    """``batch_sizes``: distinct integers of at least 1, not with ``input_file`` (whose lines are
    the requests); ``peer_batch_sizes``: some of them."""
    sizes, peer_sizes = cfg.batch_sizes, cfg.peer_batch_sizes
    if sizes is None:
        if peer_sizes is not None:
            raise ValueError(f"peer_batch_sizes={list(peer_sizes)} needs batch_sizes (the rows it picks from)")
        return
    sizes = list(sizes)
    if not sizes or any(not is_int(b) or b < 1 for b in sizes) or len(set(sizes)) != len(sizes):
        raise ValueError(f"batch_sizes={sizes!r} must be a non-empty list of distinct integers of at least 1")
    if cfg.input_file is not None:
        raise ValueError(
            f"batch_sizes={sizes} makes each row's requests; input_file={cfg.input_file!r} is a fixed request set "
            "(drop one of them)"
        )
    if peer_sizes is not None and (not list(peer_sizes) or any(b not in sizes for b in peer_sizes)):
        raise ValueError(f"peer_batch_sizes={list(peer_sizes)!r} must be a non-empty subset of batch_sizes={sizes}")


def check_model_for_workload(cfg: BenchAppConfig) -> ResolvedConfig:
    """The model can run the workload (from its config, before the engine starts): image needs a
    vision-language model, audio a speech model, the token workloads (text, chat, shared_prefix)
    a text or vision-language model.  Returns the run's resolved configuration (the engine takes
    it: validated once)."""
    from pprun.engine.resolve import resolve_config

    resolved = resolve_config(cfg.pprun_config())
    arch = resolved.arch
    # The workload the model runs: audio for a speech model, image for a vision-language one
    # (which runs token prompts as well).
    kind = "audio" if arch.audio_encoder is not None else "image" if arch.multimodal is not None else "text"
    if cfg.workload == kind or (cfg.workload in TOKEN_WORKLOADS and kind in ("text", "image")):
        return resolved
    needs = {"image": "a vision-language model (Llava)", "audio": "a speech model (Whisper)"}
    is_a = {"text": "a text-only model", "image": "a vision-language model", "audio": "a speech model"}
    raise ValueError(
        f"workload={cfg.workload} needs {needs.get(cfg.workload, 'a text model')}; model.model={cfg.model.model!r} "
        f"({arch.architecture}) is {is_a[kind]}: use workload={kind} or another model"
    )
