"""SingleFlight: concurrent callers asking for the same thing share one call instead of making one each.

A cold burst of N requests for one key used to make N identical database queries (the key lookup,
then the budget seed): the first answer was not in the cache yet when the others looked. Here the
first caller starts the call and the others await its result (or its exception). The call runs
in its own task and waiters are shielded from it, so one waiter cancelled (its client left) does
not cancel the call the others are waiting for. Nothing is remembered once the call ends: caching
the result is the caller's business.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class SingleFlight(Generic[K, V]):
    """At most one call in flight per key; later callers for that key get the same outcome."""

    def __init__(self) -> None:
        self._flights: dict[K, asyncio.Future[V]] = {}

    def __len__(self) -> int:
        return len(self._flights)

    async def run(self, key: K, call: Callable[[], Awaitable[V]]) -> V:
        """`call()`'s result, from the call already in flight for `key` if there is one."""
        task = self._flights.get(key)
        if task is None:
            task = asyncio.ensure_future(call())
            self._flights[key] = task
            task.add_done_callback(lambda done: self._finished(key, done))
        return await asyncio.shield(task)

    def _finished(self, key: K, task: asyncio.Future[V]) -> None:
        if self._flights.get(key) is task:
            del self._flights[key]
        if not task.cancelled():
            task.exception()  # retrieved: every waiter may have left, this is not an unseen error
