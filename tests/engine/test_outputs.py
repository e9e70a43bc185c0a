"""Deltas: folding later deltas in, and a request stream coalescing what a slow reader missed."""

from __future__ import annotations

import asyncio

from engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from engine.request_stream import RequestStream
from engine.sequence import Logprob


def _delta(
    index: int, text: str, tokens: list[int], finish: str | None = None, total: int = 0, n_done: bool = False
) -> RequestOutput:
    logprobs = [{t: Logprob(-1.0, 1, str(t))} for t in tokens]
    comp = CompletionOutput(index, text, tokens, finish, None, logprobs, -1.0 * total)
    return RequestOutput("r", "p", [1, 2], [comp], n_done, RequestMetrics(0.0), num_generated_tokens=total)


def test_add_concatenates_tokens_text_and_logprobs_and_the_last_finish_reason_wins() -> None:
    whole = _delta(0, "Hel", [7])
    whole.add(_delta(0, "lo", [8], total=2))
    whole.add(_delta(0, "!", [9], finish="length", total=3, n_done=True))
    (comp,) = whole.outputs
    assert (comp.text, comp.token_ids, comp.finish_reason) == ("Hello!", [7, 8, 9], "length")
    assert comp.logprobs is not None and [list(e) for e in comp.logprobs] == [[7], [8], [9]]
    assert comp.cumulative_logprob == -3.0 and whole.num_generated_tokens == 3 and whole.finished


def test_add_keeps_completions_in_index_order_and_leaves_the_later_delta_untouched() -> None:
    whole = _delta(1, "b", [2])
    later = _delta(0, "a", [1])
    whole.add(later)
    later.add(_delta(0, "x", [3]))
    assert [c.index for c in whole.outputs] == [0, 1]
    assert whole.outputs[0].text == "a" and whole.outputs[0].token_ids == [1]


def test_a_slow_reader_gets_the_missed_deltas_as_one() -> None:
    async def run() -> list[RequestOutput]:
        stream = RequestStream("r", lambda _id, _abort: None)
        stream.put(_delta(0, "a", [1], total=1))
        stream.put(_delta(0, "b", [2], total=2))
        stream.put(_delta(0, "c", [3], finish="stop", total=3, n_done=True))
        return [out async for out in stream]

    (out,) = asyncio.run(run())
    assert (out.text, out.token_ids, out.finish_reason, out.num_generated_tokens) == (
        "abc",
        [1, 2, 3],
        "stop",
        3,
    )
