"""The engine's domain errors: each carries the HTTP answer it becomes (status, type, code, param).

The server turns any of them into OpenAI's error format with one function (`engine.http.error_mapping`),
which reads these attributes and never an exception's message. `public_message` is what a client
may read: the message itself for a request's own mistakes, a fixed text where the cause is
internal (that goes to the server log).
"""

from __future__ import annotations


class EngineError(Exception):
    """Base of the engine's domain errors; subclasses set the class attributes."""

    status = 500
    type = "server_error"
    code: str | None = None
    param: str | None = None  # the request field to change, when one is to blame
    headers: dict[str, str] = {}  # noqa: RUF012 (read-only; a subclass replaces it whole)
    fixed_message: str | None = None  # answered instead of the message (internal causes)

    def __init__(self, message: str = "", *, code: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code
        if param is not None:
            self.param = param

    @property
    def public_message(self) -> str:
        """The message the client reads."""
        return self.fixed_message if self.fixed_message is not None else str(self)


class InvalidRequestError(EngineError, ValueError):
    """The request's prompt or parameters are invalid (param: None means the prompt)."""

    status = 400
    type = "invalid_request_error"
    code = "invalid_request"


class ContextLengthExceededError(InvalidRequestError):
    """Prompt plus max_tokens exceeds the model's context length."""

    code = "context_length_exceeded"


class KVCacheCapacityError(InvalidRequestError):
    """The request could never fit in the whole KV cache, so it would wait forever."""

    code = "kv_cache_capacity_exceeded"


class ClientDisconnectedError(EngineError):
    """The client went away before the response was ready (answered 499: nobody reads it)."""

    status = 499
    type = "client_disconnected"
    code = "client_disconnected"
