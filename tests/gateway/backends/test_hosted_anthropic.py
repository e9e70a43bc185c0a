"""A hosted Anthropic model (litellm's `anthropic/` provider) against a fake Messages API on loopback."""

from __future__ import annotations

import asyncio
import http.server
import sys
import threading
from collections.abc import Iterator
from typing import ClassVar

import orjson
import pytest

from gateway.backends.base import UpstreamStreamError, UpstreamUnavailableError
from gateway.backends.fetched_urls import fetches_urls
from gateway.backends.hosted import HostedModel
from gateway.backends.litellm_map import provider_of
from gateway.config.policy import HostedBackend
from gateway.errors import GatewayError
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


class _Fetched(http.server.BaseHTTPRequestHandler):
    """A URL on the gateway's own network: it records every fetch (a PNG's first bytes as answer)."""

    paths: ClassVar[list[str]] = []

    def do_GET(self) -> None:
        _Fetched.paths.append(self.path)
        body = b"\x89PNG\r\n\x1a\n"
        self.send_response(200)
        self.send_header("content-type", "image/png")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_an_image_url_is_never_fetched_from_inside_the_gateway_for_a_provider_that_takes_bytes(
    provider: ManagedServer, monkeypatch: pytest.MonkeyPatch, stream: bool
) -> None:
    # litellm downloads an image_url for Anthropic itself, following redirects: any key could make
    # the gateway read a URL on its own network (SSRF). A URL is refused up front; data: is sent.
    monkeypatch.setenv("SB_TEST_ANTHROPIC_KEY", "sk-ant-test")
    internal = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Fetched)
    threading.Thread(target=internal.serve_forever, daemon=True).start()
    secret = f"http://127.0.0.1:{internal.server_address[1]}/internal-secret.png"
    _Fetched.paths.clear()

    async def call(url: str) -> int:
        spec = HostedBackend(
            type="hosted", model=MODEL, api_key_env="SB_TEST_ANTHROPIC_KEY", base_url=provider.base_url
        )
        model = HostedModel("claude", spec)
        parts = [{"type": "text", "text": "what is it?"}, {"type": "image_url", "image_url": {"url": url}}]
        body = orjson.dumps(
            {"model": MODEL, "messages": [{"role": "user", "content": parts}], "max_tokens": 5}
        )
        try:
            if not stream:
                return (await model.send("/v1/chat/completions", body)).status
            async with model.stream("/v1/chat/completions", body) as upstream:
                return upstream.status
        finally:
            await model.close()

    try:
        for url in (secret, " HTTPS://169.254.169.254/latest/meta-data/"):
            with pytest.raises(GatewayError) as refused:
                asyncio.run(call(url))
            assert refused.value.status == 400 and refused.value.param == "messages[0].content[1]"
            assert refused.value.code == "url_not_supported"
        assert _Fetched.paths == []
        png = (
            "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR4nGNgYGD4DwAB"
            "BAEAwS2OUAAAAABJRU5ErkJggg=="
        )
        assert asyncio.run(call(png)) == 200  # the bytes themselves go to the provider
    finally:
        internal.shutdown()
        internal.server_close()


def test_a_provider_that_fetches_urls_on_its_side_gets_them() -> None:
    assert not fetches_urls(provider_of("openai/gpt-4o-mini")) and not fetches_urls(
        provider_of("azure/my-deployment")
    )
    assert fetches_urls(provider_of("anthropic/claude-3-5-haiku-20241022"))
    assert fetches_urls(provider_of("no-such-provider/x"))
