"""`policy check`, `route eval` and `route explain`: the routing policy offline, for ops and CI.

`route explain` shows the capability filter as the gateway applies it, with what it can know
offline: declared values, and litellm's map for hosted models (imported, a few seconds, only for a
request that needs a capability or has a body over LOOKUP_BYTES). Engines report theirs to a
running gateway only: offline they show as unknown, and unknown is assumed present.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from gateway.config.policy import HostedBackend, Policy, PolicyError, load_policy
from gateway.routing.capabilities import (
    CapabilityTable,
    Learner,
    needed,
)
from gateway.routing.complexity import ComplexityModel
from gateway.routing.explain import anonymous_key, explain, self_hosted, tiered_route
from gateway.routing.router import Router

LOOKUP_BYTES = 2048  # a smaller body fits every context a chat model has: no need to ask litellm


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


def route_eval(policy_path: Path, data: Path, route: str | None) -> dict[str, float]:
    """Route every labelled row of a JSONL file; accuracy etc. for `complex` (any tier above the first)."""
    policy = load_policy(policy_path)
    name = tiered_route(policy, route)
    router = Router(policy, ComplexityModel.load())
    first_tier = policy.routes[name].tiers[0].name
    tp = fp = tn = fn = frontier = 0
    for number, line in enumerate(data.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        # a row of another shape, or a label of another spelling, counted as "simple" made the figures wrong
        if not isinstance(row, dict) or row.get("label") not in ("simple", "complex"):
            raise ValueError(f"{data}:{number}: each row must be an object whose label is simple or complex")
        request = {"model": name, "messages": row.get("messages") or []}
        decision = router.decide(name, request, anonymous_key())
        predicted = decision.tier != first_tier
        actual = row.get("label") == "complex"
        tp, fp = tp + (predicted and actual), fp + (predicted and not actual)
        tn, fn = tn + (not predicted and not actual), fn + (not predicted and actual)
        frontier += not self_hosted(policy, decision.chain[0])
    n = tp + fp + tn + fn
    return {
        "n": n,
        "accuracy": (tp + tn) / n if n else 0.0,
        "precision": tp / (tp + fp) if tp + fp else 0.0,
        "recall": tp / (tp + fn) if tp + fn else 0.0,
        "frontier_share": frontier / n if n else 0.0,
    }


def route_explain(policy_path: Path, body: Mapping[str, Any], route: str | None, team: str | None) -> str:
    """Features, their contributions, the score, the tier, the capability filter and the chain, as text."""
    policy = load_policy(policy_path)
    name = str(body.get("model") or tiered_route(policy, route))
    if name not in policy.exposed():
        raise ValueError(f"'{name}' is neither a model nor a route in {policy_path}")
    body = {**body, "model": name}
    size = len(json.dumps(body).encode())
    learners = _hosted_learners(policy) if needed(body) or size > LOOKUP_BYTES else {}
    router = Router(policy, ComplexityModel.load(), CapabilityTable(policy, learners))
    return "\n".join(asyncio.run(explain(router, name, body, size, team)))


def _hosted_learners(policy: Policy) -> dict[str, Learner]:
    """litellm's word on the policy's hosted models (importing litellm takes seconds: only when asked)."""
    hosted = {name: spec for name, spec in policy.backends.items() if isinstance(spec, HostedBackend)}
    if not hosted:
        return {}
    from gateway.backends.hosted import HostedModel

    return {name: HostedModel(name, spec) for name, spec in hosted.items()}
