"""Replica health: circuit breakers, active checks, and picking the least-loaded healthy replica.

Two sources of truth meet here. Active checks (`GET /health`, then queue depth and KV-cache usage
from `GET /metrics`) run on an interval per replica and mark it up or down; a replica that comes up
(or has not answered yet) is also asked `GET /v1/models` for its model cards (model_cards.py).
Real traffic feeds the replica's circuit breaker: connection errors, 5xx answers, timeouts and
first tokens slower than the SLO count as failures. A replica takes traffic when its last check
passed and its breaker lets it; among those, the one with the fewest requests in flight wins (then
the shorter queue).
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections import deque
from collections.abc import Callable, Iterable
from enum import Enum

import aiohttp

from gateway.backends.base import Learned
from gateway.backends.model_cards import MAX_CARDS_BYTES, parse_model_cards
from gateway.config.policy import Breaker, HealthSettings

logger = logging.getLogger(__name__)

_GAUGE = re.compile(
    rb"^(engine:num_requests_waiting|engine:kv_cache_usage_perc)\{?[^ ]*\s+([0-9.eE+-]+)", re.M
)


class BreakerState(Enum):
    """Closed: traffic flows. Open: none until the cooldown ends. Half-open: one probe decides."""

    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class CircuitBreaker:
    """Opens on `consecutive_failures` in a row, or an error rate over `window` s; probes after `cooldown`."""

    def __init__(self, settings: Breaker, clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        self._clock = clock
        self._state = BreakerState.CLOSED
        self._consecutive = 0
        self._opened_at = 0.0
        self._probing = False
        # outcomes within the window, bucketed by whole second: [second, requests, failures]
        self._buckets: deque[list[int]] = deque()
        self._requests = 0
        self._failures = 0

    @property
    def state(self) -> BreakerState:
        """The state now (an open breaker turns half-open once its cooldown has passed)."""
        if self._state is BreakerState.OPEN and self._clock() - self._opened_at >= self.settings.cooldown:
            self._state = BreakerState.HALF_OPEN
            self._probing = False
        return self._state

    def can_pass(self) -> bool:
        """Whether a request may go through now (without claiming the half-open probe)."""
        state = self.state
        return state is BreakerState.CLOSED or (state is BreakerState.HALF_OPEN and not self._probing)

    def claim(self) -> bool:
        """Let one request through: always when closed; once (the probe) when half-open."""
        state = self.state
        if state is BreakerState.CLOSED:
            return True
        if state is BreakerState.HALF_OPEN and not self._probing:
            self._probing = True
            return True
        return False

    def release(self) -> None:
        """A claimed request ended without a verdict (e.g. the client left): free the probe slot."""
        self._probing = False

    def record(self, ok: bool) -> float:
        """One outcome of real traffic (or of a probe); returns when it was recorded (`amend` takes
        it). O(1): counts are kept per second of the window."""
        now = self._clock()
        state = self.state
        if state is BreakerState.HALF_OPEN:
            self._probing = False
            if ok:
                self._close()
            else:
                self._open(now)
            return now
        self._count(now, ok)
        if ok:
            self._consecutive = 0
            return now
        self._consecutive += 1
        if state is BreakerState.CLOSED:  # only a failure can trip a closed breaker
            self._trip_if_due(now)
        return now

    def amend(self, at: float) -> None:
        """The success recorded at `at` turned failure: a stream whose first token was its verdict
        broke mid-answer (a replica whose every stream broke after its first token was never left).
        Counted where it was, if its second is still in the window (and holds a success to turn);
        else (the stream outlived the window, or a probe's close cleared it) as a failure now. The
        run of failures grows by one."""
        now = self._clock()
        if self.state is not BreakerState.CLOSED:
            return
        second = int(at)
        bucket = next((b for b in self._buckets if b[0] == second), None)
        if bucket is not None and bucket[1] > bucket[2] and second > int(now) - self.settings.window:
            bucket[2] += 1
            self._failures += 1
        else:
            self._count(now, False)
        self._consecutive += 1
        self._trip_if_due(now)

    def _trip_if_due(self, now: float) -> None:
        rate_tripped = (
            self._requests >= self.settings.min_requests
            and self._failures / self._requests >= self.settings.error_rate
        )
        if self._consecutive >= self.settings.consecutive_failures or rate_tripped:
            self._open(now)

    def _count(self, now: float, ok: bool) -> None:
        second = int(now)
        horizon = second - self.settings.window
        while self._buckets and self._buckets[0][0] <= horizon:
            _, requests, failures = self._buckets.popleft()
            self._requests -= requests
            self._failures -= failures
        if not self._buckets or self._buckets[-1][0] != second:
            self._buckets.append([second, 0, 0])
        bucket = self._buckets[-1]
        bucket[1] += 1
        self._requests += 1
        if not ok:
            bucket[2] += 1
            self._failures += 1

    def _open(self, now: float) -> None:
        self._state, self._opened_at, self._probing = BreakerState.OPEN, now, False

    def _close(self) -> None:
        self._state, self._consecutive = BreakerState.CLOSED, 0
        self._buckets.clear()
        self._requests = self._failures = 0


class Replica:
    """One engine server: its last check, its breaker, and its requests in flight."""

    def __init__(self, url: str, health: HealthSettings, clock: Callable[[], float] = time.monotonic) -> None:
        self.url = url
        self.health = health
        self.breaker = CircuitBreaker(health.breaker, clock)
        self.check_ok = True  # optimistic until the first check says otherwise
        self.last_error: str | None = None
        self.queue_depth = 0.0
        self.kv_usage = 0.0
        self.in_flight = 0
        self.cards: dict[str, Learned] | None = None  # its /v1/models, once it answered
        # monotonic time of the first of the checks in a row it did not answer at all (frozen,
        # partitioned); an answer, even a 503 (a draining engine finishing its requests), resets it
        self.silent_since: float | None = None

    def usable(self) -> bool:
        """Up by the last check and let through by the breaker."""
        return self.check_ok and self.breaker.can_pass()

    def saturated(self) -> bool:
        """Over the policy's queue-depth or KV-usage limit (used only while others are free)."""
        h = self.health
        return (h.max_queue_depth is not None and self.queue_depth > h.max_queue_depth) or (
            h.max_kv_usage is not None and self.kv_usage > h.max_kv_usage
        )

    def describe(self) -> dict[str, object]:
        """For /admin views and logs."""
        return {
            "url": self.url, "check_ok": self.check_ok, "breaker": self.breaker.state.value,
            "in_flight": self.in_flight, "queue_depth": self.queue_depth, "kv_usage": self.kv_usage,
            "last_error": self.last_error,
        }  # fmt: skip


def pick(replicas: Iterable[Replica], avoid: frozenset[str] = frozenset()) -> Replica | None:
    """The usable replica with the fewest requests in flight (unsaturated first, then shorter queue)."""
    best: Replica | None = None
    best_key: tuple[bool, int, float] | None = None
    for replica in replicas:
        if replica.url in avoid or not replica.usable():
            continue
        key = (replica.saturated(), replica.in_flight, replica.queue_depth)
        if best_key is None or key < best_key:
            best, best_key = replica, key
    return best


class HealthChecker:
    """Checks every replica of one pool each `interval` s until stopped."""

    def __init__(
        self, name: str, replicas: list[Replica], health: HealthSettings, headers: dict[str, str],
        on_cards: Callable[[], None] = lambda: None,
        on_silent: Callable[[Replica], None] = lambda replica: None, silence: float | None = None,
    ) -> None:  # fmt: skip
        self.name = name
        self.replicas = replicas
        self.health = health
        self._headers = headers
        self._on_cards = on_cards  # a replica's model cards changed
        # a replica that answered no check for `silence` s: its requests in flight are given up on
        self._on_silent = on_silent
        self._silence = silence
        self._task: asyncio.Task[None] | None = None
        self._session: aiohttp.ClientSession | None = None

    def start(self) -> None:
        """Begin checking in the background."""
        timeout = aiohttp.ClientTimeout(total=self.health.timeout)
        self._session = aiohttp.ClientSession(timeout=timeout, headers=self._headers)
        self._task = asyncio.create_task(self._loop(), name=f"health-{self.name}")

    async def _loop(self) -> None:
        # Nothing but cancellation (stop) may end this loop: a dead loop leaves every replica in its
        # last state forever, the ones that died included. An unexpected error costs one round.
        while True:
            try:
                outcomes = await asyncio.gather(
                    *(self.check(r) for r in self.replicas), return_exceptions=True
                )
                for replica, outcome in zip(self.replicas, outcomes, strict=True):
                    if isinstance(outcome, Exception):
                        logger.error("%s replica %s: the health check failed unexpectedly", self.name,
                                     replica.url, exc_info=outcome)  # fmt: skip
                    elif isinstance(outcome, BaseException):
                        raise outcome  # cancellation, KeyboardInterrupt: not ours to swallow
            except Exception:
                logger.exception("%s: a health check round failed; the next one runs as usual", self.name)
            await asyncio.sleep(self.health.interval)

    async def check(self, replica: Replica) -> None:
        """One check: /health must answer 200 (itself: a redirect is not followed, to any host it names);
        /metrics (if served) gives queue depth and KV usage."""
        assert self._session is not None
        answered = False  # /health gave an answer, whatever it was
        try:
            async with self._session.get(replica.url + "/health", allow_redirects=False) as resp:
                answered = True
                ok = resp.status == 200
                error = None if ok else f"/health answered {resp.status}"
            if ok:
                async with self._session.get(replica.url + "/metrics", allow_redirects=False) as resp:
                    if resp.status == 200:
                        self._read_gauges(replica, await resp.read())
        except (aiohttp.ClientError, TimeoutError) as exc:
            ok, error = False, f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        except Exception as exc:  # anything else talking to it: the replica is not known to be well
            ok, error = False, type(exc).__name__
            if error != replica.last_error:  # the traceback once, not every interval
                logger.warning("%s replica %s: unexpected error in its health check", self.name,
                               replica.url, exc_info=exc)  # fmt: skip
        if ok != replica.check_ok:
            level = logging.INFO if ok else logging.WARNING
            logger.log(level, "%s replica %s is %s%s", self.name, replica.url, "up" if ok else "down",
                       f" ({error})" if error else "")  # fmt: skip
        came_up = ok and not replica.check_ok
        replica.check_ok, replica.last_error = ok, error
        if answered:
            replica.silent_since = None
        else:
            now = time.monotonic()
            if replica.silent_since is None:
                replica.silent_since = now
            elif self._silence is not None and now - replica.silent_since >= self._silence:
                self._on_silent(replica)  # each check while it stays silent: nothing new goes to it
        if ok and (came_up or replica.cards is None):  # a restarted engine may serve another model
            await self._learn(replica)
        if ok and replica.breaker.state is BreakerState.HALF_OPEN and replica.breaker.claim():
            replica.breaker.record(True)  # a passing check is the half-open probe

    async def _learn(self, replica: Replica) -> None:
        """The replica's model cards; an engine without them (or failing to give them) is asked again
        at its next check, and is no less healthy for it."""
        assert self._session is not None
        try:
            async with self._session.get(replica.url + "/v1/models", allow_redirects=False) as resp:
                raw = await resp.content.read(MAX_CARDS_BYTES + 1) if resp.status == 200 else b""
        except (aiohttp.ClientError, TimeoutError) as exc:
            logger.debug("%s replica %s: no model cards (%s)", self.name, replica.url, exc)
            return
        cards = parse_model_cards(raw) if 0 < len(raw) <= MAX_CARDS_BYTES else None
        if cards is not None and cards != replica.cards:
            replica.cards = cards
            self._on_cards()

    @staticmethod
    def _read_gauges(replica: Replica, text: bytes) -> None:
        waiting, usage = 0.0, 0.0
        for name, raw in _GAUGE.findall(text):
            try:
                value = float(raw)
            except ValueError:  # e.g. "1e" or "..": the pattern admits what float() does not
                continue
            if name == b"engine:num_requests_waiting":
                waiting += value
            else:
                usage = max(usage, value)
        replica.queue_depth, replica.kv_usage = waiting, usage

    async def stop(self) -> None:
        """Stop checking and close the session."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        if self._session is not None:
            await self._session.close()
            self._session = None
