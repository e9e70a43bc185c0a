"""The active policy and everything built from it, and the watcher that hot-reloads it.

A reload builds a whole new Runtime (router, failover, pools) and swaps one reference, so a
request in flight finishes on the version it started with. Pools whose settings did not change
are carried over (their health state and connections too); pools that left the policy are closed
once the requests that may still use them have had their time.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import os
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter

from gateway.backends.base import Upstream
from gateway.backends.engine import EnginePool
from gateway.config.policy import (
    EngineBackend,
    HostedBackend,
    Policy,
    parse_policy,
    policy_version,
    read_policy_text,
)
from gateway.governance import tokens
from gateway.governance.budgets import BudgetStore
from gateway.governance.costs import PriceBook
from gateway.governance.periods import counter_restarts
from gateway.pipeline.failover import Failover
from gateway.routing.capabilities import CapabilityTable
from gateway.routing.complexity import ComplexityModel
from gateway.routing.router import Router

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Runtime:
    """One policy version and what serves it."""

    policy: Policy
    router: Router
    failover: Failover
    pools: dict[str, Upstream]
    version: str
    loaded_at: datetime
    prices: PriceBook


async def build_runtime(
    policy: Policy, version: str, model: ComplexityModel, previous: Runtime | None = None
) -> Runtime:
    """Pools for the policy's backends (reusing unchanged ones from `previous`), started.

    If anything fails, the pools made here are closed before the error goes on: a refused reload
    must not leave health checks running against a policy that never became active."""
    pools: dict[str, Upstream] = {}
    made: list[Upstream] = []
    try:
        for name in policy.backends:
            old = previous.pools.get(name) if previous is not None else None
            if old is not None and _same_backend(previous, policy, name):
                pools[name] = old
                continue
            pool = pools[name] = _new_backend(name, policy)
            made.append(pool)
            if isinstance(old, EnginePool) and isinstance(pool, EnginePool):
                pool.adopt_homes(old)  # its replicas changed: prefixes on the ones still there stay
            await pool.start()
        router = Router(policy, model, CapabilityTable(policy, pools))  # learns from the pools
    except BaseException:
        await _close_all(made)
        raise
    return Runtime(
        policy, router, Failover(policy, pools), pools, version, datetime.now(UTC), PriceBook(policy)
    )


async def _close_all(pools: list[Upstream]) -> None:
    """Close each pool; one that fails to close is logged and does not keep the others open."""
    for pool in pools:
        try:
            await pool.close()
        except Exception:
            logger.exception("closing backend %r failed", getattr(pool, "name", pool))


def _same_backend(previous: Runtime | None, policy: Policy, name: str) -> bool:
    """Whether backend `name` is served as before: its price aside (the price book reads prices
    from the policy; a pool never does), a price change rebuilt the pool, losing its breakers and
    connections and keeping the old one's health checks running for the longest timeout."""
    assert previous is not None
    before = previous.policy.backends.get(name)
    after = policy.backends[name]
    return (
        before is not None
        and type(before) is type(after)
        and before.model_dump(exclude=_PRICES) == after.model_dump(exclude=_PRICES)
        and previous.policy.health_for(name) == policy.health_for(name)
    )


_PRICES = {"price", "gpu"}  # what a backend's spec says of its cost, and nothing else


def _new_backend(name: str, policy: Policy) -> Upstream:
    """An engine pool, or a hosted model (litellm is imported only when the policy has one)."""
    spec = policy.backends[name]
    if isinstance(spec, EngineBackend):
        if spec.tokenizer and not tokens.tokenizer_exists(spec.tokenizer):
            logger.warning(
                "backend %r: no tokenizer.json at %s; rows without usage use tiktoken", name, spec.tokenizer
            )
        return EnginePool(name, spec, policy.health_for(name))
    from gateway.backends.hosted import HostedModel

    hosted = HostedModel(name, spec)
    if hosted.unavailable_reason:
        logger.warning("hosted backend %r is unavailable: %s", name, hosted.unavailable_reason)
    return hosted


class RuntimeHolder:
    """The one mutable reference to the active Runtime (read once per request)."""

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime


class PolicyWatcher:
    """Polls the policy file; a valid change becomes the active Runtime, an invalid one is refused.

    Refusals keep the previous policy serving; they are logged, counted in
    `gateway_policy_reload_failures_total`, and shown by `status()` (GET /admin/policy).
    """

    def __init__(
        self, path: Path, holder: RuntimeHolder, model: ComplexityModel, registry: CollectorRegistry,
        interval: float = 0.5, budgets: BudgetStore | None = None,
    ) -> None:  # fmt: skip
        self.path = path
        self.holder = holder
        self.model = model
        self.interval = interval
        self.budgets = budgets  # where a team budget given back, or over another period, is reseeded
        self.last_error: str | None = None
        self.last_error_at: datetime | None = None
        self._stamp = _stamp(path)
        self._task: asyncio.Task[None] | None = None
        self._retiring: set[asyncio.Task[None]] = set()
        self._to_close: list[Upstream] = []
        self._lock = asyncio.Lock()
        self.reloads = Counter("gateway_policy_reloads", "Policy changes applied.", registry=registry)
        self.failures = Counter(
            "gateway_policy_reload_failures", "Policy changes refused (invalid).", registry=registry
        )

    def start(self) -> None:
        """Begin watching."""
        self._task = asyncio.create_task(self._loop(), name="policy-watcher")

    async def _loop(self) -> None:
        # Nothing but cancellation (stop) may end this loop: a dead watcher ignores every later edit
        # while GET /admin/policy still looks healthy. reload() refuses any file it cannot apply;
        # this catches the rest (a bug) and polls on.
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self._poll()
            except Exception:
                logger.exception("policy watcher: unexpected error, watching on")

    async def _poll(self) -> None:
        stamp = _stamp(self.path)
        if stamp != self._stamp:
            self._stamp = stamp
            await self.reload()

    async def reload(self) -> bool:
        """Read, validate and apply the file now; False (and the old policy kept) when it is refused.

        Any exception is a refusal (logged, counted, shown as last_error), never the watcher's end."""
        async with self._lock:  # one reload at a time: each builds on the runtime it found
            current = self.holder.runtime
            try:
                # off the event loop: parsing a 1.5 MB file took 8.6 s, and every request waited
                prepared = await asyncio.to_thread(self._prepare, current.version)
                if prepared is None:  # the active version again (a bad edit reverted): nothing is wrong
                    self.last_error = self.last_error_at = None
                    return True
                runtime = await build_runtime(prepared[0], prepared[1], self.model, current)
            except Exception as exc:
                self._refuse(exc, current.version)
                return False
            self._apply(runtime, current)
            return True

    def _prepare(self, active: str) -> tuple[Policy, str] | None:
        """The file's policy and version, validated (in a worker thread); None if `active` is its version."""
        text = read_policy_text(self.path)
        version = policy_version(text)
        if version == active:
            return None
        policy = parse_policy(text, str(self.path))
        Router(policy, self.model)  # weights overrides are checked here too
        if any(isinstance(spec, HostedBackend) for spec in policy.backends.values()):
            importlib.import_module("gateway.backends.hosted")  # litellm's first import takes ~3 s
        return policy, version

    def _refuse(self, exc: Exception, active: str) -> None:
        """Count and show a refused change; the active version keeps serving."""
        self.failures.inc()
        expected = isinstance(exc, ValueError)  # PolicyError and the checks of the pools' constructors
        message = str(exc) if expected else f"{type(exc).__name__}: {exc}"
        self.last_error, self.last_error_at = message, datetime.now(UTC)
        logger.error(
            "policy change refused, still serving version %s: %s", active, message,
            exc_info=None if expected else exc,  # an unexpected error: its traceback helps
        )  # fmt: skip

    def _apply(self, runtime: Runtime, current: Runtime) -> None:
        """Make `runtime` the active one and retire the pools it no longer uses."""
        self.holder.runtime = runtime
        self.reloads.inc()
        self.last_error = self.last_error_at = None
        logger.info("policy version %s active (was %s)", runtime.version, current.version)
        self._retire([p for n, p in current.pools.items() if runtime.pools.get(n) is not p], current.policy)
        self._reseed(reseeded_teams(current.policy, runtime.policy))

    def _reseed(self, teams: list[str]) -> None:
        """Forget the counters of teams whose budget came back or changed period: the next request
        seeds them from the log (what each team spent, its requests without a budget included)."""
        budgets = self.budgets
        if budgets is None or not teams:
            return

        async def forget() -> None:
            for team in teams:
                try:
                    await budgets.forget("team", team)
                except Exception:  # the policy stands; the old counter is counted on
                    logger.exception("team %s: its budget counters could not be reset", team)

        task = asyncio.create_task(forget())
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)

    def _retire(self, pools: list[Upstream], policy: Policy) -> None:
        """Close pools that left the policy, after the longest request that may still use them."""
        if not pools:
            return
        grace = max([spec.timeouts.total for spec in policy.backends.values()] + [1.0])
        self._to_close.extend(pools)

        async def close_later() -> None:
            await asyncio.sleep(grace)
            for pool in pools:
                self._to_close.remove(pool)
                await pool.close()

        task = asyncio.create_task(close_later())
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)

    def status(self) -> dict[str, Any]:
        """For GET /admin/policy."""
        rt = self.holder.runtime
        return {
            "path": str(self.path),
            "version": rt.version,
            "loaded_at": rt.loaded_at.isoformat(),
            "last_error": self.last_error,
            "last_error_at": self.last_error_at.isoformat() if self.last_error_at else None,
            "backends": {
                name: {"available": pool.unavailable_reason is None, "reason": pool.unavailable_reason,
                       "replicas": [r.describe() for r in getattr(pool, "replicas", [])]}
                for name, pool in rt.pools.items()
            },
            "models": {name: _capabilities(rt, name) for name in rt.policy.models},
        }  # fmt: skip

    async def stop(self) -> None:
        """Stop watching; close retired pools now."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        for task in list(self._retiring):
            task.cancel()
        await asyncio.gather(*self._retiring, return_exceptions=True)
        for pool in self._to_close:
            await pool.close()
        self._to_close.clear()


def reseeded_teams(before: Policy, after: Policy) -> list[str]:
    """Teams whose budget the new policy gives back (none before) or puts over another period: their
    counter was left as it stood, not charged meanwhile (a new `usd` alone keeps it)."""
    teams = []
    for name, team in after.teams.items():
        old = before.teams.get(name)
        was = old.budget.period if old is not None and old.budget is not None else None
        if counter_restarts(was, team.budget.period if team.budget is not None else None):
            teams.append(name)
    return teams


def _capabilities(rt: Runtime, model: str) -> dict[str, Any]:
    """A model's capabilities as routing sees them now, and where each came from (declared, learned)."""
    resolved = rt.router.capabilities.of(model)
    return {"capabilities": dict(resolved.supports), "context_length": resolved.context_length,
            "sources": dict(resolved.sources)}  # fmt: skip


def _stamp(path: Path) -> tuple[str, int, int, int, int, int] | None:
    """What tells a changed file without reading it: the resolved target, its inode, size, mtime and ctime.

    The target and inode catch a symlink swapped to another file of the same size and mtime (a
    Kubernetes ConfigMap's `..data`, Nix or Bazel outputs with normalised mtimes); ctime moves on
    every write, even one that sets the mtime back."""
    try:
        real = os.path.realpath(path)
        info = os.stat(real)
    except (OSError, ValueError):  # ValueError: a NUL in the path
        return None
    return (real, info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns)
