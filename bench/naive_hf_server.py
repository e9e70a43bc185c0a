"""The baseline for bench/serve.py: HF `generate` behind FastAPI, one request at a time.

This is how a newcomer wraps transformers: a lock around `model.generate`, a TextIteratorStreamer
for SSE. It speaks just enough of /v1/completions (streaming, token-id or text prompts, usage)
for the benchmark client.

Usage: python bench/naive_hf_server.py --model DIR --port 8002
"""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from transformers import AutoModelForCausalLM, AutoTokenizer, TextIteratorStreamer


def create_app(model_dir: str) -> FastAPI:
    """One model, one lock: requests are served strictly one after another."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, local_files_only=True).eval()
    lock = asyncio.Lock()
    app = FastAPI()

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body: dict[str, Any] = json.loads(await request.body())
        prompt = body["prompt"]
        ids = prompt if isinstance(prompt, list) else tokenizer(prompt).input_ids
        max_tokens = int(body.get("max_tokens") or 16)
        ignore_eos = bool(body.get("ignore_eos"))
        input_ids = torch.tensor([ids])
        kwargs: dict[str, Any] = dict(max_new_tokens=max_tokens, do_sample=False)
        if ignore_eos:
            kwargs["min_new_tokens"] = max_tokens
        if not body.get("stream"):
            async with lock:
                out = await asyncio.to_thread(_generate, model, input_ids, kwargs)
            text = tokenizer.decode(out, skip_special_tokens=True)
            usage = {
                "prompt_tokens": len(ids),
                "completion_tokens": len(out),
                "total_tokens": len(ids) + len(out),
            }
            return JSONResponse(
                {"choices": [{"index": 0, "text": text, "finish_reason": "length"}], "usage": usage}
            )
        return StreamingResponse(
            _stream(model, tokenizer, lock, input_ids, kwargs), media_type="text/event-stream"
        )

    return app


def _generate(model: Any, input_ids: torch.Tensor, kwargs: dict[str, Any]) -> list[int]:
    with torch.no_grad():
        return list(model.generate(input_ids, **kwargs)[0, input_ids.shape[1] :].tolist())


async def _stream(
    model: Any, tokenizer: Any, lock: asyncio.Lock, input_ids: torch.Tensor, kwargs: dict[str, Any]
) -> AsyncIterator[bytes]:
    rid = f"cmpl-{uuid.uuid4().hex}"
    async with lock:
        streamer = TextIteratorStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
        result: dict[str, list[int]] = {}

        def work() -> None:
            result["ids"] = _generate(model, input_ids, {**kwargs, "streamer": streamer})

        thread = threading.Thread(target=work)
        thread.start()
        iterator = iter(streamer)
        while True:
            piece = await asyncio.to_thread(next, iterator, None)
            if piece is None:
                break
            if piece:
                chunk = {"id": rid, "created": int(time.time()), "choices": [{"index": 0, "text": piece}]}
                yield b"data: " + json.dumps(chunk).encode() + b"\n\n"
        thread.join()
    n_out = len(result.get("ids", []))
    n_in = int(input_ids.shape[1])
    final = {
        "id": rid,
        "choices": [],
        "usage": {"prompt_tokens": n_in, "completion_tokens": n_out, "total_tokens": n_in + n_out},
    }
    yield b"data: " + json.dumps(final).encode() + b"\n\n"
    yield b"data: [DONE]\n\n"


def main() -> None:
    """Serve until killed."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8002)
    args = parser.parse_args()
    uvicorn.run(create_app(args.model), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
