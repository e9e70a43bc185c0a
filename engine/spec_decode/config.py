"""SpeculativeConfig: vLLM's `speculative_config`, checked once (a dict, its JSON text, or this)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

SPEC_METHODS = ("ngram", "draft_model")
MAX_SPECULATIVE_TOKENS = 16  # a verify pass costs more with every draft; past this it never pays
MAX_LOOKUP = 64  # the longest n-gram a prompt lookup matches


@dataclass(frozen=True)
class SpeculativeConfig:
    """How the engine proposes tokens for the target model to verify in one pass.

    `ngram` (prompt lookup): the longest suffix of a sequence, between prompt_lookup_min and
    prompt_lookup_max tokens, found earlier in its prompt or output proposes the tokens that
    followed it there. `draft_model`: a smaller model with the same tokenizer proposes them.
    The rest are ours, for workloads that cannot benefit: a sequence stops speculating once
    `min_acceptance_rate` of its drafted tokens are not accepted over `acceptance_window` of them,
    the engine pauses speculation for `pause_steps` steps when the same holds over all sequences,
    and `disable_by_batch_size` (vLLM's name) turns it off while more requests than that run.
    """

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int | None = None  # unset: 2 (or prompt_lookup_max if smaller)
    prompt_lookup_max: int | None = None  # unset: 4 (or prompt_lookup_min if larger)
    model: str | None = None  # draft_model: a local folder
    disable_by_batch_size: int | None = None
    min_acceptance_rate: float = 0.1
    acceptance_window: int = 32
    pause_steps: int = 64

    def __post_init__(self) -> None:
        if self.method not in SPEC_METHODS:
            raise ValueError(f"speculative_config.method must be one of {SPEC_METHODS}, got {self.method!r}")
        if not 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"speculative_config.num_speculative_tokens must be in [1, {MAX_SPECULATIVE_TOKENS}], "
                f"got {self.num_speculative_tokens}"
            )
        low, high = _lookup_defaults(self.prompt_lookup_min, self.prompt_lookup_max)
        for name, value in (("prompt_lookup_min", low), ("prompt_lookup_max", high)):
            if not 1 <= value <= MAX_LOOKUP:
                raise ValueError(f"speculative_config.{name} must be in [1, {MAX_LOOKUP}], got {value}")
        if low > high:
            raise ValueError(
                f"speculative_config.prompt_lookup_min ({low}) must not exceed prompt_lookup_max ({high})"
            )
        object.__setattr__(self, "prompt_lookup_min", low)
        object.__setattr__(self, "prompt_lookup_max", high)
        if self.method == "draft_model" and not self.model:
            raise ValueError("speculative_config.model must name the draft model for method 'draft_model'")
        if self.method != "draft_model" and self.model is not None:
            raise ValueError("speculative_config.model is for method 'draft_model' only")
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise ValueError(
                f"speculative_config.disable_by_batch_size must be >= 1, got {self.disable_by_batch_size}"
            )
        if not 0.0 <= self.min_acceptance_rate < 1.0:
            raise ValueError(
                f"speculative_config.min_acceptance_rate must be in [0, 1), got {self.min_acceptance_rate}"
            )
        for name in ("acceptance_window", "pause_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"speculative_config.{name} must be >= 1, got {getattr(self, name)}")

    @property
    def lookup_range(self) -> tuple[int, int]:
        """(shortest, longest) n-gram a prompt lookup matches."""
        assert self.prompt_lookup_min is not None and self.prompt_lookup_max is not None
        return self.prompt_lookup_min, self.prompt_lookup_max

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict[str, Any] | str) -> SpeculativeConfig:
        """From a dict (vLLM's `speculative_config`) or its JSON text; unknown keys are refused."""
        if isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"speculative_config is not valid JSON: {exc}") from None
        if not isinstance(value, dict):
            raise ValueError('speculative_config must be a JSON object, e.g. {"method": "ngram"}')
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(
                f"speculative_config: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}"
            )
        for name, given in value.items():
            expected = float if name == "min_acceptance_rate" else str if name in ("method", "model") else int
            ok = isinstance(given, expected) and not isinstance(given, bool)
            if expected is float:
                ok = isinstance(given, int | float) and not isinstance(given, bool)
            if not ok and given is not None:
                raise ValueError(f"speculative_config.{name} must be {expected.__name__}, got {given!r}")
        return cls(**value)


def _lookup_defaults(low: int | None, high: int | None) -> tuple[int, int]:
    """(min, max) n-gram sizes: 2 and 4 unless given; one given alone moves the other out of its way."""
    if low is None:
        low = 2 if high is None else min(2, high)
    if high is None:
        high = max(4, low)
    return low, high
