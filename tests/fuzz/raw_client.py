"""A raw HTTP/1.1 client over asyncio sockets: any header bytes, and a cut at any phase.

httpx refuses to send invalid header bytes and cannot stop halfway through a body; this client
writes the request itself and reads the answer until the server closes (`connection: close`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

from tests.fuzz.answers import Answer
from tests.fuzz.cases import MAX_BODY, Case


async def send(
    host: str,
    port: int,
    case: Case,
    key: str | None,
    upstream_saw: Callable[[str], Awaitable[bool]],
    timeout: float = 60.0,
) -> Answer:
    """Send `case`, cut where it says, and return what came back (status None: nothing did)."""
    reader, writer = await asyncio.open_connection(host, port)
    try:
        head = [b"POST " + case.path.encode() + b" HTTP/1.1", b"host: " + f"{host}:{port}".encode(),
                b"connection: close", b"content-length: %d" % len(case.body)]  # fmt: skip
        if not any(name == b"content-type" for name, _ in case.headers):
            head.append(b"content-type: application/json")
        if key is not None:
            head.append(b"authorization: Bearer " + key.encode())
        head += [name + b": " + value for name, value in case.headers]
        writer.write(b"\r\n".join(head) + b"\r\n\r\n")
        if case.cut == "mid_body":
            writer.write(case.body[: len(case.body) // 2])
            await writer.drain()
            await asyncio.sleep(0.05)
            return Answer(None, error="cut mid-body (expected)")
        if len(case.body) > MAX_BODY:  # refused on its declared length: the 413 comes before the body
            return _parse(await asyncio.wait_for(reader.read(), timeout))
        writer.write(case.body)
        await writer.drain()
        if case.cut == "waiting":
            deadline = asyncio.get_running_loop().time() + 10
            while not await upstream_saw(case.token):  # then the proxy is surely waiting on it
                if asyncio.get_running_loop().time() > deadline:
                    break
                await asyncio.sleep(0.05)
            return Answer(None, error="cut while waiting (expected)")
        if case.cut == "mid_stream":  # leave once the first event is in (or the answer is whole)
            data = b""
            while b"data:" not in data.partition(b"\r\n\r\n")[2]:
                more = await asyncio.wait_for(reader.read(4096), timeout)
                if not more:
                    break
                data += more
            return Answer(None, body=data, error="cut mid-stream (expected)")
        raw = await asyncio.wait_for(reader.read(), timeout)
        return _parse(raw)
    except (ConnectionError, TimeoutError) as exc:
        return Answer(None, error=f"{type(exc).__name__}: {exc}")
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError, OSError):
            await writer.wait_closed()


def _parse(raw: bytes) -> Answer:
    """Status, headers and (de-chunked) body of a whole HTTP/1.1 response."""
    head, sep, body = raw.partition(b"\r\n\r\n")
    if not sep:
        return Answer(None, error=f"an incomplete response: {raw[:200]!r}")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ")[1])
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    if headers.get("transfer-encoding", "").lower() == "chunked":
        out, rest = bytearray(), body
        while True:
            size_line, sep, rest = rest.partition(b"\r\n")
            if not sep:
                return Answer(status, headers, bytes(out), "the chunked body was cut")
            size = int(size_line.split(b";")[0], 16)
            if size == 0:
                break
            out += rest[:size]
            rest = rest[size + 2 :]
        body = bytes(out)
    elif "content-length" in headers and len(body) != int(headers["content-length"]):
        return Answer(status, headers, body, f"{len(body)} of {headers['content-length']} bytes")
    return Answer(status, headers, body)
