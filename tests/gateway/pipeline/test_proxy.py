"""The gateway in a subprocess, in front of a fake OpenAI upstream, through the official client."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import sys
import time
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from gateway.governance import tokens
from gateway.governance.costs import map_price
from gateway.store.models import PICO
from tests.engine.server_proc import ManagedServer
from tests.gateway.processes import read_log_rows, start_gateway

MASTER = "sk-master-proxy"


class Stack:
    """A fake upstream, a gateway in front of it, and keys."""

    def __init__(self, root: Path, database_url: str | None = None) -> None:
        self.upstream = ManagedServer(
            lambda port: [sys.executable, "tests/fakes/openai_upstream.py", "--port", str(port)], 60
        )
        policy = root / "policy.yaml"
        policy.write_text(
            f"""
backends:
  fake: {{type: engine, urls: ["{self.upstream.base_url}"], timeouts: {{connect: 1, total: 10}},
         price: {{input_per_mtok: 0.3, output_per_mtok: 1.7}}}}
  down: {{type: engine, urls: ["http://127.0.0.1:9"], timeouts: {{connect: 1, total: 2}}}}
  frontier: {{type: hosted, model: openai/fake-model, api_key_env: FAKE_PROVIDER_KEY,
             base_url: "{self.upstream.base_url}/v1"}}
  nokey: {{type: hosted, model: openai/gpt-4o-mini, api_key_env: SWITCHBOARD_TEST_UNSET_KEY}}
models:
  hosted: {{backend: frontier}}
  hosted-nokey: {{backend: nokey}}
  fast: {{backend: fake, model: fake-model}}
  smart: {{backend: fake}}
  broken: {{backend: down}}
costs: {{reference_model: gpt-4o-mini}}
"""
        )
        self.database_url = database_url or f"sqlite+aiosqlite:///{root / 'gateway.db'}"
        self.env = {
            "GATEWAY_MASTER_KEY": MASTER,
            "GATEWAY_KEY_SECRET": "proxy-secret",
            "GATEWAY_DATABASE_URL": self.database_url,
            "GATEWAY_KEY_CACHE_TTL": "0.2",
            "FAKE_PROVIDER_KEY": "sk-fake-provider",
        }
        self.gateway = start_gateway(policy, self.env)
        self.key = self.create_key(name="all")

    def create_key(self, **body: Any) -> str:
        r = httpx.post(
            f"{self.gateway.base_url}/admin/keys", json=body, headers={"Authorization": f"Bearer {MASTER}"}
        )
        r.raise_for_status()
        return str(r.json()["key"])

    def client(self, key: str | None = None) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.gateway.base_url}/v1", api_key=key or self.key, max_retries=0)

    def log_rows(self) -> list[dict[str, Any]]:
        return read_log_rows(self.database_url)

    def close(self) -> int:
        code = self.gateway.stop()
        self.upstream.stop()
        return code


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = Stack(tmp_path_factory.mktemp("gw"))
    try:
        yield s
    finally:
        s.close()


def test_chat_goes_through_with_usage_and_gateway_headers(stack: Stack) -> None:
    raw = stack.client().chat.completions.with_raw_response.create(
        model="fast", messages=[{"role": "user", "content": "hello there"}]
    )
    resp = raw.parse()
    assert resp.choices[0].message.content == "echo: hello there"
    assert resp.usage is not None and resp.usage.completion_tokens == 3
    assert raw.headers["x-request-id"].startswith("req-")
    assert raw.headers["x-gateway-backend"] == "fake"
    assert 0.0 <= float(raw.headers["x-gateway-overhead-ms"]) < 50.0


def test_streams_pass_through_chunk_by_chunk(stack: Stack) -> None:
    client = stack.client()
    chunks = list(
        client.chat.completions.create(
            model="fast", messages=[{"role": "user", "content": "a b c"}], stream=True
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "echo: a b c"
    assert all(c.usage is None for c in chunks)  # usage was not asked for: not shown
    with_usage = list(
        client.completions.create(
            model="smart", prompt="x y", stream=True, stream_options={"include_usage": True}
        )
    )
    assert with_usage[-1].usage is not None and with_usage[-1].usage.completion_tokens == 3


def test_models_lists_only_what_the_key_may_use(stack: Stack) -> None:
    limited = stack.create_key(name="limited", allowed_models=["fast"])
    assert [m.id for m in stack.client(limited).models.list().data] == ["fast"]
    assert {m.id for m in stack.client().models.list().data} == {
        "fast",
        "smart",
        "broken",
        "hosted",
        "hosted-nokey",
    }
    with pytest.raises(openai.PermissionDeniedError) as info:
        stack.client(limited).chat.completions.create(
            model="smart", messages=[{"role": "user", "content": "x"}]
        )
    assert info.value.code == "model_not_allowed"
    assert stack.client(limited).models.retrieve("fast").id == "fast"
    for hidden in ("smart", "nope", "a/b"):
        with pytest.raises(openai.NotFoundError):
            stack.client(limited).models.retrieve(hidden)
    listed = httpx.get(f"{stack.gateway.base_url}/v1/models", headers={"Authorization": f"Bearer {limited}"})
    refused = httpx.get(f"{stack.gateway.base_url}/v1/models")
    missing = httpx.get(f"{stack.gateway.base_url}/no/such/route")
    for r in (listed, refused, missing):  # every answer of every route carries a request id
        assert r.headers["x-request-id"].startswith("req-"), r.status_code


def test_auth_matrix(stack: Stack) -> None:
    url = f"{stack.gateway.base_url}/v1/chat/completions"
    body = {"model": "fast", "messages": [{"role": "user", "content": "x"}]}
    assert httpx.post(url, json=body).status_code == 401
    assert httpx.post(url, json=body, headers={"Authorization": "Bearer sk-nope"}).status_code == 401
    revoked = stack.create_key(name="revoked")
    key_id = httpx.get(
        f"{stack.gateway.base_url}/admin/keys", headers={"Authorization": f"Bearer {MASTER}"}
    ).json()
    target = next(k["id"] for k in key_id["data"] if k["name"] == "revoked")
    httpx.post(
        f"{stack.gateway.base_url}/admin/keys/{target}/revoke", headers={"Authorization": f"Bearer {MASTER}"}
    )
    r = httpx.post(url, json=body, headers={"Authorization": f"Bearer {revoked}"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"  # as an unknown key
    expired = stack.create_key(name="old", expires_at="2020-01-01T00:00:00Z")
    r = httpx.post(url, json=body, headers={"Authorization": f"Bearer {expired}"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert (
        httpx.get(
            f"{stack.gateway.base_url}/admin/keys", headers={"Authorization": f"Bearer {stack.key}"}
        ).status_code
        == 403
    )


@pytest.mark.parametrize(
    ("content", "status", "code"),
    [
        (b"{not json", 400, "invalid_json"),
        (b"[1]", 400, "invalid_type"),
        (b'{"messages": []}', 400, "missing_required_parameter"),
        (b'{"model": "", "messages": []}', 400, "missing_required_parameter"),
        (b'{"model": 5, "messages": []}', 400, "invalid_type"),  # there, but not a name
        (b'{"model": ["fast"], "messages": []}', 400, "invalid_type"),
        (b'{"model": "nope", "messages": []}', 404, "model_not_found"),
        # the request's shape, checked before any backend is chosen (a hosted one took it for an outage)
        (b'{"model": "fast", "messages": "hi"}', 400, "invalid_type"),
        (b'{"model": "fast", "messages": ["hi"]}', 400, "invalid_type"),
        (b'{"model": "fast", "messages": []}', 400, "invalid_type"),
        (b'{"model": "fast"}', 400, "missing_required_parameter"),
        (
            b'{"model": "fast", "messages": [{"role": "user", "content": "x"}], "stream": "yes"}',
            400,
            "invalid_type",
        ),
        (
            b'{"model": "fast", "messages": [{"role": "user", "content": "x"}], "stream": true, '
            b'"stream_options": [1]}',
            400,
            "invalid_type",
        ),
        (
            b'{"model": "fast", "messages": [{"role": "user", "content": "x"}], "stream": true, '
            b'"stream_options": {"include_usage": "x"}}',
            400,
            "invalid_type",
        ),
        (b'{"model": "' + b"n" * 100_000 + b'", "messages": []}', 404, "model_not_found"),
        (b'{"model": "fast", "pad": "' + b"x" * (9 << 20) + b'"}', 413, "body_too_large"),
    ],
)
def test_bad_requests_are_clear_4xx(stack: Stack, content: bytes, status: int, code: str) -> None:
    r = httpx.post(
        f"{stack.gateway.base_url}/v1/chat/completions",
        content=content,
        headers={"Authorization": f"Bearer {stack.key}", "content-type": "application/json"},
        timeout=30,
    )
    assert r.status_code == status, r.text
    assert r.json()["error"]["code"] == code
    assert len(r.content) < 2_000  # an unknown model's name is not echoed whole


@pytest.mark.parametrize(
    "prompt", [[], [None], [{"a": 1}], [1.5], [1, "a"], [[1], "a"], [[]], [-1], [True], {"text": "x"}]
)
@pytest.mark.parametrize("model", ["fast", "hosted"])
def test_prompts_in_no_openai_shape_are_400s_for_every_backend(stack: Stack, prompt: Any, model: str) -> None:
    """A hosted provider's library took these for an outage (a 502 that failed over)."""
    r = httpx.post(
        f"{stack.gateway.base_url}/v1/completions", json={"model": model, "prompt": prompt},
        headers={"Authorization": f"Bearer {stack.key}"},
    )  # fmt: skip
    assert r.status_code == 400, r.text
    assert (r.json()["error"]["param"], r.json()["error"]["code"]) == ("prompt", "invalid_value")


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("n", 129),
        ("n", 0),
        ("n", 2.0),
        ("n", True),
        ("best_of", 10_000),
        # reservations read only an integer: these went upstream unreserved
        ("max_tokens", -5),
        ("max_tokens", 0),
        ("max_tokens", "12"),
        ("max_tokens", 1e308),
        ("max_tokens", 10**30),
        ("max_completion_tokens", True),
        ("max_completion_tokens", 2.5),
    ],
)
@pytest.mark.parametrize("model", ["fast", "hosted"])
def test_choices_and_output_caps_past_their_bounds_are_400s_before_any_reservation(
    stack: Stack, field: str, value: Any, model: str
) -> None:
    """The budget reserves for at most 128 answers: a provider that took n=10,000 would bill past it;
    an output cap that is not an integer in range went upstream unreserved."""
    body = {"model": model, "messages": [{"role": "user", "content": "x"}], field: value}
    r = httpx.post(f"{stack.gateway.base_url}/v1/chat/completions", json=body,
                   headers={"Authorization": f"Bearer {stack.key}"})  # fmt: skip
    assert r.status_code == 400, r.text
    whole = isinstance(value, int | float) and not isinstance(value, bool) and float(value).is_integer()
    code = "invalid_type" if field.startswith("max_") and not whole else "invalid_value"  # 1e308: a number
    assert (r.json()["error"]["param"], r.json()["error"]["code"]) == (field, code)


@pytest.mark.parametrize("model", ["fast", "hosted"])
def test_a_legacy_completion_that_echoes_may_ask_for_no_output(stack: Stack, model: str) -> None:
    """Scoring a prompt (evaluation harnesses send echo, max_tokens 0 and logprobs) is not refused by
    the gateway's own check; a chat's max_tokens 0 is."""
    headers = {"Authorization": f"Bearer {stack.key}"}
    scored = {"model": model, "prompt": "x", "echo": True, "max_tokens": 0}
    r = httpx.post(f"{stack.gateway.base_url}/v1/completions", json=scored, headers=headers)
    assert not (r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"), r.text
    chat = {"model": model, "messages": [{"role": "user", "content": "x"}], "max_tokens": 0}
    r = httpx.post(f"{stack.gateway.base_url}/v1/chat/completions", json=chat, headers=headers)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text


@pytest.mark.parametrize(
    ("field", "value", "param"),
    [
        ("messages", [{"role": "user", "content": [1, 2]}], "messages[0].content"),
        ("messages", [{"role": "user", "content": 5}], "messages[0].content"),
        ("messages", [{"role": "user", "content": [{"text": "x"}]}], "messages[0].content"),
        (
            "messages",
            [{"role": "user", "content": [{"type": "text", "text": {"a": 1}}]}],
            "messages[0].content",
        ),
        ("messages", [{"role": "user", "content": [{"type": "text"}]}], "messages[0].content"),
        ("tool_choice", 5, "tool_choice"),
        ("response_format", "json", "response_format"),
        ("tools", {"type": "function"}, "tools"),
        ("tools", ["x"], "tools"),
    ],
)
@pytest.mark.parametrize("model", ["fast", "hosted"])
def test_chat_fields_in_no_openai_shape_are_400s_for_every_backend(
    stack: Stack, field: str, value: Any, param: str, model: str
) -> None:
    """A hosted provider's library refused these before sending: its error read as an outage (a 502
    that failed over, `upstream_unavailable`), not the client's mistake."""
    body = {"model": model, "messages": [{"role": "user", "content": "x"}], field: value}
    r = httpx.post(f"{stack.gateway.base_url}/v1/chat/completions", json=body,
                   headers={"Authorization": f"Bearer {stack.key}"})  # fmt: skip
    assert r.status_code == 400, r.text
    assert (r.json()["error"]["param"], r.json()["error"]["code"]) == (param, "invalid_type")


@pytest.mark.parametrize("path", ["chat", "text"])
def test_a_hosted_stream_of_several_choices_ends_each_as_the_whole_answer_does_and_bills_its_usage(
    stack: Stack, path: str
) -> None:
    """litellm's stream wrapper ended at the first choice's finish and made its usage up."""
    client = stack.client()
    ask: Any = {"model": "hosted", "n": 3}
    if path == "chat":
        ask["messages"] = [{"role": "user", "content": "three little words"}]
        whole = client.chat.completions.create(**ask)
        expected = {c.index: (c.message.content, c.finish_reason) for c in whole.choices}
        raw = client.chat.completions.with_raw_response.create(
            **ask, stream=True, stream_options={"include_usage": True}
        )
    else:
        ask["prompt"] = "three little words"
        whole = client.completions.create(**ask)  # type: ignore[assignment]
        expected = {c.index: (c.text, c.finish_reason) for c in whole.choices}  # type: ignore[attr-defined]
        raw = client.completions.with_raw_response.create(
            **ask, stream=True, stream_options={"include_usage": True}
        )  # type: ignore[assignment]
    got: dict[int, list[Any]] = {}
    usage = None
    for chunk in raw.parse():
        usage = chunk.usage or usage
        for c in chunk.choices:
            piece = (c.delta.content if path == "chat" else c.text) or ""  # type: ignore[union-attr]
            entry = got.setdefault(c.index, ["", None])
            entry[0] += piece
            entry[1] = c.finish_reason or entry[1]
    assert {i: tuple(v) for i, v in got.items()} == expected and len(expected) == 3
    assert usage is not None and whole.usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens) == (
        whole.usage.prompt_tokens,
        whole.usage.completion_tokens,
    )
    deadline = time.monotonic() + 5
    while not (rows := [r for r in stack.log_rows() if r["id"] == raw.headers["x-request-id"]]):
        assert time.monotonic() < deadline, "no row for the stream"
        time.sleep(0.05)
    assert (rows[0]["completion_tokens"], rows[0]["cost_estimated"]) == (whole.usage.completion_tokens, False)


def test_a_hosted_whole_answer_carries_no_litellm_fields(stack: Stack) -> None:
    """litellm's provider_specific_fields went to clients, and back upstream with a replayed message."""
    r = httpx.post(
        f"{stack.gateway.base_url}/v1/chat/completions",
        json={"model": "hosted", "messages": [{"role": "user", "content": "plain fields"}]},
        headers={"Authorization": f"Bearer {stack.key}"},
    )
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "echo: plain fields"
    assert b"provider_specific_fields" not in r.content


def test_a_hosted_text_completion_stream_keeps_its_logprobs(stack: Stack) -> None:
    """litellm's stream wrapper dropped a legacy completion's logprobs altogether."""
    ask: Any = {"model": "hosted", "prompt": "words with odds", "logprobs": 1}
    whole = stack.client().completions.create(**ask).choices[0]
    assert whole.logprobs is not None and whole.logprobs.tokens
    tokens: list[str] = []
    for chunk in stack.client().completions.create(**ask, stream=True):
        for c in chunk.choices:
            tokens += c.logprobs.tokens if c.logprobs and c.logprobs.tokens else []
    assert tokens == whole.logprobs.tokens


def test_a_pool_whose_only_replica_is_down_is_503_without_naming_the_replica(stack: Stack) -> None:
    deadline = time.monotonic() + 5  # the first health check marks it down; until then calls fail (502)
    while True:
        with pytest.raises(openai.APIStatusError) as info:
            stack.client().chat.completions.create(model="broken", messages=[{"role": "user", "content": ""}])
        if info.value.status_code == 503 or time.monotonic() > deadline:
            break
        assert info.value.status_code == 502 and info.value.code == "upstream_unavailable"
        time.sleep(0.1)
    assert info.value.status_code == 503 and info.value.code == "model_unavailable"
    assert "127.0.0.1" not in info.value.message and "broken" in info.value.message  # no internal URL


def test_upstream_errors_pass_through_with_their_status(stack: Stack) -> None:
    httpx.post(f"{stack.upstream.base_url}/control", json={"fail_status": 429})
    try:
        with pytest.raises(openai.RateLimitError):
            stack.client().chat.completions.create(model="fast", messages=[{"role": "user", "content": "x"}])
    finally:
        httpx.post(f"{stack.upstream.base_url}/control", json={"fail_status": None})


def test_burst_of_500_requests_logs_500_rows_with_the_upstream_token_totals(
    tmp_path: Path, database_url: str
) -> None:
    stack = Stack(tmp_path, database_url)
    try:

        async def burst() -> None:
            client = openai.AsyncOpenAI(
                base_url=f"{stack.gateway.base_url}/v1", api_key=stack.key, max_retries=0, timeout=120,
                http_client=openai.DefaultAsyncHttpxClient(limits=httpx.Limits(max_connections=64)),
            )  # fmt: skip

            async def one(i: int) -> None:
                words = " ".join(["w"] * (i % 7 + 1))
                if i % 2:
                    await client.chat.completions.create(
                        model="fast", messages=[{"role": "user", "content": words}]
                    )
                else:
                    stream = await client.completions.create(model="smart", prompt=words, stream=True)
                    async for _ in stream:
                        pass

            await asyncio.gather(*(one(i) for i in range(500)))
            await client.close()

        asyncio.run(burst())
        stats = httpx.get(f"{stack.upstream.base_url}/stats").json()
    finally:
        assert stack.close() == 0  # SIGTERM: the log writer flushes before exit
    rows = stack.log_rows()
    assert len(rows) == 500 == stats["requests"]
    assert all(r["status"] == 200 for r in rows)
    assert sum(r["prompt_tokens"] for r in rows) == stats["prompt_tokens"]
    assert sum(r["completion_tokens"] for r in rows) == stats["completion_tokens"]
    assert all(r["overhead_ms"] is not None and r["key_id"] for r in rows)
    picousd = sum(int(r["cost_picousd"]) for r in rows)  # exact integers on both databases
    want = stats["prompt_tokens"] * Decimal("0.3") + stats["completion_tokens"] * Decimal("1.7")
    assert Decimal(picousd) / PICO == want / 1_000_000
    reference = map_price("gpt-4o-mini")
    assert reference is not None
    reference_total = sum(int(r["reference_cost_picousd"]) for r in rows)
    daily = read_log_rows(stack.database_url, "usage_daily")  # the aggregates agree with the raw rows
    assert sum(d["requests"] for d in daily) == 500
    assert sum(d["prompt_tokens"] for d in daily) == stats["prompt_tokens"]
    assert sum(int(d["cost_picousd"]) for d in daily) == picousd
    assert Decimal(reference_total) / PICO == reference.cost(
        stats["prompt_tokens"], stats["completion_tokens"]
    )
    assert stack.key not in json.dumps([dict(r) for r in rows], default=str)


def test_hosted_model_through_litellm_whole_and_streamed(stack: Stack) -> None:
    client = stack.client()
    raw = client.chat.completions.with_raw_response.create(
        model="hosted", messages=[{"role": "user", "content": "over the wire"}]
    )
    resp = raw.parse()
    assert resp.choices[0].message.content == "echo: over the wire"
    assert resp.usage is not None and resp.usage.completion_tokens == 4
    assert raw.headers["x-gateway-backend"] == "frontier"
    chunks = list(
        client.chat.completions.create(
            model="hosted", messages=[{"role": "user", "content": "a b"}], stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "echo: a b"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 3


def test_hosted_model_without_its_key_is_listed_unavailable_and_refused(stack: Stack) -> None:
    listed = httpx.get(
        f"{stack.gateway.base_url}/v1/models", headers={"Authorization": f"Bearer {stack.key}"}
    ).json()
    entry = next(m for m in listed["data"] if m["id"] == "hosted-nokey")
    assert entry["available"] is False and "SWITCHBOARD_TEST_UNSET_KEY" not in entry["unavailable_reason"]
    with pytest.raises(openai.APIStatusError) as info:
        stack.client().chat.completions.create(
            model="hosted-nokey", messages=[{"role": "user", "content": "x"}]
        )
    assert info.value.status_code == 503 and info.value.code == "model_unavailable"
    assert "SWITCHBOARD_TEST_UNSET_KEY" not in info.value.message  # the configuration stays private


def test_hosted_provider_errors_keep_their_status(stack: Stack) -> None:
    httpx.post(f"{stack.upstream.base_url}/control", json={"fail_status": 400})
    try:
        with pytest.raises(openai.BadRequestError):
            stack.client().chat.completions.create(
                model="hosted", messages=[{"role": "user", "content": "x"}]
            )
    finally:
        httpx.post(f"{stack.upstream.base_url}/control", json={"fail_status": None})


def test_client_leaving_a_stream_closes_the_upstream_stream(stack: Stack) -> None:
    httpx.post(f"{stack.upstream.base_url}/control", json={"chunk_delay_ms": 100})
    try:
        before = httpx.get(f"{stack.upstream.base_url}/stats").json()["streams_cut_off"]
        body = {
            "model": "fast",
            "messages": [{"role": "user", "content": " ".join(["w"] * 50)}],
            "stream": True,
        }
        headers = {"Authorization": f"Bearer {stack.key}"}
        with httpx.stream(
            "POST", f"{stack.gateway.base_url}/v1/chat/completions", json=body, headers=headers
        ) as r:
            seen = 0
            for line in r.iter_lines():
                seen += bool(line)
                if seen == 3:
                    break
        deadline = time.monotonic() + 5
        while httpx.get(f"{stack.upstream.base_url}/stats").json()["streams_cut_off"] == before:
            assert time.monotonic() < deadline, "the upstream stream kept running after the client left"
            time.sleep(0.05)
    finally:
        httpx.post(f"{stack.upstream.base_url}/control", json={"chunk_delay_ms": 0})


def test_client_leaving_before_a_whole_answer_cancels_the_upstream_call_and_logs_499(stack: Stack) -> None:
    created = httpx.post(f"{stack.gateway.base_url}/admin/keys", json={"name": "leaves-early"},
                         headers={"Authorization": f"Bearer {MASTER}"}).json()  # fmt: skip
    httpx.post(f"{stack.upstream.base_url}/control", json={"latency_ms": 3000})
    try:
        before = httpx.get(f"{stack.upstream.base_url}/stats").json()["waits_cut_off"]
        with pytest.raises(openai.APITimeoutError):
            stack.client(created["key"]).with_options(timeout=0.5).chat.completions.create(
                model="fast", messages=[{"role": "user", "content": "left early"}]
            )
        deadline = time.monotonic() + 5
        while httpx.get(f"{stack.upstream.base_url}/stats").json()["waits_cut_off"] == before:
            assert time.monotonic() < deadline, "the upstream call kept waiting after the client left"
            time.sleep(0.05)
    finally:
        httpx.post(f"{stack.upstream.base_url}/control", json={"latency_ms": 0})
    deadline = time.monotonic() + 5
    while not (rows := [r for r in stack.log_rows() if r["key_id"] == created["id"]]):
        assert time.monotonic() < deadline, "no log row for the request whose client left"
        time.sleep(0.1)
    (row,) = rows
    assert row["error_type"] == "client_disconnected" and row["requested_model"] == "fast"
    # what it was waiting on (the row used to say no backend and no attempt), billed nothing
    assert (row["backend"], row["attempts"], row["cost_picousd"]) == ("fake", 1, None), row


@pytest.mark.parametrize("status", [401, 403, 404])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("model", ["fast", "hosted"])
def test_an_upstream_refusing_the_gateway_is_a_502_that_names_nothing_of_it(
    stack: Stack, status: int, stream: bool, model: str
) -> None:
    """An engine run with --api-key the policy lacks, or a wrong upstream model name: a client with a
    good key must not read an authentication error, nor the upstream's words (its model names)."""
    httpx.post(f"{stack.upstream.base_url}/control", json={"fail_status": status})
    try:
        r = httpx.post(
            f"{stack.gateway.base_url}/v1/chat/completions",
            json={"model": model, "messages": [{"role": "user", "content": "hi"}], "stream": stream},
            headers={"Authorization": f"Bearer {stack.key}"},
        )
    finally:
        httpx.post(f"{stack.upstream.base_url}/control", json={"fail_status": None})
    assert r.status_code == 502, r.text
    error = r.json()["error"]
    assert error["code"] == "upstream_refused_gateway" and error["type"] == "api_error"
    assert "fake failure" not in r.text and "fake-model" not in r.text
    # configuration: the SDKs' retries cannot help (a hosted 401 was a provider_502 they retried
    # twice, each one more call with a key the provider refuses)
    assert r.headers["x-should-retry"] == "false"
    row = next(row for row in _eventually_logged(stack, r) if row["id"] == r.headers["x-request-id"])
    assert (row["status"], row["error_type"]) == (502, error["code"])


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_providers_refusal_of_the_clients_request_passes_its_message_on(stack: Stack, stream: bool) -> None:
    httpx.post(f"{stack.upstream.base_url}/control", json={"fail_status": 400})
    try:
        r = httpx.post(
            f"{stack.gateway.base_url}/v1/chat/completions",
            json={"model": "hosted", "messages": [{"role": "user", "content": "hi"}], "stream": stream},
            headers={"Authorization": f"Bearer {stack.key}"},
        )
    finally:
        httpx.post(f"{stack.upstream.base_url}/control", json={"fail_status": None})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"] == "fake failure 400"  # the provider's words: what to change
    assert r.json()["error"]["code"] == "provider_400" and "litellm" not in r.text


def test_a_client_that_closes_once_it_has_done_is_logged_200_not_499(stack: Stack) -> None:
    """The official SDKs stop reading at [DONE] and close, maybe before the upstream's body ends."""
    httpx.post(f"{stack.upstream.base_url}/control", json={"linger_after_done_ms": 1500})
    ids = []
    try:
        for i in range(3):
            raw = stack.client().chat.completions.with_raw_response.create(
                model="fast", messages=[{"role": "user", "content": f"read to the end {i}"}], stream=True
            )
            ids.append(raw.headers["x-request-id"])
            stream = raw.parse()
            text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
            assert text == f"echo: read to the end {i}"
            stream.close()
    finally:
        httpx.post(f"{stack.upstream.base_url}/control", json={"linger_after_done_ms": 0})
    deadline = time.monotonic() + 5
    while len(rows := [r for r in stack.log_rows() if r["id"] in ids]) < 3:
        assert time.monotonic() < deadline, "a stream has no log row"
        time.sleep(0.1)
    assert [(r["status"], r["error_type"]) for r in rows] == [(200, None)] * 3


def test_a_stream_settles_its_budget_before_the_client_has_its_end(stack: Stack) -> None:
    """Each stream reserves ~$0.0068 (4000 tokens at $1.7/M) and costs ~$0.00001: a reservation
    still held when the client asks again, holding the last stream open (its upstream lingers
    after [DONE]), refuses the next request."""
    key = stack.create_key(name="tight-sequence", budget_usd=0.01)
    headers = {"Authorization": f"Bearer {key}"}
    httpx.post(f"{stack.upstream.base_url}/control", json={"linger_after_done_ms": 1500})
    try:
        with contextlib.ExitStack() as held:
            for i in range(4):
                body = {"model": "fast", "messages": [{"role": "user", "content": f"in turn {i}"}],
                        "stream": True, "max_tokens": 4000}  # fmt: skip
                client = held.enter_context(httpx.Client(base_url=stack.gateway.base_url, timeout=10))
                r = held.enter_context(client.stream("POST", "/v1/chat/completions", json=body,
                                                     headers=headers))  # fmt: skip
                assert r.status_code == 200, r.read()
                lines = r.iter_lines()
                while next(lines) != "data: [DONE]":  # the end: the next request goes at once
                    pass
    finally:
        httpx.post(f"{stack.upstream.base_url}/control", json={"linger_after_done_ms": 0})


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_completion_paths_refuse_other_methods_with_405(stack: Stack, path: str) -> None:
    r = httpx.get(f"{stack.gateway.base_url}{path}", headers={"Authorization": f"Bearer {stack.key}"})
    assert r.status_code == 405 and r.headers["allow"] == "POST"
    assert r.json()["error"]["code"] == "method_not_allowed"


def test_errors_after_auth_carry_the_request_id(stack: Stack) -> None:
    r = httpx.post(
        f"{stack.gateway.base_url}/v1/chat/completions",
        json={"model": "nope", "messages": []},
        headers={"Authorization": f"Bearer {stack.key}"},
    )
    assert r.status_code == 404 and r.headers["x-request-id"].startswith("req-")
    assert any(row["id"] == r.headers["x-request-id"] for row in _eventually_logged(stack, r))


def _eventually_logged(stack: Stack, r: httpx.Response) -> list[dict[str, Any]]:
    deadline = time.monotonic() + 5
    while True:
        rows = stack.log_rows()
        if any(row["id"] == r.headers["x-request-id"] for row in rows) or time.monotonic() > deadline:
            return rows
        time.sleep(0.1)


def test_answers_without_usage_are_counted_with_a_tokenizer_and_marked_estimated(stack: Stack) -> None:
    httpx.post(f"{stack.upstream.base_url}/control", json={"omit_usage": True})
    try:
        client = stack.client()
        whole = client.chat.completions.with_raw_response.create(
            model="fast", messages=[{"role": "user", "content": "count these words please"}]
        )
        streamed = client.chat.completions.with_raw_response.create(
            model="fast", messages=[{"role": "user", "content": "and these too"}], stream=True
        )
        list(streamed.parse())
    finally:
        httpx.post(f"{stack.upstream.base_url}/control", json={"omit_usage": False})
    ids = {whole.headers["x-request-id"]: "echo: count these words please",
           streamed.headers["x-request-id"]: "echo: and these too"}  # fmt: skip
    deadline = time.monotonic() + 5
    while len(rows := [r for r in stack.log_rows() if r["id"] in ids]) < 2:
        assert time.monotonic() < deadline, "the rows were not written"
        time.sleep(0.1)
    for row in rows:
        assert row["cost_estimated"] in (True, 1) and row["status"] == 200
        assert row["completion_tokens"] == tokens.count(ids[row["id"]], "fast")
        assert int(row["cost_picousd"]) > 0
    whole_row = next(row for row in rows if row["id"] == whole.headers["x-request-id"])
    # the text, and a chat's tokens beside it as OpenAI counts them: 3 per message, 3 for the reply
    assert whole_row["prompt_tokens"] == tokens.count("count these words please", "fast") + 3 + 3
    streamed_row = next(row for row in rows if row["id"] == streamed.headers["x-request-id"])
    assert streamed_row["prompt_tokens"] == 3  # what the (fake) engine's stream said: its own count


def test_a_stream_without_usage_is_billed_the_prompt_count_its_engine_told(stack: Stack) -> None:
    """An engine stream opens with its templated prompt's count (`stream_prompt_tokens`, asked by the
    gateway, stripped from the client's events): a stream ending without usage (the client left, the
    replica broke) is billed that count, not the message's words alone."""
    httpx.post(f"{stack.upstream.base_url}/control", json={"omit_usage": True})
    words = "one two three four five six seven"
    body = {"model": "fast", "messages": [{"role": "user", "content": words}], "stream": True,
            "stream_prompt_tokens": False}  # fmt: skip
    try:
        with httpx.stream("POST", f"{stack.gateway.base_url}/v1/chat/completions", json=body,
                          headers={"Authorization": f"Bearer {stack.key}"}, timeout=30) as r:  # fmt: skip
            lines = [line for line in r.iter_lines() if line]
    finally:
        httpx.post(f"{stack.upstream.base_url}/control", json={"omit_usage": False})
    assert r.status_code == 200 and lines[-1] == "data: [DONE]"
    assert all(line.startswith("data: ") for line in lines)  # the engine's count is the gateway's alone
    row = next(row for row in _eventually_logged(stack, r) if row["id"] == r.headers["x-request-id"])
    assert row["cost_estimated"] in (True, 1)
    assert row["prompt_tokens"] == 7  # the fake engine's count; the estimate would say 7 + 3 + 3


def test_a_streams_answer_ends_with_its_done_not_when_the_upstreams_body_does(stack: Stack) -> None:
    """The end of the chunked answer goes out with [DONE], in the same write, and the connection
    takes the next request at once. It used to wait for the upstream's own end (drained after
    [DONE] for up to a second), here held 1.5 s."""
    httpx.post(f"{stack.upstream.base_url}/control", json={"linger_after_done_ms": 1500})
    body = {"model": "fast", "messages": [{"role": "user", "content": "end with the end"}], "stream": True}
    headers = {"Authorization": f"Bearer {stack.key}"}
    try:
        with socket.create_connection(("127.0.0.1", stack.gateway.port), timeout=10) as sock:
            for _ in range(2):  # the second on the same connection, as soon as the first has its end
                payload = json.dumps(body).encode()
                head = (
                    "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    f"Authorization: {headers['Authorization']}\r\nContent-Length: {len(payload)}\r\n\r\n"
                )
                sock.sendall(head.encode() + payload)
                got = b""
                while b"data: [DONE]" not in got:
                    part = sock.recv(65536)
                    assert part, got
                    got += part
                done_at = time.monotonic()
                while not got.endswith(b"0\r\n\r\n"):
                    sock.settimeout(max(0.01, done_at + 1.0 - time.monotonic()))
                    part = sock.recv(65536)
                    assert part, got
                    got += part
                assert time.monotonic() - done_at < 0.5
                assert got.startswith(b"HTTP/1.1 200") and b"transfer-encoding: chunked" in got.lower()
    finally:
        httpx.post(f"{stack.upstream.base_url}/control", json={"linger_after_done_ms": 0})


def _exchange_http10(port: int, head: str, payload: bytes) -> bytes:
    """One HTTP/1.0 request; everything the gateway sends until it closes the connection."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(head.encode() + payload)
        got = b""
        while part := sock.recv(65536):
            got += part
    return got


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
def test_an_http_1_0_client_gets_no_chunked_encoding(stack: Stack, stream: bool) -> None:
    """RFC 9112: chunked transfer coding must not be sent to an HTTP/1.0 client (it cannot read
    it). A stream goes as its bytes, ended by the connection's close; a whole answer keeps its
    Content-Length. (uvicorn chunked both, as to an HTTP/1.1 client.)"""
    body = {"model": "fast", "messages": [{"role": "user", "content": "old client"}], "stream": stream}
    payload = json.dumps(body).encode()
    head = (
        "POST /v1/chat/completions HTTP/1.0\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {stack.key}\r\nContent-Length: {len(payload)}\r\n\r\n"
    )
    got = _exchange_http10(stack.gateway.port, head, payload)
    head_bytes, _, answer = got.partition(b"\r\n\r\n")
    headers = head_bytes.lower().split(b"\r\n")
    assert headers[0].startswith(b"http/1.1 200"), got[:200]
    assert not any(h.startswith(b"transfer-encoding") for h in headers), head_bytes
    assert b"connection: close" in headers or not stream
    if stream:
        events = [e for e in answer.split(b"\n\n") if e]
        assert events[-1] == b"data: [DONE]" and all(e.startswith(b"data: ") for e in events), answer[-300:]
        chunks = [json.loads(e[6:]) for e in events[:-1]]
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
        assert text == "echo: old client"
    else:
        (length,) = [int(h.split(b":")[1]) for h in headers if h.startswith(b"content-length")]
        assert len(answer) == length
        assert json.loads(answer)["choices"][0]["message"]["content"] == "echo: old client"


@pytest.mark.parametrize("path", ["chat", "text"])
def test_a_hosted_stream_without_the_providers_usage_is_counted_not_billed_on_litellms_count(
    stack: Stack, path: str
) -> None:
    """litellm's stream wrapper ends a stream the provider sent no usage for with a usage it
    counted from the text: relayed, it reached the client as the provider's and was billed as
    reported. A provider's own usage still is (a text completion's too: its wrapper wraps a chat's)."""
    client = stack.client()
    ask: Any = {"model": "hosted", "stream": True, "stream_options": {"include_usage": True}}
    create: Any = client.chat.completions if path == "chat" else client.completions
    if path == "chat":
        ask["messages"] = [{"role": "user", "content": "one two three"}]
    else:
        ask["prompt"] = "one two three"
    if path == "chat":  # (a text completion's wrapper keeps nothing that tells the two apart)
        httpx.post(f"{stack.upstream.base_url}/control", json={"omit_usage": True})
        try:
            raw = create.with_raw_response.create(**ask)
            chunks = list(raw.parse())
        finally:
            httpx.post(f"{stack.upstream.base_url}/control", json={"omit_usage": False})
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == "echo: one two three"
        assert all(c.usage is None for c in chunks)  # none the provider gave
        row = next(row for row in _eventually_logged(stack, raw) if row["id"] == raw.headers["x-request-id"])
        assert row["cost_estimated"] in (True, 1) and row["completion_tokens"] > 0
    told = create.with_raw_response.create(**ask)
    told_chunks = list(told.parse())
    assert told_chunks[-1].usage is not None and told_chunks[-1].usage.completion_tokens == 4
    row = next(row for row in _eventually_logged(stack, told) if row["id"] == told.headers["x-request-id"])
    assert row["cost_estimated"] in (False, 0) and row["completion_tokens"] == 4
