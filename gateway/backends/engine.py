"""The engine pool: Switchboard engine replicas called directly over lean keep-alive connections.

Not litellm and not a general HTTP client: the pool speaks HTTP/1.1 itself over an asyncio protocol
with httptools' parser (gateway/backends/wire.py, where the measured reason is). Each call goes to
the healthy replica with the fewest requests in flight (gateway/backends/health.py) and reports
its outcome to that replica's circuit breaker.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from types import TracebackType
from urllib.parse import urlsplit

from gateway.backends.base import (
    MAX_REPLY_BYTES,
    Learned,
    UpstreamReply,
    UpstreamStream,
    UpstreamUnavailableError,
    answer_object,
)
from gateway.backends.health import HealthChecker, Replica, pick
from gateway.backends.model_cards import merge_replicas
from gateway.backends.prefix_homes import PrefixHomes
from gateway.backends.replica_lines import ReplicaLines
from gateway.backends.upstream_errors import retry_after_seconds
from gateway.backends.wire import WirePool, WireResponse
from gateway.backends.wire_connection import WireError
from gateway.config.policy import EngineBackend, HealthSettings, Timeouts

logger = logging.getLogger(__name__)


class EnginePool:
    """The replicas of one engine backend, with keep-alive connections and health tracking."""

    def __init__(self, name: str, spec: EngineBackend, health: HealthSettings) -> None:
        self.name = name
        self.spec = spec
        self.health = health
        self.replicas = [Replica(u.rstrip("/"), health) for u in spec.urls]
        urls = [r.url for r in self.replicas]
        # prefix_affinity: each prefix's home replica, and the calls sent to it or spilled elsewhere
        self.homes = PrefixHomes(urls) if spec.balance == "prefix_affinity" else None
        self.affinity_counts: dict[str, int] | None = {"hit": 0, "spill": 0} if self.homes else None
        key = os.environ.get(spec.api_key_env) if spec.api_key_env else None
        auth = {"authorization": f"Bearer {key}"} if key else {}
        # masked in what a replica's error may echo: the key, and each replica's address (host:port
        # first, then its host alone): replica URLs stay in the gateway's log
        self._key = (key,) if key else ()
        # (a single-label host, `engine`, is left: masked, it took that word out of every message)
        places = [
            place
            for p in map(urlsplit, urls)
            for place in (p.netloc, p.hostname or "")
            if "." in place or ":" in place
        ]
        self._hidden = tuple(dict.fromkeys(h for h in (key or "", *places) if h))
        headers = {"content-type": "application/json", **auth}
        self._wires = {r.url: WirePool(r.url, headers, limit=1000, idle_seconds=60.0) for r in self.replicas}
        # a whole answer sends nothing until it is done: a replica that has answered none of its health
        # checks for as long as a stream may be silent (timeouts.between_tokens) will not send it
        self._checker = HealthChecker(name, self.replicas, health, auth, self._cards_changed,
                                      self._silent, spec.timeouts.between_tokens)  # fmt: skip
        self._learned: dict[str, Learned] = {}  # served name -> what the replicas' cards say
        self._learned_version = 0

    async def start(self) -> None:
        """Start the active health checks."""
        self._checker.start()

    def adopt_homes(self, previous: EnginePool) -> None:
        """Keep the prefixes' homes of the pool this one replaces (its replicas changed)."""
        if self.homes is not None and previous.homes is not None:
            self.homes.adopt(previous.homes)

    @property
    def timeouts(self) -> Timeouts:
        """The backend's own timeouts."""
        return self.spec.timeouts

    @property
    def learned_version(self) -> int:
        """Bumped whenever the replicas' model cards say something new."""
        return self._learned_version

    def learned(self, model: str) -> Learned | None:
        """What the replicas' /v1/models say about `model` (None: no replica described it)."""
        return self._learned.get(model)

    def _silent(self, replica: Replica) -> None:
        """The replica answered no health check for `between_tokens` s: what it has in flight fails as
        a timeout (tried on another replica, then the next model) instead of waiting for `total`."""
        since = time.monotonic() - (replica.silent_since or time.monotonic())
        error = TimeoutError(f"the replica answered no health check for {since:.0f} s")
        failed = self._wires[replica.url].fail_lent(error)
        if failed:
            logger.warning("%s replica %s: silent for %.0f s, %d request(s) in flight to it given up on",
                           self.name, replica.url, since, failed)  # fmt: skip

    def _cards_changed(self) -> None:
        merged = merge_replicas(r.cards for r in self.replicas if r.cards is not None)
        if merged != self._learned:
            self._learned = merged
            self._learned_version += 1
            logger.info("engine pool %s: model cards %s", self.name, merged)

    @property
    def unavailable_reason(self) -> str | None:
        """None while a replica is usable; otherwise what is wrong with each."""
        if any(r.usable() for r in self.replicas):
            return None
        states = "; ".join(
            f"{r.url}: {r.last_error or 'failing'}" if not r.check_ok else f"{r.url}: circuit open"
            for r in self.replicas
        )
        return f"no healthy replica in engine pool {self.name} ({states})"

    def _claim(self, avoid: frozenset[str], affinity: int | None = None) -> Replica:
        """A replica for one call (claims the half-open probe if that is what it gets): the one the
        request's prefix key maps to when the pool balances by prefix, else the least loaded."""
        tried: set[str] = set(avoid)
        while (replica := self._pick(frozenset(tried), affinity)) is not None:
            if replica.breaker.claim():
                return replica
            tried.add(replica.url)
        reason = self.unavailable_reason or f"every replica of {self.name} already failed this request"
        raise UpstreamUnavailableError(reason, timeout=False)

    def _pick(self, tried: frozenset[str], affinity: int | None) -> Replica | None:
        if self.homes is None or affinity is None:
            return pick(self.replicas, tried)
        factor, slack = self.spec.max_load_factor, self.spec.load_slack
        replica, home = self.homes.choose(affinity, self.replicas, tried, factor, slack)
        assert self.affinity_counts is not None
        self.affinity_counts["hit" if home else "spill"] += 1
        return replica if replica is not None else pick(self.replicas, tried)

    async def send(
        self,
        path: str,
        body: bytes,
        timeouts: Timeouts | None = None,
        avoid: frozenset[str] = frozenset(),
        headers: Mapping[str, str] | None = None,
        affinity: int | None = None,
    ) -> UpstreamReply:
        """POST and read the whole response (`headers`: the trace context, when tracing is on;
        `affinity`: the request's prefix key)."""
        replica = self._claim(avoid, affinity)
        replica.in_flight += 1
        verdict: bool | None = None
        t = timeouts or self.spec.timeouts
        try:
            async with self._translated(replica):
                resp = await self._wires[replica.url].post(path, body, t.connect, t.total, headers)
                try:
                    body = await resp.read(MAX_REPLY_BYTES)
                    if resp.status != 200:
                        body = self._masked(body)
                    reply = UpstreamReply(
                        resp.status, body, replica.url, _retry_after(resp), hidden=self._hidden
                    )
                finally:
                    resp.release()
            if reply.status == 200:  # parsed here, once: an answer of the wrong shape is the replica's fault
                reply.answer = answer_object(reply.body)
                verdict = reply.answer is not None
            else:
                verdict = reply.status < 500
            return reply
        except UpstreamUnavailableError:
            verdict = False
            raise
        finally:
            replica.in_flight -= 1
            _settle(replica, verdict)

    @asynccontextmanager
    async def stream(
        self,
        path: str,
        body: bytes,
        timeouts: Timeouts | None = None,
        avoid: frozenset[str] = frozenset(),
        headers: Mapping[str, str] | None = None,
        affinity: int | None = None,
    ) -> AsyncIterator[UpstreamStream]:
        """POST with a streamed response; leaving the block early closes the upstream connection."""
        replica = self._claim(avoid, affinity)
        replica.in_flight += 1
        verdict = _Verdict(replica)
        started = time.perf_counter()
        t = timeouts or self.spec.timeouts
        try:
            async with self._translated(replica), asyncio.timeout(t.first_token):  # the response must start
                resp = await self._wires[replica.url].post(path, body, t.connect, t.total, headers)
        except BaseException as exc:
            replica.in_flight -= 1
            if isinstance(exc, UpstreamUnavailableError):
                verdict(False)
            else:
                verdict.settle()  # cancelled (the client left): no verdict on the replica
            raise
        try:
            error = b""
            if resp.status != 200:  # its body is due as soon as a first token would be
                async with self._translated(replica), asyncio.timeout(t.first_token):
                    error = self._masked(await resp.read(MAX_REPLY_BYTES))
                verdict(resp.status < 500)
            slo, name = self.health.first_token_slo, f"{self.name} ({replica.url})"
            lines = ReplicaLines(resp, name, started, slo, verdict, t.between_tokens)
            yield UpstreamStream(resp.status, lines, error, replica.url, verdict, _retry_after(resp),
                                 pump=lines.pump, hidden=self._hidden, answered=lines.answered)  # fmt: skip
        finally:
            replica.in_flight -= 1
            verdict.settle()
            resp.release()  # read to the end: back to the pool; abandoned: closed, so the engine aborts

    def _masked(self, error: bytes) -> bytes:
        """A replica's error answer without the pool's key: an engine that echoes the Authorization
        header it refused must not hand the key to the client (a stream's error events are reduced
        with the key among their `hidden`: upstream_errors.reduced_fields)."""
        for secret in self._key:  # (the hosts too are masked in the error's fields: `hidden`)
            error = error.replace(secret.encode(), b"[hidden]")
        return error

    def _translated(self, replica: Replica) -> _Translated:
        """Connection failures and timeouts become UpstreamUnavailableError (502/504)."""
        return _Translated(self.name, replica.url)

    async def close(self) -> None:
        """Stop the checks and close the pooled connections."""
        await self._checker.stop()
        for wire in self._wires.values():
            wire.close()


class _Translated:
    """EnginePool._translated's context manager: a class, not a generator (one is entered on every
    request's way to the replica, and a generator-based one costs several times as much)."""

    __slots__ = ("_name", "_url")

    def __init__(self, name: str, url: str) -> None:
        self._name, self._url = name, url

    async def __aenter__(self) -> None:
        return None

    async def __aexit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:  # fmt: skip
        if isinstance(exc, TimeoutError):
            message = f"{self._name} ({self._url}) timed out"
            raise UpstreamUnavailableError(message, timeout=True, deployment=self._url) from exc
        if isinstance(exc, (WireError, OSError)):
            message = f"{self._name} ({self._url}) is unreachable: {exc or type(exc).__name__}"
            raise UpstreamUnavailableError(message, timeout=False, deployment=self._url) from exc


def _settle(replica: Replica, verdict: bool | None) -> None:
    """Record an outcome, or free a half-open probe slot when there is none (the caller left)."""
    if verdict is None:
        replica.breaker.release()
    else:
        replica.breaker.record(verdict)


class _Verdict:
    """One stream's outcome for its replica's breaker: the first verdict counts (its first token's:
    a half-open probe is decided then); a break after a success amends it, once."""

    def __init__(self, replica: Replica) -> None:
        self._replica = replica
        self._given = False
        self._ok_at: float | None = None  # when its success was recorded (None: no success to amend)

    def __call__(self, ok: bool) -> None:
        if not self._given:
            self._given = True
            at = self._replica.breaker.record(ok)
            self._ok_at = at if ok else None
        elif self._ok_at is not None and not ok:
            at, self._ok_at = self._ok_at, None
            self._replica.breaker.amend(at)

    def settle(self) -> None:
        """At the end: no verdict given (the client left first) frees the probe slot."""
        if not self._given:
            self._given = True
            self._replica.breaker.release()


def _retry_after(resp: WireResponse) -> int | None:
    """An error answer's Retry-After in seconds (an overloaded replica's 503), sanitized."""
    if resp.retry_after is None or resp.status == 200:
        return None
    return retry_after_seconds(resp.retry_after.decode("latin-1"))
