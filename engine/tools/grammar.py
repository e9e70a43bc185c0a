"""The grammar an answer with tool calls is decoded under, from a ToolRequest.

One output format for every model and every tool_choice, so that one parser reads them all:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

The wrapper is literal text in the grammar (so the name is always one of the offered functions and
the keys come in this order); the arguments are held to the function's parameters schema, in
json.dumps' layout. Per
`tool_choice`:
- auto: free text (which can never contain the `<tool_call>` tag: an unconstrained call would slip
  past the schema), then optionally the calls, then the end;
- required: only calls (one or more); a named function: one call to it (as OpenAI and vLLM: a
  forced call is one call, never a loop of them until max_tokens);
- parallel_tool_calls false: at most one call;
- auto beside a JSON `response_format`: the answer in that format, or calls (no text before them).
none is not constrained at all (the answer is text; tags in it are not parsed as calls).
"""

from __future__ import annotations

import dataclasses
import json

from engine.guided.spec import GuidedSpec
from engine.tools.request import Function, ToolRequest, function_param

CALL_BEGIN = "<tool_call>"
CALL_END = "</tool_call>"
# the call's literal text before the arguments and after them
_HEAD = CALL_BEGIN + '\n{{"name": "{name}", "arguments": '
_TAIL = "}\n" + CALL_END


def call_prefix(name: str) -> str:
    """The text of a call up to its arguments."""
    return _HEAD.format(name=name)


def call_text(name: str, arguments: str) -> str:
    """A whole call as the model writes it (history replayed into a prompt uses the same form)."""
    return call_prefix(name) + arguments + _TAIL


def tool_spec(tools: ToolRequest, answer: GuidedSpec | None = None) -> GuidedSpec | None:
    """The constraint for an answer to `tools` (None: tool_choice none, nothing to hold it to);
    `answer`: a JSON format a text answer must take (tool_choice auto, a `response_format` beside the
    tools, as agents send for their final answer)."""
    if not tools.calls_allowed:
        return None
    functions = tools.offered()
    begin = _lark_string(CALL_BEGIN)
    rules = [f"body: {' | '.join(f'body_{i}' for i in range(len(functions)))}"]
    for i, function in enumerate(functions):  # a call after its opening tag
        head = _lark_string(call_prefix(function.name)[len(CALL_BEGIN) :])
        rules.append(f"body_{i}: {head} {_arguments(function)} {_lark_string(_TAIL)}")
    named = tools.choice not in ("auto", "required")
    more = f" (SEP {begin} body)*" if tools.parallel and not named else ""
    if tools.choice == "auto" and answer is not None:  # the answer in its format, or calls
        start = f"start: answer | {begin} body{more}"
        lexemes = [f"answer: %json {answer.inline_json()}"]
    elif tools.choice == "auto":
        # text alone (never holding the tag), or text up to the first tag (lazy: the lexeme ends at
        # the tag's first occurrence, so the call after it is always held to the grammar) and calls
        start = f"start: TEXT? | lead body{more}"
        lexemes = [
            f"lead[lazy]: ANY {begin}",
            "ANY: /(.|\\n)*/",
            # llguidance's regex: & is "and", ~ is "not"
            f"TEXT: /(.|\\n)+/ & ~/(.|\\n)*{_regex_literal(CALL_BEGIN)}(.|\\n)*/",
        ]
    else:
        start = f"start: {begin} body{more}"
        lexemes = []
    lexemes.append("SEP: /\\n{1,2}/")
    grammar = "\n".join(["%llguidance {}", start, *rules, *lexemes]) + "\n"
    parts = tuple(
        GuidedSpec.json_schema(
            f.parameters, param=f"{function_param(i, tools.legacy)}.parameters", any_whitespace=False
        )
        for i, f in enumerate(tools.functions)
        if f in functions
    ) + ((answer,) if answer is not None and tools.choice == "auto" else ())
    return dataclasses.replace(GuidedSpec.grammar(grammar, param="tools"), parts=parts)


def _arguments(function: Function) -> str:
    """The arguments as an inline JSON-schema rule, laid out as json.dumps does ({"a": 1, "b": [2, 3]}):
    no free whitespace, which a small model would otherwise spend its tokens on."""
    layout = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}
    schema = {**function.schema(), "x-guidance": layout}
    return "%json " + json.dumps(schema, separators=(",", ":"), ensure_ascii=False)


def _lark_string(text: str) -> str:
    """A Lark string literal (JSON string escaping is what Lark reads)."""
    return json.dumps(text, ensure_ascii=False)


def _regex_literal(text: str) -> str:
    """`text` matched literally inside a /regex/."""
    return "".join("\\" + c if c in r"\.+*?()|[]{}^$/" else c for c in text)
