"""OpenAI chat and text completions on top of AsyncLLMEngine: requests in, JSON and SSE out."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from engine.async_engine import AsyncLLMEngine, RequestStream
from engine.errors import InvalidRequestError
from engine.openai_format import (
    SSE_DONE,
    Call,
    aborted_event,
    chat_logprobs,
    completion_logprobs,
    raise_if_aborted,
    response_head,
    sse,
    text_choice,
    usage,
)
from engine.outputs import CompletionOutput, RequestOutput
from engine.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    _SamplingFields,
    build_sampling_params,
    chat_messages,
    completion_prompts,
    load_generation_defaults,
)
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:  # imported only when tracing is on
    from engine.tracing import RequestSpan


class OpenAIServing:
    """Translates OpenAI requests into engine requests and engine outputs into OpenAI responses."""

    def __init__(self, engine: AsyncLLMEngine, served_names: list[str]) -> None:
        assert served_names
        self.engine = engine
        self.served_names = served_names
        self.created = int(time.time())
        self._defaults: dict[str, float] | None = None

    # ----------------------------------------------------------------- common
    def resolve_model(self, name: str | None) -> str:
        """The served name to echo back; 404 for a model this server does not serve."""
        if name is None or name == "":
            return self.served_names[0]
        if name in self.served_names:
            return name
        raise APIError(
            404,
            f"The model '{name}' does not exist; this server serves: {', '.join(self.served_names)}",
            param="model",
            code="model_not_found",
        )

    def models(self) -> dict[str, Any]:
        """Body of GET /v1/models."""
        max_len = self.engine.engine.max_model_len if self.engine.engine is not None else None
        data = [
            {
                "id": name,
                "object": "model",
                "created": self.created,
                "owned_by": "switchboard",
                "root": self.engine.config.model,
                "max_model_len": max_len,
            }
            for name in self.served_names
        ]
        return {"object": "list", "data": data}

    def generation_defaults(self) -> dict[str, float]:
        """The model's own sampling defaults (generation_config.json), read once after loading."""
        if self._defaults is None:
            engine = self.engine.engine
            if engine is None:
                return {}
            self._defaults = load_generation_defaults(engine.model_dir)
        return self._defaults

    def sampling_params(
        self, req: _SamplingFields, max_tokens: int | None, logprobs: int | None
    ) -> SamplingParams:
        """SamplingParams from the request's fields; absent ones take the model's defaults, then OpenAI's."""
        return build_sampling_params(req, max_tokens, logprobs, self.generation_defaults())

    def _tokenizer(self) -> Any:
        engine = self.engine.engine
        tokenizer = engine.tokenizer if engine is not None else None
        if tokenizer is None:
            raise APIError(
                400, "this model has no tokenizer: send token ids to /v1/completions", param="model"
            )
        return tokenizer

    async def _start(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        add_special_tokens: bool,
        span: RequestSpan | None = None,
    ) -> RequestStream:
        """Admit the request (admission errors become 400s); the caller closes the stream."""
        try:
            stream = await self.engine.add_request(request_id, prompt, params, add_special_tokens)
            if span is not None:
                span.admitted(request_id)
                stream.on_final = span.finished
            return stream
        except InvalidRequestError as exc:
            text = str(exc)
            if "max_tokens" in text or "requested" in text:
                param = "max_tokens"
            else:
                param = "prompt" if add_special_tokens else "messages"
            raise APIError(400, text, param=param, code=exc.code) from exc

    # ------------------------------------------------------------------- chat
    def render_chat(self, req: ChatCompletionRequest) -> str:
        """The conversation through the model's own chat template."""
        messages = chat_messages(req.messages)
        tokenizer = self._tokenizer()
        if not getattr(tokenizer, "chat_template", None):
            raise APIError(400, "this model has no chat template: use /v1/completions", param="messages")
        try:
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except Exception as exc:  # the template's own checks (e.g. role order) raise jinja errors
            raise APIError(400, f"the chat template rejected the messages: {exc}", param="messages") from exc
        return str(text)

    async def chat(
        self, req: ChatCompletionRequest, span: RequestSpan | None = None
    ) -> dict[str, Any] | AsyncIterator[bytes]:
        """A chat completion: the whole response, or an SSE byte stream when `stream` is set."""
        model = self.resolve_model(req.model)
        prompt = self.render_chat(req)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        top = (req.top_logprobs or 0) if req.logprobs else None
        params = self.sampling_params(req, max_tokens, top)
        call = Call(f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), model, "chat.completion")
        stream = await self._start(call.id, prompt, params, False, span)
        if req.stream:
            return _closing(self._chat_events(call, stream, params, top, req.include_usage), [stream])
        try:
            final = await _last(stream)
        finally:
            stream.close()
        raise_if_aborted(final)
        choices = [
            {
                "index": c.index,
                "message": {"role": "assistant", "content": c.text},
                "logprobs": chat_logprobs(c, 0, top) if top is not None else None,
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
            }
            for c in final.outputs
        ]
        return {**response_head(call), "choices": choices, "usage": usage([final])}

    async def _chat_events(
        self,
        call: Call,
        outputs: RequestStream,
        params: SamplingParams,
        top: int | None,
        include_usage: bool,
    ) -> AsyncIterator[bytes]:
        head = {**response_head(call), "object": "chat.completion.chunk"}
        extra = {"usage": None} if include_usage else {}

        def chunk(
            index: int, delta: dict[str, Any], logprobs: Any = None, finish: str | None = None
        ) -> bytes:
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
            return sse({**head, "choices": [choice], **extra})

        for i in range(params.n):
            yield chunk(i, {"role": "assistant", "content": ""})
        sent = _Progress(params.n)
        last: RequestOutput | None = None
        async for out in outputs:
            last = out
            for c in out.outputs:
                if sent.finished[c.index]:
                    continue
                if c.finish_reason == "abort":
                    yield aborted_event()
                    return
                text, first_token = sent.advance(c)
                logprobs = chat_logprobs(c, first_token, top) if top is not None else None
                if text or (logprobs and logprobs["content"]):
                    yield chunk(c.index, {"content": text}, logprobs)
                if c.finish_reason is not None:
                    sent.finished[c.index] = True
                    yield chunk(c.index, {}, finish=c.finish_reason)
        if include_usage and last is not None:
            yield sse({**head, "choices": [], "usage": usage([last])})
        yield SSE_DONE

    # ------------------------------------------------------------ completions
    async def completions(
        self, req: CompletionRequest, span: RequestSpan | None = None
    ) -> dict[str, Any] | AsyncIterator[bytes]:
        """A text completion for one or several prompts (choices indexed prompt-major)."""
        model = self.resolve_model(req.model)
        prompts = completion_prompts(req.prompt)
        params = self.sampling_params(req, req.max_tokens, req.logprobs)
        call = Call(f"cmpl-{uuid.uuid4().hex}", int(time.time()), model, "text_completion")
        streams: list[RequestStream] = []
        try:
            for k, prompt in enumerate(prompts):
                request_id = call.id if len(prompts) == 1 else f"{call.id}-{k}"
                streams.append(await self._start(request_id, prompt, params, True, span))
            echo = [self._echo_text(p) for p in prompts] if req.echo else None
        except BaseException:
            _close_all(streams)
            raise
        if req.stream:
            return _closing(self._completion_events(call, streams, params, echo, req.include_usage), streams)
        try:
            finals = list(await asyncio.gather(*(_last(s) for s in streams)))
        finally:
            _close_all(streams)
        choices = []
        for k, final in enumerate(finals):
            raise_if_aborted(final)
            for c in final.outputs:
                prefix = echo[k] if echo is not None else ""
                choices.append(
                    {
                        "index": k * params.n + c.index,
                        "text": prefix + c.text,
                        "logprobs": completion_logprobs(c, 0, 0, params.logprobs)
                        if params.logprobs is not None
                        else None,
                        "finish_reason": c.finish_reason,
                        "stop_reason": c.stop_reason,
                    }
                )
        return {**response_head(call), "choices": choices, "usage": usage(finals)}

    def _echo_text(self, prompt: str | list[int]) -> str:
        if isinstance(prompt, str):
            return prompt
        return str(self._tokenizer().decode(prompt))

    async def _completion_events(
        self,
        call: Call,
        streams: list[RequestStream],
        params: SamplingParams,
        echo: list[str] | None,
        include_usage: bool,
    ) -> AsyncIterator[bytes]:
        head = response_head(call)
        extra = {"usage": None} if include_usage else {}
        n = params.n
        sent = [_Progress(n) for _ in streams]
        offsets = [[len(echo[k]) if echo else 0] * n for k in range(len(streams))]
        finals: dict[int, RequestOutput] = {}
        if echo is not None:
            for k, text in enumerate(echo):
                for i in range(n):
                    yield sse({**head, "choices": [text_choice(k * n + i, text, None, None)], **extra})
        async for k, out in _merge(streams):
            finals[k] = out
            for c in out.outputs:
                if sent[k].finished[c.index]:
                    continue
                if c.finish_reason == "abort":
                    yield aborted_event()
                    return
                text, first_token = sent[k].advance(c)
                logprobs = None
                if params.logprobs is not None:
                    logprobs = completion_logprobs(c, first_token, offsets[k][c.index], params.logprobs)
                    offsets[k][c.index] += len(text)
                finish = c.finish_reason
                if text or finish is not None or (logprobs and logprobs["tokens"]):
                    choice = text_choice(k * n + c.index, text, logprobs, finish)
                    yield sse({**head, "choices": [choice], **extra})
                if finish is not None:
                    sent[k].finished[c.index] = True
        if include_usage:
            yield sse({**head, "choices": [], "usage": usage([finals[k] for k in sorted(finals)])})
        yield SSE_DONE


class _Progress:
    """What a stream has already sent, per completion index."""

    def __init__(self, n: int) -> None:
        self.text = [0] * n
        self.tokens = [0] * n
        self.finished = [False] * n

    def advance(self, c: CompletionOutput) -> tuple[str, int]:
        """The new text since last time, and the index of the first token not sent yet."""
        i = c.index
        text = c.text[self.text[i] :]
        first_token = self.tokens[i]
        self.text[i] = len(c.text)
        self.tokens[i] = len(c.token_ids)
        return text, first_token


async def _closing(events: AsyncIterator[bytes], streams: list[RequestStream]) -> AsyncIterator[bytes]:
    """Pass SSE events through; however the response ends, its requests are closed (aborted if unfinished)."""
    try:
        async for event in events:
            yield event
    finally:
        await events.aclose()  # type: ignore[attr-defined]
        _close_all(streams)


def _close_all(streams: list[RequestStream]) -> None:
    for stream in streams:
        stream.close()


async def _last(outputs: RequestStream) -> RequestOutput:
    last = None
    async for out in outputs:
        last = out
    assert last is not None and last.finished
    return last


async def _merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several streams as they come, tagged with the stream's position."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    q: asyncio.Queue[tuple[int, RequestOutput] | tuple[int, BaseException] | None] = asyncio.Queue()

    async def pump(k: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                await q.put((k, out))
        except Exception as exc:
            await q.put((k, exc))
        finally:
            await q.put(None)

    tasks = [asyncio.create_task(pump(k, s)) for k, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            item = await q.get()
            if item is None:
                remaining -= 1
                continue
            k, value = item
            if isinstance(value, BaseException):
                raise value
            yield k, value
    finally:
        for t in tasks:
            t.cancel()
