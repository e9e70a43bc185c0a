"""A hostile OpenAI-compatible upstream on loopback: raw asyncio HTTP, so every byte and cut is ours.

It answers `POST /v1/chat/completions` and `POST /v1/completions` like an OpenAI server, unless the
request picks a misbehaviour. The mode comes from the last message's content (or the prompt):
the text `mode=NAME` or `mode=NAME:ARG` anywhere in it, so parallel requests (a fuzz run) each
choose their own; otherwise the mode set by `POST /control {"mode": "NAME[:ARG]"}` applies
(default `ok`). Modes, for whole answers and streams alike unless said:

  ok                 an honest answer with usage
  bad_utf8           invalid UTF-8 inside the answer text (a stream line, or the whole body)
  long_line:MIB      the answer text is MIB MiB long (one SSE line, or one whole body)
  usage:KIND         usage that is negative, huge (2**40), string, lots ("usage": "lots"), float,
                     null, mismatch (parts do not add up), cached (cached > prompt), int32 (2**31)
  truncate           a stream that ends cleanly (last chunk, connection closed) before data: [DONE];
                     a whole body cut in the middle of its Content-Length
  cut                a stream closed after two events without the chunked body's end (FIN, no RST)
  reset              a TCP reset (RST) after the first events / after half the body
  not_json           200 whose body is not JSON (a stream: an SSE line that is not JSON)
  json_list          200 whose body is a JSON list (a stream: a data: line holding a list)
  slow:MS            the whole response, one byte every MS milliseconds
  stall              the headers (and, for a stream, one event), then nothing until the caller leaves
  stall_first        nothing at all until the caller leaves (not even headers)
  huge:MIB           a whole body of MIB MiB (valid JSON)
  huge_chunked:MIB   a whole body of MIB MiB, chunked (no Content-Length)
  content_type       right bytes, wrong content-type (text/html)
  status:CODE        that HTTP status with a non-JSON body
  error_event        a stream whose second event is an error object, then [DONE]
  first_not_json     a stream whose first event after the role chunk (its first token's) is not JSON
  odd_chunk          a stream opening with role chunks of the wrong shapes (choices 7, delta a string)
  html               a stream answered 200 with an HTML page that names an internal host
  after_done         a stream that goes on after its [DONE]: text, a second usage, [DONE] again
  stall_after_done   a stream whose [DONE] comes, then nothing (no end of its body) until the caller leaves
  role_spam          a stream of 200 role-only chunks before its text
  two_usage          a stream with a believable usage chunk, then an unbelievable one (2**40)
  big_stream:MIB     a stream of MIB one-MiB text chunks, no usage
  early_usage        a stream whose (small, believable) usage comes before 400 more words, none after
  huge_head          a response head that never ends (256 KiB of one header, then the close)
  error_leak:CODE    that status with an OpenAI error naming an internal host, plus extra fields
  rate_limited:WAIT  429 with an OpenAI rate_limit_error and `Retry-After: WAIT` (`date`: an
                     HTTP-date, `none`: no header; anything else as it is)
  overloaded:WAIT    likewise, a 503 `server_overloaded` (an engine at its request limit)
  redirect:CODE_PORT that redirect status (301, 302, 307, 308) to http://127.0.0.1:PORT (an attacker's
                     server, which must never receive the request)
  shape:KIND         a whole 200 JSON object of the wrong shape (SHAPES: no choices, choices a string,
                     a null choice, a null message, a number as content, {})
  echo_auth          400 with an OpenAI error whose message echoes the request's Authorization header
                     (a stream: its second event is that error, as an `invalid_request_error` event)

`GET /stats` lists every request received (method, path, headers, body as text) and how many
connections the fake cut itself; `GET /seen/TOKEN` says whether a received body held TOKEN;
`POST /reset` forgets them; `GET /health` is 200.

Run: python tests/fakes/hostile_upstream.py --port 9002
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import re
import socket
import struct
from dataclasses import dataclass, field
from typing import Any

import orjson

MODE = re.compile(r"mode=([a-z_0-9]+)(?::([0-9a-z_]+))?")
BAD_UTF8 = b"\xff\xfe\xc3(\xed\xa0\x80"  # a stray byte, a broken sequence, an encoded surrogate
RECORDED_BODY_BYTES = 1 << 20  # what /stats keeps of each request body

SHAPES: dict[str, Any] = {
    "no_choices": {
        "id": "x",
        "object": "chat.completion",
        "usage": {"prompt_tokens": 5, "completion_tokens": 3},
    },
    "choices_string": {"id": "x", "choices": "nope"},
    "choice_null": {"id": "x", "choices": [None]},
    "message_null": {"id": "x", "choices": [{"index": 0, "message": None, "finish_reason": "stop"}]},
    "content_number": {
        "id": "x",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": 12345}}],
    },
    "empty": {},
}

USAGE: dict[str, Any] = {
    "negative": {"prompt_tokens": -1_000_000, "completion_tokens": -5, "total_tokens": -1_000_005},
    "huge": {"prompt_tokens": 1 << 40, "completion_tokens": 1 << 40, "total_tokens": 1 << 41},
    "int32": {"prompt_tokens": 1 << 31, "completion_tokens": 1, "total_tokens": (1 << 31) + 1},
    "string": {"prompt_tokens": "12", "completion_tokens": "3", "total_tokens": "15"},
    "lots": "lots",
    "float": {"prompt_tokens": 1.5, "completion_tokens": 2.25, "total_tokens": 3.75},
    "null": None,
    "mismatch": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 999},
    "cached": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5,
               "prompt_tokens_details": {"cached_tokens": 50}},
    "bool": {"prompt_tokens": True, "completion_tokens": False, "total_tokens": 1},
    "list": [1, 2, 3],
}  # fmt: skip


@dataclass
class Request:
    """One parsed HTTP request."""

    method: str
    path: str
    headers: dict[str, str]
    body: bytes


@dataclass
class HostileUpstream:
    """The server's state: the default mode, what it received, the connections it cut."""

    mode: str = "ok"
    requests: list[dict[str, Any]] = field(default_factory=list)
    cuts: int = 0  # connections reset or closed mid-answer by the fake
    stalls: int = 0  # requests answered with a stall
    _server: asyncio.Server | None = None

    async def start(self, host: str, port: int) -> None:
        """Listen on host:port."""
        self._server = await asyncio.start_server(self._connection, host, port, limit=1 << 20)

    async def serve_forever(self) -> None:
        """Serve until cancelled."""
        assert self._server is not None
        async with self._server:
            await self._server.serve_forever()

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:  # keep-alive: one request after another until a mode closes the connection
                request = await _read_request(reader)
                if request is None:
                    break
                if not await self._dispatch(request, reader, writer):
                    break
        except (ConnectionError, asyncio.IncompleteReadError, ValueError):
            pass  # the caller left or sent garbage: nothing to answer
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError, OSError):
                await writer.wait_closed()

    async def _dispatch(
        self, request: Request, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> bool:
        """Answer one request; False: the connection is finished."""
        if request.method == "GET" and request.path == "/health":
            return await _send(writer, 200, b'{"status":"ready"}')
        if request.method == "GET" and request.path == "/stats":
            return await _send(
                writer,
                200,
                orjson.dumps({"requests": self.requests, "cuts": self.cuts, "stalls": self.stalls}),
            )
        if request.method == "GET" and request.path.startswith("/seen/"):
            token = request.path.removeprefix("/seen/")
            seen = any(token in r["body"] for r in self.requests)
            return await _send(writer, 200, orjson.dumps({"seen": seen}))
        if request.method == "POST" and request.path == "/reset":
            self.requests.clear()
            self.cuts = self.stalls = 0
            return await _send(writer, 200, b"{}")
        if request.method == "POST" and request.path == "/control":
            self.mode = str(orjson.loads(request.body).get("mode") or "ok")
            return await _send(writer, 200, orjson.dumps({"mode": self.mode}))
        if request.method == "GET" and request.path.endswith("/models"):
            data = [{"id": "fake-model", "object": "model", "created": 0, "owned_by": "fake"}]
            return await _send(writer, 200, orjson.dumps({"object": "list", "data": data}))
        if request.method == "POST" and request.path.endswith("/completions"):
            self.requests.append({
                "method": request.method, "path": request.path, "headers": request.headers,
                "body": request.body[:RECORDED_BODY_BYTES].decode("utf-8", "replace"),
            })  # fmt: skip
            return await self._complete(request, reader, writer)
        return await _send(writer, 404, b'{"error":{"message":"not found","type":"invalid_request_error"}}')

    async def _complete(
        self, request: Request, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> bool:
        try:
            body = orjson.loads(request.body)
        except orjson.JSONDecodeError:
            body = {}
        body = body if isinstance(body, dict) else {}
        chat = request.path.endswith("chat/completions")
        name, arg = _mode(body, chat, self.mode)
        answer = Answer(body, chat, name, arg, request.headers.get("authorization", ""))
        if name in ("stall", "stall_first"):
            self.stalls += 1
        if body.get("stream") is True:
            return await self._stream(answer, reader, writer)
        return await self._whole(answer, reader, writer)

    async def _whole(self, a: Answer, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        mode, arg = a.mode, a.arg
        if mode in ("huge_head", "error_leak", "rate_limited", "overloaded", "redirect"):
            return await _hostile_head(writer, mode, arg)
        if mode == "echo_auth":
            return await _send(writer, 400, orjson.dumps({"error": a.echoed_auth()}))
        if mode == "shape":
            return await _send(writer, 200, orjson.dumps(SHAPES.get(arg or "empty", {})))
        if mode == "status":
            return await _send(writer, int(arg or 500), b"<html>upstream exploded</html>", "text/html")
        if mode == "not_json":
            return await _send(writer, 200, b"this is not JSON at all")
        if mode == "json_list":
            return await _send(writer, 200, b"[1, 2, 3]")
        if mode == "stall_first":
            return await self._stall(reader)
        if mode == "huge":
            text = "x" * (int(arg or 80) << 20)
            return await _send(writer, 200, orjson.dumps(a.whole(text)))
        if mode == "huge_chunked":  # no Content-Length to refuse it by: 1 MiB chunks, unbounded
            writer.write(_head(200, "application/json", None) + _chunk(b'{"choices":[{"text":"'))
            for _ in range(int(arg or 80)):
                writer.write(_chunk(b"x" * (1 << 20)))
                await writer.drain()
            writer.write(_chunk(b'"}]}') + b"0\r\n\r\n")
            await writer.drain()
            return True
        if mode == "long_line":
            return await _send(writer, 200, orjson.dumps(a.whole("y" * (int(arg or 1) << 20))))
        if mode == "bad_utf8":
            body = orjson.dumps(a.whole("MARKER")).replace(b"MARKER", b"ok " + BAD_UTF8)
            return await _send(writer, 200, body)
        payload = orjson.dumps(a.whole(a.text))
        if mode == "content_type":
            return await _send(writer, 200, payload, "text/html")
        if mode in ("truncate", "cut"):
            head = _head(200, "application/json", len(payload))
            writer.write(head + payload[: len(payload) // 2])
            await writer.drain()
            return False  # closed with half the promised bytes
        if mode == "reset":
            writer.write(_head(200, "application/json", len(payload)) + payload[: len(payload) // 2])
            await writer.drain()
            self._reset(writer)
            return False
        if mode == "slow":
            return await self._slow(writer, _head(200, "application/json", len(payload)) + payload, arg)
        if mode == "stall":
            writer.write(_head(200, "application/json", len(payload)) + payload[:10])
            await writer.drain()
            return await self._stall(reader)
        return await _send(writer, 200, payload)

    async def _stream(self, a: Answer, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        mode, arg = a.mode, a.arg
        if mode in ("huge_head", "error_leak", "rate_limited", "overloaded", "redirect"):
            return await _hostile_head(writer, mode, arg)
        if mode == "html":
            page = b"<html><body>Internal upstream http://10.9.8.7:9999 db=secret</body></html>\n"
            writer.write(_head(200, "text/html", None) + _chunk(page) + b"0\r\n\r\n")
            await writer.drain()
            return True
        if mode == "status":
            return await _send(writer, int(arg or 500), b"upstream exploded", "text/plain")
        if mode == "stall_first":
            return await self._stall(reader)
        events = a.events()
        if mode == "slow":
            raw = _head(200, "text/event-stream", len(b"".join(events))) + b"".join(events)
            return await self._slow(writer, raw, arg)
        content_type = "text/html" if mode == "content_type" else "text/event-stream"
        writer.write(_head(200, content_type, None))
        for i, event in enumerate(events):
            if i == 2 and mode == "reset":
                await writer.drain()
                self._reset(writer)
                return False
            if i == 2 and mode == "cut":  # closed without the chunked body's end
                await writer.drain()
                self.cuts += 1
                return False
            if i == 2 and mode == "stall":
                writer.write(_chunk(event))
                await writer.drain()
                return await self._stall(reader)
            if mode == "truncate" and event == b"data: [DONE]\n\n":
                break
            writer.write(_chunk(event))
            await writer.drain()
            if mode == "stall_after_done" and event == b"data: [DONE]\n\n":
                return await self._stall(reader)
        writer.write(b"0\r\n\r\n")  # the chunked body ends cleanly, whatever the events said
        await writer.drain()
        return mode not in ("truncate",)

    def _reset(self, writer: asyncio.StreamWriter) -> None:
        """Close with a TCP RST (SO_LINGER 0), as a crashed upstream would."""
        self.cuts += 1
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.transport.abort()

    async def _slow(self, writer: asyncio.StreamWriter, raw: bytes, arg: str | None) -> bool:
        delay = int(arg or 100) / 1000
        for i in range(len(raw)):
            writer.write(raw[i : i + 1])
            await writer.drain()
            await asyncio.sleep(delay)
        return True

    async def _stall(self, reader: asyncio.StreamReader) -> bool:
        """Say nothing more until the caller closes the connection (or 10 minutes pass)."""
        with contextlib.suppress(TimeoutError, ConnectionError):
            await asyncio.wait_for(reader.read(), 600)  # returns at the caller's EOF
        return False


class Answer:
    """The completion one request gets: its text, the whole body and the SSE events, per mode."""

    def __init__(self, body: dict[str, Any], chat: bool, mode: str, arg: str | None, auth: str = "") -> None:
        self.chat, self.mode, self.arg, self.auth = chat, mode, arg, auth
        model = body.get("model")
        self.model = model if isinstance(model, str) else "fake-model"
        self.text = "echo: hostile"
        self.usage: Any = {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}
        if mode == "usage":
            self.usage = USAGE.get(arg or "negative", USAGE["negative"])

    def whole(self, text: str) -> dict[str, Any]:
        """The non-streamed answer carrying `text`."""
        if self.chat:
            choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text},
                                      "finish_reason": "stop"}  # fmt: skip
        else:
            choice = {"index": 0, "text": text, "finish_reason": "stop", "logprobs": None}
        return {"id": "hostile-1", "object": "chat.completion" if self.chat else "text_completion",
                "created": 0, "model": self.model, "choices": [choice], "usage": self.usage}  # fmt: skip

    def echoed_auth(self) -> dict[str, Any]:
        """An OpenAI error that tells the caller the Authorization header it sent (a careless engine's)."""
        key = self.auth.removeprefix("Bearer ")  # the key alone: only its value can be masked
        return {"message": f"invalid key presented: {key} (expected another)",
                "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}  # fmt: skip

    def _event(self, delta: str | None, finish: str | None = None) -> bytes:
        if self.chat:
            d: dict[str, Any] = {} if delta is None else {"content": delta}
            choice: dict[str, Any] = {"index": 0, "delta": d, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": delta or "", "finish_reason": finish}
        chunk = {"id": "hostile-1", "object": "chat.completion.chunk" if self.chat else "text_completion",
                 "created": 0, "model": self.model, "choices": [choice]}  # fmt: skip
        return b"data: " + orjson.dumps(chunk) + b"\n\n"

    def events(self) -> list[bytes]:
        """The stream's SSE events, [DONE] included."""
        mode, arg = self.mode, self.arg
        out = []
        if self.chat:
            role = {"id": "hostile-1", "object": "chat.completion.chunk", "created": 0, "model": self.model,
                    "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                 "finish_reason": None}]}  # fmt: skip
            out.append(b"data: " + orjson.dumps(role) + b"\n\n")
        if mode == "empty":  # nothing to say: the end arrives with the first event after the role
            return [*out, b"data: [DONE]\n\n"]
        if mode == "first_not_json":
            return [*out, b"data: {this is not json\n\n", b"data: [DONE]\n\n"]
        out.append(self._event("echo:"))
        if mode == "bad_utf8":
            out.append(self._event("MARKER").replace(b"MARKER", b" bad " + BAD_UTF8))
        elif mode == "long_line":
            out.append(self._event(" " + "z" * (int(arg or 1) << 20)))
        elif mode == "not_json":
            out.append(b"data: {this is not json\n\n")
        elif mode == "json_list":
            out.append(b"data: [1, 2, 3]\n\n")
        elif mode == "odd_chunk":  # a role chunk whose shapes are wrong: choices not a list, delta a string
            out.insert(0, b'data: {"role":"assistant","choices":7}\n\n')
            out.insert(1, b'data: {"role":"assistant","choices":[{"index":0,"delta":"text"}]}\n\n')
        elif mode == "role_spam":
            out[1:1] = out[:1] * 200
        elif mode == "big_stream":
            out.extend(self._event("B" * (1 << 20)) for _ in range(int(arg or 1)))
        elif mode == "early_usage":  # a small believable usage first, then most of the answer
            early = {"id": "hostile-1", "object": "chat.completion.chunk" if self.chat else "text_completion",
                     "created": 0, "model": self.model, "choices": [], "usage": self.usage}  # fmt: skip
            out.append(b"data: " + orjson.dumps(early) + b"\n\n")
            out.extend(self._event(" word") for _ in range(400))
        elif mode == "error_event":
            error = {"error": {"message": "upstream failed mid-way", "type": "api_error", "code": None}}
            out.append(b"data: " + orjson.dumps(error) + b"\n\n")
        elif mode == "echo_auth":
            out.append(b"data: " + orjson.dumps({"error": self.echoed_auth()}) + b"\n\n")
        out.append(self._event(" hostile"))
        out.append(self._event(None, "stop"))
        usage = {"id": "hostile-1", "object": "chat.completion.chunk" if self.chat else "text_completion",
                 "created": 0, "model": self.model, "choices": [], "usage": self.usage}  # fmt: skip
        if mode not in ("big_stream", "early_usage"):  # (its count is the gateway's to make)
            out.append(b"data: " + orjson.dumps(usage) + b"\n\n")
        if mode == "two_usage":
            later = {**usage, "usage": USAGE["huge"]}
            out.append(b"data: " + orjson.dumps(later) + b"\n\n")
        out.append(b"data: [DONE]\n\n")
        if mode == "after_done":
            out.append(self._event(" INJECTED after done"))
            injected = {"prompt_tokens": 4, "completion_tokens": 5, "total_tokens": 9}
            out.append(b"data: " + orjson.dumps({**usage, "usage": injected}) + b"\n\n")
            out.append(b"data: [DONE]\n\n")
        return out


def _mode(body: dict[str, Any], chat: bool, default: str) -> tuple[str, str | None]:
    """The misbehaviour a request asks for (in its last message or prompt), else the default."""
    text: Any = None
    if chat:
        messages = body.get("messages")
        if isinstance(messages, list) and messages and isinstance(messages[-1], dict):
            text = messages[-1].get("content")
    else:
        text = body.get("prompt")
    found = MODE.search(text) if isinstance(text, str) else None
    if found is None:
        found = MODE.search("mode=" + default)
    assert found is not None
    return found.group(1), found.group(2)


async def _read_request(reader: asyncio.StreamReader) -> Request | None:
    """One HTTP/1.1 request (Content-Length or chunked body); None at a clean end of the connection."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError as exc:
        if exc.partial.strip():
            raise
        return None
    lines = head.decode("latin-1").split("\r\n")
    method, target, _ = lines[0].split(" ", 2)
    path = target.partition("?")[0]  # Azure's SDK sends ?api-version=
    headers = {}
    for line in lines[1:]:
        if line:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
    if headers.get("transfer-encoding", "").lower() == "chunked":
        parts = []
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
            parts.append(await reader.readexactly(size + 2))
            if size == 0:
                break
        body = b"".join(p[:-2] for p in parts)
    else:
        body = await reader.readexactly(int(headers.get("content-length", "0")))
    return Request(method, path, headers, body)


async def _hostile_head(writer: asyncio.StreamWriter, mode: str, arg: str | None) -> bool:
    """huge_head: a header that never ends; error_leak: an error that tells too much;
    rate_limited: a 429 with the Retry-After asked for."""
    if mode in ("rate_limited", "overloaded"):
        wait = {"date": "Wed, 21 Oct 2015 07:28:00 GMT", "none": None}.get(arg or "none", arg)
        if mode == "rate_limited":
            status, error = 429, {"message": "Rate limit reached", "type": "rate_limit_error", "param": None,
                                  "code": None}  # fmt: skip
        else:
            status, error = 503, {"message": "at the request limit", "type": "server_error", "param": None,
                                  "code": "server_overloaded"}  # fmt: skip
        body = orjson.dumps({"error": error})
        extra = "" if wait is None else f"retry-after: {wait}\r\n"
        head = _head(status, "application/json", len(body)).removesuffix(b"\r\n")
        writer.write(head + extra.encode() + b"\r\n" + body)
        await writer.drain()
        return True
    if mode == "redirect":
        code, _, port = (arg or "307_9").partition("_")
        location = f"location: http://127.0.0.1:{port}/v1/chat/completions\r\n"
        writer.write(_head(int(code), "text/plain", 0).removesuffix(b"\r\n") + location.encode() + b"\r\n")
        await writer.drain()
        return True
    if mode == "huge_head":
        writer.write(b"HTTP/1.1 200 OK\r\nx-big: ")
        for _ in range(64):
            writer.write(b"a" * 4096)
            await writer.drain()
        return False
    host, port = writer.get_extra_info("sockname")[:2]
    error = {
        "message": "failed at http://10.0.0.5:8001/internal token=abc on gpu-7.internal,"
        f" replica {host}:{port} (node 10.0.3.17)",
        "type": "invalid_request_error",
        "param": None,
        "code": "bad_thing",
        "internal_url": "http://10.0.0.5",
    }
    body = orjson.dumps({"error": error, "debug": {"host": "gpu-7.internal"}})
    return await _send(writer, int(arg or 400), body)


def _head(status: int, content_type: str, length: int | None) -> bytes:
    framing = f"content-length: {length}" if length is not None else "transfer-encoding: chunked"
    return f"HTTP/1.1 {status} X\r\ncontent-type: {content_type}\r\n{framing}\r\n\r\n".encode()


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n" % len(data) + data + b"\r\n"


async def _send(
    writer: asyncio.StreamWriter, status: int, body: bytes, content_type: str = "application/json"
) -> bool:
    writer.write(_head(status, content_type, len(body)) + body)
    await writer.drain()
    return True


async def _main(port: int) -> None:
    upstream = HostileUpstream()
    await upstream.start("127.0.0.1", port)
    await upstream.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--port", type=int, required=True)
    asyncio.run(_main(parser.parse_args().port))


if __name__ == "__main__":
    main()
