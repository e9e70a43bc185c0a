"""Routing decisions: direct names, tiers by complexity, overrides, and data residency."""

from __future__ import annotations

import math
from datetime import UTC, datetime

import pytest

from gateway.config.policy import parse_policy
from gateway.governance.keys import AuthError, KeyInfo
from gateway.routing.complexity import ComplexityModel
from gateway.routing.router import NoRouteError, Router

POLICY = """
backends:
  pool: {type: engine, urls: ["http://127.0.0.1:8001"]}
  openai: {type: hosted, model: openai/gpt-4o-mini}
  anthropic: {type: hosted, model: anthropic/claude}
models:
  small: {backend: pool, fallbacks: [gpt]}
  gpt: {backend: openai, fallbacks: [claude]}
  claude: {backend: anthropic}
routes:
  auto:
    tiers:
      - {name: simple, threshold: 0, candidates: [small]}
      - {name: complex, threshold: 0.5, candidates: [gpt, claude]}
    fallbacks: [claude, small]
  smart: {candidates: [gpt], fallbacks: [claude]}
overrides:
  - {team: legal, tier: complex}
  - {team: eu, data_residency: self_hosted_only}
  - {key: vip, candidates: [claude]}
  - {team: vipteam, tier: simple}
"""


def _model(score: float) -> ComplexityModel:
    """A model that gives every request `score` (all weight in the bias)."""
    return ComplexityModel(("log_tokens",), (0.0,), (1.0,), math.log(score / (1 - score)))


def _key(team: str | None = None, key_id: str = "k1") -> KeyInfo:
    return KeyInfo(key_id, "n", "sk-x", team, None, {}, datetime.now(UTC), None, None, None)


BODY = {"messages": [{"role": "user", "content": "hello"}]}


def test_a_direct_model_is_tried_first_then_its_fallbacks() -> None:
    decision = Router(parse_policy(POLICY), _model(0.9)).decide("small", BODY, _key())
    assert decision.chain == ("small", "gpt") and decision.reason == "direct" and decision.tier is None
    assert decision.header() == "small"


@pytest.mark.parametrize(("score", "tier", "chain"), [
    (0.2, "simple", ("small", "claude")),
    (0.9, "complex", ("gpt", "claude", "small")),
])  # fmt: skip
def test_the_score_picks_the_tier_and_fallbacks_follow_once_each(
    score: float, tier: str, chain: tuple[str, ...]
) -> None:
    decision = Router(parse_policy(POLICY), _model(score)).decide("auto", BODY, _key())
    assert decision.tier == tier and decision.chain == chain
    assert decision.score == pytest.approx(score)
    assert decision.header() == f"auto; tier={tier}; score={score:.3f}"
    assert decision.reason == f"complexity {score:.3f} -> tier {tier}"


def test_a_team_override_forces_the_tier_without_scoring() -> None:
    decision = Router(parse_policy(POLICY), _model(0.1)).decide("auto", BODY, _key("legal"))
    assert decision.tier == "complex" and decision.score is None
    assert decision.reason == "override team legal: tier complex"


def test_a_key_override_wins_over_its_team() -> None:
    decision = Router(parse_policy(POLICY), _model(0.1)).decide("auto", BODY, _key("vipteam", "vip"))
    assert decision.chain == ("claude", "small") and "override key vip" in decision.reason


def test_self_hosted_only_drops_every_hosted_model_even_from_fallbacks() -> None:
    router = Router(parse_policy(POLICY), _model(0.1))
    decision = router.decide("auto", BODY, _key("eu"))
    assert decision.chain == ("small",) and decision.self_hosted_only
    assert router.decide("small", BODY, _key("eu")).chain == ("small",)


def test_self_hosted_only_refuses_hosted_names_and_routes_with_nothing_self_hosted() -> None:
    router = Router(parse_policy(POLICY), _model(0.9))
    with pytest.raises(AuthError) as info:
        router.decide("gpt", BODY, _key("eu"))
    assert info.value.status == 403 and info.value.code == "data_residency"
    with pytest.raises(NoRouteError, match="self_hosted_only"):
        router.decide("smart", BODY, _key("eu"))


def test_complexity_weight_overrides_must_name_real_features() -> None:
    fallbacks = "    fallbacks: [claude, small]\n"
    policy = parse_policy(POLICY.replace(fallbacks, fallbacks + "    complexity_weights: {nope: 1}\n"))
    with pytest.raises(ValueError, match="nope"):
        Router(policy, _model(0.5))


def test_complexity_weight_overrides_must_name_real_features_on_a_route_without_tiers_too() -> None:
    """docs/policy.md: an unknown name makes the policy invalid; a candidates route took any name."""
    smart = "  smart: {candidates: [gpt], fallbacks: [claude]"
    policy = parse_policy(POLICY.replace(smart, smart + ", complexity_weights: {nope: 1}"))
    with pytest.raises(
        ValueError, match=r"routes.smart.complexity_weights: unknown complexity feature\(s\): nope"
    ):
        Router(policy, _model(0.5))
