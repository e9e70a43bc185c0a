"""BlockManager: paged KV blocks, reference counts, prefix-cache hashes and LRU eviction."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence as Seq
from dataclasses import dataclass

from engine.sequence import Sequence

_ROOT_HASH = 0x5357_4254  # parent hash of the first block of every sequence


def hash_block(parent_hash: int, token_ids: Seq[int]) -> int:
    """Chained hash of a full block: its tokens and everything before them (via the parent)."""
    return hash((parent_hash, tuple(token_ids)))


@dataclass
class Block:
    """One KV block: `block_size` token slots in every layer's pool."""

    block_id: int
    ref_count: int = 0
    block_hash: int | None = None
    parent_hash: int = 0
    token_ids: tuple[int, ...] = ()

    def reset(self) -> None:
        """Forget the cached content (the block is about to hold other tokens)."""
        self.block_hash = None
        self.parent_hash = 0
        self.token_ids = ()


class BlockManager:
    """Hands out KV blocks to sequences and shares full blocks between identical prefixes.

    Free blocks live in one ordered dict used as an LRU queue (O(1) push, pop and removal):
    blocks without cached content sit at the front and are reused first; freed blocks that
    hold a cached prefix go to the back and are evicted oldest-first only when needed.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool) -> None:
        assert num_blocks > 0 and block_size > 0
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[int, int] = {}  # block hash -> block id
        self.prefix_queries = 0  # prompt tokens looked up in the cache
        self.prefix_hits = 0  # of those, tokens found

    # ----------------------------------------------------------------- queries
    @property
    def num_free_blocks(self) -> int:
        """Blocks with no owner (cached-but-unreferenced blocks included: they can be evicted)."""
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by running sequences."""
        return 1.0 - len(self._free) / self.num_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold `num_tokens` tokens."""
        return -(-num_tokens // self.block_size)

    def _update_hashes(self, seq: Sequence) -> None:
        """Extend seq.block_hashes to every full block of its current tokens."""
        bs = self.block_size
        hashes = seq.block_hashes
        for i in range(len(hashes), len(seq.token_ids) // bs):
            parent = hashes[-1] if hashes else _ROOT_HASH
            hashes.append(hash_block(parent, seq.token_ids[i * bs : (i + 1) * bs]))

    def find_cached_blocks(self, seq: Sequence) -> list[int]:
        """Block ids holding the longest cached prefix of the sequence's tokens.

        At least one token is always left to compute, since its logits are needed.
        """
        if not self.enable_prefix_caching:
            return []
        self._update_hashes(seq)
        bs = self.block_size
        max_blocks = (seq.num_tokens - 1) // bs
        found: list[int] = []
        parent = _ROOT_HASH
        for i in range(max_blocks):
            h = seq.block_hashes[i]
            block_id = self._cached.get(h)
            if block_id is None:
                break
            block = self.blocks[block_id]
            tokens = seq.token_ids[i * bs : (i + 1) * bs]
            if block.parent_hash != parent or block.token_ids != tuple(tokens):
                break  # hash collision: not our prefix
            found.append(block_id)
            parent = h
        return found

    def can_allocate(self, seq: Sequence, cached: list[int], num_new_tokens: int) -> bool:
        """Whether a waiting sequence's cached prefix plus `num_new_tokens` tokens fit now."""
        revived = sum(1 for b in cached if self.blocks[b].ref_count == 0)
        needed = self.num_blocks_for(len(cached) * self.block_size + num_new_tokens) - len(cached)
        return revived + needed <= len(self._free)

    def allocate(self, seq: Sequence, cached: list[int], num_new_tokens: int) -> None:
        """Give a waiting sequence its cached prefix blocks and fresh blocks for new tokens."""
        assert not seq.block_table and seq.num_computed_tokens == 0
        for block_id in cached:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self._free[block_id]  # revive from the LRU queue
            block.ref_count += 1
            seq.block_table.append(block_id)
        seq.num_computed_tokens = len(cached) * self.block_size
        self.append_slots(seq, num_new_tokens)

    def can_append_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Whether a running sequence can grow by `num_new_tokens` tokens."""
        needed = self.num_blocks_for(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        return needed <= len(self._free)

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> None:
        """Add the blocks needed for `num_new_tokens` more tokens."""
        needed = self.num_blocks_for(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        assert needed <= len(self._free), "caller must check can_append_slots first"
        for _ in range(needed):
            seq.block_table.append(self._pop_free())

    def trim(self, seq: Sequence) -> None:
        """Give back the blocks past the sequence's tokens (held for drafts that were rejected)."""
        keep = self.num_blocks_for(seq.num_tokens)
        while len(seq.block_table) > keep:
            block = self.blocks[seq.block_table.pop()]
            assert block.ref_count == 1 and block.block_hash is None, "a draft's block is its own"
            block.ref_count = 0
            self._free[block.block_id] = None
            self._free.move_to_end(block.block_id, last=False)

    def _pop_free(self) -> int:
        block_id, _ = self._free.popitem(last=False)
        block = self.blocks[block_id]
        assert block.ref_count == 0
        if block.block_hash is not None:  # evict its cached content
            if self._cached.get(block.block_hash) == block_id:
                del self._cached[block.block_hash]
            block.reset()
        block.ref_count = 1
        return block_id

    # ---------------------------------------------------------------- updates
    def record_prefix_query(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        """Count a prefix-cache lookup (in tokens), for metrics."""
        self.prefix_queries += num_query_tokens
        self.prefix_hits += num_hit_tokens

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the sequence's computed full blocks in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        num_full = min(seq.num_computed_tokens // bs, len(seq.block_table))
        if num_full <= seq.num_published_blocks:
            return
        self._update_hashes(seq)
        for i in range(seq.num_published_blocks, num_full):
            block = self.blocks[seq.block_table[i]]
            if block.block_hash is not None:
                continue  # already cached (shared prefix or registered earlier)
            h = seq.block_hashes[i]
            if h in self._cached:
                continue  # same content computed twice concurrently: keep the first copy
            block.block_hash = h
            block.parent_hash = seq.block_hashes[i - 1] if i else _ROOT_HASH
            block.token_ids = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            self._cached[h] = block.block_id
        seq.num_published_blocks = num_full

    def free(self, seq: Sequence) -> None:
        """Drop the sequence's references; blocks reaching zero become free (cached ones evictable)."""
        # Reverse order: a sequence's tail blocks are the least likely to be shared, evict them first.
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            assert block.ref_count > 0
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None
                if block.block_hash is None:
                    self._free.move_to_end(block_id, last=False)
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.num_published_blocks = 0

    def reset_prefix_cache(self) -> None:
        """Forget every cached-but-unreferenced block."""
        for block_id in self._free:
            block = self.blocks[block_id]
            if block.block_hash is not None:
                self._cached.pop(block.block_hash, None)
                block.reset()
