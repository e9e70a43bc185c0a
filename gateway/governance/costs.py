"""Prices per token and the cost of one request, as exact Decimals.

Hosted models are priced from litellm's bundled cost map (read as a file: importing litellm takes
seconds), unless the policy gives a price. Self-hosted pools are priced by the policy: per token,
or derived from the GPU's hourly price and its throughput:

    input USD/token  = hourly_usd / 3600 / input_tokens_per_second
    output USD/token = hourly_usd / 3600 / output_tokens_per_second

Cost of a request = (prompt - cached) * input + cached * cached_input + completion * output, with
cached_input = input when no cached price is known. Prices go through `str` into Decimal, so the
map's 1.5e-07 is exactly 0.00000015.
"""

from __future__ import annotations

import importlib.util
import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from decimal import Decimal
from functools import lru_cache
from pathlib import Path
from typing import Any

from gateway.config.policy import EngineBackend, HostedBackend, Policy, Price
from gateway.governance.usage import choices, max_output

logger = logging.getLogger(__name__)

_MILLION = Decimal(1_000_000)
DEFAULT_OUTPUT_CAP = 4096  # tokens reserved for a request that names no max_tokens on an uncapped model
_HOUR = Decimal(3600)


@dataclass(frozen=True)
class TokenPrice:
    """USD per token."""

    input: Decimal
    output: Decimal
    cached_input: Decimal

    def cost(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> Decimal:
        """Exact cost of one request's usage."""
        cached = min(max(cached_tokens, 0), prompt_tokens)
        return (
            (prompt_tokens - cached) * self.input
            + cached * self.cached_input
            + completion_tokens * self.output
        )


def _dec(value: Any) -> Decimal:
    return Decimal(str(value))


def from_policy_price(price: Price) -> TokenPrice:
    """A policy price (USD per million tokens) per token."""
    cached = price.cached_input_per_mtok if price.cached_input_per_mtok is not None else price.input_per_mtok
    return TokenPrice(
        _dec(price.input_per_mtok) / _MILLION, _dec(price.output_per_mtok) / _MILLION, _dec(cached) / _MILLION
    )


def litellm_file(*parts: str) -> Path | None:
    """A data file inside litellm's installed package, found without importing litellm."""
    spec = importlib.util.find_spec("litellm")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))).joinpath(*parts)


@lru_cache(maxsize=1)
def cost_map() -> dict[str, Any]:
    """litellm's bundled model price map, read from its package without importing litellm."""
    path = litellm_file("model_prices_and_context_window_backup.json")
    if path is None:
        return {}
    try:
        data: dict[str, Any] = json.loads(path.read_text())
    except (OSError, ValueError):
        logger.warning("litellm's cost map is unreadable at %s: hosted models are unpriced", path)
        return {}
    return data


def _map_entry(model: str) -> dict[str, Any]:
    """The map's entry for `openai/gpt-4o-mini` or `gpt-4o-mini` ({} when unknown)."""
    table = cost_map()
    entry = table.get(model) or table.get(model.split("/", 1)[-1])
    return entry if isinstance(entry, dict) else {}


def map_price(model: str) -> TokenPrice | None:
    """litellm's price for a model name (`openai/gpt-4o-mini` or `gpt-4o-mini`), or None."""
    entry = _map_entry(model)
    if not entry or entry.get("input_cost_per_token") is None:
        return None
    input_ = _dec(entry["input_cost_per_token"])
    output = _dec(entry.get("output_cost_per_token") or 0)
    cached = entry.get("cache_read_input_token_cost")
    return TokenPrice(input_, output, _dec(cached) if cached is not None else input_)


def max_output_tokens(model: str) -> int | None:
    """The model's output cap from litellm's map, if it has one."""
    cap = _map_entry(model).get("max_output_tokens")
    return int(cap) if isinstance(cap, int | float) and cap > 0 else None


class PriceBook:
    """The price of every backend of one policy version, and of its reference model."""

    def __init__(self, policy: Policy) -> None:
        self.self_hosted = frozenset(n for n, b in policy.backends.items() if isinstance(b, EngineBackend))
        self._backend_of = {name: route.backend for name, route in policy.models.items()}
        self._caps = {
            name: max_output_tokens(spec.model)
            for name, route in policy.models.items()
            if isinstance(spec := policy.backends[route.backend], HostedBackend)
        }
        self._prices: dict[str, TokenPrice | None] = {}
        for name, spec in policy.backends.items():
            self._prices[name] = _backend_price(spec)
            if self._prices[name] is None:
                logger.warning("backend %r has no price: its requests are logged without cost", name)
        reference = policy.costs.reference_model
        self.reference = map_price(reference) if reference else None
        if reference and self.reference is None:
            logger.warning("reference model %r is not in litellm's price map: no savings figures", reference)

    def price(self, backend: str) -> TokenPrice | None:
        """USD per token on `backend` (None: unpriced)."""
        return self._prices.get(backend)

    def output_cap(self, chain: Sequence[str], context: Callable[[str], int | None] | None = None,
                   default: int | None = DEFAULT_OUTPUT_CAP) -> int | None:  # fmt: skip
        """The output tokens one answer may take on `chain` when the request names no max_tokens:
        the largest output cap on the chain, a hosted model's from litellm's map, a self-hosted
        one's its context (`context(model)`: an engine answers up to the rest of it), else
        `default`. A reservation takes DEFAULT_OUTPUT_CAP for a chain whose caps are unknown; what
        a usage may say (usage.py checked_usage) is held only to a cap that is known (a longer
        answer from a model whose cap is not in the map is real, and billed)."""
        caps = [self._caps.get(m) for m in chain]
        if context is not None:
            caps += [context(m) for m in chain if self._backend_of.get(m) in self.self_hosted]
        known = [c for c in caps if c]
        return max(known) if known else default

    def worst_case(self, chain: Sequence[str], body: dict[str, Any], body_bytes: int,
                   context: Callable[[str], int | None] | None = None) -> Decimal:  # fmt: skip
        """The most a request may cost anywhere on its chain: a prompt token per body byte (a token
        is at least a byte; bytes / 4, an average, let concurrent requests overspend a budget by
        more than one reservation), plus n x max_tokens per prompt (else output_cap) at the dearest
        prices (a prompt token's, fresh or cached). A usage that would cost more is not believed
        (pipeline/finish.py): the request is counted, as one without usage is."""
        prices = [p for p in (self._prices.get(self._backend_of.get(m, "")) for m in chain) if p is not None]
        if not prices:
            return Decimal(0)
        out = max_output(body) or self.output_cap(chain, context) or DEFAULT_OUTPUT_CAP
        out *= choices(body)  # every one of n answers is billed
        # a cached prompt token may be priced above a fresh one (a policy's price is not checked for it)
        prompt = max(max(p.input, p.cached_input) for p in prices)
        return body_bytes * prompt + out * max(p.output for p in prices)

    def costs(self, backend: str, usage: dict[str, Any]) -> tuple[Decimal | None, Decimal | None]:
        """(what the request cost, what the reference model would have charged: self-hosted only)."""
        prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
        if not isinstance(prompt, int) or not isinstance(completion, int):
            return None, None
        details = usage.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        cached = cached if isinstance(cached, int) else 0
        price = self._prices.get(backend)
        cost = price.cost(prompt, completion, cached) if price is not None else None
        reference = None
        if backend in self.self_hosted and self.reference is not None:
            reference = self.reference.cost(prompt, completion, cached)
        return cost, reference


def _backend_price(spec: EngineBackend | HostedBackend) -> TokenPrice | None:
    if spec.price is not None:
        return from_policy_price(spec.price)
    if isinstance(spec, HostedBackend):
        return map_price(spec.model)
    if spec.gpu is not None:
        per_second = _dec(spec.gpu.hourly_usd) / _HOUR
        input_ = per_second / _dec(spec.gpu.input_tokens_per_second)
        return TokenPrice(input_, per_second / _dec(spec.gpu.output_tokens_per_second), input_)
    return None
