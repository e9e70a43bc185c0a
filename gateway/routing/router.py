"""Policy + request + key -> the ordered list of models to try, and why.

A direct model name is its own first candidate, then those of its fallbacks the key may call. An
alias (`routes`) has fixed candidates or complexity tiers (the request's score picks the tier), then
fallbacks. Overrides for the key or its team may force a tier or the candidates; `self_hosted_only`
drops every hosted model from the chain, so such a request never leaves our engines. A model that
lacks a capability the request needs, or whose context its prompt exceeds, is skipped before any
call (capabilities.py); tiers none of whose candidates can serve it are passed over before the
score picks one, and when nothing is left the answer is a 400 that names what is missing.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from gateway.backends.base import Attempt
from gateway.config.policy import EngineBackend, Override, Policy, Retries, Route, Tier, Timeouts
from gateway.errors import GatewayError
from gateway.governance.keys import AuthError, KeyInfo
from gateway.routing.capabilities import NO_NEEDS, CapabilityTable, Check, Needs
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
    resume_streams: bool | None = None  # the route's word on stream resumption (None: each pool's)
    complexity: ComplexityResult | None = field(default=None, compare=False)
    skipped: tuple[Attempt, ...] = ()  # models of the chain that cannot serve the request, never called
    # where each skipped model sat: before chain[i] (len(chain): after the last); none given: first
    skipped_at: tuple[int, ...] = ()

    def header(self) -> str:
        """`x-gateway-route`: alias, tier, score."""
        parts = [self.alias]
        if self.tier is not None:
            parts.append(f"tier={self.tier}")
        if self.score is not None:
            parts.append(f"score={self.score:.3f}")
        return "; ".join(parts)


def _scorers(policy: Policy, base: ComplexityModel) -> dict[str, ComplexityScorer]:
    """A scorer for each tiered route; every route's weight overrides are checked, tiers or not.

    Raises ValueError naming the route when a weight names no feature (docs/policy.md: an unknown
    name makes the policy invalid, even where no tier would use it)."""
    scorers: dict[str, ComplexityScorer] = {}
    for name, route in policy.routes.items():
        try:
            model = base.with_overrides(route.complexity_weights)
        except ValueError as exc:
            raise ValueError(f"routes.{name}.complexity_weights: {exc}") from exc
        if route.tiers:
            scorers[name] = ComplexityScorer(model)
    return scorers


class Router:
    """Decides routes for one policy version (a new policy gets a new Router)."""

    def __init__(
        self,
        policy: Policy,
        model: ComplexityModel | None = None,
        capabilities: CapabilityTable | None = None,
    ) -> None:
        self.policy = policy
        self.capabilities = capabilities or CapabilityTable(policy)  # declared only, unless given learners
        self._scorers = _scorers(policy, model or ComplexityModel.load())
        self._by_key = {o.key: o for o in policy.overrides if o.key is not None}
        self._by_team = {o.team: o for o in policy.overrides if o.team is not None}

    def override_for(self, key: KeyInfo) -> Override | None:
        """The key's own override, else its team's."""
        return self._by_key.get(key.id) or (self._by_team.get(key.team) if key.team else None)

    def decide(
        self, name: str, body: Mapping[str, Any], key: KeyInfo, needs: Needs = NO_NEEDS
    ) -> RouteDecision:
        """The route for a request to `name` (a model or an alias the policy knows) that needs `needs`.

        Raises CapabilityError (400) when no model of the chain can serve what the request needs."""
        override = self.override_for(key)
        check = self.capabilities.checker(needs)
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
            decision = self._alias(name, self.policy.routes[name], body, override, check)
        if residency:
            kept = tuple(m for m in decision.chain if self._self_hosted(m))
            if not kept:
                raise NoRouteError(
                    f"no self-hosted model can serve '{name}' for this key (data residency: self_hosted_only)"
                )
            decision = replace(decision, chain=kept, self_hosted_only=True,
                                reason=decision.reason + "; self-hosted only")  # fmt: skip
        if check is not None:
            decision = self._capable(decision, check, needs)
        return decision

    def _capable(self, decision: RouteDecision, check: Check, needs: Needs) -> RouteDecision:
        """The chain without the models that cannot serve the request; those are noted as skipped."""
        kept: list[str] = []
        skipped: list[Attempt] = []
        at: list[int] = []
        for model in decision.chain:
            why = check(model)
            if why is None:
                kept.append(model)
            else:
                skipped.append(Attempt(model, self.policy.models[model].backend, None, why, called=False))
                at.append(len(kept))
        if not kept:
            raise self.capabilities.refusal(decision.alias, needs, skipped)
        reason = decision.reason + (f" (needs {needs.label()})" if needs.capabilities else "")
        return replace(
            decision, chain=tuple(kept), skipped=tuple(skipped), skipped_at=tuple(at), reason=reason
        )

    def explain(self, name: str, body: Mapping[str, Any]) -> ComplexityResult | None:
        """The complexity result a tiered alias would use (None for other names)."""
        scorer = self._scorers.get(name)
        return scorer.score(body) if scorer is not None else None

    def _alias(
        self, name: str, route: Route, body: Mapping[str, Any], override: Override | None, check: Check | None
    ) -> RouteDecision:
        tier_name: str | None = None
        score: float | None = None
        result: ComplexityResult | None = None
        passed_over: list[str] = []  # a tier that cannot serve the request: its candidates, to note skipped
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
                tier = _by_score(route.tiers, score)
                reason = f"complexity {score:.3f} -> tier {tier.name}"
                serving = [t for t in route.tiers if _serves(t, check)]
                if tier not in serving and serving:  # capabilities filter before the tiers choose
                    passed_over = list(tier.candidates)
                    tier = _by_score(serving, score)
                    reason += f" -> tier {tier.name}"
                elif not serving:  # no tier can: every tier's models are noted with what they lack
                    passed_over = [m for t in route.tiers for m in t.candidates]
            tier_name, candidates = tier.name, list(tier.candidates)
        else:
            candidates, reason = list(route.candidates), "alias"
        chain = tuple(dict.fromkeys([*passed_over, *candidates, *route.fallbacks]))  # in order, once each
        return RouteDecision(
            name, chain, reason, tier_name, score, retries=route.retries, timeouts=route.timeouts,
            resume_streams=route.resume_streams, complexity=result,
        )  # fmt: skip

    def _self_hosted(self, model: str) -> bool:
        return isinstance(self.policy.backends[self.policy.models[model].backend], EngineBackend)


def _by_score(tiers: list[Tier], score: float) -> Tier:
    """The last tier whose threshold is at or below `score` (the first when none is)."""
    chosen = tiers[0]
    for tier in tiers:
        if score >= tier.threshold:
            chosen = tier
    return chosen


def _serves(tier: Tier, check: Check | None) -> bool:
    """Whether some candidate of the tier can serve the request."""
    return check is None or any(check(model) is None for model in tier.candidates)


def _subject(override: Override | None) -> str:
    assert override is not None
    return f"team {override.team}" if override.team is not None else f"key {override.key}"
