"""Prefix affinity: requests that share their leading messages go to the same engine replica.

An engine keeps a prompt's KV blocks in its prefix cache; least-loaded balancing scatters the
requests that share a system prompt over every replica, and each recomputes it. Here a request's
affinity key hashes its leading part: every message but the last (the system prompt and earlier
turns), or for a lone message or text prompt its first LONE_PREFIX_TOKENS tokens in whole blocks
of BLOCK_TOKENS, counted with the pool's tokenizer when the policy names one
(`gateway.pipeline.prefix_keys`) and
else estimated as 4 characters a token. A consistent-hash ring orders the replicas for a key:
its first is the key's ring home, and a replica that joins or leaves moves only the keys of its
own arcs. Where each prefix lives, within bounds on prefixes and on requests per replica, is
`gateway.backends.prefix_homes`'s decision.
"""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Sequence
from typing import Any

import orjson

POINTS_PER_REPLICA = 128  # virtual nodes: each replica's share of the ring evens out
BLOCK_TOKENS = 16  # the engine's KV block: a key covers whole blocks, as its prefix cache does
LONE_PREFIX_TOKENS = 256  # a lone prompt's key: its first 16 blocks (shared instructions, a document)
PREFIX_BLOCK_CHARS = 4 * BLOCK_TOKENS  # without a tokenizer, 64 characters stand for a block
WINDOW_CHARS = 8 * LONE_PREFIX_TOKENS  # what is tokenized at most: 8 characters a token is generous
MAX_PREFIX_CHARS = 1 << 16  # what a key reads at most of earlier messages (bytes)
MAX_PREFIX_IDS = 4096  # and of a token-id prompt


def hash_bytes(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


def prefix_key(body: dict[str, Any]) -> int | None:
    """The request's affinity key with characters for tokens, or None when it shares nothing."""
    text = lone_text(body)
    if text is not None:
        return char_key(text)
    messages = body.get("messages")
    if isinstance(messages, list) and len(messages) > 1:
        # prompts that share their first 64 KiB share that much cache anyway
        return hash_bytes(orjson.dumps(messages[:-1], option=orjson.OPT_SORT_KEYS)[:MAX_PREFIX_CHARS])
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt:
        ids = prompt if isinstance(prompt[0], int) else prompt[0]  # a batch: the first prompt's
        if isinstance(ids, list) and all(isinstance(i, int) for i in ids[:MAX_PREFIX_IDS]):
            return ids_key(ids[:MAX_PREFIX_IDS])
    return None


def lone_text(body: dict[str, Any]) -> str | None:
    """The text of a lone message or a text prompt (the first of a batch), None for anything else."""
    messages = body.get("messages")
    if isinstance(messages, list):
        if len(messages) != 1:
            return None
        content = messages[0].get("content") if isinstance(messages[0], dict) else None
        return content if isinstance(content, str) else orjson.dumps(content).decode()
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        prompt = prompt[0]
    return prompt if isinstance(prompt, str) else None


def char_key(text: str) -> int | None:
    """The first LONE_PREFIX_TOKENS' worth of characters, whole blocks (none: shorter than a block)."""
    length = min(len(text), LONE_PREFIX_TOKENS * PREFIX_BLOCK_CHARS // BLOCK_TOKENS)
    length = length // PREFIX_BLOCK_CHARS * PREFIX_BLOCK_CHARS
    return hash_bytes(text[:length].encode()) if length else None


def ids_key(ids: list[int]) -> int | None:
    """Token ids in whole blocks (none: shorter than a block)."""
    length = len(ids) // BLOCK_TOKENS * BLOCK_TOKENS
    return hash_bytes(orjson.dumps(ids[:length])) if length else None  # orjson: any i64 or u64 a body holds


class AffinityRing:
    """The replicas' points on a 64-bit ring; `choose` walks it from a key."""

    def __init__(self, urls: Sequence[str]) -> None:
        points = sorted(
            (hash_bytes(f"{url}#{i}".encode()), url) for url in urls for i in range(POINTS_PER_REPLICA)
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
