"""Audio in for speech models: files or arrays to 16 kHz mono, windows, log-mel features.

- Files are read by ``soundfile`` (libsndfile: WAV, FLAC, OGG/Vorbis and more) as float32.
- Several channels are mixed down by averaging them.
- Any other sample rate is resampled by ``soxr`` (the SoX resampler, "HQ": a linear-phase
  polyphase filter), not by interpolation.
- Audio longer than one window (Whisper: 30 s) is cut into consecutive, non-overlapping
  windows; each is transcribed as its own request and the texts are joined in order with a
  single space (each stripped first).  A word that straddles a cut may be split or garbled at
  the cut; windows are never dropped or overlapped, so no audio is lost or repeated.
- Log-mel features are computed in torch on the first stage's device, a step's windows in one
  batch (:class:`LogMelSpectrogram`), as ``transformers``' ``WhisperFeatureExtractor`` computes
  them, configured by the checkpoint's ``preprocessor_config.json`` (:class:`LogMelConfig`: mel
  bins, FFT size, hop, padding to 30 s).  A request carries its window's samples.

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

AUDIO_SAMPLES_KEY = "samples"
"""Key of an audio item's window in its data: ``[num_samples]`` float32 at 16 kHz, at most one
window (``LogMelConfig.n_samples``), unpadded; the first stage computes its features."""


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


class LogMelConfig:
    """Whisper's log-mel front end as a checkpoint's ``preprocessor_config.json`` describes it
    (plain numbers, no torch): what the driver needs to cut windows and size requests, and what
    the first stage's :class:`LogMelSpectrogram` computes with.

    Read here: ``feature_size`` (mel bins), ``sampling_rate``, ``hop_length``, ``n_fft``,
    ``chunk_length`` (seconds a window covers), ``n_samples`` / ``nb_max_frames`` (derived from
    them when absent), ``padding_value``, ``dither``.  ``transformers``' defaults fill any key the
    file leaves out.
    """

    _DEFAULTS = {"feature_size": 80, "sampling_rate": SAMPLE_RATE, "hop_length": 160, "chunk_length": 30,
                 "n_fft": 400, "padding_value": 0.0, "dither": 0.0}

    def __init__(self, values: dict[str, Any], where: str = "preprocessor_config.json") -> None:
        v = {**self._DEFAULTS, **{k: values[k] for k in self._DEFAULTS if values.get(k) is not None}}
        for key in ("feature_size", "sampling_rate", "hop_length", "chunk_length", "n_fft"):
            if isinstance(v[key], bool) or not isinstance(v[key], int) or v[key] < 1:
                raise ValueError(f"{where}: {key} must be a positive integer, got {v[key]!r}")
        if v["sampling_rate"] != SAMPLE_RATE:
            raise ValueError(f"{where}: sampling_rate={v['sampling_rate']}; pprun resamples to {SAMPLE_RATE}")
        if float(v["dither"]) != 0.0:
            raise ValueError(f"{where}: dither={v['dither']}; pprun computes log-mel features without dithering")
        self.num_mel_bins: int = v["feature_size"]
        self.sampling_rate: int = v["sampling_rate"]
        self.hop_length: int = v["hop_length"]
        self.n_fft: int = v["n_fft"]
        self.chunk_length: int = v["chunk_length"]
        self.padding_value = float(v["padding_value"])
        self.n_samples: int = self.chunk_length * self.sampling_rate
        """Samples of one window: shorter audio is padded to it with ``padding_value``."""
        self.num_frames: int = self.n_samples // self.hop_length
        """Mel frames of one window (``nb_max_frames``: the STFT's last frame is dropped)."""
        for key, have in (("n_samples", self.n_samples), ("nb_max_frames", self.num_frames)):
            if values.get(key) is not None and values[key] != have:
                raise ValueError(f"{where}: {key}={values[key]} disagrees with the other fields ({have})")

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> LogMelConfig:
        """The config of a checkpoint directory (``ValueError`` when it has none or it is bad)."""
        import json

        path = Path(model_dir) / "preprocessor_config.json"
        if not path.is_file():
            raise ValueError(f"model directory {str(model_dir)!r} has no preprocessor_config.json")
        try:
            values = json.loads(path.read_text())
        except ValueError as exc:
            raise ValueError(f"{path}: not valid JSON: {exc}") from exc
        if not isinstance(values, dict):
            raise ValueError(f"{path}: expected a JSON object")
        return cls(values, str(path))

    @property
    def window_seconds(self) -> float:
        """Audio one feature window covers (Whisper: 30 s)."""
        return float(self.chunk_length)

    def mel_filters(self) -> np.ndarray:
        """``[1 + n_fft // 2, num_mel_bins]`` float64 triangular filters on the Slaney mel scale,
        Slaney-normalised, 0 to 8 kHz: the bank ``WhisperFeatureExtractor`` builds."""
        def hz_to_mel(freq: np.ndarray) -> np.ndarray:
            mels = 3.0 * freq / 200.0
            log = freq >= 1000.0
            mels[log] = 15.0 + np.log(freq[log] / 1000.0) * (27.0 / np.log(6.4))
            return mels

        def mel_to_hz(mels: np.ndarray) -> np.ndarray:
            freq = 200.0 * mels / 3.0
            log = mels >= 15.0
            freq[log] = 1000.0 * np.exp((np.log(6.4) / 27.0) * (mels[log] - 15.0))
            return freq

        n_mels = self.num_mel_bins
        edges = hz_to_mel(np.array([0.0, 8000.0]))
        filter_freqs = mel_to_hz(np.linspace(edges[0], edges[1], n_mels + 2))
        fft_freqs = np.linspace(0, self.sampling_rate // 2, 1 + self.n_fft // 2)
        diff = np.diff(filter_freqs)
        slopes = filter_freqs[None, :] - fft_freqs[:, None]
        down = -slopes[:, :-2] / diff[:-1]
        up = slopes[:, 2:] / diff[1:]
        filters = np.maximum(np.zeros(1), np.minimum(down, up))
        filters *= (2.0 / (filter_freqs[2 : n_mels + 2] - filter_freqs[:n_mels]))[None, :]
        return filters

    def check_window(self, samples: np.ndarray) -> None:
        """A window holds at most :attr:`n_samples` samples (``ValueError`` otherwise)."""
        if samples.shape[0] > self.n_samples:
            raise ValueError(f"a window holds at most {self.n_samples} samples, got {samples.shape[0]}")


class LogMelSpectrogram:
    """Whisper's log-mel features of a batch of windows, computed in torch on one device.

    The same steps as ``WhisperFeatureExtractor`` (its torch path, ``padding="max_length"``):
    each window padded to ``n_samples`` with ``padding_value``; ``torch.stft`` with a periodic
    Hann window of ``n_fft``, hop ``hop_length``, centred (reflect padding); the power spectrum
    without the last frame; the mel filters (:meth:`LogMelConfig.mel_filters`, float32);
    ``log10`` of ``max(mel, 1e-10)``; per window, ``max(x, x.max() - 8)``; then ``(x + 4) / 4``.
    Float32 throughout, whatever the model's dtype (``tests/test_audio.py`` checks it against
    ``transformers``).
    """

    def __init__(self, config: LogMelConfig, device) -> None:
        import torch

        self.config = config
        self.device = torch.device(device)
        self.window = torch.hann_window(config.n_fft, device=self.device)
        self.filters = torch.from_numpy(config.mel_filters().T.astype(np.float32)).to(self.device)
        """``[num_mel_bins, 1 + n_fft // 2]`` float32."""

    def stack(self, windows: Sequence[np.ndarray]):
        """``[len(windows), n_samples]`` float32 on the device: each window's samples, then
        ``padding_value`` (one host-to-device copy per window, straight into its row)."""
        import torch

        cfg = self.config
        for w in windows:
            cfg.check_window(w)
        batch = torch.full((len(windows), cfg.n_samples), cfg.padding_value, dtype=torch.float32,
                           device=self.device)
        for row, w in zip(batch, windows):
            row[: w.shape[0]].copy_(torch.from_numpy(np.asarray(w, dtype=np.float32)), non_blocking=True)
        return batch

    def __call__(self, windows: Sequence[np.ndarray]):
        """``[len(windows), num_mel_bins, num_frames]`` float32 features on the device."""
        return self.features(self.stack(windows))

    def features(self, waveform):
        """Features of ``waveform [B, n_samples]`` (float32, on the device)."""
        import torch

        cfg = self.config
        stft = torch.stft(waveform, cfg.n_fft, cfg.hop_length, window=self.window, return_complex=True)
        power = stft[..., :-1].abs().square_()  # [B, freq, frames]
        mel = torch.matmul(self.filters, power)  # [B, mels, frames]
        log_spec = mel.clamp_(min=1e-10).log10_()
        floor = log_spec.amax(dim=(1, 2), keepdim=True) - 8.0
        return torch.maximum(log_spec, floor).add_(4.0).div_(4.0)
