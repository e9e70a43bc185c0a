"""What an engine says about its models in `GET /v1/models`: context length and capabilities.

Each entry of `data` is a model card: its `id` (the served name), `max_model_len` (prompt plus
output tokens it takes at most: its context) and, from engines that report them, `capabilities`:
`{"tools": true, "json_schema": true, "json_object": true, "vision": false, "logprobs": true,
"context_length": 8192}` (engine/model_info.py; other keys, e.g. `structured_outputs`, are not
routed on). `max_model_len` wins over `capabilities.context_length` when both are given.
A value of the wrong type counts as unsaid, never as true: a card is the upstream's word, and a
routing decision must not rest on a guess. The replicas of a pool are merged conservatively (a
rolling upgrade may leave them disagreeing, and a request may land on any of them): a capability
one replica denies is denied, and the context is the shortest any replica reports.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import orjson

from gateway.backends.base import Learned
from gateway.config.policy import Capabilities

MAX_CARDS_BYTES = 1 << 20  # an honest /v1/models answer is a few hundred bytes per served name
MAX_CONTEXT = 1 << 31  # past this a context length is not a number we believe
_NAMES = tuple(Capabilities.model_fields)


def parse_model_cards(raw: bytes) -> dict[str, Learned] | None:
    """Served name -> what its card says; None when `raw` is not a model list at all."""
    try:
        listing = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    data = listing.get("data") if isinstance(listing, dict) else None
    if not isinstance(data, list):
        return None
    cards: dict[str, Learned] = {}
    for card in data:
        if isinstance(card, dict) and isinstance(card.get("id"), str):
            cards[card["id"]] = _learned(card)
    return cards


def _learned(card: Mapping[str, Any]) -> Learned:
    said = card.get("capabilities")
    said = said if isinstance(said, dict) else {}
    flags = {name: value for name in _NAMES if isinstance(value := said.get(name), bool)}
    return Learned(
        Capabilities(**flags), _context(card.get("max_model_len")) or _context(said.get("context_length"))
    )


def _context(length: Any) -> int | None:
    return length if type(length) is int and 0 < length <= MAX_CONTEXT else None


def merge_replicas(reports: Iterable[Mapping[str, Learned]]) -> dict[str, Learned]:
    """One pool's view of its models from its replicas' cards (denials and the shortest context win)."""
    merged: dict[str, Learned] = {}
    for report in reports:
        for model, learned in report.items():
            seen = merged.get(model)
            merged[model] = learned if seen is None else _meet(seen, learned)
    return merged


def _meet(a: Learned, b: Learned) -> Learned:
    flags: dict[str, bool] = {}
    for name in _NAMES:
        said = [v for v in (getattr(a.capabilities, name), getattr(b.capabilities, name)) if v is not None]
        if said:
            flags[name] = all(said)
    contexts = [c for c in (a.context_length, b.context_length) if c is not None]
    return Learned(Capabilities(**flags), min(contexts) if contexts else None)
