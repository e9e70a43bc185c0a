"""What an upstream's answer says about itself: its error code, whether it is an OpenAI error, and
the error event that ends a stream the gateway cannot relay further."""

from __future__ import annotations

import re
from collections.abc import Collection

import orjson

_CODE = re.compile(r"[A-Za-z][A-Za-z0-9_.\-]{0,63}")  # an error code or type as OpenAI spells them
MAX_ERROR_MESSAGE = 1000  # characters of an upstream's client error message passed on
_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*://\S*")  # a URL inside a message: an upstream's, never shown
_IPV4 = re.compile(r"\b(?:[0-9]{1,3}\.){3}[0-9]{1,3}(?::[0-9]{1,5})?\b")  # an address, bare: its network's
# An upstream that answers these refuses the gateway, not the client's request (whose key the
# gateway checked, for a model the policy names): its credentials (401, 403, a proxy's 407), the
# model's upstream name or the path (404, 405) are the operator's to fix. Another replica or model
# is tried; a client that meets one anyway gets a 502 that names no upstream model or detail.
GATEWAY_FAULT_STATUSES = frozenset({401, 403, 404, 405, 407})
# Statuses outside HTTP's own that mean the upstream is overloaded (Anthropic's 529): answered, and
# failed over, as the 503 they mean.
OVERLOADED_STATUSES = frozenset({529})
MAX_RETRY_AFTER = 3600  # seconds of an upstream's Retry-After passed on at most
_SECONDS = re.compile(r"[0-9]{1,10}")


def retry_after_seconds(value: object) -> int | None:
    """An upstream's `Retry-After` as whole seconds for the client, at most MAX_RETRY_AFTER; None
    for anything but delay-seconds (an HTTP-date, a fraction, text): never relayed as it came."""
    if not isinstance(value, str) or not _SECONDS.fullmatch(value.strip()):
        return None
    return min(int(value.strip()), MAX_RETRY_AFTER)


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


def reduced_error(body: bytes, status: int, model: str, hidden: Collection[str] = ()) -> bytes:
    """An upstream's whole OpenAI error answer as the client gets it (`reduced_fields`); `body`
    must pass `is_openai_error`."""
    return orjson.dumps({"error": reduced_fields(orjson.loads(body)["error"], status, model, hidden)})


def reduced_fields(
    error: dict[str, object], status: int, model: str, hidden: Collection[str] = ()
) -> dict[str, str | None]:
    """An upstream's OpenAI error object reduced to its four fields, nothing else of it. A client
    error (4xx) keeps its message, at most MAX_ERROR_MESSAGE characters with URLs masked: it says
    what to change, such as a context length. A server error's or a 429's message is replaced: it
    can only describe the upstream (its hosts, load, internals). Codes and types that are not plain
    tokens are dropped; `param` is cut at 200 characters. Each of `hidden` (the gateway's key for
    that upstream, its host) is masked wherever it appears, before the clip cuts one in two: a
    provider that echoes the Authorization header in a 400 must not hand our key to the client. So
    is an IPv4 address, bare (an engine naming its node)."""

    def token(value: object) -> str | None:
        return value if isinstance(value, str) and _CODE.fullmatch(value) else None

    message, param = error.get("message"), error.get("param")
    if status < 500 and status != 429:
        text = masked(message, hidden) if isinstance(message, str) else ""
        kept = _IPV4.sub("[host]", _URL.sub("[url]", text[:MAX_ERROR_MESSAGE]))
        message = kept or "the request cannot be completed"
        kind = token(error.get("type")) or "invalid_request_error"
    else:
        message = f"the upstream for '{model}' could not answer (HTTP {status})"
        kind = "rate_limit_error" if status == 429 else "api_error"
    return {
        "message": message,
        "type": kind,
        "param": _IPV4.sub("[host]", masked(param, hidden))[:200] if isinstance(param, str) else None,
        "code": token(error.get("code")),
    }


# what reads as a credential in any upstream's message: an Authorization header's value, an
# `sk-`-style key, a `key=`/`token:` assignment (an engine that echoes the header it refused names the
# pool's key; a provider's message may name one we never configured, e.g. a proxy's in between)
# A value counts as a credential only if it looks like one: 8 characters or more with a digit, or 16
# or more (so "Only basic types are supported", "Missing bearer token", "token: must be a string"
# keep their words).
_SECRET_VALUE = r"(?=[^\s\"',;]*\d|[^\s\"',;]{16})[^\s\"',;]{8,}"
_CREDENTIAL = re.compile(
    rf"(?i)\b(?:bearer|basic)\s+{_SECRET_VALUE}|\bsk-[\w-]{{8,}}|\b(api[_-]?key|token|secret|password)"
    rf"([\"']?\s*[=:]\s*[\"']?){_SECRET_VALUE}"
)


def masked(text: str, hidden: Collection[str]) -> str:
    """`text` with every string of `hidden` replaced, in any case, and whatever reads as a credential;
    one of `hidden` shorter than 4 characters (a one-letter service name) is left: masking it would
    garble the message, not protect it."""
    for secret in hidden:
        if len(secret) >= 4:
            text = re.sub(re.escape(secret), "[hidden]", text, flags=re.IGNORECASE)
    return _CREDENTIAL.sub(_credential_hidden, text)


def _credential_hidden(match: re.Match[str]) -> str:
    """A credential's value replaced; an assignment keeps its name (`token=[hidden]`)."""
    return f"{match.group(1)}{match.group(2)}[hidden]" if match.group(1) else "[hidden]"
