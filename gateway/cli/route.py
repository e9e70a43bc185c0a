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
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from gateway.config.policy import EngineBackend, HostedBackend, Policy, PolicyError, load_policy
from gateway.governance.keys import KeyInfo
from gateway.routing.capabilities import (
    CAPABILITIES,
    CapabilityError,
    CapabilityTable,
    Learner,
    Needs,
    needed,
)
from gateway.routing.complexity import ComplexityModel
from gateway.routing.router import NoRouteError, Router

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
    """Features, their contributions, the score, the tier, the capability filter and the chain, as text."""
    policy = load_policy(policy_path)
    name = str(body.get("model") or tiered_route(policy, route))
    if name not in policy.exposed():
        raise ValueError(f"'{name}' is neither a model nor a route in {policy_path}")
    body = {**body, "model": name}
    size = len(json.dumps(body).encode())
    learners = _hosted_learners(policy) if needed(body) or size > LOOKUP_BYTES else {}
    table = CapabilityTable(policy, learners)
    needs = table.needs(name, body, size)
    if needs.to_count:
        needs = asyncio.run(table.counted(needs, body))
    router = Router(policy, ComplexityModel.load(), table)
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
    lines += _capability_lines(table, name, needs)
    try:
        decision = router.decide(name, body, _anonymous(team), needs)
    except NoRouteError as exc:
        return "\n".join([*lines, f"no route: {exc}"])
    except CapabilityError as exc:
        return "\n".join([*lines, f"refused {exc.status} {exc.code} (param {exc.param}): {exc.message}"])
    first = decision.chain[0]
    backend = policy.models[first].backend
    where = "self-hosted" if _self_hosted(policy, first) else "hosted"
    lines += [
        f"route   {decision.header()}",
        f"reason  {decision.reason}",
        f"chain   {' -> '.join(decision.chain)}",
        f"first   {first} on backend {backend} ({where})",
    ]
    if decision.skipped:
        lines.append(f"skipped {', '.join(f'{a.model} ({a.outcome})' for a in decision.skipped)}")
    return "\n".join(lines)


def _capability_lines(table: CapabilityTable, name: str, needs: Needs) -> list[str]:
    """What the request needs, and what each model it may reach can do (where each value comes from)."""
    if not needs.capabilities and not needs.prompt_tokens:
        return ["needs   no capability, and its prompt fits every known context: nothing filtered"]
    wanted = ", ".join(f"{c} (by `{p}`)" for c, p in needs.capabilities) or "no capability"
    lines = [f"needs   {wanted}"]
    if needs.prompt_tokens:
        counts = ", ".join(f"{m} {n}" for m, n in needs.prompt_tokens.items())
        lines.append(f"prompt  tokens by each model's tokenizer, where the context may be short: {counts}")
    lines.append("capabilities (d: declared, l: learned, ?: nobody said: assumed present)")
    header = "".join(f"{c:>13}" for c in (*CAPABILITIES, "context"))
    lines.append(f"  {'model':<24}{header}")
    for model in table.reachable(name):
        resolved = table.of(model)
        cells = [_cell(resolved.supports[c], resolved.sources[c]) for c in CAPABILITIES]
        cells.append(_cell(resolved.context_length, resolved.sources["context_length"]))
        lines.append(f"  {model:<24}" + "".join(f"{cell:>13}" for cell in cells))
    return lines


def _cell(value: bool | int | None, source: str) -> str:
    if value is None:
        return "?"
    shown = ("yes" if value else "no") if isinstance(value, bool) else str(value)
    return f"{shown} {source[0]}"


def _hosted_learners(policy: Policy) -> dict[str, Learner]:
    """litellm's word on the policy's hosted models (importing litellm takes seconds: only when asked)."""
    hosted = {name: spec for name, spec in policy.backends.items() if isinstance(spec, HostedBackend)}
    if not hosted:
        return {}
    from gateway.backends.hosted import HostedModel

    return {name: HostedModel(name, spec) for name, spec in hosted.items()}


def _self_hosted(policy: Policy, model: str) -> bool:
    return isinstance(policy.backends[policy.models[model].backend], EngineBackend)


def _anonymous(team: str | None = None) -> KeyInfo:
    """A key with no restrictions (and an optional team), for offline routing."""
    now = datetime.now(UTC)
    return KeyInfo("offline", "offline", "sk-offl", team, None, {}, now, None, None, None)
