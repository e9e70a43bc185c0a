"""The gateway's base error and OpenAI's error body: below every room (gateway/api/errors.py maps
exceptions to answers)."""

from __future__ import annotations

from typing import Any

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
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> bytes:
    """`{"error": {...}}` as JSON bytes."""
    body: dict[str, Any] = {"error": {"message": message, "type": type_, "param": param, "code": code}}
    return orjson.dumps(body)


def auth_error_type(status: int) -> str:
    """OpenAI's error type for an AuthError's status."""
    return {401: "authentication_error", 429: "requests"}.get(status, "permission_error")
