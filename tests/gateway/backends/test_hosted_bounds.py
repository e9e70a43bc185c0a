"""The bounds on a hosted provider's answer (gateway/backends/bounded_body.py) for every litellm
provider that takes the gateway's client: a whole answer past 64 MiB and a stream line past 8 MiB
are refused, from a fake provider on loopback that sends them in any provider's path."""

from __future__ import annotations

import asyncio
import http.server
import threading
from collections.abc import Iterator

import httpx
import orjson
import pytest

from gateway.backends.base import MAX_REPLY_BYTES, UpstreamStreamError, UpstreamUnavailableError
from gateway.backends.bounded_body import BOUNDED_PROVIDERS
from gateway.backends.hosted import HostedModel
from gateway.backends.litellm_map import provider_of
from gateway.backends.replica_lines import MAX_LINE_BYTES
from gateway.config.policy import HostedBackend
from tests.engine.server_proc import ManagedServer
from tests.fuzz.stack import hostile_server

MIB = 1 << 20
# a model of each provider the bound covers, as a policy names it (litellm's name)
MODELS = ["openai/fake-model", "text-completion-openai/fake-model", "azure/fake-model",
          "azure_text/fake-model", "anthropic/fake-model", "gemini/fake-model", "mistral/fake-model",
          "groq/fake-model", "deepseek/fake-model", "xai/fake-model", "fireworks_ai/fake-model",
          "openrouter/fake-model", "hosted_vllm/fake-model", "together_ai/fake-model",
          "deepinfra/fake-model", "perplexity/fake-model", "cerebras/fake-model"]  # fmt: skip


GEMINI_ANSWER = {
    "candidates": [{"content": {"parts": [{"text": "hello"}], "role": "model"}, "finishReason": "STOP",
                    "index": 0}],
    "usageMetadata": {"promptTokenCount": 3, "candidatesTokenCount": 1, "totalTokenCount": 4},
}  # fmt: skip


class _Oversized(http.server.BaseHTTPRequestHandler):
    """Any POST: a stream (asked for in the body or the path) of one line past MAX_LINE_BYTES, else
    a whole answer whose Content-Length is past MAX_REPLY_BYTES (its bytes sent until cut off);
    `mode=ok` in the request: GEMINI_ANSWER."""

    protocol_version = "HTTP/1.1"

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("content-length") or 0))
        streamed = b'"stream": true' in body or b'"stream":true' in body or b"stream" in self.path.encode()
        try:
            if b"mode=ok" in body:  # an honest answer, in Gemini's format (the only provider asked so)
                answer = orjson.dumps(GEMINI_ANSWER)
                answer = b"data: " + answer + b"\n\n" if streamed else answer
                self._head("text/event-stream" if streamed else "application/json", len(answer))
                self.wfile.write(answer)
            elif streamed:
                line = b'data: {"x": "' + b"z" * (MAX_LINE_BYTES + MIB) + b'"}\n\n'
                self._head("text/event-stream", len(line))
                self.wfile.write(line)
            else:
                size = MAX_REPLY_BYTES + 6 * MIB
                self._head("application/json", size)
                for _ in range(size // MIB):
                    self.wfile.write(b" " * MIB)
        except (BrokenPipeError, ConnectionResetError):
            pass  # cut off by the bound: what the test wants

    def _head(self, content_type: str, length: int) -> None:
        self.send_response(200)
        self.send_header("content-type", content_type)
        self.send_header("content-length", str(length))
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def oversized() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Oversized)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()


@pytest.fixture(scope="module")
def honest() -> Iterator[ManagedServer]:
    server = hostile_server()
    try:
        yield server
    finally:
        server.stop()


def _spec(model: str, base_url: str) -> HostedBackend:
    azure = provider_of(model) in ("azure", "azure_text")
    return HostedBackend(type="hosted", model=model, api_key_env="SB_TEST_BOUND_KEY",
                         base_url=base_url if azure or model.startswith("gemini") else base_url + "/v1",
                         api_version="2024-06-01" if azure else None)  # fmt: skip


def _body(model: str, content: str) -> tuple[str, bytes]:
    if model.startswith(("text-completion-openai", "azure_text")):
        return "/v1/completions", orjson.dumps({"model": model, "prompt": content, "max_tokens": 5})
    message = {"role": "user", "content": content}
    return "/v1/chat/completions", orjson.dumps({"model": model, "messages": [message], "max_tokens": 5})


async def _call(spec: HostedBackend, content: str, stream: bool) -> tuple[int, int]:
    """(status, bytes of the answer: its body, or its stream's lines) from the hosted backend."""
    model = HostedModel("bounded", spec)
    path, body = _body(spec.model, content)
    try:
        if not stream:
            reply = await model.send(path, body)
            return reply.status, len(reply.body)
        async with model.stream(path, body) as upstream:
            return upstream.status, sum([len(line) async for line in upstream.lines])
    finally:
        await model.close()


def test_every_provider_tested_here_is_one_the_bound_covers() -> None:
    assert {provider_of(model) for model in MODELS} == BOUNDED_PROVIDERS


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("model", MODELS)
def test_an_oversized_answer_is_refused_for_every_provider_that_takes_our_client(
    oversized: str, monkeypatch: pytest.MonkeyPatch, model: str, stream: bool
) -> None:
    # was: mistral, groq, azure, gemini, together_ai ... read a 70 MiB answer (or a 9 MiB line) whole
    monkeypatch.setenv("SB_TEST_BOUND_KEY", "sk-test")
    with pytest.raises((UpstreamUnavailableError, UpstreamStreamError)) as refused:
        asyncio.run(_call(_spec(model, oversized), "hi", stream))
    assert "more than" in str(refused.value) or "longer than" in str(refused.value), refused.value


# litellm 1.83's groq reads `service_tier` from a whole answer, which the fake's lacks (it fails so
# with its own client too): its whole answer is not among these
_HONEST = [(m, stream) for m in MODELS if not m.startswith(("anthropic", "gemini"))
           for stream in (False, True) if stream or not m.startswith("groq")]  # fmt: skip


@pytest.mark.parametrize(
    ("model", "stream"), _HONEST, ids=[f"{m}-{'stream' if s else 'whole'}" for m, s in _HONEST]
)
def test_an_honest_answer_still_comes_through_the_bounded_client(
    honest: ManagedServer, monkeypatch: pytest.MonkeyPatch, model: str, stream: bool
) -> None:
    monkeypatch.setenv("SB_TEST_BOUND_KEY", "sk-test")
    status, size = asyncio.run(_call(_spec(model, honest.base_url), "mode=ok", stream))
    assert status == 200 and 0 < size < 10_000
    sent = httpx.get(f"{honest.base_url}/stats").json()["requests"][-1]["headers"]
    assert sent.get("authorization", sent.get("api-key", "")).endswith("sk-test"), (
        sent
    )  # our key, as litellm sends it


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_an_honest_gemini_answer_still_comes_through_the_bounded_client(
    oversized: str, monkeypatch: pytest.MonkeyPatch, stream: bool
) -> None:
    monkeypatch.setenv("SB_TEST_BOUND_KEY", "sk-test")
    status, size = asyncio.run(_call(_spec("gemini/fake-model", oversized), "mode=ok", stream))
    assert status == 200 and 0 < size < 10_000


def test_azure_with_a_key_and_an_ad_token_in_the_environment_sends_the_key_as_litellm_does(
    honest: ManagedServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # was: AsyncAzureOpenAI got both and refused every request ("mutually exclusive"): a 502
    # where litellm's own client sends the key (its key comes first)
    monkeypatch.setenv("SB_TEST_BOUND_KEY", "sk-test")
    monkeypatch.setenv("AZURE_AD_TOKEN", "ad-token")
    status, _ = asyncio.run(_call(_spec("azure/fake-model", honest.base_url), "mode=ok", False))
    assert status == 200
    sent = httpx.get(f"{honest.base_url}/stats").json()["requests"][-1]["headers"]
    assert sent.get("api-key") == "sk-test" and "authorization" not in sent, sent


def test_openai_without_a_base_url_goes_where_openai_api_base_says_as_litellm_does(
    honest: ManagedServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # was: litellm's own client reads OPENAI_API_BASE, the SDK's only OPENAI_BASE_URL: the request
    # (and the key) went to api.openai.com
    monkeypatch.setenv("SB_TEST_BOUND_KEY", "sk-test")
    monkeypatch.setenv("OPENAI_API_BASE", honest.base_url + "/v1")
    monkeypatch.delenv("OPENAI_BASE_URL", raising=False)
    spec = HostedBackend(type="hosted", model="openai/fake-model", api_key_env="SB_TEST_BOUND_KEY")
    httpx.post(f"{honest.base_url}/reset")
    status, _ = asyncio.run(_call(spec, "mode=ok", False))
    assert status == 200
    sent = httpx.get(f"{honest.base_url}/stats").json()["requests"]
    assert [r["path"] for r in sent] == ["/v1/chat/completions"], sent
