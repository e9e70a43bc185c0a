"""Tool fields are checked at the boundary: clear 400s that name the field, OpenAI's defaults."""

from __future__ import annotations

from typing import Any

import pytest

from engine.tools.request import MAX_TOOLS, ToolRequestError, parse_tool_request


def tool(name: str, parameters: Any = None) -> dict[str, Any]:
    function: dict[str, Any] = {"name": name, "description": f"does {name}"}
    if parameters is not None:
        function["parameters"] = parameters
    return {"type": "function", "function": function}


def test_tools_default_to_auto_and_parallel_and_a_function_without_parameters_takes_none() -> None:
    req = parse_tool_request({"tools": [tool("ping"), tool("add", {"type": "object", "properties": {}})]})
    assert req is not None and req.choice == "auto" and req.parallel
    assert [f.name for f in req.offered()] == ["ping", "add"]
    assert req.functions[0].schema() == {"type": "object", "properties": {}, "additionalProperties": False}
    assert req.functions[0].as_openai()["function"]["description"] == "does ping"
    assert parse_tool_request({"messages": []}) is None
    assert parse_tool_request({"tools": [], "tool_choice": "none"}) is None


def test_a_named_choice_offers_only_that_function_and_none_offers_calls_not_at_all() -> None:
    named = {"type": "function", "function": {"name": "add"}}
    req = parse_tool_request({"tools": [tool("ping"), tool("add")], "tool_choice": named})
    assert req is not None and req.choice == "add" and [f.name for f in req.offered()] == ["add"]
    none = parse_tool_request({"tools": [tool("ping")], "tool_choice": "none", "parallel_tool_calls": False})
    assert none is not None and not none.calls_allowed and not none.parallel


def test_legacy_functions_map_onto_tools() -> None:
    req = parse_tool_request({"functions": [{"name": "ping"}], "function_call": {"name": "ping"}})
    assert req is not None and req.choice == "ping"


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"tool_choice": "auto"}, "tool_choice", "only allowed when tools"),
        ({"tools": {"a": 1}}, "tools", "must be an array"),
        ({"tools": [{"type": "retrieval"}]}, "tools[0].type", '"function"'),
        ({"tools": [tool("bad name")]}, "tools[0].function.name", "1-64 letters"),
        ({"tools": [tool("a"), tool("a")]}, "tools[1].function.name", "two tools"),
        ({"tools": [tool("a", {"type": "string"})]}, "tools[0].function.parameters", "object"),
        ({"tools": [tool("a", [1])]}, "tools[0].function.parameters", "JSON schema object"),
        ({"tools": [tool("a")], "tool_choice": "sometimes"}, "tool_choice", '"none", "auto"'),
        (
            {"tools": [tool("a")], "tool_choice": {"type": "function", "function": {"name": "b"}}},
            "tool_choice.function.name",
            "names no tool",
        ),
        ({"tools": [tool("a")], "parallel_tool_calls": "yes"}, "parallel_tool_calls", "boolean"),
        ({"tools": [tool("a")], "functions": [{"name": "a"}]}, "functions", "not both"),
        # a choice in the other spelling would be ignored: refused, naming it
        ({"functions": [{"name": "a"}], "tool_choice": "required"}, "tool_choice", "function_call"),
        ({"functions": [], "tool_choice": "required"}, "tool_choice", "function_call"),
        ({"tools": [tool("a")], "function_call": {"name": "a"}}, "function_call", "tool_choice"),
        # the legacy spelling is named as the client spelled it
        ({"functions": [{"name": "bad name"}]}, "functions[0].name", "1-64 letters"),
        ({"functions": [{"name": "a"}, {"name": "a"}]}, "functions[1].name", "two functions"),
        ({"functions": [{"name": "a", "parameters": [1]}]}, "functions[0].parameters", "JSON schema object"),
        ({"functions": [{"name": "a"}] * (MAX_TOOLS + 1)}, "functions", f"at most {MAX_TOOLS} functions"),
        ({"tools": [tool(f"t{i}") for i in range(MAX_TOOLS + 1)]}, "tools", f"at most {MAX_TOOLS}"),
        # a strict that is not a boolean, as response_format's; parallel_tool_calls with tools or without
        (
            {"tools": [{"type": "function", "function": {"name": "a", "strict": "yes"}}]},
            "tools[0].function.strict",
            "boolean",
        ),
        ({"parallel_tool_calls": "no"}, "parallel_tool_calls", "boolean"),
        ({"tools": [tool("a")], "parallel_tool_calls": 0}, "parallel_tool_calls", "boolean"),
        (
            {"tools": [tool("a", {"type": "object", "x": "y" * 300_000})]},
            "tools[0].function.parameters",
            "exceeds",
        ),
    ],
)
def test_malformed_tool_fields_are_400s_naming_the_field(
    body: dict[str, Any], param: str, words: str
) -> None:
    with pytest.raises(ToolRequestError, match=words) as caught:
        parse_tool_request(body)
    assert (caught.value.status, caught.value.param) == (400, param)


def test_parameters_always_describe_an_object_and_x_guidance_is_refused() -> None:
    either = {"anyOf": [{"type": "string"}, {"type": "integer"}]}
    req = parse_tool_request(
        {"tools": [tool("pick", either), tool("keep", {"properties": {"a": {}}, "type": "object"})]}
    )
    assert req is not None
    assert req.functions[0].schema() == {"type": "object", "anyOf": [{"type": "string"}, {"type": "integer"}]}
    assert list(req.functions[1].schema()) == ["properties", "type"]  # a given type keeps its place
    with pytest.raises(ToolRequestError, match="x-guidance") as refused:
        parse_tool_request(
            {"tools": [tool("a"), tool("b", {"type": "object", "x-guidance": {"lenient": True}})]}
        )
    assert refused.value.param == "tools[1].function.parameters"
