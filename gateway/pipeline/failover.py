"""Walking a route's chain: another replica, a retry after backoff, then the next model.

The only place that decides whether an upstream failure is worth another try. Retryable: the
upstream unreachable or timed out, a 500/502/503/504 answer, an upstream refusing the gateway itself
(GATEWAY_FAULT_STATUSES: 401, 403, 404, 405, 407), a stream that breaks or stalls before its first
token. 429 moves on to the next model at once. Other answers (another 4xx: the client's) are
returned as they are. A stream is committed to the client only once its first token arrives:
until then none of its events has been sent, so switching is invisible; after that, it is never
switched. Its status and headers may go earlier, with the first event of the first upstream that
begins one (`commit`, the policy's `stream_head`): a later switch does not change them, and the
request log names both. That first event goes with them when it only opens the answer (a chat
stream's role chunk: the client parses it while the model works, not after its first token); a
later upstream's opening events for the choices the client has one of are then dropped.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from typing import Any

import orjson

from gateway.backends.base import (
    Attempt,
    Upstream,
    UpstreamReply,
    UpstreamStream,
    UpstreamStreamError,
    UpstreamUnavailableError,
    answer_object,
)
from gateway.backends.upstream_errors import GATEWAY_FAULT_STATUSES
from gateway.config.policy import EngineBackend, Policy, Retries, Timeouts
from gateway.errors import GatewayError
from gateway.pipeline.prefix_keys import PrefixKeys
from gateway.pipeline.resume import ResumePlan, resumable_body
from gateway.pipeline.served import Served
from gateway.pipeline.stream_start import FirstEvent, until_first_token
from gateway.routing.router import RouteDecision
from gateway.telemetry.trace import NO_TRACE, Trace

RETRY_STATUSES = frozenset({500, 502, 503, 504}) | GATEWAY_FAULT_STATUSES  # another replica, then model
NEXT_MODEL_STATUSES = frozenset({429})
_ATTEMPT_CAP = 16  # whatever the policy says, one request makes at most this many upstream calls


class ChainExhaustedError(GatewayError):
    """Every model in the chain failed; `last` is the last upstream error answer, if any (the client
    gets it as it was), else the error says what failed: 503 when nothing could be called (or a
    self-hosted-only request found no self-hosted model), 504 on a timeout, 502 otherwise."""

    def __init__(self, message: str, attempts: list[Attempt], last: UpstreamReply | None, timeout: bool,
                 unavailable: bool, self_hosted_only: bool = False,
                 invalid: bool = False) -> None:  # fmt: skip
        if unavailable:
            status, param, code = 503, "model", "model_unavailable"
        elif self_hosted_only:  # never "try hosted": say so
            status, param, code = 503, "model", "self_hosted_unavailable"
        elif timeout:
            status, param, code = 504, None, "upstream_timeout"
        elif invalid:  # the last upstream answered 200 with what is not an answer
            status, param, code = 502, None, "upstream_invalid_response"
        else:
            status, param, code = 502, None, "upstream_unavailable"
        super().__init__(status, message, "api_error", param, code)  # `detail()` is the operator's
        self.attempts, self.last, self.timeout, self.unavailable = attempts, last, timeout, unavailable

    def detail(self) -> str:
        """Every attempt with its replica and error text: for the server log, never a client."""
        return "; ".join(a.describe() for a in self.attempts) or "nothing tried"


def backoff(retries: Retries, round_: int, rng: random.Random) -> float:
    """Seconds before retry `round_` (1-based): backoff * 2**(round-1), capped, +- jitter."""
    base = min(retries.max_backoff, retries.backoff * 2.0 ** (round_ - 1))
    return max(0.0, base * (1 + retries.jitter * (2 * rng.random() - 1)))


_RETRY, _NEXT = "retry", "next"  # a round's outcome when it did not serve: retry this model, or move on
# called once, when an upstream's stream sends its first event: (backend, deployment, attempts before
# it, that event's line when it only opens the answer, else None); True: the line went out with the head
Commit = Callable[[str, str, list[Attempt], str | None], Awaitable[bool]]
# called once, when the stream served has its first token: (its head, whether it is resumable); it
# may write the head to the client at once (relay.py's EarlyHead)
FirstToken = Callable[[list[str], bool], None]


class Failover:
    """Runs one request along its chain."""

    def __init__(self, policy: Policy, pools: dict[str, Upstream], rng: random.Random | None = None) -> None:
        self.policy = policy
        self.pools = pools
        self._rng = rng or random.Random()
        self._prefix_keys = PrefixKeys()  # prefix-affinity keys, with each pool's tokenizer

    async def send(self, decision: RouteDecision, path: str, body: dict[str, Any], trace: Trace = NO_TRACE,
                   progress: Progress | None = None) -> Served:  # fmt: skip
        """A whole answer from the first model in the chain that gives one. `progress` follows the
        walk as it goes (what a request whose client leaves meanwhile logs)."""
        return await self._walk(decision, path, body, False, trace, progress or Progress())

    async def stream(self, decision: RouteDecision, path: str, body: dict[str, Any], trace: Trace = NO_TRACE,
                     progress: Progress | None = None, commit: Commit | None = None,
                     first_token: FirstToken | None = None) -> Served:  # fmt: skip
        """An open stream whose first token has arrived (or an error answer to pass through).
        `commit` is awaited once, when an upstream's stream first sends an event (before its first token);
        `first_token` is called once, with the served stream's head, just before it is returned.

        With tracing, the served attempt's span stays open until the caller finishes the trace.
        """
        progress = progress or Progress()
        return await self._walk(decision, path, body, True, trace, progress, commit, first_token)

    async def _walk(self, decision: RouteDecision, path: str, body: dict[str, Any], stream: bool,
                    trace: Trace, progress: Progress, commit: Commit | None = None,
                    first_token: FirstToken | None = None) -> Served:  # fmt: skip
        state = _State(decision, trace, progress)
        state.commit = commit
        state.first_token = first_token
        for model, pool in self._candidates(decision, state):
            spec = self.policy.backends[pool.name]
            upstream_body = self._upstream_body(body, model)
            plan = None
            if stream and isinstance(spec, EngineBackend):  # its prompt's true count, should the client leave
                upstream_body["stream_prompt_tokens"] = True
                if self._resumes(decision, spec, body):
                    upstream_body["stream_token_ids"] = True  # the engine reports each delta's token ids
                    timeouts = decision.timeouts or pool.timeouts
                    plan = ResumePlan(pool, spec, model, path, upstream_body, timeouts)
            payload = orjson.dumps(upstream_body)
            state.plan = plan
            state.affinity = None
            if isinstance(spec, EngineBackend) and spec.balance == "prefix_affinity":
                state.affinity = await self._prefix_keys.key(body, spec.tokenizer)
            for round_ in range(1 + decision.retries.count):
                if round_:
                    await asyncio.sleep(backoff(decision.retries, round_, self._rng))
                one = self._stream_round if stream else self._whole_round
                try:
                    outcome = await one(state, model, pool, path, payload)
                except _OutOfTimeError:  # this model's `total` is spent (the next one's may be longer)
                    break
                if isinstance(outcome, Served):
                    return outcome
                if outcome == _NEXT or not state.budget():
                    break
        raise state.exhausted()

    async def _whole_round(self, state: _State, model: str, pool: Upstream, path: str,
                           payload: bytes) -> Served | str:  # fmt: skip
        """Each replica of the pool once (another replica costs no backoff)."""
        avoid: set[str] = set()
        while state.budget():
            timeouts = state.timeouts(pool)
            headers = self._begin(state, model, pool, stream=False)
            try:
                reply = await pool.send(
                    path, payload, timeouts, frozenset(avoid), headers, **state.affinity_arg()
                )
            except UpstreamUnavailableError as exc:
                if exc.deployment is None:  # nothing (left) to offer this round: not a call
                    state.no_deployment(model, pool.name, str(exc), tried_some=bool(avoid))
                    return _RETRY
                state.failed(model, pool.name, exc.deployment, _unavailable(exc), exc)
                avoid.add(exc.deployment)
                continue
            if reply.status in NEXT_MODEL_STATUSES:
                state.failed(model, pool.name, reply.url, f"status {reply.status}", reply)
                return _NEXT
            if reply.status in RETRY_STATUSES:
                state.failed(model, pool.name, reply.url, f"status {reply.status}", reply)
                avoid.add(reply.url)
                continue
            if reply.status == 200 and reply.answer is None:  # (an engine pool's is parsed already)
                reply.answer = answer_object(reply.body)
                if reply.answer is None:  # not an answer a client's SDK can read: another replica
                    state.failed(model, pool.name, reply.url, "invalid answer", None, invalid=True)
                    avoid.add(reply.url)
                    continue
            state.trace.end_attempt(reply.url, reply.status)
            return Served(model, pool.name, reply.url, state.attempts, reply=reply)
        return _NEXT

    async def _stream_round(self, state: _State, model: str, pool: Upstream, path: str,
                            payload: bytes) -> Served | str:  # fmt: skip
        """Like `_whole_round`, but a stream counts only once its first token is in."""
        avoid: set[str] = set()
        loop = asyncio.get_running_loop()
        while state.budget():
            timeouts = state.timeouts(pool)
            # one first_token window from the call: its head and its first token together (the head's
            # wait was bounded by it, then the first token's by it again, so twice it in all)
            first_token_by = loop.time() + (timeouts or pool.timeouts).first_token
            headers = self._begin(state, model, pool, stream=True)
            owner = AsyncExitStack()  # holds the upstream open: closed here, or handed over in Served
            try:
                upstream = await owner.enter_async_context(
                    pool.stream(path, payload, timeouts, frozenset(avoid), headers, **state.affinity_arg())
                )
            except UpstreamUnavailableError as exc:
                if exc.deployment is None:
                    state.no_deployment(model, pool.name, str(exc), tried_some=bool(avoid))
                    return _RETRY
                state.failed(model, pool.name, exc.deployment, _unavailable(exc), exc)
                avoid.add(exc.deployment)
                continue
            if upstream.status != 200:
                reply = UpstreamReply(upstream.status, upstream.error_body, upstream.url,
                                      upstream.retry_after, hidden=upstream.hidden)  # fmt: skip
                if upstream.status not in RETRY_STATUSES and upstream.status not in NEXT_MODEL_STATUSES:
                    return Served(model, pool.name, upstream.url, state.attempts, stream=upstream,
                                  owner=owner)  # fmt: skip
                await owner.aclose()
                state.failed(model, pool.name, upstream.url, f"status {upstream.status}", reply)
                if upstream.status in NEXT_MODEL_STATUSES:
                    return _NEXT
                avoid.add(upstream.url)
                continue
            try:
                async with asyncio.timeout_at(first_token_by):
                    head = await until_first_token(
                        upstream.lines, self._on_first_event(state, pool, upstream), state.opened
                    )
            except TimeoutError:
                upstream.verdict(False)
                await owner.aclose()
                state.failed(model, pool.name, upstream.url, "first token timeout", None, timeout=True)
                avoid.add(upstream.url)
                continue
            except (UpstreamStreamError, UpstreamUnavailableError) as exc:
                upstream.verdict(False)
                await owner.aclose()
                state.failed(model, pool.name, upstream.url, f"stream broke ({exc})", None)
                avoid.add(upstream.url)
                continue
            except BaseException:  # the client left (cancelled): release the upstream
                await owner.aclose()
                raise
            if state.first_token is not None:  # nothing can fail this stream from here on
                state.first_token(head, state.plan is not None)
            return Served(model, pool.name, upstream.url, state.attempts, stream=upstream, head=head,
                          owner=owner, resume=state.plan)  # fmt: skip
        return _NEXT

    @staticmethod
    def _on_first_event(state: _State, pool: Upstream, upstream: UpstreamStream) -> FirstEvent | None:
        """What to do when the upstream's first event arrives: commit the stream's head (once)."""
        commit = state.commit
        if commit is None:
            return None

        async def first_event(line: str, opening: frozenset[int] | None) -> bool:
            state.commit = None
            sent = await commit(
                pool.name, upstream.url, list(state.attempts), None if opening is None else line
            )
            if sent and opening is not None:
                state.opened = opening
            return sent

        return first_event

    def _candidates(self, decision: RouteDecision, state: _State) -> Iterator[tuple[str, Upstream]]:
        """The chain's models with their pools, in order, as the walk reaches them; those that cannot
        be called now (and those the router skipped) are noted when the walk passes them, so that
        a model after the one that answers is never reported as a failover."""
        for i, model in enumerate(decision.chain):
            state.reach(i)
            pool = self.pools[self.policy.models[model].backend]
            reason = pool.unavailable_reason
            if reason is None:
                yield model, pool
            else:
                state.skipped(model, pool.name, reason)

    def _begin(self, state: _State, model: str, pool: Upstream, stream: bool) -> dict[str, str] | None:
        """The attempt's span, and the headers that carry it upstream (None: not traced)."""
        state.progress.calling = pool.name
        spec = self.policy.backends[pool.name]
        return state.trace.begin_attempt(model, self.policy.upstream_model(model), pool.name, spec, stream)

    def _upstream_body(self, body: dict[str, Any], model: str) -> dict[str, Any]:
        """The request as `model`'s backend gets it: under the upstream's own name for the model."""
        return {**body, "model": self.policy.upstream_model(model)}

    @staticmethod
    def _resumes(decision: RouteDecision, spec: EngineBackend, body: dict[str, Any]) -> bool:
        """Whether a stream from this engine pool goes on elsewhere if its replica fails mid-answer:
        the pool resumes, the route does not say no, the answer has one choice."""
        if not spec.resume_streams or spec.max_resumptions < 1 or decision.resume_streams is False:
            return False
        return resumable_body(body)


@dataclass
class Progress:
    """How far a walk has come: the attempts that failed so far, and the backend being called now."""

    attempts: list[Attempt] = field(default_factory=list)
    calling: str | None = None


class _State:
    """What one request has tried so far."""

    def __init__(self, decision: RouteDecision, trace: Trace, progress: Progress) -> None:
        self.decision = decision
        self.trace = trace
        self.progress = progress
        self.affinity: int | None = None  # the prefix key while the pool tried balances by it
        self.plan: ResumePlan | None = None  # how the model tried now resumes a broken stream
        self.commit: Commit | None = None  # a stream's head, not sent yet (sent at an upstream's first event)
        self.first_token: FirstToken | None = None  # told the served stream's head
        # the choices whose opening event (sent with the head) the client has, from an upstream
        self.opened: frozenset[int] = frozenset()
        self.attempts: list[Attempt] = progress.attempts  # shared: what a caller that left has seen
        self.unavailable_reasons: list[str] = []
        self.last: UpstreamReply | None = None
        self.last_timeout = False
        self.last_invalid = False  # the last call answered 200 with what is not an answer
        self.calls = 0
        self.started = time.monotonic()  # the request's `total` runs from here, across its attempts
        # models the router skipped (capabilities), by where they sat in the chain: noted when reached
        at = decision.skipped_at or (0,) * len(decision.skipped)
        self._router_skipped = sorted(zip(at, range(len(at)), decision.skipped, strict=True))

    def reach(self, index: int) -> None:
        """The walk is at chain[index]: the router's skipped models before it are noted, never called."""
        while self._router_skipped and self._router_skipped[0][0] <= index:
            attempt = self._router_skipped.pop(0)[2]
            self.attempts.append(attempt)
            self.trace.failed_over(attempt.model, attempt.backend, None, attempt.outcome, attempt.reason)

    def affinity_arg(self) -> dict[str, int]:
        """`affinity=` for the call, only once there is a key: upstreams that balance otherwise (and
        ones written before the argument existed) are called as before."""
        return {} if self.affinity is None else {"affinity": self.affinity}

    def budget(self) -> bool:
        return self.calls < _ATTEMPT_CAP

    def timeouts(self, pool: Upstream) -> Timeouts | None:
        """An attempt's timeouts: the route's (None: the pool's own) for the first call; for a later
        one, within what is left of its `total` since the request's walk began (a second replica, a
        retry or the next model does not start its clock again: two replicas that accepted and
        never answered took twice `total`). _OutOfTimeError when nothing is left of it (a fallback
        whose backend has a longer `total` is still tried)."""
        if self.calls == 0 and not self.attempts:
            return self.decision.timeouts
        t = self.decision.timeouts or pool.timeouts
        left = t.total - (time.monotonic() - self.started)
        if left <= _LEAST_ATTEMPT_SECONDS:
            raise _OutOfTimeError
        if left >= t.total:
            return self.decision.timeouts
        return Timeouts(connect=min(t.connect, left), first_token=min(t.first_token, left), total=left,
                        between_tokens=t.between_tokens)  # fmt: skip

    def failed(
        self,
        model: str,
        backend: str,
        deployment: str | None,
        outcome: str,
        cause: UpstreamReply | UpstreamUnavailableError | None,
        timeout: bool = False,
        invalid: bool = False,
    ) -> None:
        self.calls += 1
        self.last_invalid = invalid
        attempt = Attempt(model, backend, deployment, outcome)
        self.attempts.append(attempt)
        status = cause.status if isinstance(cause, UpstreamReply) else None
        self.trace.failed_over(model, backend, deployment, outcome, attempt.reason, status)
        if isinstance(cause, UpstreamReply):
            self.last, self.last_timeout = cause, False
        else:
            self.last = None
            self.last_timeout = timeout or (isinstance(cause, UpstreamUnavailableError) and cause.timeout)

    def no_deployment(self, model: str, backend: str, reason: str, tried_some: bool) -> None:
        """The backend had nothing to offer: noted (unless this round already tried its replicas)."""
        self.trace.no_call(model, backend, f"unavailable ({reason})", noted=not tried_some)
        if not tried_some:
            self.attempts.append(Attempt(model, backend, None, f"unavailable ({reason})", called=False))
            self.unavailable_reasons.append(f"{model}: {reason}")

    def skipped(self, model: str, backend: str, reason: str) -> None:
        """A model whose backend cannot be called now: noted, never called."""
        self.attempts.append(Attempt(model, backend, None, f"unavailable ({reason})", called=False))
        self.unavailable_reasons.append(f"{model}: {reason}")
        self.trace.failed_over(model, backend, None, f"unavailable ({reason})", "unavailable")

    def exhausted(self) -> ChainExhaustedError:
        """The error for a chain that served nothing; its message is for the client (no URL, no
        upstream error text: those stay in the log row's failover column)."""
        self.reach(len(self.decision.chain))
        tried = ", ".join(a.public() for a in self.attempts) or "nothing"
        called = any(a.called for a in self.attempts)
        residency = (
            " (hosted models skipped: data must stay self-hosted)" if self.decision.self_hosted_only else ""
        )
        if not called and self.unavailable_reasons:
            models = ", ".join(dict.fromkeys(a.model for a in self.attempts if a.reason == "unavailable"))
            # the models skipped for the request itself (a capability, the context) say why, too
            unfit = ", ".join(a.public() for a in self.attempts if a.reason != "unavailable")
            why = f"{models}: unavailable" + (f"; {unfit}" if unfit else "")
            message = f"no model can serve '{self.decision.alias}' now ({why})"
        else:
            message = f"every model for '{self.decision.alias}' failed; tried: {tried}"
        return ChainExhaustedError(
            message + residency,
            self.attempts,
            self.last,
            self.last_timeout,
            not called,
            self.decision.self_hosted_only,
            self.last_invalid,
        )


class _OutOfTimeError(Exception):
    """The request's `total` is spent before its next attempt."""


_LEAST_ATTEMPT_SECONDS = 0.01  # less left than this for a call is none left


def _unavailable(exc: UpstreamUnavailableError) -> str:
    return "timeout" if exc.timeout else "unreachable"
