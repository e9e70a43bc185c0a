"""A whole upstream answer as the client gets it: relayed, its usage checked, or replaced by an
OpenAI-format error (an upstream's text that is not one is never relayed)."""

from __future__ import annotations

import logging

import orjson

from gateway.backends.base import UpstreamReply
from gateway.backends.upstream_errors import (
    GATEWAY_FAULT_STATUSES,
    error_code,
    is_openai_error,
    reduced_error,
)
from gateway.errors import NO_RETRY, NOSNIFF, GatewayError
from gateway.governance.usage import checked_usage
from gateway.pipeline.call import Call
from gateway.pipeline.reply import JSON_HEADER, Reply, error_reply

logger = logging.getLogger(__name__)


def passed_on(call: Call, status: int, body: bytes, retry_after: int | None = None) -> tuple[Reply, str]:
    """An upstream's error answer as the client gets it, with the error code for the log: in
    OpenAI's format, a 4xx with its status, a 503/504 as it is, any other status (500, 501, a
    1xx-3xx that answers nothing) as 502. A 429 or 503 carries the upstream's `retry_after`
    (sanitized seconds, see UpstreamReply), when it gave one.

    The gateway is the server the client talks to: an upstream's 500 is a bad gateway, and a body
    that is not an OpenAI error (an HTML page, plain text, a list) is replaced, never relayed.
    """
    client_status = status if 400 <= status < 500 or status in (502, 503, 504) else 502
    if status in GATEWAY_FAULT_STATUSES:  # the upstream refused the gateway: the operator's to fix
        logger.error("request %s: %s refused the gateway with HTTP %d: %r",
                     call.id, call.backend or call.model, status, body[:300])  # fmt: skip
        message = f"the upstream for '{call.model}' refused the gateway's request (HTTP {status})"
        refused = GatewayError(502, message, "api_error", code="upstream_refused_gateway", headers=[NO_RETRY])
        return error_reply(refused), "upstream_refused_gateway"
    if not is_openai_error(body):
        logger.warning("request %s: %s answered HTTP %d without an OpenAI error: %r",
                       call.id, call.backend or call.model, status, body[:200])  # fmt: skip
        kind = "invalid_request_error" if client_status < 500 else "api_error"
        message = f"the upstream for '{call.model}' answered HTTP {status}"
        replaced = GatewayError(client_status, message, kind, code="upstream_error")
        return error_reply(replaced), "upstream_error"
    reduced = reduced_error(body, status, call.model or "the model", call.hidden)
    headers = [JSON_HEADER, NOSNIFF]  # as every error answer of ours (gateway/errors.py)
    if client_status in (429, 503) and retry_after is not None:  # a rate limit's, an overload's wait
        headers.append((b"retry-after", str(retry_after).encode()))
    return Reply(client_status, headers, reduced), error_code(body)


def whole(call: Call, reply: UpstreamReply, log_bodies: bool) -> tuple[Reply, str | None]:
    """The served upstream's whole answer for the client, with the error code for the log (None: a
    success). Usage the gateway does not believe is neither logged nor relayed."""
    if reply.status != 200:
        return passed_on(call, reply.status, reply.body, reply.retry_after)
    answer = reply.answer  # parsed and checked where it was served (failover.py)
    if answer is None:
        try:
            answer = orjson.loads(reply.body)
        except orjson.JSONDecodeError:
            answer = None
    if not isinstance(answer, dict):
        logger.warning("request %s: %s answered 200 with a body that is not a JSON object",
                       call.id, call.backend)  # fmt: skip
        message = f"the upstream ({call.backend}) sent an answer that is not a JSON object"
        exc = GatewayError(502, message, "api_error", code="upstream_invalid_response")
        return error_reply(exc), exc.code
    call.usage = checked_usage(answer.get("usage"), call.body, call.body_bytes, call.output_cap) or {}
    model = answer.get("model")
    call.response_model = model if isinstance(model, str) else None
    relayed = reply.body
    if answer.get("usage") is not None and not call.usage:  # unbelievable: not relayed either
        answer["usage"] = None
        relayed = orjson.dumps(answer)
    if log_bodies:
        call.response_body = relayed
    call.reply_body = relayed
    return Reply(reply.status, [JSON_HEADER], relayed), None
