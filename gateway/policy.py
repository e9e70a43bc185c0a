"""The routing policy: YAML -> a validated, frozen Policy (the routing issue extends the schema)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator


class PolicyError(ValueError):
    """The policy file is missing, not YAML, or breaks the schema; the message names the path."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Timeouts(_Strict):
    """Seconds."""

    connect: float = Field(default=2.0, gt=0)
    total: float = Field(default=600.0, gt=0)


class EngineBackend(_Strict):
    """A pool of Switchboard engine servers (OpenAI-compatible), called directly over HTTP."""

    type: Literal["engine"]
    urls: list[str] = Field(min_length=1)
    api_key_env: str | None = None  # env var holding the engines' --api-key, if they have one
    timeouts: Timeouts = Timeouts()

    @model_validator(mode="after")
    def _urls_are_http(self) -> EngineBackend:
        for i, url in enumerate(self.urls):
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"urls[{i}]: must start with http:// or https://, got {url!r}")
        return self


class HostedBackend(_Strict):
    """A hosted model called through litellm (OpenAI, Anthropic, Azure, Gemini, OpenAI-compatible)."""

    type: Literal["hosted"]
    model: str = Field(min_length=1)  # litellm's name, e.g. "openai/gpt-4o-mini", "anthropic/claude-..."
    api_key_env: str | None = None  # env var holding the provider key; unset there: model unavailable
    base_url: str | None = None  # for Azure or any OpenAI-compatible server
    api_version: str | None = None  # Azure
    timeouts: Timeouts = Timeouts()


Backend = Annotated[EngineBackend | HostedBackend, Field(discriminator="type")]


class ModelRoute(_Strict):
    """A model name clients may ask for, and where it is served."""

    backend: str
    model: str | None = None  # the upstream's name for it (default: the exposed name)


class Policy(_Strict):
    """Backends, the models exposed to clients, and logging options."""

    backends: dict[str, Backend] = Field(min_length=1)
    models: dict[str, ModelRoute] = Field(min_length=1)
    log_bodies: bool = False  # store prompt and completion bodies in the request log

    @model_validator(mode="after")
    def _routes_name_backends(self) -> Policy:
        for name, route in self.models.items():
            if route.backend not in self.backends:
                known = ", ".join(sorted(self.backends))
                raise ValueError(f"models.{name}.backend: unknown backend {route.backend!r} (known: {known})")
        return self

    def upstream_model(self, name: str) -> str:
        """The name the backend knows the model by (a hosted backend's own model by default)."""
        route = self.models[name]
        if route.model:
            return route.model
        backend = self.backends[route.backend]
        return backend.model if isinstance(backend, HostedBackend) else name


def parse_policy(text: str, source: str = "<policy>") -> Policy:
    """Validate YAML text; errors read like `models.auto.backend: unknown backend 'x'`."""
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise PolicyError(f"{source}: not valid YAML: {exc}") from exc
    if not isinstance(raw, dict):
        raise PolicyError(f"{source}: the policy must be a mapping")
    try:
        return Policy.model_validate(raw)
    except ValidationError as exc:
        raise PolicyError(
            f"{source}: " + "; ".join(_describe(e) for e in exc.errors(include_url=False))
        ) from exc


def load_policy(path: Path) -> Policy:
    """Read and validate a policy file."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise PolicyError(f"cannot read policy {path}: {exc.strerror}") from exc
    return parse_policy(text, str(path))


def _describe(err: object) -> str:
    assert isinstance(err, dict)
    parts = [str(p) for p in err["loc"]]
    if len(parts) >= 3 and parts[0] == "backends" and parts[2] in ("engine", "hosted"):
        del parts[2]  # the union's tag: `backends.local.urls`, not `backends.local.engine.urls`
    loc = ".".join(parts)
    msg = str(err["msg"]).removeprefix("Value error, ")
    if err["type"] == "extra_forbidden":
        msg = "unknown key"
    return f"{loc}: {msg}" if loc else msg
