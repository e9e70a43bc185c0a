"""OpenAIServing in-process: bounded SSE events for slow readers, and admissions cut short."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from engine.async_engine import AsyncLLMEngine
from engine.config import EngineConfig
from engine.http.openai_format import MAX_EVENT_TOKENS
from engine.http.protocol import ChatCompletionRequest, CompletionRequest
from engine.http.serving import OpenAIServing
from engine.sampling_params import SamplingParams
from tests.engine.hooked_server import HookedAsyncLLMEngine


async def _ready(model: Path) -> HookedAsyncLLMEngine:
    engine = HookedAsyncLLMEngine(EngineConfig(model=str(model), kv_cache_memory=32 << 20), "tiny")
    engine.start()
    await engine.wait_ready(60)
    return engine


async def _slow_read(events: AsyncIterator[bytes], engine: AsyncLLMEngine) -> list[bytes]:
    """Read the first event, then pause until the engine has finished, then read the rest."""
    first = [await events.__anext__()]
    while engine.num_in_flight:
        await asyncio.sleep(0.05)
    return first + [e async for e in events]


def test_a_slow_reader_of_top_logprobs_gets_bounded_events(tiny_chat_model: Path) -> None:
    async def run() -> None:
        engine = await _ready(tiny_chat_model)
        serving = OpenAIServing(engine, ["tiny"])
        try:
            chat = ChatCompletionRequest.model_validate(
                {
                    "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 100,
                    "ignore_eos": True,
                    "logprobs": True,
                    "top_logprobs": 20,
                    "stream": True,
                }
            )
            events = await serving.chat(chat)
            assert not isinstance(events, dict)
            raw = await _slow_read(events, engine)
            bodies = [json.loads(e.removeprefix(b"data: ")) for e in raw[:-1]]
            assert raw[-1] == b"data: [DONE]\n\n"
            assert max(len(e) for e in raw) < 64 << 10  # before: one event of all 100 tokens (~200 KB)
            entries = [
                len(b["choices"][0]["logprobs"]["content"]) for b in bodies if b["choices"][0]["logprobs"]
            ]
            assert sum(entries) == 100 and max(entries) <= MAX_EVENT_TOKENS
            text = await serving.completions(
                CompletionRequest.model_validate(
                    {"prompt": "hi", "max_tokens": 40, "ignore_eos": True, "logprobs": 20, "stream": True}
                )
            )
            assert not isinstance(text, dict)
            raw = await _slow_read(text, engine)
            bodies = [json.loads(e.removeprefix(b"data: ")) for e in raw[:-1]]
            tokens = [len(b["choices"][0]["logprobs"]["tokens"]) for b in bodies]
            assert sum(tokens) == 40 and max(tokens) <= MAX_EVENT_TOKENS
            assert [b["choices"][0]["finish_reason"] for b in bodies].count("length") == 1
            assert bodies[-1]["choices"][0]["finish_reason"] == "length"
        finally:
            engine.shutdown()

    asyncio.run(run())


def test_a_caller_leaving_while_its_request_is_queued_leaves_the_engine_healthy(
    tiny_chat_model: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async def run() -> None:
        engine = await _ready(tiny_chat_model)
        try:
            engine.stall_for(0.5)  # the add waits in the command queue
            await asyncio.sleep(0.05)
            adding = asyncio.ensure_future(
                engine.add_request("gone", [1, 2, 3], SamplingParams(max_tokens=50))
            )
            await asyncio.sleep(0.2)
            adding.cancel()
            with pytest.raises(asyncio.CancelledError):
                await adding
            await asyncio.sleep(0.6)
            assert engine.health().healthy and engine.num_in_flight == 0
            assert engine.engine is not None and engine.engine.num_unfinished_requests == 0
            outs = [o async for o in engine.generate("next", [1, 2, 3], SamplingParams(max_tokens=3))]
            assert outs[-1].finished
        finally:
            engine.shutdown()

    with caplog.at_level(logging.WARNING):
        asyncio.run(run())
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
