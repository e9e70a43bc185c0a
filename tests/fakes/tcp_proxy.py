"""TcpProxy: a loopback TCP proxy in its own thread, to take a shared server (PostgreSQL) away from
one client without stopping it for everybody else.

`cut()` resets every open connection and resets each new one at once (a client sees its
connection lost, then refused: a server that went down); `cut(hang=True)` accepts new ones and
never answers (a host gone from the network: only a timeout tells); `silence()` does that to the
open connections too, without a reset (a partition: pooled connections go quiet); `deafen()` passes
requests on and drops every reply (half-open: the server acts, the client never hears);
`restore()` forwards again, as a server that came back. The listening port never changes.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator


class TcpProxy:
    """Forwards 127.0.0.1:`port` to `target_host`:`target_port` until closed."""

    def __init__(self, target_host: str, target_port: int) -> None:
        self._target = (target_host, target_port)
        self._cut = False
        self._hang = False
        self._silent = False  # open connections forward nothing, in either direction
        self._deaf = False  # requests reach the server, its replies are dropped
        self._writers: set[asyncio.StreamWriter] = set()
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.Server | None = None
        started = threading.Event()
        self._thread = threading.Thread(target=self._serve, args=(started,), name="tcp-proxy", daemon=True)
        self._thread.start()
        started.wait(10)
        assert self._server is not None, "the proxy did not start"
        self.port: int = self._server.sockets[0].getsockname()[1]

    def _serve(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(asyncio.start_server(self._accept, "127.0.0.1", 0))
        started.set()
        self._loop.run_forever()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._cut:
            if self._hang:  # held open, never answered, until restore() or close()
                self._writers.add(writer)
                return
            writer.transport.abort()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(*self._target)
        except OSError:
            writer.transport.abort()
            return
        self._writers |= {writer, up_writer}
        try:
            await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer, reply=True))
        finally:
            self._writers -= {writer, up_writer}

    async def _pipe(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, reply: bool = False
    ) -> None:
        try:
            while data := await reader.read(65536):
                if reply and self._deaf:
                    continue
                while self._silent:  # held, never delivered: restore() resets these connections
                    await asyncio.sleep(0.05)
                writer.write(data)
                await writer.drain()
        except (OSError, RuntimeError):
            pass
        finally:
            writer.transport.abort()  # either side gone: the other side sees a reset, as on a crash

    def _run(self, action: str, hang: bool = False) -> None:
        async def act() -> None:
            self._cut, self._hang = action in ("cut", "silence"), hang
            self._silent, self._deaf = action == "silence", action == "deafen"
            if self._silent or self._deaf:  # the open connections stay open
                return
            for writer in list(self._writers):  # restore: the held connections go too
                writer.transport.abort()
            self._writers.clear()

        asyncio.run_coroutine_threadsafe(act(), self._loop).result(10)

    def cut(self, hang: bool = False) -> None:
        """Reset every connection now, and each new one (or, `hang`, hold it unanswered) until `restore()`."""
        self._run("cut", hang)

    def silence(self) -> None:
        """Forward nothing more on open connections, hold new ones unanswered; no reset until `restore()`."""
        self._run("silence", hang=True)

    def deafen(self) -> None:
        """Pass requests on, open connections and new ones, and drop every reply, until `restore()`."""
        self._run("deafen")

    def restore(self) -> None:
        """Forward new connections again."""
        self._run("restore")

    def close(self) -> None:
        """Stop listening, reset everything, end the thread."""

        async def shutdown() -> None:
            assert self._server is not None
            self._server.close()
            for writer in list(self._writers):
                writer.transport.abort()
            others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in others:
                task.cancel()
            await asyncio.gather(*others, return_exceptions=True)

        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        if not self._thread.is_alive():
            self._loop.close()


@contextlib.contextmanager
def tcp_proxy(target_host: str, target_port: int) -> Iterator[TcpProxy]:
    """A running proxy, closed on exit even if the test fails."""
    proxy = TcpProxy(target_host, target_port)
    try:
        yield proxy
    finally:
        proxy.close()
