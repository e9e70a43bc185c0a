"""One OpenAI request through the gateway, as a story: prepare, decide, admit, send or stream, finish.

Each stage lives in its own module: prepare.py (body, model, key), the router (decide),
admission.py (rate limits and budgets), failover.py (the chain), answer.py (a whole answer),
relay.py (a stream), finish.py (the log row, the release, the sinks). Every error a client may
get is a GatewayError, answered by gateway/errors.py's one mapping.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable
from datetime import UTC, datetime

from gateway.backends.base import Attempt
from gateway.config.policy import Policy
from gateway.errors import GatewayError, cancelled_outcome
from gateway.governance.keys import KeyInfo
from gateway.governance.usage import max_output
from gateway.pipeline.admission import Admission
from gateway.pipeline.answer import passed_on, whole
from gateway.pipeline.call import Call, request_id
from gateway.pipeline.failover import ChainExhaustedError, Commit, Progress
from gateway.pipeline.finish import Finish
from gateway.pipeline.prepare import prepare
from gateway.pipeline.relay import EarlyHead, opening_event, relay
from gateway.pipeline.reply import SSE_HEADERS, HeadSender, Outlet, Reply, error_reply, one_event
from gateway.pipeline.runtime import Runtime, RuntimeHolder
from gateway.pipeline.served import Served
from gateway.pipeline.stream_start import request_error
from gateway.routing.capabilities import CapabilityError
from gateway.store.record import RecordSink, RequestRecord, blank_row
from gateway.telemetry.trace import NO_TRACE, NO_TRACING, Trace, Tracing

logger = logging.getLogger(__name__)


class Proxy:
    """Routes chat and text completions along the policy's chains and logs every request."""

    def __init__(
        self,
        holder: RuntimeHolder,
        log: RecordSink,
        admission: Admission | None = None,
        metrics: RecordSink | None = None,
        access: RecordSink | None = None,
        tracing: Tracing | None = None,
    ) -> None:
        self.holder = holder
        self.admission = admission or Admission()
        self.tracing: Tracing = tracing or NO_TRACING
        telemetry = [sink for sink in (metrics, access) if sink is not None]
        self.finish = Finish(holder, self.admission, log, telemetry)

    @property
    def runtime(self) -> Runtime:
        """The active policy version (a reload replaces it between requests)."""
        return self.holder.runtime

    @property
    def policy(self) -> Policy:
        """The active policy."""
        return self.runtime.policy

    def models_for(self, key: KeyInfo) -> list[tuple[str, str | None]]:
        """The names this key may use, each with why it is unavailable (None: available).

        The reason is generic: the backends' own reasons name replica URLs and environment
        variables, which are the operator's business (GET /admin/policy has them)."""
        rt = self.runtime
        listed = []
        for name in rt.policy.exposed():
            if not key.allows(name):
                continue
            chain = rt.policy.reachable(name)
            usable = any(rt.pools[rt.policy.models[m].backend].unavailable_reason is None for m in chain)
            listed.append((name, None if usable else "no backend can serve this model now"))
        return listed

    async def handle(self, path: str, raw: bytes, key: KeyInfo, trace: Trace = NO_TRACE,
                     head: HeadSender | None = None) -> Reply:  # fmt: skip
        """Forward one request; every outcome, errors and client disconnects included, gets a log row.
        `head`: sends a stream's status and headers early (the policy's `stream_head`); once it has,
        the Reply's status and headers are spent and an error is the stream's one event."""
        call = Call(request_id(), key, time.perf_counter(), datetime.now(UTC), trace=trace)
        rt = self.runtime  # one policy version for the whole request, even if a reload lands meanwhile
        call.prices, call.policy = rt.prices, rt.policy
        try:
            body, wants_usage = prepare(rt, call, raw, path)
            model = call.model or ""
            needs = rt.router.capabilities.needs(model, body, len(raw))  # NO_NEEDS unless it needs something
            if needs.to_count:  # a body bigger than some model's context: count its prompt, off the loop
                needs = await rt.router.capabilities.counted(needs, body)
            call.decision = rt.router.decide(model, body, key, needs)
            trace.routed(call.decision)
            if max_output(body) is None:  # what one answer may take, when known: its usage is held to it
                call.output_cap = rt.prices.output_cap(
                    call.decision.chain, rt.router.capabilities.context_length, default=None
                )
            call.ticket = await self.admission.admit(rt, key, call.decision, body, len(raw))
            _raise_if_cancelled()
            progress = Progress()
            if call.stream:
                early, commit = None, None
                if head is not None and rt.policy.stream_head == "first_event":
                    early = EarlyHead(call, wants_usage)  # the head may go out with the first token
                    commit = self._committer(call, head, early)
                walk = rt.failover.stream(call.decision, path, body, trace, progress, commit, early)
                served = await self._upstream(call, walk, progress)
                return await self._streamed(call, served, wants_usage, early)
            served = await self._upstream(
                call, rt.failover.send(call.decision, path, body, trace, progress), progress
            )
            assert served.reply is not None
            call.hidden = served.reply.hidden
            return self._answered(call, *whole(call, served.reply, rt.policy.log_bodies))
        except ChainExhaustedError as exc:  # every model failed
            call.attempts = exc.attempts
            call.backend = call.deployment = None  # nothing served (a stream's head named the first)
            logger.warning("request %s: %s (%s)", call.id, exc, exc.detail())
            if exc.last is None:
                return self._failed(call, exc)
            call.deployment = exc.last.url  # the last upstream error answer, as it was
            last = exc.last
            call.hidden = last.hidden
            return self._answered(call, *passed_on(call, last.status, last.body, last.retry_after))
        except CapabilityError as exc:  # no model can serve what it needs: the skipped ones are logged
            call.attempts = exc.attempts
            return self._failed(call, exc)
        except GatewayError as exc:
            return self._failed(call, exc)
        except asyncio.CancelledError as exc:  # the client left before the answer was ready, or the
            self.finish(call, *cancelled_outcome(exc))  # gateway stopped, its grace period over
            raise
        except Exception:  # a fault nothing above names (an upstream's bytes nobody foresaw): 502, logged
            logger.exception("request %s failed unexpectedly", call.id)
            message = "the upstream's answer could not be processed"
            return self._failed(call, GatewayError(502, message, "api_error", code="upstream_error"))

    def refuse(self, started: float, exc: GatewayError, trace: Trace = NO_TRACE) -> Reply:
        """The answer to a request refused before it reaches `handle` (method, key, body): counted and
        logged by the telemetry, not written to the request log (there is no key to charge it to)."""
        refused_id = request_id()
        row = blank_row(
            refused_id, datetime.now(UTC), exc.status, round((time.perf_counter() - started) * 1e3, 3)
        )
        row["error_type"] = exc.code
        self.finish.observe_later(RequestRecord(row, trace_ids=trace.ids), trace)
        reply = error_reply(exc)
        reply.headers.append((b"x-request-id", refused_id.encode()))
        return reply

    async def drain(self) -> None:
        """At shutdown: the rows still being counted are finished (before the log writer stops)."""
        await self.finish.drain()

    @staticmethod
    async def _upstream(call: Call, served: Awaitable[Served], progress: Progress) -> Served:
        """What failover serves, its wait counted as upstream time (a stream's: to its first token).
        A client that leaves meanwhile is logged with what was tried and what it was waiting on."""
        sent = time.perf_counter()
        try:
            answer = await served
        except asyncio.CancelledError:
            call.attempts, call.calling = list(progress.attempts), progress.calling
            raise
        finally:
            call.upstream_seconds = time.perf_counter() - sent
        call.served_by(answer.backend, answer.deployment, answer.attempts)
        return answer

    @staticmethod
    def _committer(call: Call, head: HeadSender, early: EarlyHead) -> Commit:
        """Sends the stream's status and headers when an upstream's stream sends its first event: they
        name that upstream and what failed before it; the wait so far was the upstream's. The event
        goes with them when it carries nothing but the opening (`line`): the official SDKs parse
        each event into objects, which costs a client about half a millisecond when that happens
        after the first token rather than while the model works. The client's connection the
        head sender gives back lets `early` write the stream's first token at once."""
        opened = time.perf_counter()

        async def commit(backend: str, deployment: str, attempts: list[Attempt], line: str | None) -> bool:
            call.upstream_seconds = time.perf_counter() - opened
            call.served_by(backend, deployment, attempts)
            reply = call.stamp(Reply(200, list(SSE_HEADERS)))
            call.committed = True
            event = None if line is None else opening_event(call, line, early.wants_usage)
            early.writer = await head(reply.status, reply.headers, event)
            return event is not None

        return commit

    async def _streamed(self, call: Call, served: Served, wants_usage: bool,
                        early: EarlyHead | None) -> Reply:  # fmt: skip
        """An open stream relayed to the client; an error answer passed on (its upstream closed)."""
        upstream = served.stream
        assert upstream is not None
        call.hidden = upstream.hidden
        if upstream.status != 200:
            await served.aclose()
            answer = passed_on(call, upstream.status, upstream.error_body, upstream.retry_after)
            return self._answered(call, *answer)
        refused = None if call.committed or not served.head else request_error(served.head[-1])
        if refused is not None:  # the request's own fault before any token, the head not sent yet:
            await served.aclose()  # the client gets the error's status, as a whole request would
            return self._answered(call, *passed_on(call, 400, refused))
        outlet = Outlet()
        events = relay(call, served, wants_usage, self.finish, outlet, early)
        if call.committed:  # the head went with the first upstream event
            return Reply(200, [], events=events, outlet=outlet)
        return call.stamp(Reply(200, list(SSE_HEADERS), events=events, outlet=outlet))

    def _answered(self, call: Call, reply: Reply, error: str | None) -> Reply:
        self.finish(call, reply.status, error)
        if call.committed:  # the client has a stream's 200 head: the error is its one event
            line = reply.body.replace(b"\r", b" ").replace(b"\n", b" ")  # JSON: only whitespace
            return Reply(reply.status, [], events=one_event(b"data: " + line + b"\n\n"))
        return call.stamp(reply)

    def _failed(self, call: Call, exc: GatewayError) -> Reply:
        return self._answered(call, error_reply(exc), exc.code)


def _raise_if_cancelled() -> None:
    """A cancel asked for but lost on its way: raised now, before the upstream is called. Python
    3.11's wait_for (redis-py's, under its socket timeout) drops one that lands as the call it waits
    on finishes, leaving the task's `cancelling()` count up: a client that left during its admission
    had the upstream called for it, and was billed (15 of 20 such requests)."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError
