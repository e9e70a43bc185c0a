"""Tool calling through the engine server and the official `openai` client.

On the default model (SmolLM2-135M-Instruct, whose ChatML template takes no tools: our tool prompt),
against the engine server and through the gateway, a round trip per tool_choice, whole and
streamed: call -> tool result -> final answer (one call at a time: greedy, a 135M model given the
chance goes on calling until max_tokens). On a tiny random model with the same tokenizer, what many
seeds show: arguments that always fit the schema, parallel calls (whole and streamed alike), never
more than one call when parallel calls are off; the 400s.
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
from tests.gateway.processes import gateway_in_front

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


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


NAMED: Any = {"type": "function", "function": {"name": "get_weather"}}
CHOICES: dict[str, Any] = {"required": "required", "named": NAMED, "auto": "auto"}
# Left to choose, a 135M model answers in prose (or writes a call's JSON without its tag); shown
# one earlier round trip and asked for a call, it calls under auto as well
AUTO_QUESTION: list[Any] = [
    {"role": "user", "content": "What is the weather in Rome?"},
    {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Rome", "unit": "celsius"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21, "sky": "sunny"}'},
    {"role": "assistant", "content": "It is 21 degrees and sunny in Rome."},
    {"role": "user", "content": "Now write the <tool_call> for Paris."},
]  # fmt: skip


def _ask(client: openai.OpenAI, stream: bool, **kwargs: Any) -> tuple[str, list[dict[str, Any]], str | None]:
    """(content, calls as {id, name, arguments}, finish_reason), whole or assembled from a stream."""
    if stream:
        return _streamed(client, **kwargs)
    reply = client.chat.completions.create(**kwargs).choices[0]
    calls = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
             for c in reply.message.tool_calls or []]  # fmt: skip
    if calls:
        _checked_calls(reply.message.tool_calls or [])
    return reply.message.content or "", calls, reply.finish_reason


def _round_trip(client: openai.OpenAI, model: str, choice: str, stream: bool) -> dict[str, Any]:
    """call under `choice` -> the tools' results -> the final answer (tool_choice none), one mode."""
    question = AUTO_QUESTION if choice == "auto" else QUESTION
    ask: dict[str, Any] = {"model": model, "tools": TOOLS, "parallel_tool_calls": False, "temperature": 0}
    content, calls, finish = _ask(
        client, stream, messages=question, tool_choice=CHOICES[choice], max_tokens=60, **ask
    )
    assistant: dict[str, Any] = {"role": "assistant", "content": content or None, "tool_calls": [
        {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
        for c in calls]}  # fmt: skip
    results = [{"role": "tool", "tool_call_id": c["id"], "content": '{"temp": 18, "sky": "clear"}'}
               for c in calls]  # fmt: skip
    answer, again, final = _ask(
        client, stream, messages=[*question, assistant, *results], tool_choice="none", max_tokens=40, **ask
    )
    return {"content": content, "calls": calls, "finish": finish,
            "answer": answer, "again": again, "final": final}  # fmt: skip


@pytest.mark.slow
class TestDefaultModel:
    @pytest.fixture(scope="class")
    @classmethod
    def clients(cls, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, openai.OpenAI]]:
        """The engine server's client, and the gateway's (which serves it as "default")."""
        proc = ServerProcess("default", "--max-model-len", "2048", "--no-access-log")
        try:
            root = tmp_path_factory.mktemp("tools")
            with gateway_in_front(proc.base_url, "default", root, alias="default") as (gateway, key):
                yield {
                    "engine": openai.OpenAI(
                        base_url=f"{proc.base_url}/v1", api_key="x", max_retries=0, timeout=300
                    ),
                    "gateway": openai.OpenAI(
                        base_url=f"{gateway.base_url}/v1", api_key=key, max_retries=0, timeout=300
                    ),
                }
        finally:
            assert proc.stop() == 0

    @pytest.fixture(scope="class")
    @classmethod
    def client(cls, clients: dict[str, openai.OpenAI]) -> openai.OpenAI:
        return clients["engine"]

    @pytest.fixture(scope="class")
    @classmethod
    def trips(cls, clients: dict[str, openai.OpenAI]) -> dict[tuple[str, str, bool], dict[str, Any]]:
        """Every round trip at once (the engine batches them): per tool_choice, whole and streamed,
        against the engine server and through the gateway."""
        runs = [(path, choice, stream) for path in clients for choice in CHOICES for stream in (False, True)]

        def trip(run: tuple[str, str, bool]) -> dict[str, Any]:
            path, choice, stream = run
            return _round_trip(clients[path], "default" if path == "gateway" else "", choice, stream)

        with ThreadPoolExecutor(len(runs)) as pool:
            return dict(zip(runs, pool.map(trip, runs), strict=True))

    @pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
    @pytest.mark.parametrize("choice", list(CHOICES))
    @pytest.mark.parametrize("path", ["engine", "gateway"])
    def test_a_round_trip_call_result_answer_for_each_tool_choice(
        self, trips: dict[tuple[str, str, bool], dict[str, Any]], path: str, choice: str, stream: bool
    ) -> None:
        trip = trips[path, choice, stream]
        # a named function's call is the answer asked for: "stop", as OpenAI (and vLLM) end it
        assert trip["finish"] == ("stop" if choice == "named" else "tool_calls")
        assert len(trip["calls"]) == 1 and not trip["content"].strip()
        call = trip["calls"][0]
        assert call["id"].startswith("call_") and (call["name"] == "get_weather" or choice != "named")
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])
        # after the tool's result, under none: a text answer and never a call
        assert trip["answer"].strip() and not trip["again"] and trip["final"] in ("stop", "length")

    @pytest.mark.parametrize("choice", list(CHOICES))
    @pytest.mark.parametrize("path", ["engine", "gateway"])
    def test_streamed_calls_are_the_whole_calls(
        self, trips: dict[tuple[str, str, bool], dict[str, Any]], path: str, choice: str
    ) -> None:
        whole, streamed = trips[path, choice, False], trips[path, choice, True]
        assert [(c["name"], c["arguments"]) for c in streamed["calls"]] == [
            (c["name"], c["arguments"]) for c in whole["calls"]
        ]
        assert streamed["answer"] == whole["answer"]

    @pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
    def test_none_answers_with_text_even_when_tools_are_offered(
        self, client: openai.OpenAI, stream: bool
    ) -> None:
        content, calls, finish = _ask(
            client, stream, model="", messages=QUESTION, tools=TOOLS,
            tool_choice="none", temperature=0, max_tokens=30,
        )  # fmt: skip
        assert content.strip() and not calls and finish in ("stop", "length")


class TestTinyModel:
    @pytest.fixture(scope="class")
    @classmethod
    def client(cls, tiny_chat_model: Path) -> Iterator[openai.OpenAI]:
        proc = ServerProcess(tiny_chat_model, "--no-access-log")
        try:
            yield openai.OpenAI(base_url=f"{proc.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
        finally:
            assert proc.stop() == 0

    @pytest.fixture(scope="class")
    @classmethod
    def seeded(cls, client: openai.OpenAI) -> list[tuple[bool, int, Any]]:
        """(parallel, seed, choice) of seeded required-call answers, all asked at once (one batch)."""
        # after a call the random model ends the answer 9 times in 10: enough seeds to see a second one
        runs = [(True, seed) for seed in range(24)] + [(False, seed) for seed in range(6)]

        def ask(run: tuple[bool, int]) -> tuple[bool, int, Any]:
            reply = client.chat.completions.create(
                model="", messages=QUESTION, tools=SHORT_TOOLS, tool_choice="required",
                parallel_tool_calls=run[0], temperature=1.0, seed=run[1], max_tokens=200,
            )  # fmt: skip
            return (*run, reply.choices[0])

        with ThreadPoolExecutor(len(runs)) as pool:
            return list(pool.map(ask, runs))

    def test_seeded_calls_always_fit_their_schemas_and_come_one_at_a_time_when_asked(
        self, seeded: list[tuple[bool, int, Any]]
    ) -> None:
        counts: dict[bool, list[int]] = {True: [], False: []}
        for parallel, _, reply in seeded:
            if reply.finish_reason == "length":  # a random model may ramble inside a string: no verdict
                continue
            assert reply.finish_reason == "tool_calls" and reply.message.tool_calls
            counts[parallel].append(len(_checked_calls(reply.message.tool_calls)))
        # every answer that ended is one or more calls that fit their schema; more than one only
        # when parallel calls are allowed (the grammar's own tests: tests/engine/tools/test_grammar.py)
        assert max(counts[True]) >= 2
        assert max(counts[False]) == 1

    def test_beside_a_json_response_format_each_answer_is_that_json_or_calls(
        self, client: openai.OpenAI
    ) -> None:
        """tools (auto) and a json_schema response_format together, as agents send them for a typed
        final answer (OpenAI takes both; this was a 400): every answer that ended is a content that
        validates against the format or calls that fit their schemas, whole and streamed alike."""
        answer = {"type": "object", "properties": {"unit": {"enum": ["c", "f"]}}, "required": ["unit"]}
        response_format: Any = {"type": "json_schema", "json_schema": {"name": "unit", "schema": answer}}
        kinds = set()
        for seed in range(8):
            ask: Any = {"model": "", "messages": QUESTION, "tools": SHORT_TOOLS, "tool_choice": "auto",
                        "response_format": response_format, "temperature": 1.0, "seed": seed,
                        "max_tokens": 60}  # fmt: skip
            reply = client.chat.completions.create(**ask).choices[0]
            if reply.finish_reason == "length":
                continue
            if reply.message.tool_calls:
                assert reply.finish_reason == "tool_calls" and not (reply.message.content or "").strip()
                _checked_calls(reply.message.tool_calls)
                kinds.add("calls")
            else:
                assert reply.finish_reason == "stop"
                jsonschema.validate(json.loads(reply.message.content or ""), answer)
                kinds.add("answer")
            content, calls, finish = _streamed(client, **ask)
            assert finish == reply.finish_reason and content == (reply.message.content or "")
            assert [c["arguments"] for c in calls] == [
                c.function.arguments for c in reply.message.tool_calls or []
            ]
        assert kinds  # a random model ended at least one answer

    def test_parallel_calls_are_indexed_with_id_and_name_once_and_stream_as_they_answer_whole(
        self, client: openai.OpenAI, seeded: list[tuple[bool, int, Any]]
    ) -> None:
        seed, reply = next((s, r) for p, s, r in seeded if p and len(r.message.tool_calls or []) >= 2)
        content, calls, finish = _streamed(
            client, model="", messages=QUESTION, tools=SHORT_TOOLS, tool_choice="required",
            parallel_tool_calls=True, temperature=1.0, seed=seed, max_tokens=200,
        )  # fmt: skip
        assert finish == "tool_calls" and not content.strip()
        assert [(c["name"], c["arguments"]) for c in calls] == [
            (c.function.name, c.function.arguments) for c in reply.message.tool_calls
        ]  # _streamed checked the indexes 0, 1, ... and that id and name came once per call
        assert len({c["id"] for c in calls}) == len(calls)
        # the SDK's stream helper gives the message the whole answer gives: content null (was "")
        with client.chat.completions.stream(
            model="", messages=QUESTION, tools=SHORT_TOOLS, tool_choice="required",
            parallel_tool_calls=True, temperature=1.0, seed=seed, max_tokens=200,
        ) as stream:  # fmt: skip
            final = stream.get_final_completion().choices[0].message
        assert final.content is None and reply.message.content is None
        assert [c.function.arguments for c in final.tool_calls or []] == [
            c.function.arguments for c in reply.message.tool_calls
        ]

    def test_an_answer_cut_inside_a_call_reads_the_same_whole_and_streamed(
        self, client: openai.OpenAI
    ) -> None:
        seen: set[str] = set()
        for max_tokens in (4, 8, 12, 16, 20, 24):
            ask: Any = {"model": "", "messages": QUESTION, "tools": SHORT_TOOLS, "tool_choice": "required",
                        "temperature": 1.0, "seed": 5, "max_tokens": max_tokens}  # fmt: skip
            reply = client.chat.completions.create(**ask).choices[0]
            if reply.finish_reason != "length":
                continue
            assert reply.message.content is None  # the markup of a cut call never reaches the content
            whole = [(c.function.name, c.function.arguments) for c in reply.message.tool_calls or []]
            content, calls, finish = _streamed(client, **ask)
            assert (content, [(c["name"], c["arguments"]) for c in calls], finish) == ("", whole, "length")
            seen.add("no call" if not whole else "cut arguments" if not _parses(whole[-1][1]) else "whole")
        assert {"no call", "cut arguments"} <= seen, seen

    def test_legacy_functions_get_a_function_call_answer_whole_and_streamed_and_replay(
        self, client: openai.OpenAI
    ) -> None:
        functions = [t["function"] for t in SHORT_TOOLS]
        ask: Any = {"model": "", "messages": QUESTION, "functions": functions,
                    "function_call": {"name": "set_unit"}, "seed": 3, "max_tokens": 60}  # fmt: skip
        reply = client.chat.completions.create(**ask).choices[0]
        call = reply.message.function_call  # what a client of the legacy API reads, and nothing else
        # the named function's call, asked for: "stop" (OpenAI's for a forced function_call)
        assert reply.finish_reason == "stop" and reply.message.tool_calls is None and call
        jsonschema.validate(json.loads(call.arguments), UNIT)
        name, arguments, finish = "", "", None
        for chunk in client.chat.completions.create(stream=True, **ask):
            delta = chunk.choices[0].delta
            assert not delta.tool_calls
            name += delta.function_call.name or "" if delta.function_call else ""
            arguments += delta.function_call.arguments or "" if delta.function_call else ""
            finish = chunk.choices[0].finish_reason or finish
        assert (name, arguments, finish) == (call.name, call.arguments, "stop")
        history = [*QUESTION, {"role": "assistant", "content": None, "function_call": call.model_dump()},
                   {"role": "function", "name": call.name, "content": '{"unit": "set"}'}]  # fmt: skip
        again = client.chat.completions.create(**{**ask, "messages": history, "function_call": "none"})
        assert again.choices[0].message.content and again.choices[0].message.function_call is None

    def test_a_stop_string_that_cuts_a_call_ends_it_as_stop_not_tool_calls(
        self, client: openai.OpenAI
    ) -> None:
        ask: Any = {"model": "", "messages": QUESTION, "tools": SHORT_TOOLS, "tool_choice": "required",
                    "temperature": 1.0, "seed": 3, "max_tokens": 60}  # fmt: skip
        ask["stop"] = ["celsius", "fahrenheit"]  # the enum values: the stop falls inside the arguments
        reply = client.chat.completions.create(**ask).choices[0]
        assert reply.finish_reason == "stop" and reply.message.tool_calls
        cut = reply.message.tool_calls[-1].function.arguments
        assert not _parses(cut) and cut.startswith('{"unit": ')  # the enum value was the stop
        _, calls, finish = _streamed(client, **ask)
        assert (finish, [c["arguments"] for c in calls]) == (
            "stop",
            [c.function.arguments for c in reply.message.tool_calls],
        )

    def test_streamed_calls_carry_every_tokens_logprobs_as_a_whole_answer_does(
        self, client: openai.OpenAI
    ) -> None:
        ask: Any = {"model": "", "messages": QUESTION, "tools": SHORT_TOOLS, "tool_choice": "required",
                    "temperature": 1.0, "seed": 7, "max_tokens": 60}  # fmt: skip
        ask |= {"logprobs": True, "top_logprobs": 2}
        whole = client.chat.completions.create(**ask)
        entries = whole.choices[0].logprobs.content  # type: ignore[union-attr]
        assert entries is not None and len(entries) == whole.usage.completion_tokens  # type: ignore[union-attr]
        streamed = []
        for chunk in client.chat.completions.create(stream=True, **ask):
            for choice in chunk.choices:
                streamed += choice.logprobs.content if choice.logprobs and choice.logprobs.content else []
        assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in entries]

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
            # a parameters schema no value satisfies: the grammar names the tool, not the whole list
            (
                {
                    "tools": [
                        *TOOLS,
                        {
                            "type": "function",
                            "function": {
                                "name": "impossible",
                                "parameters": {
                                    "type": "object",
                                    "properties": {"n": {"type": "integer", "minimum": 5, "maximum": 1}},
                                    "required": ["n"],
                                },
                            },
                        },
                    ]
                },
                "tools[2].function.parameters",
            ),
            # an integer the grammar engine would round (a 64-bit id in an enum): arguments off the schema
            (
                {
                    "tools": [
                        TOOLS[0],
                        {
                            "type": "function",
                            "function": {
                                "name": "by_id",
                                "parameters": {
                                    "type": "object",
                                    "properties": {"id": {"enum": [12345678901234567891]}},
                                },
                            },
                        },
                    ]
                },
                "tools[1].function.parameters",
            ),
            # beside tools (auto), only a JSON format can hold the answer that is not a call
            ({"tools": TOOLS, "extra_body": {"structured_outputs": {"regex": "a+"}}}, "structured_outputs"),
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
