"""Tools and tool history reach the prompt: natively through templates that take tools, else ours."""

from __future__ import annotations

import gc
import time
from typing import Any

from engine.http.messages import chat_messages
from engine.tools.grammar import call_text
from engine.tools.prompt import template_takes_tools, with_tools
from engine.tools.request import parse_tool_request

TOOLS = [
    {"type": "function", "function": {"name": "add", "description": "adds", "parameters": {"type": "object"}}}
]
HISTORY: list[dict[str, Any]] = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "1+2 and 3+4?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'},
            },
            {
                "id": "call_2",
                "type": "function",
                "function": {"name": "add", "arguments": '{"a": 3, "b": 4}'},
            },
        ],
    },
    {"role": "tool", "content": "3", "tool_call_id": "call_1"},
    {"role": "tool", "content": "7", "tool_call_id": "call_2"},
]


class _Template:
    def __init__(self, text: str) -> None:
        self.chat_template = text


def test_a_template_without_tools_gets_our_prompt_calls_in_the_grammars_form_and_joined_results() -> None:
    messages, listed = with_tools(HISTORY, parse_tool_request({"tools": TOOLS}), native=False)
    assert listed is None
    assert messages[0]["role"] == "system" and messages[0]["content"].startswith("Be brief.\n\n")
    assert '{"name": "add", "description": "adds"' in messages[0]["content"]
    assert messages[2] == {
        "role": "assistant",
        "content": call_text("add", '{"a": 1, "b": 2}') + "\n" + call_text("add", '{"a": 3, "b": 4}'),
    }
    assert messages[3] == {
        "role": "user",
        "content": "<tool_response>\n3\n</tool_response>\n<tool_response>\n7\n</tool_response>",
    }
    assert len(messages) == 4


def test_tool_choice_none_offers_nothing_but_the_history_still_renders() -> None:
    messages, listed = with_tools(
        HISTORY, parse_tool_request({"tools": TOOLS, "tool_choice": "none"}), native=False
    )
    assert listed is None and messages[0] == {"role": "system", "content": "Be brief."}
    assert "<tool_call>" in messages[2]["content"]


def test_a_template_that_takes_tools_gets_them_and_the_history_with_arguments_as_objects() -> None:
    assert template_takes_tools(_Template("{% if tools %}...{% endif %}"))
    assert not template_takes_tools(_Template("{{ message['content'] }}"))
    messages, listed = with_tools(HISTORY, parse_tool_request({"tools": TOOLS}), native=True)
    assert listed == [
        {
            "type": "function",
            "function": {"name": "add", "description": "adds", "parameters": {"type": "object"}},
        }
    ]
    assert messages[2]["tool_calls"][1]["function"]["arguments"] == {"a": 3, "b": 4}
    assert messages[4] == {"role": "tool", "content": "7", "tool_call_id": "call_2"}


def test_a_legacy_function_call_history_renders_as_its_tool_call_twin() -> None:
    call = {"name": "add", "arguments": '{"a": 1, "b": 2}'}
    legacy: list[dict[str, Any]] = [
        {"role": "user", "content": "1+2?"},
        {"role": "assistant", "content": None, "function_call": call},
        {"role": "function", "name": "add", "content": "3"},
    ]
    tools: list[dict[str, Any]] = [
        {"role": "user", "content": "1+2?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "add", "type": "function", "function": call}],
        },
        {"role": "tool", "tool_call_id": "add", "content": "3"},
    ]
    assert chat_messages(legacy) == chat_messages(tools)


def test_a_legacy_function_result_without_content_replays_as_an_empty_result() -> None:
    """OpenAI's function message has `content: string | null` (a function that returned nothing):
    the history replays, not a 400 for the whole conversation."""
    messages = chat_messages([{"role": "function", "name": "ping", "content": None}])
    assert messages == [{"role": "tool", "content": "", "tool_call_id": "ping"}]


def test_a_long_run_of_tool_results_renders_in_linear_time() -> None:
    """with_tools runs on the server's event loop: appending each result to the turn so far copied
    that turn per result (quadratic: 20k results, which fit a 2 MB body, held the loop for seconds)."""

    def seconds(n: int) -> float:
        turns = [{"role": "user", "content": "go"}] + [
            {"role": "tool", "tool_call_id": "c", "content": "y" * 40} for _ in range(n)
        ]
        best = float("inf")
        gc.disable()  # a collection inside one timing would pass for a slope (CI once saw 9.5x)
        try:
            for _ in range(5):
                start = time.perf_counter()
                with_tools(turns, None, native=False)
                best = min(best, time.perf_counter() - start)
        finally:
            gc.enable()
        return best

    # 4x the results: 4x the time when linear, 16x when quadratic (far more: the copies outgrow
    # the caches); the margin is for a busy 2-core machine's noise on millisecond timings
    assert seconds(24_000) < 12 * seconds(6_000)
    assert with_tools([{"role": "tool", "content": "1"}, {"role": "tool", "content": "2"}], None, False)[
        0
    ] == [
        {
            "role": "user",
            "content": "<tool_response>\n1\n</tool_response>\n<tool_response>\n2\n</tool_response>",
        }
    ]
