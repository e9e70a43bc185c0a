"""A hosted provider's whole answer read at most MAX_REPLY_BYTES, as an engine's is: httpx event
hooks that refuse a longer Content-Length at once and cut a body that runs past it, so a provider
(or a hostile base_url) answering gigabytes is never held in memory; nor does the client follow a
redirect (the prompt would go on to whatever host a 307 names). The bytes counted are the
bytes decoded: the request asks for no compression, and a compressed answer is refused (64 MiB of
gzip can decode to gigabytes).

A stream's body is bounded too: in all, at STREAM_BYTES (the relay bounds the events it re-encodes
at 64 MiB, but the provider's own format is wordier), and line by line at MAX_LINE_BYTES, as an
engine replica's: the SSE reader in litellm's path holds a line until its end comes, so one line
of gigabytes would have been held whole before any bound saw it."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import litellm
import openai
from litellm.llms.azure.azure import AzureChatCompletion
from litellm.llms.custom_httpx.http_handler import AsyncHTTPHandler

from gateway.backends.base import MAX_REPLY_BYTES
from gateway.backends.replica_lines import MAX_LINE_BYTES
from gateway.config.policy import HostedBackend

STREAM_BYTES = 4 * MAX_REPLY_BYTES  # a streamed answer's bytes as the provider sends them

# litellm providers (1.83) whose answers are read through a client of ours that bounds them, by the
# client their branch of litellm's `completion` takes: an OpenAI SDK client (openai's own, and the
# OpenAI-compatible providers it sends through its openai handler), an Azure SDK client, or its own
# handler (base_llm_http_handler's providers, anthropic's and gemini's). Any other provider's
# answers are read by litellm's own client, unbounded (docs/security.md); tests/gateway/backends/
# test_hosted_bounds.py sends each of these an oversized answer.
_OPENAI_CLIENT = frozenset({"openai", "text-completion-openai", "together_ai", "deepinfra", "perplexity",
                            "cerebras"})  # fmt: skip
_AZURE_CLIENT = frozenset({"azure", "azure_text"})
_HANDLER_CLIENT = frozenset({"anthropic", "gemini", "mistral", "groq", "deepseek", "xai", "fireworks_ai",
                             "openrouter", "hosted_vllm"})  # fmt: skip
BOUNDED_PROVIDERS = _OPENAI_CLIENT | _AZURE_CLIENT | _HANDLER_CLIENT


class AnswerTooLargeError(Exception):
    """A provider's answer passed MAX_REPLY_BYTES, or could (compressed): closed, the rest unread."""


class _BoundedBody(httpx.AsyncByteStream):
    """The response body's bytes until `limit` (and, given `line_limit`, while no line is longer);
    past it, the body is closed and the read fails."""

    def __init__(self, body: httpx.AsyncByteStream, limit: int, line_limit: int | None = None) -> None:
        self._body, self._limit, self._line_limit = body, limit, line_limit

    async def __aiter__(self) -> AsyncIterator[bytes]:
        read = line = 0  # bytes in all; bytes since the last line feed
        async for chunk in self._body:
            read += len(chunk)
            if read > self._limit:
                await self._body.aclose()
                raise AnswerTooLargeError(f"the answer is longer than {self._limit} bytes")
            if self._line_limit is not None:
                line = _line_after(chunk, line, self._line_limit)
                if line < 0:
                    await self._body.aclose()
                    raise AnswerTooLargeError(f"a line of the stream is longer than {self._line_limit} bytes")
            yield chunk

    async def aclose(self) -> None:
        await self._body.aclose()


def _line_after(chunk: bytes, line: int, limit: int) -> int:
    """The bytes since the last line feed once `chunk` is read, `line` of them before it; -1 when a
    line passes `limit` (one that began before the chunk, or one wholly inside a chunk that long)."""
    first = chunk.find(b"\n")
    if first == -1:
        line += len(chunk)
        return line if line <= limit else -1
    if line + first > limit or (len(chunk) > limit and max(map(len, chunk.split(b"\n"))) > limit):
        return -1
    return len(chunk) - chunk.rfind(b"\n") - 1


async def uncompressed(request: httpx.Request) -> None:
    """httpx `request` event hook: the answer is asked for as it is, so its bytes are its size."""
    request.headers["accept-encoding"] = "identity"


async def bound_body(response: httpx.Response) -> None:
    """httpx `response` event hook (it runs before the body is read): the body, bounded."""
    await _bounded(response, MAX_REPLY_BYTES, None)


async def bound_stream(response: httpx.Response) -> None:
    """bound_body for a streamed answer: STREAM_BYTES in all, MAX_LINE_BYTES a line."""
    await _bounded(response, STREAM_BYTES, MAX_LINE_BYTES)


async def _bounded(response: httpx.Response, limit: int, line_limit: int | None) -> None:
    length = response.headers.get("content-length", "")
    encoding = response.headers.get("content-encoding", "identity").strip().lower()
    if encoding not in ("", "identity"):
        await response.aclose()
        raise AnswerTooLargeError(f"the answer is compressed ({encoding[:20]}): its size is unbounded")
    if length.isdigit() and int(length) > limit:
        await response.aclose()
        raise AnswerTooLargeError(f"the answer announces {length} bytes, past {limit}")
    stream = response.stream
    assert isinstance(stream, httpx.AsyncByteStream)  # an async client's
    response.stream = _BoundedBody(stream, limit, line_limit)


SDKClient = openai.AsyncOpenAI | openai.AsyncAzureOpenAI


def bounded_client(
    spec: HostedBackend, provider: str | None, api_key: str | None, stream: bool = False
) -> tuple[SDKClient | AsyncHTTPHandler, AsyncHTTPHandler] | None:
    """The `client=` litellm takes for whole answers (or, `stream`, streamed ones) of `spec`'s model
    of `provider` (litellm_map.provider_of), one that reads them bounded (bound_body, bound_stream),
    and the handler that owns its connections (closed with the model: a handler closes its client
    when it is collected). None for a provider outside BOUNDED_PROVIDERS: litellm's own client,
    whose answers are not bounded (docs/security.md)."""
    if provider not in BOUNDED_PROVIDERS:
        return None
    bound = bound_stream if stream else bound_body
    hooks: dict[str, list[Callable[..., Any]]] = {"request": [uncompressed], "response": [bound]}
    handler = AsyncHTTPHandler(event_hooks=hooks)
    # litellm's client follows redirects, and so would the SDKs given it: a provider (or a hostile
    # base_url) answering 307 would have the client's prompt sent on to any host it names. A
    # redirect is an answer like any other non-2xx: the call fails (and fails over)
    handler.client.follow_redirects = False
    if provider in _HANDLER_CLIENT:
        return handler, handler
    # litellm's transport, our hooks; an httpx (not httpx2) client, as litellm gives the SDK
    http: Any = handler.client
    if provider in _AZURE_CLIENT:
        return _azure_client(spec, api_key, http), handler
    # the provider's URL and key as litellm finds them (its default URL; its variable, e.g.
    # TOGETHERAI_API_KEY); OPENAI_API_KEY only for OpenAI's own
    _, _, found_key, base_url = litellm.get_llm_provider(spec.model, api_base=spec.base_url, api_key=api_key)
    if provider in ("openai", "text-completion-openai"):  # litellm reads OPENAI_API_BASE too, the SDK not
        base_url = base_url or os.environ.get("OPENAI_BASE_URL") or os.environ.get("OPENAI_API_BASE")
    fallback = os.environ.get("OPENAI_API_KEY") if provider in ("openai", "text-completion-openai") else None
    key = api_key or found_key or fallback or ""
    return openai.AsyncOpenAI(api_key=key, base_url=base_url, max_retries=0, http_client=http), handler


def _azure_client(spec: HostedBackend, api_key: str | None, http: Any) -> SDKClient:
    """The Azure SDK client litellm would make for `spec` (its key, endpoint, version and Entra ID
    settings, from the policy or its AZURE_* variables), on our `http` client."""
    endpoint = spec.base_url or os.environ.get("AZURE_API_BASE")
    key = api_key or os.environ.get("AZURE_OPENAI_API_KEY") or os.environ.get("AZURE_API_KEY")
    azure = AzureChatCompletion()
    params = azure.initialize_azure_sdk_client(
        # a key comes first, as in litellm's own client (the SDK refuses a key and a token together)
        litellm_params={"azure_ad_token": None if key else os.environ.get("AZURE_AD_TOKEN")},
        api_key=key,
        api_base=endpoint,
        model_name=spec.model,
        api_version=spec.api_version,
        is_async=True,
    )
    params.update(http_client=http, max_retries=0)  # litellm's own http client (unused) replaced
    if azure._is_azure_v1_api_version(params["api_version"]):  # as litellm: the plain OpenAI client
        return openai.AsyncOpenAI(
            api_key=key, base_url=f"{endpoint}/openai/v1/", max_retries=0, http_client=http
        )
    return openai.AsyncAzureOpenAI(**params)
