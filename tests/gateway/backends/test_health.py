"""Circuit breakers and replica choice: the state machine, on a controlled clock."""

from __future__ import annotations

import asyncio

import pytest

from gateway.backends.health import BreakerState, CircuitBreaker, HealthChecker, Replica, pick
from gateway.config.policy import Breaker, HealthSettings


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_opens_after_consecutive_failures_and_refuses_traffic() -> None:
    clock = Clock()
    breaker = CircuitBreaker(Breaker(consecutive_failures=3, cooldown=5), clock)
    for _ in range(2):
        breaker.record(False)
    assert breaker.state is BreakerState.CLOSED and breaker.claim()
    breaker.record(False)
    assert breaker.state is BreakerState.OPEN
    assert not breaker.can_pass() and not breaker.claim()


def test_a_success_resets_the_consecutive_count() -> None:
    breaker = CircuitBreaker(Breaker(consecutive_failures=3, min_requests=100), Clock())
    for ok in (False, False, True, False, False):
        breaker.record(ok)
    assert breaker.state is BreakerState.CLOSED


def test_opens_on_error_rate_over_the_window_once_it_holds_enough_requests() -> None:
    clock = Clock()
    breaker = CircuitBreaker(
        Breaker(consecutive_failures=100, error_rate=0.5, window=10, min_requests=6), clock
    )
    for ok in (True, False, True, False, True):
        breaker.record(ok)
        clock.now += 1
    assert breaker.state is BreakerState.CLOSED  # 2/5 failed, and fewer than 6 requests anyway
    breaker.record(False)
    assert breaker.state is BreakerState.OPEN  # 3/6 = 50%


def test_old_outcomes_leave_the_window() -> None:
    clock = Clock()
    breaker = CircuitBreaker(
        Breaker(consecutive_failures=100, error_rate=0.5, window=10, min_requests=4), clock
    )
    for _ in range(3):
        breaker.record(False)
    clock.now = 30
    for _ in range(3):
        breaker.record(True)
    breaker.record(False)
    assert breaker.state is BreakerState.CLOSED  # 1/4 in the window


def test_a_success_amended_to_a_failure_is_counted_once_where_it_was_or_now_if_it_aged_out() -> None:
    """A stream's first token is its verdict; a break after it amends that success. Taking a
    request off the window when the success had aged out of it (streams outlive the window) made
    5 broken of 15 read as 5 of 10 and opened the breaker."""
    clock = Clock()
    breaker = CircuitBreaker(
        Breaker(consecutive_failures=100, error_rate=0.5, window=10, min_requests=4), clock
    )
    early = [breaker.record(True) for _ in range(5)]  # streams begun at 0 s
    clock.now = 1
    breaker.amend(early[0])  # broke at 1 s: its success turned failure, in its own second
    assert (breaker._requests, breaker._failures) == (5, 1)
    clock.now = 30  # the others broke long after: their successes left the window
    for _ in range(3):
        breaker.record(True)
    for at in early[1:3]:
        breaker.amend(at)
    assert (breaker._requests, breaker._failures) == (5, 2)  # 2 of 5 now: closed
    assert breaker.state is BreakerState.CLOSED
    breaker.amend(early[3])
    assert breaker.state is BreakerState.OPEN  # 3 of 6: half of what it served in the window broke


def test_a_stream_that_breaks_after_its_first_token_counts_once_against_its_replica() -> None:
    from gateway.backends.engine import _Verdict

    clock = Clock()
    replica = Replica("http://r", HealthSettings(breaker=Breaker(min_requests=100)), clock)
    verdict = _Verdict(replica)
    verdict(True)  # its first token
    verdict(False)  # it broke
    verdict(False)  # and the relay says so too: once
    assert (replica.breaker._requests, replica.breaker._failures) == (1, 1)
    failed_first = _Verdict(replica)
    failed_first(False)
    failed_first(False)  # a failure is not amended into two
    assert (replica.breaker._requests, replica.breaker._failures) == (2, 2)


def test_half_open_after_cooldown_lets_exactly_one_probe_through() -> None:
    clock = Clock()
    breaker = CircuitBreaker(Breaker(consecutive_failures=1, cooldown=5), clock)
    breaker.record(False)
    clock.now = 4.9
    assert breaker.state is BreakerState.OPEN
    clock.now = 5.0
    assert breaker.state is BreakerState.HALF_OPEN
    assert breaker.claim() and not breaker.claim() and not breaker.can_pass()
    breaker.record(True)
    assert breaker.state is BreakerState.CLOSED and breaker.claim()


def test_a_failed_probe_reopens_for_another_cooldown() -> None:
    clock = Clock()
    breaker = CircuitBreaker(Breaker(consecutive_failures=1, cooldown=5), clock)
    breaker.record(False)
    clock.now = 6
    assert breaker.claim()
    breaker.record(False)
    assert breaker.state is BreakerState.OPEN
    clock.now = 10
    assert breaker.state is BreakerState.OPEN
    clock.now = 11
    assert breaker.state is BreakerState.HALF_OPEN


def test_a_probe_without_verdict_frees_the_slot() -> None:
    clock = Clock()
    breaker = CircuitBreaker(Breaker(consecutive_failures=1, cooldown=1), clock)
    breaker.record(False)
    clock.now = 2
    assert breaker.claim()
    breaker.release()
    assert breaker.claim()


def test_pick_prefers_fewest_in_flight_then_unsaturated_and_skips_unusable() -> None:
    health = HealthSettings(max_queue_depth=4)
    a, b, c = (Replica(u, health) for u in ("http://a", "http://b", "http://c"))
    a.in_flight, b.in_flight, c.in_flight = 3, 1, 2
    assert pick([a, b, c]) is b
    b.check_ok = False
    assert pick([a, b, c]) is c
    c.queue_depth = 10  # saturated: used only when nothing else is free
    assert pick([a, b, c]) is a
    assert pick([a, b, c], avoid=frozenset({"http://a"})) is c
    for r in (a, c):
        for _ in range(3):
            r.breaker.record(False)
    assert pick([a, b, c]) is None


class _FlakyChecker(HealthChecker):
    """Raises an exception no check expects on its first rounds, then counts the rounds that ran."""

    def __init__(
        self, replicas: list[Replica], health: HealthSettings, failures: list[BaseException]
    ) -> None:
        super().__init__("flaky", replicas, health, {})
        self.failures = failures
        self.rounds = 0

    async def check(self, replica: Replica) -> None:
        if self.failures:
            raise self.failures.pop(0)
        self.rounds += 1


def test_the_health_loop_survives_any_exception_in_a_check_round(caplog: pytest.LogCaptureFixture) -> None:
    health = HealthSettings(interval=0.05)  # the least the policy takes
    replica = Replica("http://127.0.0.1:9", health)
    failures: list[BaseException] = [ZeroDivisionError("bug"), KeyError("gauge"), UnicodeDecodeError(
        "utf-8", b"\xff", 0, 1, "bad byte")]  # fmt: skip
    checker = _FlakyChecker([replica], health, failures)

    async def run() -> None:
        checker.start()
        try:
            for _ in range(500):
                if checker.rounds >= 3:
                    break
                await asyncio.sleep(0.01)
            assert checker._task is not None and not checker._task.done()
        finally:
            await checker.stop()

    asyncio.run(run())
    assert checker.rounds >= 3 and not failures
    assert "ZeroDivisionError" in caplog.text and "KeyError" in caplog.text


def test_a_check_that_fails_unexpectedly_marks_only_that_replica_down() -> None:
    health = HealthSettings(interval=0.05)  # the least the policy takes
    replica = Replica("http://127.0.0.1:9", health)
    checker = HealthChecker("odd", [replica], health, {})

    def broken_get(*_: object, **__: object) -> None:
        raise ValueError("an aiohttp internal surprise")

    async def run() -> None:
        checker.start()
        try:
            assert checker._session is not None
            checker._session.get = broken_get  # type: ignore[method-assign,assignment]
            await checker.check(replica)  # does not raise
        finally:
            await checker.stop()

    asyncio.run(run())
    assert replica.check_ok is False and replica.last_error == "ValueError"


def test_only_a_replica_that_answers_no_check_for_the_silence_is_reported_silent() -> None:
    """No answer at all for `silence` s (frozen, partitioned): reported at each check from then on,
    so that its requests in flight are given up on. A 503 (a draining engine finishing its requests)
    is an answer: never silent, however long it lasts."""

    async def serve(status: int) -> asyncio.Server:
        async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.1 %d X\r\ncontent-length: 0\r\nconnection: close\r\n\r\n" % status)
            await writer.drain()
            writer.close()

        return await asyncio.start_server(answer, "127.0.0.1", 0)

    async def run() -> None:
        done = asyncio.Event()

        async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await done.wait()  # reads nothing, answers nothing
            writer.close()

        health = HealthSettings(interval=60, timeout=0.05)  # the loop's own first round, then ours
        frozen = await asyncio.start_server(silent, "127.0.0.1", 0)
        draining = await serve(503)
        servers = [frozen, draining]
        replicas = [Replica(f"http://127.0.0.1:{s.sockets[0].getsockname()[1]}", health) for s in servers]
        reported: list[str] = []
        checker = HealthChecker("p", replicas, health, {}, on_silent=lambda r: reported.append(r.url),
                                silence=0.3)  # fmt: skip
        checker.start()
        try:
            for _ in range(3):
                for replica in replicas:
                    await checker.check(replica)
            assert not reported  # silent for less than 0.3 s so far
            await asyncio.sleep(0.35)
            for replica in replicas:
                await checker.check(replica)
            assert reported == [replicas[0].url] and replicas[1].silent_since is None
            assert not replicas[0].check_ok and not replicas[1].check_ok  # both down all the same
        finally:
            await checker.stop()
            done.set()
            for s in servers:
                s.close()
            await asyncio.sleep(0.01)

    asyncio.run(run())


def test_a_health_check_never_follows_a_redirect() -> None:
    # was: /health answering 302 to another host had the checker call that host, and its 200 marked
    # the replica healthy
    async def run() -> None:
        called: list[bytes] = []

        async def elsewhere(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            called.append(await reader.readuntil(b"\r\n\r\n"))
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
            await writer.drain()
            writer.close()

        target = await asyncio.start_server(elsewhere, "127.0.0.1", 0)
        port = target.sockets[0].getsockname()[1]

        async def redirecting(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.1 302 Found\r\nlocation: http://127.0.0.1:%d/health\r\n"
                         b"content-length: 0\r\nconnection: close\r\n\r\n" % port)  # fmt: skip
            await writer.drain()
            writer.close()

        replica_server = await asyncio.start_server(redirecting, "127.0.0.1", 0)
        health = HealthSettings(interval=60, timeout=1)
        replica = Replica(f"http://127.0.0.1:{replica_server.sockets[0].getsockname()[1]}", health)
        checker = HealthChecker("p", [replica], health, {})
        checker.start()
        try:
            await checker.check(replica)
        finally:
            await checker.stop()
            replica_server.close()
            target.close()
        assert called == [] and replica.check_ok is False
        assert replica.last_error == "/health answered 302"

    asyncio.run(run())
