"""A tokenizer for the tiny random models (whose 256-token vocabulary no real tokenizer fits).

Token ``i`` is the two letters ``LETTERS[i % 16] + LETTERS[i // 16]`` (1 and 2 are BOS and EOS,
as in ``tiny_models.make_tiny_llama``): text is read two characters at a time (a pair outside
the vocabulary is token 0), outputs decode to letter text in which short stop strings occur
often, and a small chat template makes ``LLM.chat`` work.
"""

from __future__ import annotations

from pathlib import Path

LETTERS = "abcdefghijklmnop"
CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' ~ m['role']) }}{% endif %}"
    "{{ m['role'] }}{{ m['content'] }}"
    "{% endfor %}{% if add_generation_prompt %}assistant{% endif %}"
)
"""Roles other than system, user and assistant are an error of the template itself."""


def make_two_letter_tokenizer(path: Path | str) -> Path:
    """Write the tokenizer (``tokenizer.json`` and its config, with :data:`CHAT_TEMPLATE`) to ``path``."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {LETTERS[i % 16] + LETTERS[i // 16]: i for i in range(256)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="aa"))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern=Regex(".."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="ba", eos_token="ca", unk_token="aa")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)
    return Path(path)
