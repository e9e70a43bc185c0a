"""Every error answer of the engine server says `X-Content-Type-Options: nosniff`: the error mapping's
(domain, framework and unexpected errors) and the limits' refusals before any route (in-process)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from engine.async_engine import AsyncLLMEngine
from engine.config import EngineConfig
from engine.http.limits import HTTPLimits
from engine.http.server import create_app

KEY = {"Authorization": "Bearer s3cret"}


@pytest.fixture(scope="module")
def client(tiny_model_factory: Callable[..., Path]) -> Iterator[TestClient]:
    model = tiny_model_factory("llama")
    engine = AsyncLLMEngine(EngineConfig(model=str(model), kv_cache_memory=16 << 20), "tiny")
    app = create_app(engine, ["tiny"], api_key="s3cret", limits=HTTPLimits(max_body_bytes=4096))

    @app.get("/v1/boom")
    async def boom() -> None:
        raise RuntimeError("a bug")

    with TestClient(app, raise_server_exceptions=False) as client:
        deadline = time.monotonic() + 60
        while client.get("/health").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        yield client


# (method, path, headers, body, status)
CASES = {
    "401 no key": ("POST", "/v1/completions", {}, b'{"prompt": "a"}', 401),
    "404 unknown route": ("GET", "/no/such/path", KEY, None, 404),
    "404 unknown model": ("GET", "/v1/models/nope", KEY, None, 404),
    "405 wrong method": ("GET", "/v1/completions", KEY, None, 405),
    "400 invalid body": ("POST", "/v1/completions", KEY, b'{"prompt": 5}', 400),
    "400 not json": ("POST", "/v1/chat/completions", KEY, b"{no", 400),
    "413 body over the limit": ("POST", "/v1/completions", KEY, b" " * 5000, 413),
    "431 headers over the limit": ("GET", "/v1/models", {**KEY, "x-pad": "a" * 40_000}, None, 431),
    "500 unexpected": ("GET", "/v1/boom", KEY, None, 500),
}


@pytest.mark.parametrize("case", list(CASES))
def test_every_error_answer_says_nosniff(client: TestClient, case: str) -> None:
    method, path, headers, body, status = CASES[case]
    r = client.request(method, path, headers={"content-type": "application/json", **headers}, content=body)
    assert r.status_code == status, r.text
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert r.headers.get("x-content-type-options") == "nosniff", r.headers
