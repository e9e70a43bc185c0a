"""Prices and request costs: litellm's map, policy overrides, GPU-derived prices, exact decimals."""

from __future__ import annotations

from decimal import Decimal

import pytest

from gateway.config.policy import parse_policy
from gateway.governance.costs import PriceBook, TokenPrice, cost_map, map_price

POLICY = """
backends:
  pool: {type: engine, urls: ["http://127.0.0.1:8001"], price: {input_per_mtok: 0.02, output_per_mtok: 0.06}}
  gpu: {type: engine, urls: ["http://127.0.0.1:8002"],
        gpu: {hourly_usd: 3.6, input_tokens_per_second: 10000, output_tokens_per_second: 1000}}
  free: {type: engine, urls: ["http://127.0.0.1:8003"]}
  mini: {type: hosted, model: openai/gpt-4o-mini}
  custom: {type: hosted, model: openai/gpt-4o-mini, price: {input_per_mtok: 1, output_per_mtok: 2,
           cached_input_per_mtok: 0.5}}
  unknown: {type: hosted, model: openai/not-a-real-model}
models:
  a: {backend: pool}
costs: {reference_model: gpt-4o}
"""


@pytest.mark.parametrize("model", ["gpt-4o-mini", "gpt-4o", "azure/gpt-4o", "openai/gpt-4o-mini"])
def test_hosted_prices_come_from_litellms_map_exactly(model: str) -> None:
    entry = cost_map()[model.removeprefix("openai/")]
    price = map_price(model)
    assert price is not None
    assert price.input == Decimal(str(entry["input_cost_per_token"]))
    assert price.output == Decimal(str(entry["output_cost_per_token"]))
    assert price.cached_input == Decimal(str(entry["cache_read_input_token_cost"]))
    want = (
        (1000 - 200) * Decimal(str(entry["input_cost_per_token"]))
        + 200 * Decimal(str(entry["cache_read_input_token_cost"]))
        + 300 * Decimal(str(entry["output_cost_per_token"]))
    )
    assert price.cost(1000, 300, 200) == want


def test_gpt_4o_mini_costs_what_its_price_sheet_says() -> None:
    price = map_price("gpt-4o-mini")  # $0.15 / $0.60 per million, cached input $0.075
    assert price is not None
    assert price.cost(1_000_000, 1_000_000, 0) == Decimal("0.75")
    assert price.cost(1_000_000, 0, 1_000_000) == Decimal("0.075")


def test_policy_prices_override_and_gpu_prices_follow_the_documented_formula() -> None:
    book = PriceBook(parse_policy(POLICY))
    assert book.price("pool") == TokenPrice(Decimal("2E-8"), Decimal("6E-8"), Decimal("2E-8"))
    custom = book.price("custom")
    assert custom is not None and custom.cached_input == Decimal("5E-7")
    gpu = book.price("gpu")  # $3.6/h = $0.001/s; 10,000 input tok/s; 1,000 output tok/s
    assert gpu is not None and gpu.input == Decimal("1E-7") and gpu.output == Decimal("0.000001")
    assert book.price("free") is None and book.price("unknown") is None


def test_self_hosted_requests_also_get_the_reference_models_cost() -> None:
    book = PriceBook(parse_policy(POLICY))
    usage = {"prompt_tokens": 1000, "completion_tokens": 500, "prompt_tokens_details": {"cached_tokens": 400}}
    cost, reference = book.costs("pool", usage)
    assert cost == 600 * Decimal("2E-8") + 400 * Decimal("2E-8") + 500 * Decimal("6E-8")
    four_o = map_price("gpt-4o")
    assert four_o is not None and reference == four_o.cost(1000, 500, 400)
    assert book.costs("mini", usage)[1] is None  # hosted: its own cost is the real one
    assert book.costs("pool", {}) == (None, None)
    assert book.costs("free", usage) == (None, reference)


def test_cached_tokens_never_exceed_the_prompt() -> None:
    price = TokenPrice(Decimal("1E-6"), Decimal("2E-6"), Decimal("5E-7"))
    assert price.cost(10, 0, 50) == 10 * Decimal("5E-7")
    assert price.cost(10, 0, -3) == 10 * Decimal("1E-6")


def test_a_reservation_covers_a_prompt_whose_cached_tokens_are_priced_above_fresh_ones() -> None:
    policy = POLICY.replace("cached_input_per_mtok: 0.5", "cached_input_per_mtok: 5")
    book = PriceBook(
        parse_policy(policy.replace("  a: {backend: pool}", "  a: {backend: pool}\n  c: {backend: custom}"))
    )
    custom = book.price("custom")
    assert custom is not None
    worst = book.worst_case(("c",), {"max_tokens": 10}, 400)
    assert worst >= custom.cost(400, 10, cached_tokens=400) == (400 * 5 + 10 * 2) * Decimal(1) / 10**6
