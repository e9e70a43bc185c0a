"""Capability-aware routing through the gateway (in this process) in front of two fake engines:
`plain` (declared without tools, a short context) and `tooled` (learned from its /v1/models card).
A request is never sent to a model that cannot serve it; the skip shows in x-gateway-failover and
in the request log; with no capable model the answer is a 400 naming what is missing."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.engine.server_proc import ManagedServer
from tests.gateway.processes import InProcessGateway, read_log_rows

MASTER = "sk-master-capabilities"
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]


class Stack:
    """Two fake engines and the gateway in front of them."""

    def __init__(self, root: Path) -> None:
        self.plain, self.tooled = (
            ManagedServer(lambda p: [sys.executable, "tests/fakes/openai_upstream.py", "--port", str(p)], 60)
            for _ in range(2)
        )
        card = {"max_model_len": 100_000, "capabilities": {"tools": True}}
        httpx.post(f"{self.tooled.base_url}/control", json={"card": card}).raise_for_status()
        policy = root / "policy.yaml"
        policy.write_text(f"""
backends:
  plain: {{type: engine, urls: ["{self.plain.base_url}"]}}
  tooled: {{type: engine, urls: ["{self.tooled.base_url}"]}}
  gone: {{type: engine, urls: ["http://127.0.0.1:9"]}}
models:
  small: {{backend: plain, model: fake-model, capabilities: {{tools: false}}, context_length: 200}}
  big: {{backend: tooled, model: fake-model}}
  only-small: {{backend: plain, model: fake-model, capabilities: {{tools: false}}}}
  gone-model: {{backend: gone}}
  short: {{backend: plain, model: fake-model, context_length: 200, fallbacks: [gone-model]}}
routes:
  auto:
    tiers:
      - {{name: simple, threshold: 0, candidates: [small]}}
      - {{name: complex, threshold: 0.99, candidates: [big]}}
    fallbacks: [small]
""")  # fmt: skip
        self.database_url = f"sqlite+aiosqlite:///{root / 'gateway.db'}"
        self.gateway = InProcessGateway(root, policy, MASTER)
        self.key = self.gateway.create_key(name="caps")
        self.client = openai.OpenAI(base_url=f"{self.gateway.base_url}/v1", api_key=self.key, max_retries=0)
        deadline = time.monotonic() + 10  # the first health round learns `tooled`'s card
        while self.model("big")["sources"]["tools"] != "learned":
            assert time.monotonic() < deadline, "the gateway never learned the engine's card"
            time.sleep(0.05)

    def model(self, name: str) -> dict[str, Any]:
        """The model's capabilities at GET /admin/policy."""
        r = httpx.get(f"{self.gateway.base_url}/admin/policy", headers={"Authorization": f"Bearer {MASTER}"})
        r.raise_for_status()
        return dict(r.json()["models"][name])

    @staticmethod
    def requests(server: ManagedServer) -> int:
        return int(httpx.get(f"{server.base_url}/stats").json()["requests"])

    def row(self, request_id: str) -> dict[str, Any]:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            rows = [r for r in read_log_rows(self.database_url) if r["id"] == request_id]
            if rows:
                return rows[0]
            time.sleep(0.1)
        raise AssertionError(f"no log row for {request_id}")

    def close(self) -> None:
        self.gateway.stop()
        self.plain.stop()
        self.tooled.stop()


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = Stack(tmp_path_factory.mktemp("caps"))
    try:
        yield s
    finally:
        s.close()


def _ask(content: str) -> list[Any]:
    return [{"role": "user", "content": content}]


def test_the_admin_view_shows_declared_and_learned_capabilities(stack: Stack) -> None:
    big, small = stack.model("big"), stack.model("small")
    assert big["capabilities"]["tools"] is True and big["context_length"] == 100_000
    assert (big["sources"]["tools"], big["sources"]["context_length"]) == ("learned", "learned")
    assert big["sources"]["vision"] == "unknown" and big["capabilities"]["vision"] is None  # assumed
    assert small["capabilities"]["tools"] is False and small["sources"]["tools"] == "declared"
    assert small["context_length"] == 200 and small["sources"]["context_length"] == "declared"


def test_a_tools_request_to_auto_never_reaches_the_model_declared_without_tools(stack: Stack) -> None:
    before = stack.requests(stack.plain)
    chat = stack.client.chat.completions
    raw = chat.with_raw_response.create(model="auto", messages=_ask("what is the weather"), tools=TOOLS)
    assert raw.http_response.status_code == 200 and raw.headers["x-gateway-backend"] == "tooled"
    assert raw.headers["x-gateway-failover"] == "small=lacks_tools"
    assert "tier=complex" in raw.headers["x-gateway-route"]
    streamed = chat.create(model="auto", messages=_ask("and tomorrow"), tools=TOOLS, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == "echo: and tomorrow"
    assert stack.requests(stack.plain) == before  # not one call reached it
    row = stack.row(raw.headers["x-request-id"])
    assert row["failover"] == "small=lacks tools" and row["attempts"] == 1 and row["backend"] == "tooled"
    assert row["route_reason"].endswith("-> tier simple -> tier complex (needs tools)")
    # the same request without tools goes where its score says
    plain = chat.with_raw_response.create(model="auto", messages=_ask("hi"))
    assert plain.headers["x-gateway-backend"] == "plain" and "x-gateway-failover" not in plain.headers


def test_with_no_model_that_has_tools_the_answer_is_a_400_naming_it(stack: Stack) -> None:
    before = stack.requests(stack.plain)
    with pytest.raises(openai.BadRequestError) as info:
        stack.client.chat.completions.create(model="only-small", messages=_ask("call it"), tools=TOOLS)
    error = info.value
    assert error.code == "model_capability_missing" and error.param == "tools"
    assert "which needs tools (for `tools`): only-small: lacks tools" in error.message
    assert error.response.headers["x-gateway-failover"] == "only-small=lacks_tools"
    assert stack.requests(stack.plain) == before
    row = stack.row(error.response.headers["x-request-id"])
    assert (row["status"], row["error_type"], row["attempts"]) == (400, "model_capability_missing", 0)
    assert row["failover"] == "only-small=lacks tools"


def test_no_model_now_names_why_each_was_skipped_the_requests_own_reasons_too(stack: Stack) -> None:
    """The fallback is down (503, it may come back), and the model asked for cannot take the prompt:
    the message says both, not only "unavailable" (the reason was in x-gateway-failover alone)."""
    deadline = time.monotonic() + 10  # until a health check finds `gone` down, it is called (502)
    while True:
        with pytest.raises(openai.APIStatusError) as info:
            stack.client.chat.completions.create(model="short", messages=_ask("word " * 400))
        if info.value.status_code != 502 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    error = info.value
    assert error.status_code == 503 and error.code == "model_unavailable"
    assert "(gone-model: unavailable; short=context_exceeded)" in error.message, error.message


def test_a_prompt_longer_than_a_models_context_skips_it(stack: Stack) -> None:
    before = stack.requests(stack.plain)
    raw = stack.client.chat.completions.with_raw_response.create(
        model="auto",
        messages=_ask("word " * 400),  # ~400 tokens: past small's declared 200
    )
    assert raw.headers["x-gateway-backend"] == "tooled"
    assert raw.headers["x-gateway-failover"] == "small=context_exceeded"
    assert stack.requests(stack.plain) == before
    assert stack.row(raw.headers["x-request-id"])["failover"].startswith("small=prompt too long (")
