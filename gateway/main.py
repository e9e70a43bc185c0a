"""create_app(settings): the gateway's ASGI app; its lifespan wires the database and services."""

from __future__ import annotations

import gc
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

from fastapi import Depends, FastAPI, Response
from prometheus_client import CollectorRegistry, generate_latest
from sqlalchemy.ext.asyncio import AsyncEngine

from gateway.api import admin_keys, admin_policy, admin_reports, openai_routes
from gateway.api.admin_gate import AdminGate
from gateway.api.asgi import Message, Receive, Scope, Send
from gateway.api.body_limit import BodyLimit
from gateway.api.completions import COMPLETION_PATHS, CompletionsEndpoint
from gateway.api.errors import install_error_handlers
from gateway.api.metrics_auth import require_metrics_reader
from gateway.api.services import Services, app_services, install_services
from gateway.config.policy import parse_policy, policy_version, read_policy_text
from gateway.config.secrets import resolve_secrets
from gateway.config.settings import GatewaySettings
from gateway.console.app import install_console
from gateway.governance.budgets import LocalBudgetStore, RedisBudgetStore
from gateway.governance.keys import AuthLimits, KeyHasher, KeyStore
from gateway.governance.ratelimit import LocalRateLimiter, RedisRateLimiter
from gateway.governance.redis_pool import pool_config
from gateway.governance.spend_seed import spend_seed
from gateway.pipeline.admission import Admission, RedisAdmission
from gateway.pipeline.call import request_id
from gateway.pipeline.proxy import Proxy
from gateway.pipeline.runtime import PolicyWatcher, RuntimeHolder, build_runtime
from gateway.routing.complexity import ComplexityModel
from gateway.store.db import create_db, dispose, session_factory
from gateway.store.log_retention import LogRetention
from gateway.store.migrate import ensure_schema
from gateway.store.request_log import RequestLogWriter
from gateway.telemetry.access_log import AccessLog
from gateway.telemetry.metrics import GatewayMetrics

if TYPE_CHECKING:
    from gateway.telemetry.tracing import GatewayTracing

logger = logging.getLogger(__name__)


class GatewayApp:
    """The ASGI entry point: the completion paths go to the bare endpoint, the rest to FastAPI.

    Before FastAPI: /admin requests need the master key in their headers, then every body is read
    at most `max_admin_body_bytes` (FastAPI would read any size, then parse it, before the route's
    dependencies). The completion endpoint checks the key, then reads at most `max_body_bytes`.
    """

    def __init__(self, api: FastAPI, settings: GatewaySettings) -> None:
        self.api = api
        self.completions = CompletionsEndpoint(
            lambda: app_services(api), settings.max_body_bytes, settings.body_timeout
        )
        limited = BodyLimit(api, settings.max_admin_body_bytes, settings.body_timeout)
        self.guarded = AdminGate(limited, api, settings.max_admin_body_bytes)

    @property
    def services(self) -> Services:
        """The services the lifespan wired (AttributeError before the app started)."""
        return app_services(self.api)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.guarded(scope, receive, send)
        elif scope["path"] in COMPLETION_PATHS:
            await self.completions(scope, receive, send)
        else:
            await self.guarded(scope, receive, _with_request_id(send))


def _with_request_id(send: Send) -> Send:
    """`send` that gives every answer of the other routes an `x-request-id` too, as the completion
    endpoint gives its own (docs/gateway.md: every response carries one)."""

    async def sending(message: Message) -> None:
        if message["type"] == "http.response.start":
            headers = list(message.get("headers", ()))
            if not any(name.lower() == b"x-request-id" for name, _ in headers):
                headers.append((b"x-request-id", request_id().encode()))
                message = {**message, "headers": headers}
        await send(message)

    return sending


def create_app(settings: GatewaySettings, tracing: GatewayTracing | None = None) -> GatewayApp:
    """The app; the database schema is checked (dev mode: upgraded) when it starts.

    `tracing`: where spans go instead of the configured OTLP endpoint (tests pass an in-memory one).
    MissingSecretsError without the master key and key secret (outside dev mode).
    """
    settings.require_secrets()  # here, not in the lifespan: a worker without them never starts

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        url = settings.resolved_database_url
        await ensure_schema(url, auto_upgrade=settings.dev_mode)
        db = create_db(url, serving=True)
        secrets = resolve_secrets(settings)
        keys = KeyStore(
            session_factory(db),
            KeyHasher(secrets.key_secret),
            settings.key_cache_ttl,
            limits=AuthLimits.from_settings(settings),
        )
        text = read_policy_text(settings.policy_path)  # a file the watcher can read again, not a pipe
        policy = parse_policy(text, str(settings.policy_path))
        model = ComplexityModel.load()
        holder = RuntimeHolder(await build_runtime(policy, policy_version(text), model))
        log = RequestLogWriter.from_settings(db, registry, settings)
        log.start()
        retention = LogRetention(db, settings.log_retention_days) if settings.log_retention_days else None
        if retention is not None:
            retention.start()
        admission = _admission(settings, db, log)
        watcher = PolicyWatcher(settings.policy_path, holder, model, registry, budgets=admission.budgets)
        watcher.start()
        tracer = tracing or _tracing(settings)
        metrics = GatewayMetrics(registry, lambda: holder.runtime.pools)
        access = AccessLog()
        proxy = Proxy(holder, log, admission, metrics, access, tracer)
        install_services(app, Services(settings, secrets, db, keys, watcher, proxy))
        gc.freeze()  # what start-up allocated is never garbage: keep it out of every later collection
        try:
            yield
        finally:
            await watcher.stop()
            if retention is not None:
                await retention.stop()
            await proxy.drain()  # rows still being counted go to the writer before it stops
            await log.stop()
            access.flush()
            await admission.close()
            for pool in holder.runtime.pools.values():
                await pool.close()
            await dispose(db)
            if tracer is not None:
                tracer.shutdown()  # exports the spans still buffered

    # no redirect for a path with a trailing slash: Starlette's was absolute, built from the client's
    # Host header (a poisoned cache could send others elsewhere); /ui has its own relative one
    app = FastAPI(
        title="Switchboard gateway", lifespan=lifespan, docs_url=None, redoc_url=None, redirect_slashes=False
    )
    install_error_handlers(app)
    app.include_router(admin_keys.router)
    app.include_router(admin_policy.router)
    app.include_router(admin_reports.router)
    app.include_router(openai_routes.router)
    install_console(app)
    registry = CollectorRegistry()

    @app.get("/health")
    async def health() -> Response:
        """The gateway process is up."""
        return Response(b'{"status":"ok"}', media_type="application/json")

    @app.get("/metrics", dependencies=[Depends(require_metrics_reader)])
    async def metrics() -> Response:
        """Prometheus text format (metrics token or master key): requests, latency, tokens, cost, ..."""
        return Response(generate_latest(registry), media_type="text/plain; version=0.0.4; charset=utf-8")

    return GatewayApp(app, settings)


def _admission(settings: GatewaySettings, db: AsyncEngine, log: RequestLogWriter) -> Admission:
    """Rate limits and budgets in Redis when one is configured (one script a request), else in memory.
    A counter is seeded from the database once the request log has written what it holds."""
    seed = spend_seed(db, log.write_now)
    if not settings.redis_url:
        return Admission(LocalRateLimiter(), LocalBudgetStore(settings.budget_fail_open), seed)
    pool = pool_config(settings)
    limiter = RedisRateLimiter(settings.redis_url, settings.rate_limit_fail_open, pool=pool)
    # a request's row is in the log within two batch intervals and a second, unless the log is behind
    logged = 2 * settings.log_flush_seconds + 1.0
    budgets = RedisBudgetStore(
        settings.redis_url, settings.budget_fail_open, pool=pool, logged_seconds=logged, log_behind=log.behind
    )
    return RedisAdmission(limiter, budgets, seed)


def _tracing(settings: GatewaySettings) -> GatewayTracing | None:
    """OTLP tracing when an endpoint is configured; otherwise None, and the SDK is never imported."""
    endpoint = settings.traces_endpoint
    if endpoint is None:
        return None
    from gateway.telemetry.tracing import otlp_tracing

    logger.info("exporting traces to %s as %s", endpoint, settings.otel_service_name)
    return otlp_tracing(endpoint, settings.otel_service_name)


def app_from_env() -> GatewayApp:
    """uvicorn factory for worker processes: settings from the environment."""
    return create_app(GatewaySettings())
