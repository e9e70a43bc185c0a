"""`policy check`, `route eval` and `route explain`: the routing policy offline, for ops and CI."""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from gateway.config.policy import EngineBackend, Policy, PolicyError, load_policy
from gateway.governance.keys import KeyInfo
from gateway.routing.complexity import ComplexityModel
from gateway.routing.router import NoRouteError, Router


def policy_check(path: Path) -> int:
    """Validate a policy file: 0 and a summary when valid, 1 and the errors when not."""
    try:
        policy = load_policy(path)
        Router(policy, ComplexityModel.load())  # complexity weight overrides name real features
    except (PolicyError, ValueError) as exc:
        print(f"invalid: {exc}")
        return 1
    print(f"valid: {len(policy.backends)} backends, {len(policy.models)} models, "
          f"{len(policy.routes)} routes, {len(policy.overrides)} overrides")  # fmt: skip
    return 0


def tiered_route(policy: Policy, name: str | None) -> str:
    """The route to evaluate: `name`, or the policy's first route with tiers."""
    if name is not None:
        if name not in policy.routes or not policy.routes[name].tiers:
            raise ValueError(f"'{name}' is not a route with complexity tiers in this policy")
        return name
    for route_name, route in policy.routes.items():
        if route.tiers:
            return route_name
    raise ValueError("the policy has no route with complexity tiers")


def route_eval(policy_path: Path, data: Path, route: str | None) -> dict[str, float]:
    """Route every labelled row of a JSONL file; accuracy etc. for `complex` (any tier above the first)."""
    policy = load_policy(policy_path)
    name = tiered_route(policy, route)
    router = Router(policy, ComplexityModel.load())
    first_tier = policy.routes[name].tiers[0].name
    tp = fp = tn = fn = frontier = 0
    for line in data.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        decision = router.decide(name, {"model": name, "messages": row.get("messages") or []}, _anonymous())
        predicted = decision.tier != first_tier
        actual = row.get("label") == "complex"
        tp, fp = tp + (predicted and actual), fp + (predicted and not actual)
        tn, fn = tn + (not predicted and not actual), fn + (not predicted and actual)
        frontier += not _self_hosted(policy, decision.chain[0])
    n = tp + fp + tn + fn
    return {
        "n": n,
        "accuracy": (tp + tn) / n if n else 0.0,
        "precision": tp / (tp + fp) if tp + fp else 0.0,
        "recall": tp / (tp + fn) if tp + fn else 0.0,
        "frontier_share": frontier / n if n else 0.0,
    }


def route_explain(policy_path: Path, body: Mapping[str, Any], route: str | None, team: str | None) -> str:
    """Features, their contributions, the score, the tier and the chain, as text."""
    policy = load_policy(policy_path)
    name = str(body.get("model") or tiered_route(policy, route))
    if name not in policy.exposed():
        raise ValueError(f"'{name}' is neither a model nor a route in {policy_path}")
    router = Router(policy, ComplexityModel.load())
    lines = []
    result = router.explain(name, body)
    if result is not None:
        lines.append(
            f"score {result.score:.3f} (logit {result.logit:+.3f} = bias {result.bias:+.3f} + features)"
        )
        ranked = sorted(result.contributions.items(), key=lambda kv: -abs(kv[1]))
        lines.append(f"{'feature':<32} {'value':>10} {'contribution':>13}")
        for feature, contribution in ranked:
            if contribution:
                lines.append(f"{feature:<32} {result.features[feature]:>10.3f} {contribution:>+13.3f}")
        if silent := sum(1 for c in result.contributions.values() if not c):
            lines.append(f"({silent} features contribute nothing here)")
    try:
        decision = router.decide(name, body, _anonymous(team))
    except NoRouteError as exc:
        return "\n".join([*lines, f"no route: {exc}"])
    first = decision.chain[0]
    backend = policy.models[first].backend
    where = "self-hosted" if _self_hosted(policy, first) else "hosted"
    lines += [
        f"route   {decision.header()}",
        f"reason  {decision.reason}",
        f"chain   {' -> '.join(decision.chain)}",
        f"first   {first} on backend {backend} ({where})",
    ]
    return "\n".join(lines)


def _self_hosted(policy: Policy, model: str) -> bool:
    return isinstance(policy.backends[policy.models[model].backend], EngineBackend)


def _anonymous(team: str | None = None) -> KeyInfo:
    """A key with no restrictions (and an optional team), for offline routing."""
    now = datetime.now(UTC)
    return KeyInfo("offline", "offline", "sk-offl", team, None, {}, now, None, None, None)
