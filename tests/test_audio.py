"""Audio in: files of several formats, resampling, mix-down, windows, features, bad input."""

from __future__ import annotations

import numpy as np
import pytest
import soundfile as sf

from pprun.audio import SAMPLE_RATE, join_window_texts, prepare_audio, split_windows


def tone(freq: float, seconds: float, rate: int) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    return (0.5 * np.sin(2 * np.pi * freq * t)).astype(np.float32)


def peak_hz(samples: np.ndarray) -> float:
    spectrum = np.abs(np.fft.rfft(samples))
    return float(np.fft.rfftfreq(samples.shape[0], 1 / SAMPLE_RATE)[spectrum.argmax()])


@pytest.mark.parametrize("fmt", ["wav", "flac", "ogg"])
def test_file_formats_resampled_and_mixed_down(tmp_path, fmt):
    left = tone(440.0, 1.0, 44_100)
    stereo = np.stack([left, 0.5 * left], axis=1)
    path = tmp_path / f"clip.{fmt}"
    sf.write(path, stereo, 44_100)
    clip = prepare_audio(path)
    assert clip.samples.dtype == np.float32 and clip.samples.ndim == 1
    assert abs(clip.samples.shape[0] - SAMPLE_RATE) <= 1
    assert abs(peak_hz(clip.samples) - 440.0) <= 2.0
    # Mixed down by averaging: amplitude 0.75 of the left channel's 0.5.
    assert abs(np.abs(clip.samples[2000:-2000]).max() - 0.375) < 0.03


def test_array_input_resampled_by_a_filter_not_interpolation():
    # 7 kHz at 48 kHz is below 16 kHz's Nyquist (8 kHz): it must survive; 9 kHz must not alias in.
    kept = prepare_audio((tone(7000.0, 1.0, 48_000), 48_000)).samples
    assert abs(peak_hz(kept) - 7000.0) <= 2.0
    removed = prepare_audio((tone(9000.0, 1.0, 48_000), 48_000)).samples
    assert np.abs(removed[1000:-1000]).max() < 0.02  # filtered out, no alias at 7 kHz


def test_windows_are_consecutive_and_joined_in_order():
    clip = prepare_audio((np.arange(70 * SAMPLE_RATE, dtype=np.float32) / 1e7, SAMPLE_RATE))
    windows = split_windows(clip, 30.0)
    assert [w.shape[0] for w in windows] == [30 * SAMPLE_RATE, 30 * SAMPLE_RATE, 10 * SAMPLE_RATE]
    assert np.array_equal(np.concatenate(windows), clip.samples)
    assert join_window_texts([" Hello there.", " ", "General Kenobi. "]) == "Hello there. General Kenobi."


@pytest.mark.parametrize(
    ("audio", "message"),
    [
        ("missing.wav", "does not exist"),
        ((np.zeros(0, dtype=np.float32), 16000), "audio is empty"),
        ((np.array([0.1, np.nan], dtype=np.float32), 16000), "NaN or infinity"),
        ((np.ones(10, dtype=np.float32), 0), "sample_rate must be > 0, got 0"),
        ((np.ones(10, dtype=np.float32), -8000), "sample_rate must be > 0, got -8000"),
        ((np.ones((2, 2, 2), dtype=np.float32), 16000), "1-D (mono) or 2-D"),
        ((np.array(["a"]), 16000), "real numbers"),
        (42, "expected a file path or a (samples, sample_rate) pair"),
    ],
)
def test_bad_audio_names_entry_and_field(tmp_path, audio, message):
    if audio == "missing.wav":
        audio = str(tmp_path / audio)
    with pytest.raises(ValueError, match="clip 3") as err:
        prepare_audio(audio, what="clip 3")
    assert message in str(err.value)


def test_non_audio_file_is_refused(tmp_path):
    path = tmp_path / "notes.wav"
    path.write_text("this is text, not audio")
    with pytest.raises(ValueError, match=r"prompts\[1\].*not a readable audio file"):
        prepare_audio(path, what="prompts[1]")
