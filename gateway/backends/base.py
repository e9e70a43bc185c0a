"""What every upstream backend offers the proxy, and the errors it may raise."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Protocol


class UpstreamUnavailableError(Exception):
    """The upstream could not be reached or did not answer in time."""

    def __init__(self, message: str, timeout: bool) -> None:
        super().__init__(message)
        self.timeout = timeout


class ModelUnavailableError(Exception):
    """The backend cannot be called at all (e.g. a hosted model whose API key is not configured)."""


class UpstreamStreamError(Exception):
    """A stream broke off after it had started."""


@dataclass
class UpstreamReply:
    """A whole (non-streamed) upstream response."""

    status: int
    body: bytes
    url: str


@dataclass
class UpstreamStream:
    """A streamed upstream response: SSE lines when status is 200, else an error body."""

    status: int
    lines: AsyncIterator[str]
    error_body: bytes
    url: str


class Upstream(Protocol):
    """An engine pool or a hosted model."""

    name: str

    @property
    def unavailable_reason(self) -> str | None:
        """Why the backend cannot be called, or None."""
        ...

    async def send(self, path: str, body: bytes) -> UpstreamReply:
        """One whole response."""
        ...

    def stream(self, path: str, body: bytes) -> AbstractAsyncContextManager[UpstreamStream]:
        """A streamed response; leaving the context releases the upstream."""
        ...

    async def close(self) -> None:
        """Release connections."""
        ...
