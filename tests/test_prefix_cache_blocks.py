"""Prefix caching in the block manager and the scheduler (pure Python, fast): the hash chain,
reference counts, LRU eviction order, hits after a request ends, no reuse of a partly filled
block, admission at the cached prefix, and preemption freeing into the cache."""

from __future__ import annotations

from pprun.core.block_manager import BlockManager, hash_block
from pprun.core.outputs import ModelRunnerOutput
from pprun.core.request import Request
from pprun.core.scheduler import Scheduler
from pprun.multimodal.items import MultiModalItem, PlaceholderRange
from pprun.sampling.params import SamplingParams

BS = 4
PARAMS = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def req(req_id: str, token_ids: list[int], **kw) -> Request:
    return Request(req_id, list(token_ids), PARAMS, **kw)


def admit(bm: BlockManager, r: Request, num_tokens: int | None = None) -> list[int]:
    """Take ``r``'s cached prefix and blocks for all its tokens; name the full ones (what the
    scheduler does when it admits and schedules a whole prompt)."""
    cached = bm.find_cached_prefix(r)
    assert bm.allocate(r, r.num_tokens, cached) is not None
    bm.register_full_blocks(r, r.num_tokens if num_tokens is None else num_tokens)
    return cached


# --- hash chain --------------------------------------------------------------------------------


def test_hash_chain_names_a_block_by_everything_before_it():
    bm = BlockManager(32, BS, enable_prefix_caching=True)
    a = req("a", [5, 6, 7, 8, 9, 10, 11, 12, 13])
    b = req("b", [5, 6, 7, 8, 9, 10, 11, 12, 99])
    c = req("c", [4, 6, 7, 8, 9, 10, 11, 12, 13])  # first token differs
    for r in (a, b, c):
        bm._extend_hashes(r, 2)
    assert a.block_hashes == b.block_hashes  # the 9th token is in no full block
    # A different first block renames every block after it, though their tokens are equal.
    assert c.block_hashes[0] != a.block_hashes[0] and c.block_hashes[1] != a.block_hashes[1]
    assert a.block_hashes[1] == hash_block(a.block_hashes[0], [9, 10, 11, 12])


def test_multimodal_items_are_part_of_a_blocks_name():
    """Placeholder tokens are all alike: the item's content hash (and where it starts) tells
    two images apart."""
    bm = BlockManager(32, BS, enable_prefix_caching=True)
    tokens = [5, 7, 7, 7, 7, 7, 7, 8]

    def with_image(req_id: str, content_hash: str, offset: int = 1) -> Request:
        item = MultiModalItem("image", content_hash, PlaceholderRange(offset, 6))
        return req(req_id, tokens, mm_items=[item])

    a, same, other, moved = with_image("a", "img0"), with_image("s", "img0"), with_image("o", "img1"), with_image("m", "img0", 2)
    for r in (a, same, other, moved):
        bm._extend_hashes(r, 2)
    assert a.block_hashes == same.block_hashes
    assert other.block_hashes[0] != a.block_hashes[0] and other.block_hashes[1] != a.block_hashes[1]
    assert moved.block_hashes[0] != a.block_hashes[0]


# --- hits, reference counts, partial blocks ------------------------------------------------------


def test_a_finished_requests_full_blocks_are_hit_by_a_later_request():
    bm = BlockManager(32, BS, enable_prefix_caching=True)
    a = req("a", list(range(10, 20)))  # 10 tokens: 2 full blocks, 1 partial
    admit(bm, a)
    a_blocks = list(a.block_ids)
    bm.free(a)
    assert bm.num_cached_blocks == 2 and bm.num_free_blocks == 31
    b = req("b", list(range(10, 20)) + [1, 2, 3])
    cached = admit(bm, b)
    assert cached == a_blocks[:2]  # the partly filled third block is not reused
    assert b.block_ids[:2] == a_blocks[:2] and a_blocks[2] not in b.block_ids[2:]
    bm.record_admission(b, len(cached) * BS)
    stats = bm.snapshot_stats()
    assert (stats.num_queries, stats.num_hits, stats.num_hit_tokens, stats.num_query_tokens) == (1, 1, 8, 13)


def test_the_last_token_is_always_computed():
    """A prompt of exactly two full blocks finds only the first: its last token's logits are
    needed, and a hit is whole blocks."""
    bm = BlockManager(32, BS, enable_prefix_caching=True)
    admit(bm, req("a", list(range(10, 18))))
    assert len(bm.find_cached_prefix(req("b", list(range(10, 18))))) == 1
    assert len(bm.find_cached_prefix(req("c", list(range(10, 19))))) == 2


def test_shared_blocks_are_reference_counted():
    bm = BlockManager(32, BS, enable_prefix_caching=True)
    a, b = req("a", list(range(10, 19))), req("b", list(range(10, 19)))
    admit(bm, a)
    assert admit(bm, b) == a.block_ids[:2]  # b shares a's two full blocks while a runs
    assert bm.num_free_blocks == 31 - 3 - 1  # a: 3 blocks, b: its own third block only
    bm.free(a)
    assert bm.num_free_blocks == 31 - 3  # a's third block; the shared two are b's still
    assert bm.snapshot_stats().num_evictable_blocks == 0
    bm.free(b)
    assert bm.num_free_blocks == 31 and bm.snapshot_stats().num_evictable_blocks == 2


def test_a_block_computed_twice_is_cached_once():
    """Two requests admitted before either was cached compute the same block: one hash, one
    block; the other is freed as a plain block."""
    bm = BlockManager(32, BS, enable_prefix_caching=True)
    a, b = req("a", list(range(10, 19))), req("b", list(range(10, 19)))
    bm.allocate(a, a.num_tokens)
    bm.allocate(b, b.num_tokens)
    bm.register_full_blocks(a, 9)
    bm.register_full_blocks(b, 9)
    assert bm.num_cached_blocks == 2
    bm.free(a)
    bm.free(b)
    assert bm.num_cached_blocks == 2 and bm.snapshot_stats().num_evictable_blocks == 2


def test_without_prefix_caching_nothing_is_named_or_found():
    bm = BlockManager(32, BS)
    a = req("a", list(range(10, 19)))
    admit(bm, a)
    bm.free(a)
    assert bm.num_cached_blocks == 0 and bm.find_cached_prefix(req("b", list(range(10, 19)))) == []


def test_reset_forgets_every_cached_block_once_none_is_owned():
    bm = BlockManager(32, BS, enable_prefix_caching=True)
    a = req("a", list(range(10, 19)))
    admit(bm, a)
    bm.record_admission(a, 0)
    assert not bm.reset_prefix_cache() and bm.num_cached_blocks == 2  # a still owns its blocks
    bm.free(a)
    assert bm.reset_prefix_cache()
    assert bm.num_cached_blocks == 0 and bm.num_free_blocks == 31 and bm.stats.num_queries == 0
    assert bm.find_cached_prefix(req("b", list(range(10, 19)))) == []
    b = req("b", list(range(10, 19)))
    admit(bm, b)  # the forgotten blocks are plain free blocks again
    assert bm.num_cached_blocks == 2


# --- eviction ---------------------------------------------------------------------------------------


def test_eviction_is_least_recently_freed_first_and_only_when_needed():
    bm = BlockManager(7, BS, enable_prefix_caching=True)  # 6 usable blocks
    a, b = req("a", list(range(10, 18))), req("b", list(range(30, 38)))
    admit(bm, a)
    admit(bm, b)
    a_blocks, b_blocks = list(a.block_ids), list(b.block_ids)
    bm.free(a)
    bm.free(b)
    # Never-named blocks go first: the cache keeps all four.
    c = req("c", list(range(50, 58)))
    admit(bm, c, num_tokens=0)
    assert bm.snapshot_stats().num_evicted_blocks == 0 and bm.num_cached_blocks == 4
    # Then the least recently freed, a request's last block before its first.
    d = req("d", list(range(70, 82)))
    assert bm.allocate(d, d.num_tokens) is not None
    assert d.block_ids == [a_blocks[1], a_blocks[0], b_blocks[1]]
    stats = bm.snapshot_stats()
    assert stats.num_evicted_blocks == 3 and stats.num_cached_blocks == 1
    assert bm.find_cached_prefix(req("a2", list(range(10, 19)))) == []
    assert bm.find_cached_prefix(req("b2", list(range(30, 39)))) == [b_blocks[0]]


def test_a_hit_keeps_its_blocks_from_eviction():
    bm = BlockManager(5, BS, enable_prefix_caching=True)  # 4 usable blocks
    a = req("a", list(range(10, 18)))
    admit(bm, a)
    first = a.block_ids[0]
    bm.free(a)
    b = req("b", list(range(10, 14)) + [1])  # shares a's first block, takes one plain block
    assert admit(bm, b) == [first]
    # Two blocks are free (a's second, evictable, and one plain): a third is refused.
    c = req("c", list(range(60, 72)))
    assert bm.allocate(c, c.num_tokens) is None and c.block_ids == []
    assert bm.allocate(c, 8) is not None and first not in c.block_ids
    assert bm.snapshot_stats().num_evicted_blocks == 1


# --- the scheduler ------------------------------------------------------------------------------------


def make_scheduler(num_blocks: int = 64, max_model_len: int = 64, **kw) -> Scheduler:
    kw.setdefault("max_num_batched_tokens", 64)
    return Scheduler(max_num_seqs=8, max_model_len=max_model_len, block_size=BS, num_blocks=num_blocks,
                     enable_prefix_caching=True, **kw)  # fmt: skip


def apply(s: Scheduler, so) -> None:
    """The step's output: token 7 for every scheduled request."""
    s.update_from_output(so, ModelRunnerOutput(so.step_id, list(so.num_scheduled_tokens),
                                               [[7] for _ in so.num_scheduled_tokens]))  # fmt: skip


def run_to_end(s: Scheduler) -> None:
    while s.has_unfinished_requests():
        apply(s, s.schedule())


def test_admission_starts_at_the_cached_prefix():
    s = make_scheduler()
    s.add_request(req("a", list(range(10, 21))))
    run_to_end(s)
    s.add_request(req("b", list(range(10, 21)) + [3, 4]))
    so = s.schedule()
    (new,) = so.scheduled_new_reqs
    assert new.num_computed_tokens == 8 and so.num_scheduled_tokens["b"] == 5
    assert s.get_request("b").num_cached_tokens == 8
    assert s.block_manager.stats.num_hit_tokens == 8


def test_requests_admitted_in_one_step_share_the_blocks_it_computes():
    s = make_scheduler()
    prefix = list(range(10, 26))
    s.add_request(req("a", prefix + [1]))
    s.add_request(req("b", prefix + [2, 3]))
    so = s.schedule()
    a, b = so.scheduled_new_reqs
    assert b.num_computed_tokens == 16 and b.block_ids[:4] == a.block_ids[:4]
    assert so.num_scheduled_tokens == {"a": 17, "b": 2}


def test_a_one_token_step_never_reads_a_block_its_own_step_writes():
    """A request left with one token to compute may run in a fused decode kernel (KV write and
    attention in one launch): it reads no block named in the same step."""
    s = make_scheduler()
    prefix = list(range(10, 18))
    s.add_request(req("a", prefix))
    s.add_request(req("b", prefix + [1]))  # 9 tokens: two cached blocks would leave one token
    so = s.schedule()
    assert so.scheduled_new_reqs[1].num_computed_tokens == 0 and so.num_scheduled_tokens["b"] == 9
    apply(s, so)
    run_to_end(s)
    s.add_request(req("c", prefix + [1]))  # a step later: the blocks were written before
    so = s.schedule()
    assert so.scheduled_new_reqs[0].num_computed_tokens == 8 and so.num_scheduled_tokens["c"] == 1


def test_the_one_token_guard_keeps_a_prompt_whole_without_chunked_prefill():
    """Where the guard gives up cached blocks, the rest of the prompt must still fit the step's
    budget whole when chunked prefill is off: the request waits a step instead of being cut."""
    s = Scheduler(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64, block_size=16, num_blocks=20,
                  enable_chunked_prefill=False, enable_prefix_caching=True)
    prompt = list(range(10, 43))  # 33 tokens: two full blocks and one token
    s.add_request(req("a", prompt))
    s.add_request(req("b", list(prompt)))
    so = s.schedule()
    assert so.num_scheduled_tokens == {"a": 33}
    apply(s, so)
    so = s.schedule()
    assert so.num_scheduled_tokens["b"] == 1 and so.scheduled_new_reqs[0].num_computed_tokens == 32


def test_a_preempted_request_frees_into_the_cache_and_resumes_from_it():
    s = make_scheduler(num_blocks=7, max_model_len=24, max_num_batched_tokens=16)  # 6 usable blocks
    longer = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    s.add_request(Request("a", list(range(10, 18)), longer))
    s.add_request(Request("b", list(range(30, 38)), longer))
    so = s.schedule()
    assert set(so.num_scheduled_tokens) == {"a", "b"}
    apply(s, so)
    # Decoding a and b past 12 tokens takes 6 blocks; one more token preempts b.
    for _ in range(8):
        apply(s, s.schedule())
        if s.get_request("b").num_preemptions:
            break
    b = s.get_request("b")
    assert b.num_preemptions == 1 and b.block_ids == []
    assert s.block_manager.num_cached_blocks >= 2
    resumed = None
    while resumed is None:
        so = s.schedule()
        resumed = next((new for new in so.scheduled_new_reqs if new.req_id == "b"), None)
        apply(s, so)
    # a, still decoding, took b's last blocks (evicted first) but not its first one.
    assert 0 < resumed.num_computed_tokens < len(resumed.prompt_token_ids) - BS
    assert s.block_manager.stats.num_evicted_blocks > 0
    run_to_end(s)
    assert s.block_manager.snapshot_stats().num_queries == 2  # resumptions are not queries
