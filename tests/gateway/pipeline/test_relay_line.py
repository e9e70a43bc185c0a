"""relay_line's bookkeeping of one upstream event, without processes: the usage it keeps."""

from __future__ import annotations

import time
import uuid
from datetime import UTC, datetime

import orjson

from gateway.governance.keys import KeyInfo
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
