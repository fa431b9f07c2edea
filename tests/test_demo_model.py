"""Tests for the built-in demo model: GGUF -> Hugging Face directory conversion.

The real conversion runs once per session (~15-30 s on CPU) and is shared by the
parity tests; the locking/atomicity tests use a fake writer and take no time.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

from pprun.models import demo
from pprun.models.demo import (
    DEMO_MODEL_ALIAS,
    DEMO_MODELS,
    cache_dir,
    convert_gguf_to_hf,
    gguf_path_for,
    resolve_model,
)

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    return",
]
TEXTS = [
    "Hello, world!",
    "  leading spaces, tabs\tand\nnewlines",
    "Unicode: héllo wörld — 你好 🤖",
    "<|im_start|>user\nhi<|im_end|>\n",
    "",
]
MESSAGES = [{"role": "user", "content": "What is 2 + 2?"}]


@pytest.fixture(scope="session")
def converted_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo alias resolved (and so converted) into a fresh session cache."""
    cache = tmp_path_factory.mktemp("pprun_cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PPRUN_CACHE_DIR", str(cache))
        return resolve_model(DEMO_MODEL_ALIAS)


@pytest.fixture(scope="session")
def gguf_reference() -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """transformers loading the GGUF file directly: the parity reference."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path = gguf_path_for(DEMO_MODEL_ALIAS)
    model = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
    ).eval()
    tokenizer = AutoTokenizer.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name
    )
    return model, tokenizer


def test_converted_dir_lives_in_cache(converted_dir: Path) -> None:
    assert converted_dir.name == DEMO_MODEL_ALIAS
    assert converted_dir.parent.name == "models"


def test_converted_logits_match_gguf(converted_dir: Path, gguf_reference) -> None:
    from transformers import AutoModelForCausalLM

    ref_model, ref_tokenizer = gguf_reference
    model = AutoModelForCausalLM.from_pretrained(converted_dir).eval()
    assert model.dtype == torch.float32
    assert model.config.tie_word_embeddings == ref_model.config.tie_word_embeddings
    if model.config.tie_word_embeddings:
        assert (
            model.lm_head.weight.data_ptr()
            == model.model.embed_tokens.weight.data_ptr()
        )
    with torch.no_grad():
        for prompt in PROMPTS:
            input_ids = ref_tokenizer(prompt, return_tensors="pt").input_ids
            ref_logits = ref_model(input_ids).logits
            logits = model(input_ids).logits
            assert logits.shape == ref_logits.shape
            max_abs_diff = (logits - ref_logits).abs().max().item()
            assert max_abs_diff <= 1e-5, (prompt, max_abs_diff)


def test_converted_files(converted_dir: Path) -> None:
    from safetensors import safe_open

    config = json.loads((converted_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["torch_dtype"] == "float32"
    assert "quantization_config" not in config
    with safe_open(str(converted_dir / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        assert {f.get_slice(n).get_dtype() for n in names} == {"F32"}
    assert "model.embed_tokens.weight" in names
    assert ("lm_head.weight" in names) != config["tie_word_embeddings"]

    generation = json.loads((converted_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == config["eos_token_id"]
    assert generation["bos_token_id"] == config["bos_token_id"]

    source = json.loads((converted_dir / "pprun_source.json").read_text())
    gguf_path = gguf_path_for(DEMO_MODEL_ALIAS)
    assert source["gguf_file"] == DEMO_MODELS[DEMO_MODEL_ALIAS].gguf_file
    assert source["gguf_size_bytes"] == gguf_path.stat().st_size
    assert source["gguf_sha256"] == hashlib.sha256(gguf_path.read_bytes()).hexdigest()
    assert source["package_version"]
    assert source["license"] == "Apache-2.0"
    # No temp dir of the conversion is left next to the result.
    assert [p.name for p in converted_dir.parent.iterdir() if ".tmp-" in p.name] == []


def test_tokenizer_roundtrip(converted_dir: Path, gguf_reference) -> None:
    from transformers import AutoTokenizer

    _, ref_tokenizer = gguf_reference
    tokenizer = AutoTokenizer.from_pretrained(converted_dir)
    for text in TEXTS:
        assert tokenizer.encode(text) == ref_tokenizer.encode(text), text
    assert tokenizer.eos_token_id == ref_tokenizer.eos_token_id
    assert tokenizer.chat_template
    assert tokenizer.chat_template == ref_tokenizer.chat_template
    rendered = tokenizer.apply_chat_template(
        MESSAGES, tokenize=False, add_generation_prompt=True
    )
    assert rendered == ref_tokenizer.apply_chat_template(
        MESSAGES, tokenize=False, add_generation_prompt=True
    )
    assert MESSAGES[0]["content"] in rendered
    assert (
        tokenizer.model_max_length
        == json.loads((converted_dir / "config.json").read_text())[
            "max_position_embeddings"
        ]
    )


def test_resolve_twice_converts_once(
    converted_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PPRUN_CACHE_DIR", str(converted_dir.parent.parent))
    weights = converted_dir / "model.safetensors"
    mtimes_before = (converted_dir.stat().st_mtime_ns, weights.stat().st_mtime_ns)

    def fail_load(*args: object, **kwargs: object) -> None:
        raise AssertionError("resolve_model converted an already converted model")

    monkeypatch.setattr(demo, "load_gguf", fail_load)
    assert resolve_model(DEMO_MODEL_ALIAS) == converted_dir
    assert (
        converted_dir.stat().st_mtime_ns,
        weights.stat().st_mtime_ns,
    ) == mtimes_before


def test_resolve_unknown_alias_raises(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PPRUN_CACHE_DIR", str(tmp_path))
    with pytest.raises(ValueError) as excinfo:
        resolve_model("no-such-model-xyz")
    message = str(excinfo.value)
    assert "no-such-model-xyz" in message
    assert "neither an existing directory nor a known model alias" in message
    assert DEMO_MODEL_ALIAS in message
    assert not (tmp_path / "models").exists()


def test_resolve_existing_dir_returned_as_is(tmp_path: Path) -> None:
    assert resolve_model(str(tmp_path)) == tmp_path


def test_cache_dir_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PPRUN_CACHE_DIR", str(tmp_path))
    assert cache_dir() == tmp_path
    monkeypatch.delenv("PPRUN_CACHE_DIR")
    assert cache_dir() == Path.home() / ".cache" / "pprun"


def _fake_writer(calls: list[Path]) -> Callable[[Path, Path], None]:
    """A stand-in for the real (slow) writer: records calls, writes the file set."""

    def write(gguf_path: Path, dest: Path) -> None:
        calls.append(dest)
        for name in demo._REQUIRED_FILES:
            (dest / name).write_text("{}")

    return write


def test_concurrent_conversions_write_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gguf_path = tmp_path / "fake.gguf"
    gguf_path.write_bytes(b"GGUF")
    out_dir = tmp_path / "models" / "fake"
    calls: list[Path] = []
    barrier = threading.Barrier(4, timeout=30)
    real_lock = demo._file_lock

    def slow_lock(lock_path: Path) -> AbstractContextManager[None]:
        # Line every thread up right before the lock so they all contend for it.
        barrier.wait()
        return real_lock(lock_path)

    monkeypatch.setattr(demo, "_write_hf_dir", _fake_writer(calls))
    monkeypatch.setattr(demo, "_file_lock", slow_lock)
    results: list[Path] = []
    threads = [
        threading.Thread(
            target=lambda: results.append(convert_gguf_to_hf(gguf_path, out_dir))
        )
        for _ in range(4)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == [out_dir] * 4
    assert len(calls) == 1
    assert sorted(p.name for p in out_dir.iterdir()) == sorted(demo._REQUIRED_FILES)
    assert [p.name for p in out_dir.parent.iterdir() if ".tmp-" in p.name] == []


def test_failed_conversion_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gguf_path = tmp_path / "fake.gguf"
    gguf_path.write_bytes(b"GGUF")
    out_dir = tmp_path / "models" / "fake"

    def broken_writer(gguf_path: Path, dest: Path) -> None:
        (dest / "config.json").write_text("{}")
        raise RuntimeError("disk full")

    monkeypatch.setattr(demo, "_write_hf_dir", broken_writer)
    with pytest.raises(RuntimeError, match="disk full"):
        convert_gguf_to_hf(gguf_path, out_dir)
    assert not out_dir.exists()
    assert [p.name for p in out_dir.parent.iterdir() if ".tmp-" in p.name] == []


def test_incomplete_out_dir_is_an_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gguf_path = tmp_path / "fake.gguf"
    gguf_path.write_bytes(b"GGUF")
    out_dir = tmp_path / "half"
    out_dir.mkdir()
    (out_dir / "config.json").write_text("{}")
    calls: list[Path] = []
    monkeypatch.setattr(demo, "_write_hf_dir", _fake_writer(calls))
    with pytest.raises(ValueError, match="not a complete converted model"):
        convert_gguf_to_hf(gguf_path, out_dir)
    assert calls == []


def test_missing_gguf_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="gguf_path"):
        convert_gguf_to_hf(tmp_path / "missing.gguf", tmp_path / "out")


def test_build_script_prints_path(
    converted_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    script = Path(__file__).resolve().parent.parent / "scripts" / "build_demo_model.py"
    spec = importlib.util.spec_from_file_location("build_demo_model", script)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    # The session's directory is complete, so this returns without converting.
    assert module.main(["--out", str(converted_dir)]) == 0
    assert capsys.readouterr().out.strip() == str(converted_dir)
