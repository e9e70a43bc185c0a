"""A stream's head written where failover found its first token (pipeline/relay.py `EarlyHead`):
the client gets each event once and in order, the relay goes on after it with the same token record,
and what the early path cannot take (a full socket, the stream's end in the head, a broken line)
ends as it did before."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime

import orjson

from gateway.backends.base import UpstreamStream
from gateway.governance.keys import KeyInfo
from gateway.pipeline.call import Call
from gateway.pipeline.relay import EarlyHead, relay
from gateway.pipeline.reply import Outlet
from gateway.pipeline.resume import TOKEN_IDS
from gateway.pipeline.served import Served

ROLE = 'data: {"id":"c1","choices":[{"index":0,"delta":{"role":"assistant"}}]}'
DONE = "data: [DONE]"


def _word(i: int) -> str:
    return (
        "data: "
        + orjson.dumps({"id": "c1", "choices": [{"index": 0, "delta": {"content": f" w{i}"}}]}).decode()
    )


class _Client:
    """The endpoint's writer: takes every part while `open`."""

    def __init__(self, open_: bool = True) -> None:
        self.open = open_
        self.out: list[bytes] = []

    def writable(self) -> bool:
        return self.open

    def write_part(self, body: bytes) -> None:
        self.out.append(body)


def _call() -> Call:
    key = KeyInfo(uuid.uuid4().hex, "k", "sk-test", None, None, {}, datetime.now(UTC), None, None, None)
    return Call("req-1", key, time.perf_counter(), datetime.now(UTC), model="m", stream=True)


def _served(head: list[str], rest: list[str]) -> Served:
    async def lines() -> AsyncIterator[str]:
        for line in rest:
            await asyncio.sleep(0)
            yield line

    stream = UpstreamStream(200, lines(), b"", "http://replica")
    return Served("m", "pool", "http://replica", [], stream=stream, head=head)


def _run(call: Call, early: EarlyHead | None, client: _Client, head: list[str], rest: list[str],
         resumable: bool = False) -> tuple[list[bytes], list[bytes], list[int]]:  # fmt: skip
    """Failover's moment (`early` told the head), then the relay: what the writer got before the
    relay started, what the relay yielded, and the statuses it ended with."""
    ended: list[int] = []

    async def main() -> tuple[list[bytes], list[bytes]]:
        if early is not None:
            early.writer = client
            early(head, resumable)
        before = list(client.out)
        outlet = Outlet()  # the relay's own middle goes through its generator here
        events = relay(call, _served(head, rest), True, lambda c, status, error: ended.append(status),
                       outlet, early)  # fmt: skip
        return before, [event async for event in events]

    before, yielded = asyncio.run(main())
    return before, yielded, ended


def _words(parts: list[bytes]) -> list[str]:
    """The words of the events in `parts` (a part may hold several events), in order."""
    events = [e for part in parts for e in part.split(b"\n\n") if e and e != b"data: [DONE]"]
    deltas = [orjson.loads(e[6:])["choices"][0]["delta"] for e in events]
    return [d["content"] for d in deltas if "content" in d]


def test_the_first_token_is_written_before_the_relay_starts_and_not_again() -> None:
    call = _call()
    early = EarlyHead(call, True)
    before, yielded, ended = _run(call, early, _Client(), [ROLE, _word(0)], [_word(1), _word(2), DONE])
    assert early.relayed and len(before) == 1  # the role chunk and the first word, one write
    assert _words(before) == [" w0"] and before[0].startswith(ROLE.encode() + b"\n\n")
    assert _words(yielded) == [" w1", " w2"] and yielded[-1] == b"data: [DONE]\n\n"
    assert ended[0] == 200
    assert call.ttft is not None and len(call.lines) == 4  # every event counted once for the log


def test_without_an_early_head_the_relay_sends_the_head_as_before() -> None:
    call = _call()
    before, yielded, _ = _run(call, None, _Client(), [ROLE, _word(0)], [_word(1), DONE])
    assert before == [] and _words(yielded) == [" w0", " w1"]


def test_a_client_whose_socket_is_full_gets_the_head_from_the_relay() -> None:
    call = _call()
    early = EarlyHead(call, True)
    before, yielded, _ = _run(call, early, _Client(open_=False), [ROLE, _word(0)], [_word(1), DONE])
    assert not early.relayed and before == []
    assert _words(yielded) == [" w0", " w1"]  # the relay's own head event: nothing lost or repeated


def test_a_head_that_holds_the_streams_end_is_left_to_the_relay() -> None:
    # the release of the request's reservations must come before the client has [DONE]
    call = _call()
    early = EarlyHead(call, True)
    before, yielded, ended = _run(call, early, _Client(), [ROLE, DONE], [])
    assert not early.relayed and before == [] and yielded == [ROLE.encode() + b"\n\ndata: [DONE]\n\n"]
    assert ended[0] == 200


def test_a_broken_first_token_line_ends_the_stream_with_an_error_event_after_what_went_before() -> None:
    call = _call()
    early = EarlyHead(call, True)
    before, yielded, ended = _run(call, early, _Client(), [ROLE, "data: {not json"], [_word(1), DONE])
    assert early.relayed and before == [ROLE.encode() + b"\n\n"]  # the role chunk was the client's
    error = orjson.loads(yielded[-1][6:])["error"]
    assert error["code"] == "upstream_stream_error" and ended[0] == 502
    assert b"w1" not in b"".join(yielded)


def test_a_resumable_streams_token_record_carries_over_to_the_relay() -> None:
    call = _call()
    early = EarlyHead(call, True)
    head = [ROLE, TOKEN_IDS + "0 7", _word(0)]
    before, yielded, _ = _run(
        call, early, _Client(), head, [TOKEN_IDS + "0 8", _word(1), DONE], resumable=True
    )
    assert early.tokens is not None and _words(before) == [" w0"] and _words(yielded) == [" w1"]
    assert early.tokens.token_ids == [7, 8]  # the head's ids and the relay's, in one record
