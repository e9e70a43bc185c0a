"""A hosted Anthropic model (litellm's `anthropic/` provider) against a fake Messages API on loopback."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Iterator

import orjson
import pytest

from gateway.backends.base import UpstreamStreamError, UpstreamUnavailableError
from gateway.backends.hosted import HostedModel
from gateway.config.policy import HostedBackend
from gateway.pipeline.failover import RETRY_STATUSES
from tests.engine.server_proc import ManagedServer

MODEL = "anthropic/claude-3-5-haiku-20241022"


@pytest.fixture(scope="module")
def provider() -> Iterator[ManagedServer]:
    server = ManagedServer(
        lambda port: [sys.executable, "tests/fakes/anthropic_upstream.py", "--port", str(port)], 60
    )
    try:
        yield server
    finally:
        server.stop()


def _stream_lines(provider: ManagedServer, content: str) -> list[str]:
    """The OpenAI SSE lines the hosted backend makes of the provider's stream."""

    async def read() -> list[str]:
        spec = HostedBackend(
            type="hosted", model=MODEL, api_key_env="SB_TEST_ANTHROPIC_KEY", base_url=provider.base_url
        )
        model = HostedModel("claude", spec)
        body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 20}
        try:
            async with model.stream("/v1/chat/completions", orjson.dumps(body)) as upstream:
                assert upstream.status == 200
                return [line async for line in upstream.lines]
        finally:
            await model.close()

    return asyncio.run(read())


def test_a_whole_anthropic_stream_is_relayed_with_its_finish(
    provider: ManagedServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SB_TEST_ANTHROPIC_KEY", "sk-ant-test")
    lines = _stream_lines(provider, "hi")
    chunks = [orjson.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == "hello world" and lines[-1] == "data: [DONE]"
    assert [c["choices"][0].get("finish_reason") for c in chunks if c["choices"]][-1] == "stop"


def test_an_anthropic_stream_that_breaks_off_is_never_relayed_as_a_whole_answer(
    provider: ManagedServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # litellm's stream wrapper ends a stream that stopped before message_delta with a "stop" of its
    # own: relayed, the cut answer looked whole to the client and was billed as one
    monkeypatch.setenv("SB_TEST_ANTHROPIC_KEY", "sk-ant-test")
    with pytest.raises(UpstreamStreamError, match="broke off"):
        _stream_lines(provider, "mode=cut")


def _refusal(provider: ManagedServer, content: str, stream: bool) -> tuple[int, bytes, int | None]:
    """The status, error body and Retry-After the hosted backend makes of a provider's refusal."""

    async def call() -> tuple[int, bytes, int | None]:
        spec = HostedBackend(
            type="hosted", model=MODEL, api_key_env="SB_TEST_ANTHROPIC_KEY", base_url=provider.base_url
        )
        model = HostedModel("claude", spec)
        body = orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": content}],
                             "max_tokens": 20})  # fmt: skip
        try:
            if not stream:
                reply = await model.send("/v1/chat/completions", body)
                return reply.status, reply.body, reply.retry_after
            async with model.stream("/v1/chat/completions", body) as upstream:
                return upstream.status, upstream.error_body, upstream.retry_after
        finally:
            await model.close()

    return asyncio.run(call())


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_an_anthropic_529_overload_is_a_503_that_fails_over(
    provider: ManagedServer, monkeypatch: pytest.MonkeyPatch, stream: bool
) -> None:
    # litellm reports Anthropic's 529 as a 500: the client saw `provider_500`, a server fault
    monkeypatch.setenv("SB_TEST_ANTHROPIC_KEY", "sk-ant-test")
    status, body, _ = _refusal(provider, "mode=overloaded", stream)
    assert status == 503 and status in RETRY_STATUSES
    error = orjson.loads(body)["error"]
    assert error["code"] == "provider_503" and error["type"] == "api_error"
    assert "Overloaded" not in error["message"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize(("wait", "kept"), [("12", 12), ("86400", 3600), ("date", None), ("none", None)])
def test_an_anthropic_429_keeps_its_retry_after_as_bounded_seconds(
    provider: ManagedServer, monkeypatch: pytest.MonkeyPatch, stream: bool, wait: str, kept: int | None
) -> None:
    monkeypatch.setenv("SB_TEST_ANTHROPIC_KEY", "sk-ant-test")
    status, _, retry_after = _refusal(provider, f"mode=rate_limited:{wait}", stream)
    assert status == 429 and retry_after == kept


def test_an_anthropic_whole_answer_past_64_mib_is_refused_as_unavailable(
    provider: ManagedServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SB_TEST_ANTHROPIC_KEY", "sk-ant-test")
    with pytest.raises(UpstreamUnavailableError, match="more than 67108864 bytes"):
        _refusal(provider, "mode=huge", False)
