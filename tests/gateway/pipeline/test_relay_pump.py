"""The relay writing a stream's middle itself through the endpoint's outlet (pipeline/relay.py
`take`), against a raw loopback replica: every event reaches the client once and in order, whether
it went through the writer (from the connection's callbacks) or through the generator (the end, and
events for a client whose socket could not take more); the request ends once, after [DONE]."""

from __future__ import annotations

import asyncio
import time
import uuid
from datetime import UTC, datetime

import orjson

from gateway.backends.base import UpstreamStream
from gateway.backends.replica_lines import ReplicaLines
from gateway.backends.wire import WirePool
from gateway.governance.keys import KeyInfo
from gateway.pipeline.call import Call
from gateway.pipeline.relay import relay
from gateway.pipeline.reply import Outlet
from gateway.pipeline.served import Served
from tests.gateway.backends.test_wire import SSE_HEAD, read_request, serving

WORDS = 30


def _event(i: int) -> bytes:
    choices = [{"index": 0, "delta": {"content": f" w{i}"}}]
    chunk = {"id": "c1", "object": "chat.completion.chunk", "choices": choices}
    return b"data: " + orjson.dumps(chunk)


async def _replica(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await read_request(reader)
    writer.write(SSE_HEAD)
    for part in [_event(i) for i in range(WORDS)] + [b"data: [DONE]"]:
        await asyncio.sleep(0.002)
        writer.write(b"%x\r\n%s\n\n\r\n" % (len(part) + 2, part))
        await writer.drain()
    writer.write(b"0\r\n\r\n")


class _Client:
    """The endpoint's writer: takes a part at once, except every third time it is asked."""

    def __init__(self, out: list[bytes]) -> None:
        self.out = out
        self.asked = 0
        self.in_task: list[bool] = []

    def writable(self) -> bool:
        self.asked += 1
        return self.asked % 3 != 0

    def write_part(self, body: bytes) -> None:
        self.in_task.append(asyncio.current_task() is not None)
        self.out.append(body)


def test_events_reach_the_client_once_and_in_order_through_the_writer_and_the_generator() -> None:
    async def main() -> None:
        key = KeyInfo(uuid.uuid4().hex, "k", "sk-test", None, None, {}, datetime.now(UTC), None, None, None)
        call = Call("req-1", key, time.perf_counter(), datetime.now(UTC), model="m", stream=True)
        ended: list[int] = []
        async with serving(_replica) as (url, _):
            resp = await WirePool(url, {}).post("/v1/x", b"{}", 1.0, 10.0)
            lines = ReplicaLines(resp, "pool (replica)", 0.0, None, lambda ok: None, 30.0)
            stream = UpstreamStream(200, lines, b"", url, pump=lines.pump)
            served = Served("m", "pool", url, [], stream=stream, head=[])
            out: list[bytes] = []
            client = _Client(out)
            outlet = Outlet(client)
            events = relay(call, served, True, lambda c, status, error: ended.append(status), outlet)
            try:
                async for event in events:
                    assert not ended or event == b"data: [DONE]\n\n"  # ended just before [DONE] went
                    out.append(event)
            finally:
                resp.release()
        words = [orjson.loads(e[6:])["choices"][0]["delta"]["content"] for e in out[:-1]]
        assert words == [f" w{i}" for i in range(WORDS)]
        assert out[-1] == b"data: [DONE]\n\n"
        assert ended == [200, 200]  # once for the end, once from the relay's close (a no-op: Finish)
        assert len(client.in_task) > WORDS // 2  # most of the middle went from the callbacks...
        assert not any(client.in_task)  # ...none of it woke the relay's task
        assert call.upstream_seconds > 0 and call.ttft is not None

    asyncio.run(main())


def test_without_an_outlet_writer_every_event_goes_through_the_generator() -> None:
    async def main() -> None:
        key = KeyInfo(uuid.uuid4().hex, "k", "sk-test", None, None, {}, datetime.now(UTC), None, None, None)
        call = Call("req-2", key, time.perf_counter(), datetime.now(UTC), model="m", stream=True)
        async with serving(_replica) as (url, _):
            resp = await WirePool(url, {}).post("/v1/x", b"{}", 1.0, 10.0)
            lines = ReplicaLines(resp, "pool (replica)", 0.0, None, lambda ok: None, 30.0)
            stream = UpstreamStream(200, lines, b"", url, pump=lines.pump)
            served = Served("m", "pool", url, [], stream=stream, head=[])
            try:
                out = [e async for e in relay(call, served, True, lambda *a: None, Outlet())]
            finally:
                resp.release()
        assert len(out) == WORDS + 1 and out[-1] == b"data: [DONE]\n\n"

    asyncio.run(main())
