"""KV-cache block allocation with automatic prefix caching (plain Python, no torch).

Every stage holds the same block id space; the scheduler owns the block table and the stages
only read block ids, so reusing a block is a decision made here once for every stage.

Prefix caching: a *full* block is named by a hash chain over its tokens,
``hash(parent block's hash, the block's token ids, the multimodal items inside it)``, so two
requests whose prompts start with the same blocks name those blocks alike.  A block is offered
to the cache as soon as the step that computes its last token is scheduled (every stage runs
steps in order, so a later step that reads it finds its KV written).  When its last owner ends,
a named block is not forgotten: it joins an LRU list of evictable blocks that still remember
their hash.  A later request whose prompt starts with cached blocks takes them (their reference
counts rise) and computes only the rest; a block is evicted, least recently used first, only
when the pool needs a block and no never-named one is free.  Hashes are SHA-256, so every SPMD
rank (each running its own scheduler) makes the same decisions.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from dataclasses import asdict, dataclass

from pprun.core.request import Request

NULL_BLOCK_ID = 0
"""Never handed out: padded tokens of a CUDA-graph batch write their KV here."""

_ROOT_HASH = b""
"""Parent hash of a request's first block."""


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative integers."""
    return -(-a // b)


def min_blocks_for_one_request(max_model_len: int, block_size: int) -> int:
    """Blocks one request of ``max_model_len`` tokens needs (the null block not included).

    The engine checks ``num_blocks - 1 >= min_blocks_for_one_request(...)``: with fewer, a
    lone long request could never run and preemption would loop forever.
    """
    return cdiv(max_model_len, block_size)


def hash_block(parent_hash: bytes, token_ids: list[int], extra_keys: tuple = ()) -> bytes:
    """The name of one full block: SHA-256 of its parent's hash, its token ids and
    ``extra_keys`` (the multimodal items inside it: ``(content_hash, offset in the block)``).

    Equal prefixes give equal hashes in every process (no ``PYTHONHASHSEED``)."""
    h = hashlib.sha256(parent_hash)
    h.update(array("q", token_ids).tobytes())
    for content_hash, offset in extra_keys:
        h.update(f"|{content_hash}@{offset}".encode())
    return h.digest()


@dataclass
class PrefixCacheStats:
    """Prefix-caching counters of one engine (cumulative since it started, except the
    ``num_*_blocks`` snapshots).  Queries are first admissions of requests; a request resumed
    after preemption also reuses its cached blocks but is not counted here."""

    enabled: bool = False
    """Whether prefix caching is on."""
    num_queries: int = 0
    """Requests looked up in the cache when first admitted."""
    num_hits: int = 0
    """Of those, requests that found at least one cached block."""
    num_query_tokens: int = 0
    """Prompt tokens of the requests looked up."""
    num_hit_tokens: int = 0
    """Prompt tokens served from the cache (not computed)."""
    num_evicted_blocks: int = 0
    """Cached blocks whose hash was dropped to reuse the block for other tokens."""
    num_cached_blocks: int = 0
    """Blocks that hold a hash now (owned by a request or evictable)."""
    num_evictable_blocks: int = 0
    """Cached blocks no request owns now (reusable by a hit, or evicted when the pool needs them)."""
    num_free_blocks: int = 0
    """Blocks no request owns now (never-named and evictable ones)."""
    num_usable_blocks: int = 0
    """Blocks that can ever be handed out (all but the null block)."""

    @property
    def hit_rate(self) -> float:
        """Prompt tokens served from the cache over prompt tokens looked up (0 before any)."""
        return self.num_hit_tokens / self.num_query_tokens if self.num_query_tokens else 0.0

    def as_dict(self) -> dict:
        """The counters and ``hit_rate`` as a JSON-ready dict (what benchmarks and metrics read)."""
        return {**asdict(self), "hit_rate": self.hit_rate}


class BlockManager:
    """Hands out KV-cache block ids ``1..num_blocks-1``; with ``enable_prefix_caching`` it also
    names full blocks and reuses them (module docstring).

    Blocks never named (or dropped as duplicates) are handed out first, from a FIFO list; then
    evictable cached blocks, least recently freed first.  Same calls in the same order give the
    same block ids, which SPMD ranks (each running its own scheduler) rely on to agree on every
    block table.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False) -> None:
        if not isinstance(num_blocks, int) or num_blocks < 2:
            raise ValueError(
                f"num_blocks={num_blocks!r} is invalid: must be an integer >= 2 "
                f"(block {NULL_BLOCK_ID} is reserved as the null block)"
            )
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size={block_size!r} is invalid: must be an integer >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._free_block_ids: deque[int] = deque(range(NULL_BLOCK_ID + 1, num_blocks))
        """Unowned blocks without a hash, handed out first."""
        self._ref_counts = [0] * num_blocks
        """Requests owning each block (a cached block may be shared)."""
        self._block_hash: list[bytes | None] = [None] * num_blocks
        """Each block's hash while the cache remembers it."""
        self._cached: dict[bytes, int] = {}
        """Hash -> the one block holding it."""
        self._evictable: OrderedDict[int, None] = OrderedDict()
        """Unowned cached blocks, least recently freed first (the eviction order)."""
        self._registered_in_step = [-1] * num_blocks
        """The step (``begin_step`` count) in which each cached block was named."""
        self._step = 0
        self.stats = PrefixCacheStats(enabled=enable_prefix_caching)

    @property
    def num_usable_blocks(self) -> int:
        """Blocks that can ever be handed out (all but the null block)."""
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        """Blocks not owned by any request right now (evictable cached blocks included)."""
        return len(self._free_block_ids) + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks the cache names by a hash right now (owned or evictable)."""
        return len(self._cached)

    def blocks_needed(self, num_tokens: int, num_current_blocks: int) -> int:
        """Extra blocks a request holding ``num_current_blocks`` needs for ``num_tokens``."""
        return max(0, cdiv(num_tokens, self.block_size) - num_current_blocks)

    def begin_step(self) -> None:
        """A new step is being built (:meth:`registered_this_step` tells its blocks apart)."""
        self._step += 1

    def registered_this_step(self, block_id: int) -> bool:
        """True when ``block_id`` was named in the step being built: its KV is written by that
        same step, not by an earlier one."""
        return self._registered_in_step[block_id] == self._step

    # --- hashing -------------------------------------------------------------------------------

    def _extend_hashes(self, req: Request, num_blocks: int) -> None:
        """Grow ``req.block_hashes`` to its first ``num_blocks`` full blocks (tokens known)."""
        hashes = req.block_hashes
        if len(hashes) >= num_blocks:
            return
        bs = self.block_size
        prompt, outputs = req.prompt_token_ids, req.output_token_ids
        num_prompt = len(prompt)
        items = req.mm_items
        for i in range(len(hashes), num_blocks):
            start, end = i * bs, (i + 1) * bs
            if end <= num_prompt:
                token_ids = prompt[start:end]
            else:
                token_ids = prompt[start:end] + outputs[max(0, start - num_prompt) : end - num_prompt]
            extra: tuple = ()
            if items:
                # An item's placeholder tokens are all alike: the item's own hash tells two
                # images apart.  Its offset in the block tells apart where it starts.
                extra = tuple(
                    (item.content_hash, item.placeholder.offset - start)
                    for item in items
                    if item.placeholder.offset < end and item.placeholder.end > start
                )
            hashes.append(hash_block(hashes[-1] if hashes else _ROOT_HASH, token_ids, extra))

    # --- prefix caching -----------------------------------------------------------------------

    def find_cached_prefix(self, req: Request) -> list[int]:
        """The cached blocks ``req``'s tokens start with, in order (nothing is taken yet).

        At most ``(num_tokens - 1) // block_size`` blocks: the last token is always computed
        (its logits give the next token), and a hit is whole blocks only, so a shared block is
        never written again.
        """
        if not self.enable_prefix_caching:
            return []
        max_blocks = (req.num_tokens - 1) // self.block_size
        self._extend_hashes(req, max_blocks)
        block_ids = []
        cached = self._cached
        for block_hash in req.block_hashes[:max_blocks]:
            block_id = cached.get(block_hash)
            if block_id is None:
                break
            block_ids.append(block_id)
        return block_ids

    def register_full_blocks(self, req: Request, num_tokens: int) -> None:
        """Name ``req``'s blocks that ``num_tokens`` known, computed (or scheduled) tokens fill.

        A block whose hash another block already holds stays unnamed (it is freed as a plain
        block): one block per hash.
        """
        if not self.enable_prefix_caching:
            return
        num_full = min(num_tokens // self.block_size, len(req.block_ids))
        first = req.num_registered_blocks
        if num_full <= first:
            return
        self._extend_hashes(req, num_full)
        cached, block_hash = self._cached, self._block_hash
        for i in range(first, num_full):
            block_id = req.block_ids[i]
            if block_hash[block_id] is not None:
                continue  # taken from the cache
            h = req.block_hashes[i]
            if h in cached:
                continue  # computed twice (two requests admitted before either was cached)
            cached[h] = block_id
            block_hash[block_id] = h
            self._registered_in_step[block_id] = self._step
        req.num_registered_blocks = num_full

    def record_admission(self, req: Request, num_cached_tokens: int) -> None:
        """Count a first admission that found ``num_cached_tokens`` prompt tokens cached."""
        if not self.enable_prefix_caching:
            return
        s = self.stats
        s.num_queries += 1
        s.num_query_tokens += len(req.prompt_token_ids)
        if num_cached_tokens:
            s.num_hits += 1
            s.num_hit_tokens += num_cached_tokens

    def snapshot_stats(self) -> PrefixCacheStats:
        """The counters with the block counts of now (a copy)."""
        s = PrefixCacheStats(**asdict(self.stats))
        s.num_cached_blocks = len(self._cached)
        s.num_evictable_blocks = len(self._evictable)
        s.num_free_blocks = self.num_free_blocks
        s.num_usable_blocks = self.num_usable_blocks
        return s

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block and zero the counters (a benchmark's timed run after its
        warm-up on the same prompts).  Only while no request owns a block: returns False, with
        nothing changed, otherwise."""
        if self.num_free_blocks != self.num_usable_blocks:
            return False
        for block_id in self._evictable:
            self._block_hash[block_id] = None
        self._free_block_ids.extend(self._evictable)
        self._evictable.clear()
        self._cached.clear()
        self.stats = PrefixCacheStats(enabled=self.enable_prefix_caching)
        return True

    # --- allocation -------------------------------------------------------------------------------

    def _take_free_block(self) -> int:
        if self._free_block_ids:
            return self._free_block_ids.popleft()
        block_id, _ = self._evictable.popitem(last=False)
        del self._cached[self._block_hash[block_id]]  # type: ignore[index]
        self._block_hash[block_id] = None
        self.stats.num_evicted_blocks += 1
        return block_id

    def allocate(self, req: Request, num_total_tokens: int, cached_block_ids: list[int] | None = None) -> list[int] | None:
        """Grow ``req.block_ids`` to cover ``num_total_tokens`` tokens.

        ``cached_block_ids`` (a request without blocks, from :meth:`find_cached_prefix`) come
        first and are shared, not handed out.  Returns the block ids appended (cached ones
        included), or ``None`` with nothing changed when too few blocks are free.
        """
        cached_block_ids = cached_block_ids or []
        num_new_blocks = self.blocks_needed(num_total_tokens, len(req.block_ids) + len(cached_block_ids))
        ref_counts = self._ref_counts
        # Taking an evictable cached block removes it from the free pool.
        num_taken_from_free = sum(1 for b in cached_block_ids if ref_counts[b] == 0)
        if num_new_blocks + num_taken_from_free > self.num_free_blocks:
            return None
        for block_id in cached_block_ids:
            if ref_counts[block_id] == 0:
                del self._evictable[block_id]
            ref_counts[block_id] += 1
        new_block_ids = list(cached_block_ids)
        for _ in range(num_new_blocks):
            block_id = self._take_free_block()
            ref_counts[block_id] = 1
            new_block_ids.append(block_id)
        if cached_block_ids:
            req.num_registered_blocks = len(cached_block_ids)
        req.block_ids.extend(new_block_ids)
        return new_block_ids

    def free(self, req: Request) -> None:
        """Release every block of ``req`` and empty ``req.block_ids``.

        A block no other request owns becomes free: a cached one joins the evictable list
        (the request's last blocks first, so they are evicted before its first ones, which
        more requests share), an unnamed one the plain free list.
        """
        ref_counts, block_hash = self._ref_counts, self._block_hash
        for block_id in req.block_ids:
            ref_counts[block_id] -= 1
        for block_id in reversed(req.block_ids):
            if ref_counts[block_id] == 0 and block_hash[block_id] is not None:
                self._evictable[block_id] = None
        self._free_block_ids.extend(b for b in req.block_ids if ref_counts[b] == 0 and block_hash[b] is None)
        req.block_ids = []
        req.num_registered_blocks = 0
