"""create_app(settings): the gateway's FastAPI app; its lifespan wires the database and services."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Response

from gateway.api import admin_keys
from gateway.auth import KeyHasher, KeyStore
from gateway.db import create_engine, session_factory
from gateway.errors import install_error_handlers
from gateway.migrate import ensure_schema
from gateway.secrets_store import resolve_secrets
from gateway.settings import GatewaySettings


def create_app(settings: GatewaySettings) -> FastAPI:
    """The app; the database schema is checked (dev mode: upgraded) when it starts."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        url = settings.resolved_database_url
        await ensure_schema(url, auto_upgrade=settings.dev_mode)
        engine = create_engine(url)
        secrets = resolve_secrets(settings)
        app.state.settings = settings
        app.state.secrets = secrets
        app.state.keys = KeyStore(
            session_factory(engine), KeyHasher(secrets.key_secret), settings.key_cache_ttl
        )
        try:
            yield
        finally:
            await engine.dispose()

    app = FastAPI(title="Switchboard gateway", lifespan=lifespan, docs_url=None, redoc_url=None)
    install_error_handlers(app)
    app.include_router(admin_keys.router)

    @app.get("/health")
    async def health() -> Response:
        """The gateway process is up."""
        return Response(b'{"status":"ok"}', media_type="application/json")

    return app
