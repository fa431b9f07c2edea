"""Incremental detokenization: the text each step's new tokens add, without re-decoding the output.

Decoding token by token is wrong for byte-level and SentencePiece tokenizers (a character may
span tokens; a word's leading space depends on what precedes it), and decoding the whole output
every step costs O(n) per token.  The method here (the one vLLM uses) decodes a short window
twice: the tokens already shown plus the new ones, and the tokens already shown alone, both from
the same start ``prefix_offset``; the difference is the new text.  Text ending in U+FFFD (an
incomplete UTF-8 sequence) waits for the next token.

A Hugging Face fast tokenizer does the same in Rust: ``tokenizers.decoders.DecodeStream`` keeps
the window and returns each token's text (None while a character is incomplete), one call per
token instead of two decodes of the window (about 1 us a token instead of 15-50 us, on the
thread that turns a step's report into deltas for every running request of a server).  Where a
tokenizer has no Rust backend (or an older ``tokenizers``), the two decodes are done here.
"""

from __future__ import annotations

from typing import Any

try:
    from tokenizers.decoders import DecodeStream
except ImportError:  # tokenizers < 0.21
    DecodeStream = None


class IncrementalDetokenizer:
    """Turns a request's output token ids, a few at a time, into text deltas.

    ``text`` (all deltas joined) equals ``tokenizer.decode(all_ids)`` for the tokenizers pprun
    serves; :meth:`finish` reconciles the rare case where it does not.
    """

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self.text = ""
        """Text decoded so far (all deltas joined)."""
        self.prefix_offset = 0
        self.read_offset = 0
        self._stream = None
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        """The Rust tokenizer of a fast tokenizer (None: decode in Python)."""
        if self._backend is not None and DecodeStream is not None:
            self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, new_token_ids: list[int]) -> str:
        """Append tokens; returns the text they complete ("" while a character is incomplete)."""
        if self.tokenizer is None:
            return ""
        self.token_ids.extend(new_token_ids)
        if self._stream is not None:
            step, backend = self._stream.step, self._backend
            chunks = [c for c in (step(backend, i) for i in new_token_ids) if c is not None]
            delta = chunks[0] if len(chunks) == 1 else "".join(chunks)
            self.text += delta
            return delta
        prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.token_ids[self.prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        delta = new_text[len(prefix_text) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        self.text += delta
        return delta

    def finish(self, final_text: str | None, sent_len: int) -> str:
        """The last delta, given the request's final text and how many characters were sent.

        ``final_text`` is the engine's decode of the whole output (cut before a stop string), or
        None for this detokenizer to decode every token id it was given (the same decode, done
        where the engine did not do it); it normally extends what was sent.  If a tokenizer's
        clean-up made it differ, what was sent cannot be taken back: the rest of this
        detokenizer's own text is sent instead.
        """
        if final_text is None:
            final_text = self._decode(self.token_ids)
        sent = self.text[:sent_len]
        if final_text.startswith(sent):
            return final_text[sent_len:]
        return self.text[sent_len:]
