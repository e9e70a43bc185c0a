"""A fake Anthropic Messages API on loopback: real HTTP and SSE, as litellm's `anthropic/` provider
reads it (its `base_url` pointed here).

`POST /v1/messages` answers "hello world" (usage: 5 input, 2 output tokens), whole or streamed as
Anthropic's events (message_start, content_block_*, message_delta with the stop reason,
message_stop). The last message's content picks a misbehaviour: `mode=cut` closes a stream cleanly
after its first text delta (no message_delta, no message_stop), as a provider connection cut
mid-answer looks to the client; `mode=overloaded` is Anthropic's 529 `overloaded_error`;
`mode=rate_limited:WAIT` a 429 `rate_limit_error` with `Retry-After: WAIT` (`date`: an HTTP-date,
`none`: no header); `mode=huge` a whole answer of 70 MiB. `GET /health` is 200.

Run: python tests/fakes/anthropic_upstream.py --port 9003
"""

from __future__ import annotations

import argparse
import re
from collections.abc import AsyncIterator
from typing import Any

import orjson
import uvicorn
from fastapi import FastAPI, Request, Response
from fastapi.responses import StreamingResponse

USAGE = {"input_tokens": 5, "output_tokens": 2}
RATE_LIMITED = re.compile(r"mode=rate_limited:([A-Za-z0-9]+)")
HTTP_DATE = "Wed, 21 Oct 2015 07:28:00 GMT"


def _error(status: int, kind: str, message: str, headers: dict[str, str] | None = None) -> Response:
    body = {"type": "error", "error": {"type": kind, "message": message}}
    return Response(orjson.dumps(body), status, headers, media_type="application/json")


def _event(kind: str, data: dict[str, Any]) -> bytes:
    return f"event: {kind}\n".encode() + b"data: " + orjson.dumps({"type": kind, **data}) + b"\n\n"


async def _stream(model: str, cut: bool) -> AsyncIterator[bytes]:
    message: dict[str, Any] = {"id": "msg_fake", "type": "message", "role": "assistant", "model": model,
                               "content": [], "stop_reason": None,
                               "usage": {"input_tokens": 5, "output_tokens": 1}}  # fmt: skip
    yield _event("message_start", {"message": message})
    yield _event("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}})
    yield _event("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": "hello"}})
    if cut:
        return  # the body ends here: no stop reason ever came
    yield _event("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": " world"}})
    yield _event("content_block_stop", {"index": 0})
    yield _event("message_delta", {"delta": {"stop_reason": "end_turn", "stop_sequence": None},
                                   "usage": {"output_tokens": 2}})  # fmt: skip
    yield _event("message_stop", {})


def create_app() -> FastAPI:
    """The fake's app (stateless)."""
    app = FastAPI()

    @app.get("/health")
    async def health() -> Response:
        return Response(b'{"status":"ready"}', media_type="application/json")

    @app.post("/v1/messages")
    async def messages(request: Request) -> Response:
        body = orjson.loads(await request.body())
        last = body["messages"][-1]["content"]
        text = last if isinstance(last, str) else orjson.dumps(last).decode()
        cut = "mode=cut" in text
        if "mode=overloaded" in text:
            return _error(529, "overloaded_error", "Overloaded")
        if "mode=huge" in text and not body.get("stream"):
            huge = {"id": "msg_fake", "type": "message", "role": "assistant", "model": body["model"],
                    "content": [{"type": "text", "text": "x" * (70 << 20)}], "stop_reason": "end_turn",
                    "stop_sequence": None, "usage": USAGE}  # fmt: skip
            return Response(orjson.dumps(huge), media_type="application/json")
        if limited := RATE_LIMITED.search(text):
            wait = {"date": HTTP_DATE, "none": None}.get(limited.group(1), limited.group(1))
            headers = None if wait is None else {"retry-after": wait}
            return _error(429, "rate_limit_error", "rate limited", headers)
        if body.get("stream"):
            return StreamingResponse(_stream(body["model"], cut), media_type="text/event-stream")
        answer = {"id": "msg_fake", "type": "message", "role": "assistant", "model": body["model"],
                  "content": [{"type": "text", "text": "hello world"}], "stop_reason": "end_turn",
                  "stop_sequence": None, "usage": USAGE}  # fmt: skip
        return Response(orjson.dumps(answer), media_type="application/json")

    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    uvicorn.run(create_app(), host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
