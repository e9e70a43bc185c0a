"""A fake OpenAI-compatible server with a fixed capacity: it queues, as an inference server does.

`--slots N` requests are served at once; the rest wait in arrival order. A request served costs
`--prefill-ms` before its first token, then `--token-ms` per further token, and streams
`max_tokens` one-word chunks (chat or completions), a usage chunk when asked, and `[DONE]`. So its
throughput is N / (prefill + (max_tokens - 1) * token) requests per second and past it TTFT grows
with the queue, which is what a load-test sweep must find. `GET /metrics` exports the queue as
`engine:num_requests_waiting` and `engine:num_requests_running` (Prometheus text); a request's
caller that leaves frees its slot or its place in the queue.

Run: python tests/fakes/capacity_upstream.py --port 9001 --slots 2 --prefill-ms 50 --token-ms 10
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import AsyncIterator
from typing import Any

import orjson
import uvicorn
from fastapi import FastAPI, Request, Response
from fastapi.responses import StreamingResponse


def create_app(slots: int, prefill_ms: float, token_ms: float) -> FastAPI:
    """The fake's app: `slots` at once, the rest queued."""
    app = FastAPI()
    gate = asyncio.Semaphore(slots)
    counts = {"waiting": 0, "running": 0}

    @app.get("/health")
    async def health() -> Response:
        return Response(b'{"status":"ready"}', media_type="application/json")

    @app.get("/metrics")
    async def metrics() -> Response:
        text = (
            "# TYPE engine:num_requests_waiting gauge\n"
            f'engine:num_requests_waiting{{model_name="fake"}} {counts["waiting"]}\n'
            "# TYPE engine:num_requests_running gauge\n"
            f'engine:num_requests_running{{model_name="fake"}} {counts["running"]}\n'
        )
        return Response(text, media_type="text/plain; version=0.0.4")

    async def events(body: dict[str, Any], chat: bool) -> AsyncIterator[bytes]:
        tokens = max(1, int(body.get("max_tokens") or 16))
        kind = "chat.completion.chunk" if chat else "text_completion"

        def event(payload: dict[str, Any]) -> bytes:
            return b"data: " + orjson.dumps({"id": "cap-1", "object": kind, "created": 0, "model": "fake",
                                            **payload}) + b"\n\n"  # fmt: skip

        counts["waiting"] += 1
        queued = True
        try:
            async with gate:
                counts["waiting"] -= 1
                queued = False
                counts["running"] += 1
                try:
                    await asyncio.sleep(prefill_ms / 1000)
                    for i in range(tokens):
                        if i:
                            await asyncio.sleep(token_ms / 1000)
                        word = f" w{i}"
                        choice = (
                            {"index": 0, "delta": {"content": word}} if chat else {"index": 0, "text": word}
                        )
                        yield event({"choices": [{**choice, "finish_reason": None}]})
                    yield event(
                        {"choices": [{"index": 0, "delta": {}, "text": "", "finish_reason": "length"}]}
                    )
                    if (body.get("stream_options") or {}).get("include_usage"):
                        usage = {"prompt_tokens": 8, "completion_tokens": tokens, "total_tokens": 8 + tokens}
                        yield event({"choices": [], "usage": usage})
                    yield b"data: [DONE]\n\n"
                finally:
                    counts["running"] -= 1
        finally:
            if queued:
                counts["waiting"] -= 1

    async def complete(request: Request, chat: bool) -> Response:
        body = orjson.loads(await request.body())
        return StreamingResponse(events(body, chat), media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await complete(request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await complete(request, chat=False)

    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--slots", type=int, default=2)
    parser.add_argument("--prefill-ms", type=float, default=50.0)
    parser.add_argument("--token-ms", type=float, default=10.0)
    args = parser.parse_args()
    app = create_app(args.slots, args.prefill_ms, args.token_ms)
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
