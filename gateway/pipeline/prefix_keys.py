"""Prefix-affinity keys counted in the pool's own tokens.

`gateway.backends.affinity` keys a lone prompt by its first characters; a pool whose policy names
its model's tokenizer gets keys from the first LONE_PREFIX_TOKENS tokens instead, which is what the
engine's prefix cache shares. Tokenizing is blocking work, so it runs in a worker thread and its
result is remembered: the requests that share a prefix, the ones affinity is for, pay for it once.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from typing import Any

from gateway.backends.affinity import (
    LONE_PREFIX_TOKENS,
    WINDOW_CHARS,
    char_key,
    hash_bytes,
    ids_key,
    lone_text,
    prefix_key,
)
from gateway.governance.tokens import hf_tokenizer

logger = logging.getLogger(__name__)


def token_key(text: str, tokenizer: str) -> int | None:
    """A lone prompt's key counted with `tokenizer` (a tokenizer.json or its folder): the ids of its
    first LONE_PREFIX_TOKENS tokens in whole blocks. Blocking: tokenizing costs ~0.25 ms a KiB."""
    ids = hf_tokenizer(tokenizer).encode(text[:WINDOW_CHARS], add_special_tokens=False).ids
    return ids_key(ids[:LONE_PREFIX_TOKENS])


class PrefixKeys:
    """Affinity keys counted with each pool's tokenizer, tokenized off the event loop, remembered.

    A lone prompt is tokenized (at most WINDOW_CHARS of it) in a worker thread; the key is kept
    in a least-recently-used map by its window, so the requests that share a prefix, the ones
    affinity is for, are tokenized once. A tokenizer that cannot be read falls back to characters.
    """

    def __init__(self, size: int = 4096) -> None:
        self._size = size
        self._known: OrderedDict[tuple[str, int], int | None] = OrderedDict()

    async def key(self, body: dict[str, Any], tokenizer: str | None) -> int | None:
        """`body`'s affinity key for a pool whose model's tokenizer is `tokenizer` (None: unknown)."""
        text = lone_text(body) if tokenizer is not None else None
        if text is None or tokenizer is None:
            return prefix_key(body)
        window = text[:WINDOW_CHARS]
        memo = (tokenizer, hash_bytes(window.encode()))
        if memo in self._known:
            self._known.move_to_end(memo)
            return self._known[memo]
        try:
            key = await asyncio.to_thread(token_key, window, tokenizer)
        except Exception:  # unreadable since the policy was checked: characters will do
            logger.warning("tokenizer %s is unreadable; affinity uses characters", tokenizer, exc_info=True)
            return char_key(text)
        self._known[memo] = key
        if len(self._known) > self._size:
            self._known.popitem(last=False)
        return key
