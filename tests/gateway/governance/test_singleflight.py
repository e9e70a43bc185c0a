"""SingleFlight: one call per key in flight, shared by every caller, whatever happens to one of them."""

from __future__ import annotations

import asyncio

from gateway.governance.singleflight import SingleFlight


def test_a_waiter_that_leaves_does_not_cancel_the_call_the_others_wait_for() -> None:
    calls = 0

    async def slow() -> str:
        nonlocal calls
        calls += 1
        await asyncio.sleep(0.05)
        return "answer"

    async def run() -> list[str]:
        flights: SingleFlight[str, str] = SingleFlight()
        leaver = asyncio.ensure_future(flights.run("k", slow))
        stayers = [asyncio.ensure_future(flights.run("k", slow)) for _ in range(3)]
        await asyncio.sleep(0.01)
        leaver.cancel()  # its client disconnected
        answers = await asyncio.gather(*stayers)
        assert len(flights) == 0  # nothing kept once the call ended
        return list(answers)

    assert asyncio.run(run()) == ["answer"] * 3 and calls == 1


def test_a_failure_reaches_every_waiter_and_the_next_caller_tries_again() -> None:
    attempts = 0

    async def flaky() -> int:
        nonlocal attempts
        attempts += 1
        await asyncio.sleep(0.01)
        if attempts == 1:
            raise ConnectionError("database away")
        return attempts

    async def run() -> None:
        flights: SingleFlight[str, int] = SingleFlight()
        outcomes = await asyncio.gather(*(flights.run("k", flaky) for _ in range(5)), return_exceptions=True)
        assert all(isinstance(o, ConnectionError) for o in outcomes)
        assert await flights.run("k", flaky) == 2

    asyncio.run(run())
    assert attempts == 2  # one shared failed call, then one new call
