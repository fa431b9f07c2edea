"""The requests ``pprun bench`` times: one builder per workload, the warm-up set, and the
workload's facts in the result.

Every builder is seeded (``workload_seed``) and returns :class:`BenchRequest` objects, the one
form every engine (pprun and each peer) runs.  The warm-up requests have the timed requests' shape
but their own seed, so that an engine that caches prompt prefixes finds none of the timed prompts
already cached.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pprun.apps import iter_jsonl
from pprun.checks import is_int
from pprun.config.config import BenchAppConfig

WORKLOADS = ("text", "image", "audio", "chat", "shared_prefix")
"""Allowed values of ``workload``."""

TOKEN_WORKLOADS = ("text", "chat", "shared_prefix")
"""Workloads whose requests are token ids only (any causal language model runs them)."""

AUDIO_SOURCES = ("speech", "synthetic")
"""Allowed values of ``audio_source``."""

SPEECH_DIR = Path(__file__).resolve().parents[3] / "tests" / "data" / "speech"
"""The committed recordings ``audio_source=speech`` tiles (present in a checkout)."""

SAMPLE_RATE = 16000
"""Sample rate of the audio workload's clips (Whisper's)."""

MAX_NUM_IMAGES = 64
MAX_IMAGE_SIZE = 4096

WARMUP_MAX_TOKENS = 16
"""Warm-up requests generate at most this many tokens: enough to run prefill and decode."""

WARMUP_SEED_OFFSET = 1_000_003
"""The warm-up requests' seed is ``workload_seed`` plus this: the same shape, other prompts."""

FILE_KEYS = ("prompt", "prompt_token_ids", "max_tokens")
"""The keys a line of ``input_file`` may hold."""

CHAT_WORDS = (
    "the of and to in is you that it he was for on are as with his they at be this have from or one had by "
    "word but not what all were we when your can said there use an each which she do how their if will up "
    "other about out many then them these so some her would make like him into time has look two more write "
    "go see number no way could people my than first water been call who oil its now find long down day did "
    "get come made may part over new sound take only little work know place year live me back give most very "
    "after thing our just name good sentence man think say great where help through much before line right"
).split()
"""The words ``workload=chat`` draws its user messages from (common English words: about one
token each for most tokenizers)."""


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
    the model runs, and the transformers peer's ``input_ids``); set once the engine is up."""

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

    def for_warmup(self) -> BenchRequest:
        """The same request generating at most :data:`WARMUP_MAX_TOKENS` tokens."""
        return BenchRequest(
            self.prompt_token_ids, min(self.max_tokens, WARMUP_MAX_TOKENS), self.multi_modal_data,
            self.expanded_token_ids,
        )  # fmt: skip


@dataclass
class Workload:
    """The timed requests, the warm-up requests run before them, and where the prompts came from."""

    requests: list[BenchRequest]
    warmup: list[BenchRequest]
    source: str
    """"random", the ``input_file`` path, or the audio source."""


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


def shared_prefix_workload(
    num_prompts: int, prefix_len: int, input_len: int, output_len: int, vocab_size: int, seed: int
) -> list[BenchRequest]:
    """``num_prompts`` prompts that share their first ``prefix_len`` random token ids (a common
    system prompt), each followed by its own ``input_len`` random token ids, from one seeded
    generator."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    prefix = torch.randint(0, vocab_size, (prefix_len,), generator=generator).tolist()
    own = torch.randint(0, vocab_size, (num_prompts, input_len), generator=generator)
    return [BenchRequest(prefix + row.tolist(), output_len) for row in own]


def chat_messages(num_prompts: int, input_len: int, seed: int) -> list[list[dict[str, str]]]:
    """``num_prompts`` one-turn conversations, each a user message of ``input_len`` words drawn
    from :data:`CHAT_WORDS` by a seeded generator."""
    import numpy as np

    rng = np.random.default_rng(seed)
    return [
        [{"role": "user", "content": " ".join(CHAT_WORDS[i] for i in rng.integers(0, len(CHAT_WORDS), input_len))}]
        for _ in range(num_prompts)
    ]


def chat_workload(
    conversations: list[list[dict[str, str]]], output_len: int, render: Any
) -> list[BenchRequest]:
    """The conversations rendered through the model's chat template (``render(conversation,
    where)`` returns ``{"prompt_token_ids": [...], ...}``, as ``LLMEngine.render_chat`` does)."""
    return [
        BenchRequest(list(render(conv, f"conversation {i}")["prompt_token_ids"]), output_len)
        for i, conv in enumerate(conversations)
    ]


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


def total_audio_seconds(workload: list[BenchRequest]) -> float:
    """Seconds of audio in an audio workload."""
    return sum(r.multi_modal_data["audio"][0].shape[0] / r.multi_modal_data["audio"][1] for r in workload)


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


def build_workload(
    cfg: BenchAppConfig, engine: Any, entries: list[tuple[str, dict, int]] | None, num_warmup: int
) -> Workload:
    """The requests of ``cfg``'s workload for the started ``engine``, its ``num_warmup`` warm-up
    requests, and where they came from; image prompts are expanded as the engine runs them
    (:attr:`BenchRequest.expanded_token_ids`)."""
    if entries is not None:
        requests = file_workload(entries, engine.tokenizer, engine.vocab_size)
        # A file has no seed to vary: its first requests warm up.
        return Workload(requests, [r.for_warmup() for r in requests[:num_warmup]], str(cfg.input_file))
    if cfg.workload == "audio":
        _check_audio_fits(cfg, engine.inputs.speech)
    seed = cfg.workload_seed
    num_warmup = min(num_warmup, cfg.num_prompts)  # never more than the timed requests
    requests = _generate(cfg, engine, cfg.num_prompts, seed)
    warmup = _generate(cfg, engine, num_warmup, seed + WARMUP_SEED_OFFSET) if num_warmup else []
    source = cfg.audio_source if cfg.workload == "audio" else "random"
    return Workload(requests, [r.for_warmup() for r in warmup], source)


def _generate(cfg: BenchAppConfig, engine: Any, num_prompts: int, seed: int) -> list[BenchRequest]:
    """``num_prompts`` requests of ``cfg``'s generated workload from ``seed``."""
    if cfg.workload == "image":
        mm = engine.resolved.arch.multimodal
        requests = image_workload(
            num_prompts, cfg.input_len, cfg.output_len, cfg.num_images, cfg.image_size,
            engine.vocab_size, int(mm["image_token_index"]), seed,
        )  # fmt: skip
        for i, r in enumerate(requests):
            r.expanded_token_ids = engine.inputs.process_prompt(r.prompt(), f"request {i}").token_ids
        return requests
    if cfg.workload == "audio":
        speech = engine.inputs.speech
        return audio_workload(
            num_prompts, cfg.audio_seconds, cfg.audio_source, speech.decoder_prompt, cfg.output_len, seed
        )
    if cfg.workload == "chat":
        return chat_workload(chat_messages(num_prompts, cfg.input_len, seed), cfg.output_len, engine.inputs.render_chat)
    if cfg.workload == "shared_prefix":
        return shared_prefix_workload(
            num_prompts, cfg.prefix_len, cfg.input_len, cfg.output_len, engine.vocab_size, seed
        )
    return random_workload(num_prompts, cfg.input_len, cfg.output_len, engine.vocab_size, seed)


def _check_audio_fits(cfg: BenchAppConfig, speech: Any) -> None:
    """One clip fits one window of the model, and ``output_len`` its decoder positions."""
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


def workload_facts(cfg: BenchAppConfig, workload: Workload) -> dict[str, Any]:
    """The result's ``"workload"`` object."""
    requests = workload.requests
    generated = cfg.input_file is None
    facts: dict[str, Any] = {
        "type": cfg.workload,
        "source": workload.source,
        "num_prompts": len(requests),
        "num_warmup_prompts": len(workload.warmup),
        "input_len": cfg.input_len if generated and cfg.workload != "audio" else None,
        "output_len": cfg.output_len if generated else None,
        "num_prompt_tokens": sum(len(r.model_token_ids) for r in requests),
        "ignore_eos": cfg.ignore_eos,
        "seed": cfg.workload_seed if generated else None,
    }
    if cfg.workload == "image":
        facts.update(
            num_images=cfg.num_images,
            image_size=cfg.image_size,
            image_tokens_per_request=len(requests[0].model_token_ids) - cfg.input_len,
        )
    if cfg.workload == "audio":
        facts.update(
            audio_seconds=cfg.audio_seconds,
            audio_source=cfg.audio_source,
            total_audio_seconds=round(total_audio_seconds(requests), 3),
        )
    if cfg.workload == "shared_prefix":
        facts["prefix_len"] = cfg.prefix_len
    return facts


def workload_rates(cfg: BenchAppConfig, requests: list[BenchRequest], elapsed_s: float) -> dict[str, float]:
    """The workload's own rates over a timed run: images per second (image), audio seconds per
    second (audio); nothing for token workloads."""
    if cfg.workload == "image":
        return {"images_per_s": round(sum(len(r.multi_modal_data["image"]) for r in requests) / elapsed_s, 3)}
    if cfg.workload == "audio":
        return {"audio_seconds_per_s": round(total_audio_seconds(requests) / elapsed_s, 2)}
    return {}
