"""The routing policy: YAML -> a validated, frozen Policy. Schema and examples: docs/policy.md.

Clients ask for a name in `models` (one backend each) or in `routes` (aliases: a candidate list,
or complexity tiers of candidates, plus fallbacks, retries and timeouts). Candidates and fallbacks
name entries of `models`. `overrides` change the route for a team or a key; `health` holds the
active-check and circuit-breaker thresholds (an engine backend may override them).
"""

from __future__ import annotations

import hashlib
import os
import re
import stat
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    FiniteFloat,
    StrictBool,
    StrictInt,
    ValidationError,
    model_validator,
)

from gateway.config.endpoints import BaseUrl, KeyEnv, ReplicaUrl
from gateway.config.strict_yaml import strict_load

# Ample: 20,000 teams take 1.5 MB. Parsing is pure-Python YAML (~6 s a MB, off the event loop on
# a reload), so the cap also bounds how long a runaway file keeps a core busy.
MAX_POLICY_BYTES = 8 << 20
MIN_HEALTH_INTERVAL = 0.05  # seconds: 20 checks a second per replica is more than any breaker needs


class PolicyError(ValueError):
    """The policy file is missing, not YAML, or breaks the schema; the message names the path."""


class _Strict(BaseModel):
    # every number finite: an .inf timeout or cooldown would wait forever (a replica's breaker never
    # half-opening again), a .nan one compares false with everything
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class Timeouts(_Strict):
    """Seconds. `first_token` bounds the wait for a stream's first event (failover happens before it);
    `between_tokens` the silence of a resumable stream after it (then it goes on on another replica)."""

    connect: float = Field(default=2.0, gt=0)
    first_token: float = Field(default=60.0, gt=0)
    total: float = Field(default=600.0, gt=0)
    between_tokens: float = Field(default=30.0, gt=0)


class Price(_Strict):
    """USD per million tokens."""

    input_per_mtok: float = Field(ge=0)
    output_per_mtok: float = Field(ge=0)
    cached_input_per_mtok: float | None = Field(default=None, ge=0)


class GpuCost(_Strict):
    """A self-hosted price derived from what the GPU costs and what it serves (docs/policy.md)."""

    hourly_usd: float = Field(gt=0)
    input_tokens_per_second: float = Field(gt=0)  # prefill throughput of one replica at load
    output_tokens_per_second: float = Field(gt=0)  # decode throughput of one replica at load


class BudgetSpec(_Strict):
    """USD per period; `daily` and `weekly` (from Monday) and `monthly` reset at 00:00 UTC."""

    usd: float = Field(gt=0)
    period: Literal["daily", "weekly", "monthly", "total"] = "monthly"


class Team(_Strict):
    """Limits shared by every key of one team."""

    rpm: int | None = Field(default=None, ge=1)  # requests per minute
    tpm: int | None = Field(default=None, ge=1)  # tokens per minute (prompt + completion)
    budget: BudgetSpec | None = None


class Costs(_Strict):
    """What the savings in the reports are measured against."""

    reference_model: str | None = None  # a litellm model name, e.g. "gpt-4o": what a frontier would charge


class Breaker(_Strict):
    """Per-replica circuit breaker: closed -> open -> half-open probe after `cooldown` -> closed."""

    consecutive_failures: int = Field(default=3, ge=1)  # open after this many failures in a row
    error_rate: float = Field(default=0.5, gt=0, le=1)  # ... or this share of failures
    window: float = Field(default=10.0, gt=0)  # ... over this many seconds
    min_requests: int = Field(default=10, ge=1)  # ... once the window holds at least this many
    cooldown: float = Field(default=5.0, gt=0)  # seconds open before one probe is let through


class HealthSettings(_Strict):
    """Active checks of engine replicas and the thresholds that mark one unhealthy."""

    # seconds between checks of each replica: at least 0.05 (1e-9 kept ~40% of a core busy per
    # replica, in the gateway and the upstream) and finite (.inf stopped checking for good)
    interval: float = Field(default=1.0, ge=MIN_HEALTH_INTERVAL, allow_inf_nan=False)
    timeout: float = Field(default=1.0, gt=0)
    first_token_slo: float | None = Field(default=None, gt=0)  # slower first token: a failure
    max_queue_depth: int | None = Field(default=None, ge=0)  # more waiting requests: avoided
    max_kv_usage: float | None = Field(default=None, gt=0, le=1)  # fuller KV cache: avoided
    breaker: Breaker = Breaker()


class HealthSettingsOverride(_Strict):
    """Per-backend changes to the policy's `health` section (unset fields keep its values)."""

    interval: float | None = Field(default=None, ge=MIN_HEALTH_INTERVAL, allow_inf_nan=False)
    timeout: float | None = Field(default=None, gt=0)
    first_token_slo: float | None = Field(default=None, gt=0)
    max_queue_depth: int | None = Field(default=None, ge=0)
    max_kv_usage: float | None = Field(default=None, gt=0, le=1)
    breaker: Breaker | None = None


class Autoscale(_Strict):
    """Targets per engine replica from which the gateway derives the replicas a pool wants (a gauge
    for the Kubernetes HPA or KEDA): the queue depth and KV usage one replica should run at."""

    target_queue_depth: float = Field(default=4.0, gt=0)  # waiting requests per replica
    target_kv_usage: float = Field(default=0.8, gt=0, le=1)  # KV-cache fraction per replica
    min_replicas: int = Field(default=1, ge=1)
    max_replicas: int = Field(default=64, ge=1)

    @model_validator(mode="after")
    def _bounds(self) -> Autoscale:
        if self.min_replicas > self.max_replicas:
            raise ValueError("min_replicas must not exceed max_replicas")
        return self


class EngineBackend(_Strict):
    """A pool of Switchboard engine servers (OpenAI-compatible), called directly over HTTP."""

    type: Literal["engine"]
    urls: list[ReplicaUrl] = Field(min_length=1)
    api_key_env: KeyEnv | None = None  # env var holding the engines' --api-key, if they have one
    timeouts: Timeouts = Timeouts()
    health: HealthSettingsOverride = HealthSettingsOverride()
    price: Price | None = None  # what a self-hosted token costs us (for the cost reports) ...
    gpu: GpuCost | None = None  # ... or derived from the GPU's hourly price and throughput
    tokenizer: str | None = None  # tokenizer.json (or its folder): counts tokens when usage is missing
    # least_loaded: fewest requests in flight; prefix_affinity: requests sharing leading messages go
    # to one replica (its prefix cache), unless it holds more than max_load_factor x the mean load
    # and more than load_slack requests above the mean (a few more in flight do not load a batching
    # engine; a spill does: it computes the prefix again elsewhere)
    balance: Literal["least_loaded", "prefix_affinity"] = "least_loaded"
    max_load_factor: float = Field(default=1.25, ge=1.0, le=10.0)
    load_slack: int = Field(default=4, ge=0, le=4096)
    autoscale: Autoscale = Autoscale()  # the targets behind gateway_pool_desired_replicas
    # a stream whose replica fails mid-answer goes on on another replica of this pool, from the
    # tokens already streamed (a route may turn it off); at most max_resumptions times per request
    resume_streams: bool = True
    max_resumptions: int = Field(default=2, ge=0, le=8)

    @model_validator(mode="after")
    def _one_price_and_distinct_urls(self) -> EngineBackend:
        if self.price is not None and self.gpu is not None:
            raise ValueError("give price or gpu, not both")
        if len(set(self.urls)) != len(self.urls):
            raise ValueError("urls: each replica must be listed once")
        return self


class HostedBackend(_Strict):
    """A hosted model called through litellm (OpenAI, Anthropic, Azure, Gemini, OpenAI-compatible)."""

    type: Literal["hosted"]
    model: str = Field(min_length=1)  # litellm's name, e.g. "openai/gpt-4o-mini", "anthropic/claude-..."
    api_key_env: KeyEnv | None = None  # env var holding the provider key; unset there: model unavailable
    base_url: BaseUrl | None = None  # for Azure or any OpenAI-compatible server
    api_version: str | None = None  # Azure
    timeouts: Timeouts = Timeouts()
    price: Price | None = None  # overrides litellm's price map


Backend = Annotated[EngineBackend | HostedBackend, Field(discriminator="type")]


class Capabilities(_Strict):
    """What a model can do, as ops declare it; unset: what the backend reports, else assumed present.

    Declared values beat learned ones (an engine's /v1/models, litellm's model map): ops know when
    a model does a feature badly even where its server accepts the field."""

    tools: StrictBool | None = None  # `tools`, `functions`, a `tool_choice` other than none
    json_schema: StrictBool | None = None  # response_format {"type": "json_schema"}
    json_object: StrictBool | None = None  # response_format {"type": "json_object"}
    vision: StrictBool | None = None  # image parts in messages (image_url, input_image)
    logprobs: StrictBool | None = None  # `logprobs`, `top_logprobs`


class ModelRoute(_Strict):
    """A model name clients may ask for, served by one backend."""

    backend: str
    model: str | None = None  # the upstream's name for it (default: the exposed name)
    fallbacks: list[str] = []  # other models to try when this one cannot answer
    capabilities: Capabilities = Capabilities()
    context_length: StrictInt | None = Field(default=None, ge=1)  # prompt tokens it takes at most


class Retries(_Strict):
    """Retries of one candidate before moving on: backoff * 2**n, capped, +- jitter (a fraction)."""

    count: int = Field(default=0, ge=0, le=10)  # 0: on to the next model once every replica failed
    backoff: float = Field(default=0.05, ge=0)
    max_backoff: float = Field(default=2.0, ge=0)
    jitter: float = Field(default=0.5, ge=0, le=1)


class Tier(_Strict):
    """Requests whose complexity score is >= `threshold` (and below the next tier's) go here."""

    name: str = Field(min_length=1)
    threshold: float
    candidates: list[str] = Field(min_length=1)  # model names, tried in order

    @model_validator(mode="after")
    def _threshold_in_range(self) -> Tier:
        if not 0 <= self.threshold <= 1:
            raise ValueError("threshold: must be between 0 and 1")
        return self


class Route(_Strict):
    """An alias: a fixed candidate list, or complexity tiers; then fallbacks."""

    candidates: list[str] = []
    tiers: list[Tier] = []
    fallbacks: list[str] = []
    retries: Retries = Retries()
    timeouts: Timeouts | None = None  # default: each backend's own
    resume_streams: bool | None = None  # off: no stream of this route is resumed (None: the pool decides)
    # override learned feature weights by name (names: checked by the Router, which knows the features);
    # finite: a NaN weight made every score 1.0, sending every request to the top tier
    complexity_weights: dict[str, FiniteFloat] = {}

    @model_validator(mode="after")
    def _candidates_or_tiers(self) -> Route:
        if bool(self.candidates) == bool(self.tiers):
            raise ValueError("give either candidates or tiers (exactly one of them)")
        for i, tier in enumerate(self.tiers):
            if i == 0 and tier.threshold != 0:
                raise ValueError("tiers[0].threshold: the first tier must start at 0")
            if i > 0 and tier.threshold <= self.tiers[i - 1].threshold:
                raise ValueError(f"tiers[{i}].threshold: must be above tiers[{i - 1}].threshold")
        names = [t.name for t in self.tiers]
        if len(set(names)) != len(names):
            raise ValueError("tiers: tier names must be unique")
        return self


class Override(_Strict):
    """For one team or one key (its id): a forced tier, forced candidates, or where data may go."""

    team: str | None = None
    key: str | None = None
    tier: str | None = None  # on tiered routes: always this tier
    candidates: list[str] | None = None  # on every route: these candidates instead
    data_residency: Literal["any", "self_hosted_only"] = "any"

    @model_validator(mode="after")
    def _one_subject(self) -> Override:
        if (self.team is None) == (self.key is None):
            raise ValueError("give exactly one of team or key")
        if self.tier is None and self.candidates is None and self.data_residency == "any":
            raise ValueError("an override must set tier, candidates or data_residency")
        return self


class Policy(_Strict):
    """Backends, the models and aliases exposed to clients, overrides, health, logging options."""

    backends: dict[str, Backend] = Field(min_length=1)
    models: dict[str, ModelRoute] = Field(min_length=1)
    routes: dict[str, Route] = {}
    overrides: list[Override] = []
    health: HealthSettings = HealthSettings()
    costs: Costs = Costs()
    teams: dict[str, Team] = {}
    log_bodies: bool = False  # keep request and response bodies in the request log and the access log
    # when a stream's status and headers go to the client: with the first event of the first upstream
    # that begins one (its events still wait for the first token, so a switch before it stays
    # invisible in them), or only with the first token (then a 5xx status, not an error event, when
    # every candidate fails before it)
    stream_head: Literal["first_event", "first_token"] = "first_event"

    @model_validator(mode="after")
    def _references_resolve(self) -> Policy:
        known_backends = ", ".join(sorted(self.backends))
        for name, route in self.models.items():
            if route.backend not in self.backends:
                raise ValueError(
                    f"models.{name}.backend: unknown backend {route.backend!r} (known: {known_backends})"
                )
            for i, fallback in enumerate(route.fallbacks):
                self._check_model(f"models.{name}.fallbacks[{i}]", fallback)
        for name, alias in self.routes.items():
            if name in self.models:
                raise ValueError(f"routes.{name}: already a name in models")
            for i, candidate in enumerate(alias.candidates):
                self._check_model(f"routes.{name}.candidates[{i}]", candidate)
            for t, tier in enumerate(alias.tiers):
                for i, candidate in enumerate(tier.candidates):
                    self._check_model(f"routes.{name}.tiers[{t}].candidates[{i}]", candidate)
            for i, fallback in enumerate(alias.fallbacks):
                self._check_model(f"routes.{name}.fallbacks[{i}]", fallback)
        tier_names = {tier.name for alias in self.routes.values() for tier in alias.tiers}
        for i, override in enumerate(self.overrides):
            if override.tier is not None and override.tier not in tier_names:
                known = ", ".join(sorted(tier_names)) or "none"
                raise ValueError(f"overrides[{i}].tier: unknown tier {override.tier!r} (known: {known})")
            for j, candidate in enumerate(override.candidates or []):
                self._check_model(f"overrides[{i}].candidates[{j}]", candidate)
        return self

    def _check_model(self, where: str, name: str) -> None:
        if name not in self.models:
            known = ", ".join(sorted(self.models))
            raise ValueError(f"{where}: unknown model {name!r} (known: {known})")

    def exposed(self) -> list[str]:
        """Every name a client may ask for: models, then routes."""
        return [*self.models, *self.routes]

    def reachable(self, name: str) -> list[str]:
        """Every model a request for `name` (a model or a route) may reach, overrides aside."""
        if name in self.models:
            return [name, *self.models[name].fallbacks]
        route = self.routes[name]
        tiers = [m for tier in route.tiers for m in tier.candidates]
        return list(dict.fromkeys([*route.candidates, *tiers, *route.fallbacks]))

    def upstream_model(self, name: str) -> str:
        """The name the backend knows a model by (a hosted backend's own model by default)."""
        route = self.models[name]
        if route.model:
            return route.model
        backend = self.backends[route.backend]
        return backend.model if isinstance(backend, HostedBackend) else name

    def health_for(self, backend: str) -> HealthSettings:
        """The policy's health settings with the backend's overrides applied."""
        spec = self.backends[backend]
        if not isinstance(spec, EngineBackend):
            return self.health
        # the fields themselves, not model_dump(): a `breaker` must stay a Breaker, not become a dict
        changes = {
            k: v for k in HealthSettingsOverride.model_fields if (v := getattr(spec.health, k)) is not None
        }
        return self.health.model_copy(update=changes)


def parse_policy(text: str, source: str = "<policy>") -> Policy:
    """Validate YAML text; errors read like `routes.auto.tiers[1].threshold: must be between 0 and 1`."""
    try:
        raw = strict_load(text)  # a key given twice is an error, not the last one kept
    except (yaml.YAMLError, ValueError) as exc:  # (ValueError: an int of more than 4,300 digits)
        raise PolicyError(f"{source}: not valid YAML: {exc}") from exc
    except RecursionError as exc:  # the parser recurses per level: 10 KB of `[[[...` is enough
        raise PolicyError(f"{source}: not valid YAML: nested too deeply") from exc
    if not isinstance(raw, dict):
        raise PolicyError(f"{source}: the policy must be a mapping")
    try:
        return Policy.model_validate(raw)
    except ValidationError as exc:
        raise PolicyError(
            f"{source}: " + "; ".join(_describe(e) for e in exc.errors(include_url=False))
        ) from exc


def load_policy(path: Path) -> Policy:
    """Read and validate a policy file (a pipe too, for a command that reads it once: `gateway policy
    check <(envsubst < p.yaml)`; the server reads a regular file only)."""
    return parse_policy(read_policy_text(path, pipes=True), str(path))


def read_policy_text(path: Path, pipes: bool = False) -> str:
    """The file's UTF-8 text, or a PolicyError saying why it cannot be read (missing, not a regular
    file, too big, bytes). Opened without blocking and refused unless a regular file: a FIFO put at
    the path blocked the open for good (the watcher's thread, holding the reload lock: no later edit
    was applied, and shutdown waited on it forever). `pipes`: a pipe or FIFO is read too, waiting
    for its writer (a command that reads the file once)."""
    try:
        fd = os.open(path, os.O_RDONLY if pipes else os.O_RDONLY | os.O_NONBLOCK)
    except OSError as exc:
        raise PolicyError(f"cannot read policy {path}: {exc.strerror}") from exc
    try:
        with os.fdopen(fd, "rb") as file:
            mode = os.fstat(file.fileno()).st_mode
            if not (stat.S_ISREG(mode) or (pipes and stat.S_ISFIFO(mode))):
                raise PolicyError(f"cannot read policy {path}: not a regular file")
            data = file.read(MAX_POLICY_BYTES + 1)  # no more: a runaway file never fills memory
    except OSError as exc:
        raise PolicyError(f"cannot read policy {path}: {exc.strerror}") from exc
    if len(data) > MAX_POLICY_BYTES:
        raise PolicyError(f"cannot read policy {path}: larger than the limit, {MAX_POLICY_BYTES:,} bytes")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise PolicyError(f"cannot read policy {path}: not UTF-8 (byte {exc.start})") from exc
    return text.replace("\r\n", "\n").replace("\r", "\n")  # as read_text() did: versions stay the same


def policy_version(text: str) -> str:
    """A short content hash that identifies one version of a policy file."""
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def _describe(err: Any) -> str:
    """`routes.auto.tiers[1].threshold: must be ...` from one pydantic error."""
    parts: list[str] = []
    loc = list(err["loc"])
    if len(loc) >= 3 and loc[0] == "backends" and loc[2] in ("engine", "hosted"):
        del loc[2]  # the union's tag: `backends.local.urls`, not `backends.local.engine.urls`
    for part in loc:
        if isinstance(part, int):
            parts[-1:] = [f"{parts[-1]}[{part}]"] if parts else [f"[{part}]"]
        else:
            parts.append(str(part))
    where = ".".join(parts)
    msg = str(err["msg"]).removeprefix("Value error, ")
    if err["type"] == "extra_forbidden":
        msg = "unknown key"
        if len(loc) >= 2 and loc[-2] == "capabilities":
            msg = f"unknown capability (known: {', '.join(Capabilities.model_fields)})"
    elif err["type"] == "bool_type":
        msg = "must be true or false"
    if where and _SUBPATH.match(msg):
        return f"{where}.{msg}"  # a validator naming a sub-path: `routes.auto` + `tiers[1].threshold: ...`
    return f"{where}: {msg}" if where else msg


_SUBPATH = re.compile(r"^[A-Za-z_]\w*(\[\d+\])?(\.[A-Za-z_]\w*(\[\d+\])?)*: ")
