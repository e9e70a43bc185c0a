"""The engine pool: Switchboard engine servers called directly with one pooled httpx client."""

from __future__ import annotations

import itertools
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import httpx

from gateway.policy import EngineBackend


class UpstreamUnavailableError(Exception):
    """The upstream could not be reached or did not answer in time."""

    def __init__(self, message: str, timeout: bool) -> None:
        super().__init__(message)
        self.timeout = timeout


@dataclass
class UpstreamReply:
    """A whole (non-streamed) upstream response."""

    status: int
    body: bytes
    url: str


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

    def _pick(self) -> str:
        return self.urls[next(self._turn) % len(self.urls)]

    async def send(self, path: str, body: bytes) -> UpstreamReply:
        """POST and read the whole response."""
        url = self._pick()
        try:
            resp = await self._client.post(url + path, content=body, headers=self._headers)
        except httpx.TimeoutException as exc:
            raise UpstreamUnavailableError(f"{self.name} ({url}) timed out", timeout=True) from exc
        except httpx.TransportError as exc:
            raise UpstreamUnavailableError(
                f"{self.name} ({url}) is unreachable: {exc}", timeout=False
            ) from exc
        return UpstreamReply(resp.status_code, resp.content, url)

    @asynccontextmanager
    async def stream(self, path: str, body: bytes) -> AsyncIterator[tuple[httpx.Response, str]]:
        """POST with a streamed response; leaving the block closes the upstream connection."""
        url = self._pick()
        request = self._client.build_request("POST", url + path, content=body, headers=self._headers)
        try:
            resp = await self._client.send(request, stream=True)
        except httpx.TimeoutException as exc:
            raise UpstreamUnavailableError(f"{self.name} ({url}) timed out", timeout=True) from exc
        except httpx.TransportError as exc:
            raise UpstreamUnavailableError(
                f"{self.name} ({url}) is unreachable: {exc}", timeout=False
            ) from exc
        try:
            yield resp, url
        finally:
            await resp.aclose()

    async def close(self) -> None:
        """Close the pooled connections."""
        await self._client.aclose()
