"""relay_line's bookkeeping of one upstream event, without processes: the usage it keeps."""

from __future__ import annotations

import time
import uuid
from datetime import UTC, datetime

import orjson
import pytest

from gateway.governance.keys import KeyInfo
from gateway.governance.usage import max_prompt
from gateway.pipeline.call import Call
from gateway.pipeline.relay import relay_line


def test_a_legacy_function_call_after_the_usage_is_answer_the_usage_does_not_cover() -> None:
    """An upstream that sends usage before the rest of the answer: what follows is counted at the
    end; a legacy `functions` answer's `delta.function_call` is answer as tool_calls are."""
    key = KeyInfo(uuid.uuid4().hex, "k", "sk-test", None, None, {}, datetime.now(UTC), None, None, None)
    call = Call("req-1", key, time.perf_counter(), datetime.now(UTC), model="m")
    usage = {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}
    relay_line(call, "data: " + orjson.dumps({"choices": [], "usage": usage}).decode(), True)
    assert call.usage
    delta = {"function_call": {"name": "f", "arguments": '{"city": "Paris"}'}}
    chunk = {"choices": [{"index": 0, "delta": delta, "finish_reason": None}]}
    relay_line(call, "data: " + orjson.dumps(chunk).decode(), True)
    assert call.usage == {}


def test_an_engines_prompt_count_is_kept_for_the_log_never_relayed_and_only_when_plain() -> None:
    """`: prompt_tokens N` (the engine's templated prompt count) is the gateway's: not an event for the
    client, not its first token; a count that is not plain digits is ignored, as any stray comment
    line; the first counts (a resumed stream's replica tells the same again); and it is bounded as a
    reported usage is, by what the request's bytes could make (max_prompt)."""
    key = KeyInfo(uuid.uuid4().hex, "k", "sk-test", None, None, {}, datetime.now(UTC), None, None, None)
    call = Call("req-1", key, time.perf_counter(), datetime.now(UTC), model="m")
    assert relay_line(call, ": prompt_tokens 37", False) is None
    assert call.told_prompt_tokens == 37 and call.ttft is None
    for hostile in (
        "-1",
        "1e9",
        "123456789",
        "",
        "abc",
        "٣٧",
        "37 38",
        "0x25",
        " 99999999999999999999",
        "38",
    ):
        assert relay_line(call, ": prompt_tokens " + hostile, False) is None
        assert call.told_prompt_tokens == 37, hostile
    body = {"messages": [{"role": "user", "content": "hi"}]}
    bounded = Call("req-2", key, time.perf_counter(), datetime.now(UTC), model="m", body=body, body_bytes=60)
    relay_line(bounded, ": prompt_tokens 16777216", False)  # a hostile upstream's count for a short prompt
    limit = max_prompt(body, 60)
    assert limit is not None and bounded.told_prompt_tokens == limit < 1 << 24


@pytest.mark.parametrize("usage", ["lots", [1, 2], 7, True])
@pytest.mark.parametrize("wants_usage", [False, True])
def test_a_usage_that_is_not_an_object_never_reaches_the_client(usage: object, wants_usage: bool) -> None:
    # was: only an object was checked, so `"usage": "lots"` was relayed, even to a client that never
    # asked for usage
    key = KeyInfo(uuid.uuid4().hex, "k", "sk-test", None, None, {}, datetime.now(UTC), None, None, None)
    call = Call("req-1", key, time.perf_counter(), datetime.now(UTC), model="m")
    alone = "data: " + orjson.dumps({"id": "c", "choices": [], "usage": usage}).decode()
    assert relay_line(call, alone, wants_usage) is None
    beside = "data: " + orjson.dumps({"id": "c", "choices": [{"index": 0, "delta": {"content": "hi"}}],
                                      "usage": usage}).decode()  # fmt: skip
    event = relay_line(call, beside, wants_usage)
    assert event is not None and b"usage" not in event and b'"hi"' in event
    assert call.usage == {}


def test_a_flood_of_tiny_events_is_bounded_by_what_keeping_them_costs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A million `data: {}` are 8 MB of text and held 80 MB: each event counts what keeping it
    costs (LINE_COST) toward the stream's bound, not its characters alone."""
    from gateway.pipeline import relay

    monkeypatch.setattr(relay, "MAX_STREAM_CHARS", 100_000)
    key = KeyInfo(uuid.uuid4().hex, "k", "sk-test", None, None, {}, datetime.now(UTC), None, None, None)
    call = Call("req-1", key, time.perf_counter(), datetime.now(UTC), model="m")
    sent = 0
    with pytest.raises(relay.StreamTooLongError):
        while True:
            relay_line(call, "data: {}", False)
            sent += 1
    assert (
        sent * (len("data: {}") + relay.LINE_COST)
        <= 100_000
        < (sent + 1) * (len("data: {}") + relay.LINE_COST)
    )
