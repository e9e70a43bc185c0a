"""Rate limits and budgets for one request: spent before the upstream call, reconciled after it.

`admit` builds the request's counters (key and team RPM/TPM, key and team budgets), spends them
(RateLimitedError, BudgetExceededError or the stores' *UnavailableError when it cannot) and returns
a Ticket. `release` replaces the ticket's reservations by what the request really used and cost,
in the background: the answer never waits for it. The limits and budgets are the key's as this
process last read it (the KeyStore caches a KeyInfo for its TTL): an admin change applies from the
next request after that.

Two classes, chosen once when the app is wired: `Admission` asks its limiter, then its budget
store; `RedisAdmission`, whose limiter and budgets share Redis, spends a request that has both in
one script (one round trip instead of two).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Coroutine
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

from gateway.governance.budgets import (
    Budget,
    BudgetStore,
    Charge,
    LocalBudgetStore,
    RedisBudgetStore,
    Seed,
    SpendUnavailableError,
)
from gateway.governance.keys import KeyInfo
from gateway.governance.periods import counted_period
from gateway.governance.ratelimit import (
    Limit,
    LimiterUnavailableError,
    LocalRateLimiter,
    RateLimiter,
    RedisRateLimiter,
)
from gateway.governance.usage import choices, max_output
from gateway.pipeline.runtime import Runtime
from gateway.routing.router import RouteDecision
from gateway.store.models import to_picousd


@dataclass
class Ticket:
    """What one request reserved."""

    token_limits: list[Limit] = field(default_factory=list)
    reserved_tokens: int = 0
    charges: list[Charge] = field(default_factory=list)


async def _no_spend(budget: Budget, start: datetime) -> int:
    """Seed for an admission without a database: nothing spent yet."""
    return 0


class Admission:
    """Checks and spends a request's rate limits and budgets."""

    def __init__(
        self, limiter: RateLimiter | None = None, budgets: BudgetStore | None = None, seed: Seed | None = None
    ) -> None:
        self.limiter = limiter or LocalRateLimiter()
        self.budgets = budgets or LocalBudgetStore()
        self._seed = seed or _no_spend
        self._background: set[asyncio.Task[None]] = set()

    async def admit(
        self, rt: Runtime, key: KeyInfo, decision: RouteDecision, body: dict[str, Any], body_bytes: int
    ) -> Ticket | None:
        """Spend the request's counters (None: it has none); raises when one refuses."""
        ticket = Ticket()
        limits = self._limits(rt, key, body, body_bytes, ticket)
        charges = self._charges(rt, key, decision, body, body_bytes)
        if not limits and not charges:
            return None
        if limits and charges:
            await self._spend_both(limits, charges, ticket)
            return ticket
        if limits:
            await self.limiter.acquire(limits)
        if charges:
            await self._reserve(charges, ticket)
        return ticket

    async def _spend_both(self, limits: list[Limit], charges: list[Charge], ticket: Ticket) -> None:
        """A request with rate limits and budgets: the limits first, then the budgets."""
        await self.limiter.acquire(limits)
        await self._reserve(charges, ticket)

    async def _reserve(self, charges: list[Charge], ticket: Ticket) -> None:
        try:
            reserved = await self.budgets.reserve(charges, self._seed)
        except BaseException:
            self._reconcile(ticket, 0)  # refused: give the tokens back (the request still counts)
            raise
        ticket.charges = charges if reserved else _unreserved(charges)

    def release(self, ticket: Ticket, usage: dict[str, Any], cost: Decimal | None) -> None:
        """After the request: tokens and money reconciled with what it really used (background)."""
        self._reconcile(ticket, _total(usage))
        actual = to_picousd(cost) if cost is not None else 0
        for charge in ticket.charges:
            self._spawn(self.budgets.settle(charge, actual))
        ticket.charges = []

    def narrow(self, ticket: Ticket, bound: dict[str, Any], cost: Decimal | None) -> None:
        """While a finished request's usage is being counted: keep reserved at most an upper bound
        of it (`bound`, costing `cost`), so that the client's next request does not meet the whole
        reservation of one that is over; release() settles the exact figures afterwards."""
        used = _total(bound)
        if used < ticket.reserved_tokens:
            for limit in ticket.token_limits:
                self._spawn(self.limiter.adjust(limit, used - ticket.reserved_tokens))
            ticket.reserved_tokens = used
        held = to_picousd(cost) if cost is not None else None
        if held is None:
            return
        narrowed = []
        for charge in ticket.charges:
            if held < charge.amount:
                self._spawn(self.budgets.settle(charge, held, final=False))
                charge = replace(charge, amount=held)
            narrowed.append(charge)
        ticket.charges = narrowed

    def _reconcile(self, ticket: Ticket, used: int) -> None:
        delta = used - ticket.reserved_tokens
        for limit in ticket.token_limits:
            self._spawn(self.limiter.adjust(limit, delta))
        ticket.token_limits = []

    @staticmethod
    def _limits(
        rt: Runtime, key: KeyInfo, body: dict[str, Any], body_bytes: int, ticket: Ticket
    ) -> list[Limit]:
        """The key's and its team's per-minute counters (tokens reserved: body bytes / 4 + n x max_tokens)."""
        team = rt.policy.teams.get(key.team) if key.team else None
        rpm = [(f"key:{key.id}", key.rpm_limit, "for this key"),
               (f"team:{key.team}", team.rpm if team else None, f"for team {key.team}")]  # fmt: skip
        tpm = [(f"key:{key.id}", key.tpm_limit, "for this key"),
               (f"team:{key.team}", team.tpm if team else None, f"for team {key.team}")]  # fmt: skip
        limits = [Limit(f"{n}:rpm", v, 1, f"requests per minute {w}") for n, v, w in rpm if v]
        if any(v for _, v, _ in tpm):
            ticket.reserved_tokens = body_bytes // 4 + (max_output(body) or 0) * choices(body)
            ticket.token_limits = [
                Limit(f"{n}:tpm", v, ticket.reserved_tokens, f"tokens per minute {w}", "tokens")
                for n, v, w in tpm
                if v
            ]
            limits += ticket.token_limits
        return limits

    @staticmethod
    def _charges(
        rt: Runtime, key: KeyInfo, decision: RouteDecision, body: dict[str, Any], body_bytes: int
    ) -> list[Charge]:
        """Budget reservations for the key and its team: the worst case over the route's chain."""
        budgets = []
        if key.budget_usd is not None:
            budgets.append(Budget("key", key.id, key.budget_usd, counted_period(key.budget_period)))
        team = rt.policy.teams.get(key.team) if key.team else None
        if team is not None and team.budget is not None and key.team is not None:
            budgets.append(Budget("team", key.team, Decimal(str(team.budget.usd)), team.budget.period))
        if not budgets:
            return []
        amount = to_picousd(
            rt.prices.worst_case(decision.chain, body, body_bytes, rt.router.capabilities.context_length)
        )
        now = datetime.now(UTC)
        token = os.urandom(12).hex()  # names this request's reservations (their markers in Redis)
        charges = []
        for budget in budgets:
            counter, start, reset = budget.counter(now)
            charges.append(Charge(budget, counter, start, reset, amount, token))
        return charges

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def close(self) -> None:
        """Let pending reconciliations finish, then close the stores."""
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
        await self.limiter.close()
        await self.budgets.close()


class RedisAdmission(Admission):
    """Admission whose limiter and budgets share Redis: limits and budgets spent in one script."""

    def __init__(
        self, limiter: RedisRateLimiter, budgets: RedisBudgetStore, seed: Seed | None = None
    ) -> None:
        super().__init__(limiter, budgets, seed)
        self._redis_limiter = limiter  # the same objects, with the types the script needs
        self._redis_budgets = budgets

    async def _spend_both(self, limits: list[Limit], charges: list[Charge], ticket: Ticket) -> None:
        """One round trip to Redis instead of two; admitted without the budgets when they fail open."""
        limiter, budgets = self._redis_limiter, self._redis_budgets
        try:
            await budgets.admit(limits, limiter.prefix, charges, self._seed)
        except SpendUnavailableError as exc:  # the database, not Redis: the limits can still be checked
            budgets.unreachable(exc)  # budgets fail closed (raises) or open
            await limiter.acquire(limits)
            ticket.charges = _unreserved(charges)
            return
        except budgets.errors as exc:
            budgets.unreachable(exc, charges)  # budgets fail closed (raises) or open; then the limits decide
            if not limiter.fail_open:  # the cause is in the server's log, not the client's answer
                budgets.give_back(charges)  # Redis may have reserved them before it stopped answering
                raise LimiterUnavailableError("rate limits cannot be checked: Redis is unreachable") from exc
            ticket.charges = _unreserved(charges)
            return
        ticket.charges = charges


def _unreserved(charges: list[Charge]) -> list[Charge]:
    """The charges of a request admitted while budgets fail open: nothing is held on the counters
    as far as the gateway knows, but what it costs is still owed to them, settled blind once Redis
    answers again (from what Redis did reserve, if it ran the admission without answering, else
    from 0); a counter gone by then is seeded from the request log, which has the request."""
    return [replace(charge, amount=0, blind=True) for charge in charges]


def _total(usage: dict[str, Any]) -> int:
    """A usage's total tokens (its parts summed where the total is missing)."""
    used = usage.get("total_tokens")
    if isinstance(used, int):
        return used
    parts = (usage.get("prompt_tokens"), usage.get("completion_tokens"))
    return sum(p for p in parts if isinstance(p, int))
