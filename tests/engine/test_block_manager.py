"""BlockManager: reference counts, prefix hits, LRU eviction order, no leaks."""

from __future__ import annotations

from engine.block_manager import BlockManager
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence

BS = 4


def _seq(tokens: list[int], seq_id: int = 0) -> Sequence:
    return Sequence(seq_id, f"r{seq_id}", 0, tokens, SamplingParams(), 8, frozenset(), None, None)


def _admit(bm: BlockManager, seq: Sequence) -> list[int]:
    cached = bm.find_cached_blocks(seq)
    num_new = seq.num_tokens - len(cached) * BS
    assert bm.can_allocate(seq, cached, num_new)
    bm.allocate(seq, cached, num_new)
    seq.num_computed_tokens = seq.num_tokens
    bm.cache_full_blocks(seq)
    return cached


def test_allocates_ceil_blocks_and_frees_everything() -> None:
    bm = BlockManager(10, BS, enable_prefix_caching=True)
    seq = _seq(list(range(10)))
    _admit(bm, seq)
    assert len(seq.block_table) == 3
    assert bm.num_free_blocks == 7
    bm.free(seq)
    assert bm.num_free_blocks == 10
    assert all(b.ref_count == 0 for b in bm.blocks)


def test_shared_prefix_reuses_full_blocks_by_reference_count() -> None:
    bm = BlockManager(10, BS, enable_prefix_caching=True)
    a = _seq([1, 2, 3, 4, 5, 6, 7, 8, 9], 0)
    _admit(bm, a)
    b = _seq([1, 2, 3, 4, 5, 6, 7, 8, 42, 43], 1)
    cached = _admit(bm, b)
    assert cached == a.block_table[:2]
    assert b.block_table[:2] == a.block_table[:2]
    assert [bm.blocks[i].ref_count for i in a.block_table[:2]] == [2, 2]
    assert b.block_table[2] != a.block_table[2]


def test_last_token_is_never_served_from_cache() -> None:
    bm = BlockManager(10, BS, enable_prefix_caching=True)
    a = _seq(list(range(8)), 0)
    _admit(bm, a)
    b = _seq(list(range(8)), 1)  # identical 2-block prompt: only the first block may hit
    assert bm.find_cached_blocks(b) == a.block_table[:1]


def test_freed_cached_blocks_are_revived_without_recompute() -> None:
    bm = BlockManager(10, BS, enable_prefix_caching=True)
    a = _seq(list(range(9)), 0)
    _admit(bm, a)
    first_blocks = a.block_table[:2]
    bm.free(a)
    b = _seq(list(range(9)) + [99], 1)
    assert _admit(bm, b) == first_blocks
    assert bm.num_free_blocks == 10 - 3


def test_uncached_blocks_are_reused_before_cached_ones() -> None:
    bm = BlockManager(4, BS, enable_prefix_caching=True)
    a = _seq(list(range(6)), 0)  # block 0 full (cached), block 1 partial (not cached)
    _admit(bm, a)
    assert a.block_table == [0, 1]
    partial = a.block_table[1]
    bm.free(a)
    c = _seq([50, 51], 2)
    _admit(bm, c)
    assert c.block_table == [partial]
    assert bm.find_cached_blocks(_seq(list(range(6)), 3)) == [0]


def test_eviction_is_least_recently_freed_first() -> None:
    bm = BlockManager(4, BS, enable_prefix_caching=True)
    old = _seq([1, 1, 1, 1, 9], 0)
    new = _seq([2, 2, 2, 2, 9], 1)
    _admit(bm, old)
    _admit(bm, new)
    old_block, new_block = old.block_table[0], new.block_table[0]
    bm.free(old)
    bm.free(new)
    # Two fresh blocks are needed by a new sequence: the partial (uncached) blocks go first,
    # then the third pick must evict the older cached block and keep the newer one.
    hog = _seq(list(range(100, 111)), 2)
    _admit(bm, hog)
    assert old_block in hog.block_table and new_block not in hog.block_table
    assert bm.find_cached_blocks(_seq([1, 1, 1, 1, 9], 3)) == []
    assert bm.find_cached_blocks(_seq([2, 2, 2, 2, 9], 4)) == [new_block]


def test_hash_collision_is_caught_by_token_comparison() -> None:
    bm = BlockManager(8, BS, enable_prefix_caching=True)
    a = _seq([1, 2, 3, 4, 5], 0)
    _admit(bm, a)
    block = bm.blocks[a.block_table[0]]
    block.token_ids = (9, 9, 9, 9)  # simulate a different block that happened to share the hash
    assert bm.find_cached_blocks(_seq([1, 2, 3, 4, 5], 1)) == []


def test_prefix_caching_off_shares_nothing() -> None:
    bm = BlockManager(8, BS, enable_prefix_caching=False)
    a = _seq(list(range(9)), 0)
    _admit(bm, a)
    assert bm.find_cached_blocks(_seq(list(range(9)), 1)) == []


def test_can_allocate_counts_revived_blocks_against_free_space() -> None:
    bm = BlockManager(5, BS, enable_prefix_caching=True)
    a = _seq(list(range(9)), 0)
    _admit(bm, a)
    bm.free(a)
    _admit(bm, _seq([50, 51, 52, 53, 54], 1))  # holds 2 blocks, leaving 3 free (2 of them cached)
    b = _seq(list(range(8)) + [7, 7, 7, 7, 7, 7, 7, 7], 2)
    cached = bm.find_cached_blocks(b)
    assert len(cached) == 2
    assert bm.can_allocate(b, cached, 4)  # 2 revived + 1 new block
    assert not bm.can_allocate(b, cached, 8)  # 2 revived + 2 new blocks > 3 free
