"""KV-cache block allocation: a deterministic free list of fixed-size blocks (no torch)."""

from __future__ import annotations

from collections import deque

from pprun.core.request import Request

NULL_BLOCK_ID = 0
"""Never handed out: padded tokens of a CUDA-graph batch write their KV here."""


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative integers."""
    return -(-a // b)


def min_blocks_for_one_request(max_model_len: int, block_size: int) -> int:
    """Blocks one request of ``max_model_len`` tokens needs (the null block not included).

    The engine checks ``num_blocks - 1 >= min_blocks_for_one_request(...)``: with fewer, a
    lone long request could never run and preemption would loop forever.
    """
    return cdiv(max_model_len, block_size)


class BlockManager:
    """Hands out KV-cache block ids ``1..num_blocks-1`` from a FIFO free list.

    Same calls in the same order give the same block ids, which SPMD ranks (each running its
    own scheduler) rely on to agree on every block table.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if not isinstance(num_blocks, int) or num_blocks < 2:
            raise ValueError(
                f"num_blocks={num_blocks!r} is invalid: must be an integer >= 2 "
                f"(block {NULL_BLOCK_ID} is reserved as the null block)"
            )
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size={block_size!r} is invalid: must be an integer >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free_block_ids: deque[int] = deque(range(NULL_BLOCK_ID + 1, num_blocks))

    @property
    def num_usable_blocks(self) -> int:
        """Blocks that can ever be handed out (all but the null block)."""
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        """Blocks not owned by any request right now."""
        return len(self._free_block_ids)

    def blocks_needed(self, num_tokens: int, num_current_blocks: int) -> int:
        """Extra blocks a request holding ``num_current_blocks`` needs for ``num_tokens``."""
        return max(0, cdiv(num_tokens, self.block_size) - num_current_blocks)

    def allocate(self, req: Request, num_total_tokens: int) -> list[int] | None:
        """Grow ``req.block_ids`` to cover ``num_total_tokens`` tokens.

        Returns the newly appended block ids (possibly empty), or ``None`` with nothing changed
        when too few blocks are free.
        """
        num_new_blocks = self.blocks_needed(num_total_tokens, len(req.block_ids))
        if num_new_blocks > len(self._free_block_ids):
            return None
        new_block_ids = [self._free_block_ids.popleft() for _ in range(num_new_blocks)]
        req.block_ids.extend(new_block_ids)
        return new_block_ids

    def free(self, req: Request) -> None:
        """Return every block of ``req`` to the free list and empty ``req.block_ids``."""
        self._free_block_ids.extend(req.block_ids)
        req.block_ids = []
