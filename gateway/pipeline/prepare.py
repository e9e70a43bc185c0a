"""The first stage of a request: its body parsed and checked, its model known and allowed."""

from __future__ import annotations

from typing import Any

import orjson

from gateway.errors import GatewayError
from gateway.governance.keys import AuthError
from gateway.pipeline.call import Call
from gateway.pipeline.runtime import Runtime

# Fields the gateway sends its engines for stream resumption (pipeline/resume.py): a client's
# would make an engine report token ids to it, or go on from tokens it made up.
_ENGINE_INTERNAL = ("stream_token_ids", "resume")


def prepare(rt: Runtime, call: Call, raw: bytes) -> tuple[dict[str, Any], bool]:
    """The request body to forward, and whether the client asked for a stream's usage.

    Raises GatewayError (400 unparseable or without a model, 404 unknown model) or AuthError (403:
    the key may not use the model). A stream always asks its upstream for usage (the log needs it);
    the relay hides it again from a client that did not ask.
    """
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise GatewayError(
            400, f"We could not parse the JSON body of your request: {exc}", code="invalid_json"
        ) from exc
    if not isinstance(body, dict):
        raise GatewayError(400, "The request body must be a JSON object", code="invalid_type")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise GatewayError(
            400, "you must provide a model parameter", param="model", code="missing_required_parameter"
        )
    call.model = model
    call.stream = bool(body.get("stream"))
    call.trace.parsed(model, body)
    if model not in rt.policy.models and model not in rt.policy.routes:
        raise GatewayError(404, f"The model '{model}' does not exist", param="model", code="model_not_found")
    if not call.key.allows(model):
        raise AuthError(403, f"this key may not use the model '{model}'", "model_not_allowed")
    if rt.policy.log_bodies:
        call.request_body = raw
    for field in _ENGINE_INTERNAL:  # the gateway's own dialogue with its engines, never a client's
        body.pop(field, None)
    call.body, call.body_bytes = body, len(raw)
    options = body.get("stream_options")
    wants_usage = isinstance(options, dict) and options.get("include_usage") is True
    if body.get("stream") is True and not wants_usage:  # the log needs usage: ask, hide it later
        body["stream_options"] = {**(options if isinstance(options, dict) else {}), "include_usage": True}
    return body, wants_usage
