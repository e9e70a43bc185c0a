"""Budgets in USD per key and per team, per period: reserved before the call, settled after it.

A budget's counter holds, in picodollars, what the period has spent plus what requests in flight
have reserved. A request reserves its worst case (prompt estimate + `max_tokens`, or the model's
output cap, at the most expensive price its route may reach) on every counter it touches, all or
nothing, and refuses when a counter would pass its limit; afterwards the reservation is replaced
by the real cost. Concurrent requests therefore overspend by at most one reservation. Counters
are named after their period's start, so a new period starts a new counter: the reset is
automatic. A counter that does not exist yet (a new period, a restart, a flushed Redis) is seeded
once from the daily aggregates, never from the raw log. With Redis the counters are shared by
every replica and one Lua script reserves atomically.

When budgets cannot be checked, because Redis is unreachable or because the database cannot give
a new counter its seed, a store either refuses (BudgetUnavailableError, naming which of the two
failed) or, with `fail_open`, admits the request without a budget and logs it; a request admitted
that way reserved nothing, so nothing is settled for it.

A Redis command that times out (or loses its connection) may still have run. So each reservation
leaves a marker beside its counter, under the request's token, holding what it holds there; a
settle moves the counter by the difference and removes the marker, and a resent one finds none and
does nothing. A request whose reservation's fate is unknown settles "blind": the marker says
whether the reservation happened, and is left as a tombstone so that a resend does not count twice.
Without them a half-open Redis left refused requests' reservations on their counters for good and
settled timed-out settles twice.
"""

from __future__ import annotations

import logging
import os
import re
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from decimal import Decimal
from functools import partial
from typing import Any, Literal, Protocol

from gateway.errors import NO_RETRY, GatewayError, retry_after_header
from gateway.governance.budget_scripts import ADMIT, MARKER_SECONDS, SEED, SETTLE
from gateway.governance.owed_settles import Owed, OwedSettles
from gateway.governance.periods import Period, period_bounds
from gateway.governance.ratelimit import Limit, refusal
from gateway.governance.redis_pool import DEFAULT_POOL, RedisPoolConfig
from gateway.governance.singleflight import SingleFlight
from gateway.store.models import PICO, to_picousd

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Budget:
    """One budget a request is charged to."""

    scope: Literal["key", "team"]
    subject: str  # the key id or the team name
    limit_usd: Decimal
    period: Period

    def counter(self, now: datetime) -> tuple[str, datetime, datetime | None]:
        """(counter name, period start, reset time) for `now`."""
        start, reset = period_bounds(self.period, now)
        return f"budget:{self.scope}:{self.subject}:{self.period}:{start.date().isoformat()}", start, reset


@dataclass(frozen=True)
class Charge:
    """A reservation on one budget's counter for one request."""

    budget: Budget
    counter: str
    period_start: datetime
    reset: datetime | None
    amount: int  # picodollars reserved
    # the request's own name for its reservations (their markers in Redis); the same for all its charges
    token: str = field(default_factory=lambda: os.urandom(12).hex())
    blind: bool = False  # whether the reservation happened is unknown (Redis failed): the marker says


class BudgetExceededError(GatewayError):
    """A budget cannot take this request's reservation (429 `insufficient_quota`); `reset` is when
    the period ends (None: never), told to the client as Retry-After and X-Budget-Reset."""

    def __init__(self, budget: Budget, reset: datetime | None, reserved: int | None = None) -> None:
        """`reserved`: the picodollars the request would hold (its worst case), where known."""
        whole = f"the {budget.period} budget of ${budget.limit_usd} for {budget.scope} {budget.subject}"
        when = f"; it resets at {reset.isoformat()}" if reset else " (a total budget: it does not reset)"
        usd = None if reserved is None else (Decimal(reserved) / PICO).normalize()
        cost = "" if usd is None else f" (it may cost up to ${usd:f})"
        self.never_fits = reserved is not None and reserved > to_picousd(budget.limit_usd)
        if self.never_fits:  # waiting does not help: a smaller max_tokens does
            message = f"{whole} cannot cover this request even unspent{cost}: lower max_tokens"
        else:
            message = f"{whole} has too little left for this request{cost}{when}"
        super().__init__(429, message, "insufficient_quota", code="budget_exceeded")
        self.budget, self.reset = budget, reset

    def headers(self) -> list[tuple[bytes, bytes]]:
        """Retry-After (seconds from now to the reset) and X-Budget-Reset, when the budget resets
        and the request could fit after it; `x-should-retry: false` (the OpenAI SDKs' own header)
        unless that is within a minute: their automatic retries, seconds apart, cannot help."""
        if self.reset is None or self.never_fits:
            return [NO_RETRY]
        wait = (self.reset - datetime.now(UTC)).total_seconds()
        return [
            (b"retry-after", retry_after_header(wait)),
            (b"x-budget-reset", self.reset.isoformat().encode()),
            *([NO_RETRY] if wait > 60 else []),
        ]


class BudgetUnavailableError(GatewayError):
    """Budgets cannot be checked (Redis or the database unreachable) and they fail closed: 503."""

    def __init__(self, message: str) -> None:
        super().__init__(503, message, "api_error", code="budget_unavailable")


class SpendUnavailableError(Exception):
    """A seed could not read what was spent so far: the database failed, not Redis.

    `kind` is the database error's class name (safe to show a client); the text is for the log.
    """

    def __init__(self, message: str, kind: str = "") -> None:
        super().__init__(message)
        self.kind = kind or type(self).__name__


Seed = Callable[[Budget, datetime], Awaitable[int]]  # raises SpendUnavailableError when it cannot


def unchecked(fail_open: bool, exc: BaseException) -> None:
    """Budgets cannot be checked because of `exc`: log and admit (fail open) or raise BudgetUnavailableError.

    The message names the database for a SpendUnavailableError, Redis for anything else, and the
    error's class only: the driver's text (hosts, ports, database names) goes to the log alone.
    """
    if isinstance(exc, SpendUnavailableError):
        cause = f"the spend so far cannot be read from the database ({exc.kind})"
    else:
        cause = f"Redis is unreachable ({type(exc).__name__})"
    detail = str(exc).splitlines()[0] if str(exc) else ""
    if fail_open:
        logger.warning("budgets not enforced: %s: %s", cause, detail)
        return
    logger.error("budgets cannot be checked, requests refused: %s: %s", cause, detail)
    raise BudgetUnavailableError(f"budgets cannot be checked: {cause}") from exc


class BudgetStore(Protocol):
    """Where the counters live."""

    async def reserve(self, charges: Sequence[Charge], seed: Seed) -> bool:
        """Reserve every charge or none (BudgetExceededError).

        False: the budgets could not be checked and fail open; nothing is reserved or to settle.
        """
        ...

    async def settle(self, charge: Charge, actual: int, final: bool = True) -> None:
        """Replace a reservation by the real cost (picodollars); not `final`: by an upper bound of it,
        settled again later."""
        ...

    async def forget(self, scope: Literal["key", "team"], subject: str) -> None:
        """Drop the subject's counters, of every period: the next admission seeds them again from the
        request log (a budget added back, or given another period: its counter was left as it was
        when the budget went, not charged since). Reservations in flight settle what they owe on
        the new counter."""
        ...

    async def close(self) -> None:
        """Release connections."""
        ...


class LocalBudgetStore:
    """In-process counters: right for one gateway replica."""

    def __init__(self, fail_open: bool = False) -> None:
        self._spent: dict[str, int] = {}
        self.fail_open = fail_open  # the database cannot seed a counter: admit (True) or refuse
        self._seeding: SingleFlight[str, int] = SingleFlight()  # a cold burst: one query per counter
        self._held: dict[str, set[str]] = {}  # counter -> the requests (tokens) whose reservation it holds
        self._orphans: set[tuple[str, str]] = set()  # (counter, token): reservations of a forgotten counter

    async def reserve(self, charges: Sequence[Charge], seed: Seed) -> bool:
        for charge in charges:
            if charge.counter not in self._spent:
                try:
                    value = await self._seeding.run(
                        charge.counter, partial(seed, charge.budget, charge.period_start)
                    )
                except SpendUnavailableError as exc:
                    unchecked(self.fail_open, exc)
                    return False
                self._spent.setdefault(charge.counter, value)
        for charge in charges:  # no await from here on: the check and the spend are atomic
            if self._spent[charge.counter] + charge.amount > to_picousd(charge.budget.limit_usd):
                raise BudgetExceededError(charge.budget, charge.reset, charge.amount)
        for charge in charges:
            self._spent[charge.counter] += charge.amount
            self._held.setdefault(charge.counter, set()).add(charge.token)
        return True

    async def settle(self, charge: Charge, actual: int, final: bool = True) -> None:
        """As in Redis: on a counter that exists. One that does not (the database could not seed it
        while budgets failed open) is seeded later from the request log, which has this request. A
        reservation whose counter was forgotten adds what it owes, once, to the counter seeded since."""
        orphan = (charge.counter, charge.token)
        if orphan in self._orphans:
            if final:
                self._orphans.discard(orphan)
                if charge.counter in self._spent:
                    self._spent[charge.counter] += actual
            return
        if charge.counter in self._spent:
            self._spent[charge.counter] += actual - charge.amount
        if final and (held := self._held.get(charge.counter)) is not None:
            held.discard(charge.token)
            if not held:
                del self._held[charge.counter]

    async def forget(self, scope: Literal["key", "team"], subject: str) -> None:
        prefix = f"budget:{scope}:{subject}:"
        for counter in [c for c in self._spent if c.startswith(prefix)]:
            del self._spent[counter]
            self._orphans.update((counter, token) for token in self._held.pop(counter, ()))

    async def close(self) -> None:
        return None


_SEED = ":seed"  # a counter's seed token: its key's suffix


class RedisBudgetStore:
    """Counters in Redis (INCRBY on integers: exact), shared by every replica.

    Requests wait for a free connection rather than fail when the pool is busy
    (gateway/governance/redis_pool.py); a counter missing for a burst of requests is seeded by one
    database query per replica.
    """

    def __init__(
        self,
        url: str,
        fail_open: bool = False,
        prefix: str = "switchboard:",
        pool: RedisPoolConfig = DEFAULT_POOL,
        logged_seconds: float | None = None,
        log_behind: Callable[[], bool] | None = None,
    ) -> None:
        """`logged_seconds`: how long after its end a request's row is surely in the log;
        `log_behind`: whether the request log cannot write now (owed_settles.py)."""
        import redis.asyncio as aioredis

        self._redis: Any = pool.client(url)
        self._seeding: SingleFlight[str, None] = SingleFlight()
        self._admit = self._redis.register_script(ADMIT)
        self._settle_script = self._redis.register_script(SETTLE)
        self._seed_script = self._redis.register_script(SEED)
        self._prefix = prefix
        self.fail_open = fail_open
        self._errors: tuple[type[BaseException], ...] = (aioredis.RedisError, OSError, TimeoutError)
        self._owed = OwedSettles(
            self._send_settle, self._errors, logged_seconds, log_behind
        )  # not confirmed yet

    async def reserve(self, charges: Sequence[Charge], seed: Seed) -> bool:
        try:
            await self.admit([], "", charges, seed)
        except self._errors as exc:
            self.unreachable(exc, charges)
            return False
        except SpendUnavailableError as exc:
            self.unreachable(exc)
            return False
        return True

    def unreachable(self, exc: BaseException, charges: Sequence[Charge] = ()) -> None:
        """Redis (or, for a SpendUnavailableError, the database) failed: admit (fail open, logged)
        or raise BudgetUnavailableError saying which. `charges`: the reservations whose fate Redis's
        failure left unknown, given back (blind) when the request is refused."""
        try:
            unchecked(self.fail_open, exc)
        except BudgetUnavailableError:
            self.give_back(charges)
            raise

    def give_back(self, charges: Sequence[Charge]) -> None:
        """A refused request's reservations, which Redis may have made although it did not answer,
        are taken back once it does (blind: only those that happened)."""
        for charge in charges:
            key = self._prefix + charge.counter
            self._owed.owe((key, self._marker(charge)), 0, "blind")

    def _marker(self, charge: Charge) -> str:
        return f"{self._prefix}{charge.counter}:held:{charge.token}"

    async def admit(
        self, limits: Sequence[Limit], limit_prefix: str, charges: Sequence[Charge], seed: Seed
    ) -> None:
        """Rate limits (counters under `limit_prefix`) and budgets in one script, all or nothing.

        Raises RateLimitedError or BudgetExceededError; redis errors (`errors`) and the seed's
        SpendUnavailableError propagate to the caller, which applies its fail-open/closed settings.
        Nothing is spent when one of them is raised.
        """
        if self._owed:  # Redis may be back: what earlier settles owe is written first
            await self._owed.write()
        keys = [limit_prefix + limit.name for limit in limits] + [self._prefix + c.counter for c in charges]
        keys += [self._marker(c) for c in charges]
        keys += [self._prefix + c.counter + _SEED for c in charges]
        args: list[float | int] = [len(limits), len(charges)]
        for limit in limits:
            args += [limit.interval, limit.cost]
        for charge in charges:
            args += [to_picousd(charge.budget.limit_usd), charge.amount]
        args.append(MARKER_SECONDS)
        for _ in range(3):
            answer = await self._admit(keys=keys, args=args)
            verdict, *rest = (answer.decode() if isinstance(answer, bytes) else str(answer)).split()
            if verdict == "ok":
                return
            if verdict == "limit":
                raise refusal(float(rest[0]), limits[int(rest[1]) - 1])
            charge = charges[int(rest[0]) - 1]
            if verdict == "over":
                raise BudgetExceededError(charge.budget, charge.reset, charge.amount)
            await self._owed.write(now=True)  # before the log is read: a blind settle then adds to no counter
            await self._seeding.run(charge.counter, partial(self._seed_counter, charge, seed))
        logger.error(
            "budget counters %s could not be seeded in three tries", keys[len(limits) :][: len(charges)]
        )
        raise BudgetUnavailableError("budgets cannot be checked: their counters could not be set up")

    async def _seed_counter(self, charge: Charge, seed: Seed) -> None:
        """What was spent so far, from the database, set on the counter unless another request was first."""
        reading = time.time()
        value = await seed(charge.budget, charge.period_start)
        ttl = "" if charge.reset is None else int((charge.reset - datetime.now(UTC)).total_seconds()) + 86400
        counter = self._prefix + charge.counter
        # first seeder wins; a new seed token tells the settles of requests in flight that this
        # counter does not hold their reservations, and when the log it holds was read (budget_scripts.py)
        token = f"{uuid.uuid4().hex}@{reading:.3f}"
        await self._seed_script(keys=[counter, counter + _SEED], args=[value, token, ttl])

    @property
    def errors(self) -> tuple[type[BaseException], ...]:
        """What an unreachable Redis raises."""
        return self._errors

    async def forget(self, scope: Literal["key", "team"], subject: str) -> None:
        """The counters and their seeds go (not the markers: a reservation in flight finds a new seed
        token on the counter seeded next and settles all it owes there, budget_scripts.py)."""
        head = f"{self._prefix}budget:{scope}:{subject}:"
        pattern = f"{_glob_escaped(head)}*"
        doomed = []
        async for key in self._redis.scan_iter(match=pattern, count=500):
            name = key.decode() if isinstance(key, bytes) else str(key)
            if _COUNTER_TAIL.fullmatch(name[len(head) :]):  # a period's counter or its seed
                doomed.append(key)
        for start in range(0, len(doomed), 500):
            await self._redis.delete(*doomed[start : start + 500])

    async def settle(self, charge: Charge, actual: int, final: bool = True) -> None:
        """The reservation becomes the real cost; one Redis did not confirm is written again until
        it does (owed_settles.py)."""
        mode = "blind" if charge.blind else "final" if final else "part"
        if mode == "part" and actual == charge.amount:
            return
        self._owed.owe((self._prefix + charge.counter, self._marker(charge)), actual, mode)
        await self._owed.write()

    async def _send_settle(self, owed: Owed, target: int, mode: str, logged: float) -> None:
        """One settle; a counter gone meanwhile (expired) is left to be seeded again from the log."""
        keys = [*owed, owed[0] + _SEED]
        await self._settle_script(keys=keys, args=[target, mode, MARKER_SECONDS, f"{logged:.3f}"])

    async def close(self) -> None:
        """What settles still owe is written first (one try): a total budget's counter never
        expires, so a worst case left on it would stay for good."""
        await self._owed.close()
        await self._redis.aclose()


_COUNTER_TAIL = re.compile(r"(?:daily|weekly|monthly|total):\d{4}-\d{2}-\d{2}(?::seed)?")


def _glob_escaped(text: str) -> str:
    """`text` matched literally in a Redis SCAN pattern."""
    return "".join(f"\\{c}" if c in "*?[]\\" else c for c in text)
