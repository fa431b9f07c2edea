"""The configuration is validated once per run, by the entry point, into the ResolvedConfig every
layer below takes; model resolution (an alias's conversion) happens there too, once, and
validation itself converts nothing (``tests/test_config.py`` has the validation-only cases)."""

from __future__ import annotations

import contextlib
import importlib.util
import shutil
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from pprun import LLM
from pprun.config.config import PprunConfig
from pprun.config.runner_choice import choose_runner
from pprun.config.validate import validate_config
from pprun.engine.async_engine import AsyncEngine
from pprun.engine.resolve import resolve_config
from pprun.models import demo
from pprun.models.demo import DEMO_MODEL_ALIAS, resolve_model
from pprun.sampling.params import SamplingParams


@contextlib.contextmanager
def count_calls(*funcs: Callable) -> Iterator[dict[str, int]]:
    """Count calls of ``funcs`` by their code objects, in this thread and every thread started
    inside the block, however they are reached (any import alias, any module binding)."""
    codes = {f.__code__: f.__name__ for f in funcs}
    counts = dict.fromkeys(codes.values(), 0)
    lock = threading.Lock()

    def profile(frame, event, arg):  # noqa: ANN001, ANN202 (sys.setprofile's signature)
        if event == "call":
            name = codes.get(frame.f_code)
            if name is not None:
                with lock:
                    counts[name] += 1

    sys.setprofile(profile)
    threading.setprofile(profile)
    try:
        yield counts
    finally:
        sys.setprofile(None)
        threading.setprofile(None)


def test_llm_validates_once_to_the_first_token(tiny_llama_dir: Path) -> None:
    """From ``LLM(...)`` to the first generated token: one validation, one runner choice."""
    with count_calls(validate_config, choose_runner) as counts:
        llm = LLM(str(tiny_llama_dir), dtype="float32", max_num_seqs=2)
        try:
            out = llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(temperature=0.0, max_tokens=1))
        finally:
            llm.shutdown()
    assert len(out[0].outputs[0].token_ids) == 1
    assert counts == {"validate_config": 1, "choose_runner": 1}
    assert llm.engine.resolved is llm.resolved  # the one object handed down


def test_async_engine_validates_once(tiny_llama_dir: Path) -> None:
    """``AsyncEngine(config)``: one validation for the engine and its input checks; a
    ResolvedConfig given to it is used as is."""
    cfg = PprunConfig.from_kwargs(model=str(tiny_llama_dir), dtype="float32", max_num_seqs=2)
    with count_calls(validate_config) as counts:
        engine = AsyncEngine(cfg)
        try:
            assert engine.inputs.resolved is engine.engine.resolved
        finally:
            engine.shutdown(drain_timeout_s=0.0)
    assert counts == {"validate_config": 1}
    resolved = resolve_config(cfg)
    with count_calls(validate_config) as counts:
        engine = AsyncEngine(resolved)
        engine.shutdown(drain_timeout_s=0.0)
    assert counts == {"validate_config": 0}


def test_missing_model_path_fails_before_any_process(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    with pytest.raises(ValueError, match=rf"model\.model='{missing}' is neither an existing directory"):
        LLM(str(missing))


def _fake_conversion(source: Path, conversions: list[Path]) -> Callable[[Path, Path], Path]:
    """A stand-in for the GGUF conversion: copies ``source`` into place with the files a finished
    conversion has, and records each call."""

    def convert(gguf_path: Path, out_dir: Path) -> Path:
        conversions.append(out_dir)
        shutil.copytree(source, out_dir)
        for name in ("tokenizer_config.json", "generation_config.json", "pprun_source.json"):
            if not (out_dir / name).exists():
                (out_dir / name).write_text("{}")
        return out_dir

    return convert


def test_resolve_config_converts_an_alias_once(
    tiny_llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Model resolution converts an unconverted alias once, then validates its directory; a
    second resolution finds it converted; a ResolvedConfig passes through untouched."""
    monkeypatch.setenv("PPRUN_CACHE_DIR", str(tmp_path))
    conversions: list[Path] = []
    monkeypatch.setattr(demo, "convert_gguf_to_hf", _fake_conversion(tiny_llama_dir, conversions))
    monkeypatch.setattr(demo, "gguf_path_for", lambda alias: tmp_path / "unused.gguf")
    cfg = PprunConfig.from_kwargs(model=DEMO_MODEL_ALIAS, dtype="float32")
    with count_calls(validate_config) as counts:
        first = resolve_config(cfg)
    out_dir = tmp_path / "models" / DEMO_MODEL_ALIAS
    assert conversions == [out_dir]
    assert counts == {"validate_config": 1}
    assert first.model_dir == out_dir and first.cfg.model.model == DEMO_MODEL_ALIAS
    assert resolve_config(cfg).model_dir == out_dir
    assert conversions == [out_dir]
    assert resolve_config(first) is first


def test_conversion_names_a_missing_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Converting the demo alias without ``gguf`` installed: an ImportError naming the package,
    before any conversion starts."""
    monkeypatch.setenv("PPRUN_CACHE_DIR", str(tmp_path))
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *args: None if name == "gguf" else real_find_spec(name, *args)
    )

    def converted(*args: object) -> None:
        raise AssertionError("converted without gguf")

    monkeypatch.setattr(demo, "convert_gguf_to_hf", converted)
    with pytest.raises(ImportError, match=r"needs the Python package 'gguf'.*pip install gguf"):
        resolve_model(DEMO_MODEL_ALIAS)
    assert not (tmp_path / "models").exists()
