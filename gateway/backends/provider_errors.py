"""What a hosted provider's failure says, read through litellm's wrapping: litellm raises its own
exception classes (a refused connection may be an InternalServerError, a "500"; Anthropic's 529 a
500) from the provider client's error, which holds the real status, headers and error object."""

from __future__ import annotations

import ast
import json
from collections.abc import Iterator, Mapping

import httpx
import openai


def causes(exc: BaseException) -> Iterator[BaseException]:
    """`exc` and the exceptions it was raised from, each once."""
    seen: set[int] = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        yield cause
        cause = cause.__cause__ or cause.__context__


def connection_failure(exc: BaseException) -> str | None:
    """ "unreachable" or "timeout" where the provider's answer never came; None for an answer the
    provider gave."""
    for cause in causes(exc):
        if isinstance(cause, openai.APITimeoutError | httpx.TimeoutException):
            return "timeout"
        if isinstance(cause, ConnectionError | httpx.TransportError | openai.APIConnectionError):
            return "unreachable"
    return None


def statuses(exc: BaseException) -> Iterator[int]:
    """The HTTP statuses `exc` and its causes carry: the provider's own among them."""
    for cause in causes(exc):
        response = getattr(cause, "response", None)
        for status in (getattr(cause, "status_code", None), getattr(response, "status_code", None)):
            if isinstance(status, int):
                yield status


def header(exc: BaseException, name: str) -> str | None:
    """A header of the provider's error response, from `exc` or a cause (litellm keeps the
    provider's headers apart, its own exception's `response` is made up)."""
    for cause in causes(exc):
        response = getattr(cause, "response", None)
        for headers in (getattr(cause, "litellm_response_headers", None), getattr(response, "headers", None)):
            if isinstance(headers, httpx.Headers | Mapping) and isinstance(headers.get(name), str):
                return str(headers[name])
    return None


def provider_error(exc: BaseException) -> dict[str, object] | None:
    """The provider's own error object about a request it refused, if it gave one: on the exception
    or, as litellm raises them (its `body` None), on the provider client's error it was raised from;
    else in the exception's message, where litellm leaves a provider's JSON it did not parse
    (Anthropic's `{"type": "error", "error": {...}}` after "AnthropicException - ")."""
    for cause in causes(exc):
        error = _error_object(getattr(cause, "body", None))
        if error is not None:
            return error
    for cause in causes(exc):
        message = _unquoted(str(getattr(cause, "message", "") or "")[:_MESSAGE_READ])
        start = message.find("{")
        if start != -1:
            try:  # the object alone: litellm may add words after it
                error = _error_object(_DECODER.raw_decode(message, start)[0])
            except ValueError:
                continue
            if error is not None:
                return error
    return None


def _unquoted(message: str) -> str:
    """`message` with a bytes literal holding the provider's JSON (`b'{...}'`, as litellm writes a
    stream's error: an apostrophe or a non-ASCII character in it is escaped there) read as text."""
    start = message.find("b'{")
    if start == -1:
        start = message.find('b"{')
    if start == -1:
        return message
    quote, end = message[start + 1], start + 2
    while end < len(message) and message[end] != quote:
        end += 2 if message[end] == "\\" else 1
    try:
        given = ast.literal_eval(message[start : end + 1])
    except (ValueError, SyntaxError):
        return message
    return given.decode("utf-8", "replace") if isinstance(given, bytes) else message


_MESSAGE_READ = 64 << 10  # of an exception's message: a provider's error object is far smaller
_DECODER = json.JSONDecoder()


def _error_object(body: object) -> dict[str, object] | None:
    """`body`'s error object (`{"error": {...}}` or the object itself) when it has a message."""
    error = body.get("error", body) if isinstance(body, dict) else None
    if isinstance(error, dict) and isinstance(error.get("message"), str) and error["message"]:
        return error
    return None
