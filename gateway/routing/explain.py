"""Why a request would go where it goes: the complexity score and its features, the capability
filter, and the chain, as lines of text (`gateway route explain` offline, the console's Routing
page against the live policy and what its engines report)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from gateway.config.policy import EngineBackend, Policy
from gateway.governance.keys import KeyInfo
from gateway.routing.capabilities import CAPABILITIES, CapabilityError, CapabilityTable, Needs
from gateway.routing.router import NoRouteError, Router


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


async def explain(
    router: Router, name: str, body: dict[str, Any], body_bytes: int, team: str | None
) -> list[str]:
    """The explanation of `body` (`body_bytes` long as sent) sent to `name`, a model or route the
    router's policy exposes."""
    policy, table = router.policy, router.capabilities
    body = {**body, "model": name}
    needs = table.needs(name, body, body_bytes)
    if needs.to_count:
        needs = await table.counted(needs, body)
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
        decision = router.decide(name, body, anonymous_key(team), needs)
    except NoRouteError as exc:
        return [*lines, f"no route: {exc}"]
    except CapabilityError as exc:
        return [*lines, f"refused {exc.status} {exc.code} (param {exc.param}): {exc.message}"]
    first = decision.chain[0]
    backend = policy.models[first].backend
    where = "self-hosted" if self_hosted(policy, first) else "hosted"
    lines += [
        f"route   {decision.header()}",
        f"reason  {decision.reason}",
        f"chain   {' -> '.join(decision.chain)}",
        f"first   {first} on backend {backend} ({where})",
    ]
    if decision.skipped:
        lines.append(f"skipped {', '.join(f'{a.model} ({a.outcome})' for a in decision.skipped)}")
    return lines


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


def self_hosted(policy: Policy, model: str) -> bool:
    """Whether `model` is served by one of our engine pools."""
    return isinstance(policy.backends[policy.models[model].backend], EngineBackend)


def anonymous_key(team: str | None = None) -> KeyInfo:
    """A key with no restrictions (and an optional team), for routing without a caller."""
    now = datetime.now(UTC)
    return KeyInfo("offline", "offline", "sk-offl", team, None, {}, now, None, None, None)
