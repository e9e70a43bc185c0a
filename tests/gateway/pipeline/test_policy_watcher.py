"""The policy watcher in process: nothing in a file ends it, a reload never holds the event loop,
and a change is seen however the file was replaced (tests/gateway/pipeline/test_reload.py runs a
whole gateway)."""

from __future__ import annotations

import asyncio
import math
import os
import time
from collections.abc import Awaitable, Callable, Iterator
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from gateway.backends.engine import EnginePool
from gateway.config.policy import Policy, load_policy, parse_policy, policy_version, read_policy_text
from gateway.governance.budgets import Budget, LocalBudgetStore
from gateway.pipeline import runtime as runtime_module
from gateway.pipeline.runtime import PolicyWatcher, RuntimeHolder, build_runtime, reseeded_teams
from gateway.routing.complexity import ComplexityModel

# port 9 (discard) refuses at once; checks a minute apart: the pools stay quiet during a test
POLICY = """backends:
  local: {{type: engine, urls: ["http://127.0.0.1:9"]}}
{extra}models:
  small: {{backend: local}}
health: {{interval: 60}}
"""
MODEL = ComplexityModel(("log_tokens",), (0.0,), (1.0,), math.log(0.25 / 0.75))


def _policy(extra: str = "") -> str:
    return POLICY.format(extra=extra)


class Watched:
    """A watcher over `root`/policy.yaml, started on the file as it is then."""

    def __init__(self, root: Path) -> None:
        self.path = root / "policy.yaml"
        self.path.write_text(_policy())
        self.registry = CollectorRegistry()

    async def start(self, interval: float = 0.01) -> PolicyWatcher:
        text = read_policy_text(self.path)
        first = await build_runtime(load_policy(self.path), policy_version(text), MODEL)
        self.watcher = PolicyWatcher(self.path, RuntimeHolder(first), MODEL, self.registry, interval)
        return self.watcher

    async def stop(self) -> None:
        await self.watcher.stop()
        for pool in self.watcher.holder.runtime.pools.values():
            await pool.close()

    def count(self, name: str) -> float:
        return self.registry.get_sample_value(name) or 0.0


@pytest.fixture
def watched(tmp_path: Path) -> Iterator[Watched]:
    yield Watched(tmp_path)


def _run(watched: Watched, body: Callable[[PolicyWatcher], Awaitable[None]], interval: float = 0.01) -> None:
    async def main() -> None:
        watcher = await watched.start(interval)
        try:
            await body(watcher)
        finally:
            await watched.stop()

    asyncio.run(main())


async def _until(check: Callable[[], bool], seconds: float = 3.0) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, f"not within {seconds} s"
        await asyncio.sleep(0.01)


def test_a_reload_that_raises_anything_is_refused_and_later_edits_still_apply(
    watched: Watched, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pool constructor's ValueError (a port out of range) raised out of reload() and ended the
    watcher: every later edit was ignored while /admin/policy showed no error."""
    start = EnginePool.start

    async def failing_start(self: EnginePool) -> None:
        if self.name == "broken":
            raise RuntimeError("cannot start")
        await start(self)

    monkeypatch.setattr(EnginePool, "start", failing_start)

    async def body(watcher: PolicyWatcher) -> None:
        watcher.start()
        active = watcher.holder.runtime.version
        watched.path.write_text(_policy('  broken: {type: engine, urls: ["http://127.0.0.1:9"]}\n'))
        await _until(lambda: watcher.last_error is not None)
        assert watcher.last_error == "RuntimeError: cannot start"
        assert watcher.holder.runtime.version == active
        assert watched.count("gateway_policy_reload_failures_total") == 1
        watched.path.write_text(_policy('  other: {type: engine, urls: ["http://127.0.0.1:9"]}\n'))
        await _until(lambda: "other" in watcher.holder.runtime.pools)
        assert watcher.last_error is None and watcher._task is not None and not watcher._task.done()

    _run(watched, body)


def test_pools_started_for_a_refused_policy_are_closed(
    watched: Watched, monkeypatch: pytest.MonkeyPatch
) -> None:
    """They kept checking their replicas for good, for a policy that never became active."""
    closed: list[str] = []
    close = EnginePool.close

    async def recording_close(self: EnginePool) -> None:
        closed.append(self.name)
        await close(self)

    real_router = runtime_module.Router

    def failing_router(*args: object) -> object:
        if len(args) == 3:  # build_runtime's, with the pools (the check before it passes)
            raise RuntimeError("router bug")
        return real_router(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(EnginePool, "close", recording_close)

    async def body(watcher: PolicyWatcher) -> None:
        monkeypatch.setattr(runtime_module, "Router", failing_router)  # after the first runtime
        watched.path.write_text(_policy('  extra: {type: engine, urls: ["http://127.0.0.1:9"]}\n'))
        assert await watcher.reload() is False
        assert closed == ["extra"]  # the new pool; `local` was carried over and still serves
        assert watcher.last_error == "RuntimeError: router bug"

    _run(watched, body)


def test_the_loop_survives_an_unexpected_error_outside_reload(
    watched: Watched, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    calls: list[int] = []
    real_stamp = runtime_module._stamp

    def flaky_stamp(path: Path) -> object:
        calls.append(1)
        if len(calls) == 2:  # the first poll (the first call is the watcher's own, at start)
            raise RuntimeError("stat bug")
        return real_stamp(path)

    monkeypatch.setattr(runtime_module, "_stamp", flaky_stamp)

    async def body(watcher: PolicyWatcher) -> None:
        watcher.start()
        await _until(lambda: len(calls) >= 4)
        assert watcher._task is not None and not watcher._task.done()

    _run(watched, body)
    assert "stat bug" in caplog.text


def test_a_reload_parses_off_the_event_loop(watched: Watched, monkeypatch: pytest.MonkeyPatch) -> None:
    """A 1.5 MB policy held the loop (every request, /health included) for 8.6 s while it parsed."""
    real_parse = runtime_module.parse_policy

    def slow_parse(text: str, source: str = "<policy>") -> object:
        time.sleep(0.3)  # a big file
        return real_parse(text, source)

    monkeypatch.setattr(runtime_module, "parse_policy", slow_parse)

    async def body(watcher: PolicyWatcher) -> None:
        watched.path.write_text(_policy("  # a change\n"))
        ticks = 0

        async def tick() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        ticker = asyncio.create_task(tick())
        assert await watcher.reload() is True
        ticker.cancel()
        assert ticks >= 10  # the loop ran on while the file parsed (blocked: 0)

    _run(watched, body)


def test_last_error_clears_when_the_file_goes_back_to_the_active_version(watched: Watched) -> None:
    """A reverted bad edit left its error shown in /admin/policy and the console for good."""

    async def body(watcher: PolicyWatcher) -> None:
        good = watched.path.read_text()
        watched.path.write_text("backends: [")
        assert await watcher.reload() is False and watcher.last_error is not None
        watched.path.write_text(good)
        assert await watcher.reload() is True
        assert watcher.last_error is None and watcher.last_error_at is None

    _run(watched, body)


def test_a_symlink_swapped_to_a_file_of_the_same_size_and_mtime_is_seen(tmp_path: Path) -> None:
    """A ConfigMap's `..data` swap (or Nix/Bazel outputs with normalised mtimes) went unnoticed."""
    for version, log_bodies in (("v1", "true "), ("v2", "false")):
        (tmp_path / version).mkdir()
        target = tmp_path / version / "p.yaml"
        target.write_text(_policy() + f"log_bodies: {log_bodies}\n")
        os.utime(target, ns=(1_577_836_800 * 10**9, 1_577_836_800 * 10**9))
    assert (tmp_path / "v1/p.yaml").stat().st_size == (tmp_path / "v2/p.yaml").stat().st_size
    (tmp_path / "data").symlink_to("v1")
    watched = Watched(tmp_path)
    watched.path.unlink()
    watched.path.symlink_to(tmp_path / "data/p.yaml")

    async def body(watcher: PolicyWatcher) -> None:
        assert watcher.holder.runtime.policy.log_bodies is True
        watcher.start()
        (tmp_path / "next").symlink_to("v2")
        (tmp_path / "next").replace(tmp_path / "data")  # the atomic swap kubelet does
        await _until(lambda: watcher.holder.runtime.policy.log_bodies is False)

    _run(watched, body)


def test_a_team_budget_given_back_or_moved_to_another_period_is_reseeded_from_the_log(
    watched: Watched,
) -> None:
    """Its counter was left as it stood while the team had no budget (not charged meanwhile): given
    back, the budget starts from what the log says the team spent. A new amount keeps the counter."""
    store = LocalBudgetStore()
    daily = Budget("team", "legal", Decimal(5), "daily").counter(datetime.now(UTC))[0]

    async def body(watcher: PolicyWatcher) -> None:
        watcher.budgets = store

        async def change(teams: str) -> None:
            watched.path.write_text(_policy(teams))
            assert await watcher.reload()
            await asyncio.sleep(0.02)  # the forget runs in a task of its own

        store._spent[daily] = 7
        await change("teams: {legal: {rpm: 5}}\n")
        assert store._spent[daily] == 7  # no budget now: nothing reads the counter
        with_budget = "teams: {legal: {budget: {usd: 5, period: daily}}}\n"
        await change(with_budget)
        assert daily not in store._spent  # given back: seeded from the log at the next request
        store._spent[daily] = 7
        raised = "teams: {legal: {budget: {usd: 9, period: daily}}}\n"
        await change(raised)
        assert store._spent[daily] == 7  # a new amount applies to the spend counted so far

    _run(watched, body)
    before = load_policy_text("teams: {a: {budget: {usd: 1, period: daily}}, b: {rpm: 1}}\n")
    after = load_policy_text("teams: {a: {budget: {usd: 1, period: weekly}}, b: {budget: {usd: 1}}, c: {}}\n")
    assert reseeded_teams(before, after) == ["a", "b"]
    assert reseeded_teams(after, after) == []


def load_policy_text(teams: str) -> Policy:
    return parse_policy(_policy(teams))


def test_a_fifo_at_the_policy_path_is_refused_and_later_edits_still_apply(watched: Watched) -> None:
    """Opening a FIFO blocked the watcher's thread for good, holding the reload lock: no later edit
    was applied, /admin/policy showed no error, and shutdown waited on the thread forever."""

    async def body(watcher: PolicyWatcher) -> None:
        watcher.start()
        active = watcher.holder.runtime.version
        fifo = watched.path.with_name("fifo.tmp")
        os.mkfifo(fifo)
        fifo.replace(watched.path)
        await _until(lambda: watcher.last_error is not None)
        assert "not a regular file" in (watcher.last_error or "")
        assert watcher.holder.runtime.version == active
        edited = watched.path.with_name("edit.tmp")
        edited.write_text(_policy('  other: {type: engine, urls: ["http://127.0.0.1:9"]}\n'))
        edited.replace(watched.path)
        await _until(lambda: "other" in watcher.holder.runtime.pools)
        assert watcher.last_error is None

    _run(watched, body)


def test_a_price_change_keeps_the_backends_pool_and_a_served_change_replaces_it(watched: Watched) -> None:
    """A price-only edit rebuilt the pool (its breakers and connections lost; the old one health-
    checked on for the longest timeout: 40 price edits left 368 sockets open)."""
    priced = POLICY.replace('urls: ["http://127.0.0.1:9"]', 'urls: ["http://127.0.0.1:9"], price: {p}')

    async def body(watcher: PolicyWatcher) -> None:
        watcher.start()
        first = watcher.holder.runtime.pools["local"]
        for price in ("{input_per_mtok: 1, output_per_mtok: 2}", "{input_per_mtok: 3, output_per_mtok: 4}"):
            version = watcher.holder.runtime.version
            watched.path.write_text(priced.format(p=price, extra=""))
            await _until(lambda v=version: watcher.holder.runtime.version != v)  # type: ignore[misc]
            assert watcher.holder.runtime.pools["local"] is first
        price = watcher.holder.runtime.policy.backends["local"].price
        assert price is not None and price.input_per_mtok == 3  # the new prices are read from the policy
        watched.path.write_text(_policy().replace("127.0.0.1:9", "127.0.0.1:7"))
        await _until(lambda: watcher.holder.runtime.pools["local"] is not first)

    _run(watched, body)
