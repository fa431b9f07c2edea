"""The word tokenizer of ``scripts/make_random_model.py``: it loads through ``tokenizers`` and
transformers' ``AutoTokenizer``, has exactly the model's vocabulary, round-trips any ids but the
special ones (what vLLM's random benchmark dataset needs to make prompts of an exact length), and
``pprun serve`` takes text prompts and returns text with it."""

from __future__ import annotations

import importlib.util
import json
import random
import urllib.request
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
VOCAB = 300
"""Specials, the 80 one-syllable words and 217 two-syllable ones."""


def load_maker():
    """``scripts/make_random_model.py`` as a module."""
    spec = importlib.util.spec_from_file_location("make_random_model", REPO_ROOT / "scripts" / "make_random_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tiny_args(out: Path, *extra: str) -> list[str]:
    return [str(out), "--hidden", "64", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--intermediate", "128",
            "--vocab", str(VOCAB), "--dtype", "float32", *extra]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("word_llama")
    load_maker().main(tiny_args(out))
    return out


def vllm_random_prompt(tok, input_len: int, offset: int) -> tuple[str, list[int]]:
    """What vLLM 0.26's ``RandomDataset`` asks of a tokenizer: a run of consecutive non-special ids
    (``input_len`` minus the special tokens the tokenizer adds) decoded to text."""
    allowed = [i for i in range(tok.vocab_size) if i not in set(tok.all_special_ids)]
    num_ids = input_len - tok.num_special_tokens_to_add()
    ids = [allowed[(offset + k) % len(allowed)] for k in range(num_ids)]
    return tok.decode(ids), ids


def test_word_tokenizer_loads_and_round_trips(tiny_dir):
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_dir, local_files_only=True)
    raw = Tokenizer.from_file(str(tiny_dir / "tokenizer.json"))
    config = json.loads((tiny_dir / "config.json").read_text())
    assert tok.is_fast and tok.vocab_size == len(tok) == raw.get_vocab_size() == config["vocab_size"] == VOCAB
    assert (tok.bos_token_id, tok.eos_token_id, tok.unk_token_id) == (config["bos_token_id"], config["eos_token_id"], 0)
    assert sorted(tok.all_special_ids) == [0, 1, 2]

    rng = random.Random(0)
    ids = [rng.randrange(3, VOCAB) for _ in range(500)]
    text = tok.decode(ids)
    assert tok.encode(text, add_special_tokens=False) == ids == raw.encode(text, add_special_tokens=False).ids
    assert tok.encode(text) == [1, *ids]
    assert tok.decode([1, *ids[:3], 2], skip_special_tokens=True) == tok.decode(ids[:3])
    assert tok.encode("not-a-word " + tok.decode(ids[:1]), add_special_tokens=False) == [0, ids[0]]

    text, ids = vllm_random_prompt(tok, 512, offset=rng.randrange(VOCAB))
    assert len(tok.encode(text)) == 512 and tok.encode(text, add_special_tokens=False) == ids


def test_words_cover_the_published_vocabularies():
    """Qwen3's 151,936 ids take words of up to three syllables, all distinct and without whitespace."""
    words = load_maker().vocabulary_words(151936 - 3)
    assert len(set(words)) == len(words) and not any(w.split() != [w] for w in words)
    assert max(map(len, words)) == 6


def test_no_tokenizer_flag_and_vocab_check(tmp_path):
    maker = load_maker()
    info = maker.main(tiny_args(tmp_path / "bare", "--no-tokenizer"))
    assert info["tokenizer"] is None and not (tmp_path / "bare" / "tokenizer.json").exists()
    assert (tmp_path / "bare" / "model.safetensors").is_file()
    with pytest.raises(SystemExit):
        maker.parse_args(["out", "--vocab", "3"])
    assert maker.parse_args(["out", "--vocab", "3", "--no-tokenizer"]).vocab == 3


def test_pprun_serves_text_with_the_word_tokenizer(tiny_dir, tmp_path):
    """The request vLLM's ``bench serve --backend openai`` sends (a streamed text completion with
    ``ignore_eos``, ``repetition_penalty`` 1 and usage), plus pprun's ``return_token_ids``: the
    prompt is counted as its words and ``<s>``, the streamed text is the decode of the tokens."""
    from serve_helpers import ServerProcess
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_dir, local_files_only=True)
    prompt, prompt_ids = vllm_random_prompt(tok, 24, offset=7)
    server = ServerProcess(tmp_path, [f"model.model={tiny_dir}", "model.dtype=float32", "parallel=single",
                                      "serve.http_port=0", "serve.engine_process=false", "scheduler.max_num_seqs=4"])
    try:
        models = json.load(urllib.request.urlopen(f"http://{server.info['http_address']}/v1/models", timeout=60))
        body = {"model": models["data"][0]["id"], "prompt": prompt, "repetition_penalty": 1.0, "max_tokens": 12,
                "logprobs": None, "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True,
                "temperature": 1.0, "seed": 3, "return_token_ids": True}
        request = urllib.request.Request(f"http://{server.info['http_address']}/v1/completions",
                                         data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
        texts, token_ids, usage = [], [], None
        with urllib.request.urlopen(request, timeout=120) as response:
            for line in response:
                data = line.decode().strip().removeprefix("data:").strip()
                if not data or data == "[DONE]":
                    continue
                chunk = json.loads(data)
                for choice in chunk["choices"]:
                    texts.append(choice["text"])
                    token_ids += choice.get("token_ids") or []
                usage = chunk.get("usage") or usage
    finally:
        server.kill()
    assert usage == {"prompt_tokens": len(prompt_ids) + 1, "completion_tokens": 12, "total_tokens": len(prompt_ids) + 13}
    assert len(token_ids) == 12
    assert "".join(texts) == tok.decode(token_ids, skip_special_tokens=True) != ""
