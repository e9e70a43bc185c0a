"""Requests and tokens per minute, per key and per team: GCRA, in-process or shared through Redis.

GCRA (the generic cell rate algorithm) keeps one number per counter, the theoretical arrival time
(TAT). A limit of L per minute spends 60/L s of TAT per unit; a request costing c units is admitted
when `max(TAT, now) + c * 60/L - now <= 60`, i.e. a full minute's worth may arrive at once, then
one unit every 60/L s. Several counters (key RPM, key TPM, team RPM, team TPM) are checked and
updated together, all or nothing. With Redis one Lua script does that atomically on Redis's own
clock, so N gateway replicas share one limit instead of multiplying it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from gateway.errors import NO_RETRY, GatewayError, retry_after_header
from gateway.governance.redis_pool import DEFAULT_POOL, RedisPoolConfig

logger = logging.getLogger(__name__)

WINDOW = 60.0  # seconds: limits are per minute
# seconds a counter may be over its window and still admit: float rounding of `tat + cost * interval
# - now - WINDOW` leaves a counter exactly at its limit a few ulps over (an rpm_limit of 1 refused
# its first request at some clock readings), which must not cost the last request a minute allows
SLACK = 1e-6


@dataclass(frozen=True)
class Limit:
    """One counter: `name` (e.g. `key:abc:rpm`), its per-minute limit, and what this request costs."""

    name: str
    per_minute: int
    cost: int
    label: str  # for the error message, e.g. "requests per minute for this key"
    unit: str = "requests"  # what it counts: "requests" or "tokens" (OpenAI's error type for a 429)

    @property
    def interval(self) -> float:
        return WINDOW / self.per_minute


class RateLimitedError(GatewayError):
    """A limit is reached: 429, typed by what the limit counts (`unit`: "requests" or "tokens"),
    with `retry_after` seconds until the request would be admitted."""

    def __init__(
        self,
        message: str,
        retry_after: float,
        unit: str = "requests",
        per_minute: int | None = None,
        never_fits: bool = False,
    ) -> None:
        super().__init__(429, message, unit, code="rate_limit_exceeded")
        self.retry_after, self.unit, self.per_minute = retry_after, unit, per_minute
        self.never_fits = never_fits  # the request alone is over the limit: waiting cannot help

    def headers(self) -> list[tuple[bytes, bytes]]:
        """`Retry-After`, and OpenAI's `x-ratelimit-*` trio for the limit reached (the SDKs and
        LiteLLM's clients read them)."""
        # a request bigger than the limit never fits: no Retry-After (the SDKs waited 60 s a retry)
        out = [NO_RETRY] if self.never_fits else [(b"retry-after", retry_after_header(self.retry_after))]
        if self.per_minute is not None and self.unit in ("requests", "tokens"):
            unit = self.unit.encode()
            out += [
                (b"x-ratelimit-limit-" + unit, b"%d" % self.per_minute),
                (b"x-ratelimit-remaining-" + unit, b"0"),
                (b"x-ratelimit-reset-" + unit, duration(self.retry_after).encode()),
            ]
        return out


def duration(seconds: float) -> str:
    """A wait as OpenAI's x-ratelimit-reset-* headers write one: "20ms", "6s", "1m1.5s", "1h29m15s"
    (it was "%.3gs": 5,355 seconds read "5.35e+03s")."""
    millis = max(round(seconds * 1000), 0)
    if millis < 1000:
        return f"{millis}ms"
    hours, rest = divmod(millis, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    secs = f"{rest / 1000:.3f}".rstrip("0").rstrip(".")
    return (f"{hours}h" if hours else "") + (f"{minutes}m" if hours or minutes else "") + f"{secs}s"


class LimiterUnavailableError(GatewayError):
    """The shared store (Redis) cannot be reached and the limiter is configured to fail closed.

    Its text is what the client reads, so it is always the same generic sentence; `detail` (the
    Redis error) is for the server's log only: it may name hosts, ports or internal addresses.
    """

    PUBLIC = "rate limits cannot be checked: Redis is unreachable"

    def __init__(self, detail: str = "") -> None:
        super().__init__(503, self.PUBLIC, "api_error", code="rate_limiter_unavailable")
        self.detail = detail


class RateLimiter(Protocol):
    """Checks and spends counters."""

    async def acquire(self, limits: Sequence[Limit]) -> None:
        """Spend every limit's cost, or none of them and raise RateLimitedError."""
        ...

    async def adjust(self, limit: Limit, delta: int) -> None:
        """Correct a counter after the fact (e.g. actual tokens minus the reservation; may be < 0)."""
        ...

    async def close(self) -> None:
        """Release connections."""
        ...


def refusal(wait: float, culprit: Limit) -> RateLimitedError:
    """The error for a refused limit: how long to wait, or that the request can never fit."""
    if culprit.cost > culprit.per_minute:
        return RateLimitedError(
            f"this request needs {culprit.cost} units but the limit is {culprit.per_minute} {culprit.label}",
            WINDOW,
            culprit.unit,
            culprit.per_minute,
            never_fits=True,
        )
    message = f"rate limit reached: {culprit.per_minute} {culprit.label}"
    return RateLimitedError(message, wait, culprit.unit, culprit.per_minute)


class LocalRateLimiter:
    """In-process counters: one gateway replica (several replicas need Redis)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._tat: dict[str, float] = {}

    async def acquire(self, limits: Sequence[Limit]) -> None:
        now = self._clock()
        updates = []
        worst: tuple[float, Limit] | None = None
        for limit in limits:
            new = max(self._tat.get(limit.name, now), now) + limit.cost * limit.interval
            over = new - now - WINDOW
            if over > SLACK and (worst is None or over > worst[0]):
                worst = (over, limit)
            updates.append((limit.name, new))
        if worst is not None:
            raise refusal(worst[0], worst[1])
        self._tat.update(updates)
        if len(self._tat) > 100_000:  # drop counters that are idle (their TAT is in the past)
            self._tat = {k: v for k, v in self._tat.items() if v > now}

    async def adjust(self, limit: Limit, delta: int) -> None:
        now = self._clock()
        self._tat[limit.name] = max(self._tat.get(limit.name, now), now) + delta * limit.interval

    async def close(self) -> None:
        return None


# KEYS: counters. ARGV: interval_1, cost_1, interval_2, cost_2, ... Returns "0" or the wait in seconds
# followed by the index of the limit that refused ("12.5 2").
_ACQUIRE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local window = 60
local new = {}
local wait, culprit = 0, 0
for i, key in ipairs(KEYS) do
  local interval = tonumber(ARGV[2 * i - 1])
  local cost = tonumber(ARGV[2 * i])
  local tat = tonumber(redis.call('GET', key) or '0')
  if tat < now then tat = now end
  new[i] = tat + cost * interval
  local over = new[i] - now - window
  if over > $SLACK and over > wait then wait, culprit = over, i end
end
if culprit > 0 then return string.format('%.6f %d', wait, culprit) end
for i, key in ipairs(KEYS) do
  redis.call('SET', key, string.format('%.6f', new[i]), 'PX', math.ceil((new[i] - now) * 1000) + 1000)
end
return '0'
""".replace("$SLACK", repr(SLACK))

# KEYS[1]: counter. ARGV: interval, delta.
_ADJUST = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local tat = tonumber(redis.call('GET', KEYS[1]) or '0')
if tat < now then tat = now end
local new = tat + tonumber(ARGV[2]) * tonumber(ARGV[1])
if new > now then
  redis.call('SET', KEYS[1], string.format('%.6f', new), 'PX', math.ceil((new - now) * 1000) + 1000)
else
  redis.call('DEL', KEYS[1])
end
return 1
"""


class RedisRateLimiter:
    """Counters in Redis, updated by Lua scripts: every replica shares them.

    When Redis cannot be reached: `fail_open` admits the request (and logs), otherwise
    LimiterUnavailableError (the gateway answers 503). A busy pool is not "unreachable": callers
    wait for a connection (gateway/governance/redis_pool.py), so limits stay exact under any burst.
    """

    def __init__(
        self,
        url: str,
        fail_open: bool = True,
        prefix: str = "switchboard:rl:",
        pool: RedisPoolConfig = DEFAULT_POOL,
    ) -> None:
        import redis.asyncio as aioredis

        self._redis: Any = pool.client(url)
        self._acquire = self._redis.register_script(_ACQUIRE)
        self._adjust = self._redis.register_script(_ADJUST)
        self.fail_open = fail_open
        self.prefix = prefix
        self._errors: tuple[type[BaseException], ...] = (aioredis.RedisError, OSError, TimeoutError)

    async def acquire(self, limits: Sequence[Limit]) -> None:
        if not limits:
            return
        args: list[float | int] = []
        for limit in limits:
            args += [limit.interval, limit.cost]
        try:
            answer = await self._acquire(keys=[self.prefix + limit.name for limit in limits], args=args)
        except self._errors as exc:
            self._unreachable(exc)
            return
        text = answer.decode() if isinstance(answer, bytes) else str(answer)
        if text != "0":
            wait, index = text.split()
            raise refusal(float(wait), limits[int(index) - 1])

    async def adjust(self, limit: Limit, delta: int) -> None:
        if delta == 0:
            return
        try:
            await self._adjust(keys=[self.prefix + limit.name], args=[limit.interval, delta])
        except self._errors as exc:
            logger.warning("rate limit: could not adjust %s by %d: %s", limit.name, delta, exc)

    def _unreachable(self, exc: BaseException) -> None:
        detail = f"{type(exc).__name__}: {exc}"
        if self.fail_open:
            logger.warning("rate limits not enforced: Redis is unreachable (%s)", detail)
            return
        logger.error("rate limits cannot be checked, requests refused: Redis is unreachable (%s)", detail)
        raise LimiterUnavailableError(detail) from exc

    async def close(self) -> None:
        await self._redis.aclose()
