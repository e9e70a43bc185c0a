"""Services: what the lifespan wires and the routes use, one typed, frozen object per started app.

create_app's lifespan builds it once and keeps it as the app's only state attribute; routes take
its parts through the `Annotated[..., Depends(...)]` aliases below, the bare completion endpoint
through `app_services`. Nothing here is replaced while the app runs: a policy reload swaps
the runtime inside `PolicyWatcher`'s holder, not a field of this object. The dependencies are
`async def`: FastAPI would run a plain `def` one in a worker thread.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, FastAPI, Request
from sqlalchemy.ext.asyncio import AsyncEngine

from gateway.config.secrets import ServerSecrets
from gateway.config.settings import GatewaySettings
from gateway.governance.keys import KeyStore
from gateway.pipeline.proxy import Proxy
from gateway.pipeline.runtime import PolicyWatcher


@dataclass(frozen=True, slots=True)
class Services:
    """The started app's services (the lifespan closes them when the app stops)."""

    settings: GatewaySettings
    secrets: ServerSecrets
    db: AsyncEngine  # the request log, reports and spend seeds read and write through it
    keys: KeyStore
    policy_watcher: PolicyWatcher
    proxy: Proxy


def install_services(app: FastAPI, services: Services) -> None:
    """Make `services` the app's (the lifespan calls this once it has built them)."""
    app.state.services = services


def app_services(app: FastAPI) -> Services:
    """The app's services; AttributeError before its lifespan started."""
    services: Services = app.state.services
    return services


async def services_of(request: Request) -> Services:
    """Dependency: the services of the app that received `request`."""
    return app_services(request.app)


ServicesDep = Annotated[Services, Depends(services_of)]


async def key_store(services: ServicesDep) -> KeyStore:
    """Dependency: the app's KeyStore."""
    return services.keys


async def proxy(services: ServicesDep) -> Proxy:
    """Dependency: the app's Proxy."""
    return services.proxy


async def database(services: ServicesDep) -> AsyncEngine:
    """Dependency: the app's database (its SQLAlchemy AsyncEngine)."""
    return services.db


async def policy_watcher(services: ServicesDep) -> PolicyWatcher:
    """Dependency: the app's PolicyWatcher."""
    return services.policy_watcher


Keys = Annotated[KeyStore, Depends(key_store)]
ProxyDep = Annotated[Proxy, Depends(proxy)]
Database = Annotated[AsyncEngine, Depends(database)]
Watcher = Annotated[PolicyWatcher, Depends(policy_watcher)]
