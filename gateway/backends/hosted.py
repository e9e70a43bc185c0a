"""Hosted models through litellm: the only module that imports it (it is slow to import: ~3 s)."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any
from urllib.parse import urlsplit

import litellm  # LITELLM_LOCAL_MODEL_COST_MAP keeps its import off the network: gateway/cli/environment.py
import orjson
from litellm.llms.custom_httpx.http_handler import AsyncHTTPHandler

from gateway.backends.base import (
    MAX_REPLY_BYTES,
    Learned,
    ModelUnavailableError,
    UpstreamReply,
    UpstreamStream,
    UpstreamStreamError,
    UpstreamUnavailableError,
)
from gateway.backends.bounded_body import AnswerTooLargeError, bounded_client
from gateway.backends.fetched_urls import fetches_urls, refuse_fetched_urls
from gateway.backends.hosted_shapes import as_stream, openai_chunk, whole_for_stream, without_litellm_fields
from gateway.backends.litellm_map import learned_from_litellm, provider_of
from gateway.backends.provider_errors import causes, connection_failure, header, provider_error, statuses
from gateway.backends.side_loop import SideLoop
from gateway.backends.upstream_errors import (
    GATEWAY_FAULT_STATUSES,
    OVERLOADED_STATUSES,
    masked,
    reduced_fields,
    retry_after_seconds,
)
from gateway.config.policy import HostedBackend, Timeouts

logger = logging.getLogger(__name__)
litellm.suppress_debug_info = True
litellm.telemetry = False

# The OpenAI request fields a client may send to a hosted model: an allow-list, because litellm
# reads its own keyword arguments from the same dict (api_base, base_url, api_key, extra_headers,
# mock_response, fallbacks, model_list, custom_llm_provider, num_retries, metadata, ...): one of
# those in a client's body would send our provider key to the client's URL. `metadata` and `store`
# are OpenAI fields too, but litellm reads `metadata` for itself, so they stay out.
_COMMON_FIELDS = frozenset({
    "model", "frequency_penalty", "logit_bias", "logprobs", "max_tokens", "n", "presence_penalty",
    "seed", "stop", "temperature", "top_p", "user",
})  # fmt: skip
CHAT_FIELDS = _COMMON_FIELDS | frozenset({
    "messages", "audio", "function_call", "functions", "max_completion_tokens", "modalities",
    "parallel_tool_calls", "prediction", "reasoning_effort", "response_format", "service_tier",
    "tool_choice", "tools", "top_logprobs", "web_search_options",
})  # fmt: skip
TEXT_FIELDS = _COMMON_FIELDS | frozenset({"prompt", "best_of", "echo", "suffix"})


class HostedModel:
    """One hosted backend: litellm `acompletion` / `atext_completion`, streamed or whole."""

    def __init__(self, name: str, spec: HostedBackend) -> None:
        self.name = name
        self.spec = spec
        self._api_key = os.environ.get(spec.api_key_env) if spec.api_key_env else None
        # what a provider's error message may echo but a client (or our log) must never read: our
        # key, its address (host and port first, then the host alone)
        where = urlsplit(spec.base_url or "")
        address = (where.netloc, where.netloc.rpartition("@")[2], where.password or "", where.hostname or "")
        self._hidden = (self._api_key or "", *address)  # with its credentials, with its port, alone
        self._side = SideLoop(f"litellm-{name}")  # litellm's per-call Python work runs there
        self._learned: dict[str, Learned] = {}
        # the bounded clients of whole answers and of streams (made on the side loop: False, True),
        # each with the handler that owns its connections (a handler closes its client when it is
        # collected); {} for a provider without one
        self._clients: dict[bool, dict[str, Any]] = {}
        self._handlers: list[AsyncHTTPHandler] = []
        self._provider = provider_of(spec.model)  # litellm's name for it, asked once
        self._fetches_urls = fetches_urls(self._provider)

    @property
    def learned_version(self) -> int:
        """What litellm's bundled map says never changes while the gateway runs."""
        return 0

    def learned(self, model: str) -> Learned | None:
        """What litellm's map says about `model` (a litellm name), read once per name."""
        if model not in self._learned:
            self._learned[model] = learned_from_litellm(model)
        return self._learned[model]

    @property
    def timeouts(self) -> Timeouts:
        """The backend's own timeouts."""
        return self.spec.timeouts

    @property
    def unavailable_reason(self) -> str | None:
        """Why the model cannot be called, or None when it can."""
        if self.spec.api_key_env and not self._api_key:
            return f"set {self.spec.api_key_env} to use {self.spec.model}"
        return None

    async def start(self) -> None:
        """Nothing runs in the background until the first call (which starts the side loop)."""

    def _check_not_tried(self, avoid: frozenset[str]) -> None:
        """One deployment: once it failed this round, there is nothing else to offer."""
        if self.spec.model in avoid:
            raise UpstreamUnavailableError(f"{self.spec.model} already failed this request", timeout=False)

    def _kwargs(
        self, path: str, body: bytes, stream: bool, timeouts: Timeouts | None
    ) -> tuple[Any, dict[str, Any]]:
        reason = self.unavailable_reason
        if reason is not None:
            raise ModelUnavailableError(reason)
        params = allowed_fields(orjson.loads(body), path)
        if self._fetches_urls:  # litellm would download a part's URL from inside the gateway (SSRF)
            refuse_fetched_urls(params)
        if stream:
            params["stream"] = True
            params["stream_options"] = {"include_usage": True}
        else:
            params.pop("stream_options", None)
        # max_retries=0: the provider's client would otherwise retry a timeout twice on its own (a
        # stalled provider held a request 3x `total`); retries are gateway/pipeline/failover.py's decision.
        params.update(timeout=(timeouts or self.spec.timeouts).total, api_key=self._api_key, max_retries=0)
        if self.spec.base_url:
            params["base_url"] = self.spec.base_url
        if self.spec.api_version:
            params["api_version"] = self.spec.api_version
        return params.pop("model"), params

    async def send(
        self,
        path: str,
        body: bytes,
        timeouts: Timeouts | None = None,
        avoid: frozenset[str] = frozenset(),
        headers: Mapping[str, str] | None = None,
        affinity: int | None = None,
    ) -> UpstreamReply:
        """One whole completion (our trace context is not sent to providers: `headers` is unused;
        a provider has no replicas to keep a prefix on: nor is `affinity`)."""
        self._check_not_tried(avoid)
        model, params = self._kwargs(path, body, False, timeouts)
        call = litellm.acompletion if path.endswith("chat/completions") else litellm.atext_completion

        total = (timeouts or self.spec.timeouts).total

        async def whole() -> bytes:
            # the provider client's timeout bounds each read, not the answer: a provider trickling
            # a byte every few seconds held a request 5x past `total` before this deadline
            async with asyncio.timeout(total):
                resp = await call(model=model, **params, **self._bounded_client(False))
            return orjson.dumps(without_litellm_fields(resp.model_dump(mode="json", exclude_none=True)))

        try:
            answer = await self._side.run(whole())
        except TimeoutError as exc:
            message = f"{self.spec.model} did not finish answering in time"
            raise UpstreamUnavailableError(message, timeout=True, deployment=self.spec.model) from exc
        except Exception as exc:
            return self._error(exc)
        return UpstreamReply(200, answer, self.spec.model)

    @asynccontextmanager
    async def stream(
        self,
        path: str,
        body: bytes,
        timeouts: Timeouts | None = None,
        avoid: frozenset[str] = frozenset(),
        headers: Mapping[str, str] | None = None,
        affinity: int | None = None,
    ) -> AsyncIterator[UpstreamStream]:
        """A streamed completion, re-encoded as OpenAI SSE lines.

        Several choices (`n`, `best_of` > 1), and a legacy completion with logprobs, are asked for
        whole and sent as a stream of that answer: litellm's stream wrapper ends at the first
        choice's finish, drops the others' finish reasons and the provider's usage, and makes up its
        own (billed as if reported); it drops a text completion's logprobs altogether.
        """
        self._check_not_tried(avoid)
        chat = path.endswith("chat/completions")
        if whole_for_stream(body, chat):
            reply = await self.send(path, body, timeouts, avoid)
            if reply.status != 200:
                yield UpstreamStream(reply.status, _no_lines(), reply.body, self.spec.model,
                                     retry_after=reply.retry_after)  # fmt: skip
                return
            shaped = as_stream(orjson.loads(reply.body), chat)
            yield UpstreamStream(200, _given(shaped), b"", self.spec.model)
            return
        model, params = self._kwargs(path, body, True, timeouts)
        call = litellm.acompletion if path.endswith("chat/completions") else litellm.atext_completion
        # `total` bounds the whole stream here, as the engine pool's does: the provider client's
        # timeout bounds each read only (a provider trickling a byte at a time never reached it), and
        # litellm's text-completion stream given our client applies none at all
        deadline = asyncio.get_running_loop().time() + (timeouts or self.spec.timeouts).total

        async def opened() -> Any:  # on the side loop, where the bounded client is made and used
            return await call(model=model, **params, **self._bounded_client(True))

        try:
            async with asyncio.timeout((timeouts or self.spec.timeouts).first_token):  # it must start by then
                resp = await self._side.run(opened())
        except TimeoutError as exc:
            message = f"{self.spec.model} did not start answering in time"
            raise UpstreamUnavailableError(message, timeout=True, deployment=self.spec.model) from exc
        except Exception as exc:
            reply = self._error(exc)
            yield UpstreamStream(reply.status, _no_lines(), reply.body, self.spec.model,
                                 retry_after=reply.retry_after)  # fmt: skip
            return

        async def next_line() -> str | None:  # runs on the side loop, where `resp` belongs
            while True:
                try:
                    chunk = await resp.__anext__()
                except StopAsyncIteration:
                    return None
                if _made_up_finish(resp, chunk):
                    raise UpstreamStreamError("the stream broke off before the provider's finish")
                shaped = openai_chunk(chunk.model_dump(mode="json", exclude_none=True), chat)
                if shaped is not None and shaped.get("usage") is not None and not _provider_usage(resp):
                    del shaped["usage"]  # litellm's own count of the text: the gateway counts, as estimated
                    if not shaped.get("choices"):
                        continue
                if shaped is not None:
                    return "data: " + orjson.dumps(shaped).decode()

        async def lines() -> AsyncIterator[str]:
            while True:
                try:
                    async with asyncio.timeout_at(deadline):
                        line = await self._side.run(next_line())
                except TimeoutError as exc:
                    raise UpstreamStreamError(
                        f"{self.spec.model}: the stream passed its total timeout"
                    ) from exc
                except Exception as exc:
                    raise UpstreamStreamError(f"{self.spec.model}: {masked(str(exc), self._hidden)}") from exc
                if line is None:
                    break
                yield line
            yield "data: [DONE]"

        yield UpstreamStream(200, lines(), b"", self.spec.model)

    def _bounded_client(self, stream: bool) -> dict[str, Any]:
        """`client=` for a whole answer or a stream: one that reads it bounded (bounded_body.py),
        made at the first call on the side loop (its clients' home); none for a provider
        bounded_client lacks."""
        given = self._clients.get(stream)
        if given is None:
            made = bounded_client(self.spec, self._provider, self._api_key, stream)
            given = self._clients[stream] = {} if made is None else {"client": made[0]}
            if made is not None:
                self._handlers.append(made[1])
        return given

    def _error(self, exc: Exception) -> UpstreamReply:
        """Provider errors, classified here and nowhere else: status and body in OpenAI's format.

        Only a 4xx about the client's own request passes the provider's error on (its message,
        clipped with URLs masked, its `param` and `code`: `upstream_errors.reduced_fields`). Our
        credentials refused (401/403/407) or a model the provider does not serve (404/405) is our
        fault, not the client's: kept as it is, it fails over and, last in the chain, reaches the
        client as an engine's does (`answer.passed_on`: 502 `upstream_refused_gateway`, which the
        SDKs do not retry). An overload outside HTTP's statuses (Anthropic's 529, which litellm
        reports as a 500) is the 503 it means; a 429 keeps the provider's Retry-After, sanitized.
        Nothing else of litellm's text reaches the client: it is logged.
        """
        if any(isinstance(cause, AnswerTooLargeError) for cause in causes(exc)):  # as an engine's
            raise UpstreamUnavailableError(
                f"{self.spec.model} answered more than {MAX_REPLY_BYTES} bytes",
                timeout=False,
                deployment=self.spec.model,
            ) from exc
        failed = connection_failure(exc)
        if isinstance(exc, litellm.exceptions.Timeout) or failed == "timeout":
            raise UpstreamUnavailableError(
                f"{self.spec.model} timed out", timeout=True, deployment=self.spec.model
            ) from exc
        if isinstance(exc, litellm.exceptions.APIConnectionError) or failed == "unreachable":
            raise UpstreamUnavailableError(
                f"{self.spec.model} is unreachable: {masked(str(exc), self._hidden)}",
                timeout=False,
                deployment=self.spec.model,
            ) from exc
        # masked as a client's copy is: a provider's error may echo the key it was sent
        logger.warning("hosted model %s failed: %s", self.spec.model, masked(str(exc), self._hidden))
        status = getattr(exc, "status_code", None)
        status = status if isinstance(status, int) and 400 <= status <= 599 else 502
        retry_after = None
        if any(s in OVERLOADED_STATUSES for s in statuses(exc)):
            status = 503
            message = f"the provider of {self.spec.model} is overloaded"
        elif status in GATEWAY_FAULT_STATUSES:  # its status kept: the pipeline answers it as an engine's
            message = f"the provider of {self.spec.model} refused the gateway (HTTP {status})"
        elif status == 429:
            message = f"the provider of {self.spec.model} is rate limiting the gateway"
            retry_after = retry_after_seconds(header(exc, "retry-after"))
        elif 400 <= status < 500:
            given = provider_error(exc)
            if given is not None:  # its message (clipped, URLs masked), param and code: what to change
                error = reduced_fields(given, status, self.spec.model, self._hidden)
                error["code"] = error["code"] or f"provider_{status}"
                return UpstreamReply(status, orjson.dumps({"error": error}), self.spec.model)
            message = f"the provider of {self.spec.model} refused the request"
        else:
            message = f"the provider of {self.spec.model} failed (HTTP {status})"
        ours = status >= 500 or status in GATEWAY_FAULT_STATUSES
        kind = "api_error" if ours else "invalid_request_error"
        body = {"error": {"message": message, "type": kind, "param": None, "code": f"provider_{status}"}}
        return UpstreamReply(status, orjson.dumps(body), self.spec.model, retry_after)

    async def close(self) -> None:
        """Close our bounded clients, stop the side loop (litellm owns its other clients)."""
        handlers, self._handlers, self._clients = self._handlers, [], {}
        for handler in handlers:
            await self._side.run(handler.client.aclose())
        await self._side.close()


def allowed_fields(body: dict[str, Any], path: str) -> dict[str, Any]:
    """The client's fields that an OpenAI endpoint at `path` defines; everything else is dropped."""
    allowed = CHAT_FIELDS if path.endswith("chat/completions") else TEXT_FIELDS
    return {name: value for name, value in body.items() if name in allowed}


async def _given(lines: list[str]) -> AsyncIterator[str]:
    for line in lines:
        yield line


async def _no_lines() -> AsyncIterator[str]:
    return
    yield  # an async generator that yields nothing


# providers whose streams litellm's wrapper records the finish of (`received_finish_reason`)
_FINISH_RECORDED = frozenset({"openai", "azure", "text-completion-openai", "azure_text", "anthropic"})


def _provider_usage(resp: Any) -> bool:
    """Whether the provider's stream carried a usage of its own. litellm's chat stream wrapper keeps
    the chunks that did (`chunks`); without one it ends the stream with a usage it counted from the
    text, which, relayed, was billed as reported and sent to the client as the provider's. A text
    completion's wrapper keeps none to read (it wraps a generator): its usage is taken as told."""
    chunks = getattr(resp, "chunks", None)
    return chunks is None or any(getattr(chunk, "usage", None) is not None for chunk in chunks)


def _made_up_finish(resp: Any, chunk: Any) -> bool:
    """Whether `chunk` carries a finish the provider never sent. litellm's stream wrapper ends a
    provider stream that broke off (a reset or cut connection, no finish) with a finish of its own,
    "stop": relayed, a cut answer would look whole to the client and be billed as one. Its record
    of the provider's own finish tells the two apart, for the providers where it keeps one."""
    if getattr(resp, "custom_llm_provider", None) not in _FINISH_RECORDED:
        return False
    if getattr(resp, "received_finish_reason", None) is not None:
        return False
    return any(getattr(choice, "finish_reason", None) for choice in getattr(chunk, "choices", None) or ())
