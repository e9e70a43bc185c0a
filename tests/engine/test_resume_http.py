"""The engine's side of stream resumption over its OpenAI API: `stream_token_ids` reports each
delta's token ids in SSE comment lines just before the data line that completes the delta, and a
request with `resume` goes on after them under the first answer's id, with no role chunk, one
usage chunk with the true totals, and the tool-call reader's state rebuilt."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from engine.async_engine import AsyncLLMEngine
from engine.config import EngineConfig
from engine.http.protocol import APIError, ChatCompletionRequest, CompletionRequest, validation_error
from engine.http.serving import OpenAIServing

CHAT = {
    "messages": [{"role": "user", "content": "Tell me about foxes"}],
    "max_tokens": 30,
    "ignore_eos": True,
}
TEXT = {"prompt": "Once upon a time", "max_tokens": 30, "ignore_eos": True}
STREAM = {"stream": True, "stream_options": {"include_usage": True}, "stream_token_ids": True}


def _serve(model: Path, test: Callable[[OpenAIServing], Awaitable[None]]) -> None:
    async def run() -> None:
        engine = AsyncLLMEngine(EngineConfig(model=str(model), kv_cache_memory=32 << 20), "tiny")
        engine.start()
        try:
            await engine.wait_ready(60)
            await test(OpenAIServing(engine, ["tiny"]))
        finally:
            engine.shutdown()

    asyncio.run(run())


async def _events(serving: OpenAIServing, body: dict[str, Any]) -> list[bytes]:
    if "messages" in body:
        events = await serving.chat(ChatCompletionRequest.model_validate(body))
    else:
        events = await serving.completions(CompletionRequest.model_validate(body))
    assert not isinstance(events, dict)
    assert isinstance(events, AsyncIterator)
    return [e async for e in events]


def _text(chunk: dict[str, Any]) -> str:
    choice = chunk["choices"][0]
    return str(choice.get("text") or (choice.get("delta") or {}).get("content") or "")


def _read(events: list[bytes]) -> tuple[list[int], str, list[dict[str, Any]]]:
    """(token ids in order, text, data chunks); checks every id line comes just before a data line."""
    ids: list[int] = []
    text, chunks = "", []
    for i, event in enumerate(events):
        if event.startswith(b": token_ids 0 "):
            assert events[i + 1].startswith(b"data: {"), "ids go just before the data line of their delta"
            ids += [int(t) for t in event[len(b": token_ids 0 ") :].strip().split(b",")]
        elif event != b"data: [DONE]\n\n":
            chunk = json.loads(event.removeprefix(b"data: "))
            chunks.append(chunk)
            if chunk["choices"]:
                text += _text(chunk)
    return ids, text, chunks


@pytest.mark.parametrize("body", [CHAT, TEXT], ids=["chat", "completions"])
@pytest.mark.parametrize(
    "sampling", [{"temperature": 0.0}, {"temperature": 1.0, "seed": 11}], ids=["greedy", "seeded"]
)
def test_a_resumed_stream_goes_on_under_the_same_id_with_the_true_totals(
    tiny_chat_model: Path, body: dict[str, Any], sampling: dict[str, Any]
) -> None:
    async def test(serving: OpenAIServing) -> None:
        request = {**body, **sampling, **STREAM}
        ids, text, chunks = _read(await _events(serving, request))
        assert len(ids) == 30 and text
        usage = chunks[-1]["usage"]
        for cut in (0, 1, 17, 29, 30):
            sent = ids[:cut]
            resume = {"token_ids": sent, "id": chunks[0]["id"], "created": chunks[0]["created"]}
            more_ids, more_text, more = _read(await _events(serving, {**request, "resume": resume}))
            assert sent + more_ids == ids
            had = serving.engine.model_info.tokenizer.decode(sent)  # type: ignore[union-attr]
            assert text.startswith(had) and had + more_text == text, cut
            assert {c["id"] for c in more} == {chunks[0]["id"]} and {c["created"] for c in more} == {
                chunks[0]["created"]
            }
            assert all("role" not in (c["choices"][0].get("delta") or {}) for c in more if c["choices"])
            totals = ("prompt_tokens", "completion_tokens", "total_tokens")  # cached ones: this replica's
            assert [more[-1]["usage"][k] for k in totals] == [usage[k] for k in totals]
            assert sum(1 for c in more if c.get("usage")) == 1

    _serve(tiny_chat_model, test)


def test_without_stream_token_ids_no_id_lines_are_sent(tiny_chat_model: Path) -> None:
    async def test(serving: OpenAIServing) -> None:
        events = await _events(serving, {**CHAT, "stream": True})
        assert not any(e.startswith(b":") for e in events)

    _serve(tiny_chat_model, test)


@pytest.mark.parametrize(
    "body",
    [CHAT, TEXT, {**TEXT, "prompt": ["Once upon a time", "In a land far away"], "n": 2}],
    ids=["chat", "completions", "two-prompts"],
)
def test_stream_prompt_tokens_opens_the_stream_with_the_prompt_count_its_usage_gives(
    tiny_chat_model: Path, body: dict[str, Any]
) -> None:
    """The gateway bills a stream its client left with this count: the templated prompt's."""

    async def test(serving: OpenAIServing) -> None:
        stream = {"stream": True, "stream_options": {"include_usage": True}}
        events = await _events(serving, {**body, **stream, "stream_prompt_tokens": True})
        assert events[0].startswith(b": prompt_tokens ") and events[0].endswith(b"\n\n")
        assert not any(e.startswith(b":") for e in events[1:])
        usage = json.loads(events[-2].removeprefix(b"data: "))["usage"]
        assert int(events[0][len(b": prompt_tokens ") :]) == usage["prompt_tokens"]
        if "messages" in body:  # the template's tokens counted: more than the message's words
            assert usage["prompt_tokens"] > len(body["messages"][0]["content"].split()) + 4
        plain = await _events(serving, {**body, **stream})
        assert not plain[0].startswith(b":")

    _serve(tiny_chat_model, test)


def test_a_resume_that_cannot_be_is_a_400_naming_the_field() -> None:
    for extra, param in (
        ({"resume": {"token_ids": [1]}}, "resume"),  # not a stream
        ({"stream": True, "n": 2, "resume": {"token_ids": [1]}}, "resume"),
        ({"stream": True, "resume": {"token_ids": [1], "id": "x y"}}, "resume.id"),
        ({"stream": True, "resume": {"token_ids": ["a"]}}, "resume.token_ids[0]"),
        ({"stream": True, "resume": {"token_ids": [1], "other": 1}}, "resume.other"),
    ):
        with pytest.raises(Exception) as err:
            ChatCompletionRequest.model_validate({**CHAT, **extra})
        error = err.value if isinstance(err.value, APIError) else validation_error(err.value)  # type: ignore[arg-type]
        assert error.status == 400 and error.param == param, extra


def _client_view(events: list[bytes]) -> tuple[str, list[dict[str, Any]]]:
    """What a client assembles from chat chunks: the content and each tool call (name, arguments)."""
    content = ""
    calls: list[dict[str, str]] = []
    for event in events:
        if not event.startswith(b"data: {"):
            continue
        chunk = json.loads(event.removeprefix(b"data: "))
        for choice in chunk["choices"]:
            delta = choice.get("delta") or {}
            content += delta.get("content") or ""
            for piece in delta.get("tool_calls") or []:
                if piece["index"] == len(calls):
                    calls.append({"name": "", "arguments": ""})
                function = piece.get("function") or {}
                calls[piece["index"]]["name"] += function.get("name") or ""
                calls[piece["index"]]["arguments"] += function.get("arguments") or ""
    return content, calls


def test_a_tool_call_stream_goes_on_under_the_same_grammar_and_reader_state(tiny_chat_model: Path) -> None:
    tool = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}},
        },
    }
    request = {**CHAT, "max_tokens": 60, "tools": [tool], "tool_choice": "required", "seed": 5, **STREAM}
    request["temperature"] = 1.0
    request.pop("ignore_eos")

    async def test(serving: OpenAIServing) -> None:
        events = await _events(serving, request)
        ids, _, chunks = _read(events)
        whole = _client_view(events)
        assert whole[1] and whole[1][0]["name"] == "get_weather"
        marks = [i for i, e in enumerate(events) if e.startswith(b": token_ids")]
        for m in (marks[1], marks[len(marks) // 2], marks[-1]):  # cut after the data line of a mark
            sent = events[: m + 2]
            had = [int(t) for e in sent if e.startswith(b": token_ids") for t in e[14:].strip().split(b",")]
            resume = {"token_ids": had, "id": chunks[0]["id"]}
            more = await _events(serving, {**request, "resume": resume})
            assert _client_view(sent + more) == whole, m
            assert had + _read(more)[0] == ids

    _serve(tiny_chat_model, test)
