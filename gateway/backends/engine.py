"""The engine pool: Switchboard engine servers called directly with one pooled httpx client."""

from __future__ import annotations

import itertools
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx

from gateway.backends.base import UpstreamReply, UpstreamStream, UpstreamUnavailableError
from gateway.policy import EngineBackend


class EnginePool:
    """Round-robin over the pool's replicas, with keep-alive connections (health checks: routing issue)."""

    def __init__(self, name: str, spec: EngineBackend, client: httpx.AsyncClient | None = None) -> None:
        self.name = name
        self.urls = [u.rstrip("/") for u in spec.urls]
        timeout = httpx.Timeout(spec.timeouts.total, connect=spec.timeouts.connect)
        limits = httpx.Limits(max_connections=1000, max_keepalive_connections=200)
        self._client = client or httpx.AsyncClient(timeout=timeout, limits=limits)
        self._turn = itertools.count()
        key = os.environ.get(spec.api_key_env) if spec.api_key_env else None
        self._headers = {"content-type": "application/json"}
        if key:
            self._headers["authorization"] = f"Bearer {key}"

    @property
    def unavailable_reason(self) -> str | None:
        """Engine pools are always callable (health checks come with the routing issue)."""
        return None

    def _pick(self) -> str:
        return self.urls[next(self._turn) % len(self.urls)]

    async def send(self, path: str, body: bytes) -> UpstreamReply:
        """POST and read the whole response."""
        url = self._pick()
        request = self._client.build_request("POST", url + path, content=body, headers=self._headers)
        resp = await self._send(request, url, stream=False)
        return UpstreamReply(resp.status_code, resp.content, url)

    @asynccontextmanager
    async def stream(self, path: str, body: bytes) -> AsyncIterator[UpstreamStream]:
        """POST with a streamed response; leaving the block closes the upstream connection."""
        url = self._pick()
        request = self._client.build_request("POST", url + path, content=body, headers=self._headers)
        resp = await self._send(request, url, stream=True)
        try:
            error = await resp.aread() if resp.status_code != 200 else b""
            yield UpstreamStream(resp.status_code, resp.aiter_lines(), error, url)
        finally:
            await resp.aclose()

    async def _send(self, request: httpx.Request, url: str, stream: bool) -> httpx.Response:
        """Send, turning connection failures and timeouts into UpstreamUnavailableError."""
        try:
            return await self._client.send(request, stream=stream)
        except httpx.TimeoutException as exc:
            raise UpstreamUnavailableError(f"{self.name} ({url}) timed out", timeout=True) from exc
        except httpx.TransportError as exc:
            message = f"{self.name} ({url}) is unreachable: {exc}"
            raise UpstreamUnavailableError(message, timeout=False) from exc

    async def close(self) -> None:
        """Close the pooled connections."""
        await self._client.aclose()
