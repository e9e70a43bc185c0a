"""One exception -> OpenAI error mapping: attributes decide, never the message text."""

from __future__ import annotations

import asyncio

from starlette.exceptions import HTTPException

from engine.engine_state import EngineDeadError, EngineUnavailableError, RequestFailedError
from engine.errors import ContextLengthExceededError, InvalidRequestError
from engine.http.error_mapping import api_error
from engine.http.protocol import INTERNAL_ERROR


def test_domain_errors_answer_with_their_own_status_code_and_param() -> None:
    error = api_error(ContextLengthExceededError("anything at all", param="max_tokens"))
    assert (error.status, error.type, error.code, error.param) == (
        400,
        "invalid_request_error",
        "context_length_exceeded",
        "max_tokens",
    )
    assert api_error(InvalidRequestError("max_tokens requested")).param is None  # the text decides nothing
    loading = api_error(EngineUnavailableError("the model is still loading", "engine_loading"))
    assert (loading.status, loading.code, loading.message) == (
        503,
        "engine_loading",
        "the model is still loading",
    )


def test_internal_causes_answer_with_a_fixed_text() -> None:
    dead = api_error(EngineDeadError("CUDA error: device-side assert"))
    failed = api_error(RequestFailedError("tensor shape mismatch"))
    assert (dead.status, dead.code) == (503, "engine_dead") and "CUDA" not in dead.message
    assert (failed.status, failed.code) == (500, "engine_error") and "tensor" not in failed.message
    assert api_error(KeyError("secret")) is INTERNAL_ERROR


def test_http_errors_and_cancelled_requests_map_too() -> None:
    assert (api_error(HTTPException(404)).status, api_error(HTTPException(404)).code) == (404, "not_found")
    assert api_error(asyncio.CancelledError()).status == 499
