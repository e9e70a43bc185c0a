"""One OpenAI request through the gateway: checks, the upstream call, headers and the log row."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Mapping
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import orjson

from gateway.backends.base import Attempt, UpstreamStreamError
from gateway.backends.upstream_errors import error_code, error_event, is_openai_error
from gateway.config.policy import EngineBackend, Policy
from gateway.errors import GatewayError, auth_error_type, error_body
from gateway.governance import tokens
from gateway.governance.budgets import (
    BudgetExceededError,
    BudgetUnavailableError,
)
from gateway.governance.keys import AuthError, KeyInfo
from gateway.governance.ratelimit import (
    LimiterUnavailableError,
    RateLimitedError,
    retry_after_header,
)
from gateway.governance.usage import ZERO_COUNTS, checked_usage, says_zero
from gateway.pipeline.admission import Admission
from gateway.pipeline.call import Call, refused_row
from gateway.pipeline.failover import ChainExhaustedError, Served
from gateway.pipeline.reply import JSON_HEADER, SSE_HEADERS, Reply, error_reply
from gateway.pipeline.runtime import Runtime, RuntimeHolder
from gateway.routing.router import NoRouteError
from gateway.store.request_log import RequestLogWriter
from gateway.telemetry.access_log import AccessLog
from gateway.telemetry.metrics import UNKNOWN, GatewayMetrics

if TYPE_CHECKING:  # imported only when tracing is on
    from gateway.telemetry.tracing import GatewayTracing, RequestTrace

logger = logging.getLogger(__name__)


class Proxy:
    """Routes chat and text completions along the policy's chains and logs every request."""

    def __init__(
        self,
        holder: RuntimeHolder,
        log: RequestLogWriter,
        admission: Admission | None = None,
        metrics: GatewayMetrics | None = None,
        access: AccessLog | None = None,
        tracing: GatewayTracing | None = None,
    ) -> None:
        self.holder = holder
        self.log = log
        self.admission = admission or Admission()
        self.metrics = metrics
        self.access = access
        self.tracing = tracing  # None: tracing off, no span is ever created
        self._pending: set[asyncio.Task[None]] = set()  # rows waiting for their token count

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
            chain = _static_chain(rt.policy, name)
            usable = any(rt.pools[rt.policy.models[m].backend].unavailable_reason is None for m in chain)
            listed.append((name, None if usable else "no backend can serve this model now"))
        return listed

    async def handle(self, path: str, raw: bytes, key: KeyInfo, trace: RequestTrace | None = None) -> Reply:
        """Forward one request; every outcome, errors and client disconnects included, gets a log row."""
        call = Call(f"req-{uuid.uuid4().hex}", key, time.perf_counter(), datetime.now(UTC), trace=trace)
        rt = self.runtime  # one policy version for the whole request, even if a reload lands meanwhile
        call.prices = rt.prices
        try:
            body, wants_usage = self._prepare(rt, call, raw)
            call.body = body
            call.decision = rt.router.decide(call.model or "", body, key)
            if trace is not None:
                trace.routed(call.decision)
            call.ticket = await self.admission.admit(rt, key, call.decision, body, len(raw))
            if call.stream:
                return await self._stream(rt, call, path, body, wants_usage)
            return await self._whole(rt, call, path, body)
        except GatewayError as exc:
            return self._failed(call, exc.status, exc.message, exc.type, exc.param, exc.code)
        except AuthError as exc:
            return self._failed(call, exc.status, exc.message, auth_error_type(exc.status), None, exc.code)
        except NoRouteError as exc:
            return self._failed(call, 503, str(exc), "api_error", "model", "no_route")
        except RateLimitedError as exc:
            kind = "tokens" if "tokens" in str(exc) else "requests"
            reply = self._failed(call, 429, str(exc), kind, None, "rate_limit_exceeded")
            reply.headers.append((b"retry-after", retry_after_header(exc.retry_after)))
            return reply
        except LimiterUnavailableError as exc:
            return self._failed(call, 503, str(exc), "api_error", None, "rate_limiter_unavailable")
        except BudgetExceededError as exc:
            reply = self._failed(call, 429, str(exc), "insufficient_quota", None, "budget_exceeded")
            if exc.reset is not None:
                wait = (exc.reset - datetime.now(UTC)).total_seconds()
                reply.headers.append((b"retry-after", retry_after_header(wait)))
                reply.headers.append((b"x-budget-reset", exc.reset.isoformat().encode()))
            return reply
        except BudgetUnavailableError as exc:
            return self._failed(call, 503, str(exc), "api_error", None, "budget_unavailable")
        except ChainExhaustedError as exc:
            return self._exhausted(call, exc)
        except asyncio.CancelledError:  # the client left before the answer was ready
            self._log(call, 499, "client_disconnected")
            raise
        except Exception:  # a fault nothing above names (an upstream's bytes nobody foresaw): 502, logged
            logger.exception("request %s failed unexpectedly", call.id)
            message = "the upstream's answer could not be processed"
            return self._failed(call, 502, message, "api_error", None, "upstream_error")

    def refuse(self, started: float, status: int, message: str, type_: str, code: str | None,
               trace: RequestTrace | None) -> Reply:  # fmt: skip
        """An answer given before a request reaches `handle` (method, key, body): counted and logged,
        not written to the request log (there is no key to charge it to)."""
        request_id = f"req-{uuid.uuid4().hex}"
        self._observe(refused_row(request_id, started, status, code), None, False, [], trace)
        reply = error_reply(status, message, type_, None, code)
        reply.headers.append((b"x-request-id", request_id.encode()))
        return reply

    def _estimated_usage(self, call: Call) -> dict[str, Any]:
        """No usage came back (an answer without it, a stream the client left): count it ourselves."""
        model = call.deployment if call.deployment and not call.deployment.startswith("http") else call.model
        spec = self.runtime.policy.backends.get(call.backend or "")
        tokenizer = spec.tokenizer if isinstance(spec, EngineBackend) else None
        chunks: list[dict[str, Any]] = []
        for raw in [call.reply_body] if call.reply_body is not None else [line[6:] for line in call.lines]:
            try:
                parsed = orjson.loads(raw)
            except orjson.JSONDecodeError:
                continue
            if isinstance(parsed, dict):
                chunks.append(parsed)
        prompt = tokens.count(tokens.prompt_text(call.body or {}), model or "", tokenizer)
        completion = tokens.count(tokens.completion_text(chunks), model or "", tokenizer)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def _exhausted(self, call: Call, exc: ChainExhaustedError) -> Reply:
        """Every model failed: the last upstream error answer as it was, else 503/504/502."""
        call.attempts = exc.attempts
        logger.warning("request %s: %s (%s)", call.id, exc, exc.detail())
        if exc.last is not None:
            call.deployment = exc.last.url
            return self._passed_on(call, exc.last.status, exc.last.body)
        if exc.unavailable:
            return self._failed(call, 503, str(exc), "api_error", "model", "model_unavailable")
        if call.decision is not None and call.decision.self_hosted_only:  # never "try hosted": say so
            return self._failed(call, 503, str(exc), "api_error", "model", "self_hosted_unavailable")
        if exc.timeout:
            return self._failed(call, 504, str(exc), "api_error", None, "upstream_timeout")
        return self._failed(call, 502, str(exc), "api_error", None, "upstream_unavailable")

    def _passed_on(self, call: Call, status: int, body: bytes) -> Reply:
        """An upstream's error answer as the client gets it: in OpenAI's format, a 4xx with its status,
        a 503/504 as it is, any other status (500, 501, a 1xx-3xx that answers nothing) as 502.

        The gateway is the server the client talks to: an upstream's 500 is a bad gateway, and a body
        that is not an OpenAI error (an HTML page, plain text, a list) is replaced, never relayed.
        """
        client_status = status if 400 <= status < 500 or status in (502, 503, 504) else 502
        if not is_openai_error(body):
            logger.warning("request %s: %s answered HTTP %d without an OpenAI error: %r",
                           call.id, call.backend or call.model, status, body[:200])  # fmt: skip
            kind = "invalid_request_error" if client_status < 500 else "api_error"
            body = error_body(f"the upstream for '{call.model}' answered HTTP {status}", kind, None,
                              "upstream_error")  # fmt: skip
        self._log(call, client_status, error_code(body))
        return self._with_headers(call, Reply(client_status, [JSON_HEADER], body))

    def _failed(
        self, call: Call, status: int, message: str, type_: str, param: str | None, code: str | None
    ) -> Reply:
        self._log(call, status, code)
        return self._with_headers(call, error_reply(status, message, type_, param, code))

    def _prepare(self, rt: Runtime, call: Call, raw: bytes) -> tuple[dict[str, Any], bool]:
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise GatewayError(
                400, f"We could not parse the JSON body of your request: {exc}", code="invalid_json"
            ) from exc
        if not isinstance(body, dict):
            raise GatewayError(400, "The request body must be a JSON object", code="invalid_type")
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise GatewayError(
                400, "you must provide a model parameter", param="model", code="missing_required_parameter"
            )
        call.model = model
        call.stream = bool(body.get("stream"))
        if call.trace is not None:
            call.trace.parsed(model, body)
        if model not in rt.policy.models and model not in rt.policy.routes:
            raise GatewayError(
                404, f"The model '{model}' does not exist", param="model", code="model_not_found"
            )
        if not call.key.allows(model):
            raise AuthError(403, f"this key may not use the model '{model}'", "model_not_allowed")
        if rt.policy.log_bodies:
            call.request_body = raw
        options = body.get("stream_options")
        wants_usage = isinstance(options, dict) and options.get("include_usage") is True
        if body.get("stream") is True and not wants_usage:  # the log needs usage: ask, hide it later
            body["stream_options"] = {**(options if isinstance(options, dict) else {}), "include_usage": True}
        return body, wants_usage

    async def _whole(self, rt: Runtime, call: Call, path: str, body: dict[str, Any]) -> Reply:
        assert call.decision is not None
        sent = time.perf_counter()
        try:
            served = await rt.failover.send(call.decision, path, body, call.trace)
        finally:
            call.upstream_seconds = time.perf_counter() - sent
        self._served(call, served)
        reply = served.reply
        assert reply is not None
        if reply.status != 200:
            return self._passed_on(call, reply.status, reply.body)
        try:
            answer = orjson.loads(reply.body)
        except orjson.JSONDecodeError:
            answer = None
        if not isinstance(answer, dict):
            logger.warning("request %s: %s answered 200 with a body that is not a JSON object",
                           call.id, call.backend)  # fmt: skip
            message = f"the upstream ({call.backend}) sent an answer that is not a JSON object"
            return self._failed(call, 502, message, "api_error", None, "upstream_invalid_response")
        call.usage = checked_usage(answer.get("usage")) or {}
        model = answer.get("model")
        call.response_model = model if isinstance(model, str) else None
        relayed = reply.body
        if answer.get("usage") is not None and not call.usage:  # unbelievable: not relayed either
            answer["usage"] = None
            relayed = orjson.dumps(answer)
        if rt.policy.log_bodies:
            call.response_body = relayed
        call.reply_body = relayed
        self._log(call, reply.status, None)
        return self._with_headers(call, Reply(reply.status, [JSON_HEADER], relayed))

    @staticmethod
    def _served(call: Call, served: Served) -> None:
        call.backend, call.deployment, call.attempts = served.backend, served.deployment, served.attempts

    async def _stream(
        self, rt: Runtime, call: Call, path: str, body: dict[str, Any], wants_usage: bool
    ) -> Reply:
        assert call.decision is not None
        sent = time.perf_counter()
        try:
            served = await rt.failover.stream(call.decision, path, body, call.trace)
        finally:
            call.upstream_seconds = time.perf_counter() - sent  # up to the first token
        self._served(call, served)
        upstream, context = served.stream, served.context
        assert upstream is not None and context is not None
        if upstream.status != 200:
            await context.__aexit__(None, None, None)
            return self._passed_on(call, upstream.status, upstream.error_body)

        async def events() -> AsyncGenerator[bytes, None]:
            status, error = 200, None
            lines = upstream.lines.__aiter__()
            ended = "data: [DONE]" in served.head  # the upstream's end arrived (it may be in the head)
            try:
                for line in served.head:  # read before committing to this upstream
                    event = self._relay(call, line, wants_usage)
                    if event is not None:
                        paused = time.perf_counter()
                        yield event
                        call.upstream_seconds += time.perf_counter() - paused
                while True:
                    waited = time.perf_counter()
                    try:
                        line = await lines.__anext__()
                    except StopAsyncIteration:
                        break
                    finally:
                        call.upstream_seconds += time.perf_counter() - waited
                    ended = ended or line == "data: [DONE]"
                    event = self._relay(call, line, wants_usage)
                    if event is not None:
                        paused = time.perf_counter()
                        yield event
                        call.upstream_seconds += time.perf_counter() - paused  # the client reading
                if not ended:  # the upstream closed the stream in the middle of the answer
                    raise UpstreamStreamError("the stream ended before data: [DONE]")
            except (asyncio.CancelledError, GeneratorExit):
                status, error = 499, "client_disconnected"
                raise
            except Exception as exc:  # broke off mid-stream: tell the client, never switch silently
                status, error = 502, "upstream_stream_error"
                if isinstance(exc, UpstreamStreamError):
                    logger.warning("request %s: the stream from %s broke: %s", call.id, call.backend, exc)
                else:
                    logger.exception("request %s: relaying %s's stream failed", call.id, call.backend)
                yield error_event(f"the upstream stream ({call.backend}) failed", error)
            finally:
                await context.__aexit__(None, None, None)
                self._log(call, status, error)

        return self._with_headers(call, Reply(200, list(SSE_HEADERS), events=events()))

    def _relay(self, call: Call, line: str, wants_usage: bool) -> bytes | None:
        """One upstream SSE line as the client should see it (usage taken for the log)."""
        if not line:
            return None
        if call.ttft is None:
            call.ttft = time.perf_counter() - call.started
        if not line.startswith("data:") or line == "data: [DONE]":
            return line.encode() + b"\n\n"
        # Every event is parsed (about a microsecond each): one that is not a JSON object would
        # break the client's SDK mid-answer, so it ends the stream with an error event instead.
        try:
            chunk = orjson.loads(line[5:])
        except orjson.JSONDecodeError:
            raise UpstreamStreamError("the upstream sent an event that is not JSON") from None
        if not isinstance(chunk, dict):
            raise UpstreamStreamError("the upstream sent an event that is not a JSON object")
        call.lines.append(line)  # kept for the token count if the stream ends without usage
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            call.usage = checked_usage(usage) or {}
            model = chunk.get("model")
            call.response_model = model if isinstance(model, str) else None
            if not wants_usage:
                if not chunk.get("choices"):
                    return None  # the usage-only chunk the client did not ask for
                chunk.pop("usage", None)
                return b"data: " + orjson.dumps(chunk) + b"\n\n"
        elif not wants_usage and usage is None and '"usage":null' in line:  # text edit: no re-encoding
            line = line.replace(',"usage":null', "")
        return line.encode() + b"\n\n"

    def _with_headers(self, call: Call, reply: Reply) -> Reply:
        reply.headers.append((b"x-request-id", call.id.encode()))
        if call.backend:
            reply.headers.append((b"x-gateway-backend", call.backend.encode()))
        if call.decision is not None:
            reply.headers.append((b"x-gateway-route", call.decision.header().encode()))
        if call.attempts:
            tried = ", ".join(a.public() for a in call.attempts)
            reply.headers.append((b"x-gateway-failover", tried.encode("ascii", "replace")))
        reply.headers.append((b"x-gateway-overhead-ms", b"%.3f" % call.overhead_ms()))
        return reply

    def _log(self, call: Call, status: int, error: str | None) -> None:
        """The request's one log row, and the release of what it reserved (a second call does nothing).

        An answer without believable usage is counted with the tokenizer in a worker thread (seconds
        for megabytes of text): the row follows when the count is done, never blocking the loop.
        """
        if call.logged:
            return
        call.logged = True
        served = call.backend is not None and (status in (200, 499) or (status == 502 and bool(call.lines)))
        if not served or (call.usage and not says_zero(call.usage)):
            self._finish(call, status, error, False)
            return
        task = asyncio.get_running_loop().create_task(self._estimate_then_finish(call, status, error))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _estimate_then_finish(self, call: Call, status: int, error: str | None) -> None:
        """Count the request's tokens; a reported zero stands only where the count finds none."""
        reported = call.usage
        try:
            counted = await asyncio.to_thread(self._estimated_usage, call)
        except Exception:  # the row matters more than its count: log it without usage
            logger.exception("request %s: counting its tokens failed", call.id)
            counted = {}
        if reported and all(counted.get(n) == 0 for n in ZERO_COUNTS if reported[n] == 0):
            self._finish(call, status, error, False)  # the zero was true: an empty prompt or answer
            return
        call.usage = counted
        self._finish(call, status, error, True)

    def _finish(self, call: Call, status: int, error: str | None, estimated: bool) -> None:
        usage = call.usage or {}
        cost = reference = None
        if call.prices is not None and call.backend is not None and usage:
            cost, reference = call.prices.costs(call.backend, usage)
        if call.ticket is not None:
            self.admission.release(call.ticket, usage, cost)
            call.ticket = None
        row = call.row(status, error, cost, reference, estimated)
        self.log.record(row)
        self._observe(row, call, call.stream, call.attempts, call.trace)

    async def drain(self) -> None:
        """At shutdown: the rows still being counted are finished (before the log writer stops)."""
        if self._pending:
            await asyncio.gather(*self._pending, return_exceptions=True)

    def _observe(self, row: Mapping[str, Any], call: Call | None, stream: bool, attempts: list[Attempt],
                 trace: RequestTrace | None) -> None:  # fmt: skip
        """Metrics, trace and access line of one finished request, all from its row."""
        if self.metrics is not None:
            self.metrics.observe(row, self._model_label(row["requested_model"]), attempts)
        if trace is not None:
            spec = self.runtime.policy.backends.get(row["backend"] or "")
            trace.finish(row, call.response_model if call else None, spec, len(attempts))
        if self.access is not None:
            self.access.write(row, call.key.key_prefix if call else None, stream, len(attempts),
                              trace.ids if trace is not None else None)  # fmt: skip

    def _model_label(self, model: str | None) -> str:
        """The requested model as a metric label: a name the policy knows, else "unknown"."""
        policy = self.runtime.policy
        return model if model is not None and (model in policy.models or model in policy.routes) else UNKNOWN


def _static_chain(policy: Policy, name: str) -> list[str]:
    """Every model a name may reach (for listing availability)."""
    if name in policy.models:
        return [name, *policy.models[name].fallbacks]
    route = policy.routes[name]
    tiers = [m for tier in route.tiers for m in tier.candidates]
    return list(dict.fromkeys([*route.candidates, *tiers, *route.fallbacks]))
