"""A lean HTTP/1.1 load generator for the overhead benchmarks: raw asyncio + httptools.

A general client (httpx, aiohttp) spends 100-300 us of CPU per request; on a 2-core machine
that competes with the server under test. Here one request is a prebuilt byte string written to a
keep-alive connection and one httptools parse of the answer, so the client costs little and the
same for every target. Timings per request: time to the whole response and to the first body
bytes (the first streamed chunk).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import cast
from urllib.parse import urlsplit

import httptools


@dataclass
class Timing:
    """One request: seconds to the first body bytes and to the end of the response."""

    first: float
    total: float
    status: int


@dataclass
class Results:
    """All requests of one run."""

    timings: list[Timing] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def errors(self) -> int:
        return sum(1 for t in self.timings if t.status != 200)

    @property
    def rps(self) -> float:
        return len(self.timings) / self.seconds if self.seconds else 0.0


def build_request(url: str, body: bytes, headers: dict[str, str]) -> bytes:
    """The bytes of one POST to `url` (keep-alive)."""
    parts = urlsplit(url)
    lines = [f"POST {parts.path} HTTP/1.1", f"host: {parts.netloc}", "content-type: application/json",
             f"content-length: {len(body)}"]  # fmt: skip
    lines += [f"{k}: {v}" for k, v in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


class _Connection(asyncio.Protocol):
    """One keep-alive connection, one request at a time."""

    def __init__(self) -> None:
        self._parser = httptools.HttpResponseParser(self)
        self._transport: asyncio.Transport | None = None
        self._done: asyncio.Future[Timing] | None = None
        self._start = 0.0
        self._first = 0.0
        self.closed = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def connection_lost(self, exc: Exception | None) -> None:
        if self._done is not None and not self._done.done():
            self._done.set_exception(ConnectionError("the server closed the connection"))
        if not self.closed.done():
            self.closed.set_result(None)

    def data_received(self, data: bytes) -> None:
        self._parser.feed_data(data)

    def on_body(self, body: bytes) -> None:
        if not self._first:
            self._first = time.perf_counter()

    def on_message_complete(self) -> None:
        end = time.perf_counter()
        assert self._done is not None
        first = (self._first or end) - self._start
        self._done.set_result(Timing(first, end - self._start, self._parser.get_status_code()))

    async def request(self, raw: bytes) -> Timing:
        assert self._transport is not None
        self._done = asyncio.get_running_loop().create_future()
        self._first = 0.0
        self._start = time.perf_counter()
        self._transport.write(raw)
        return await self._done

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()


async def run(url: str, raw: bytes, requests: int, concurrency: int, seconds: float = 1e9) -> Results:
    """Up to `requests` requests (or `seconds` s) over `concurrency` keep-alive connections, back to back."""
    parts = urlsplit(url)
    loop = asyncio.get_running_loop()
    conns = []
    for _ in range(concurrency):
        _, conn = await loop.create_connection(_Connection, parts.hostname, parts.port)
        conns.append(conn)
    results = Results()
    remaining = requests

    async def worker(conn: _Connection) -> None:
        nonlocal remaining
        while remaining > 0 and time.perf_counter() < stop_at:
            remaining -= 1
            results.timings.append(await conn.request(raw))

    start = time.perf_counter()
    stop_at = start + seconds
    try:
        await asyncio.gather(*(worker(c) for c in conns))
    finally:
        results.seconds = time.perf_counter() - start
        for conn in conns:
            conn.close()
    return results
