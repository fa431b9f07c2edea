"""Audio in for speech models: files or arrays to 16 kHz mono, windows, log-mel features.

- Files are read by ``soundfile`` (libsndfile: WAV, FLAC, OGG/Vorbis and more) as float32.
- Several channels are mixed down by averaging them.
- Any other sample rate is resampled by ``soxr`` (the SoX resampler, "HQ": a linear-phase
  polyphase filter), not by interpolation.
- Audio longer than one window (Whisper: 30 s) is cut into consecutive, non-overlapping
  windows; each is transcribed as its own request and the texts are joined in order with a
  single space (each stripped first).  A word that straddles a cut may be split or garbled at
  the cut; windows are never dropped or overlapped, so no audio is lost or repeated.
- Log-mel features come from ``transformers``' ``WhisperFeatureExtractor``, configured by the
  checkpoint's ``preprocessor_config.json`` (mel bins, FFT size, hop, padding to 30 s).

Every check raises ``ValueError`` naming the entry and what is wrong, before any work starts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

SAMPLE_RATE = 16_000
"""Whisper's input rate: every clip is resampled to it."""

AUDIO_FEATURES_KEY = "input_features"
"""Key of an audio item's log-mel features (``[num_mel_bins, frames]`` float32) in its data."""


@dataclass(frozen=True)
class AudioClip:
    """A clip ready for a speech model: mono float32 samples at :data:`SAMPLE_RATE`."""

    samples: np.ndarray
    """[num_samples] float32, mono, 16 kHz."""
    source: str
    """Where it came from (a path, or ``<array>``), for messages and outputs."""

    @property
    def seconds(self) -> float:
        """Duration in seconds."""
        return self.samples.shape[0] / SAMPLE_RATE


def load_audio_file(path: str | Path, *, what: str = "audio") -> tuple[np.ndarray, int]:
    """Read an audio file as ``(float32 samples [frames] or [frames, channels], sample rate)``.

    Raises:
        ValueError: the file does not exist or is not audio libsndfile can read.
    """
    import soundfile as sf

    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{what}: file {str(path)!r} does not exist")
    try:
        samples, sample_rate = sf.read(str(path), dtype="float32", always_2d=False)
    except (sf.LibsndfileError, RuntimeError, TypeError) as exc:
        raise ValueError(
            f"{what}: {str(path)!r} is not a readable audio file (WAV, FLAC, OGG...): {exc}"
        ) from exc
    return samples, int(sample_rate)


def prepare_audio(audio: Any, *, what: str = "audio") -> AudioClip:
    """Turn a path or a ``(samples, sample_rate)`` pair into a 16 kHz mono :class:`AudioClip`.

    ``samples`` is 1-D (mono) or 2-D ``[frames, channels]``; any real dtype.

    Raises:
        ValueError: naming ``what``: unreadable file, wrong shape, empty audio, non-finite
            samples, or a sample rate that is not a positive number.
    """
    if isinstance(audio, (str, Path)):
        samples, sample_rate = load_audio_file(audio, what=what)
        source = str(audio)
    elif isinstance(audio, (tuple, list)) and len(audio) == 2:
        samples, sample_rate = audio
        source = "<array>"
    else:
        raise ValueError(
            f"{what}: expected a file path or a (samples, sample_rate) pair, got {type(audio).__name__}"
        )
    if isinstance(sample_rate, bool) or not isinstance(sample_rate, (int, float, np.integer, np.floating)):
        raise ValueError(f"{what}: sample_rate must be a number, got {sample_rate!r}")
    if not np.isfinite(sample_rate) or sample_rate <= 0:
        raise ValueError(f"{what}: sample_rate must be > 0, got {sample_rate!r}")
    try:
        array = np.asarray(samples)
    except Exception as exc:  # noqa: BLE001 - any array-like failure is the user's input
        raise ValueError(f"{what}: samples are not an array: {exc}") from exc
    if array.dtype.kind not in "fiu":
        raise ValueError(f"{what}: samples must be real numbers, got dtype {array.dtype}")
    if array.ndim not in (1, 2):
        raise ValueError(
            f"{what}: samples must be 1-D (mono) or 2-D [frames, channels], got shape {array.shape}"
        )
    if array.size == 0:
        raise ValueError(f"{what}: audio is empty (0 samples)")
    array = array.astype(np.float32, copy=False)
    if not np.isfinite(array).all():
        raise ValueError(f"{what}: samples contain NaN or infinity")
    if array.ndim == 2:
        array = array.mean(axis=1, dtype=np.float32)
    if sample_rate != SAMPLE_RATE:
        import soxr

        array = soxr.resample(array, float(sample_rate), SAMPLE_RATE, quality="HQ").astype(np.float32)
        if array.size == 0:
            raise ValueError(f"{what}: audio is shorter than one sample at {SAMPLE_RATE} Hz")
    return AudioClip(np.ascontiguousarray(array), source)


def split_windows(clip: AudioClip, window_seconds: float) -> list[np.ndarray]:
    """Consecutive, non-overlapping windows of at most ``window_seconds`` (the last shorter)."""
    size = int(round(window_seconds * SAMPLE_RATE))
    return [clip.samples[start : start + size] for start in range(0, clip.samples.shape[0], size)]


def join_window_texts(texts: Sequence[str]) -> str:
    """One transcript from its windows' texts, in order (see the module docstring)."""
    return " ".join(t.strip() for t in texts if t.strip())


class LogMelFeatures:
    """Log-mel features as a checkpoint's ``preprocessor_config.json`` says (Whisper)."""

    def __init__(self, model_dir: str | Path) -> None:
        from transformers import WhisperFeatureExtractor

        path = Path(model_dir) / "preprocessor_config.json"
        if not path.is_file():
            raise ValueError(f"model directory {str(model_dir)!r} has no preprocessor_config.json")
        self.extractor = WhisperFeatureExtractor.from_pretrained(str(model_dir))
        if self.extractor.sampling_rate != SAMPLE_RATE:
            raise ValueError(
                f"{path}: sampling_rate={self.extractor.sampling_rate}; pprun resamples to {SAMPLE_RATE}"
            )

    @property
    def window_seconds(self) -> float:
        """Audio one feature window covers (Whisper: 30 s)."""
        return float(self.extractor.chunk_length)

    def __call__(self, samples: np.ndarray) -> np.ndarray:
        """``[num_mel_bins, nb_max_frames]`` float32 features of one window of 16 kHz samples."""
        if samples.shape[0] > self.extractor.n_samples:
            raise ValueError(
                f"a window holds at most {self.extractor.n_samples} samples, got {samples.shape[0]}"
            )
        out = self.extractor(samples, sampling_rate=SAMPLE_RATE, return_tensors="np")
        return out["input_features"][0].astype(np.float32)
