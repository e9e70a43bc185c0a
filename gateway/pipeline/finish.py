"""The last stage of a request: its one log row, the release of what it reserved, and its sinks.

`Finish(call, status, error)` may be called more than once (a relay's end after a handler's); the
first call counts. An answer without believable usage is counted with the tokenizer in a worker
thread (seconds for megabytes of text): the row follows when the count is done, never blocking
the loop. Then the row is priced, the admission ticket released, and the request's record handed
to every sink: the request log, the telemetry (metrics, access log) and the request's trace.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from decimal import Decimal
from typing import Any

import orjson

from gateway.config.policy import EngineBackend, Policy
from gateway.governance import tokens
from gateway.governance.usage import MAX_TOKENS, ZERO_COUNTS, choices, max_output, says_zero
from gateway.pipeline.admission import Admission
from gateway.pipeline.call import Call, Ended
from gateway.pipeline.runtime import RuntimeHolder
from gateway.store.models import to_picousd
from gateway.store.record import RecordSink, RequestRecord
from gateway.telemetry.trace import Trace

logger = logging.getLogger(__name__)


class Finish:
    """Ends requests: log row, reservations released, record to every sink."""

    def __init__(self, holder: RuntimeHolder, admission: Admission, log: RecordSink,
                 telemetry: Sequence[RecordSink]) -> None:  # fmt: skip
        self.holder = holder
        self.admission = admission
        self.log = log  # the request log: rows of requests that reached the proxy
        self.telemetry = tuple(telemetry)  # every request, those refused before the proxy too
        self._pending: set[asyncio.Task[None]] = set()  # rows waiting for their token count

    def __call__(self, call: Call, status: int, error: str | None) -> None:
        """The request's one log row, and the release of what it reserved (a second call does nothing)."""
        if call.logged:
            return
        call.logged = True
        # a stream that broke off (502) or was ended by the upstream's request error (400) after
        # sending answer lines was served as far as it went: those tokens are counted and billed;
        # one the gateway's shutdown cut off as one whose client left
        served = call.backend is not None and (
            status in (200, 499) or error == "gateway_shutdown" or (status in (400, 502) and bool(call.lines))
        )
        ended = call.ended()  # a count after it is not the request's time
        if served and call.usage and _past_reservation(call):
            logger.warning("request %s: %s reported a usage that costs more than the request reserved: "
                           "counted instead", call.id, call.backend)  # fmt: skip
            call.usage = {}
        if not served or (call.usage and not says_zero(call.usage)):
            self._finish(call, status, error, False, ended)
            return
        self._narrow(call)
        task = asyncio.get_running_loop().create_task(self._estimate_then_finish(call, status, error, ended))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    def _narrow(self, call: Call) -> None:
        """Before the count: hold no more than an upper bound of the request's tokens.

        A token is at least one byte of UTF-8 and a character at most four: the request's body
        bounds its prompt (a message's JSON outweighs its template tokens), four times the answer's
        characters bound the completion. Loose (the JSON of each event counts), but it frees the
        reservation of a short answer at once, not after the tokenizer had its turn.
        """
        if call.ticket is None or call.prices is None or call.backend is None:
            return
        if call.reply_body is not None:
            completion = len(call.reply_body)
        else:
            completion = 4 * sum(len(line) for line in call.lines)
        bound = {"prompt_tokens": call.body_bytes, "completion_tokens": completion}
        bound["total_tokens"] = call.body_bytes + completion
        cost, _ = call.prices.costs(call.backend, bound)
        self.admission.narrow(call.ticket, bound, cost)

    async def _estimate_then_finish(self, call: Call, status: int, error: str | None, ended: Ended) -> None:
        """Count the request's tokens; a reported zero stands only where the count finds none."""
        reported = call.usage
        try:
            counted = await asyncio.to_thread(
                estimated_usage, call, call.policy or self.holder.runtime.policy
            )
        except Exception:  # the row matters more than its count: log it without usage
            logger.exception("request %s: counting its tokens failed", call.id)
            counted = {}
        if reported and all(counted.get(n) == 0 for n in ZERO_COUNTS if reported[n] == 0):
            self._finish(call, status, error, False, ended)  # the zero was true: an empty prompt or answer
            return
        call.usage = counted
        self._finish(call, status, error, True, ended)

    def _finish(self, call: Call, status: int, error: str | None, estimated: bool, ended: Ended) -> None:
        """The release now, before the client can have the answer's end and ask again; the row and
        the sinks once the answer's bytes are out (they stamp when the request ended, not when
        they run): at concurrency 1 they cost a cold CPU ~0.1 ms that the client would wait for."""
        usage = call.usage or {}
        cost = reference = None
        if call.prices is not None and call.backend is not None and usage:
            cost, reference = call.prices.costs(call.backend, usage)
        if call.ticket is not None:
            self.admission.release(call.ticket, usage, cost)
            call.ticket = None
        later(self._record, call, status, error, cost, reference, estimated, ended)

    def _record(self, call: Call, status: int, error: str | None, cost: Decimal | None,
                reference: Decimal | None, estimated: bool,
                ended: Ended) -> None:  # fmt: skip
        """The request's row and record, handed to the request log and the telemetry, read against
        the policy it ran under (a reload meanwhile took its model and backend away: its metrics went
        to `unknown`, its spans lost their provider)."""
        policy = call.policy or self.holder.runtime.policy
        model = call.model
        rec = RequestRecord(
            call.row(status, error, cost, reference, estimated, ended),
            call.key.key_prefix,
            call.stream,
            call.attempts,
            model is not None and (model in policy.models or model in policy.routes),
            call.response_model,
            policy.backends.get(call.backend) if call.backend is not None else None,
            call.trace.ids,
            call.resumptions,
        )
        self.log.record(rec)
        self.observe(rec, call.trace)

    def observe(self, rec: RequestRecord, trace: Trace) -> None:
        """The telemetry of one finished request: every sink, then its trace."""
        for sink in self.telemetry:
            sink.record(rec)
        trace.record(rec)

    def observe_later(self, rec: RequestRecord, trace: Trace) -> None:
        """`observe`, once the answer being sent is out (a refusal's: its row is stamped already)."""
        later(self.observe, rec, trace)

    async def drain(self) -> None:
        """At shutdown: the rows still being counted are finished (before the log writer stops)."""
        if self._pending:
            await asyncio.gather(*self._pending, return_exceptions=True)


def later(work: Callable[..., None], *args: Any) -> None:
    """`work(*args)` from the loop, after the running task's next wait: a handler that sends its
    answer before waiting again (a whole answer, a stream's last event) has sent it by then. The
    loop runs callbacks in order, so the work is done before any later request's handler runs;
    a fault in it is logged (it must not reach a client that has its answer)."""
    asyncio.get_running_loop().call_soon(_logged, work, args)


def _logged(work: Callable[..., None], args: tuple[Any, ...]) -> None:
    try:
        work(*args)
    except Exception:
        logger.exception("recording a finished request failed")


def _past_reservation(call: Call) -> bool:
    """Whether a request's usage would cost more than it reserved on its budgets (its worst case:
    a prompt token per body byte, max_tokens per answer, at the dearest prices on its chain). An
    upstream may say 4,200 prompt tokens for a 200-byte question, within what a template could add:
    believed, three such requests on a $1 budget spent $12.63; concurrent requests may overspend a
    budget by at most one reservation only if none is billed past its own."""
    ticket = call.ticket
    # a blind charge (budgets failing open: Redis or the database away) reserved nothing to hold it to
    held = [charge.amount for charge in ticket.charges if not charge.blind] if ticket is not None else []
    if not held or call.prices is None or call.backend is None:
        return False
    cost, _ = call.prices.costs(call.backend, call.usage)
    return cost is not None and to_picousd(cost) > max(held)


def estimated_usage(call: Call, policy: Policy) -> dict[str, Any]:
    """No usage came back (an answer without it, a stream the client left): count it ourselves."""
    model = call.deployment if call.deployment and not call.deployment.startswith("http") else call.model
    spec = policy.backends.get(call.backend or "")
    tokenizer = spec.tokenizer if isinstance(spec, EngineBackend) else None
    chunks: list[dict[str, Any]] = []
    for raw in [call.reply_body] if call.reply_body is not None else [line[6:] for line in call.lines]:
        try:
            parsed = orjson.loads(raw)
        except orjson.JSONDecodeError:
            continue
        if isinstance(parsed, dict):
            chunks.append(parsed)
    # bounded as reported usage is (governance/usage.py): a count past it would lock a key out
    body = call.body or {}
    if call.told_prompt_tokens is not None:  # an engine's stream said: the templated prompt's count
        prompt = call.told_prompt_tokens
    else:
        prompt = tokens.count(tokens.prompt_text(body), model or "", tokenizer)
        prompt = min(prompt + tokens.prompt_token_ids(body) + tokens.chat_overhead(body), MAX_TOKENS)
    completion = min(tokens.count(tokens.completion_text(chunks), model or "", tokenizer), MAX_TOKENS)
    # within what the request reserved: a prompt token a byte (a told count past it is an engine's
    # word against the bytes), no more answer than it asked for (text an upstream sent past it)
    if call.body_bytes:
        prompt = min(prompt, call.body_bytes)
    most = max_output(body) or call.output_cap
    if most is not None:
        completion = min(completion, most * choices(body))
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
