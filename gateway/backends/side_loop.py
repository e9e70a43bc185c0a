"""SideLoop: an event loop in a thread of its own, for libraries that do heavy Python work per call.

litellm (and the OpenAI SDK inside it) builds each request and parses each answer in Python on the
loop that awaits it: about 2 ms per call and 0.15 ms per chat message here, so one request with
10,000 messages held the gateway's loop (and /health) for 1.4 s. A hosted model runs its calls on
a SideLoop instead: that work then costs the side thread, and the gateway's loop only waits on a
future (it still shares the GIL, which Python hands over every 5 ms).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class SideLoop:
    """A daemon thread running its own event loop; `run` awaits a coroutine there from any loop."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    def _ensure(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
            self._thread = threading.Thread(target=self._loop.run_forever, name=self._name, daemon=True)
            self._thread.start()
        return self._loop

    async def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """The coroutine's result, computed on the side loop; cancelling the caller cancels it there."""
        future = asyncio.run_coroutine_threadsafe(coro, self._ensure())
        return await asyncio.wrap_future(future)  # a cancelled wrapper cancels the task on the side loop

    async def close(self) -> None:
        """Cancel what still runs there, stop the loop and join its thread."""
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        self._loop = self._thread = None

        async def cancel_all() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(cancel_all(), loop))
        loop.call_soon_threadsafe(loop.stop)
        await asyncio.to_thread(thread.join, 5.0)
        if not thread.is_alive():
            loop.close()
