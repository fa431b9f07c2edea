"""``pprun bench``: offline throughput and latency of pprun, and of a peer on the same workload.

The text workload is ``num_prompts`` random prompts of ``input_len`` token ids (seeded) generating
``output_len`` tokens each, greedy and past EOS, or a JSONL file. pprun warms up on its first
requests (``num_warmup_prompts``: one full batch by default, 16 tokens each), then runs it timed;
its engine is then shut down and Hugging Face transformers' ``generate()`` (the peer, ``peer=hf``)
warms up the same way and runs the same token ids on the same device and dtype, in batches of
``max_num_seqs`` prompts of equal length (so nothing is padded). One JSON object is printed:
pprun's tokens/s, request throughput, TTFT and TPOT percentiles, its steady decode rate
(``decode_tokens_per_s``: the steps after the last prefill while the batch is full, so prefill and
the tail do not dilute it), the configuration facts, the peer's tokens/s and the ratio pprun/peer.

``workload=image`` (a Llava-form model) gives every request ``num_images`` seeded random images of
``image_size`` pixels square, then ``input_len`` random text tokens; the peer is transformers'
``LlavaForConditionalGeneration.generate`` on the same images (through the checkpoint's image
processor) and the same expanded prompt.  ``workload=audio`` (Whisper) gives every request one
clip of ``audio_seconds`` (``audio_source``: the committed speech recordings, or synthetic); the
peer is ``WhisperForConditionalGeneration.generate`` on the same clips, and both sides report
audio seconds per second.  Image and audio preprocessing (pixels, log-mel features) is timed on
both sides.  The JSON has the same shape for every workload; ``greedy_match_fraction`` compares
each request's tokens up to its first EOS.
"""

from __future__ import annotations

import gc
import json
import logging
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pprun.apps import iter_jsonl, job_output_dir, job_output_path
from pprun.checks import is_int
from pprun.config.config import BenchAppConfig
from pprun.config.validate import ResolvedConfig
from pprun.sampling.params import SamplingParams

logger = logging.getLogger(__name__)

PEERS = ("hf", "none")
"""Allowed values of ``peer``."""

WORKLOADS = ("text", "image", "audio")
"""Allowed values of ``workload``."""

AUDIO_SOURCES = ("speech", "synthetic")
"""Allowed values of ``audio_source``."""

SPEECH_DIR = Path(__file__).resolve().parents[2] / "tests" / "data" / "speech"
"""The committed recordings ``audio_source=speech`` tiles (present in a checkout)."""

SAMPLE_RATE = 16000
"""Sample rate of the audio workload's clips (Whisper's)."""

MAX_NUM_IMAGES = 64
MAX_IMAGE_SIZE = 4096

STEADY_DECODE_KEYS = ("decode_tokens_per_s", "decode_ms_per_step", "decode_steps", "decode_batch")
"""Keys of ``EngineTrace.steady_decode`` in the result (null when the run has too few such steps)."""

WARMUP_MAX_TOKENS = 16
"""Warm-up requests generate at most this many tokens: enough to run prefill and decode."""


@dataclass
class BenchRequest:
    """One request of the workload: its prompt token ids and how many tokens to generate."""

    prompt_token_ids: list[int]
    max_tokens: int
    multi_modal_data: dict[str, Any] | None = None
    """workload=image: ``{"image": [HxWx3 uint8 arrays]}``; workload=audio:
    ``{"audio": (samples, 16000)}``."""
    expanded_token_ids: list[int] | None = None
    """workload=image: the prompt with each image token expanded into its placeholder rows (what
    the model runs, and the peer's ``input_ids``); set once the engine is up."""

    @property
    def model_token_ids(self) -> list[int]:
        """The token ids the model runs (images expanded)."""
        return self.prompt_token_ids if self.expanded_token_ids is None else self.expanded_token_ids

    def prompt(self) -> dict[str, Any]:
        """The prompt as ``LLM.generate`` takes it."""
        prompt: dict[str, Any] = {"prompt_token_ids": self.prompt_token_ids}
        if self.multi_modal_data is not None:
            prompt["multi_modal_data"] = self.multi_modal_data
        return prompt


FILE_KEYS = ("prompt", "prompt_token_ids", "max_tokens")
"""The keys a line of ``input_file`` may hold."""


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
    warmup = cfg.num_warmup_prompts
    if warmup is not None and (not is_int(warmup) or warmup < 0):
        raise ValueError(f"num_warmup_prompts={warmup!r} must be an integer of at least 0 (or null: one full batch)")
    if cfg.workload != "text" and cfg.input_file is not None:
        raise ValueError(
            f"input_file={cfg.input_file!r} is for workload=text; workload={cfg.workload} makes its own "
            "requests (drop input_file)"
        )
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


def check_model_for_workload(cfg: BenchAppConfig) -> ResolvedConfig:
    """The model can run the workload (from its config, before the engine starts): image needs a
    vision-language model, audio a speech model, text neither of those.  Returns the run's
    resolved configuration (the engine takes it: validated once)."""
    from pprun.engine.resolve import resolve_config

    resolved = resolve_config(cfg.pprun_config())
    arch = resolved.arch
    # The workload the model runs: audio for a speech model, image for a vision-language one
    # (which runs text prompts as well).
    kind = "audio" if arch.audio_encoder is not None else "image" if arch.multimodal is not None else "text"
    if cfg.workload == kind or (cfg.workload == "text" and kind == "image"):
        return resolved
    needs = {"text": "a text model", "image": "a vision-language model (Llava)", "audio": "a speech model (Whisper)"}
    is_a = {"text": "a text-only model", "image": "a vision-language model", "audio": "a speech model"}
    raise ValueError(
        f"workload={cfg.workload} needs {needs[cfg.workload]}; model.model={cfg.model.model!r} "
        f"({arch.architecture}) is {is_a[kind]}: use workload={kind} or another model"
    )


def check_workload_fits(workload: list[BenchRequest], max_model_len: int) -> None:
    """Every request's prompt (images expanded) and output fit the engine's context: else pprun
    would stop it short while the peer generates it in full, and the two would time different work."""
    for i, r in enumerate(workload):
        if len(r.model_token_ids) + r.max_tokens > max_model_len:
            raise ValueError(
                f"request {i}: {len(r.model_token_ids)} prompt tokens + {r.max_tokens} output tokens exceed "
                f"max_model_len={max_model_len}; raise model.max_model_len or shorten input_len / output_len"
                + (" / num_images" if r.expanded_token_ids is not None else "")
            )


def warmup_prompts(cfg: BenchAppConfig, num_requests: int) -> int:
    """How many requests warm up (``num_warmup_prompts``; None: one full batch of the workload)."""
    if cfg.num_warmup_prompts is not None:
        return cfg.num_warmup_prompts
    return min(num_requests, cfg.scheduler.max_num_seqs)


def random_workload(
    num_prompts: int, input_len: int, output_len: int, vocab_size: int, seed: int
) -> list[BenchRequest]:
    """``num_prompts`` prompts of ``input_len`` uniformly random token ids from a seeded generator."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (num_prompts, input_len), generator=generator)
    return [BenchRequest(row.tolist(), output_len) for row in ids]


def image_workload(
    num_prompts: int,
    input_len: int,
    output_len: int,
    num_images: int,
    image_size: int,
    vocab_size: int,
    image_token_id: int,
    seed: int,
) -> list[BenchRequest]:
    """``num_prompts`` prompts of ``num_images`` image tokens then ``input_len`` random text token
    ids (never the image token), each with its own uniformly random RGB images of ``image_size``
    pixels square, from one seeded generator."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size - 1, (num_prompts, input_len), generator=generator)
    ids += (ids >= image_token_id).long()  # skip the image token id
    pixels = torch.randint(
        0, 256, (num_prompts, num_images, image_size, image_size, 3), dtype=torch.uint8, generator=generator
    )
    return [
        BenchRequest(
            [image_token_id] * num_images + row.tolist(),
            output_len,
            {"image": [img.numpy() for img in images]},
        )
        for row, images in zip(ids, pixels)
    ]


def speech_clips(num_clips: int, seconds: float, seed: int, speech_dir: Path = SPEECH_DIR) -> list:
    """``num_clips`` 16 kHz clips of ``seconds``: the recordings in ``speech_dir`` laid end to end
    (0.5 s of silence after each) and repeated, each clip starting at its own seeded offset within
    one round of them, so no two clips are likely equal."""
    import numpy as np

    from pprun.audio import prepare_audio

    gap = np.zeros(SAMPLE_RATE // 2, dtype=np.float32)
    pieces = [part for p in sorted(speech_dir.iterdir()) for part in (prepare_audio(p).samples, gap)]
    one_round = np.concatenate(pieces)
    length = int(round(seconds * SAMPLE_RATE))
    stream = np.tile(one_round, -(-(length + one_round.shape[0]) // one_round.shape[0]))
    offsets = np.random.default_rng(seed).integers(0, one_round.shape[0], num_clips)
    return [stream[o : o + length].copy() for o in offsets]


def synthetic_clips(num_clips: int, seconds: float, seed: int) -> list:
    """``num_clips`` 16 kHz clips of ``seconds``: three rising tones of seeded pitches and a little
    noise each (audio no model transcribes as words; decoding length is set by ``output_len``)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    t = np.arange(int(round(seconds * SAMPLE_RATE))) / SAMPLE_RATE
    clips = []
    for _ in range(num_clips):
        pitches = rng.uniform(100.0, 2000.0, 3)
        tones = sum(np.sin(2 * np.pi * f * t * (1 + 0.1 * t)) for f in pitches) / 3
        clips.append((0.3 * tones + 0.02 * rng.standard_normal(t.shape)).astype(np.float32))
    return clips


def audio_workload(
    num_prompts: int, seconds: float, source: str, decoder_prompt: list[int], output_len: int, seed: int
) -> list[BenchRequest]:
    """One request per clip (:func:`speech_clips` or :func:`synthetic_clips`), each starting from
    the checkpoint's decoder prompt."""
    clips = speech_clips(num_prompts, seconds, seed) if source == "speech" else synthetic_clips(num_prompts, seconds, seed)
    return [BenchRequest(list(decoder_prompt), output_len, {"audio": (c, SAMPLE_RATE)}) for c in clips]


def read_workload_file(path: str, output_len: int) -> list[tuple[str, dict, int]]:
    """``(where, line object, max_tokens)`` for each line of a JSONL workload, checked for what
    needs no model: only :data:`FILE_KEYS`, ``{"prompt": str}`` (non-empty) or
    ``{"prompt_token_ids": [int >= 0, ...]}`` (non-empty), ``"max_tokens"`` (else ``output_len``)
    an integer of at least 1."""
    entries = []
    for where, obj in iter_jsonl(path):
        unknown = sorted(set(obj) - set(FILE_KEYS))
        if unknown:
            raise ValueError(f"{where}: unknown keys {unknown}; a line may hold {', '.join(FILE_KEYS)}")
        if "prompt_token_ids" in obj:
            ids = obj["prompt_token_ids"]
            if not isinstance(ids, list) or not ids or not all(is_int(t) and t >= 0 for t in ids):
                raise ValueError(f"{where}: prompt_token_ids must be a non-empty list of ints >= 0")
        elif not (isinstance(obj.get("prompt"), str) and obj["prompt"]):
            raise ValueError(f"{where}: needs 'prompt' (a non-empty string) or 'prompt_token_ids'")
        max_tokens = obj.get("max_tokens", output_len)
        if not is_int(max_tokens) or max_tokens < 1:
            raise ValueError(f"{where}: max_tokens={max_tokens!r} must be an int of at least 1")
        entries.append((where, obj, max_tokens))
    if not entries:
        raise ValueError(f"input_file={path!r} holds no requests")
    return entries


def file_workload(entries: list[tuple[str, dict, int]], tokenizer: Any, vocab_size: int) -> list[BenchRequest]:
    """The requests of a JSONL file's entries (:func:`read_workload_file`), token ids checked
    against the vocabulary and text prompts tokenized."""
    requests = []
    for where, obj, max_tokens in entries:
        if "prompt_token_ids" in obj:
            ids = obj["prompt_token_ids"]
            if any(t >= vocab_size for t in ids):
                raise ValueError(
                    f"{where}: prompt_token_ids must be a non-empty list of ints in [0, {vocab_size})"
                )
        else:
            if tokenizer is None:
                raise ValueError(f"{where}: a text prompt needs a tokenizer and this model has none")
            ids = list(tokenizer.encode(obj["prompt"]))
        requests.append(BenchRequest(ids, max_tokens))
    return requests


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (linear interpolation), or None without values."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000.0, 3)


def run_pprun(
    llm: Any, workload: list[BenchRequest], num_warmup_prompts: int, ignore_eos: bool
) -> tuple[dict[str, Any], list[list[int]]]:
    """Warm up, then time ``workload`` through ``llm.generate``: throughput and latency metrics,
    and each request's output token ids."""

    def params(max_tokens: int) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos)

    prompts = [r.prompt() for r in workload]
    warmup = workload[:num_warmup_prompts]
    if warmup:
        llm.generate(prompts[: len(warmup)], [params(min(r.max_tokens, WARMUP_MAX_TOKENS)) for r in warmup])
    from pprun.utils.step_trace import EngineTrace

    # The engine's step trace over the timed run (host clock: three reads per step); the one of
    # PPRUN_STEP_TRACE when set, else one for this run only.
    engine = llm.engine
    own_trace = engine.trace is None
    trace = engine.trace = engine.trace or EngineTrace()
    first_step = len(trace.rows)
    try:
        start = time.perf_counter()
        outputs = llm.generate(prompts, [params(r.max_tokens) for r in workload])
        elapsed_s = time.perf_counter() - start
    finally:
        if own_trace:
            engine.trace = None
    num_prompt_tokens = sum(len(r.model_token_ids) for r in workload)
    num_output_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    ttfts = [o.metrics.time_to_first_token for o in outputs if o.metrics.time_to_first_token is not None]
    tpots = [o.metrics.time_per_output_token for o in outputs if o.metrics.time_per_output_token is not None]
    metrics = {
        "elapsed_s": round(elapsed_s, 4),
        "num_output_tokens": num_output_tokens,
        "output_tokens_per_s": round(num_output_tokens / elapsed_s, 2),
        "total_tokens_per_s": round((num_prompt_tokens + num_output_tokens) / elapsed_s, 2),
        "requests_per_s": round(len(workload) / elapsed_s, 3),
        "ttft_ms_p50": _ms(percentile(ttfts, 50)),
        "ttft_ms_p99": _ms(percentile(ttfts, 99)),
        "tpot_ms_p50": _ms(percentile(tpots, 50)),
        "tpot_ms_p99": _ms(percentile(tpots, 99)),
        # Steady decode: answered steps after the last prefill while the batch is full (None
        # when too few such steps); the whole-run rates above include prefill and the tail.
        **(trace.steady_decode(since=first_step) or dict.fromkeys(STEADY_DECODE_KEYS)),
    }
    return metrics, [list(o.outputs[0].token_ids) for o in outputs]


def peer_batches(workload: list[BenchRequest], batch_size: int) -> list[list[BenchRequest]]:
    """Requests grouped by (prompt length, max_tokens), in chunks of at most ``batch_size``, so each
    batch runs unpadded and every row generates the same number of tokens."""
    groups: dict[tuple[int, int], list[BenchRequest]] = {}
    for r in workload:
        groups.setdefault((len(r.model_token_ids), r.max_tokens), []).append(r)
    return [g[i : i + batch_size] for g in groups.values() for i in range(0, len(g), batch_size)]


def until_eos(tokens: Sequence[int], eos_token_ids: set[int]) -> list[int]:
    """``tokens`` up to and including the first EOS (all of them without one)."""
    out = []
    for t in tokens:
        out.append(int(t))
        if t in eos_token_ids:
            break
    return out


def greedy_match_fraction(
    ours: list[list[int]], theirs: list[list[int]], eos_token_ids: set[int], ignore_eos: bool
) -> float:
    """The fraction of requests on which pprun and the peer generated the same tokens.  Without
    ``ignore_eos`` both stop at EOS and must agree up to it; with it, they must agree before
    pprun's first EOS, past which they need not: pprun samples on from the EOS while the peer
    (EOS suppressed by ``min_new_tokens``) never sampled it."""
    same = 0
    for a, b in zip(ours, theirs):
        if not ignore_eos:
            same += until_eos(a, eos_token_ids) == until_eos(b, eos_token_ids)
            continue
        head = until_eos(a, eos_token_ids)
        if head and head[-1] in eos_token_ids:
            head = head[:-1]
        same += list(b[: len(head)]) == head
    return round(same / len(ours), 3) if ours else 0.0


def _sync(device: str) -> None:
    if str(device).startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def time_peer(
    workload: list[BenchRequest],
    batch_size: int,
    num_warmup_prompts: int,
    device: str,
    generate: Callable[[list[BenchRequest], int], list[list[int]]],
) -> tuple[float, list[BenchRequest], list[list[int]], int]:
    """Warm ``generate(batch, max_new_tokens)`` up on the first batch (at most 16 tokens), then
    time it over the workload's :func:`peer_batches`; ``(elapsed_s, batches, each request's
    tokens in workload order, number of batches)``."""
    batches = peer_batches(workload, batch_size)
    if num_warmup_prompts > 0:
        first = batches[0][: max(1, min(num_warmup_prompts, batch_size))]
        generate(first, min(first[0].max_tokens, WARMUP_MAX_TOKENS))
        _sync(device)
    start = time.perf_counter()
    batch_outputs = [generate(b, b[0].max_tokens) for b in batches]
    _sync(device)
    elapsed_s = time.perf_counter() - start
    tokens_by_request = {id(r): row for b, o in zip(batches, batch_outputs) for r, row in zip(b, o)}
    return elapsed_s, batches, [tokens_by_request[id(r)] for r in workload], len(batches)


def peer_metrics(
    name: str, elapsed_s: float, num_batches: int, workload: list[BenchRequest], tokens: list[list[int]]
) -> dict[str, Any]:
    """The peer's throughput metrics (the same names as pprun's)."""
    num_output_tokens = sum(len(t) for t in tokens)
    num_prompt_tokens = sum(len(r.model_token_ids) for r in workload)
    return {
        "name": name,
        "elapsed_s": round(elapsed_s, 4),
        "num_batches": num_batches,
        "num_output_tokens": num_output_tokens,
        "output_tokens_per_s": round(num_output_tokens / elapsed_s, 2),
        "total_tokens_per_s": round((num_prompt_tokens + num_output_tokens) / elapsed_s, 2),
        "requests_per_s": round(len(workload) / elapsed_s, 3),
    }


def _generation_kwargs(max_new_tokens: int, ignore_eos: bool) -> dict[str, Any]:
    # min_new_tokens == max_new_tokens suppresses EOS: every row runs the full length, as
    # pprun's ignore_eos does.
    kwargs: dict[str, Any] = {"do_sample": False, "max_new_tokens": max_new_tokens}
    if ignore_eos:
        kwargs["min_new_tokens"] = max_new_tokens
    return kwargs


def _rows(new_tokens: Any, eos_token_ids: set[int], ignore_eos: bool) -> list[list[int]]:
    """Each row of a batch's new tokens as the tokens it generated: all of them with
    ``ignore_eos``, else up to its EOS (the rest is padding after a row finished)."""
    rows = [row.tolist() for row in new_tokens]
    return rows if ignore_eos else [until_eos(row, eos_token_ids) for row in rows]


def _pad_id(config: Any, eos_token_ids: set[int]) -> int:
    pad = getattr(config, "pad_token_id", None)
    if pad is None:
        pad = min(eos_token_ids)
    return pad[0] if isinstance(pad, list) else int(pad)


def run_hf_peer(
    model_dir: str,
    device: str,
    dtype: str,
    workload: list[BenchRequest],
    batch_size: int,
    num_warmup_prompts: int,
    ignore_eos: bool = True,
    eos_token_ids: set[int] | None = None,
) -> tuple[dict[str, Any], list[list[int]]]:
    """Time transformers' ``generate`` (greedy; exactly ``max_tokens`` new tokens with
    ``ignore_eos``, else up to EOS) on a text workload: throughput metrics, and each request's
    output token ids (in workload order)."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    torch_dtype = getattr(torch, dtype)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype).to(device).eval()
    eos = model.config.eos_token_id
    eos_ids = set(eos_token_ids or ([eos] if isinstance(eos, int) else eos or []))
    pad = _pad_id(model.config, eos_ids)

    def generate(batch: list[BenchRequest], max_new_tokens: int) -> list[list[int]]:
        ids = torch.tensor([r.prompt_token_ids for r in batch], device=device)
        gen_cfg = GenerationConfig(
            **_generation_kwargs(max_new_tokens, ignore_eos), pad_token_id=pad, eos_token_id=sorted(eos_ids) or eos
        )
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=gen_cfg)
        return _rows(out[:, ids.shape[1] :], eos_ids, ignore_eos)

    elapsed_s, _, tokens, num_batches = time_peer(workload, batch_size, num_warmup_prompts, device, generate)
    return peer_metrics("transformers.generate", elapsed_s, num_batches, workload, tokens), tokens


def run_hf_image_peer(
    model_dir: str,
    device: str,
    dtype: str,
    workload: list[BenchRequest],
    batch_size: int,
    num_warmup_prompts: int,
    ignore_eos: bool,
    eos_token_ids: set[int],
) -> tuple[dict[str, Any], list[list[int]]]:
    """Time transformers' ``LlavaForConditionalGeneration.generate`` on an image workload: the
    checkpoint's image processor (timed) on the same images, the prompt expanded as pprun runs it
    (transformers checks it holds one image token per embedding row)."""
    import torch
    from transformers import AutoImageProcessor, LlavaForConditionalGeneration

    torch_dtype = getattr(torch, dtype)
    model = LlavaForConditionalGeneration.from_pretrained(model_dir, dtype=torch_dtype).to(device).eval()
    processor = AutoImageProcessor.from_pretrained(model_dir)
    pad = _pad_id(model.config.text_config, eos_token_ids)

    def generate(batch: list[BenchRequest], max_new_tokens: int) -> list[list[int]]:
        images = [img for r in batch for img in r.multi_modal_data["image"]]
        pixels = processor(images, return_tensors="pt")["pixel_values"].to(device, torch_dtype)
        ids = torch.tensor([r.expanded_token_ids for r in batch], device=device)
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=pixels,
                pad_token_id=pad, eos_token_id=sorted(eos_token_ids), **_generation_kwargs(max_new_tokens, ignore_eos),
            )
        return _rows(out[:, ids.shape[1] :], eos_token_ids, ignore_eos)

    elapsed_s, _, tokens, num_batches = time_peer(workload, batch_size, num_warmup_prompts, device, generate)
    metrics = peer_metrics("transformers.LlavaForConditionalGeneration.generate", elapsed_s, num_batches, workload, tokens)
    metrics["images_per_s"] = round(sum(len(r.multi_modal_data["image"]) for r in workload) / elapsed_s, 3)
    return metrics, tokens


def run_hf_audio_peer(
    model_dir: str,
    device: str,
    dtype: str,
    workload: list[BenchRequest],
    batch_size: int,
    num_warmup_prompts: int,
    ignore_eos: bool,
    eos_token_ids: set[int],
) -> tuple[dict[str, Any], list[list[int]]]:
    """Time transformers' ``WhisperForConditionalGeneration.generate`` (its generation config:
    decoder prompt, suppress lists) on an audio workload, log-mel features included (timed)."""
    import torch
    from transformers import WhisperFeatureExtractor, WhisperForConditionalGeneration

    torch_dtype = getattr(torch, dtype)
    model = WhisperForConditionalGeneration.from_pretrained(model_dir, dtype=torch_dtype).to(device).eval()
    features = WhisperFeatureExtractor.from_pretrained(model_dir)

    def generate(batch: list[BenchRequest], max_new_tokens: int) -> list[list[int]]:
        clips = [r.multi_modal_data["audio"][0] for r in batch]
        feats = features(clips, sampling_rate=SAMPLE_RATE, return_tensors="pt").input_features
        with torch.inference_mode():
            out = model.generate(feats.to(device, torch_dtype), **_generation_kwargs(max_new_tokens, ignore_eos))
        rows = _rows(out, eos_token_ids, ignore_eos)
        if not ignore_eos and out.shape[1] < max_new_tokens:
            # Whisper's generate returns the new tokens only, and drops the EOS that ended the
            # longest row: every row that stopped short ended with one (pprun counts it).
            rows = [row if row and row[-1] in eos_token_ids else [*row, min(eos_token_ids)] for row in rows]
        return rows

    elapsed_s, _, tokens, num_batches = time_peer(workload, batch_size, num_warmup_prompts, device, generate)
    metrics = peer_metrics("transformers.WhisperForConditionalGeneration.generate", elapsed_s, num_batches, workload,
                           tokens)
    metrics["audio_seconds_per_s"] = round(total_audio_seconds(workload) / elapsed_s, 2)
    return metrics, tokens


def total_audio_seconds(workload: list[BenchRequest]) -> float:
    """Seconds of audio in an audio workload."""
    return sum(r.multi_modal_data["audio"][0].shape[0] / r.multi_modal_data["audio"][1] for r in workload)


def _free_device_memory(device: str) -> None:
    gc.collect()
    if str(device).startswith("cuda"):
        import torch

        torch.cuda.empty_cache()


def build_workload(cfg: BenchAppConfig, engine: Any, entries: list[tuple[str, dict, int]] | None) -> tuple[list[BenchRequest], str]:
    """The requests of ``cfg``'s workload for the started ``engine`` and where they came from;
    image prompts are expanded as the engine runs them (:attr:`BenchRequest.expanded_token_ids`)."""
    if cfg.workload == "image":
        mm = engine.resolved.arch.multimodal
        workload = image_workload(
            cfg.num_prompts, cfg.input_len, cfg.output_len, cfg.num_images, cfg.image_size,
            engine.vocab_size, int(mm["image_token_index"]), cfg.workload_seed,
        )
        for i, r in enumerate(workload):
            r.expanded_token_ids = engine.inputs.process_prompt(r.prompt(), f"request {i}").token_ids
        return workload, "random"
    if cfg.workload == "audio":
        speech = engine.inputs.speech
        if cfg.audio_seconds > speech.window_seconds:
            raise ValueError(
                f"audio_seconds={cfg.audio_seconds!r} is longer than one window of model {cfg.model.model!r} "
                f"({speech.window_seconds:g} s): one request takes at most one window"
            )
        room = speech.max_target_positions - len(speech.decoder_prompt)
        if cfg.output_len > room:
            raise ValueError(
                f"output_len={cfg.output_len} is past model {cfg.model.model!r}'s max_target_positions="
                f"{speech.max_target_positions} after its {len(speech.decoder_prompt)}-token decoder prompt: "
                f"output_len may be at most {room} (workload=audio)"
            )
        workload = audio_workload(
            cfg.num_prompts, cfg.audio_seconds, cfg.audio_source, speech.decoder_prompt, cfg.output_len,
            cfg.workload_seed,
        )
        return workload, cfg.audio_source
    if entries is not None:
        return file_workload(entries, engine.tokenizer, engine.vocab_size), str(cfg.input_file)
    workload = random_workload(cfg.num_prompts, cfg.input_len, cfg.output_len, engine.vocab_size, cfg.workload_seed)
    return workload, "random"


def workload_facts(cfg: BenchAppConfig, workload: list[BenchRequest], source: str, num_warmup: int) -> dict[str, Any]:
    """The result's ``"workload"`` object."""
    generated = cfg.input_file is None
    facts: dict[str, Any] = {
        "type": cfg.workload,
        "source": source,
        "num_prompts": len(workload),
        "num_warmup_prompts": num_warmup,
        "input_len": cfg.input_len if generated and cfg.workload != "audio" else None,
        "output_len": cfg.output_len if generated else None,
        "num_prompt_tokens": sum(len(r.model_token_ids) for r in workload),
        "ignore_eos": cfg.ignore_eos,
        "seed": cfg.workload_seed if generated else None,
    }
    if cfg.workload == "image":
        facts.update(
            num_images=cfg.num_images,
            image_size=cfg.image_size,
            image_tokens_per_request=len(workload[0].model_token_ids) - cfg.input_len,
        )
    if cfg.workload == "audio":
        facts.update(
            audio_seconds=cfg.audio_seconds,
            audio_source=cfg.audio_source,
            total_audio_seconds=round(total_audio_seconds(workload), 3),
        )
    return facts


def run(cfg: BenchAppConfig) -> dict[str, Any]:
    """Benchmark pprun (and the peer) on ``cfg``'s workload; print and return the result object."""
    from pprun.engine.llm import LLM

    entries = check_bench_config(cfg)
    resolved = check_model_for_workload(cfg)
    llm = LLM(config=resolved)
    try:
        engine = llm.engine
        workload, source = build_workload(cfg, engine, entries)
        check_workload_fits(workload, engine.max_model_len)
        facts = llm.describe()
        model_dir = str(engine.resolved.model_dir)
        eos_token_ids = set(engine.eos_token_ids)
        logger.info("bench: %d %s requests (%s), timing pprun", len(workload), cfg.workload, source)
        num_warmup = warmup_prompts(cfg, len(workload))
        pprun_result, pprun_tokens = run_pprun(llm, workload, num_warmup, cfg.ignore_eos)
    finally:
        # The peer loads a second copy of the weights: free pprun's stages (and KV cache) first.
        llm.shutdown()
        del llm
        _free_device_memory(str(cfg.device))
    if cfg.workload == "image":
        pprun_result["images_per_s"] = round(cfg.num_images * len(workload) / pprun_result["elapsed_s"], 3)
    if cfg.workload == "audio":
        pprun_result["audio_seconds_per_s"] = round(total_audio_seconds(workload) / pprun_result["elapsed_s"], 2)
    result: dict[str, Any] = {
        "workload": workload_facts(cfg, workload, source, num_warmup),
        "config": {
            "model": facts.get("model"),
            "runner": facts.get("runner"),
            "executor": facts.get("executor"),
            "pp": facts.get("pipeline_parallel_size"),
            "layer_partition": facts.get("layer_partition"),
            "device": facts.get("device"),
            "dtype": facts.get("dtype"),
            "batch": cfg.scheduler.max_num_seqs,
            "steps_in_flight": facts.get("steps_in_flight"),
            "async_scheduling": facts.get("async_scheduling"),
            "async_pipeline_steps": facts.get("async_pipeline_steps"),
            # CUDA graphs are only captured on GPU.
            "cudagraph_mode": cfg.compilation.cudagraph_mode
            if str(facts.get("device")).startswith("cuda")
            else "none",
        },
        "pprun": pprun_result,
        "peer": None,
        "ratio": None,
    }
    overrides = job_overrides()
    if overrides is not None:
        # What the user set for this run: `pprun report` tells the swept settings by them.
        result["overrides"] = overrides
    if cfg.peer == "hf":
        peer_fn = {"text": run_hf_peer, "image": run_hf_image_peer, "audio": run_hf_audio_peer}[cfg.workload]
        logger.info("bench: timing the peer (transformers, batch %d)", cfg.scheduler.max_num_seqs)
        peer, peer_tokens = peer_fn(
            model_dir,
            facts["device"],
            facts["dtype"],
            workload,
            cfg.scheduler.max_num_seqs,
            num_warmup,
            cfg.ignore_eos,
            eos_token_ids,
        )
        _free_device_memory(facts["device"])
        # Both are greedy on the same inputs: a low fraction flags a correctness problem (small
        # numeric differences can flip a near-tie, so 1.0 is not guaranteed in half precision).
        peer["greedy_match_fraction"] = greedy_match_fraction(pprun_tokens, peer_tokens, eos_token_ids, cfg.ignore_eos)
        result["peer"] = peer
        result["ratio"] = round(pprun_result["output_tokens_per_s"] / peer["output_tokens_per_s"], 3)
    text = json.dumps(result, indent=2)
    print(text, flush=True)
    out_paths = [p for p in (job_output_path(cfg.output_json),) if p is not None]
    sweep_dir = job_output_dir()
    if sweep_dir is not None and not out_paths:
        # A sweep prints one object per job; keep each in its job folder too.
        out_paths.append(sweep_dir / "bench.json")
    for path in out_paths:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")
        logger.info("bench: wrote %s", path)
    return result


def job_overrides() -> dict[str, str] | None:
    """This Hydra job's command-line overrides as ``{key: value}`` (a sweep job's own values), or
    None outside Hydra."""
    try:
        from hydra.core.hydra_config import HydraConfig
    except ImportError:
        return None
    if not HydraConfig.initialized():
        return None
    overrides = {}
    for item in HydraConfig.get().overrides.task:
        key, sep, value = item.partition("=")
        if sep:
            overrides[key.lstrip("+~")] = value
    return overrides


try:
    from hydra.experimental.callback import Callback as _HydraCallback
except ImportError:  # Hydra is optional for the Python API; the callback only runs under it
    _HydraCallback = object


class SweepReport(_HydraCallback):
    """Hydra callback (``hydra.callbacks`` in ``conf/bench.yaml``): when a ``pprun bench -m`` sweep
    ends, render its table and plot into the sweep directory (:mod:`pprun.apps.report`)."""

    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        """Render the report of the sweep just finished; a failure to render is logged, not raised,
        so the runs' JSONs stay the sweep's result (``pprun report DIR`` renders again)."""
        from pprun.apps.report import render_report

        sweep_dir = str(config.hydra.sweep.dir)
        try:
            paths = render_report(sweep_dir)
        except Exception as e:  # a plotting error must not hide the finished runs
            logger.error("bench: no sweep report for %s (%s: %s)", sweep_dir, type(e).__name__, e)
            return
        for path in paths.values():
            print(f"bench: wrote {path}", file=sys.stderr, flush=True)


def main() -> None:
    """Entry point of ``pprun bench``: ``sys.argv[1:]`` are Hydra overrides."""
    from pprun.apps import run_hydra_app

    run_hydra_app("bench", run)


if __name__ == "__main__":
    main()
