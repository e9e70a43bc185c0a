"""ToolRequest: a chat request's `tools`, `tool_choice` and `parallel_tool_calls`, checked at the boundary.

OpenAI's rules: tools are functions with a name (1-64 letters, digits, _ or -), an optional
description and a JSON-schema `parameters` object describing an object (absent: no arguments, `{}`);
at most 128 of them;
`tool_choice` is none, auto, required or {"type": "function", "function": {"name"}} naming one of
them, defaults to auto with tools and none without, and is refused without tools. The legacy
`functions` / `function_call` fields map onto the same shape, one call at most (`legacy`: the
answer then says `message.function_call`, as OpenAI's does, since a client of that API reads
nothing else). Bounds keep a request's schemas within what the grammar compiler should see
(`MAX_SCHEMA_BYTES`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from engine.errors import InvalidRequestError

MAX_TOOLS = 128
MAX_SCHEMA_BYTES = 256 * 1024  # all functions' parameters together, as compact JSON
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_EMPTY_PARAMETERS = '{"type":"object","properties":{},"additionalProperties":false}'  # no arguments: {}


class ToolRequestError(InvalidRequestError):
    """A malformed tools / tool_choice field (400 invalid_request_error naming the field)."""

    code = "invalid_tools"


@dataclass(frozen=True)
class Function:
    """One callable function: its name, description and parameters schema (compact JSON text)."""

    name: str
    description: str | None
    parameters: str

    def schema(self) -> dict[str, Any]:
        """The parameters schema as a dict."""
        value: dict[str, Any] = json.loads(self.parameters)
        return value

    def as_openai(self) -> dict[str, Any]:
        """The tool as OpenAI (and chat templates) spell it."""
        function: dict[str, Any] = {"name": self.name}
        if self.description:
            function["description"] = self.description
        function["parameters"] = self.schema()
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolRequest:
    """The functions a request offers and how the model may use them.

    `choice`: "none", "auto", "required", or the one function's name that must be called;
    `legacy`: asked with the deprecated `functions` field (one call, written as `function_call`).
    """

    functions: tuple[Function, ...]
    choice: str
    parallel: bool
    legacy: bool = False

    @property
    def calls_allowed(self) -> bool:
        """Whether the answer may hold tool calls at all."""
        return self.choice != "none"

    @property
    def named(self) -> bool:
        """Whether one function is named: the call is the answer asked for, which OpenAI ends with
        finish_reason "stop" (not "tool_calls", its reason for calls the model chose to make)."""
        return self.choice not in ("none", "auto", "required")

    @property
    def calls_only(self) -> bool:
        """Whether the answer is calls and nothing else (required, or a named function)."""
        return self.choice not in ("none", "auto")

    def offered(self) -> tuple[Function, ...]:
        """The functions the answer may call (one when a function is named)."""
        if self.choice in ("none", "auto", "required"):
            return self.functions
        return tuple(f for f in self.functions if f.name == self.choice)


def parse_tool_request(body: Mapping[str, Any]) -> ToolRequest | None:
    """The request's tool fields, or None when it offers no tools (and names no tool choice)."""
    tools, functions = body.get("tools"), body.get("functions")
    if tools is not None and functions is not None:
        raise ToolRequestError("send tools or the legacy functions, not both", param="functions")
    # each spelling's choice goes with its own list: the other's would be ignored without a word
    if functions is not None and body.get("tool_choice") is not None:
        message = "tool_choice goes with tools; with functions, use function_call"
        raise ToolRequestError(message, param="tool_choice")
    if tools is not None and body.get("function_call") is not None:
        message = "function_call goes with functions; with tools, use tool_choice"
        raise ToolRequestError(message, param="function_call")
    if functions is not None:
        tools = _legacy_tools(functions)
        choice_value, choice_param = body.get("function_call"), "function_call"
    else:
        choice_value, choice_param = body.get("tool_choice"), "tool_choice"
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):  # checked with tools or without
        raise ToolRequestError("parallel_tool_calls must be a boolean", param="parallel_tool_calls")
    if tools is None or tools == []:
        if choice_value not in (None, "none"):
            raise ToolRequestError(f"{choice_param} is only allowed when tools are given", param=choice_param)
        return None
    parsed = _functions(tools, legacy=functions is not None)
    if functions is not None:  # the legacy answer has room for one call: `message.function_call`
        return ToolRequest(parsed, _choice(choice_value, choice_param, {f.name for f in parsed}), False, True)
    choice = _choice(choice_value, choice_param, {f.name for f in parsed})
    return ToolRequest(parsed, choice, True if parallel is None else parallel)


def _functions(tools: Any, legacy: bool = False) -> tuple[Function, ...]:
    """The functions of `tools`; a refusal names the field as the client spelled it (`legacy`:
    `functions[i].name`, its list wrapped as tools by `_legacy_tools`)."""
    field = "functions" if legacy else "tools"
    if not isinstance(tools, list):
        raise ToolRequestError(f"{field} must be an array", param=field)
    if len(tools) > MAX_TOOLS:
        raise ToolRequestError(f"at most {MAX_TOOLS} {field} may be given, got {len(tools)}", param=field)
    out: list[Function] = []
    seen: set[str] = set()
    size = 0
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, Mapping) or tool.get("type") != "function":
            raise ToolRequestError(f'{where}.type must be "function"', param=f"{where}.type")
        function = tool.get("function")
        at = function_param(i, legacy)
        if not isinstance(function, Mapping):
            raise ToolRequestError(f"{at} must be an object", param=at)
        name = function.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise ToolRequestError(f"{at}.name must be 1-64 letters, digits, _ or -", param=f"{at}.name")
        if name in seen:
            raise ToolRequestError(f"two {field} are named {name!r}", param=f"{at}.name")
        seen.add(name)
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            raise ToolRequestError(f"{at}.description must be a string", param=f"{at}.description")
        # strict or not, the arguments are held to the schema; a strict that is no boolean is a
        # mistake, as in response_format.json_schema.strict
        if function.get("strict") is not None and not isinstance(function.get("strict"), bool):
            raise ToolRequestError(f"{at}.strict must be a boolean", param=f"{at}.strict")
        parameters = _parameters(function.get("parameters"), f"{at}.parameters")
        size += len(parameters)
        if size > MAX_SCHEMA_BYTES:
            raise ToolRequestError(f"the {field}' parameters exceed {MAX_SCHEMA_BYTES} bytes", param=field)
        out.append(Function(name, description, parameters))
    return tuple(out)


def function_param(index: int, legacy: bool) -> str:
    """Where the request spelled its `index`-th function: tools[i].function, or functions[i]."""
    return f"functions[{index}]" if legacy else f"tools[{index}].function"


def _parameters(value: Any, param: str) -> str:
    if value is None:
        return _EMPTY_PARAMETERS
    if not isinstance(value, Mapping):
        raise ToolRequestError(f"{param} must be a JSON schema object", param=param)
    if value.get("type", "object") != "object":
        raise ToolRequestError(f'{param} must describe an object ("type": "object")', param=param)
    if "x-guidance" in value:
        raise ToolRequestError(
            f"{param}: x-guidance is not accepted (the server sets its options)", param=param
        )
    # arguments are a JSON object whatever else the schema says: a schema without a type (an anyOf,
    # a $ref) gets one, and one that then allows no object is refused when its grammar is built
    if "type" not in value:
        value = {"type": "object", **value}
    try:
        text = json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ToolRequestError(f"{param} is not plain JSON: {exc}", param=param) from None
    except RecursionError:
        raise ToolRequestError(f"{param} is nested too deeply", param=param) from None
    if len(text) > MAX_SCHEMA_BYTES:
        raise ToolRequestError(f"{param} exceeds {MAX_SCHEMA_BYTES} bytes", param=param)
    return text


def _choice(value: Any, param: str, names: set[str]) -> str:
    if value is None:
        return "auto"
    if value in ("none", "auto", "required"):
        return str(value)
    if isinstance(value, Mapping):
        function = value.get("function") if param == "tool_choice" else value
        if param == "tool_choice" and value.get("type") != "function":
            raise ToolRequestError('tool_choice.type must be "function"', param="tool_choice.type")
        name = function.get("name") if isinstance(function, Mapping) else None
        if isinstance(name, str) and name in names:
            return name
        where = "tool_choice.function.name" if param == "tool_choice" else "function_call.name"
        raise ToolRequestError(f"{where} names no tool of this request: {name!r}", param=where)
    raise ToolRequestError(f'{param} must be "none", "auto", "required" or a function to call', param=param)


def _legacy_tools(functions: Any) -> list[Any]:
    """The deprecated `functions` list, as `tools`."""
    if not isinstance(functions, list):
        raise ToolRequestError("functions must be an array", param="functions")
    return [{"type": "function", "function": f} for f in functions]


def checked_tool_calls(value: Any, param: str) -> list[dict[str, Any]]:
    """An assistant turn's `tool_calls` from the history: [{"id", "type", "function": {"name",
    "arguments" (JSON text)}}], at most MAX_TOOLS of them."""
    if not isinstance(value, list) or len(value) > MAX_TOOLS:
        raise ToolRequestError(f"{param} must be an array of at most {MAX_TOOLS} calls", param=param)
    calls = []
    for i, call in enumerate(value):
        where = f"{param}[{i}]"
        function = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(function, Mapping):
            raise ToolRequestError(f"{where}.function must be an object", param=f"{where}.function")
        name, arguments = function.get("name"), function.get("arguments")
        if not isinstance(name, str) or not name:
            raise ToolRequestError(f"{where}.function.name must be a string", param=f"{where}.function.name")
        if not isinstance(arguments, str):
            raise ToolRequestError(
                f"{where}.function.arguments must be a JSON string", param=f"{where}.function.arguments"
            )
        call_id = call.get("id")
        if call_id is not None and not isinstance(call_id, str):
            raise ToolRequestError(f"{where}.id must be a string", param=f"{where}.id")
        calls.append({"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}})
    return calls
