"""Stream resumption: a stream whose engine replica fails mid-answer goes on on another replica.

Failover switches freely until a stream's first token; after it, the client holds part of the
answer. For an engine pool that resumes (`resume_streams`, on by default), the gateway asks the
engine for each delta's token ids (`stream_token_ids`: SSE comment lines just before the data
line that completes the delta, stripped here) and keeps those the client has. When the replica
fails (connection reset, read timeout, an error event, a stream ended before `[DONE]`), another
replica of the same pool gets the same request with `resume: {token_ids, id, created}`: it takes
those tokens as its own earlier output (text, stop strings, grammar state, penalties, seeded
draws per position, max_tokens all go on from there) and streams only what follows, under the
first replica's id, without a role chunk. The client sees one answer and one usage chunk with
the true totals; the log has one row.

Never resumed: another model or a hosted API (only replicas of the pool that served), a request
with several choices, past `max_resumptions`, with less than `MIN_REMAINING_S` of the deadline
left, or when a chunk reached the client without the ids that produced it (an upstream that cut a
delta's events apart): then the stream ends with an error event, as without resumption.
"""

from __future__ import annotations

import time
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from typing import Any

import orjson

from gateway.backends.base import (
    Upstream,
    UpstreamErrorEvent,
    UpstreamStream,
    UpstreamStreamError,
    UpstreamUnavailableError,
)
from gateway.config.policy import EngineBackend, Timeouts
from gateway.telemetry.trace import Trace

TOKEN_IDS = ": token_ids "  # the engine's comment line: `: token_ids <choice> <id>,<id>,...`
MIN_REMAINING_S = 1.0  # less of the request's deadline than this left: not worth another replica
_MAX_TOKENS = 1 << 20  # ids one stream may report (the engine's own bound on a resumed request)
_MAX_ID_LINE = 64 << 10  # characters of one id line (the engine sends at most 4,096 ids a line)


def resumable_body(body: dict[str, Any]) -> bool:
    """Whether a request's answer can be resumed: one choice (n, best_of) of one prompt."""
    if body.get("n") not in (None, 1) or body.get("best_of") not in (None, 1):
        return False
    prompt = body.get("prompt")  # several prompts: several choices
    return not (isinstance(prompt, list) and len(prompt) > 1 and isinstance(prompt[0], (str, list)))


def break_reason(exc: BaseException) -> str:
    """A bounded label for why a stream broke (metrics, the log row)."""
    if isinstance(exc, UpstreamErrorEvent):
        return "error_event"
    if isinstance(exc, UpstreamStreamError) and isinstance(exc.__cause__, TimeoutError):
        return "timeout"
    if isinstance(exc, TimeoutError):
        return "timeout"
    if isinstance(exc, _EndedEarly):
        return "ended_early"
    return "reset"


class _EndedEarly(UpstreamStreamError):
    """The upstream closed the stream before `data: [DONE]`."""


def ended_early() -> UpstreamStreamError:
    """The error for a stream that closed before its end."""
    return _EndedEarly("the stream ended before data: [DONE]")


@dataclass
class StreamTokens:
    """What the client has of a resumable stream: the token ids behind the text it was sent."""

    token_ids: list[int] = field(default_factory=list)  # confirmed: their text reached the client
    pending: list[int] = field(default_factory=list)  # announced, for the next data line
    unconfirmed: int = 0  # chunks with output sent since the last confirmed ids (0: resumable)
    finished: bool = False  # the client has the choice's finish_reason
    id: str | None = None  # the answer's id and time, which a resumed stream keeps
    created: int | None = None

    def announce(self, line: str) -> None:
        """A `: token_ids 0 <ids>` line: the ids of the data line that follows."""
        if len(line) > _MAX_ID_LINE:  # refused before parsing: no long work on the event loop
            raise UpstreamStreamError("the upstream sent a token_ids line that is too long")
        _, _, rest = line.partition(TOKEN_IDS)
        index, _, ids = rest.partition(" ")
        if index != "0":
            raise UpstreamStreamError("the upstream reported token ids of another choice")
        try:
            tokens = [int(t) for t in ids.split(",")]
        except ValueError:
            raise UpstreamStreamError("the upstream sent a malformed token_ids line") from None
        if len(self.token_ids) + len(self.pending) + len(tokens) > _MAX_TOKENS or any(
            not 0 <= t < 1 << 31 for t in tokens
        ):
            raise UpstreamStreamError("the upstream sent token ids out of bounds")
        self.pending.extend(tokens)

    def passes(self, chunk: dict[str, Any]) -> bool:
        """Takes note of one data chunk; False for one the client must not get (a finished choice's
        repeat, from the replica that went on)."""
        choices = chunk.get("choices")
        if not isinstance(choices, list) or not choices:
            return True  # the usage chunk
        if self.finished:
            return False
        if self.id is None:
            ident, created = chunk.get("id"), chunk.get("created")
            self.id = ident if isinstance(ident, str) and 0 < len(ident) <= 128 else None
            self.created = created if isinstance(created, int) and 0 <= created < 1 << 40 else None
        choice = choices[0]
        if self.pending:
            self.token_ids.extend(self.pending)
            self.pending.clear()
            self.unconfirmed = 0
        elif isinstance(choice, dict) and _carries_output(choice):
            self.unconfirmed += 1
        if isinstance(choice, dict) and choice.get("finish_reason"):
            self.finished = True
        return True

    @property
    def resumable(self) -> bool:
        """Whether another replica can go on exactly where the client is."""
        return self.unconfirmed == 0 and self.id is not None


def _carries_output(choice: dict[str, Any]) -> bool:
    delta = choice.get("delta")
    # a legacy `functions` answer's call comes as `function_call` (engine/http/chat_tools.py)
    if isinstance(delta, dict) and (
        delta.get("content") or delta.get("tool_calls") or delta.get("function_call")
    ):
        return True
    return bool(choice.get("text") or choice.get("finish_reason"))


@dataclass(frozen=True)
class Reopened:
    """The stream another replica opened, and what holds it open (closed by the relay)."""

    stream: UpstreamStream
    owner: AsyncExitStack


class ResumePlan:
    """How one request's stream goes on: the pool, the upstream body, what is left of its budget."""

    def __init__(self, pool: Upstream, spec: EngineBackend, model: str, path: str, body: dict[str, Any],
                 timeouts: Timeouts) -> None:  # fmt: skip
        self.pool = pool
        self.spec = spec
        self.model = model
        self.path = path
        self.body = body  # as sent upstream (the upstream model's name, stream_token_ids)
        self.timeouts = timeouts
        self.left = spec.max_resumptions
        self.failed: set[str] = set()  # replicas this request's stream broke on, or could not reopen

    def worth_it(self, tokens: StreamTokens, started: float) -> bool:
        """Whether to try: resumptions left, the client's position known, time left."""
        return self.left > 0 and tokens.resumable and self._remaining(started) >= MIN_REMAINING_S

    def _remaining(self, started: float) -> float:
        return self.timeouts.total - (time.perf_counter() - started)

    async def reopen(self, tokens: StreamTokens, started: float, trace: Trace) -> Reopened | None:
        """The stream opened on another replica, going on after `tokens` (None: none could)."""
        remaining = self._remaining(started)
        t = self.timeouts
        # the pool's silence bound holds on the new replica too (was: dropped, so a second stall was
        # waited out to `total`, the default 30 s or the whole request's, not `between_tokens`)
        timeouts = Timeouts(connect=t.connect, first_token=min(t.first_token, remaining), total=remaining,
                            between_tokens=min(t.between_tokens, remaining))  # fmt: skip
        resume: dict[str, Any] = {"token_ids": tokens.token_ids, "id": tokens.id}
        if tokens.created is not None:
            resume["created"] = tokens.created
        payload = orjson.dumps({**self.body, "resume": resume})
        upstream_model = str(self.body.get("model"))
        while True:
            headers = trace.begin_attempt(self.model, upstream_model, self.pool.name, self.spec, True)
            owner = AsyncExitStack()
            try:
                upstream = await owner.enter_async_context(
                    self.pool.stream(self.path, payload, timeouts, frozenset(self.failed), headers)
                )
            except UpstreamUnavailableError as exc:
                if exc.deployment is None:  # no replica left to ask
                    trace.no_call(self.model, self.pool.name, "unavailable", noted=False)
                    return None
                trace.end_attempt(exc.deployment, None, "unreachable", str(exc))
                self.failed.add(exc.deployment)
                continue
            if upstream.status != 200:  # the replica refused (overloaded, or our request): another
                trace.end_attempt(upstream.url, upstream.status)
                self.failed.add(upstream.url)
                await owner.aclose()
                continue
            self.left -= 1
            return Reopened(upstream, owner)
