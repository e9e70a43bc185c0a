"""The engine's life cycle as /health reports it, and the errors a request meets when it cannot run."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from engine.errors import EngineError


class EngineUnavailableError(EngineError, RuntimeError):
    """The engine cannot take requests now (loading, draining, stalled or dead); `code` says which."""

    status = 503
    type = "service_unavailable"

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message, code=code)


class EngineDeadError(EngineError, RuntimeError):
    """The step loop failed; requests in flight cannot finish."""

    status = 503
    type = "service_unavailable"
    code = "engine_dead"
    fixed_message = "The engine failed and is restarting; retry shortly"


class RequestFailedError(EngineError, RuntimeError):
    """A step that ran this request raised; the request is dropped, the engine goes on."""

    status = 500
    type = "server_error"
    code = "engine_error"
    fixed_message = "The engine failed while running this request; retry it"


class EngineState(enum.Enum):
    """Life cycle of the engine as /health reports it."""

    LOADING = "loading"
    READY = "ready"
    DRAINING = "draining"
    STOPPED = "stopped"
    DEAD = "dead"


@dataclass(frozen=True)
class Health:
    """What /health answers."""

    state: str  # loading | ready | draining | stalled | stopped | dead
    healthy: bool
    detail: str
    seconds_since_progress: float


def describe(health: Health) -> dict[str, Any]:
    """Health as a JSON body."""
    return {
        "status": health.state,
        "healthy": health.healthy,
        "detail": health.detail,
        "seconds_since_progress": round(health.seconds_since_progress, 3),
    }
