"""The cheapest relay Python can be: a byte pipe on uvloop, for the floor of `stream_relay.py --bare`.

Each client connection gets its own upstream connection, and bytes go through both ways as they
come, from the loop's callbacks (asyncio protocols, no task, no parsing, no HTTP). What it costs
per relayed chunk is what any relay in Python on uvloop pays on a machine (a wake-up, a read and a
write each way), whatever it does besides: the line under which a relay that reads HTTP and SSE
cannot go.

Usage: python bench/bare_relay.py --port P --upstream-port U
"""

from __future__ import annotations

import argparse
import asyncio
from typing import cast

import uvloop


class _Pipe(asyncio.Protocol):
    """One side of a pair: what it receives is written to its peer's transport."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.peer: _Pipe | None = None
        self.pending: list[bytes] = []  # what came before the peer connected

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # (uvloop's is not a subclass)

    def data_received(self, data: bytes) -> None:
        peer = self.peer
        if peer is not None and peer.transport is not None:
            peer.transport.write(data)
        else:
            self.pending.append(data)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.close()


class _Client(_Pipe):
    """A client's connection: opens its upstream connection and pairs the two."""

    def __init__(self, upstream_port: int) -> None:
        super().__init__()
        self.upstream_port = upstream_port

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        asyncio.get_running_loop().create_task(self._connect())

    async def _connect(self) -> None:
        loop = asyncio.get_running_loop()
        _, upstream = await loop.create_connection(_Pipe, "127.0.0.1", self.upstream_port)
        upstream.peer, self.peer = self, upstream
        for data in self.pending:
            assert upstream.transport is not None
            upstream.transport.write(data)
        self.pending.clear()


async def _serve(port: int, upstream_port: int) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: _Client(upstream_port), "127.0.0.1", port)
    async with server:
        await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream-port", type=int, required=True)
    args = parser.parse_args()
    uvloop.run(_serve(args.port, args.upstream_port))


if __name__ == "__main__":
    main()
