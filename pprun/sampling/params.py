"""User-facing sampling parameters (plain Python: the scheduler imports this, torch does not)."""

from __future__ import annotations

from dataclasses import dataclass

from pprun.checks import SEED_MAX, SEED_MIN, is_int, is_number, is_seed


@dataclass
class SamplingParams:
    """How to pick each output token and when to stop; names follow vLLM's ``SamplingParams``.

    Call :meth:`validate` (the engine does) before any work starts: every bad value raises a
    ``ValueError`` naming the field, the value and what is allowed.
    """

    n: int = 1
    """Number of completions per prompt (only 1 is supported)."""
    temperature: float = 1.0
    """Softmax temperature; 0 means greedy."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability sums to ``top_p``; in (0, 1]."""
    top_k: int = -1
    """Keep the ``top_k`` most likely tokens; -1 (or 0) keeps all."""
    min_p: float = 0.0
    """Drop tokens whose probability is below ``min_p`` times the top token's; in [0, 1]."""
    seed: int | None = None
    """Per-request seed: a seeded request yields the same tokens alone or in any batch."""
    max_tokens: int | None = 16
    """Most tokens to generate; ``None`` means up to the model's context length."""
    min_tokens: int = 0
    """Stop conditions (EOS, stop tokens, stop strings) are ignored before this many tokens."""
    stop: list[str] | str | None = None
    """Strings that end generation; the matched string is not included in the text."""
    stop_token_ids: list[int] | None = None
    """Token ids that end generation (kept in ``token_ids``)."""
    ignore_eos: bool = False
    """Keep generating past the model's end-of-sequence token."""
    logprobs: int | None = None
    """Return the sampled token's log-probability and the top ``logprobs`` alternatives."""
    skip_special_tokens: bool = True
    """Leave special tokens out of the decoded text."""
    suppress_token_ids: list[int] | None = None
    """Token ids never sampled: their logits are set to -inf before sampling (and logprobs)."""
    begin_suppress_token_ids: list[int] | None = None
    """Token ids not sampled as the first output token (a checkpoint's ``begin_suppress_tokens``)."""

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is None:
            self.stop = []
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        if self.suppress_token_ids is None:
            self.suppress_token_ids = []
        if self.begin_suppress_token_ids is None:
            self.begin_suppress_token_ids = []

    @property
    def greedy(self) -> bool:
        """True when sampling reduces to argmax."""
        return self.temperature == 0.0

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first bad field, its value and what is allowed.

        Integers must be ``int`` (a ``bool`` is refused), numbers finite, flags ``bool``."""

        def bad(name: str, allowed: str) -> None:
            raise ValueError(
                f"SamplingParams.{name}={getattr(self, name)!r} is invalid: {allowed}"
            )

        if not is_int(self.n) or self.n != 1:
            bad("n", "only n=1 is supported")
        if not is_number(self.temperature) or self.temperature < 0:
            bad("temperature", "must be a finite number >= 0 (0 means greedy)")
        if not is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            bad("top_p", "must be a number in (0, 1]")
        if not is_int(self.top_k) or self.top_k < -1:
            bad("top_k", "must be an integer >= -1 (-1 or 0 disables top-k)")
        if not is_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            bad("min_p", "must be a number in [0, 1]")
        if self.max_tokens is not None and (not is_int(self.max_tokens) or self.max_tokens < 1):
            bad("max_tokens", "must be an integer >= 1, or None")
        if not is_int(self.min_tokens) or self.min_tokens < 0:
            bad("min_tokens", "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", f"must be at most max_tokens={self.max_tokens}")
        if self.seed is not None and not is_seed(self.seed):
            bad("seed", f"must be an integer in [{SEED_MIN}, {SEED_MAX}] (64 bits), or None")
        if self.logprobs is not None and (not is_int(self.logprobs) or self.logprobs < 0):
            bad("logprobs", "must be an integer >= 0, or None")
        if not isinstance(self.stop, (list, tuple)) or not all(isinstance(s, str) and s for s in self.stop):
            bad("stop", "must be a non-empty string or a list of them")
        if not isinstance(self.stop_token_ids, (list, tuple)) or not all(
            is_int(t) and t >= 0 for t in self.stop_token_ids
        ):
            bad("stop_token_ids", "must be a list of non-negative integers")
        for name in ("suppress_token_ids", "begin_suppress_token_ids"):
            ids = getattr(self, name)
            if not isinstance(ids, (list, tuple)) or not all(is_int(t) and t >= 0 for t in ids):
                bad(name, "must be a list of non-negative integers")
        for flag in ("ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, flag), bool):
                bad(flag, "must be True or False")
