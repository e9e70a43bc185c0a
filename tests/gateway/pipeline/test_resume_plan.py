"""The rules of stream resumption, without processes: what the client has (token id lines and the
chunks they belong to), when a stream may go on elsewhere, and how another replica is found."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any

import pytest

from gateway.backends.base import (
    UpstreamErrorEvent,
    UpstreamStream,
    UpstreamStreamError,
    UpstreamUnavailableError,
)
from gateway.config.policy import EngineBackend, Timeouts
from gateway.pipeline.resume import (
    ResumePlan,
    StreamTokens,
    break_reason,
    ended_early,
    resumable_body,
)
from gateway.telemetry.trace import NO_TRACE


def _chunk(content: str | None = None, finish: str | None = None, role: bool = False) -> dict[str, Any]:
    delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
    if content is not None:
        delta["content"] = content
    return {
        "id": "chatcmpl-1",
        "created": 7,
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }


def test_ids_count_once_the_chunk_they_precede_is_passed_on() -> None:
    tokens = StreamTokens()
    assert tokens.passes(_chunk(role=True)) and tokens.resumable  # the role chunk carries nothing
    tokens.announce(": token_ids 0 5,6")
    assert tokens.token_ids == [] and tokens.pending == [5, 6]
    assert tokens.passes(_chunk("Hello"))
    assert tokens.token_ids == [5, 6] and tokens.resumable
    assert (tokens.id, tokens.created) == ("chatcmpl-1", 7)
    tokens.passes(_chunk(" world"))  # text without its ids (an upstream that cut a delta apart)
    assert not tokens.resumable
    tokens.announce(": token_ids 0 7")
    tokens.passes(_chunk("!"))
    assert tokens.resumable and tokens.token_ids == [5, 6, 7]


def test_a_legacy_function_call_without_its_ids_is_output_the_client_has() -> None:
    """The engine answers a `functions` request with `delta.function_call` pieces: one that reached
    the client without its ids leaves the stream where no other replica can go on exactly."""
    tokens = StreamTokens()
    tokens.passes(_chunk(role=True))
    call = _chunk()
    call["choices"][0]["delta"] = {"function_call": {"name": "f", "arguments": "{}"}}
    tokens.passes(call)
    assert not tokens.resumable


def test_after_the_finish_a_choice_gets_nothing_more_but_usage_still_passes() -> None:
    tokens = StreamTokens()
    tokens.announce(": token_ids 0 1")
    tokens.passes(_chunk(finish="stop"))
    assert tokens.finished
    assert not tokens.passes(_chunk(finish="stop"))  # the repeat from the replica that went on
    assert tokens.passes({"id": "chatcmpl-1", "choices": [], "usage": {"completion_tokens": 1}})


@pytest.mark.parametrize(
    "line",
    [
        ": token_ids 1 5",
        ": token_ids 0 5,x",
        ": token_ids 0 ",
        ": token_ids 0 -1",
        f": token_ids 0 {1 << 31}",
        ": token_ids 0 " + "1," * 40_000 + "1",  # too long to parse on the event loop
    ],
)
def test_a_malformed_token_id_line_is_a_broken_stream(line: str) -> None:
    with pytest.raises(UpstreamStreamError):
        StreamTokens().announce(line)


def test_which_requests_can_be_resumed() -> None:
    assert resumable_body({"messages": []}) and resumable_body({"prompt": "x", "n": 1})
    assert resumable_body({"prompt": ["one prompt"]}) and resumable_body({"prompt": [1, 2, 3]})
    assert not resumable_body({"messages": [], "n": 2})
    assert not resumable_body({"prompt": "x", "best_of": 3})
    assert not resumable_body({"prompt": ["a", "b"]}) and not resumable_body({"prompt": [[1], [2]]})


def test_why_a_stream_broke_is_a_bounded_label() -> None:
    timeout = UpstreamStreamError("pool: timeout")
    timeout.__cause__ = TimeoutError()
    assert break_reason(timeout) == "timeout" and break_reason(TimeoutError()) == "timeout"
    assert break_reason(UpstreamErrorEvent("x")) == "error_event"
    assert break_reason(ended_early()) == "ended_early"
    assert break_reason(UpstreamStreamError("connection reset")) == "reset"


class _Pool:
    """An engine pool whose replicas answer the reopened stream as scripted."""

    name = "pool"

    def __init__(self, script: dict[str, int | str]) -> None:
        self.script = script
        self.calls: list[tuple[frozenset[str], dict[str, Any]]] = []
        self.timeouts: list[Timeouts | None] = []

    @asynccontextmanager
    async def stream(self, path: str, body: bytes, timeouts: Timeouts | None = None,
                     avoid: frozenset[str] = frozenset(), headers: Mapping[str, str] | None = None,
                     affinity: int | None = None) -> AsyncIterator[UpstreamStream]:  # fmt: skip
        import orjson

        self.calls.append((avoid, orjson.loads(body)))
        self.timeouts.append(timeouts)
        url = next((u for u in self.script if u not in avoid), None)
        if url is None:
            raise UpstreamUnavailableError("no replica left", timeout=False)
        if self.script[url] == "down":
            raise UpstreamUnavailableError("refused", timeout=False, deployment=url)

        async def lines() -> AsyncIterator[str]:
            yield "data: [DONE]"

        yield UpstreamStream(int(self.script[url]), lines(), b"", url)


def _plan(pool: _Pool, max_resumptions: int = 2, total: float = 60.0) -> ResumePlan:
    spec = EngineBackend(
        type="engine", urls=["http://a", "http://b", "http://c"], max_resumptions=max_resumptions
    )
    timeouts = Timeouts(total=total, between_tokens=2.5)
    return ResumePlan(pool, spec, "local", "/v1/chat/completions", {"model": "m", "stream": True}, timeouts)  # type: ignore[arg-type]


def _tokens() -> StreamTokens:
    tokens = StreamTokens()
    tokens.announce(": token_ids 0 3,4")
    tokens.passes(_chunk("hi"))
    return tokens


def test_reopening_skips_replicas_that_failed_or_refuse_and_sends_what_the_client_has() -> None:
    pool = _Pool({"http://a": 200, "http://b": "down", "http://c": 503, "http://d": 200})
    plan = _plan(pool)
    plan.failed.add("http://a")  # where the stream broke
    opened = asyncio.run(plan.reopen(_tokens(), time.perf_counter(), NO_TRACE))
    assert opened is not None and opened.stream.url == "http://d"
    assert plan.failed == {"http://a", "http://b", "http://c"} and plan.left == 1
    avoid, body = pool.calls[-1]
    assert body["resume"] == {"token_ids": [3, 4], "id": "chatcmpl-1", "created": 7}
    assert body["model"] == "m" and avoid == frozenset({"http://a", "http://b", "http://c"})
    # the pool's silence bound goes with it (was: the default 30 s on the replica it went on on)
    assert all(t is not None and t.between_tokens == 2.5 for t in pool.timeouts)
    asyncio.run(opened.owner.aclose())


def test_no_replica_left_means_no_resumption() -> None:
    plan = _plan(_Pool({"http://a": 200}))
    plan.failed.add("http://a")
    assert asyncio.run(plan.reopen(_tokens(), time.perf_counter(), NO_TRACE)) is None


def test_it_is_worth_it_only_with_resumptions_time_and_the_clients_position_left() -> None:
    now = time.perf_counter()
    assert _plan(_Pool({})).worth_it(_tokens(), now)
    assert not _plan(_Pool({}), max_resumptions=0).worth_it(_tokens(), now)
    assert not _plan(_Pool({}), total=5.0).worth_it(_tokens(), now - 4.5)  # half a second left
    unknown = _tokens()
    unknown.passes(_chunk(" there"))  # text without its ids
    assert not _plan(_Pool({})).worth_it(unknown, now)
