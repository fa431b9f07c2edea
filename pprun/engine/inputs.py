"""What a request's input goes through before it is queued: prompt and sampling-parameter checks,
tokenization, chat templates, image and audio processing, and decoding token ids back to text.

:class:`LLMEngine` holds an :class:`InputProcessor` (``engine.inputs``: offline requests and the
in-process async engine use its checks); the server process of ``pprun serve`` with
``serve.engine_process`` builds one of its own, next to no model, so that it validates, tokenizes
and detokenizes while the engine process only steps.  Both are built from the run's
:class:`~pprun.config.validate.ResolvedConfig`; neither validates the configuration again.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pprun.checks import is_int
from pprun.config.validate import ResolvedConfig
from pprun.sampling.params import SamplingParams

logger = logging.getLogger(__name__)


class InputProcessor:
    """Checks and processes one model's prompts and sampling parameters, without the model.

    ``tokenizer`` is None for a checkpoint without one (token-id prompts only, no text out).
    ``encoder_budget`` gives the scheduler's encoder budget (the most encoder output rows one image
    may take) where a scheduler is at hand (the engine's processor); without it (a server's own
    processor) the engine checks that when the request is added.
    """

    def __init__(
        self, resolved: ResolvedConfig, tokenizer: Any, *, encoder_budget: Callable[[], int] | None = None
    ) -> None:
        self.cfg = resolved.cfg
        self.resolved = resolved
        self._encoder_budget_of = encoder_budget
        self.tokenizer = tokenizer
        self.vocab_size = resolved.arch.vocab_size
        self.max_model_len = resolved.max_model_len
        self.max_logprobs = resolved.cfg.model.max_logprobs
        self.speech = None
        """``pprun.engine.speech.SpeechRequests`` of a speech model (Whisper), else None."""
        if resolved.arch.audio_encoder is not None:
            from pprun.engine.speech import SpeechRequests

            self.speech = SpeechRequests(
                resolved.model_dir, resolved.arch.max_position_embeddings,
                resolved.arch.audio_encoder.max_source_positions,
            )  # fmt: skip
        self._image_processor = None

    @classmethod
    def for_config(cls, resolved: ResolvedConfig) -> InputProcessor:
        """The processor of ``resolved``'s model, its tokenizer loaded."""
        return cls(resolved, load_tokenizer(str(resolved.tokenizer_dir)))

    def _encoder_budget(self) -> int | None:
        """Encoder output rows one image may take (the scheduler's budget); None where no
        scheduler is at hand (a server's own processor: the engine checks when the request is
        added)."""
        return None if self._encoder_budget_of is None else self._encoder_budget_of()

    def check_params(self, params: object, where: str) -> None:
        """Validate one request's sampling parameters, alone and against this model; raise
        ValueError naming ``where``, the field and the value."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"{where} has type {type(params).__name__}: must be a SamplingParams")
        try:
            params.validate()
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
        if params.logprobs is not None and params.logprobs > self.vocab_size:
            raise ValueError(f"{where}: SamplingParams.logprobs={params.logprobs} is invalid: must be at most "
                             f"the vocabulary size {self.vocab_size}")
        if params.logprobs is not None and params.logprobs > self.max_logprobs:
            raise ValueError(f"{where}: SamplingParams.logprobs={params.logprobs} is invalid: must be at most "
                             f"model.max_logprobs={self.max_logprobs} (the engine's setting)")

    def output_room(self, num_prompt_tokens: int) -> int:
        """Output tokens the context leaves after a prompt of ``num_prompt_tokens``."""
        return self.max_model_len - num_prompt_tokens

    def check_output_room(self, num_prompt_tokens: int, params: SamplingParams, where: str) -> None:
        """Raise ValueError when ``params.max_tokens`` asks for more tokens than the context leaves
        after the prompt (naming both numbers); ``max_tokens=None`` asks for as many as it leaves."""
        room = self.output_room(num_prompt_tokens)
        if params.max_tokens is not None and params.max_tokens > room:
            raise ValueError(
                f"{where}: SamplingParams.max_tokens={params.max_tokens} is invalid: the prompt has "
                f"{num_prompt_tokens} tokens and max_model_len={self.max_model_len} leaves room for {room} "
                f"output tokens; ask for at most {room}, or max_tokens=None for as many as the context leaves"
            )

    def check_prompt(self, prompt: object, where: str) -> tuple[str | None, list[int]]:
        """Tokenise and validate one text prompt; raise ValueError naming ``where`` and the value
        (a prompt with ``multi_modal_data`` goes through :meth:`process_prompt`)."""
        checked = self.process_prompt(prompt, where)
        if checked.mm_items:
            raise ValueError(f"{where}: multi_modal_data is not taken on this path; use LLM.generate")
        return checked.text, checked.token_ids

    def process_prompt(self, prompt: object, where: str) -> ProcessedPrompt:
        """Tokenise and validate one prompt, and process its ``multi_modal_data`` (images expanded
        into their placeholder ranges); raise ValueError naming ``where``, the field and the value.

        A prompt is a str, or a dict with ``prompt`` (text) or ``prompt_token_ids``, and optionally
        ``multi_modal_data`` (``{"image": <image or list of images>}``); any other key is an error.
        """
        if self.speech is not None:
            return self._process_speech_prompt(prompt, where)
        if isinstance(prompt, str):
            prompt = {"prompt": prompt}
        if not isinstance(prompt, dict) or not ("prompt_token_ids" in prompt or "prompt" in prompt):
            raise ValueError(
                f"{where}={_short(prompt)} has type {type(prompt).__name__}: a prompt must be a "
                "str or a dict with 'prompt' (a str) or 'prompt_token_ids' (a list of ints)"
            )
        unknown = sorted(set(prompt) - _PROMPT_KEYS)
        if unknown:
            raise ValueError(
                f"{where} has unknown key(s) {unknown}: a prompt dict takes only {sorted(_PROMPT_KEYS)}"
            )
        text = prompt.get("prompt")
        if "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            if not isinstance(ids, (list, tuple)):
                raise ValueError(
                    f"{where}.prompt_token_ids={_short(ids)} is invalid: must be a list of ints"
                )
            ids = list(ids)
            # At C speed when every id is a plain int in the vocabulary (the element types as a
            # set, then min and max): a server validates a burst of requests one after another on
            # its event loop, and the element-by-element checks below cost 0.1-0.2 ms for 512 ids.
            # They run only to find and name what is wrong.
            if not ids or set(map(type, ids)) != {int} or min(ids) < 0 or max(ids) >= self.vocab_size:
                if not all(is_int(t) for t in ids):
                    raise ValueError(
                        f"{where}.prompt_token_ids={_short(ids)} is invalid: must be a list of ints"
                    )
                for i, t in enumerate(ids):
                    if not 0 <= t < self.vocab_size:
                        raise ValueError(
                            f"{where}.prompt_token_ids[{i}]={t} is outside the vocabulary: "
                            f"token ids must be in [0, {self.vocab_size})"
                        )
        else:
            if not isinstance(text, str):
                raise ValueError(f"{where}.prompt={_short(text)} has type {type(text).__name__}: must be a str")
            if not text:
                raise ValueError(f"{where}: prompt is empty ('')")
            if self.tokenizer is None:
                raise ValueError(
                    f"{where}: a text prompt needs a tokenizer and model {self.cfg.model.model!r} "
                    "has none; pass {'prompt_token_ids': [...]}"
                )
            ids = self.tokenizer.encode(text)
        mm_items = []
        if prompt.get("multi_modal_data") is not None:
            ids, mm_items = self._process_multi_modal(ids, prompt["multi_modal_data"], where)
        elif self.resolved.arch.multimodal is not None:
            self._check_no_image_tokens(ids, where)
        if not ids:
            raise ValueError(f"{where}: prompt has 0 tokens; it must have at least 1")
        if len(ids) >= self.max_model_len:
            expanded = " after its images were expanded into their placeholder tokens" if mm_items else ""
            raise ValueError(
                f"{where}: prompt has {len(ids)} tokens{expanded}; with max_model_len={self.max_model_len} "
                f"a prompt may have at most {self.max_model_len - 1} (room for one output token)"
            )
        return ProcessedPrompt(text, ids, mm_items)

    def _process_speech_prompt(self, prompt: object, where: str) -> ProcessedPrompt:
        """A speech model's prompt: ``{"multi_modal_data": {"audio": (samples, rate) or a path}}``,
        optionally with a decoder ``prompt`` or ``prompt_token_ids`` (default: the checkpoint's
        decoder prompt, ``pprun.engine.speech``)."""
        data = prompt.get("multi_modal_data") if isinstance(prompt, dict) else None
        if not isinstance(data, dict) or "audio" not in data:
            raise ValueError(
                f"{where}: model {self.cfg.model.model!r} is a speech model and needs audio: pass "
                "{'multi_modal_data': {'audio': (samples, sample_rate)}} (optionally with a decoder "
                "'prompt' or 'prompt_token_ids'), or use LLM.transcribe"
            )
        unknown = sorted(set(prompt) - _PROMPT_KEYS) + [f"multi_modal_data.{k}" for k in sorted(set(data) - {"audio"})]
        if unknown:
            raise ValueError(f"{where} has unknown key(s) {unknown}: a speech model takes "
                             f"{sorted(_PROMPT_KEYS)} and multi_modal_data={{'audio': ...}}")
        speech = self.speech
        clip = speech.prepare_clip(data["audio"], f"{where}.multi_modal_data.audio")
        if clip.seconds > speech.window_seconds:
            raise ValueError(
                f"{where}.multi_modal_data.audio is {clip.seconds:.1f} s long: one request takes at most "
                f"{speech.window_seconds:.0f} s; LLM.transcribe splits longer audio into windows"
            )
        text = prompt.get("prompt")
        if "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            if not isinstance(ids, (list, tuple)) or not ids or not all(is_int(t) for t in ids):
                raise ValueError(f"{where}.prompt_token_ids={_short(ids)} is invalid: must be a non-empty list of ints")
            for i, t in enumerate(ids):
                if not 0 <= t < self.vocab_size:
                    raise ValueError(f"{where}.prompt_token_ids[{i}]={t} is outside the vocabulary: token ids "
                                     f"must be in [0, {self.vocab_size})")
            ids = list(ids)
        elif text is not None:
            if not isinstance(text, str) or not text:
                raise ValueError(f"{where}.prompt={_short(text)} must be a non-empty str")
            ids = self.tokenizer.encode(text, add_special_tokens=False)
        else:
            ids = list(speech.decoder_prompt)
        speech.check_length(len(ids), None, where)
        return ProcessedPrompt(text, ids, [speech.audio_item(clip.samples, clip.source, len(ids))])

    def check_request(self, processed: ProcessedPrompt, params: SamplingParams, where: str) -> SamplingParams:
        """Checks of a prompt and its parameters together; returns the parameters to queue it
        with (a speech model's: with its checkpoint's suppress lists, ``pprun.engine.speech``)."""
        if self.speech is None:
            self.check_output_room(len(processed.token_ids), params, where)
            return params
        self.speech.check_length(len(processed.token_ids), params, where)
        return self.speech.with_suppression(params)

    def _check_no_image_tokens(self, ids: list[int], where: str) -> None:
        """A vision-language model's prompt without ``multi_modal_data`` must hold no image token
        (each would take an image's rows that nobody gives)."""
        image_token = int(self.resolved.arch.multimodal["image_token_index"])
        count = ids.count(image_token)
        if count:
            raise ValueError(
                f"{where}: the prompt has {count} image token(s) (id {image_token}) but no multi_modal_data: pass "
                "{'multi_modal_data': {'image': [...]}} with one image per image token"
            )

    def _process_multi_modal(self, ids: list[int], data: object, where: str) -> tuple[list[int], list]:
        """``multi_modal_data`` checked and processed: ``(expanded token ids, items)``."""
        from pprun.multimodal.processing import SUPPORTED_MODALITIES

        arch = self.resolved.arch
        if arch.multimodal is None:
            raise ValueError(
                f"{where}.multi_modal_data: model {self.cfg.model.model!r} ({arch.architecture}) is text-only "
                "and takes no images or other multimodal data"
            )
        if not isinstance(data, dict):
            raise ValueError(f"{where}.multi_modal_data has type {type(data).__name__}: must be a dict such as "
                             "{'image': [...]}")
        unknown = sorted(set(data) - set(SUPPORTED_MODALITIES))
        if unknown:
            raise ValueError(
                f"{where}.multi_modal_data has unknown modality key(s) {unknown}: this model takes "
                f"{list(SUPPORTED_MODALITIES)}"
            )
        images = data.get("image", [])
        if not isinstance(images, (list, tuple)):
            images = [images]
        ids, items = self.image_processor.process(ids, list(images), where)
        budget = self._encoder_budget()
        for index, item in enumerate(items):
            if budget is not None and item.num_embeds > budget:
                # The scheduler could never encode it: refused here, before any request is queued.
                raise ValueError(
                    f"{where}.multi_modal_data['image'][{index}] takes {item.num_embeds} encoder output rows: "
                    f"must be at most scheduler.max_num_encoder_tokens={budget}"
                )
        return ids, items

    @property
    def image_processor(self):
        """The model's :class:`~pprun.multimodal.processing.ImageProcessor` (built on first use)."""
        if self._image_processor is None:
            from pprun.multimodal.processing import ImageProcessor

            self._image_processor = ImageProcessor(self.resolved.model_dir, self.resolved.arch.multimodal, self.tokenizer)
        return self._image_processor

    def render_chat(self, conversation: object, where: str, *, add_generation_prompt: bool = True) -> dict:
        """One conversation (a non-empty list of ``{role, content}`` dicts) rendered with the
        model's chat template into a prompt: ``{"prompt_token_ids": [...], "prompt": text}``.
        Raises ValueError naming ``where`` when there is no template or it cannot be rendered."""
        tok = self.tokenizer
        if tok is None or not getattr(tok, "chat_template", None):
            raise ValueError(f"model {self.cfg.model.model!r} has no chat template")
        if (
            not isinstance(conversation, (list, tuple))
            or not conversation
            or not all(isinstance(m, dict) for m in conversation)
        ):
            raise ValueError(f"{where}={_short(conversation)} must be a non-empty list of {{role, content}} dicts")
        from pprun.multimodal.processing import image_token_text, split_chat_images

        # OpenAI-style content parts: image parts become the image token's text, in order.
        mm = self.resolved.arch.multimodal
        conversation, images = split_chat_images(
            list(conversation), image_token_text(tok, mm["image_token_index"]) if mm else None, where
        )
        try:
            ids = tok.apply_chat_template(list(conversation), add_generation_prompt=add_generation_prompt, tokenize=True)
        except Exception as e:  # the template's own error (jinja2, a missing key, ...)
            raise ValueError(f"{where} cannot be rendered with the chat template: {e}") from e
        if hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
            ids = ids["input_ids"]
        rendered = {"prompt_token_ids": list(ids), "prompt": tok.decode(ids)}
        if images:
            rendered["multi_modal_data"] = {"image": images}
        return rendered

    def decode(self, token_ids: list[int], params: SamplingParams) -> str:
        """Token ids to text ("" for a model without a tokenizer)."""
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(token_ids, skip_special_tokens=params.skip_special_tokens)


_PROMPT_KEYS = frozenset({"prompt", "prompt_token_ids", "multi_modal_data"})
"""The keys a prompt dict may have."""


@dataclass
class ProcessedPrompt:
    """A validated prompt: its text (if any), token ids (image tokens expanded) and multimodal items."""

    text: str | None
    token_ids: list[int]
    mm_items: list


def load_tokenizer(path: str):
    """The model directory's tokenizer (transformers' fast tokenizer, local files only).

    A directory without tokenizer files (test checkpoints) gives ``None``: the engine then takes
    only ``prompt_token_ids`` prompts and returns empty text.
    """
    from pathlib import Path

    from transformers import AutoTokenizer

    files = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    if Path(path).is_dir() and not any((Path(path) / f).exists() for f in files):
        logger.warning("no tokenizer in %s: token-id prompts only, outputs carry no text", path)
        return None
    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
