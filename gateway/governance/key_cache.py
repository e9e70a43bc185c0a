"""KeyCache: looked-up keys and unknown digests, each in its own bounded LRU with its own TTL.

Keys found and digests not found are kept apart so that a flood of random keys can only push out
other misses, never the valid keys that real traffic depends on (the old single dict was cleared
whole once 100k misses piled up, sending every valid key back to the database at once). A miss
can stay longer than a hit: a digest nobody had a key for cannot become valid later, because a new
or rotated key is 256 fresh random bits, so its only cost is memory, which `miss_size` bounds.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Generic, TypeVar

V = TypeVar("V")


class _Lru(Generic[V]):
    """digest -> (stored at, value), oldest use first; entries older than `ttl` count as absent."""

    def __init__(self, ttl: float, size: int, clock: Callable[[], float]) -> None:
        self._ttl, self._size, self._clock = ttl, size, clock
        self._entries: OrderedDict[str, tuple[float, V]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, digest: str) -> tuple[bool, V | None]:
        entry = self._entries.get(digest)
        if entry is None:
            return False, None
        if self._clock() - entry[0] >= self._ttl:
            del self._entries[digest]
            return False, None
        self._entries.move_to_end(digest)
        return True, entry[1]

    def put(self, digest: str, value: V) -> None:
        if self._size <= 0:
            return
        self._entries[digest] = (self._clock(), value)
        self._entries.move_to_end(digest)
        while len(self._entries) > self._size:
            self._entries.popitem(last=False)

    def pop(self, digest: str) -> None:
        self._entries.pop(digest, None)


class KeyCache(Generic[V]):
    """What a digest resolved to (a key, or None for no key), for `ttl` or, for None, `miss_ttl` seconds."""

    def __init__(
        self, ttl: float, size: int, miss_ttl: float, miss_size: int, clock: Callable[[], float]
    ) -> None:
        self._found: _Lru[V] = _Lru(ttl, size, clock)
        self._missing: _Lru[None] = _Lru(miss_ttl, miss_size, clock)

    def get(self, digest: str) -> tuple[bool, V | None]:
        """(cached, key): (False, None) when the database must be asked."""
        hit, value = self._found.get(digest)
        if hit:
            return True, value
        return self._missing.get(digest)

    def put(self, digest: str, value: V | None) -> None:
        """Remember what the database said about `digest` (None: no key has it)."""
        if value is None:
            self._found.pop(digest)
            self._missing.put(digest, None)
        else:
            self._missing.pop(digest)
            self._found.put(digest, value)

    def forget(self, digest: str) -> None:
        """Ask the database next time."""
        self._found.pop(digest)
        self._missing.pop(digest)

    def sizes(self) -> tuple[int, int]:
        """(keys cached, misses cached)."""
        return len(self._found), len(self._missing)
