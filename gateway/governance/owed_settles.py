"""Settles Redis did not confirm (it was away, or its answer was lost), kept and written again
until it does: by the replica's next settle or admission, and a second after each failure by
themselves, since other replicas meet the reservations this one holds back (a replica with no
requests wrote them only at shutdown). Each settle's marker makes writing it twice harmless
(budget_scripts.py); dropping one left a whole worst case on its budget until the counter expired
(never, for a total budget).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

logger = logging.getLogger(__name__)

RETRY_SECONDS = 1.0
# how long after a request's end its row is surely in the log, by default (the store is given its
# writer's batch interval, twice, plus a second): a counter seeded later has the cost of a request
# admitted blind (budget_scripts.py). While the writer cannot write (an outage, a spool to replay),
# no time is: the settle adds the cost, whenever the counter was seeded.
LOGGED_SECONDS = 1.0
NEVER = 1e18  # (a time no seed is after: finite, for Redis's Lua to read)

Owed = tuple[str, str]  # (counter, marker)
Settle = Callable[[Owed, int, str, float], Awaitable[None]]  # sends one settle (raises `errors`)


class OwedSettles:
    """What settles still owe, by (counter, marker): (target, mode, logged by)."""

    def __init__(
        self,
        send: Settle,
        errors: tuple[type[BaseException], ...],
        logged_seconds: float | None = None,
        log_behind: Callable[[], bool] | None = None,
    ) -> None:
        self._send = send
        self._errors = errors
        self._logged_seconds = LOGGED_SECONDS if logged_seconds is None else logged_seconds
        self._log_behind = log_behind
        self.pending: dict[Owed, tuple[int, str, float]] = {}
        self._writing = False
        self._retry_at = 0.0  # monotonic time before which they are not tried again
        self._timer: asyncio.TimerHandle | None = None
        self._retrying: set[asyncio.Task[None]] = set()
        self._closed = False

    def __bool__(self) -> bool:
        return bool(self.pending)

    def owe(self, owed: Owed, target: int, mode: str) -> None:
        """A settle to write (a later one replaces an earlier; a bound never undoes a final)."""
        if mode != "part" or self.pending.get(owed, (0, "part", 0.0))[1] == "part":
            behind = self._log_behind is not None and self._log_behind()
            self.pending[owed] = (target, mode, NEVER if behind else time.time() + self._logged_seconds)

    async def write(self, now: bool = False) -> None:
        """Write what is owed, one writer at a time (`now`: even within the pause after a failure)."""
        if now:
            self._retry_at = 0.0
        if not self.pending or self._writing or time.monotonic() < self._retry_at:
            return
        self._writing = True
        try:
            while self.pending:
                owed, entry = next(iter(self.pending.items()))
                try:
                    await self._send(owed, *entry)
                except self._errors as exc:
                    # an admission meanwhile does not wait on Redis twice; the timer tries again
                    self._retry_at = time.monotonic() + RETRY_SECONDS
                    self._retry_later()
                    logger.error(
                        "budget %s: a settle to %d picodollars not confirmed yet: %s", owed[0], entry[0], exc
                    )
                    return
                if self.pending.get(owed) == entry:  # not replaced by a later settle meanwhile
                    del self.pending[owed]
        finally:
            self._writing = False

    def _retry_later(self) -> None:
        if self._timer is None and not self._closed:
            self._timer = asyncio.get_running_loop().call_later(RETRY_SECONDS, self._retry)

    def _retry(self) -> None:
        self._timer = None
        if self.pending and not self._closed:
            task = asyncio.get_running_loop().create_task(self._retried())
            self._retrying.add(task)
            task.add_done_callback(self._retrying.discard)

    async def _retried(self) -> None:
        try:
            await self.write(now=True)  # (the timer may fire a hair before the pause ends)
        except Exception:  # the next failure or request tries again
            logger.exception("budgets: writing the settles owed failed")

    async def close(self) -> None:
        """At shutdown: one last try, whatever the pause; what is left is logged."""
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
        if self._retrying:
            await asyncio.gather(*self._retrying, return_exceptions=True)
        if not self.pending:
            return
        try:
            await self.write(now=True)
        except Exception:  # the shutdown goes on; what is owed is in the log
            logger.exception("budgets: settles owed at shutdown could not be written")
        if self.pending:
            logger.error("budgets: %d settles not written, their counters keep what they held: %s",
                         len(self.pending), self.pending)  # fmt: skip
