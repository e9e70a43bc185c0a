"""A minimal-cost OpenAI-compatible upstream for overhead benchmarks: raw asyncio + httptools.

Every request to `/v1/chat/completions` or `/v1/completions` gets the same small completion (three
completion tokens, usage included); `"stream": true` gets it as SSE chunks, a usage chunk when
`stream_options.include_usage` is set, and `[DONE]`. Keep-alive, no framework: a request costs a
few tens of microseconds, so the benchmark measures the proxy in front of it, not the fake.
`GET /health` answers `{"status":"ready"}`; `GET /stats` counts the requests served.

With `--gap-ms G` a stream is sent as it would come from a model: chunked, one event per write,
G ms apart, a role-only first chunk (chat) then `--tokens` one-word chunks (bench/stream_relay.py
measures the first chunk that carries text, and the relay's CPU per chunk, against it). With
`--hold-head` as well, the head and the role chunk wait for the first word and leave with it, as a
gateway that answers a stream only once its first token is in does: what that alone costs a client.

Run: python tests/fakes/fast_upstream.py --port 9001 [--gap-ms 5 --tokens 20 [--hold-head]]
"""

from __future__ import annotations

import argparse
import asyncio
from typing import Any, cast

import httptools
import orjson
import uvloop

_WORDS = ("Hello", " from", " fake")


def _completion(chat: bool, model: str) -> bytes:
    usage = {"prompt_tokens": 5, "completion_tokens": len(_WORDS), "total_tokens": 5 + len(_WORDS)}
    text = "".join(_WORDS)
    if chat:
        choice: dict[str, Any] = {
            "index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop",
            "logprobs": None,
        }  # fmt: skip
        kind = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "finish_reason": "stop", "logprobs": None}
        kind = "text_completion"
    return orjson.dumps(
        {"id": "cmpl-fast", "object": kind, "created": 0, "model": model, "choices": [choice], "usage": usage}
    )


def _stream(chat: bool, model: str, include_usage: bool) -> bytes:
    return b"".join(_events(chat, model, include_usage, _WORDS))


def _events(chat: bool, model: str, include_usage: bool, words: tuple[str, ...]) -> list[bytes]:
    """The SSE events of a streamed answer of `words`, `[DONE]` included."""
    kind = "chat.completion.chunk" if chat else "text_completion"
    base = {"id": "cmpl-fast", "object": kind, "created": 0, "model": model}
    events: list[dict[str, Any]] = []
    if chat:
        events.append({**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                            "finish_reason": None}]})  # fmt: skip
    for i, word in enumerate(words):
        last = i == len(words) - 1
        part: dict[str, Any] = {"content": word} if chat else {"text": word}
        choice = {"index": 0, ("delta" if chat else "text"): part if chat else word,
                  "finish_reason": "stop" if last else None}  # fmt: skip
        events.append({**base, "choices": [choice], **({"usage": None} if include_usage else {})})
    if include_usage:
        usage = {"prompt_tokens": 5, "completion_tokens": len(words), "total_tokens": 5 + len(words)}
        events.append({**base, "choices": [], "usage": usage})
    return [b"data: " + orjson.dumps(e) + b"\n\n" for e in events] + [b"data: [DONE]\n\n"]


def _response(status: int, body: bytes, content_type: bytes = b"application/json") -> bytes:
    head = b"HTTP/1.1 %d OK\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n"
    return head % (status, content_type, len(body)) + body


class _Connection(asyncio.Protocol):
    """One keep-alive client connection."""

    def __init__(self, stats: dict[str, int], gap: float, tokens: int, hold_head: bool = False) -> None:
        self._gap = gap  # seconds between streamed events (0: the whole stream in one write)
        self._hold_head = hold_head  # paced: the head and role chunk leave with the first word
        self._words = tuple(f" w{i}" for i in range(tokens)) if gap else _WORDS
        self._paced_events = 0
        self._parser = httptools.HttpRequestParser(self)
        self._stats = stats
        self._transport: asyncio.Transport | None = None
        self._url = b""
        self._body: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError:
            assert self._transport is not None
            self._transport.write(_response(400, b'{"error":{"message":"bad request"}}'))
            self._transport.close()

    def on_url(self, url: bytes) -> None:
        self._url = url

    def on_message_begin(self) -> None:
        self._body = []

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        assert self._transport is not None
        answer = self._answer(self._url.split(b"?")[0], b"".join(self._body))
        if isinstance(answer, list):
            asyncio.get_running_loop().create_task(self._paced(answer))
        else:
            self._transport.write(answer)

    async def _paced(self, events: list[bytes]) -> None:
        """One event per HTTP chunk, `gap` apart, as tokens come; what follows the last token (the
        usage chunk, `[DONE]`) comes with it, as from an engine. The client waits for the end
        before its next request."""
        transport = self._transport
        assert transport is not None
        held = [b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"]
        paced = self._paced_events  # the role chunk (chat) and the words: a gap before each but the first
        # what waits for the first word with --hold-head (the words are the last `tokens` paced events)
        holding = paced - len(self._words) if self._hold_head else -1
        for i, event in enumerate(events):
            if 0 < i < paced:
                await asyncio.sleep(self._gap)
            if transport.is_closing():
                return
            held.append(b"%x\r\n%s\r\n" % (len(event), event))
            if i >= holding:
                transport.write(b"".join(held))
                held.clear()
        transport.write(b"0\r\n\r\n")

    def _answer(self, path: bytes, raw: bytes) -> bytes | list[bytes]:
        if path == b"/health":
            return _response(200, b'{"status":"ready"}')
        if path == b"/stats":
            return _response(200, orjson.dumps(self._stats))
        if path not in (b"/v1/chat/completions", b"/v1/completions"):
            return _response(404, b'{"error":{"message":"not found","type":"invalid_request_error"}}')
        self._stats["requests"] += 1
        body = orjson.loads(raw) if raw else {}
        chat = path == b"/v1/chat/completions"
        model = str(body.get("model", "fake-model"))
        if body.get("stream"):
            usage = bool((body.get("stream_options") or {}).get("include_usage"))
            if self._gap:
                self._paced_events = len(self._words) + (1 if chat else 0)
                return _events(chat, model, usage, self._words)
            return _response(200, _stream(chat, model, usage), b"text/event-stream")
        return _response(200, _completion(chat, model))


async def serve(host: str, port: int, gap: float = 0.0, tokens: int = 20, hold_head: bool = False) -> None:
    """Serve until cancelled."""
    stats = {"requests": 0}
    loop = asyncio.get_running_loop()
    server = await loop.create_server(
        lambda: _Connection(stats, gap, tokens, hold_head), host, port, backlog=1024
    )
    async with server:
        await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9001)
    parser.add_argument("--gap-ms", type=float, default=0.0, help="pace streamed events this far apart")
    parser.add_argument("--tokens", type=int, default=20, help="content chunks per paced stream")
    parser.add_argument(
        "--hold-head", action="store_true", help="paced: send the head with the first word, not before"
    )
    args = parser.parse_args()
    uvloop.run(serve(args.host, args.port, args.gap_ms / 1e3, args.tokens, args.hold_head))


if __name__ == "__main__":
    main()
