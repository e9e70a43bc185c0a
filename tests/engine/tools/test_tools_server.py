"""Tool calling through the engine server and the official `openai` client.

On the default model (SmolLM2-135M-Instruct, whose ChatML template takes no tools: our tool prompt)
a whole round trip per tool_choice, whole and streamed: call -> tool result -> final answer (one
call at a time: greedy, a 135M model given the chance goes on calling until max_tokens). On a
tiny random model with the same tokenizer, what many seeds show: arguments that always fit the
schema, never more than one call when parallel calls are off; the 400s.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest

from tests.engine.server_proc import ServerProcess

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"timezone": {"type": "string", "maxLength": 20}},
    "required": ["timezone"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city",
            "parameters": WEATHER,
        },
    },
    {
        "type": "function",
        "function": {"name": "get_time", "description": "The time in a timezone", "parameters": TIME},
    },
]
UNIT = {
    "type": "object",
    "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["unit"],
    "additionalProperties": False,
}
# calls of a few tokens each, so that a random model ends them well inside max_tokens
SHORT_TOOLS: list[Any] = [{"type": "function", "function": {"name": "set_unit", "parameters": UNIT}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME, "set_unit": UNIT}
QUESTION = [{"role": "user", "content": "What is the weather in Paris right now?"}]


def _checked_calls(calls: list[Any]) -> list[tuple[str, dict[str, Any]]]:
    """(name, arguments) of each call, after checking ids and the arguments against the schema."""
    out = []
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, SCHEMAS[call.function.name])
        out.append((call.function.name, arguments))
    assert len({c.id for c in calls}) == len(calls)
    return out


def _streamed(client: openai.OpenAI, **kwargs: Any) -> tuple[str, list[dict[str, Any]], str | None]:
    """(content, calls as {id, name, arguments}, finish_reason) assembled from a stream's deltas."""
    content, calls, finish = "", [], None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for piece in choice.delta.tool_calls or []:
            if piece.id is not None:  # a call's first piece: id and name, once
                assert piece.index == len(calls) and piece.function and piece.function.name
                calls.append({"id": piece.id, "name": piece.function.name, "arguments": ""})
            else:
                assert piece.function is not None and piece.function.name is None
            calls[piece.index]["arguments"] += piece.function.arguments or ""
        finish = choice.finish_reason or finish
    return content, calls, finish


@pytest.mark.slow
class TestDefaultModel:
    @pytest.fixture(scope="class")
    @classmethod
    def client(cls) -> Iterator[openai.OpenAI]:
        proc = ServerProcess("default", "--max-model-len", "2048", "--no-access-log")
        try:
            yield openai.OpenAI(base_url=f"{proc.base_url}/v1", api_key="unused", max_retries=0, timeout=300)
        finally:
            assert proc.stop() == 0

    @pytest.mark.parametrize(
        "choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
    )
    def test_a_whole_round_trip_call_result_answer(self, client: openai.OpenAI, choice: Any) -> None:
        first = client.chat.completions.create(
            model="",
            messages=QUESTION,
            tools=TOOLS,
            tool_choice=choice,
            parallel_tool_calls=False,
            temperature=0,
            max_tokens=60,
        )
        message = first.choices[0].message
        assert first.choices[0].finish_reason == "tool_calls" and message.tool_calls
        calls = _checked_calls(message.tool_calls)
        assert calls[0][0] == "get_weather" or choice == "required"
        history: list[Any] = [*QUESTION, message.model_dump(exclude_none=True)]
        history += [{"role": "tool", "tool_call_id": c.id, "content": '{"temp": 18, "sky": "clear"}'}
                    for c in message.tool_calls]  # fmt: skip
        final = client.chat.completions.create(
            model="", messages=history, tools=TOOLS, tool_choice="none", temperature=0, max_tokens=40
        )
        answer = final.choices[0]
        assert answer.message.tool_calls is None and answer.message.content
        assert answer.finish_reason in ("stop", "length")

    def test_a_streamed_round_trip_gives_ids_and_names_once_and_arguments_in_pieces(
        self, client: openai.OpenAI
    ) -> None:
        content, calls, finish = _streamed(
            client,
            model="",
            messages=QUESTION,
            tools=TOOLS,
            tool_choice="required",
            parallel_tool_calls=False,
            temperature=0,
            max_tokens=60,
        )
        assert finish == "tool_calls" and calls and not content.strip()
        for call in calls:
            jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])
        whole = client.chat.completions.create(
            model="",
            messages=QUESTION,
            tools=TOOLS,
            tool_choice="required",
            parallel_tool_calls=False,
            temperature=0,
            max_tokens=60,
        )
        assert [c.function.arguments for c in whole.choices[0].message.tool_calls or []] == [
            c["arguments"] for c in calls
        ]  # the same calls, streamed or whole
        history: list[Any] = [*QUESTION, {"role": "assistant", "tool_calls": [
            {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
            for c in calls]}]  # fmt: skip
        history += [{"role": "tool", "tool_call_id": c["id"], "content": "18 C, clear"} for c in calls]
        options: dict[str, Any] = {"parallel_tool_calls": False, "temperature": 0, "max_tokens": 40}
        content, again, finish = _streamed(client, model="", messages=history, tools=TOOLS, **options)
        assert content or again  # auto: an answer, or calls that fit the schema
        for call in again:
            jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])

    def test_auto_answers_with_text_or_valid_calls_and_none_never_calls(self, client: openai.OpenAI) -> None:
        for choice in ("auto", "none"):
            reply = client.chat.completions.create(
                model="", messages=QUESTION, tools=TOOLS, tool_choice=choice, parallel_tool_calls=False,
                temperature=0, max_tokens=40,
            ).choices[0]  # fmt: skip
            if reply.message.tool_calls:
                assert choice == "auto" and reply.finish_reason == "tool_calls"
                _checked_calls(reply.message.tool_calls)
            else:
                assert reply.message.content and reply.finish_reason in ("stop", "length")


class TestTinyModel:
    @pytest.fixture(scope="class")
    @classmethod
    def client(cls, tiny_chat_model: Path) -> Iterator[openai.OpenAI]:
        proc = ServerProcess(tiny_chat_model, "--no-access-log")
        try:
            yield openai.OpenAI(base_url=f"{proc.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
        finally:
            assert proc.stop() == 0

    def _calls(self, client: openai.OpenAI, parallel: bool, seed: int) -> list[tuple[str, dict[str, Any]]]:
        reply = client.chat.completions.create(
            model="", messages=QUESTION, tools=SHORT_TOOLS, tool_choice="required",
            parallel_tool_calls=parallel, temperature=1.0, seed=seed, max_tokens=200,
        ).choices[0]  # fmt: skip
        if reply.finish_reason == "length":  # a random model may ramble inside a string: no verdict
            return []
        assert reply.finish_reason == "tool_calls" and reply.message.tool_calls
        return _checked_calls(reply.message.tool_calls)

    def test_seeded_calls_always_fit_their_schemas_and_come_one_at_a_time_when_asked(
        self, client: openai.OpenAI
    ) -> None:
        runs = [(True, seed) for seed in range(10)] + [(False, seed) for seed in range(6)]
        with ThreadPoolExecutor(len(runs)) as pool:  # at once: the engine decodes them as one batch
            counts = list(pool.map(lambda run: len(self._calls(client, *run)), runs))
        # every answer that ended is one or more calls that fit their schema (that more than one may
        # follow when allowed, and not otherwise, is the grammar's: tests/engine/tools/test_grammar.py)
        assert max(counts[:10]) >= 1
        assert max(counts[10:]) == 1

    def test_bad_tools_and_tools_with_a_response_format_are_400s_naming_the_field(
        self, client: openai.OpenAI
    ) -> None:
        bad: list[tuple[dict[str, Any], str]] = [
            ({"tools": [{"type": "function", "function": {"name": "no spaces"}}]}, "tools[0].function.name"),
            (
                {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
                "tool_choice.function.name",
            ),
            ({"tool_choice": "required"}, "tool_choice"),
            ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "response_format"),
        ]
        for extra, param in bad:
            with pytest.raises(openai.BadRequestError) as caught:
                client.chat.completions.create(model="", messages=QUESTION, max_tokens=5, **extra)
            error = caught.value.body
            assert (
                isinstance(error, dict)
                and error["param"] == param
                and error["type"] == "invalid_request_error"
            )
