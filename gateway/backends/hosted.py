"""Hosted models through litellm: the only module that imports it (it is slow to import: ~3 s)."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any

import orjson

from gateway.backends.base import (
    ModelUnavailableError,
    UpstreamReply,
    UpstreamStream,
    UpstreamStreamError,
    UpstreamUnavailableError,
)
from gateway.policy import HostedBackend, Timeouts

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # never fetch the cost map at import

import litellm

logger = logging.getLogger(__name__)
litellm.suppress_debug_info = True
litellm.telemetry = False


class HostedModel:
    """One hosted backend: litellm `acompletion` / `atext_completion`, streamed or whole."""

    def __init__(self, name: str, spec: HostedBackend) -> None:
        self.name = name
        self.spec = spec
        self._api_key = os.environ.get(spec.api_key_env) if spec.api_key_env else None

    @property
    def timeouts(self) -> Timeouts:
        """The backend's own timeouts."""
        return self.spec.timeouts

    @property
    def unavailable_reason(self) -> str | None:
        """Why the model cannot be called, or None when it can."""
        if self.spec.api_key_env and not self._api_key:
            return f"set {self.spec.api_key_env} to use {self.spec.model}"
        return None

    async def start(self) -> None:
        """Nothing runs in the background for a hosted model."""

    def _check_not_tried(self, avoid: frozenset[str]) -> None:
        """One deployment: once it failed this round, there is nothing else to offer."""
        if self.spec.model in avoid:
            raise UpstreamUnavailableError(f"{self.spec.model} already failed this request", timeout=False)

    def _kwargs(self, body: bytes, stream: bool, timeouts: Timeouts | None) -> tuple[Any, dict[str, Any]]:
        reason = self.unavailable_reason
        if reason is not None:
            raise ModelUnavailableError(reason)
        params: dict[str, Any] = orjson.loads(body)
        params.pop("stream", None)
        if stream:
            params["stream"] = True
            params["stream_options"] = {"include_usage": True}
        else:
            params.pop("stream_options", None)
        params.update(timeout=(timeouts or self.spec.timeouts).total, api_key=self._api_key)
        if self.spec.base_url:
            params["base_url"] = self.spec.base_url
        if self.spec.api_version:
            params["api_version"] = self.spec.api_version
        return params.pop("model"), params

    async def send(
        self,
        path: str,
        body: bytes,
        timeouts: Timeouts | None = None,
        avoid: frozenset[str] = frozenset(),
        headers: Mapping[str, str] | None = None,
    ) -> UpstreamReply:
        """One whole completion (our trace context is not sent to providers: `headers` is unused)."""
        self._check_not_tried(avoid)
        model, params = self._kwargs(body, False, timeouts)
        call = litellm.acompletion if path.endswith("chat/completions") else litellm.atext_completion
        try:
            resp = await call(model=model, **params)
        except Exception as exc:
            return self._error(exc)
        return UpstreamReply(200, resp.model_dump_json(exclude_none=True).encode(), self.spec.model)

    @asynccontextmanager
    async def stream(
        self,
        path: str,
        body: bytes,
        timeouts: Timeouts | None = None,
        avoid: frozenset[str] = frozenset(),
        headers: Mapping[str, str] | None = None,
    ) -> AsyncIterator[UpstreamStream]:
        """A streamed completion, re-encoded as OpenAI SSE lines."""
        self._check_not_tried(avoid)
        model, params = self._kwargs(body, True, timeouts)
        call = litellm.acompletion if path.endswith("chat/completions") else litellm.atext_completion
        try:
            async with asyncio.timeout((timeouts or self.spec.timeouts).first_token):  # it must start by then
                resp = await call(model=model, **params)
        except TimeoutError as exc:
            message = f"{self.spec.model} did not start answering in time"
            raise UpstreamUnavailableError(message, timeout=True, deployment=self.spec.model) from exc
        except Exception as exc:
            reply = self._error(exc)
            yield UpstreamStream(reply.status, _no_lines(), reply.body, self.spec.model)
            return

        async def lines() -> AsyncIterator[str]:
            try:
                async for chunk in resp:
                    yield "data: " + chunk.model_dump_json(exclude_none=True)
            except Exception as exc:
                raise UpstreamStreamError(f"{self.spec.model}: {exc}") from exc
            yield "data: [DONE]"

        yield UpstreamStream(200, lines(), b"", self.spec.model)

    def _error(self, exc: Exception) -> UpstreamReply:
        """Provider errors, classified here and nowhere else: status and body in OpenAI's format."""
        if isinstance(exc, (litellm.exceptions.Timeout,)):
            raise UpstreamUnavailableError(
                f"{self.spec.model} timed out", timeout=True, deployment=self.spec.model
            ) from exc
        if isinstance(exc, litellm.exceptions.APIConnectionError):
            raise UpstreamUnavailableError(
                f"{self.spec.model} is unreachable: {exc}", timeout=False, deployment=self.spec.model
            ) from exc
        status = int(getattr(exc, "status_code", 0) or 502)
        kind = "invalid_request_error" if 400 <= status < 500 else "api_error"
        body = {"error": {"message": str(exc), "type": kind, "param": None, "code": type(exc).__name__}}
        logger.warning("hosted model %s answered %d: %s", self.spec.model, status, exc)
        return UpstreamReply(status, orjson.dumps(body), self.spec.model)

    async def close(self) -> None:
        """Nothing pooled here (litellm owns its clients)."""


async def _no_lines() -> AsyncIterator[str]:
    return
    yield  # an async generator that yields nothing
