"""A streamed answer relayed event by event: usage taken for the log, hidden where the client did
not ask for it, and, when the upstream breaks off, another replica of the pool going on from where
the client is (a resumable stream: resume.py) or an error event (never a silent switch).

The relay owns the served upstream: it closes it (`aclosing`) however the stream ends, and hands
the request's status to `done` (the log row and the release of its reservations, exactly once):
just before the event that carries `[DONE]` goes out, so that a client that asks again the moment
it has the end finds its budget settled (what the upstream sends after its `[DONE]`, drained for up
to a second, is nobody's time); otherwise when the stream ends. Gateway time is what the relay
spends between reading a line and handing its event on; everything else (waiting on the upstream,
the client reading) is upstream time. Two clock reads a line.

Under our own server, the events of a stream's middle leave without this generator: the endpoint
gives the relay an outlet to the client's connection, and an engine replica's lines are pumped into
`take` from the upstream connection's callbacks, which writes each event at once. A relayed chunk
then costs no task wake-up and no trip through the generators and the endpoint's send (measured in
docs/BENCHMARKS.md). What `take` declines comes through here as before: the end, an event for a
client whose socket is full (the send waits for it), a break.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import aclosing

import orjson

from gateway.backends.base import (
    PROMPT_TOKENS,
    Pump,
    UpstreamErrorEvent,
    UpstreamRequestErrorEvent,
    UpstreamStreamError,
)
from gateway.backends.upstream_errors import error_event, reduced_fields
from gateway.errors import cancelled_outcome
from gateway.governance.usage import checked_usage
from gateway.pipeline.call import Call
from gateway.pipeline.reply import DONE_EVENT, ClientWriter, Outlet
from gateway.pipeline.resume import TOKEN_IDS, StreamTokens, break_reason, ended_early
from gateway.pipeline.served import Served
from gateway.store.record import Resumption

logger = logging.getLogger(__name__)

_DONE = "data: [DONE]"
MAX_STREAM_CHARS = 64 << 20  # a stream's events in all, as a whole answer's bytes (MAX_REPLY_BYTES)
# what keeping one event costs besides its characters (a str's header, its slot in `call.lines`):
# counted toward MAX_STREAM_CHARS, which then bounds a stream's memory, tiny events too (a million
# `data:{}` held 80 MB for 9 MB of text)
LINE_COST = 64
_AFTER_DONE_SECONDS = 1.0  # how long the upstream may take to end its body once it has sent [DONE]


class StreamTooLongError(UpstreamStreamError):
    """The stream passed MAX_STREAM_CHARS: ended with an error event, never resumed elsewhere."""


class EarlyHead:
    """A stream's head (its events up to the first token) written to the client where failover
    found the first token, when the stream's status and headers went out before it (`writer`, the
    client's connection, set then): the first text then leaves before failover, the proxy, the
    endpoint and the relay have returned and started (about a third of its time in the gateway on
    a cold CPU: docs/BENCHMARKS.md). The relay goes on after it, with its token record (`tokens`)
    and what broke the head (`broke`, raised by the relay as if it had read it).
    A head holding the stream's end, or a client whose socket is full, is left to the relay."""

    __slots__ = ("broke", "call", "relayed", "spent", "tokens", "wants_usage", "writer")

    def __init__(self, call: Call, wants_usage: bool) -> None:
        self.call = call
        self.wants_usage = wants_usage
        self.writer: ClientWriter | None = None
        self.relayed = False  # the head's events went out: the relay starts after them
        self.tokens: StreamTokens | None = None
        self.broke: Exception | None = None
        self.spent = 0.0  # gateway time, inside what the caller counts as waiting on the upstream

    def __call__(self, head: list[str], resumable: bool) -> None:
        """Failover has a stream's first token (the last of `head`) and serves that stream."""
        writer = self.writer
        if self.relayed or writer is None or _DONE in head or not writer.writable():
            return
        started = time.perf_counter()
        self.tokens = StreamTokens() if resumable else None
        events, self.broke = _relayed_head(self.call, head, self.wants_usage, self.tokens)
        self.relayed = True
        if events:
            writer.write_part(b"".join(events))
        self.spent = time.perf_counter() - started


async def relay(call: Call, served: Served, wants_usage: bool, done: Callable[[Call, int, str | None], None],
                outlet: Outlet | None = None,
                early: EarlyHead | None = None) -> AsyncGenerator[bytes, None]:  # fmt: skip
    """The client's events of an open stream whose first lines (`served.head`) are read already;
    a resumable one goes on on another replica when its own fails mid-answer (resume.py).

    Given an `outlet` that the endpoint connects to the client, and an upstream that can pump its
    lines, the events of the stream's middle are written from the upstream connection's callbacks
    (`take`), and only the others (the end, an event for a client whose socket is full, a break)
    come through here. A head that `early` relayed already is not relayed again."""
    status, error = 200, None
    answered = False  # the client has been handed the stream's end ([DONE]): a close is not a leave
    if early is not None and not early.relayed:
        early = None
    if early is not None:
        tokens = early.tokens
        call.upstream_seconds -= early.spent
    else:
        tokens = StreamTokens() if served.resume is not None else None
    current: Served | None = served
    perf_counter = time.perf_counter
    mark = perf_counter()  # gateway time up to here is counted; what follows is the upstream's

    def take(line: str) -> bool:  # a pumped line: relayed now, or declined (False) for the loop below
        nonlocal mark
        writer = outlet.writer if outlet is not None else None
        if writer is None or line == _DONE or not writer.writable():
            return False
        call.upstream_seconds += perf_counter() - mark
        event = relay_line(call, line, wants_usage, tokens)  # what it raises, the loop raises
        mark = perf_counter()
        if event is not None:
            writer.write_part(event)
        return True

    try:
        while current is not None:
            upstream, reading = current.stream, current
            assert upstream is not None
            try:
                async with aclosing(current):
                    ended = _DONE in current.head  # the upstream's end arrived (it may be in the head)
                    call.upstream_seconds += perf_counter() - mark
                    # read before committing to this upstream: one event for the client (one send);
                    # nothing after the end is the client's
                    lines = current.head[: current.head.index(_DONE) + 1] if ended else current.head
                    head: list[bytes] = []
                    if early is not None:  # the head went out already (not a resumed stream's)
                        broke, early = early.broke, None
                    else:
                        head, broke = _relayed_head(call, lines, wants_usage, tokens)
                    mark = perf_counter()
                    if head:
                        answered = ended and broke is None
                        if answered:
                            done(call, status, error)  # released before the client can ask again
                        yield b"".join(head)
                    if broke is not None:  # after the events before it (the role chunk is the client's)
                        raise broke
                    if not ended:
                        pump = upstream.pump if outlet is not None else None
                        async for line in upstream.lines if pump is None else _declined(pump, take):
                            call.upstream_seconds += perf_counter() - mark
                            ended = line == _DONE
                            event = relay_line(call, line, wants_usage, tokens)
                            mark = perf_counter()
                            if event is not None:
                                answered = ended
                                if ended:
                                    done(call, status, error)  # released before the client can ask again
                                yield event
                            if ended:
                                break
                        call.upstream_seconds += perf_counter() - mark
                    if not ended:  # the upstream closed the stream in the middle of the answer
                        raise ended_early()
                    mark = perf_counter()
                    upstream.answered()  # whole: what breaks while the rest is drained is no fault
                    await _drained(upstream.lines)  # the upstream's time, as the lines before were
                    call.upstream_seconds += perf_counter() - mark
                current = None
            except (asyncio.CancelledError, GeneratorExit) as exc:
                call.upstream_seconds += perf_counter() - mark  # (mostly spent waiting for its next line)
                # a client that closes once it has the end (the official SDKs stop reading at [DONE],
                # before the upstream's body has ended) got the whole answer
                if not answered:  # the client left, or the gateway's grace period at shutdown ran out
                    status, error = cancelled_outcome(exc)
                raise
            except UpstreamRequestErrorEvent as exc:  # the request's own fault: passed on, never resumed
                call.upstream_seconds += perf_counter() - mark
                mark = perf_counter()
                status, error = 400, exc.code
                current = None
                yield exc.event
            except Exception as exc:  # broke off mid-stream: resumed, or the client is told
                # the wait up to the break (a silence, the total timeout) was the upstream's, not ours
                call.upstream_seconds += perf_counter() - mark
                mark = perf_counter()
                if tokens is not None and tokens.finished and call.usage:  # all but the end: given
                    current = None
                    answered = True
                    done(call, status, error)
                    yield DONE_EVENT
                    continue
                oversized = isinstance(exc, StreamTooLongError)  # another replica would send as much
                if not oversized:  # the answer the client asked for was that long: not the replica's fault
                    upstream.verdict(False)  # its first token's success, amended: its breaker counts it
                mark = perf_counter()
                try:
                    current = None if oversized else await _resumed(call, reading, tokens, exc)
                except asyncio.CancelledError as cancelled:  # the client left, or the gateway stopped
                    status, error = cancelled_outcome(cancelled)
                    raise
                call.upstream_seconds += perf_counter() - mark  # waiting for another replica
                mark = perf_counter()
                if current is None:  # never switched silently: the client learns the stream failed
                    status, error = 502, "upstream_stream_error"
                    if isinstance(exc, UpstreamStreamError):
                        logger.warning("request %s: the stream from %s broke: %s", call.id, call.backend, exc)
                    else:
                        logger.exception("request %s: relaying %s's stream failed", call.id, call.backend)
                    yield error_event(f"the upstream stream ({call.backend}) failed", error)
    finally:
        done(call, status, error)


def _relayed_head(call: Call, lines: list[str], wants_usage: bool,
                  tokens: StreamTokens | None) -> tuple[list[bytes], Exception | None]:  # fmt: skip
    """The client's events of the head's lines, up to the first that breaks the stream (returned
    too): the events before it still go out, so that a stream resumed elsewhere, which sends no
    role chunk of its own, keeps the one the client was owed."""
    head: list[bytes] = []
    for line in lines:
        try:
            event = relay_line(call, line, wants_usage, tokens)
        except Exception as exc:
            return head, exc
        if event is not None:
            head.append(event)
    return head, None


async def _declined(pump: Pump, take: Callable[[str], bool]) -> AsyncGenerator[str, None]:
    """The lines of a pumped stream that `take` declined, in order."""
    while (line := await pump(take)) is not None:
        yield line


async def _drained(lines: AsyncIterator[str]) -> None:
    """Reads what an upstream sends after [DONE] (dropped: the client has its end) so that its
    connection, read to the end, can serve again; one that does not end soon is closed instead."""
    try:
        async with asyncio.timeout(_AFTER_DONE_SECONDS):
            async for _ in lines:
                pass
    except Exception:  # late bytes, a break or a stall after the end: the answer is whole already
        logger.debug("an upstream's stream did not end cleanly after [DONE]", exc_info=True)


async def _resumed(call: Call, failed: Served, tokens: StreamTokens | None, exc: Exception) -> Served | None:
    """Another replica going on with a broken stream, or None (not resumable, or none could)."""
    plan = failed.resume
    if plan is None or tokens is None or not plan.worth_it(tokens, call.started):
        return None
    reason, position = break_reason(exc), len(tokens.token_ids)
    plan.failed.add(failed.deployment)
    call.trace.resumed(failed.backend, failed.deployment, reason, position)
    opened = await plan.reopen(tokens, call.started, call.trace)
    if opened is None:
        return None
    served = Served(plan.model, plan.pool.name, opened.stream.url, [], stream=opened.stream,
                    owner=opened.owner, resume=plan)  # fmt: skip
    logger.warning(
        "request %s: the stream from %s broke (%s: %s); resumed after %d tokens on %s",
        call.id, failed.deployment, reason, exc, position, served.deployment,
    )  # fmt: skip
    call.resumptions.append(Resumption(failed.backend, failed.deployment, reason, position))
    call.deployment = served.deployment
    return served


def relay_line(call: Call, line: str, wants_usage: bool, tokens: StreamTokens | None = None) -> bytes | None:
    """One upstream SSE line as the client should see it (usage taken for the log; None: nothing).

    `tokens`: a resumable stream's, which takes the engine's token id lines (never the client's)
    and whose error event is a break to resume from, not an answer to pass on."""
    if not line:
        return None
    if call.ttft is None:
        # an engine stream opens with its prompt's count, for the log: not the client's, nor its first
        # token (a resumed stream's replica tells it again later: dropped below, as any comment line)
        if line.startswith(PROMPT_TOKENS):
            call.told_prompt(line)
            return None
        call.ttft = time.perf_counter() - call.started
    if line == _DONE:
        return DONE_EVENT
    if not line.startswith("data:"):  # comments, other fields, stray text: none of it is the client's
        if tokens is not None and line.startswith(TOKEN_IDS):
            tokens.announce(line)
        return None
    call.stream_chars += len(line) + LINE_COST
    if call.stream_chars > MAX_STREAM_CHARS:
        logger.warning("request %s: the stream from %s passed %d characters: ended", call.id, call.backend,
                       MAX_STREAM_CHARS)  # fmt: skip
        raise StreamTooLongError(f"the stream passed {MAX_STREAM_CHARS} characters")
    # Every event is parsed (about a microsecond each): one that is not a JSON object would
    # break the client's SDK mid-answer, so it ends the stream with an error event instead.
    try:
        chunk = orjson.loads(line[5:])
    except orjson.JSONDecodeError:
        raise UpstreamStreamError("the upstream sent an event that is not JSON") from None
    if not isinstance(chunk, dict):
        raise UpstreamStreamError("the upstream sent an event that is not a JSON object")
    if not _well_shaped(chunk.get("choices")):  # `choices: 7` or a string delta: the SDKs' loops raise
        logger.warning("request %s: an event from %s with misshapen choices dropped", call.id, call.backend)
        return None
    if chunk.get("id") != call.chunk_id:  # one id a stream, as OpenAI's: a candidate taking over
        if call.chunk_id is None:  # after the first event (failover before its first token) has its own
            call.chunk_id = chunk.get("id")
        elif "id" in chunk:
            chunk["id"] = call.chunk_id
            line = "data: " + orjson.dumps(chunk).decode()
    error = chunk.get("error")
    if isinstance(error, dict) and error.get("type") == "invalid_request_error":
        raise _request_error(error, call.hidden)
    if tokens is not None:
        if error is not None:
            raise UpstreamErrorEvent("the engine ended the stream with an error event")
        if not tokens.passes(chunk):
            return None
    call.lines.append(line)  # kept for the token count if the stream ends without usage
    usage = chunk.get("usage")
    if usage is not None:  # an object, or a string, a number, a list: none of those is believable
        checked = checked_usage(usage, call.body, call.body_bytes, call.output_cap)
        if checked:  # one not believable leaves a believable one before it in place
            call.usage = checked
            model = chunk.get("model")
            call.response_model = model if isinstance(model, str) else None
        if not wants_usage or not checked:  # nor does the client get one the gateway does not believe
            if not chunk.get("choices"):
                return None  # the usage-only chunk the client did not ask for
            chunk.pop("usage", None)
            return b"data: " + orjson.dumps(chunk) + b"\n\n"
    elif call.usage and _carries_answer(chunk):  # answer after the usage: it does not cover it,
        call.usage = {}  # so the tokens are counted at the end unless a later usage comes
    if usage is None and not wants_usage and '"usage":null' in line:  # text edit: no re-encoding
        line = line.replace(',"usage":null', "")
    return line.encode() + b"\n\n"


def opening_event(call: Call, line: str, wants_usage: bool) -> bytes:
    """The client's event for an upstream's opening line, which carries nothing but the opening
    (failover.py checked it), sent with the stream's head before the first token; kept for the
    token count, as every event the client was sent."""
    call.stream_chars += len(line) + LINE_COST
    call.lines.append(line)
    try:  # once a stream: the id its later events keep, whichever candidate sends them
        opening = orjson.loads(line[5:])
        call.chunk_id = opening.get("id") if isinstance(opening, dict) else None
    except orjson.JSONDecodeError:
        pass
    if not wants_usage and '"usage":null' in line:
        line = line.replace(',"usage":null', "")
    return line.encode() + b"\n\n"


def _well_shaped(choices: object) -> bool:
    """Whether an event's `choices` is absent or a list of objects whose `delta`, if any, is one
    (a null one passes: some servers send it beside a finish, which must not be lost)."""
    if choices is None:
        return True
    if not isinstance(choices, list):
        return False
    for choice in choices:  # a loop, not all(generator): once per event of every stream
        if not isinstance(choice, dict) or not isinstance(choice.get("delta") or {}, dict):
            return False
    return True


def _carries_answer(chunk: dict[str, object]) -> bool:
    """Whether an event holds answer text or calls, legacy function_call too (role-only and
    finish-only events do not)."""
    choices = chunk.get("choices")
    for choice in choices if isinstance(choices, list) else []:
        if not isinstance(choice, dict):
            continue
        delta = choice.get("delta")
        if isinstance(delta, dict) and (
            delta.get("content") or delta.get("tool_calls") or delta.get("function_call")
        ):
            return True
        if choice.get("text"):
            return True
    return False


def _request_error(error: dict[str, object], hidden: tuple[str, ...] = ()) -> UpstreamRequestErrorEvent:
    """The client's event for an upstream's mid-stream `invalid_request_error`: reduced as a whole
    4xx answer is (upstream_errors.reduced_fields), its code (else `invalid_request`) for the log."""
    fields = reduced_fields(error, 400, "", hidden)
    event = error_event(fields["message"] or "", fields["code"], "invalid_request_error", fields["param"])
    return UpstreamRequestErrorEvent(event, fields["code"] or "invalid_request")
