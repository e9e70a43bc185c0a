"""The engine's OpenAI-compatible HTTP server: routes, error mapping, limits, graceful shutdown."""

from __future__ import annotations

import asyncio
import hmac
import logging
import signal
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any, TypeVar

import uvicorn
from fastapi import Depends, FastAPI, Request, Response
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Send

from engine.async_engine import AsyncLLMEngine
from engine.config import EngineConfig
from engine.default_model import DEFAULT_MODEL_ALIAS, DEFAULT_MODEL_NAME
from engine.engine_state import describe
from engine.errors import ClientDisconnectedError, EngineError
from engine.http.error_mapping import NOSNIFF, api_error
from engine.http.h11_protocol import limited_h11_protocol
from engine.http.limits import ConcurrencyLimit, HTTPLimits, RequestSizeMiddleware
from engine.http.openai_format import SSE_DONE, dumps
from engine.http.protocol import (
    INTERNAL_ERROR,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    validation_error,
)
from engine.http.request_id import RequestIdMiddleware, scope_request_id
from engine.http.serving import OpenAIServing
from engine.http.tokenize import add_token_routes
from engine.metrics import CONTENT_TYPE

if TYPE_CHECKING:  # imported only when tracing is on
    from engine.http.tracing import EngineTracing, RequestSpan

logger = logging.getLogger(__name__)

_Req = TypeVar("_Req", bound=BaseModel)

# Bodies above this are parsed in a worker thread, so a few MiB of JSON do not hold the event loop.
_PARSE_INLINE_BYTES = 64 * 1024
_DEAD_CHECK_INTERVAL = 0.5  # seconds between checks that the engine can still serve


@dataclass(frozen=True)
class ServerOptions:
    """How the HTTP side behaves (the engine's own options are in EngineConfig)."""

    host: str = "127.0.0.1"
    port: int = 8001
    served_model_names: tuple[str, ...] = ()
    stall_timeout: float = 30.0  # /health turns 503 when the step loop makes no progress this long
    shutdown_timeout: float = 30.0  # on SIGTERM, how long requests in flight may take to finish
    api_key: str | None = None  # when set, /v1/* requires `Authorization: Bearer <key>`
    access_log: bool = True
    log_level: str = "info"
    otlp_traces_endpoint: str | None = None  # OTLP/HTTP traces URL; None: tracing off
    otel_service_name: str = "switchboard-engine"
    limits: HTTPLimits = field(default_factory=HTTPLimits)


def served_names(config: EngineConfig, options: ServerOptions) -> list[str]:
    """Names clients may pass as `model`: explicit ones, else the folder's name and the --model value."""
    if options.served_model_names:
        return list(options.served_model_names)
    if config.model == DEFAULT_MODEL_ALIAS:
        return [DEFAULT_MODEL_NAME, DEFAULT_MODEL_ALIAS]
    folder = Path(config.model).expanduser().name or config.model
    return [folder] if folder == config.model else [folder, config.model]


def create_app(
    engine: AsyncLLMEngine,
    names: list[str],
    api_key: str | None = None,
    tracing: EngineTracing | None = None,
    limits: HTTPLimits | None = None,
) -> FastAPI:
    """The FastAPI app; its lifespan starts the engine thread (the model loads in the background).

    `tracing`: spans for the completion routes (None: off, and no span is created).
    `limits`: body and header sizes and the body read timeout are enforced here (the rest in
    `run_server`).
    """
    limits = limits or HTTPLimits()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        try:
            yield
        finally:
            await asyncio.to_thread(engine.shutdown)
            if tracing is not None:
                tracing.shutdown()  # exports the spans still buffered

    # no redirect for a trailing slash: its Location was built from the client's Host header
    app = FastAPI(
        title="Switchboard engine", lifespan=lifespan, docs_url=None, redoc_url=None, redirect_slashes=False
    )
    app.state.engine = engine
    app.state.serving = OpenAIServing(engine, names)
    _install_error_handlers(app)
    _add_routes(app, engine, app.state.serving, _key_check(api_key), tracing)
    add_token_routes(app, app.state.serving, [Depends(_key_check(api_key))], _parse)

    def body_limit() -> int:
        info = engine.model_info
        return limits.body_limit(info.max_model_len if info is not None else None)

    app.add_middleware(
        RequestSizeMiddleware,
        limit=body_limit,
        read_timeout=limits.body_read_timeout,
        max_header_bytes=limits.max_header_bytes,
    )
    app.add_middleware(ConcurrencyLimit, limit=limits.limit_concurrency)  # refuses unread
    app.add_middleware(RequestIdMiddleware)  # outermost: every answer, refusals too, has its id
    return app


def _key_check(api_key: str | None) -> Callable[[Request], Awaitable[None]]:
    """A dependency: with a key configured, /v1 routes need `Authorization: Bearer <key>`."""
    expected = api_key.encode() if api_key else None

    async def check(request: Request) -> None:
        if expected is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), expected):
            raise APIError(401, "Incorrect or missing API key", code="invalid_api_key")

    return check


def _add_routes(
    app: FastAPI,
    engine: AsyncLLMEngine,
    serving: OpenAIServing,
    key_check: Callable[[Request], Awaitable[None]],
    tracing: EngineTracing | None,
) -> None:
    authorized = [Depends(key_check)]

    @app.post("/v1/chat/completions", dependencies=authorized)
    async def chat_completions(request: Request) -> Response:
        """OpenAI chat completions (the model's chat template), streamed or whole."""
        if tracing is not None:
            return await _traced(request, tracing.start(request.headers, request.url.path), serving)
        req = await _parse(request, ChatCompletionRequest)
        return _respond(await _until_disconnect(request, serving.chat(req)))

    @app.post("/v1/completions", dependencies=authorized)
    async def completions(request: Request) -> Response:
        """OpenAI (legacy) text completions, streamed or whole."""
        if tracing is not None:
            return await _traced(request, tracing.start(request.headers, request.url.path), serving)
        req = await _parse(request, CompletionRequest)
        return _respond(await _until_disconnect(request, serving.completions(req)))

    @app.get("/v1/models", dependencies=authorized)
    async def list_models() -> Response:
        """The served model names."""
        return _json(serving.models())

    @app.get("/v1/models/{model:path}", dependencies=authorized)
    async def get_model(model: str) -> Response:
        """One served model."""
        found = next((m for m in serving.models()["data"] if m["id"] == model), None)
        if found is None:  # ("" names the default model in a request; here, no model: /v1/models/ was 500)
            serving.served_model(model)  # its 404
            raise APIError(
                404, "GET /v1/models/{model} needs a model's name", param="model", code="model_not_found"
            )
        return _json(found)

    @app.api_route("/health", methods=["GET", "HEAD"])  # HEAD: load balancers that probe with it
    async def health() -> Response:
        """200 when loaded and the step loop is making progress; 503 otherwise."""
        state = engine.health()
        return _json(describe(state), 200 if state.healthy else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        """Prometheus text format."""
        return Response(engine.metrics.render(), media_type=CONTENT_TYPE)


async def _traced(request: Request, span: RequestSpan, serving: OpenAIServing) -> Response:
    """A completion route under its span: ended with the response, or with the stream it returns."""
    try:
        if request.url.path.endswith("/chat/completions"):
            chat = await _parse(request, ChatCompletionRequest)
            span.parsed(chat, serving.served_model(chat.model))
            work = serving.chat(chat, span)
        else:
            text = await _parse(request, CompletionRequest)
            span.parsed(text, serving.served_model(text.model))
            work = serving.completions(text, span)
        result = await _until_disconnect(request, work)
    except BaseException as exc:
        span.end(*_error_status(exc))
        raise
    if isinstance(result, dict):
        span.end(200)
        return _json(result)
    return _respond(span.streaming(result))


def _error_status(exc: BaseException) -> tuple[int, str]:
    """The status and error code (else type) the error handler answers `exc` with."""
    error = api_error(exc)
    return error.status, error.code or error.type


async def _parse(request: Request, model: type[_Req]) -> _Req:
    body = await request.body()  # already read, and bounded, by RequestSizeMiddleware
    try:
        if len(body) <= _PARSE_INLINE_BYTES:
            return model.model_validate_json(body)
        return await asyncio.to_thread(model.model_validate_json, body)
    except ValidationError as exc:
        raise validation_error(exc) from exc


def _json(body: Any, status: int = 200) -> Response:
    return Response(dumps(body), status_code=status, media_type="application/json")


class EventStreamResponse(StreamingResponse):
    """starlette's streaming answer, but its `[DONE]` event goes out with the answer's end, in one
    send (starlette sends the end later, once the event generator has closed): a client reading
    the answer to its end has it with [DONE], and one that stops reading at [DONE] (the official
    SDKs) closes an answer already complete."""

    async def stream_response(self, send: Send) -> None:
        """The head, each event, and the end (with the [DONE] event, or alone if none came)."""
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        ended = False
        async for chunk in self.body_iterator:
            if isinstance(chunk, str):
                chunk = chunk.encode(self.charset)
            data = bytes(chunk)  # (bytes as they are; a memoryview copied)
            if ended:  # nothing follows [DONE] (the event stream ends there)
                continue
            ended = data.endswith(SSE_DONE)
            await send({"type": "http.response.body", "body": data, "more_body": not ended})
        if not ended:
            await send({"type": "http.response.body", "body": b"", "more_body": False})


def _respond(result: dict[str, Any] | AsyncIterator[bytes]) -> Response:
    if isinstance(result, dict):
        return _json(result)
    return EventStreamResponse(
        result,
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


T = TypeVar("T")


async def _until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Run `work`, cancelling it (which aborts its engine request) if the client disconnects first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        disconnected = watcher.done() and not watcher.cancelled()
        watcher.cancel()
        if not task.done():
            task.cancel()
            # cancel() only asks: wait until it lands (reading the result before raised
            # InvalidStateError), then look at what the work ended with
            await asyncio.wait({task})
    if task.cancelled():
        raise ClientDisconnectedError()
    result = task.result()  # the work's own error, if any, propagates
    if disconnected and not isinstance(result, dict):
        # the work finished as the client left: nobody will read the stream, so close it now
        await result.aclose()  # type: ignore[attr-defined]
        raise ClientDisconnectedError()
    return result


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _install_error_handlers(app: FastAPI) -> None:
    """Every error answers through `api_error`; an unexpected one is logged, its text withheld."""

    async def answer(request: Request, exc: Exception) -> Response:
        error = api_error(exc)
        if error is INTERNAL_ERROR:  # Starlette logs the traceback too
            logger.error("unexpected error on %s: %s", request.url.path, type(exc).__name__)
        response = Response(
            dumps(error.body()),
            status_code=error.status,
            headers=error.headers,
            media_type="application/json",
        )
        response.raw_headers.append(NOSNIFF)
        rid = scope_request_id(request.scope)
        if rid is not None and not any(k == b"x-request-id" for k, _ in response.raw_headers):
            response.raw_headers.append((b"x-request-id", rid))  # a 500 from outside the middleware
        return response

    for exc_class in (EngineError, StarletteHTTPException, Exception):
        app.add_exception_handler(exc_class, answer)


class DrainingServer(uvicorn.Server):
    """uvicorn, but SIGTERM/SIGINT first drains: 503 for new work, requests in flight finish, exit 0.

    A second signal ends the drain now: the requests in flight are aborted (streams get their error
    event), the connections' grace ends, the engine stops, exit 0. A third exits at once (uvicorn's
    force_exit, which skips the engine's stop). If the engine dies (loading or the step loop failed,
    or its thread is gone), the server stops and `engine_died` is set: the process exits non-zero so
    that its supervisor restarts it; /health answers 503 until then.
    """

    def __init__(self, config: uvicorn.Config, engine: AsyncLLMEngine, drain_timeout: float) -> None:
        super().__init__(config)
        self._engine = engine
        self._drain_timeout = drain_timeout
        self._loop: asyncio.AbstractEventLoop | None = None
        self._signals = 0
        self._cut_off = asyncio.Event()  # set once a second signal's aborts have been delivered
        self.engine_died = False

    async def serve(self, sockets: Any = None) -> None:
        """Remember the event loop so signal handlers can schedule the drain on it; watch the engine."""
        self._loop = asyncio.get_running_loop()
        watcher = asyncio.ensure_future(self._watch_engine())
        try:
            await super().serve(sockets)
        finally:
            watcher.cancel()

    async def _watch_engine(self) -> None:
        while not self.should_exit:
            await asyncio.sleep(_DEAD_CHECK_INTERVAL)
            if self._engine.is_dead:
                logger.critical("the engine cannot serve any more: exiting for a restart")
                self.engine_died = True
                # /health answers 503 `dead` a moment first, so that health checks see why it went
                # (a watcher that found the engine dead at once left them almost no time to)
                await asyncio.sleep(_DEAD_CHECK_INTERVAL)
                self.should_exit = True
                return

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """A signal, in the main thread between two of the loop's steps: it only leaves word (the
        class's docstring). Not re-raised, so the exit code stays 0."""
        self._signals += 1
        loop = self._loop
        if loop is None or loop.is_closed() or self._signals >= 3:  # before serving, after it, or a third
            self.should_exit = True
            self.force_exit = self._signals >= 3
            return
        name = signal.Signals(sig).name
        if self._signals == 1:
            logger.info("received %s: draining", name)
            loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._drain()))
        else:
            logger.warning("received %s again: aborting the requests in flight", name)
            self.should_exit = True
            loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._abort_all()))

    async def _drain(self) -> None:
        aborted = await self._engine.drain(self._drain_timeout)
        logger.info("drained (%d request(s) aborted); shutting down", aborted)
        self.should_exit = True

    async def _abort_all(self) -> None:
        """The drain with no time left: abort what runs, let the handlers send their last bytes."""
        try:
            await self._engine.drain(0)
        finally:
            self._cut_off.set()

    async def _wait_tasks_to_complete(self) -> None:
        """uvicorn's wait for the connections to finish, cut short once a second signal's aborts are
        delivered (uvicorn then cancels what is left and runs the app's shutdown: the engine stops)."""
        waiting = asyncio.ensure_future(super()._wait_tasks_to_complete())
        cut_off = asyncio.ensure_future(self._cut_off.wait())
        try:
            await asyncio.wait({waiting, cut_off}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            cut_off.cancel()
        if not waiting.done():
            waiting.cancel()
            raise TimeoutError
        waiting.result()


def run_server(
    config: EngineConfig,
    options: ServerOptions,
    engine_class: type[AsyncLLMEngine] = AsyncLLMEngine,
    extend_app: Callable[[FastAPI, AsyncLLMEngine], None] | None = None,
) -> int:
    """Serve until SIGTERM/SIGINT; returns the exit code.

    `engine_class` and `extend_app` (more routes) let a test entry point serve an instrumented engine.
    """
    names = served_names(config, options)
    engine = engine_class(config, names[0], stall_timeout=options.stall_timeout)
    tracing = None
    if options.otlp_traces_endpoint is not None:  # the SDK is imported only then
        from engine.http.tracing import otlp_tracing

        logger.info("exporting traces to %s as %s", options.otlp_traces_endpoint, options.otel_service_name)
        tracing = otlp_tracing(options.otlp_traces_endpoint, options.otel_service_name)
    limits = options.limits
    app = create_app(engine, names, options.api_key, tracing, limits)
    if extend_app is not None:
        extend_app(app, engine)
    uv_config = uvicorn.Config(
        app,
        host=options.host,
        port=options.port,
        log_level=options.log_level,
        access_log=options.access_log,
        http=limited_h11_protocol(limits.header_read_timeout, limits.connection_limit, limits.send_timeout),
        h11_max_incomplete_event_size=limits.max_header_bytes,
        timeout_keep_alive=limits.timeout_keep_alive,
        timeout_graceful_shutdown=limits.timeout_graceful_shutdown,
    )
    server = DrainingServer(uv_config, engine, options.shutdown_timeout)
    server.run()
    if server.engine_died:
        return 3
    return 0 if server.started else 1
