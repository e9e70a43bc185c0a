"""The first stage of a request: its body parsed and checked, its model known and allowed."""

from __future__ import annotations

from typing import Any

import orjson

from gateway.errors import GatewayError, model_not_found
from gateway.governance.keys import AuthError
from gateway.governance.usage import MAX_CHOICES, MAX_TOKENS
from gateway.pipeline.call import Call
from gateway.pipeline.runtime import Runtime

# Fields the gateway sends its engines for stream resumption (pipeline/resume.py): a client's
# would make an engine report token ids to it, or go on from tokens it made up.
_ENGINE_INTERNAL = ("stream_token_ids", "resume", "stream_prompt_tokens")


def prepare(
    rt: Runtime, call: Call, raw: bytes, path: str = "/v1/chat/completions"
) -> tuple[dict[str, Any], bool]:
    """The request body to forward, and whether the client asked for a stream's usage.

    Raises GatewayError (400 unparseable, without a model, or not the request's shape; 404 unknown
    model) or AuthError (403: the key may not use the model). A stream always asks its upstream for
    usage (the log needs it); the relay hides it again from a client that did not ask.
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
    if model is not None and not isinstance(model, str):  # there, but not a name: as OpenAI answers it
        message = f"Invalid type for 'model': expected a string, but got {_json_type(model)} instead."
        raise GatewayError(400, message, param="model", code="invalid_type")
    if not model:
        raise GatewayError(
            400, "you must provide a model parameter", param="model", code="missing_required_parameter"
        )
    call.model = model
    call.stream = body.get("stream") is True
    if model not in rt.policy.models and model not in rt.policy.routes:
        raise model_not_found(model)
    call.trace.parsed(model, body)  # a known name only: a made-up one (any length) never names a span
    if not call.key.allows(model):
        raise AuthError(403, f"this key may not use the model '{model}'", "model_not_allowed")
    _check_shape(body, path)
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


def _check_shape(body: dict[str, Any], path: str) -> None:
    """What every backend needs of the request, checked before any is chosen: an engine would refuse
    the rest itself, but a hosted provider's library may take it as its own failure (a malformed
    `messages` looked like an unreachable provider and was failed over)."""
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise GatewayError(400, "'stream' must be a boolean", param="stream", code="invalid_type")
    options = body.get("stream_options")  # the gateway rewrites it: a malformed one must not be hidden
    if options is not None and not isinstance(options, dict):
        raise GatewayError(400, "'stream_options' must be an object", param="stream_options",
                           code="invalid_type")  # fmt: skip
    if isinstance(options, dict) and not isinstance(options.get("include_usage", False), bool):
        raise GatewayError(400, "'stream_options.include_usage' must be a boolean",
                           param="stream_options.include_usage", code="invalid_type")  # fmt: skip
    _check_choices(body)
    _check_output_bounds(body, path)
    if path.endswith("/chat/completions"):
        messages = body.get("messages")
        if messages is None:
            raise GatewayError(
                400,
                "you must provide a messages parameter",
                param="messages",
                code="missing_required_parameter",
            )
        if not isinstance(messages, list) or not messages:
            raise GatewayError(
                400, "'messages' must be a non-empty array", param="messages", code="invalid_type"
            )
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise GatewayError(
                    400,
                    f"messages[{i}] must be an object with a string 'role'",
                    param=f"messages[{i}]",
                    code="invalid_type",
                )
            if not _content_shape(message.get("content")):
                raise GatewayError(400, f"messages[{i}].content must be a string, null or an array of "
                                   "parts (objects with a string 'type'; a text part's 'text' a string)",
                                   param=f"messages[{i}].content", code="invalid_type")  # fmt: skip
        _check_chat_options(body)
    elif "prompt" not in body or body["prompt"] is None:
        raise GatewayError(
            400, "you must provide a prompt parameter", param="prompt", code="missing_required_parameter"
        )
    elif not _prompt_shape(body["prompt"]):
        message = ("'prompt' must be a string, or a non-empty array of strings, of token ids or of "
                   "non-empty token-id arrays")  # fmt: skip
        raise GatewayError(400, message, param="prompt", code="invalid_value")


def _check_output_bounds(body: dict[str, Any], path: str) -> None:
    """`max_tokens` and `max_completion_tokens`, when given, are integers from 1 to MAX_TOKENS: the
    reservations read only such a number, and passed anything else ("12", -5, 1e308) on unreserved.
    A legacy completion that echoes its prompt may ask for none (0: the prompt scored, as
    evaluation harnesses do)."""
    least = (
        0
        if path.endswith("/completions")
        and not path.endswith("/chat/completions")
        and body.get("echo") is True
        else 1
    )
    for field in ("max_tokens", "max_completion_tokens"):
        value = body.get(field)
        if value is None:
            continue
        if isinstance(value, float) and value.is_integer() and abs(value) > MAX_TOKENS:
            value = int(value)  # an integer past 64 bits, which the JSON reader gave as a float: out of range
        if type(value) is not int:
            raise GatewayError(400, f"'{field}' must be an integer, not {_json_type(value)}", param=field,
                               code="invalid_type")  # fmt: skip
        if not least <= value <= MAX_TOKENS:
            raise GatewayError(400, f"'{field}' must be from {least} to {MAX_TOKENS}", param=field,
                               code="invalid_value")  # fmt: skip


def _check_choices(body: dict[str, Any]) -> None:
    """`n` and `best_of`, when given, are integers from 1 to MAX_CHOICES (OpenAI's bound on `n`).
    The budget reserves for at most that many answers (usage.choices): a provider that took more
    would answer, and bill, past the reservation; an engine refuses them anyway."""
    for field in ("n", "best_of"):
        value = body.get(field)
        if value is not None and (type(value) is not int or not 1 <= value <= MAX_CHOICES):
            raise GatewayError(400, f"'{field}' must be an integer from 1 to {MAX_CHOICES}", param=field,
                               code="invalid_value")  # fmt: skip


# Chat options a hosted provider's library checks before sending (an outage to us, else), by the
# shape OpenAI gives each: what the value must be, and its name in the error.
_CHAT_OPTIONS: dict[str, tuple[tuple[type, ...], str]] = {
    "tools": ((list,), "an array of objects"),
    "tool_choice": ((str, dict), "a string or an object"),
    "response_format": ((dict,), "an object"),
}


def _check_chat_options(body: dict[str, Any]) -> None:
    """400 `invalid_type` for a chat option of another shape than _CHAT_OPTIONS says (absent: fine)."""
    for field, (types, shape) in _CHAT_OPTIONS.items():
        value = body.get(field)
        parts = value if isinstance(value, list) else []  # (tools: objects only)
        if value is not None and not (isinstance(value, types) and all(isinstance(p, dict) for p in parts)):
            raise GatewayError(400, f"'{field}' must be {shape}", param=field, code="invalid_type")


def _content_shape(content: Any) -> bool:
    """A message's content as OpenAI takes it: absent, text, or parts that each name their type (a
    text part's text a string: an object there was passed on, and read as text by nobody)."""
    if content is None or isinstance(content, str):
        return True
    return isinstance(content, list) and all(
        isinstance(part, dict)
        and isinstance(kind := part.get("type"), str)
        and (kind != "text" or isinstance(part.get("text"), str))
        for part in content
    )


def _token_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(type(t) is int and t >= 0 for t in value)


def _prompt_shape(prompt: Any) -> bool:
    """OpenAI's four prompt shapes (a hosted provider's library takes any other for an outage)."""
    if isinstance(prompt, str):
        return True
    if not isinstance(prompt, list) or not prompt:
        return False
    return all(isinstance(p, str) for p in prompt) or _token_ids(prompt) or all(_token_ids(p) for p in prompt)


def _json_type(value: object) -> str:
    """A JSON value's type as OpenAI's error messages name it."""
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a decimal"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    return "null" if value is None else "a string"
