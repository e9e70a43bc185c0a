"""FailedAuthLimiter: at most N failed authentications per minute from one client address.

A wrong, revoked or expired key counts as one failure of its sender's address. Past `per_minute`
failures in a minute (GCRA, as gateway/governance/ratelimit.py: a full minute's worth at once, then one every
60/N s), every request from that address is refused with 429 before its key is even looked at, a
valid key included: answering a valid key normally would tell someone testing a list of leaked
keys which ones work. Counters live in this process (one replica's view; N replicas allow N times
as many) and at most `max_addresses` are tracked, least recently failed dropped first.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable

logger = logging.getLogger(__name__)

WINDOW = 60.0


class FailedAuthLimiter:
    """Counts failures per address; `blocked` says how long an address must wait (None: it may try)."""

    def __init__(self, per_minute: int, max_addresses: int, clock: Callable[[], float]) -> None:
        self.per_minute = per_minute  # 0: no limit
        self._max_addresses = max_addresses
        self._clock = clock
        self._tat: OrderedDict[str, float] = OrderedDict()  # address -> theoretical arrival time

    def blocked(self, address: str | None) -> float | None:
        """Seconds until `address` may try again, or None if it may now."""
        if address is None or self.per_minute <= 0:
            return None
        tat = self._tat.get(address)
        if tat is None:
            return None
        wait = tat + WINDOW / self.per_minute - self._clock() - WINDOW
        return wait if wait > 0 else None

    def failed(self, address: str | None) -> None:
        """One failed authentication from `address`; logs when it starts being refused."""
        if address is None or self.per_minute <= 0:
            return
        now = self._clock()
        self._tat[address] = max(self._tat.get(address, now), now) + WINDOW / self.per_minute
        self._tat.move_to_end(address)
        while len(self._tat) > self._max_addresses:
            self._tat.popitem(last=False)
        wait = self.blocked(address)
        if wait is not None:
            logger.warning(
                "client %s: %d failed authentications within a minute; its requests are refused for %.0f s",
                address, self.per_minute, wait,
            )  # fmt: skip
