"""The scheduler's view of the encoder cache: which items' outputs the first stage holds, who needs
them, which to encode in a step and which to free (plain Python, no torch).

The scheduler decides, the first stage follows: a :class:`~pprun.core.outputs.SchedulerOutput`
names the items to encode this step (``scheduled_encoder_inputs``) and the content hashes whose
outputs are no longer needed (``free_encoder_hashes``).  Entries are keyed by content hash, so an
item that appears twice in one request, or in several requests alive at once, is encoded once.
An entry lives while some unfinished request (waiting, running or preempted) holds an item with
its hash, so a preempted request recomputes from the cached output rather than encoding again.

An item that reaches the decoder through cross-attention (no embedding rows: a Whisper window) is
different: the stages encode it whenever its request is admitted, new or resumed after a
preemption (``pprun.worker.encoder_decoder``), into that request's cross-cache slot, so it costs
its ``num_encoder_positions`` every time its request's window starts at the prompt's beginning,
never deduplicated by hash.
"""

from __future__ import annotations

from collections.abc import Sequence

from pprun.multimodal.items import MultiModalItem


class EncoderCacheManager:
    """Reference counts of content hashes, and which of them the first stage has encoded."""

    def __init__(self) -> None:
        self._holders: dict[str, set[str]] = {}
        """Content hash -> ids of the unfinished requests that carry an item with it."""
        self._encoded: set[str] = set()
        """Hashes whose encoder output the first stage holds (or will, once its step runs)."""
        self._freed: list[str] = []
        """Hashes released since the last :meth:`take_freed`."""

    def add_request(self, req_id: str, items: Sequence[MultiModalItem]) -> None:
        """A request with these items arrived: it holds their hashes until it finishes."""
        for item in items:
            self._holders.setdefault(item.content_hash, set()).add(req_id)

    def release_request(self, req_id: str, items: Sequence[MultiModalItem]) -> None:
        """The request finished: its hashes that nobody else holds are freed."""
        for item in items:
            holders = self._holders.get(item.content_hash)
            if holders is None:
                continue
            holders.discard(req_id)
            if not holders:
                del self._holders[item.content_hash]
                if item.content_hash in self._encoded:
                    self._encoded.remove(item.content_hash)
                    self._freed.append(item.content_hash)

    def is_encoded(self, content_hash: str) -> bool:
        """True when the first stage holds (or is about to hold) this hash's encoder output."""
        return content_hash in self._encoded

    def mark_encoded(self, content_hash: str) -> None:
        """This hash is encoded in the step being built."""
        self._encoded.add(content_hash)

    def take_freed(self) -> list[str]:
        """The hashes freed since the last call (for the next step's ``free_encoder_hashes``)."""
        freed, self._freed = self._freed, []
        return freed

    @property
    def num_encoded(self) -> int:
        """Entries the first stage holds."""
        return len(self._encoded)

    @property
    def num_held(self) -> int:
        """Content hashes some unfinished request holds (encoded or not yet)."""
        return len(self._holders)


def reads_cross_attention(item: MultiModalItem) -> bool:
    """Whether ``item`` reaches the decoder through cross-attention (a Whisper window: no
    embedding rows in the prompt) rather than through its embedding rows."""
    return not item.num_embeds


def encoder_cost(item: MultiModalItem) -> int:
    """Encoder output rows that encoding ``item`` computes (its share of a step's encoder budget):
    its embedding rows, or for an item read through cross-attention its encoder positions."""
    return item.num_encoder_positions if reads_cross_attention(item) else item.num_embeds


def plan_encoder_inputs(
    items: Sequence[MultiModalItem],
    start: int,
    num_new_tokens: int,
    budget: int,
    cache: EncoderCacheManager,
) -> tuple[int, list[int], int]:
    """Which of a request's items to encode for its window ``[start, start + num_new_tokens)``.

    Items are looked at in prompt order; one whose range meets the window and whose hash is not
    encoded yet costs its :func:`encoder_cost` of the step's encoder ``budget`` (a cross-attention
    item: whenever the window starts at 0, see the module docstring).  When an item does
    not fit, the window is cut before its range (0: the request waits for a later step).  Returns
    ``(num_new_tokens, item indices to encode, encoder rows used)``; nothing is marked encoded here.
    """
    to_encode: list[int] = []
    hashes: set[str] = set()
    cost = 0
    for index in sorted(range(len(items)), key=lambda i: items[i].placeholder.offset):
        item = items[index]
        rng = item.placeholder
        if rng.offset >= start + num_new_tokens:
            break
        if not item.num_embeds:
            if start > 0 or not item.num_encoder_positions:
                continue  # encoded when the request was admitted (or costs nothing)
        elif rng.end <= start or cache.is_encoded(item.content_hash) or item.content_hash in hashes:
            continue
        if cost + encoder_cost(item) > budget:
            num_new_tokens = rng.offset - start
            to_encode = [i for i in to_encode if items[i].placeholder.offset < start + num_new_tokens]
            cost = sum(encoder_cost(items[i]) for i in to_encode)
            break
        to_encode.append(index)
        hashes.add(item.content_hash)
        cost += encoder_cost(item)
    return max(num_new_tokens, 0), to_encode, cost
