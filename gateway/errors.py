"""The gateway's base error and the one mapping of an error to OpenAI's answer: below every room.

Every error a client may be answered with is a GatewayError: it carries its HTTP `status`,
OpenAI's `type`, `param` and `code`, and the `headers()` its answer needs (Retry-After, Allow).
`error_answer` turns any of them into the answer (with `nosniff`: a browser never takes an error's JSON,
which may quote what a client sent, for HTML or script); the proxy, the completion endpoint, the ASGI
guards and the FastAPI handlers (gateway/api/errors.py) all use it, and none reads a message.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import orjson


class GatewayError(Exception):
    """An error answered as `{"error": {"message", "type", "param", "code"}}` with `status`."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: Sequence[tuple[bytes, bytes]] = (),
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self._headers = headers

    def headers(self) -> list[tuple[bytes, bytes]]:
        """Response headers the answer needs besides its content type (e.g. Retry-After)."""
        return list(self._headers)


# on every error answer (and an upstream's error passed on): its body is JSON, whatever a browser guesses
NOSNIFF = (b"x-content-type-options", b"nosniff")


class ErrorAnswer(NamedTuple):
    """An error's HTTP answer: status, headers (the JSON content type not included) and body."""

    status: int
    headers: list[tuple[bytes, bytes]]
    body: bytes


def error_answer(exc: GatewayError) -> ErrorAnswer:
    """The OpenAI-format answer to `exc`: the one place an error becomes a status, body and headers."""
    body = error_body(exc.message, exc.type, exc.param, exc.code)
    return ErrorAnswer(exc.status, [NOSNIFF, *exc.headers()], body)


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> bytes:
    """`{"error": {...}}` as JSON bytes."""
    body: dict[str, Any] = {"error": {"message": message, "type": type_, "param": param, "code": code}}
    return orjson.dumps(body)


# The OpenAI SDKs' own header: an answer that carries it is not retried by their automatic retries
# (twice by default, seconds apart), where waiting cannot change it (a budget spent until next
# month, a request bigger than a limit, an upstream that refuses the gateway's configuration)
NO_RETRY = (b"x-should-retry", b"false")


def retry_after_header(seconds: float) -> bytes:
    """`Retry-After` in whole seconds, at least 1."""
    return str(max(1, math.ceil(seconds))).encode()


_ECHOED_NAME = 200  # characters of a model's name repeated in its 404 (a 2 MB name is not echoed)


def model_not_found(model: str) -> GatewayError:
    """The 404 for a model the gateway does not serve (or that the key may not list)."""
    shown = model if len(model) <= _ECHOED_NAME else model[:_ECHOED_NAME] + "…"
    return GatewayError(404, f"The model '{shown}' does not exist", param="model", code="model_not_found")


# The message uvicorn cancels the requests still in flight with once a stopping server's grace
# period (`timeout_graceful_shutdown`: GATEWAY_SHUTDOWN_TIMEOUT) is over, in every worker; they end
# as 503 `gateway_shutdown`, not as clients that left (tests/gateway/test_shutdown.py runs it)
SHUTDOWN = "Task cancelled, timeout graceful shutdown exceeded"


def stopped_by_shutdown(exc: BaseException) -> bool:
    """Whether a CancelledError is the server's at shutdown (SHUTDOWN), not a client leaving."""
    return bool(exc.args) and exc.args[0] == SHUTDOWN


def cancelled_outcome(exc: BaseException) -> tuple[int, str]:
    """The log's status and error for a request a CancelledError ended: the gateway's shutdown
    (503 `gateway_shutdown`), else its client leaving (499 `client_disconnected`)."""
    return (503, "gateway_shutdown") if stopped_by_shutdown(exc) else (499, "client_disconnected")


def shutdown_error() -> GatewayError:
    """What a request cut off by the gateway's shutdown is answered (if it still can be) and logged."""
    message = "the gateway shut down before the answer was complete; retry the request"
    return GatewayError(503, message, "api_error", code="gateway_shutdown")
