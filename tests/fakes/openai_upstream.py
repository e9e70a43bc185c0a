"""A fake OpenAI-compatible upstream on loopback: real HTTP and SSE, controllable latency and failures.

Replies are deterministic: the completion is "echo:" plus the words of the last message (or the
prompt), one word per token; usage counts whitespace-separated words. `POST /control` sets
`latency_ms` (before the response), `chunk_delay_ms` (between streamed chunks), `fail_status`
(answer every request with that status), `omit_usage` (report no usage), `card` (fields added
to its model's entry in `GET /v1/models`, e.g. `max_model_len` and `capabilities`), and
`break_after` / `break_mode` (a new stream breaks after that many words: `reset` the connection,
send an `error_event` or a `request_error` (an `invalid_request_error` event), or `stall`),
`linger_after_done_ms` (the body ends that long after a stream's `[DONE]`, as an engine's may);
`GET /stats` reports completions arrived (before the latency wait) and served, the usage
reported so far, how many callers left during the
latency wait or mid-stream, and streams resumed.

Like the engine, it speaks stream resumption: with `stream_token_ids` each word's token id (its
position) comes in a `: token_ids 0 <id>` line before its data line, and `resume: {token_ids, id,
created}` goes on after those words under that id, without a role chunk (ids that are not the
answer's own first words: 400); with `stream_prompt_tokens` a stream opens with `: prompt_tokens N`
(its usage's prompt count).

Run: python tests/fakes/openai_upstream.py --port 9001
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import orjson
import uvicorn
from fastapi import FastAPI, Request, Response
from fastapi.responses import StreamingResponse


def create_app() -> FastAPI:
    """The fake's app; its state lives on app.state (one fake per process)."""
    app = FastAPI()
    app.state.control = {
        "latency_ms": 0.0, "fail_status": None, "chunk_delay_ms": 0.0, "omit_usage": False, "card": {},
        "break_after": None, "break_mode": "reset", "linger_after_done_ms": 0.0,
    }  # fmt: skip
    app.state.stats = {
        "arrived": 0,  # completions received, counted before the latency wait (`requests`: after it)
        "requests": 0,
        "prompt_tokens": 0,
        "completion_tokens": 0,
        "streams_cut_off": 0,
        "waits_cut_off": 0,
        "resumed": 0,
    }

    @app.get("/health")
    async def health() -> Response:
        return Response(b'{"status":"ready"}', media_type="application/json")

    @app.post("/control")
    async def control(request: Request) -> dict[str, Any]:
        app.state.control.update(orjson.loads(await request.body()))
        return dict(app.state.control)

    @app.get("/stats")
    async def stats() -> dict[str, Any]:
        return dict(app.state.stats)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {"id": "fake-model", "object": "model", "created": 0, "owned_by": "fake"}
        return {"object": "list", "data": [{**card, **app.state.control["card"]}]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await _complete(app, request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _complete(app, request, chat=False)

    return app


async def _complete(app: FastAPI, request: Request, chat: bool) -> Response:
    raw = await request.body()
    app.state.stats["arrived"] += 1
    control = app.state.control
    if control["latency_ms"]:  # waited in slices: a caller that leaves meanwhile is counted
        deadline = time.monotonic() + control["latency_ms"] / 1000
        while time.monotonic() < deadline:
            await asyncio.sleep(min(0.02, max(0.0, deadline - time.monotonic())))
            if await request.is_disconnected():
                app.state.stats["waits_cut_off"] += 1
                return Response(status_code=499)
    if control["fail_status"]:
        status = int(control["fail_status"])
        body = {
            "error": {"message": f"fake failure {status}", "type": "api_error", "param": None, "code": None}
        }
        return Response(orjson.dumps(body), status_code=status, media_type="application/json")
    body = orjson.loads(raw)
    if chat:
        text = str(body["messages"][-1].get("content") or "")
        prompt_tokens = sum(len(str(m.get("content") or "").split()) for m in body["messages"])
    else:
        text = str(body["prompt"])
        prompt_tokens = len(text.split())
    words = ["echo:", *text.split()][: int(body.get("max_tokens") or 10_000)]
    usage = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": len(words),
        "total_tokens": prompt_tokens + len(words),
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    stats = app.state.stats
    stats["requests"] += 1
    stats["prompt_tokens"] += prompt_tokens
    stats["completion_tokens"] += len(words)
    rid, created, model = f"fake-{stats['requests']}", int(time.time()), body.get("model")
    if body.get("stream"):
        include = bool((body.get("stream_options") or {}).get("include_usage")) and not control["omit_usage"]
        resume = body.get("resume")
        start = 0
        if isinstance(resume, dict):
            start = len(resume.get("token_ids") or [])
            if resume.get("token_ids") != list(range(start)) or start > len(words):
                error = {
                    "message": "bad resume",
                    "type": "invalid_request_error",
                    "param": "resume",
                    "code": None,
                }
                return Response(
                    orjson.dumps({"error": error}), status_code=400, media_type="application/json"
                )
            rid, created = str(resume.get("id") or rid), int(resume.get("created") or created)
            stats["resumed"] += 1
        stream = _Stream(rid, created, model, words, usage, include, chat, bool(body.get("stream_token_ids")),
                         start, isinstance(resume, dict), bool(body.get("stream_prompt_tokens")))  # fmt: skip
        return StreamingResponse(_events(stream, app), media_type="text/event-stream")
    # a whole answer with n choices: choice i drops its last i words and ends on "length" (i > 0)
    n = body.get("n") if type(body.get("n")) is int and body["n"] > 1 else 1
    choices: list[dict[str, Any]] = []
    for i in range(n):
        content, finish = " ".join(words[: len(words) - i]), "stop" if i == 0 else "length"
        if chat:
            message = {"role": "assistant", "content": content}
            choices.append({"index": i, "message": message, "finish_reason": finish})
        else:  # legacy logprobs when asked: each word a token at -0.5
            kept = words[: len(words) - i]
            offsets = [sum(len(w) + 1 for w in kept[:k]) for k in range(len(kept))]
            tokens = [(" " if k else "") + w for k, w in enumerate(kept)]
            logprobs = {"tokens": tokens, "token_logprobs": [-0.5] * len(kept), "text_offset": offsets}
            given = logprobs if body.get("logprobs") is not None else None
            choices.append({"index": i, "text": content, "finish_reason": finish, "logprobs": given})
    if n > 1:
        completion = sum(len(words) - i for i in range(n))
        usage |= {"completion_tokens": completion, "total_tokens": prompt_tokens + completion}
    reply = {
        "id": rid,
        "object": "chat.completion" if chat else "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage,
    }
    if control["omit_usage"]:  # a provider that reports none
        del reply["usage"]
    return Response(orjson.dumps(reply), media_type="application/json")


@dataclass
class _Stream:
    rid: str
    created: int
    model: Any
    words: list[str]
    usage: dict[str, Any]
    include: bool
    chat: bool
    token_ids: bool  # stream_token_ids: each word's position before its data line
    start: int  # the word a resumed stream goes on from
    resumed: bool
    prompt_line: bool = False  # stream_prompt_tokens: the prompt's count first


async def _events(stream: _Stream, app: FastAPI) -> AsyncIterator[bytes]:
    """The stream; `chunk_delay_ms` paces it, and a reader that leaves early is counted."""
    finished = False
    try:
        async for event in _chunks(stream, app):
            yield event
        finished = True
    finally:
        if not finished:
            app.state.stats["streams_cut_off"] += 1


class _Broken(Exception):
    """Raised inside the response: the server drops the connection mid-body."""


async def _chunks(s: _Stream, app: FastAPI) -> AsyncIterator[bytes]:
    obj = "chat.completion.chunk" if s.chat else "text_completion"
    extra = {"usage": None} if s.include else {}
    control = app.state.control

    def event(choice: dict[str, Any]) -> bytes:
        return b"data: " + orjson.dumps({"id": s.rid, "object": obj, "created": s.created, "model": s.model,
                                        "choices": [choice], **extra}) + b"\n\n"  # fmt: skip

    if s.prompt_line:
        yield b": prompt_tokens %d\n\n" % s.usage["prompt_tokens"]
    if s.chat and not s.resumed:
        yield event({"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None})
    delay = float(control.get("chunk_delay_ms") or 0.0) / 1000
    break_after = None if s.resumed else control.get("break_after")
    for i in range(s.start, len(s.words) + 1):
        if break_after is not None and i == int(break_after):
            mode = control.get("break_mode") or "reset"
            if mode in ("error_event", "request_error"):
                error = {"message": "the engine failed", "type": "server_error", "param": None, "code": None}
                if mode == "request_error":  # the request's own fault, as a grammar outgrowing its limits
                    error = {"message": "the JSON schema is too complex for guided decoding: " + "x" * 3000,
                             "type": "invalid_request_error", "param": "response_format.json_schema.schema",
                             "code": "invalid_json_schema", "internal": "http://10.0.0.1/"}  # fmt: skip
                yield b"data: " + orjson.dumps({"error": error}) + b"\n\n"
                return
            if mode == "stall":
                await asyncio.sleep(3600)
            raise _Broken("connection dropped mid-stream")
        if i == len(s.words):
            break
        if delay:
            await asyncio.sleep(delay)
        word = s.words[i]
        piece = word if i == 0 else " " + word
        ids = b": token_ids 0 %d\n\n" % i if s.token_ids else b""
        yield ids + event({"index": 0, "delta": {"content": piece}, "finish_reason": None} if s.chat
                          else {"index": 0, "text": piece, "finish_reason": None})  # fmt: skip
    yield event({"index": 0, "delta": {}, "finish_reason": "stop"} if s.chat
                else {"index": 0, "text": "", "finish_reason": "stop"})  # fmt: skip
    if s.include:
        yield b"data: " + orjson.dumps({"id": s.rid, "object": obj, "created": s.created, "model": s.model,
                                        "choices": [], "usage": s.usage}) + b"\n\n"  # fmt: skip
    yield b"data: [DONE]\n\n"
    linger = float(control.get("linger_after_done_ms") or 0.0) / 1000
    if linger:
        await asyncio.sleep(linger)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    uvicorn.run(create_app(), host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
