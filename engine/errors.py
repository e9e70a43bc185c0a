"""Request errors raised at admission; the HTTP server maps them to 400 responses."""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """The request's prompt or parameters are invalid."""

    code = "invalid_request"


class ContextLengthExceededError(InvalidRequestError):
    """Prompt plus max_tokens exceeds the model's context length."""

    code = "context_length_exceeded"


class KVCacheCapacityError(InvalidRequestError):
    """The request could never fit in the whole KV cache, so it would wait forever."""

    code = "kv_cache_capacity_exceeded"
