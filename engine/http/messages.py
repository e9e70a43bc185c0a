"""A request's messages and prompt as the engine reads them: chat messages normalized for the chat
template (roles checked, content parts to text, legacy function messages as tool results) and a
completion's prompt(s), as texts or token ids. Each refusal is a 400 naming the field."""

from __future__ import annotations

from typing import Any

from engine.http.protocol import APIError
from engine.tools.request import checked_tool_calls

_ROLES = ("system", "developer", "user", "assistant", "tool")


def chat_messages(raw: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as the chat template wants them: role and plain-text content (and tool calls, results)."""
    out = []
    for i, msg in enumerate(raw):
        if not isinstance(msg, dict):
            raise APIError(
                400, f"messages[{i}] must be an object", param=f"messages[{i}]", code="invalid_type"
            )
        msg = _from_legacy(msg, i)
        role = msg.get("role")
        if role not in _ROLES:
            raise APIError(
                400,
                f"messages[{i}].role must be one of {', '.join(_ROLES)}, got {role!r}",
                param=f"messages[{i}].role",
                code="invalid_value",
            )
        content = _content_text(msg.get("content"), f"messages[{i}].content", role == "assistant")
        if content is None and role != "assistant":
            raise APIError(
                400,
                f"messages[{i}].content is required",
                param=f"messages[{i}].content",
                code="invalid_value",
            )
        turn: dict[str, Any] = {"role": "system" if role == "developer" else role, "content": content or ""}
        if role == "assistant" and msg.get("tool_calls"):
            turn["tool_calls"] = checked_tool_calls(msg["tool_calls"], f"messages[{i}].tool_calls")
        if role == "tool":
            call_id = msg.get("tool_call_id")
            if not isinstance(call_id, str):  # required, as OpenAI's API has it
                missing = call_id is None
                raise APIError(
                    400,
                    f"Missing required parameter: 'messages[{i}].tool_call_id'"
                    if missing
                    else f"messages[{i}].tool_call_id must be a string",
                    param=f"messages[{i}].tool_call_id",
                    code="missing_required_parameter" if missing else "invalid_type",
                )
            turn["tool_call_id"] = call_id
        out.append(turn)
    return out


def _from_legacy(msg: dict[str, Any], i: int) -> dict[str, Any]:
    """A turn of the deprecated function-calling API (a `function` role result, an assistant's
    `function_call`) as its tool-calling twin, so that a `functions` client's history replays."""
    where = f"messages[{i}]"
    if msg.get("role") == "function":
        if not isinstance(msg.get("name"), str):
            raise APIError(
                400, f"Missing required parameter: '{where}.name'", param=f"{where}.name",
                code="missing_required_parameter",
            )  # fmt: skip
        # its content may be null (OpenAI's `string | null`: a function that returned nothing)
        content = "" if msg.get("content") is None else msg["content"]
        return {**msg, "role": "tool", "tool_call_id": msg["name"], "content": content}
    call = msg.get("function_call")
    if msg.get("role") != "assistant" or call is None or msg.get("tool_calls"):
        return msg
    if not isinstance(call, dict):
        param = f"{where}.function_call"
        raise APIError(400, f"{param} must be an object", param=param, code="invalid_type")
    for field in ("name", "arguments"):
        if not isinstance(call.get(field), str):
            param = f"{where}.function_call.{field}"
            raise APIError(400, f"{param} must be a string", param=param, code="invalid_type")
    return {**msg, "tool_calls": [{"id": call["name"], "type": "function", "function": call}]}


def _content_text(content: object, param: str, assistant: bool = False) -> str | None:
    """The text of a message's content; an assistant's may hold `refusal` parts (OpenAI's history of
    a refused answer), read as the words it said."""
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(
            400, f"{param} must be a string or an array of content parts", param=param, code="invalid_type"
        )
    parts = []
    for j, part in enumerate(content):
        refusal = assistant and isinstance(part, dict) and part.get("type") == "refusal"
        field = "refusal" if refusal else "text"
        if not isinstance(part, dict) or part.get("type") != field:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise APIError(
                400,
                f"{param}[{j}]: only text content parts are supported, got {kind!r}",
                param=f"{param}[{j}]",
                code="invalid_value",
            )
        text = part.get(field)
        if not isinstance(text, str):
            missing = field not in part
            raise APIError(
                400,
                f"Missing required parameter: '{param}[{j}].{field}'"
                if missing
                else f"{param}[{j}].{field} must be a string, got {type(text).__name__}",
                param=f"{param}[{j}].{field}",
                code="missing_required_parameter" if missing else "invalid_type",
            )
        parts.append(text)
    return "\n".join(parts)  # as vLLM joins a message's text parts


def completion_prompts(prompt: object) -> list[str | list[int]]:
    """`prompt` as a list of prompts: each a string or a list of token ids."""
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return list(prompt)
        if all(_is_int(t) for t in prompt):
            return [list(prompt)]
        if all(isinstance(p, list) and p and all(_is_int(t) for t in p) for p in prompt):
            return [list(p) for p in prompt]
    raise APIError(
        400,
        "'prompt' must be a non-empty string, array of strings, array of token ids, or array of "
        "non-empty arrays of token ids",
        param="prompt",
        code="invalid_type" if not isinstance(prompt, (str, list)) else "invalid_value",
    )


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
