"""Audio in: files of several formats, resampling, mix-down, windows, features, bad input."""

from __future__ import annotations

import numpy as np
import pytest
import soundfile as sf
import torch

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


# ---------------------------------------------------------------------------------------------
# Log-mel features (pprun.audio.LogMelSpectrogram) against transformers' WhisperFeatureExtractor
# ---------------------------------------------------------------------------------------------

FRONT_ENDS = {
    "tiny.en": {},  # transformers' defaults: what whisper-tiny.en's preprocessor_config.json says
    "tiny-test": {"feature_size": 7, "chunk_length": 3, "hop_length": 1600, "n_fft": 400},
    "128-bins": {"feature_size": 128},  # large-v3's front end
}


def log_mel_windows(n_samples: int) -> list[np.ndarray]:
    """Windows a batch may hold: full, short, one sample, silence, loud, a pure tone."""
    rng = np.random.default_rng(7)
    t = np.arange(n_samples) / SAMPLE_RATE
    return [
        (0.3 * rng.standard_normal(n_samples)).astype(np.float32),
        (0.1 * rng.standard_normal(n_samples // 3)).astype(np.float32),
        np.array([0.25], dtype=np.float32),
        np.zeros(n_samples // 2, dtype=np.float32),
        np.clip(4.0 * rng.standard_normal(n_samples), -1, 1).astype(np.float32),
        (0.5 * np.sin(2 * np.pi * 440.0 * t)).astype(np.float32),
    ]


def front_end(tmp_path, name):
    from transformers import WhisperFeatureExtractor

    from pprun.audio import LogMelConfig

    fe = WhisperFeatureExtractor(**FRONT_ENDS[name])
    fe.save_pretrained(tmp_path)
    return fe, LogMelConfig.from_model_dir(tmp_path)


def check_log_mel(tmp_path, name, device, atol):
    from pprun.audio import LogMelSpectrogram

    fe, cfg = front_end(tmp_path, name)
    assert np.array_equal(cfg.mel_filters(), fe.mel_filters)
    assert (cfg.n_samples, cfg.num_frames, cfg.num_mel_bins) == (fe.n_samples, fe.nb_max_frames, fe.feature_size)
    windows = log_mel_windows(cfg.n_samples)
    ours = LogMelSpectrogram(cfg, device)(windows)
    assert ours.device.type == torch.device(device).type and ours.dtype == torch.float32
    ref = fe(windows, sampling_rate=SAMPLE_RATE, return_tensors="np").input_features
    assert ours.shape == ref.shape == (len(windows), cfg.num_mel_bins, cfg.num_frames)
    np.testing.assert_allclose(ours.cpu().numpy(), ref, rtol=0, atol=atol)
    # One window at a time, as the extractor is called per request, gives the same rows.
    for i in (0, 3):
        one = fe(windows[i], sampling_rate=SAMPLE_RATE, return_tensors="np").input_features[0]
        np.testing.assert_allclose(ours[i].cpu().numpy(), one, rtol=0, atol=atol)


@pytest.mark.parametrize("name", sorted(FRONT_ENDS))
def test_log_mel_equals_transformers(tmp_path, name):
    """A batch of windows (full, short, one sample, silence, clipped, a tone) gives the features
    WhisperFeatureExtractor gives, with the same mel filters."""
    check_log_mel(tmp_path, name, "cpu", atol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["tiny.en", "tiny-test"])
def test_log_mel_on_gpu_equals_transformers_gpu(tmp_path, name):
    """The same on the GPU (cuFFT against the extractor's CPU FFT)."""
    check_log_mel(tmp_path, name, "cuda", atol=1e-4)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"dither": 0.1}, "dither=0.1"),
        ({"sampling_rate": 8000}, "sampling_rate=8000; pprun resamples to 16000"),
        ({"hop_length": 0}, "hop_length must be a positive integer, got 0"),
        ({"nb_max_frames": 100}, "nb_max_frames=100 disagrees"),
    ],
)
def test_bad_front_end_config_is_refused(tmp_path, change, message):
    import json

    from pprun.audio import LogMelConfig

    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"feature_size": 80, **change}))
    with pytest.raises(ValueError, match="preprocessor_config.json") as err:
        LogMelConfig.from_model_dir(tmp_path)
    assert message in str(err.value)
    with pytest.raises(ValueError, match="has no preprocessor_config.json"):
        LogMelConfig.from_model_dir(tmp_path / "missing")


def test_window_longer_than_the_front_end_is_refused(tmp_path):
    from pprun.audio import LogMelSpectrogram

    _, cfg = front_end(tmp_path, "tiny-test")
    with pytest.raises(ValueError, match=f"at most {cfg.n_samples} samples, got {cfg.n_samples + 1}"):
        LogMelSpectrogram(cfg, "cpu")([np.zeros(cfg.n_samples + 1, dtype=np.float32)])
