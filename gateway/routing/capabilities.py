"""Capabilities: what a request needs, what each model can do, and which candidates may serve it.

A request's needs are read once from its parsed body (dict lookups, no I/O): `tools`, `functions`
or a `tool_choice` other than none need tools; `response_format` json_schema or json_object needs
that; an image part in a message needs vision; `logprobs` or `top_logprobs` need logprobs.

A model's capabilities are resolved ahead of requests, each from the first source that says:
the policy (`capabilities`, `context_length`: declared), else its backend (learned: an engine's
/v1/models cards, litellm's bundled map for a hosted model), else nobody, and then the capability
is assumed present (the upstream answers for itself). They are resolved again only when a
backend's `learned_version` moves, never with I/O on a request's way.

A prompt is held against a context only when it might not fit: a body's size in bytes bounds its
prompt's tokens (a token is at least one byte of text, and a message's JSON outweighs its chat
template), so the model's tokenizer counts it, in a worker thread, only for a body bigger than
the context of some model the request may reach. Its text is counted without the template's few
tokens per message: a model is skipped only when the prompt surely does not fit.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from gateway.backends.base import LACKS, TOO_LONG, Attempt, Learned
from gateway.config.policy import Capabilities, EngineBackend, Policy
from gateway.errors import GatewayError
from gateway.governance import tokens

CAPABILITIES: tuple[str, ...] = tuple(Capabilities.model_fields)  # tools, json_schema, json_object, ...
_IMAGE_PARTS = frozenset({"image_url", "input_image"})
# the fields that may need a capability (images aside: they are parts of messages)
_ASKING = frozenset({"tools", "functions", "tool_choice", "function_call", "response_format", "logprobs",
                     "top_logprobs"})  # fmt: skip

Check = Callable[[str], str | None]  # model -> why it cannot serve this request (None: it can)


class Learner(Protocol):
    """A backend that says what its models can do (EnginePool, HostedModel)."""

    @property
    def learned_version(self) -> int:
        """Changes when `learned` may answer differently."""
        ...

    def learned(self, model: str) -> Learned | None:
        """What the backend says about `model` (its upstream name)."""
        ...


class CapabilityError(GatewayError):
    """No model the request may reach can serve it: 400 `model_capability_missing` (param: the field
    that needs the capability) or `context_length_exceeded`; `attempts` are the skipped models."""

    def __init__(self, message: str, param: str, code: str, attempts: list[Attempt]) -> None:
        super().__init__(400, message, "invalid_request_error", param, code)
        self.attempts = attempts


@dataclass(frozen=True)
class Needs:
    """What one request needs of the model that serves it."""

    capabilities: tuple[tuple[str, str], ...] = ()  # (capability, the request field that needs it)
    prompt_field: str = "messages"  # where the prompt is: `messages`, or `prompt` for text completions
    to_count: tuple[str, ...] = ()  # models whose context the body's size may exceed
    prompt_tokens: Mapping[str, int] = field(default_factory=dict)  # those models' count of the prompt

    def label(self) -> str:
        """`tools, vision` (for the route reason)."""
        return ", ".join(capability for capability, _ in self.capabilities)


NO_NEEDS = Needs()


@dataclass(frozen=True)
class Resolved:
    """One model's capabilities and context, with where each value came from."""

    supports: Mapping[str, bool | None]  # None: nobody said (assumed present)
    context_length: int | None
    sources: Mapping[str, str]  # capability or "context_length" -> declared, learned or unknown


def needed(body: Mapping[str, Any]) -> tuple[tuple[str, str], ...]:
    """(capability, field) for each capability `body` needs, in CAPABILITIES order."""
    if _ASKING.isdisjoint(body.keys()):  # the common case: one set test, then the messages' parts
        return (("vision", "messages"),) if _has_image(body.get("messages")) else ()
    found: list[tuple[str, str]] = []
    tools = _tools_field(body)
    if tools is not None:
        found.append(("tools", tools))
    response_format = body.get("response_format")
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind in ("json_schema", "json_object"):
        found.append((kind, "response_format"))
    if _has_image(body.get("messages")):
        found.append(("vision", "messages"))
    logprobs = body.get("logprobs")
    if logprobs is True or type(logprobs) is int:  # chat: true; text completions: a number, 0 too
        found.append(("logprobs", "logprobs"))
    elif body.get("top_logprobs") is not None:
        found.append(("logprobs", "top_logprobs"))
    return tuple(found)


def _tools_field(body: Mapping[str, Any]) -> str | None:
    if body.get("tools"):
        return "tools"
    if body.get("functions"):
        return "functions"
    for name in ("tool_choice", "function_call"):
        choice = body.get(name)
        if choice is not None and choice != "none":
            return name
    return None


def _has_image(messages: Any) -> bool:
    if not isinstance(messages, list):
        return False
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            for part in content:
                kind = part.get("type") if isinstance(part, dict) else None
                if isinstance(kind, str) and kind in _IMAGE_PARTS:  # (a client's dict is unhashable)
                    return True
    return False


class CapabilityTable:
    """Every model's resolved capabilities for one policy version, kept in step with its backends."""

    def __init__(self, policy: Policy, learners: Mapping[str, Learner] | None = None) -> None:
        self.policy = policy
        self._learners = {name: lr for name, lr in (learners or {}).items() if name in policy.backends}
        # polled per request: only engines learn while the gateway runs (a hosted model's map is fixed)
        self._polled = tuple(
            (name, lr)
            for name, lr in self._learners.items()
            if isinstance(policy.backends[name], EngineBackend)
        )
        self._models_of: dict[str, list[str]] = {name: [] for name in policy.backends}
        for model, route in policy.models.items():
            self._models_of[route.backend].append(model)
        forced = [m for override in policy.overrides for m in override.candidates or []]
        self._reach = {
            name: tuple(dict.fromkeys([*policy.reachable(name), *forced])) for name in policy.exposed()
        }
        self._seen: dict[str, int] = {}
        self._resolved: dict[str, Resolved] = {}
        for backend in policy.backends:
            self._resolve(backend)
        self._floor = self._smallest_context()

    def reachable(self, name: str) -> tuple[str, ...]:
        """Every model a request for `name` may reach (its chains, and any override's candidates)."""
        return self._reach[name]

    def of(self, model: str) -> Resolved:
        """The model's capabilities as they stand now."""
        self._sync()
        return self._resolved[model]

    def context_length(self, model: str) -> int | None:
        """The model's context in tokens, as declared or learned (None: unknown)."""
        return self.of(model).context_length

    def needs(self, name: str, body: Mapping[str, Any], body_bytes: int) -> Needs:
        """What a request for `name` needs (NO_NEEDS, the common case, when nothing is to check)."""
        capabilities = needed(body)
        self._sync()
        to_count: tuple[str, ...] = ()
        if self._floor is not None and body_bytes > self._floor:
            to_count = tuple(
                m for m in self._reach.get(name, ())
                if (context := self._resolved[m].context_length) is not None and body_bytes > context
            )  # fmt: skip
        if not capabilities and not to_count:
            return NO_NEEDS
        return Needs(capabilities, "messages" if "messages" in body else "prompt", to_count)

    async def counted(self, needs: Needs, body: dict[str, Any]) -> Needs:
        """`needs` with the prompt counted for each model in `to_count` (in a worker thread)."""
        if not needs.to_count:
            return needs
        jobs: dict[str, tuple[str, str | None, int]] = {}  # counted by -> (model name, tokenizer, limit)
        by: dict[str, str] = {}
        for model in needs.to_count:
            upstream = self.policy.upstream_model(model)
            spec = self.policy.backends[self.policy.models[model].backend]
            tokenizer = spec.tokenizer if isinstance(spec, EngineBackend) else None
            by[model] = key = tokens.counted_by(upstream, tokenizer)
            limit = self._resolved[model].context_length or 0
            if key not in jobs or jobs[key][2] < limit:
                jobs[key] = (upstream, tokenizer, limit)
        counts = await asyncio.to_thread(_count_prompt, body, jobs)
        return replace(needs, prompt_tokens={model: counts[by[model]] for model in needs.to_count})

    def checker(self, needs: Needs) -> Check | None:
        """Why each model cannot serve a request with `needs` (None: nothing to check)."""
        if not needs.capabilities and not needs.prompt_tokens:
            return None
        self._sync()
        resolved, found = self._resolved, dict[str, str | None]()

        def check(model: str) -> str | None:
            if model not in found:
                found[model] = _why_not(resolved[model], needs, model)
            return found[model]

        return check

    def refusal(self, alias: str, needs: Needs, skipped: list[Attempt]) -> CapabilityError:
        """The 400 for a request that every model it may reach was skipped for."""
        why = "; ".join(f"{a.model}: {a.outcome}" for a in skipped)
        lacked = {
            c for a in skipped if a.outcome.startswith(LACKS) for c in a.outcome[len(LACKS) :].split(", ")
        }
        missing = [(capability, param) for capability, param in needs.capabilities if capability in lacked]
        if missing:
            wanted = " and ".join(f"{capability} (for `{param}`)" for capability, param in missing)
            message = f"no model for '{alias}' can serve this request, which needs {wanted}: {why}"
            return CapabilityError(message, missing[0][1], "model_capability_missing", skipped)
        message = f"the prompt is longer than the context of every model for '{alias}': {why}"
        return CapabilityError(message, needs.prompt_field, "context_length_exceeded", skipped)

    def _sync(self) -> None:
        """Resolve again the models of any backend that learned something new since last time."""
        changed = False
        for backend, learner in self._polled:
            if learner.learned_version != self._seen.get(backend):
                self._resolve(backend)
                changed = True
        if changed:
            self._floor = self._smallest_context()

    def _resolve(self, backend: str) -> None:
        learner = self._learners.get(backend)
        if learner is not None:
            self._seen[backend] = learner.learned_version
        for model in self._models_of[backend]:
            learned = learner.learned(self.policy.upstream_model(model)) if learner is not None else None
            self._resolved[model] = _resolve(self.policy, model, learned)

    def _smallest_context(self) -> int | None:
        known = [r.context_length for r in self._resolved.values() if r.context_length is not None]
        return min(known) if known else None


def _resolve(policy: Policy, model: str, learned: Learned | None) -> Resolved:
    """Declared beats learned; neither: unknown."""
    route = policy.models[model]
    supports: dict[str, bool | None] = {}
    sources: dict[str, str] = {}
    for capability in CAPABILITIES:
        declared = getattr(route.capabilities, capability)
        said = getattr(learned.capabilities, capability) if learned is not None else None
        supports[capability], sources[capability] = _first(declared, said)
    said_context = learned.context_length if learned is not None else None
    context, sources["context_length"] = _first(route.context_length, said_context)
    return Resolved(supports, context, sources)


def _first(declared: Any, learned: Any) -> tuple[Any, str]:
    if declared is not None:
        return declared, "declared"
    if learned is not None:
        return learned, "learned"
    return None, "unknown"


def _why_not(resolved: Resolved, needs: Needs, model: str) -> str | None:
    lacking = [c for c, _ in needs.capabilities if resolved.supports[c] is False]
    if lacking:
        return LACKS + ", ".join(dict.fromkeys(lacking))
    counted = needs.prompt_tokens.get(model)
    context = resolved.context_length
    if counted is not None and context is not None and counted > context:
        return f"{TOO_LONG} ({counted} tokens > {context})"
    return None


def _count_prompt(body: dict[str, Any], jobs: Mapping[str, tuple[str, str | None, int]]) -> dict[str, int]:
    """The prompt's tokens by each tokenizer, each counted only as far as its largest context needs."""
    text = tokens.prompt_text(body)
    return {
        key: tokens.count_until(text, model, tokenizer, limit)
        for key, (model, tokenizer, limit) in jobs.items()
    }
