"""The engine's FastAPI app in-process: API-key checks and the loading state."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from starlette.types import Message

from engine.async_engine import AsyncLLMEngine
from engine.config import EngineConfig
from engine.http.server import EventStreamResponse, create_app
from engine.models.config import ModelConfig


@pytest.fixture
def keyed_client(tiny_model_factory: Callable[..., Path]) -> Iterator[TestClient]:
    model = tiny_model_factory("llama")
    engine = AsyncLLMEngine(EngineConfig(model=str(model), kv_cache_memory=16 << 20), "tiny")
    app = create_app(engine, ["tiny"], api_key="s3cret")
    with TestClient(app) as client:
        deadline = time.monotonic() + 60
        while client.get("/health").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        yield client


def test_api_key_guards_v1_routes_but_not_health_or_metrics(keyed_client: TestClient) -> None:
    body = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
        r = keyed_client.post("/v1/completions", json=body, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert keyed_client.get("/v1/models").status_code == 401
    ok = keyed_client.post("/v1/completions", json=body, headers={"Authorization": "Bearer s3cret"})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2
    assert keyed_client.get("/health").status_code == 200
    assert keyed_client.get("/metrics").status_code == 200


def test_health_and_requests_are_503_while_the_model_loads(
    tiny_model_factory: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    import threading

    import engine.async_engine as async_engine

    release = threading.Event()
    real = async_engine.LLMEngine

    def slow_engine(config: EngineConfig) -> object:
        assert release.wait(60)
        return real(config)

    monkeypatch.setattr(async_engine, "LLMEngine", slow_engine)
    model = tiny_model_factory("llama")
    engine = AsyncLLMEngine(EngineConfig(model=str(model), kv_cache_memory=16 << 20), "tiny")
    with TestClient(create_app(engine, ["tiny"])) as client:
        health = client.get("/health")
        assert health.status_code == 503 and health.json()["status"] == "loading"
        r = client.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 1})
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_loading"
        release.set()
        deadline = time.monotonic() + 60
        while client.get("/health").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert client.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 1}).status_code == 200


@pytest.mark.parametrize(
    ("events", "last"),
    [
        ([b"data: {}\n\n", b"data: [DONE]\n\n"], b"data: [DONE]\n\n"),  # the end goes with [DONE]
        ([b"data: {}\n\n"], b""),  # a stream without one (an error event ended it) still ends
    ],
)
def test_a_streams_done_goes_out_with_the_answers_end_in_one_send(events: list[bytes], last: bytes) -> None:
    # was: starlette sent the end after the generator had closed, in a later write than [DONE]
    async def body() -> AsyncIterator[bytes]:
        for event in events:
            yield event

    sent: list[Message] = []

    async def send(message: Message) -> None:
        sent.append(message)

    async def receive() -> Message:
        return {"type": "http.disconnect"}

    response = EventStreamResponse(body(), media_type="text/event-stream")
    asyncio.run(response({"type": "http", "asgi": {"spec_version": "2.4"}}, receive, send))
    bodies = [m for m in sent if m["type"] == "http.response.body"]
    assert [m["more_body"] for m in bodies] == [True] * (len(bodies) - 1) + [False]
    assert bodies[-1]["body"] == last
    assert b"".join(m["body"] for m in bodies) == b"".join(events)


def test_a_prompt_past_the_whole_kv_pool_names_the_field_it_came_in(tiny_chat_model: Path) -> None:
    # was: `param: "prompt"` for a chat, which has no such field (its context-length error said messages)
    cfg = ModelConfig.from_dir(tiny_chat_model)
    per_block = 2 * cfg.num_layers * 16 * cfg.num_kv_heads * cfg.head_dim * 4
    engine = AsyncLLMEngine(EngineConfig(model=str(tiny_chat_model), kv_cache_memory=4 * per_block), "tiny")
    with TestClient(create_app(engine, ["tiny"])) as client:
        deadline = time.monotonic() + 60
        while client.get("/health").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "word " * 100}], "max_tokens": 1}
        text = {"model": "tiny", "prompt": [1] * 65, "max_tokens": 1}
        for body, path, param in (
            (chat, "/v1/chat/completions", "messages"),
            (text, "/v1/completions", "prompt"),
        ):
            r = client.post(path, json=body)
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert (error["code"], error["param"]) == ("kv_cache_capacity_exceeded", param)


def test_models_slash_is_a_404_and_an_unexpected_500_carries_its_request_id(
    tiny_model_factory: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """GET /v1/models/ (an empty name) was a 500; and the 500 Starlette's error middleware sends,
    outside every added middleware, went without x-request-id."""
    model = tiny_model_factory("llama")
    engine = AsyncLLMEngine(EngineConfig(model=str(model), kv_cache_memory=16 << 20), "tiny")
    with TestClient(create_app(engine, ["tiny"]), raise_server_exceptions=False) as client:
        deadline = time.monotonic() + 60
        while client.get("/health").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        empty = client.get("/v1/models/")
        assert empty.status_code == 404 and empty.json()["error"]["code"] == "model_not_found", empty.text
        assert client.get("/v1/models/tiny").json()["id"] == "tiny"

        def broken(self: object) -> None:
            raise RuntimeError("a bug")

        monkeypatch.setattr("engine.http.serving.OpenAIServing.models", broken)
        failed = client.get("/v1/models", headers={"x-request-id": "trace-42"})
        assert failed.status_code == 500 and failed.json()["error"]["code"] == "internal_error"
        assert failed.headers["x-request-id"] == "trace-42" and "a bug" not in failed.text
