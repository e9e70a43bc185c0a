"""Finish: the release before the answer goes out, the row and the sinks once it is out (stamped
when the request ended), and a sink that fails costs its record, never the answer."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import uuid
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

import orjson
import pytest

from gateway.config.policy import parse_policy
from gateway.governance.budgets import Budget, Charge
from gateway.governance.costs import PriceBook
from gateway.governance.keys import KeyInfo
from gateway.pipeline.admission import Admission, Ticket
from gateway.pipeline.call import Call
from gateway.pipeline.failover import Failover
from gateway.pipeline.finish import Finish, estimated_usage
from gateway.pipeline.proxy import Proxy
from gateway.pipeline.runtime import Runtime, RuntimeHolder
from gateway.routing.router import Router
from gateway.store.models import to_picousd
from gateway.store.record import RequestRecord

POLICY = """
backends:
  local: {type: engine, urls: ["http://127.0.0.1:1"], price: {input_per_mtok: 1, output_per_mtok: 2}}
models:
  small: {backend: local}
"""


class Released(Admission):
    """Admission that notes each release (and when) instead of settling counters."""

    def __init__(self) -> None:
        super().__init__()
        self.released: list[tuple[float, Decimal | None]] = []

    def release(self, ticket: Ticket, usage: dict[str, Any], cost: Decimal | None) -> None:
        self.released.append((time.perf_counter(), cost))


class Sink:
    def __init__(self, fail: bool = False) -> None:
        self.records: list[tuple[float, RequestRecord]] = []
        self.fail = fail

    def record(self, rec: RequestRecord) -> None:
        if self.fail:
            raise RuntimeError("the sink broke")
        self.records.append((time.perf_counter(), rec))


def _finish(log: Sink, telemetry: list[Sink]) -> tuple[Finish, Released]:
    policy = parse_policy(POLICY)
    runtime = Runtime(
        policy, Router(policy), Failover(policy, {}), {}, "test", datetime.now(UTC), PriceBook(policy)
    )
    admission = Released()
    return Finish(RuntimeHolder(runtime), admission, log, telemetry), admission


def _served_call(finish: Finish) -> Call:
    key = KeyInfo(uuid.uuid4().hex, "k", "sk-test", None, None, {}, datetime.now(UTC), None, None, None)
    call = Call("req-1", key, time.perf_counter(), datetime.now(UTC), model="small")
    call.prices = finish.holder.runtime.prices
    call.served_by("local", "http://127.0.0.1:1", [])
    call.usage = {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}
    call.ticket = Ticket()
    return call


def test_the_release_comes_at_once_and_the_row_after_the_answer_stamped_when_it_ended() -> None:
    asyncio.run(_release_then_row())


async def _release_then_row() -> None:
    log, metrics = Sink(), Sink()
    finish, admission = _finish(log, [metrics])
    call = _served_call(finish)
    finish(call, 200, None)
    ended = time.perf_counter()
    assert len(admission.released) == 1 and admission.released[0][1] is not None  # priced, released now
    assert call.ticket is None
    assert log.records == [] and metrics.records == []  # the answer is still to be sent
    time.sleep(0.05)  # sending it (the row must not count this)
    await asyncio.sleep(0)
    assert len(log.records) == 1 and len(metrics.records) == 1
    row = log.records[0][1].row
    assert row["status"] == 200 and row["prompt_tokens"] == 10 and row["cost_picousd"] is not None
    assert row["latency_ms"] <= (ended - call.started) * 1e3 + 1  # stamped at the finish, not 50 ms later
    finish(call, 499, "client_disconnected")  # a second end (a relay's after a handler's): nothing
    await asyncio.sleep(0)
    assert len(log.records) == 1 and len(admission.released) == 1


def test_a_failing_sink_costs_its_record_not_the_others_nor_the_caller(
    caplog: pytest.LogCaptureFixture,
) -> None:
    log, broken = Sink(), Sink(fail=True)
    finish, admission = _finish(log, [broken])

    async def end() -> None:
        finish(_served_call(finish), 200, None)  # returns: the answer goes out whatever the sinks do
        await asyncio.sleep(0)

    with caplog.at_level(logging.ERROR):
        asyncio.run(end())
    assert len(admission.released) == 1
    assert len(log.records) == 1  # the request log got its row before the broken sink ran
    assert any("recording a finished request failed" in r.getMessage() for r in caplog.records)


def test_the_row_keeps_the_gateway_time_counted_when_the_request_ended() -> None:
    """A stream's relay goes on after its end: it adds the [DONE] event's write (and the drain of
    what follows it) to upstream_seconds before the deferred row is built, which took that time
    (and the release's) off the row's overhead_ms."""
    asyncio.run(_row_overhead_as_at_the_end())


async def _row_overhead_as_at_the_end() -> None:
    log = Sink()
    finish, _ = _finish(log, [])
    call = _served_call(finish)
    time.sleep(0.02)  # the gateway's own time
    finish(call, 200, None)
    call.upstream_seconds += 0.02  # relay.py: the time after the end, counted once the event is out
    await asyncio.sleep(0)
    assert log.records[0][1].row["overhead_ms"] >= 19


def test_a_row_waiting_for_its_token_count_is_stamped_when_the_request_ended(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The count runs in a worker thread after the request ended (seconds for megabytes): neither
    its latency nor its overhead is the request's."""

    def slow_count(call: Call, policy: Any) -> dict[str, Any]:
        time.sleep(0.1)
        return {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}

    monkeypatch.setattr("gateway.pipeline.finish.estimated_usage", slow_count)

    async def main() -> None:
        log = Sink()
        finish, _ = _finish(log, [])
        call = _served_call(finish)
        call.usage = {}  # none came back: counted
        finish(call, 200, None)
        await finish.drain()
        await asyncio.sleep(0)
        row = log.records[0][1].row
        assert row["cost_estimated"] and row["prompt_tokens"] == 10
        assert row["latency_ms"] < 50 and row["overhead_ms"] < 50

    asyncio.run(main())


def _budgeted(finish: Finish, usage: dict[str, Any], body: dict[str, Any]) -> Call:
    """A served call whose ticket reserved what its body may cost (admission's worst case)."""
    call = _served_call(finish)
    call.usage = usage
    call.body, call.body_bytes = body, len(orjson.dumps(body))
    worst = finish.holder.runtime.prices.worst_case(("small",), body, call.body_bytes)
    budget = Budget("key", call.key.id, Decimal(100), "daily")
    assert call.ticket is not None
    call.ticket.charges = [Charge(budget, "c", datetime.now(UTC), None, to_picousd(worst))]
    return call


def test_a_usage_that_costs_more_than_the_request_reserved_is_counted_instead() -> None:
    """Believable as counts (4,200 prompt tokens for a 200-byte question is within what a template
    could add), but past the reservation: three such requests on a $1 budget spent $12.63, when
    concurrent requests may overspend by at most one reservation."""
    body = {"model": "small", "messages": [{"role": "user", "content": "count me " * 20}], "max_tokens": 10}

    async def main() -> None:
        log = Sink()
        finish, admission = _finish(log, [])
        over = _budgeted(finish, {"prompt_tokens": 4200, "completion_tokens": 10, "total_tokens": 4210}, body)
        within = _budgeted(finish, {"prompt_tokens": 50, "completion_tokens": 10, "total_tokens": 60}, body)
        over.id, within.id = "req-over", "req-within"
        for call in (over, within):
            call.reply_body = orjson.dumps({"choices": [{"message": {"content": "one two three"}}]})
            finish(call, 200, None)
        await finish.drain()
        await asyncio.sleep(0)
        rows = {rec.row["id"]: rec.row for _, rec in log.records}
        assert rows["req-over"]["cost_estimated"] and rows["req-over"]["prompt_tokens"] < 200
        assert not rows["req-within"]["cost_estimated"] and rows["req-within"]["prompt_tokens"] == 50
        assert len(admission.released) == 2 and all(cost is not None for _, cost in admission.released)

    asyncio.run(main())


def test_a_counted_answer_is_never_billed_past_what_the_request_could_hold_or_ask_for() -> None:
    """An upstream that sends more text than max_tokens, or an engine telling a prompt count past the
    request's bytes: the count stays within the request's own bounds (its reservation's)."""
    finish, _ = _finish(Sink(), [])
    body = {"model": "small", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "n": 2}
    call = _served_call(finish)
    call.usage = {}
    call.body, call.body_bytes = body, len(orjson.dumps(body))
    call.reply_body = orjson.dumps({"choices": [{"message": {"content": "word " * 500}}]})
    call.told_prompt_tokens = 5000
    counted = estimated_usage(call, finish.holder.runtime.policy)
    assert counted["completion_tokens"] == 6 and counted["prompt_tokens"] == call.body_bytes
    body.pop("max_tokens")  # no max_tokens: the cap the reservation took
    call.output_cap = 100
    assert estimated_usage(call, finish.holder.runtime.policy)["completion_tokens"] == 200


class _Swallowing(Released):
    """An admission whose store loses a cancel that lands as its call finishes (Python 3.11's
    wait_for under redis-py's socket timeout): the cancel is caught and the admission returns."""

    def __init__(self) -> None:
        super().__init__()
        self.entered = asyncio.Event()

    async def admit(self, *args: Any, **kwargs: Any) -> Ticket:
        self.entered.set()
        with contextlib.suppress(asyncio.CancelledError):  # lost, as wait_for loses it: the task's
            await asyncio.sleep(3600)  # cancelling() count stays up
        return Ticket()


def test_a_cancel_lost_in_the_admission_still_stops_the_request_before_its_upstream() -> None:
    """A client that left while its admission talked to Redis had the upstream called for it and
    was billed (15 of 20 such requests, redis-py on Python 3.11)."""
    log = Sink()
    finish, _ = _finish(log, [])
    admission = _Swallowing()
    proxy = Proxy(finish.holder, log, admission)
    key = KeyInfo(uuid.uuid4().hex, "k", "sk-test", None, None, {}, datetime.now(UTC), None, None, None)
    body = orjson.dumps({"model": "small", "messages": [{"role": "user", "content": "hi"}]})

    async def main() -> None:
        task = asyncio.ensure_future(proxy.handle("/v1/chat/completions", body, key))
        await admission.entered.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0.01)

    asyncio.run(main())
    (row,) = [rec.row for _, rec in log.records]
    assert row["status"] == 499 and row["backend"] is None  # no upstream was called


def test_while_budgets_fail_open_a_reported_usage_is_believed() -> None:
    """Redis or the database away, budgets failing open: each charge is blind and reserved nothing
    (amount 0). Held to that, every answer's usage was thrown away and recounted."""
    body = {"model": "small", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10}

    async def main() -> None:
        log = Sink()
        finish, _ = _finish(log, [])
        call = _budgeted(finish, {"prompt_tokens": 12, "completion_tokens": 10, "total_tokens": 22}, body)
        assert call.ticket is not None
        call.ticket.charges = [dataclasses.replace(c, amount=0, blind=True) for c in call.ticket.charges]
        finish(call, 200, None)
        await finish.drain()
        await asyncio.sleep(0)
        row = log.records[0][1].row
        assert not row["cost_estimated"] and row["prompt_tokens"] == 12

    asyncio.run(main())


def test_a_request_is_recorded_against_the_policy_it_ran_under_not_a_reload_since() -> None:
    """A reload that removed its model and backend mid-request sent its metrics to `unknown` and
    took its trace's provider away."""

    async def main() -> None:
        log = Sink()
        finish, _ = _finish(log, [])
        call = _served_call(finish)
        call.policy = finish.holder.runtime.policy
        reloaded = parse_policy(POLICY.replace("local", "other").replace("small", "big"))
        finish.holder.runtime = Runtime(reloaded, Router(reloaded), Failover(reloaded, {}), {}, "v2",
                                        datetime.now(UTC), PriceBook(reloaded))  # fmt: skip
        finish(call, 200, None)
        await asyncio.sleep(0)
        (rec,) = [rec for _, rec in log.records]
        assert rec.known_model and rec.backend_spec is not None and rec.backend_spec.type == "engine"

    asyncio.run(main())
