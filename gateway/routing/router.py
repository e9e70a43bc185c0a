"""Policy + request + key -> the ordered list of models to try, and why.

A direct model name is its own first candidate, then those of its fallbacks the key may call. An
alias (`routes`) has fixed candidates or complexity tiers (the request's score picks the tier), then
fallbacks. Overrides for the key or its team may force a tier or the candidates; `self_hosted_only`
drops every hosted model from the chain, so such a request never leaves our engines.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from gateway.config.policy import EngineBackend, Override, Policy, Retries, Route, Timeouts
from gateway.errors import GatewayError
from gateway.governance.keys import AuthError, KeyInfo
from gateway.routing.complexity import ComplexityModel, ComplexityResult, ComplexityScorer

NO_RETRIES = Retries()  # direct models: no retries of the same model (built once, not per request)


class NoRouteError(GatewayError):
    """Nothing in the chain may serve this request (e.g. self-hosted only, but every candidate is
    hosted): 503 `no_route`, naming the model."""

    def __init__(self, message: str) -> None:
        super().__init__(503, message, "api_error", "model", "no_route")


@dataclass(frozen=True)
class RouteDecision:
    """Where one request goes: `chain` is tried in order (candidates, then fallbacks)."""

    alias: str
    chain: tuple[str, ...]
    reason: str
    tier: str | None = None
    score: float | None = None
    self_hosted_only: bool = False
    retries: Retries = NO_RETRIES
    timeouts: Timeouts | None = None
    complexity: ComplexityResult | None = field(default=None, compare=False)

    def header(self) -> str:
        """`x-gateway-route`: alias, tier, score."""
        parts = [self.alias]
        if self.tier is not None:
            parts.append(f"tier={self.tier}")
        if self.score is not None:
            parts.append(f"score={self.score:.3f}")
        return "; ".join(parts)


class Router:
    """Decides routes for one policy version (a new policy gets a new Router)."""

    def __init__(self, policy: Policy, model: ComplexityModel | None = None) -> None:
        self.policy = policy
        base = model or ComplexityModel.load()
        self._scorers = {
            name: ComplexityScorer(base.with_overrides(route.complexity_weights))
            for name, route in policy.routes.items()
            if route.tiers
        }
        self._by_key = {o.key: o for o in policy.overrides if o.key is not None}
        self._by_team = {o.team: o for o in policy.overrides if o.team is not None}

    def override_for(self, key: KeyInfo) -> Override | None:
        """The key's own override, else its team's."""
        return self._by_key.get(key.id) or (self._by_team.get(key.team) if key.team else None)

    def decide(self, name: str, body: Mapping[str, Any], key: KeyInfo) -> RouteDecision:
        """The route for a request to `name` (a model or an alias the policy knows)."""
        override = self.override_for(key)
        residency = override is not None and override.data_residency == "self_hosted_only"
        if name in self.policy.models:
            if residency and not self._self_hosted(name):
                raise AuthError(
                    403, f"'{name}' is a hosted model; this key's data must stay on self-hosted engines",
                    "data_residency",
                )  # fmt: skip
            # a key's allowed_models binds the fallbacks too: a model the key may not call is never
            # reached through another's chain (an alias the key may use grants what its route lists)
            fallbacks = [m for m in self.policy.models[name].fallbacks if key.allows(m)]
            decision = RouteDecision(name, (name, *fallbacks), "direct")
        else:
            decision = self._alias(name, self.policy.routes[name], body, override)
        if residency:
            kept = tuple(m for m in decision.chain if self._self_hosted(m))
            if not kept:
                raise NoRouteError(
                    f"no self-hosted model can serve '{name}' for this key (data residency: self_hosted_only)"
                )
            decision = replace(decision, chain=kept, self_hosted_only=True,
                                reason=decision.reason + "; self-hosted only")  # fmt: skip
        return decision

    def explain(self, name: str, body: Mapping[str, Any]) -> ComplexityResult | None:
        """The complexity result a tiered alias would use (None for other names)."""
        scorer = self._scorers.get(name)
        return scorer.score(body) if scorer is not None else None

    def _alias(
        self, name: str, route: Route, body: Mapping[str, Any], override: Override | None
    ) -> RouteDecision:
        tier_name: str | None = None
        score: float | None = None
        result: ComplexityResult | None = None
        if override is not None and override.candidates is not None:
            candidates, reason = list(override.candidates), f"override {_subject(override)}: candidates"
        elif route.tiers:
            forced = override.tier if override is not None else None
            tier = next((t for t in route.tiers if t.name == forced), None)
            if tier is not None:
                reason = f"override {_subject(override)}: tier {tier.name}"
            else:
                result = self._scorers[name].score(body)
                score = result.score
                tier = route.tiers[0]
                for candidate in route.tiers:
                    if score >= candidate.threshold:
                        tier = candidate
                reason = f"complexity {score:.3f} -> tier {tier.name}"
            tier_name, candidates = tier.name, list(tier.candidates)
        else:
            candidates, reason = list(route.candidates), "alias"
        chain = tuple(dict.fromkeys([*candidates, *route.fallbacks]))  # in order, once each
        return RouteDecision(
            name, chain, reason, tier_name, score, retries=route.retries, timeouts=route.timeouts,
            complexity=result,
        )  # fmt: skip

    def _self_hosted(self, model: str) -> bool:
        return isinstance(self.policy.backends[self.policy.models[model].backend], EngineBackend)


def _subject(override: Override | None) -> str:
    assert override is not None
    return f"team {override.team}" if override.team is not None else f"key {override.key}"
