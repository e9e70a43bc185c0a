"""Served: the upstream answer that reaches the client, owning its open stream until closed."""

from __future__ import annotations

from contextlib import AsyncExitStack
from dataclasses import dataclass, field

from gateway.backends.base import Attempt, UpstreamReply, UpstreamStream
from gateway.pipeline.resume import ResumePlan


@dataclass
class Served:
    """The answer that will reach the client, and everything tried before it.

    A streamed answer owns its open upstream (`stream`, whose first lines are in `head`) until
    `aclose()`: the caller closes it with `async with aclosing(served)` or `await served.aclose()`.
    """

    model: str
    backend: str
    deployment: str
    attempts: list[Attempt]
    reply: UpstreamReply | None = None  # whole answers
    stream: UpstreamStream | None = None  # streamed answers
    head: list[str] = field(default_factory=list)
    owner: AsyncExitStack | None = None  # holds the upstream's context open (streams)
    resume: ResumePlan | None = None  # a stream that may go on on another replica if this one fails

    async def aclose(self) -> None:
        """Release the upstream (a second call does nothing)."""
        if self.owner is not None:
            await self.owner.aclose()
