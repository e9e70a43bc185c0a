"""Prefix affinity: requests that share their leading messages go to the same engine replica.

An engine keeps a prompt's KV blocks in its prefix cache; least-loaded balancing scatters the
requests that share a system prompt over every replica, and each recomputes it. Here a request's
affinity key hashes its leading part (every message but the last: the system prompt and earlier
turns; a lone message or a text prompt: its first characters, cut at a block boundary), and a
consistent-hash ring with bounded load (Mirrokni et al.) maps the key to a replica: the first one
clockwise that is usable, not avoided, not saturated and under `load_factor` × the mean load. A
replica that joins or leaves moves only the keys of its own arcs.
"""

from __future__ import annotations

import bisect
import hashlib
import math
from collections.abc import Sequence
from typing import Any

import orjson

from gateway.backends.health import Replica

POINTS_PER_REPLICA = 128  # virtual nodes: each replica's share of the ring evens out
PREFIX_BLOCK_CHARS = 64  # ~16 tokens, one KV block: a lone prompt's key covers whole blocks
MAX_PREFIX_CHARS = 1 << 16  # what a key reads at most (characters of a prompt, bytes of messages)


def _hash(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


def prefix_key(body: dict[str, Any]) -> int | None:
    """The request's affinity key, or None when it has nothing to share (an empty prompt)."""
    messages = body.get("messages")
    if isinstance(messages, list) and messages:
        if len(messages) > 1:  # prompts that share their first 64 KiB share that much cache anyway
            return _hash(orjson.dumps(messages[:-1], option=orjson.OPT_SORT_KEYS)[:MAX_PREFIX_CHARS])
        content = messages[0].get("content") if isinstance(messages[0], dict) else None
        text = content if isinstance(content, str) else orjson.dumps(content).decode()
        return _text_key(text)
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return _text_key(prompt)
    if isinstance(prompt, list) and prompt:
        first = prompt[0]
        if isinstance(first, str):  # a batch of text prompts: the first one's
            return _text_key(first)
        ids = prompt if isinstance(first, int) else first  # token ids: whole blocks of 16, at most 4,096
        if not isinstance(ids, list):
            return None
        length = min(len(ids), 4096) // 16 * 16
        return _hash(orjson.dumps(ids[:length])) if length else None
    return None


def _text_key(text: str) -> int | None:
    """A lone prompt's leading whole blocks (a prompt shorter than one block shares nothing)."""
    length = min(len(text), MAX_PREFIX_CHARS) // PREFIX_BLOCK_CHARS * PREFIX_BLOCK_CHARS
    return _hash(text[:length].encode()) if length else None


class AffinityRing:
    """The replicas' points on a 64-bit ring; `choose` walks it from a key."""

    def __init__(self, urls: Sequence[str]) -> None:
        points = sorted(
            (_hash(f"{url}#{i}".encode()), url) for url in urls for i in range(POINTS_PER_REPLICA)
        )
        self._hashes = [h for h, _ in points]
        self._urls = [u for _, u in points]

    def order(self, key: int) -> list[str]:
        """Every replica once, in ring order from `key` (the first is the key's home)."""
        start = bisect.bisect_left(self._hashes, key)
        seen: dict[str, None] = {}
        n = len(self._urls)
        for i in range(n):
            seen.setdefault(self._urls[(start + i) % n], None)
            if len(seen) * POINTS_PER_REPLICA >= n:
                break
        return list(seen)

    def choose(
        self, key: int, replicas: Sequence[Replica], avoid: frozenset[str], load_factor: float
    ) -> tuple[Replica | None, bool]:
        """(the replica for `key`, whether it is the key's home); None: none within bounds."""
        by_url = {r.url: r for r in replicas}
        usable = [r for r in replicas if r.usable()]
        if not usable:
            return None, False
        cap = math.ceil(load_factor * (sum(r.in_flight for r in usable) + 1) / len(usable))
        for i, url in enumerate(self.order(key)):
            replica = by_url.get(url)
            if replica is None or url in avoid or not replica.usable() or replica.saturated():
                continue
            if replica.in_flight + 1 <= cap:
                return replica, i == 0
        return None, False
