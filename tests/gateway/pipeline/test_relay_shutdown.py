"""A stream cut off by the gateway's shutdown (api/completions.py cancels it with errors.SHUTDOWN) is
logged as 503 `gateway_shutdown` wherever the relay waits: on its upstream, on the client, or on
another replica that is taking over a broken stream (resume.py)."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from datetime import UTC, datetime

import orjson

from gateway.backends.base import UpstreamStream, UpstreamStreamError
from gateway.config.policy import EngineBackend, Timeouts
from gateway.errors import SHUTDOWN
from gateway.governance.keys import KeyInfo
from gateway.pipeline.call import Call
from gateway.pipeline.relay import relay
from gateway.pipeline.resume import ResumePlan
from gateway.pipeline.served import Served


def _call() -> Call:
    key = KeyInfo(uuid.uuid4().hex, "k", "sk-test", None, None, {}, datetime.now(UTC), None, None, None)
    return Call("req-1", key, time.perf_counter(), datetime.now(UTC), model="m", stream=True)


class _SlowPool:
    """An engine pool whose other replica takes for ever to reopen a stream."""

    name = "pool"

    def __init__(self) -> None:
        self.asked = asyncio.Event()

    @asynccontextmanager
    async def stream(self, path: str, body: bytes, timeouts: Timeouts | None = None,
                     avoid: frozenset[str] = frozenset(), headers: Mapping[str, str] | None = None,
                     affinity: int | None = None) -> AsyncIterator[UpstreamStream]:  # fmt: skip
        self.asked.set()
        await asyncio.sleep(3600)
        raise AssertionError("unreachable")
        yield  # pragma: no cover


async def _breaking() -> AsyncIterator[str]:
    """A replica's stream: one token (with its ids), then the connection breaks."""
    chunk = {"id": "c1", "created": 7, "choices": [{"index": 0, "delta": {"content": "hi"}}]}
    yield ": token_ids 0 3"
    yield "data: " + orjson.dumps(chunk).decode()
    raise UpstreamStreamError("pool (http://a): the upstream closed the connection")


def test_a_shutdown_while_another_replica_takes_over_is_logged_as_the_shutdown() -> None:
    async def main() -> list[tuple[int, str | None]]:
        pool = _SlowPool()
        spec = EngineBackend(type="engine", urls=["http://a", "http://b"], max_resumptions=2)
        plan = ResumePlan(pool, spec, "m", "/v1/chat/completions", {"model": "m", "stream": True},  # type: ignore[arg-type]
                          Timeouts(total=60.0))  # fmt: skip
        stream = UpstreamStream(200, _breaking(), b"", "http://a")
        served = Served("m", "pool", "http://a", [], stream=stream, resume=plan)
        ended: list[tuple[int, str | None]] = []
        events = relay(_call(), served, True, lambda c, status, error: ended.append((status, error)))

        async def read() -> None:
            async for _ in events:
                pass

        reader = asyncio.ensure_future(read())
        await pool.asked.wait()  # the stream broke; another replica is being asked
        reader.cancel(msg=SHUTDOWN)
        await asyncio.gather(reader, return_exceptions=True)
        return ended

    ended = asyncio.run(main())
    assert ended and ended[0] == (503, "gateway_shutdown")
