"""The tool-call grammar lets through exactly the calls a tool_choice allows, with valid arguments."""

from __future__ import annotations

from typing import Any

import pytest

from engine.guided import GuidedCompiler
from engine.guided.spec import GuidedSpec
from engine.tools.grammar import call_text, tool_spec
from engine.tools.request import parse_tool_request

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "add",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    },
]
WEATHER = call_text("get_weather", '{"city": "Paris", "unit": "c"}')
ADD = call_text("add", '{"a": 1, "b": 2}')
NAMED_ADD = {"type": "function", "function": {"name": "add"}}


def accepts(compiler: GuidedCompiler, tokenizer: Any, choice: Any, parallel: bool, text: str) -> bool:
    """Whether the grammar takes `text` token by token and then the end."""
    tools = parse_tool_request({"tools": TOOLS, "tool_choice": choice, "parallel_tool_calls": parallel})
    assert tools is not None
    spec = tool_spec(tools)
    assert spec is not None
    matcher = compiler.compile(spec).matcher()
    ids = tokenizer.encode(text, add_special_tokens=False)
    return all(matcher.accept_token(i) for i in ids) and matcher.accept_token(tokenizer.eos_token_id)


@pytest.mark.parametrize(
    ("choice", "parallel", "text", "allowed"),
    [
        ("auto", True, "It is sunny.", True),
        ("auto", True, "Let me look that up.\n" + WEATHER, True),
        ("auto", True, WEATHER + "\n" + ADD, True),
        ("auto", False, WEATHER + "\n" + ADD, False),  # one call at most
        ("auto", True, WEATHER + "\nAnd some text after.", False),
        ("auto", True, call_text("get_weather", '{"town": "Paris"}'), False),  # city is required
        ("auto", True, call_text("get_weather", '{"city": "Paris", "unit": "k"}'), False),  # not in the enum
        ("auto", True, call_text("delete_everything", "{}"), False),  # no such function
        ("auto", True, '<tool_call>\n{"name": "add"}', False),
        ("required", True, "Just text.", False),
        ("required", True, ADD + "\n\n" + WEATHER, True),
        ("required", False, ADD, True),
        (NAMED_ADD, True, WEATHER, False),
        (NAMED_ADD, True, ADD, True),
        (NAMED_ADD, True, ADD + "\n" + ADD, False),  # a forced call is one call, as OpenAI's and vLLM's
    ],
)
def test_the_grammar_takes_exactly_the_allowed_answers(
    compiler: GuidedCompiler, hf_tokenizer: Any, choice: Any, parallel: bool, text: str, allowed: bool
) -> None:
    assert accepts(compiler, hf_tokenizer, choice, parallel, text) is allowed


def test_tool_choice_none_constrains_nothing() -> None:
    tools = parse_tool_request({"tools": TOOLS, "tool_choice": "none"})
    assert tools is not None and tool_spec(tools) is None


def test_a_legacy_functions_schema_is_named_where_the_client_wrote_it() -> None:
    req = parse_tool_request({"functions": [t["function"] for t in TOOLS]})
    assert req is not None
    spec = tool_spec(req)
    assert spec is not None
    assert [part.param for part in spec.parts] == ["functions[0].parameters", "functions[1].parameters"]


CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


@pytest.mark.parametrize(
    ("answer", "text", "allowed"),
    [
        (GuidedSpec.json_schema(CITY), '{"city": "Paris"}', True),
        (GuidedSpec.json_schema(CITY), WEATHER, True),  # a call instead of the answer
        (GuidedSpec.json_schema(CITY), WEATHER + "\n" + ADD, True),
        (GuidedSpec.json_schema(CITY), '{"town": "Paris"}', False),  # the format's schema holds
        (GuidedSpec.json_schema(CITY), "It is sunny.", False),  # no free text
        (GuidedSpec.json_schema(CITY), '{"city": "Paris"}\n' + WEATHER, False),  # the answer, or calls
        (GuidedSpec.json_object(), '{"anything": [1, 2]}', True),
        (GuidedSpec.json_object(), "[1, 2]", False),
    ],
)
def test_auto_beside_a_json_format_takes_the_answer_in_it_or_calls(
    compiler: GuidedCompiler, hf_tokenizer: Any, answer: GuidedSpec, text: str, allowed: bool
) -> None:
    """tools with a response_format (agents' typed final answer): each answer is one or the other."""
    tools = parse_tool_request({"tools": TOOLS, "tool_choice": "auto"})
    assert tools is not None
    spec = tool_spec(tools, answer)
    assert spec is not None
    matcher = compiler.compile(spec).matcher()
    ids = hf_tokenizer.encode(text, add_special_tokens=False)
    ok = all(matcher.accept_token(i) for i in ids) and matcher.accept_token(hf_tokenizer.eos_token_id)
    assert ok is allowed
