"""Capability-aware routing: what a request needs, where a model's capabilities come from, and how
the router skips the candidates that cannot serve a request before the tiers choose."""

from __future__ import annotations

import asyncio
import math
from datetime import UTC, datetime
from typing import Any

import pytest

from gateway.backends.base import Learned
from gateway.config.policy import Capabilities, parse_policy
from gateway.governance.keys import KeyInfo
from gateway.routing.capabilities import NO_NEEDS, CapabilityError, CapabilityTable, needed
from gateway.routing.complexity import ComplexityModel
from gateway.routing.router import Router

POLICY = """
backends:
  pool: {type: engine, urls: ["http://127.0.0.1:8001"]}
  big: {type: engine, urls: ["http://127.0.0.1:8002"]}
  openai: {type: hosted, model: openai/gpt-4o-mini}
models:
  small: {backend: pool, capabilities: {tools: false, vision: false}, context_length: 64}
  mid: {backend: big, capabilities: {tools: true}}
  gpt: {backend: openai}
routes:
  auto:
    tiers:
      - {name: simple, threshold: 0, candidates: [small]}
      - {name: complex, threshold: 0.5, candidates: [gpt]}
    fallbacks: [small]
  local:
    candidates: [small]
    fallbacks: [mid]
overrides:
  - {team: legal, tier: simple}
"""
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
CHAT = [{"role": "user", "content": "hello"}]
IMAGE = [{"role": "user", "content": [{"type": "text", "text": "what is it"},
                                      {"type": "image_url", "image_url": {"url": "data:,"}}]}]  # fmt: skip


class FakeLearner:
    """A backend that reports what it is told, bumping its version like a pool whose cards changed."""

    def __init__(self, cards: dict[str, Learned] | None = None) -> None:
        self.cards = cards or {}
        self.learned_version = 0
        self.asked = 0

    def learned(self, model: str) -> Learned | None:
        self.asked += 1
        return self.cards.get(model)

    def report(self, model: str, learned: Learned) -> None:
        self.cards[model] = learned
        self.learned_version += 1


def _model(score: float) -> ComplexityModel:
    return ComplexityModel(("log_tokens",), (0.0,), (1.0,), math.log(score / (1 - score)))


def _key(team: str | None = None) -> KeyInfo:
    return KeyInfo("k1", "n", "sk-x", team, None, {}, datetime.now(UTC), None, None, None)


def _route(name: str, body: dict[str, Any], score: float = 0.1, team: str | None = None,
           table: CapabilityTable | None = None) -> Any:  # fmt: skip
    policy = parse_policy(POLICY)
    table = table or CapabilityTable(policy)
    router = Router(policy, _model(score), table)
    needs = table.needs(name, body, len(str(body)))
    if needs.to_count:
        needs = asyncio.run(table.counted(needs, body))
    return router.decide(name, {"model": name, **body}, _key(team), needs)


@pytest.mark.parametrize(("body", "needs"), [
    ({"messages": CHAT}, ()),
    ({"messages": CHAT, "tools": TOOLS}, (("tools", "tools"),)),
    ({"messages": CHAT, "tools": []}, ()),  # an empty list asks for nothing
    ({"messages": CHAT, "functions": [{"name": "f"}]}, (("tools", "functions"),)),
    ({"messages": CHAT, "tool_choice": "required"}, (("tools", "tool_choice"),)),
    ({"messages": CHAT, "tool_choice": "none"}, ()),
    ({"messages": CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     (("json_schema", "response_format"),)),
    ({"messages": CHAT, "response_format": {"type": "json_object"}}, (("json_object", "response_format"),)),
    ({"messages": CHAT, "response_format": {"type": "text"}}, ()),
    ({"messages": IMAGE}, (("vision", "messages"),)),
    ({"messages": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     (("vision", "messages"),)),
    ({"messages": [{"role": "user", "content": [{"type": {}, "text": "hi"}, {"type": []}]}]}, ()),
    ({"messages": CHAT, "response_format": {"type": {}}}, ()),
    ({"messages": CHAT, "logprobs": True}, (("logprobs", "logprobs"),)),
    ({"messages": CHAT, "logprobs": False}, ()),
    ({"messages": CHAT, "top_logprobs": 2}, (("logprobs", "top_logprobs"),)),
    ({"prompt": "x", "logprobs": 0}, (("logprobs", "logprobs"),)),  # text completions: a number
    ({"messages": IMAGE, "tools": TOOLS, "logprobs": True},
     (("tools", "tools"), ("vision", "messages"), ("logprobs", "logprobs"))),
])  # fmt: skip
def test_a_request_needs_what_its_fields_ask_for(body: dict[str, Any], needs: tuple[Any, ...]) -> None:
    assert needed(body) == needs


def test_a_plain_request_needs_nothing_and_routes_as_before() -> None:
    policy = parse_policy(POLICY)
    assert CapabilityTable(policy).needs("auto", {"messages": CHAT}, 60) is NO_NEEDS
    decision = _route("auto", {"messages": CHAT})
    assert decision.chain == ("small",) and decision.skipped == ()
    assert decision.reason == "complexity 0.100 -> tier simple"


def test_a_tools_request_to_auto_never_reaches_a_model_declared_without_tools() -> None:
    decision = _route("auto", {"messages": CHAT, "tools": TOOLS}, score=0.1)
    assert decision.chain == ("gpt",) and decision.tier == "complex"  # the simple tier was passed over
    assert decision.reason == "complexity 0.100 -> tier simple -> tier complex (needs tools)"
    assert [(a.model, a.outcome, a.called) for a in decision.skipped] == [("small", "lacks tools", False)]
    assert [a.public() for a in decision.skipped] == ["small=lacks_tools"]


def test_a_forced_tier_is_kept_and_only_its_capable_models_are_tried() -> None:
    with pytest.raises(CapabilityError):  # legal's forced tier has only `small`, and so has the fallback
        _route("auto", {"messages": CHAT, "tools": TOOLS}, team="legal")
    decision = _route("local", {"messages": CHAT, "tools": TOOLS})
    assert decision.chain == ("mid",) and [a.model for a in decision.skipped] == ["small"]
    assert decision.skipped_at == (0,)  # where it sat: before the chain's first model


def test_with_no_capable_model_the_answer_is_a_400_naming_the_capability_and_field() -> None:
    with pytest.raises(CapabilityError) as info:
        _route("small", {"messages": CHAT, "tool_choice": "auto"})
    exc = info.value
    assert (exc.status, exc.code, exc.param, exc.type) == (
        400, "model_capability_missing", "tool_choice", "invalid_request_error",
    )  # fmt: skip
    assert exc.message == (
        "no model for 'small' can serve this request, which needs tools (for `tool_choice`): "
        "small: lacks tools"
    )
    assert [a.public() for a in exc.attempts] == ["small=lacks_tools"]
    with pytest.raises(CapabilityError) as info:
        _route("small", {"messages": IMAGE})
    assert info.value.param == "messages" and "needs vision (for `messages`)" in info.value.message


def test_when_no_tier_can_serve_every_tiers_models_are_named_with_what_each_lacks() -> None:
    policy = parse_policy(
        POLICY.replace("gpt: {backend: openai}", "gpt: {backend: openai, capabilities: {vision: false}}")
    )
    router = Router(policy, _model(0.9))
    table = router.capabilities
    body = {"messages": IMAGE, "tools": TOOLS}
    with pytest.raises(CapabilityError) as info:
        router.decide("auto", body, _key(), table.needs("auto", body, 100))
    assert info.value.param == "tools" and [a.public() for a in info.value.attempts] == [
        "small=lacks_tools", "gpt=lacks_vision",
    ]  # fmt: skip
    assert (
        "needs tools (for `tools`) and vision (for `messages`): small: lacks tools, vision; gpt: lacks vision"
        in (info.value.message)
    )


def test_a_prompt_longer_than_a_context_skips_that_model_counted_with_its_tokenizer() -> None:
    long = {"messages": [{"role": "user", "content": "word " * 200}]}  # ~200 tokens > small's 64
    decision = _route("local", long)
    assert decision.chain == ("mid",)
    (skip,) = decision.skipped
    assert skip.model == "small" and skip.reason == "context_exceeded"
    assert skip.outcome.startswith("prompt too long (") and skip.outcome.endswith(" tokens > 64)")
    with pytest.raises(CapabilityError) as info:
        _route("small", long)
    assert (info.value.code, info.value.param) == ("context_length_exceeded", "messages")
    # a body that may be long but whose prompt is short: counted, and it fits
    padded = {"messages": CHAT, "metadata_padding": "x" * 500}
    assert _route("local", padded).chain == ("small", "mid")


def test_declared_beats_learned_and_learned_fills_what_is_not_declared() -> None:
    policy = parse_policy(POLICY)
    pool = FakeLearner({"small": Learned(Capabilities(tools=True, json_schema=True), 4096)})
    table = CapabilityTable(policy, {"pool": pool})
    small = table.of("small")
    assert small.supports["tools"] is False and small.sources["tools"] == "declared"
    assert small.supports["json_schema"] is True and small.sources["json_schema"] == "learned"
    assert small.supports["logprobs"] is None and small.sources["logprobs"] == "unknown"
    assert small.context_length == 64 and small.sources["context_length"] == "declared"


def test_learned_capabilities_apply_once_the_backend_reports_them_without_asking_per_request() -> None:
    policy = parse_policy(POLICY)
    big = FakeLearner()
    table = CapabilityTable(policy, {"big": big})
    body = {"messages": CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}
    assert _route("local", body, table=table).chain == ("small", "mid")  # unknown: assumed present
    asked = big.asked
    for _ in range(5):
        _route("local", body, table=table)
    assert big.asked == asked  # resolved once, not per request
    big.report("mid", Learned(Capabilities(json_schema=False), 100_000))
    decision = _route("local", body, table=table)
    assert decision.chain == ("small",) and decision.skipped[0].outcome == "lacks json_schema"
    assert table.of("mid").context_length == 100_000 and big.asked == asked + 1
