"""Speech requests for an encoder-decoder model (Whisper): audio in, decoder prompt, decoding rules.

The engine builds one :class:`SpeechRequests` for a Whisper checkpoint.  It turns a prompt with
``multi_modal_data={"audio": ...}`` into a request: the audio becomes one ``"audio"``
:class:`~pprun.multimodal.items.MultiModalItem` holding the window's 16 kHz samples (first stage
only: it computes the log-mel features, ``pprun.audio.LogMelSpectrogram``), whose placeholder
range is the whole decoder prompt with no embedding rows (the audio reaches the decoder through
cross-attention, not through its token embeddings).

Decoding follows the checkpoint's ``generation_config.json`` as ``transformers``' Whisper
``generate`` does with its defaults (no timestamps):

- decoder prompt: ``decoder_start_token_id``, then the ``forced_decoder_ids`` in position order,
  then ``<|notimestamps|>`` if it is not among them;
- ``suppress_tokens`` never sampled, ``begin_suppress_tokens`` not sampled as the first output
  token: added to a request's :class:`SamplingParams` (``suppress_token_ids``,
  ``begin_suppress_token_ids``) unless it sets its own;
- a decoder prompt plus ``max_tokens`` may not pass ``max_target_positions``.
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from pprun.audio import (
    AUDIO_SAMPLES_KEY,
    AudioClip,
    LogMelConfig,
    join_window_texts,
    prepare_audio,
    split_windows,
)
from pprun.engine.outputs import RequestOutput
from pprun.multimodal.items import MultiModalItem, PlaceholderRange
from pprun.sampling.params import SamplingParams


@dataclass
class TranscriptionOutput:
    """One clip's transcript, from :meth:`pprun.engine.llm.LLM.transcribe`."""

    source: str
    """The path given, or ``<array>``."""
    text: str
    """The windows' texts joined in order (``pprun.audio.join_window_texts``)."""
    audio_seconds: float
    """Duration of the clip (after resampling to 16 kHz)."""
    windows: list[RequestOutput] = field(default_factory=list)
    """One request output per 30 s window, in order."""


_WINDOW_IDS = itertools.count()
"""Keys of audio items (``SpeechRequests.audio_item``): unique within the process."""


class SpeechRequests:
    """Prompt building and decoding rules of one Whisper checkpoint (see the module docstring)."""

    def __init__(self, model_dir: Path, max_target_positions: int, max_source_positions: int | None = None) -> None:
        self.log_mel = LogMelConfig.from_model_dir(model_dir)
        """The checkpoint's log-mel front end (``preprocessor_config.json``)."""
        if max_source_positions is not None and self.log_mel.num_frames != 2 * max_source_positions:
            raise ValueError(
                f"{model_dir}: preprocessor_config.json gives {self.log_mel.num_frames} mel frames per "
                f"window, but the encoder takes 2 * max_source_positions = {2 * max_source_positions}"
            )
        self.max_target_positions = max_target_positions
        path = Path(model_dir) / "generation_config.json"
        generation: dict[str, Any] = json.loads(path.read_text()) if path.is_file() else {}
        config = json.loads((Path(model_dir) / "config.json").read_text())
        start = generation.get("decoder_start_token_id", config.get("decoder_start_token_id"))
        if start is None:
            raise ValueError(f"{model_dir}: no decoder_start_token_id in config.json or generation_config.json")
        forced = sorted(generation.get("forced_decoder_ids") or config.get("forced_decoder_ids") or [])
        prompt = [int(start)] + [int(tok) for _, tok in forced if tok is not None]
        no_timestamps = generation.get("no_timestamps_token_id")
        if no_timestamps is not None and int(no_timestamps) not in prompt:
            prompt.append(int(no_timestamps))
        self.decoder_prompt: list[int] = prompt
        """Token ids every transcription starts from."""
        self.suppress_token_ids = [int(t) for t in generation.get("suppress_tokens") or []]
        self.begin_suppress_token_ids = [int(t) for t in generation.get("begin_suppress_tokens") or []]

    @property
    def window_seconds(self) -> float:
        """Audio one request covers (30 s)."""
        return self.log_mel.window_seconds

    def default_params(self) -> SamplingParams:
        """Greedy decoding up to ``max_target_positions``, with the checkpoint's suppress lists."""
        return self.with_suppression(
            SamplingParams(temperature=0.0, max_tokens=self.max_target_positions - len(self.decoder_prompt))
        )

    def with_suppression(self, params: SamplingParams) -> SamplingParams:
        """``params`` with the checkpoint's suppress lists where it sets none of its own."""
        changes = {}
        if not params.suppress_token_ids:
            changes["suppress_token_ids"] = list(self.suppress_token_ids)
        if not params.begin_suppress_token_ids:
            changes["begin_suppress_token_ids"] = list(self.begin_suppress_token_ids)
        return replace(params, **changes) if changes else params

    def check_length(self, num_prompt_tokens: int, params: SamplingParams | None, where: str) -> None:
        """A decoder prompt plus ``max_tokens`` must fit in ``max_target_positions``."""
        if num_prompt_tokens >= self.max_target_positions:
            raise ValueError(
                f"{where}: the decoder prompt has {num_prompt_tokens} tokens; the model's "
                f"max_target_positions={self.max_target_positions} leaves no room for output"
            )
        if params is not None and params.max_tokens is not None and num_prompt_tokens + params.max_tokens > self.max_target_positions:
            raise ValueError(
                f"{where}: decoder prompt ({num_prompt_tokens} tokens) + SamplingParams.max_tokens="
                f"{params.max_tokens} is past the model's max_target_positions={self.max_target_positions}; "
                f"max_tokens may be at most {self.max_target_positions - num_prompt_tokens}"
            )

    def audio_item(self, samples, source: str, num_prompt_tokens: int) -> MultiModalItem:
        """The audio item of one window (16 kHz mono samples, at most 30 s).

        Its key (``content_hash``) is unique per window and hashes nothing: an item read through
        cross-attention is encoded into its own request's slot whenever the request is admitted,
        never shared with an equal one (``pprun.multimodal.encoder_budget``), so hashing 30 s of
        samples would buy nothing."""
        self.log_mel.check_window(samples)
        return MultiModalItem(
            modality="audio",
            content_hash=f"audio:{os.getpid()}:{next(_WINDOW_IDS)}",
            # The whole decoder prompt, no embedding rows: cross-attention reads the audio.
            placeholder=PlaceholderRange(0, num_prompt_tokens, (False,) * num_prompt_tokens),
            data={AUDIO_SAMPLES_KEY: samples, "source": source},
            # The encoder's second convolution halves the window's frames.
            num_encoder_positions=self.log_mel.num_frames // 2,
        )

    def prepare_clip(self, audio: object, where: str) -> AudioClip:
        """Load/convert one audio input, naming ``where`` in any error."""
        return prepare_audio(audio, what=where)

    def windows(self, clip: AudioClip) -> list:
        """The clip's consecutive 30 s windows (see ``pprun.audio``)."""
        return split_windows(clip, self.window_seconds)

    @staticmethod
    def join(outputs: Sequence[RequestOutput]) -> str:
        """One transcript from the windows' outputs, in order."""
        return join_window_texts([o.outputs[0].text for o in outputs])
