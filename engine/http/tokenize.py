"""vLLM's tokenizer endpoints: POST /tokenize, POST /detokenize and GET /version.

`/tokenize` counts a text as a text completion's prompt is read (`prompt`; the tokenizer's special
tokens added unless `add_special_tokens` is false), or a conversation as a chat completion's is
(`messages`, `tools`, the template switches; no special tokens added unless asked): its `count` is
the `usage.prompt_tokens` the same request would be billed. Like vLLM, it counts a prompt longer
than the context (a client asks to learn that), but not one surely longer than TRUNCATE_SLACK
contexts: one tokenizer call holds every thread, the step loop's included, about a second a
megabyte (engine/prompt_length.py). `/detokenize` turns token ids back into text (special tokens
kept, as vLLM decodes them). Both are under the API key, as the /v1 routes; `/version` is not.
"""

from __future__ import annotations

import asyncio
import functools
import importlib.metadata
from collections.abc import Awaitable, Sequence
from typing import Any, Protocol, TypeVar

from fastapi import FastAPI, Request, Response
from fastapi.params import Depends
from pydantic import BaseModel, ConfigDict, Field

from engine.errors import ContextLengthExceededError
from engine.http.openai_format import dumps
from engine.http.protocol import APIError, ChatCompletionRequest
from engine.http.serving import OpenAIServing
from engine.input_processor import TRUNCATE_SLACK
from engine.prompt_length import tokens_at_least

_Req = TypeVar("_Req", bound=BaseModel)


class Parse(Protocol):
    """The server's body reader: a request model, or its 400."""

    def __call__(self, request: Request, model: type[_Req]) -> Awaitable[_Req]: ...


# Texts and id lists above this size are tokenized or decoded in a worker thread, not on the loop.
_INLINE_CHARS = 16 * 1024
_INLINE_IDS = 4096


class TokenizeOptions(BaseModel):
    """The fields of a /tokenize request besides the prompt or the conversation itself."""

    model_config = ConfigDict(strict=True, extra="ignore")
    model: str | None = None
    prompt: str | None = None
    messages: list[Any] | None = None  # a conversation: read again as a chat completion's
    add_special_tokens: bool | None = None  # absent: a text completion's true, a chat's false
    return_token_strs: bool | None = False


class DetokenizeRequest(BaseModel):
    """POST /detokenize: token ids (the body's size bounds their number)."""

    model_config = ConfigDict(strict=True, extra="ignore")
    model: str | None = None
    tokens: list[int] = Field(max_length=1 << 22)


def add_token_routes(
    app: FastAPI, serving: OpenAIServing, authorized: Sequence[Depends], parse: Parse
) -> None:
    """The three routes; `parse` reads a body into a request model (the server's 400s)."""

    @app.post("/tokenize", dependencies=list(authorized))
    async def tokenize(request: Request) -> Response:
        """A prompt's or a conversation's token ids and their count."""
        options = await parse(request, TokenizeOptions)
        serving.served_model(options.model)
        tokenizer = serving.tokenizer()
        info = serving.engine.model_info
        assert info is not None  # (it has a tokenizer)
        max_len = info.max_model_len
        if options.messages is not None:
            if options.add_special_tokens:  # the chat route adds none: the count would not be its bill
                message = "a conversation is counted as the chat route reads it: without added special tokens"
                raise APIError(400, message, param="add_special_tokens", code="invalid_value")
            chat = await parse(request, ChatCompletionRequest)
            rendered = await serving.render_chat(chat, chat.tool_request(), TRUNCATE_SLACK)
            special, field = False, "messages"
        elif options.prompt is None:
            raise APIError(400, "/tokenize needs a `prompt` (a string) or `messages`", param="prompt")
        else:
            rendered, field = options.prompt, "prompt"
            special = options.add_special_tokens is not False
        if isinstance(rendered, str):
            work = (tokenizer, rendered, special, max_len * TRUNCATE_SLACK, field)
            inline = len(rendered) <= _INLINE_CHARS
            ids = _token_ids(*work) if inline else await asyncio.to_thread(_token_ids, *work)
        else:
            ids = rendered
        strs = None
        if options.return_token_strs:  # (tens of thousands of ids: off the loop)
            strs = (
                await asyncio.to_thread(tokenizer.convert_ids_to_tokens, ids)
                if len(ids) > _INLINE_IDS
                else (tokenizer.convert_ids_to_tokens(ids))
            )
        body = {"count": len(ids), "max_model_len": max_len, "tokens": ids, "token_strs": strs}
        return Response(dumps(body), media_type="application/json")

    @app.post("/detokenize", dependencies=list(authorized))
    async def detokenize(request: Request) -> Response:
        """Token ids' text."""
        req = await parse(request, DetokenizeRequest)
        serving.served_model(req.model)
        tokenizer = serving.tokenizer()
        size = len(tokenizer)
        bad = next((t for t in req.tokens if not 0 <= t < size), None)
        if bad is not None:
            message = f"token id {bad} is outside the tokenizer's vocabulary [0, {size})"
            raise APIError(400, message, param="tokens", code="invalid_value")
        work = (tokenizer, req.tokens)
        text = _decoded(*work) if len(req.tokens) <= _INLINE_IDS else await asyncio.to_thread(_decoded, *work)
        return Response(dumps({"prompt": text}), media_type="application/json")

    @app.get("/version")
    async def version() -> Response:
        """The engine's release (the installed package's)."""
        return Response(dumps({"version": _release()}), media_type="application/json")


def _token_ids(tokenizer: Any, text: str, special: bool, bound: int, field: str) -> list[int]:
    """The text's ids; a text surely longer than `bound` tokens is refused before it is read whole."""
    at_least = tokens_at_least(tokenizer, text, bound)
    if at_least is not None:
        raise ContextLengthExceededError(
            f"/tokenize counts texts up to {bound} tokens; this one has at least {at_least}", param=field
        )
    return list(tokenizer(text, add_special_tokens=special).input_ids)


def _decoded(tokenizer: Any, ids: list[int]) -> str:
    return str(tokenizer.decode(ids))


@functools.cache
def _release() -> str:
    try:
        return importlib.metadata.version("switchboard")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree never installed
        return "unknown"
