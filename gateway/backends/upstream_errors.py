"""What an upstream's answer says about itself: its error code, whether it is an OpenAI error, and
the error event that ends a stream the gateway cannot relay further."""

from __future__ import annotations

import orjson


def error_event(message: str, code: str | None, kind: str = "api_error", param: str | None = None) -> bytes:
    """An OpenAI-format error as the last SSE event of a stream that cannot go on."""
    error = {"message": message, "type": kind, "param": param, "code": code}
    return b"data: " + orjson.dumps({"error": error}) + b"\n\n"


def is_openai_error(body: bytes) -> bool:
    """Whether a body is `{"error": {"message": "...", ...}}`."""
    try:
        parsed = orjson.loads(body)
    except orjson.JSONDecodeError:
        return False
    error = parsed.get("error") if isinstance(parsed, dict) else None
    return isinstance(error, dict) and isinstance(error.get("message"), str)


def error_code(body: bytes) -> str:
    try:
        error = orjson.loads(body).get("error") or {}
        return str(error.get("code") or error.get("type") or "upstream_error")
    except (orjson.JSONDecodeError, AttributeError):
        return "upstream_error"
