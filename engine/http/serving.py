"""OpenAI chat and text completions on top of AsyncLLMEngine: requests in, JSON and SSE out."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from typing import TYPE_CHECKING, Any

from engine.async_engine import AsyncLLMEngine
from engine.errors import InvalidRequestError
from engine.http.chat_render import ChatRenderer
from engine.http.chat_tools import StreamedChoices, reads_calls, whole_message
from engine.http.event_stream import EventStream, close_all, merged, whole_output
from engine.http.messages import chat_messages, completion_prompts
from engine.http.openai_format import (
    SSE_DONE,
    ResponseIdentity,
    aborted_event,
    chat_logprobs,
    completion_logprobs,
    event_pieces,
    logprobs_text_length,
    marked,
    prompt_tokens_line,
    raise_if_aborted,
    response_head,
    slice_completion_logprobs,
    sse,
    text_choice,
    text_pieces,
    usage,
)
from engine.http.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    _SamplingFields,
    build_sampling_params,
)
from engine.http.request_limits import check_guided_limits, check_request_limits
from engine.input_processor import TRUNCATE_SLACK
from engine.outputs import CompletionOutput, RequestOutput
from engine.request_stream import RequestStream
from engine.sampling_params import SamplingParams
from engine.tools.prompt import template_takes_tools, with_tools
from engine.tools.request import ToolRequest

if TYPE_CHECKING:  # imported only when tracing is on
    from engine.http.tracing import RequestSpan

logger = logging.getLogger(__name__)

# OpenAI's and vLLM's default for /v1/completions without max_tokens (chat: the rest of the context).
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


class OpenAIServing:
    """Translates OpenAI requests into engine requests and engine outputs into OpenAI responses."""

    def __init__(self, engine: AsyncLLMEngine, served_names: list[str]) -> None:
        assert served_names
        self.engine = engine
        self.served_names = served_names
        self.created = int(time.time())
        self._renderer = ChatRenderer()

    # ----------------------------------------------------------------- common
    def served_model(self, name: str | None) -> str:
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
        info = self.engine.model_info
        max_len = info.max_model_len if info is not None else None
        data = [
            {
                "id": name,
                "object": "model",
                "created": self.created,
                "owned_by": "switchboard",
                "root": self.engine.config.model,
                "max_model_len": max_len,
                "capabilities": info.capabilities() if info is not None else None,
                "precision": dict(info.precision) if info is not None else None,
                "speculative_decoding": dict(info.speculative) if info and info.speculative else None,
            }
            for name in self.served_names
        ]
        return {"object": "list", "data": data}

    def generation_defaults(self) -> Mapping[str, float]:
        """The model's own sampling defaults (generation_config.json); none while it loads."""
        info = self.engine.model_info
        return info.generation_defaults if info is not None else {}

    def sampling_params(
        self, req: _SamplingFields, max_tokens: int | None, logprobs: int | None
    ) -> SamplingParams:
        """SamplingParams from the request's fields; absent ones take the model's defaults, then OpenAI's.

        The output constraint (response_format / structured_outputs) is checked and bounded here;
        it compiles when the request is added, beside the prompt's tokenizing.
        """
        guided = req.guided_spec()
        check_guided_limits(self.engine.config, guided)
        return build_sampling_params(req, max_tokens, logprobs, self.generation_defaults(), guided)

    def tokenizer(self) -> Any:
        """The loaded model's tokenizer: 503 while it loads, 400 for a folder without one."""
        info = self.engine.model_info
        if info is None:  # still loading (or never loaded): a 503 that says so, not "no tokenizer"
            self.engine.check_accepting()
            raise APIError(503, "the model is not loaded", "api_error", code="engine_loading")
        tokenizer = info.tokenizer
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
        resume: list[int] | None = None,
    ) -> RequestStream:
        """Admit the request (admission errors become 400s); the caller closes the stream."""
        try:
            stream = await self.engine.add_request(request_id, prompt, params, add_special_tokens, resume)
            if span is not None:
                span.admitted(request_id)
                stream.on_final = span.finished
            return stream
        except InvalidRequestError as exc:
            if exc.param in (None, "prompt"):  # the prompt is to blame: name the field it came in
                exc.param = "prompt" if add_special_tokens else "messages"
            raise

    # ------------------------------------------------------------------- chat
    async def render_chat(
        self, req: ChatCompletionRequest, tools: ToolRequest | None = None, contexts: int | None = None
    ) -> str | list[int]:
        """The conversation (and the tools offered) through the model's own chat template, or our
        tool prompt where the template takes no tools (long ones in a worker thread): its text, or
        its token ids where client text spelled special tokens (engine/http/special_text.py), at
        most `contexts` contexts long (else one; TRUNCATE_SLACK for a prompt to be cut)."""
        tokenizer = self.tokenizer()
        if not getattr(tokenizer, "chat_template", None):
            raise APIError(400, "this model has no chat template: use /v1/completions", param="messages")
        messages, listed = with_tools(chat_messages(req.messages), tools, template_takes_tools(tokenizer))
        info = self.engine.model_info
        assert info is not None  # a tokenizer was found in it
        options = req.template_options()
        # a prompt to be cut to its last tokens may be longer than the context: the engine cuts it
        slack = contexts or (1 if req.truncate_prompt_tokens is None else TRUNCATE_SLACK)
        return await self._renderer.render(tokenizer, messages, listed, info.max_model_len * slack, options)

    async def chat(
        self, req: ChatCompletionRequest, span: RequestSpan | None = None
    ) -> dict[str, Any] | AsyncIterator[bytes]:
        """A chat completion: the whole response, or an SSE byte stream when `stream` is set."""
        model = self.served_model(req.model)
        top = (req.top_logprobs or 0) if req.logprobs else None
        check_request_limits(self.engine.config, 1, req.n or 1, req.stop_strings(), top, "top_logprobs")
        tools = req.tool_request()
        prompt = await self.render_chat(req, tools)
        # absent: the rest of the context, as vLLM does for chat
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        params = self.sampling_params(req, max_tokens, top)
        identity = _identity(req, "chatcmpl", model, "chat.completion")
        resume = req.resume.token_ids if req.resume is not None else None
        # the engine's request id: the answer's, unless it came with a resumed request
        request_id = identity.id if resume is None else f"chatcmpl-{uuid.uuid4().hex}"
        stream = await self._start(request_id, prompt, params, False, span, resume)
        if req.stream:
            marks = _Marks(
                bool(req.stream_token_ids), params.n, stream.prompt_tokens, req.stream_prompt_tokens
            )
            events = self._chat_events(identity, stream, params, top, req.include_usage, tools, marks, resume)
            return EventStream(events, [stream])
        try:
            final = await whole_output(stream)
        finally:
            stream.close()
        raise_if_aborted(final)
        choices = []
        for c in final.outputs:
            message, finish_reason = whole_message(c.text, c.finish_reason, tools, c.stop_reason)
            choices.append(
                {
                    "index": c.index,
                    "message": message,
                    "logprobs": chat_logprobs(c, top) if top is not None else None,
                    "finish_reason": finish_reason,
                    "stop_reason": c.stop_reason,
                }
            )
        return {**response_head(identity), "choices": choices, "usage": usage([final])}

    async def _chat_events(
        self,
        identity: ResponseIdentity,
        outputs: RequestStream,
        params: SamplingParams,
        top: int | None,
        include_usage: bool,
        tools: ToolRequest | None,
        marks: _Marks,
        resume: list[int] | None,
    ) -> AsyncIterator[bytes]:
        if marks.opening:
            yield marks.opening
        head = {**response_head(identity), "object": "chat.completion.chunk"}
        calls = (
            StreamedChoices(params.n, tools.calls_only, tools.legacy, tools.named)
            if tools is not None and reads_calls(tools)
            else None
        )
        extra = {"usage": None} if include_usage else {}

        def chunk(index: int, delta: dict[str, Any], logprobs: Any = None, finish: str | None = None,
                  stop_reason: int | str | None = None) -> bytes:  # fmt: skip
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
            if finish is not None:  # the stop string or token that ended it, as vLLM's last chunk says
                choice["stop_reason"] = stop_reason
            return sse({**head, "choices": [choice], **extra})

        if resume is None:  # a resumed answer goes on with a message whose role was sent
            opening = None if tools is not None and tools.calls_only else ""  # calls only: null, as whole
            for i in range(params.n):
                yield chunk(i, {"role": "assistant", "content": opening})
        ended = [False] * params.n
        # logprobs of tokens whose text the call reader holds back: they ride on the next delta
        held_logprobs: list[list[dict[str, Any]]] = [[] for _ in range(params.n)]

        def take_logprobs(index: int) -> dict[str, Any] | None:
            if top is None:
                return None
            entries, held_logprobs[index] = held_logprobs[index], []
            return {"content": entries}

        last: RequestOutput | None = None
        async for out in outputs:
            last = out
            for c in out.outputs:
                if ended[c.index]:
                    continue
                if c.finish_reason == "abort":
                    yield aborted_event()
                    return
                if calls is not None and c.replayed_text:  # the reader's state, as after those tokens
                    calls.deltas(c.index, c.replayed_text)
                events: list[bytes] = []
                logprobs = chat_logprobs(c, top) if top is not None else None
                if calls is not None:  # content and call pieces (logprobs ride on the first delta)
                    if logprobs is not None:
                        held_logprobs[c.index].extend(logprobs["content"])
                    for delta in calls.deltas(c.index, c.text):
                        events.append(chunk(c.index, delta, take_logprobs(c.index) if not events else None))
                else:
                    entries = logprobs["content"] if logprobs is not None else []
                    for piece, start, end in event_pieces(c.text, len(entries)):
                        piece_logprobs = {"content": entries[start:end]} if logprobs is not None else None
                        events.append(chunk(c.index, {"content": piece}, piece_logprobs))
                if c.finish_reason is not None:
                    ended[c.index] = True
                    finish = c.finish_reason
                    end_logprobs = None
                    if calls is not None:
                        held, finish = calls.finish(c.index, finish, c.stop_reason)
                        events.extend(
                            chunk(c.index, delta, take_logprobs(c.index) if i == 0 else None)
                            for i, delta in enumerate(held)
                        )
                        if held_logprobs[c.index]:  # tokens whose text went nowhere (a call's tag)
                            end_logprobs = take_logprobs(c.index)
                    events.append(chunk(c.index, {}, end_logprobs, finish=finish, stop_reason=c.stop_reason))
                for event in marks.mark(events, c):
                    yield event
        if include_usage and last is not None:
            yield sse({**head, "choices": [], "usage": usage([last])})
        yield SSE_DONE

    # ------------------------------------------------------------ completions
    async def completions(
        self, req: CompletionRequest, span: RequestSpan | None = None
    ) -> dict[str, Any] | AsyncIterator[bytes]:
        """A text completion for one or several prompts (choices indexed prompt-major)."""
        model = self.served_model(req.model)
        prompts = completion_prompts(req.prompt)
        n = req.n or 1
        check_request_limits(
            self.engine.config, len(prompts), n, req.stop_strings(), req.logprobs, "logprobs"
        )
        max_tokens = req.max_tokens if req.max_tokens is not None else COMPLETIONS_DEFAULT_MAX_TOKENS
        params = self.sampling_params(req, max_tokens, req.logprobs)
        identity = _identity(req, "cmpl", model, "text_completion")
        resume = req.resume.token_ids if req.resume is not None else None
        if resume is not None and len(prompts) != 1:
            raise APIError(400, "only a request with one prompt can be resumed", param="resume")
        streams: list[RequestStream] = []
        base_id = identity.id if resume is None else f"cmpl-{uuid.uuid4().hex}"
        try:
            for k, prompt in enumerate(prompts):
                request_id = base_id if len(prompts) == 1 else f"{base_id}-{k}"
                streams.append(await self._start(request_id, prompt, params, True, span, resume))
            # a resumed answer's echo was sent with its beginning
            echo = [self._echo_text(p) for p in prompts] if req.echo and resume is None else None
        except BaseException:
            close_all(streams)
            raise
        if req.stream:
            prompt_tokens = sum(s.prompt_tokens for s in streams)
            marks = _Marks(
                bool(req.stream_token_ids), len(prompts) * params.n, prompt_tokens, req.stream_prompt_tokens
            )
            return EventStream(
                self._completion_events(identity, streams, params, echo, req.include_usage, marks), streams
            )
        try:
            finals = list(await asyncio.gather(*(whole_output(s) for s in streams)))
        finally:
            close_all(streams)
        choices = []
        for k, final in enumerate(finals):
            raise_if_aborted(final)
            for c in final.outputs:
                prefix = echo[k] if echo is not None else ""
                choices.append(
                    {
                        "index": k * params.n + c.index,
                        "text": prefix + c.text,
                        "logprobs": completion_logprobs(c, 0, params.logprobs)
                        if params.logprobs is not None
                        else None,
                        "finish_reason": c.finish_reason,
                        "stop_reason": c.stop_reason,
                    }
                )
        return {**response_head(identity), "choices": choices, "usage": usage(finals)}

    def _echo_text(self, prompt: str | list[int]) -> str:
        if isinstance(prompt, str):
            return prompt
        return str(self.tokenizer().decode(prompt))

    async def _completion_events(
        self,
        identity: ResponseIdentity,
        streams: list[RequestStream],
        params: SamplingParams,
        echo: list[str] | None,
        include_usage: bool,
        marks: _Marks,
    ) -> AsyncIterator[bytes]:
        if marks.opening:
            yield marks.opening
        head = response_head(identity)
        extra = {"usage": None} if include_usage else {}
        n = params.n
        ended = [[False] * n for _ in streams]
        # where the next delta's tokens start in each choice's text (logprobs' text_offset)
        offsets = [[len(echo[k]) if echo else 0] * n for k in range(len(streams))]
        finals: dict[int, RequestOutput] = {}
        if echo is not None:
            for k, text in enumerate(echo):
                for i in range(n):
                    for piece in text_pieces(text):
                        yield sse({**head, "choices": [text_choice(k * n + i, piece, None, None)], **extra})
        async for k, out in merged(streams):
            finals[k] = out
            for c in out.outputs:
                if ended[k][c.index]:
                    continue
                if c.finish_reason == "abort":
                    yield aborted_event()
                    return
                text = c.text
                logprobs = None
                if params.logprobs is not None:
                    logprobs = completion_logprobs(c, offsets[k][c.index], params.logprobs)
                    # past this delta's tokens, as a whole answer counts them: its text may be
                    # shorter (a possible stop string held back, or cut by one)
                    offsets[k][c.index] += logprobs_text_length(c)
                finish = c.finish_reason
                pieces = event_pieces(text, len(logprobs["tokens"]) if logprobs is not None else 0)
                if not pieces and finish is not None:
                    pieces = [("", 0, 0)]
                events = []
                for j, (piece, start, end) in enumerate(pieces):
                    piece_logprobs = (
                        slice_completion_logprobs(logprobs, start, end) if logprobs is not None else None
                    )
                    last_piece = j == len(pieces) - 1
                    choice = text_choice(
                        k * n + c.index, piece, piece_logprobs, finish if last_piece else None, c.stop_reason
                    )
                    events.append(sse({**head, "choices": [choice], **extra}))
                for event in marks.mark(events, c, k * n):
                    yield event
                if finish is not None:
                    ended[k][c.index] = True
        if include_usage:
            yield sse({**head, "choices": [], "usage": usage([finals[k] for k in sorted(finals)])})
        yield SSE_DONE


def _identity(req: _SamplingFields, prefix: str, model: str, kind: str) -> ResponseIdentity:
    """The answer's id and time: new, or a resumed answer's own (its chunks go on as one stream)."""
    resume = req.resume
    ident = resume.id if resume is not None and resume.id is not None else f"{prefix}-{uuid.uuid4().hex}"
    created = resume.created if resume is not None and resume.created is not None else int(time.time())
    return ResponseIdentity(ident, created, model, kind)


class _Marks:
    """What the gateway asked a stream to tell it in SSE comment lines, which clients ignore.
    `stream_token_ids`: each choice's token ids, before the data line that completes their delta
    (ids of a delta that sends nothing wait for the next one that does). `stream_prompt_tokens`:
    the prompt's token count, the stream's first line (`opening`)."""

    def __init__(self, on: bool, choices: int, prompt_tokens: int = 0, announce: bool | None = False) -> None:
        self.on = on
        self.opening = prompt_tokens_line(prompt_tokens) if announce else b""
        self._pending: list[list[int]] = [[] for _ in range(choices)] if on else []

    def mark(self, events: list[bytes], c: CompletionOutput, offset: int = 0) -> list[bytes]:
        """`events` of delta `c` (choice `offset + c.index`), with the ids due before the last one."""
        if not self.on:
            return events
        index = offset + c.index
        pending = self._pending[index]
        pending.extend(c.token_ids)
        return marked(events, index, pending)
