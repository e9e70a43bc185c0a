"""SamplingParams: how one request chooses its tokens and when it stops; StructuredOutputsParams:
what its output is held to (vLLM's offline names)."""

from __future__ import annotations

import copy
import math
import numbers
from dataclasses import dataclass, field, fields
from typing import Any

from engine.guided.spec import GuidedSpec, from_structured_outputs

_GREEDY_EPS = 1e-5
MAX_LOGIT_BIAS = 300  # entries in `logit_bias` (OpenAI's limit)
MAX_ALLOWED_TOKEN_IDS = 1 << 17  # `allowed_token_ids` (vLLM's): past any vocabulary served today
MAX_BAD_WORDS, MAX_BAD_WORD_CHARS = 128, 256  # `bad_words` (vLLM's): how many, and how long each
MAX_STOP_TOKEN_IDS = 1024  # entries in `stop_token_ids`: every sampled token is looked up in them


@dataclass(frozen=True)
class StructuredOutputsParams:
    """vLLM's structured-outputs options: exactly one constraint (json, regex, choice, grammar,
    json_object, structural_tag), plus the JSON layout options. The same fields as the HTTP
    `structured_outputs` object; checked when the SamplingParams holding it is made."""

    json: str | dict[str, Any] | None = None  # a JSON schema, as a dict or its JSON text
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # Lark, or GBNF/EBNF ("root ::= ...")
    json_object: bool | None = None
    structural_tag: str | dict[str, Any] | None = None
    disable_fallback: bool = False  # accepted for vLLM's sake; one library, nothing to fall back to
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None

    def to_spec(self) -> GuidedSpec:
        """The constraint, checked (GuidedDecodingError, a ValueError, names the field at fault)."""
        given = {f.name: getattr(self, f.name) for f in fields(self)}
        return from_structured_outputs({k: v for k, v in given.items() if v is not None})


# the float fields, each a finite number; the integer fields
_NUMBERS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
_INTEGERS = ("n", "max_tokens", "top_k", "seed", "logprobs", "min_tokens", "truncate_prompt_tokens")


@dataclass
class SamplingParams:
    """Per-request sampling options, with vLLM's names and defaults."""

    n: int = 1
    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    min_tokens: int = 0
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    # the constraint the engine applies: from structured_outputs, or set directly by the HTTP layer
    # (response_format, or its structured_outputs object), where the spec names the request field
    guided: GuidedSpec | None = None
    # speculative decoding (when the engine has a speculative_config): False opts this request out
    speculative: bool = True
    # OpenAI's logit_bias: added to these tokens' logits before sampling, each in [-100, 100]
    logit_bias: dict[int, float] | None = None
    # vLLM's bad_words: the last token of each word's tokens is forbidden where it would complete it
    bad_words: list[str] | None = None
    # vLLM's: only the prompt's last that many tokens are read (-1: as many as the context holds)
    truncate_prompt_tokens: int | None = None
    # vLLM's: a stop string that ends the output is part of it (by default it is cut off)
    include_stop_str_in_output: bool = False
    # vLLM's allowed_token_ids: only these tokens may be sampled (every other logit is -inf)
    allowed_token_ids: list[int] | None = None
    # the structured_outputs `guided` was made from (None: set directly, or none)
    _guided_from: StructuredOutputsParams | None = field(init=False, repr=False, compare=False, default=None)

    def __post_init__(self) -> None:
        self._normalize()
        if self.structured_outputs is not None:
            spec = self.structured_outputs.to_spec()
            if self.guided is not None and self.guided != spec:  # (replace() hands the derived one back)
                raise ValueError("give structured_outputs or guided, not both")
            self.guided, self._guided_from = spec, self.structured_outputs
        self._validate()

    def checked(self) -> SamplingParams:
        """A request's own copy of these params as their fields are now, checked again: a field set
        after construction (`params.stop = [...]`, `params.structured_outputs = ...`) counts, as vLLM
        reads them when a request is added (they were ignored), and a change made later does not
        reach the request (the sampler reads its params at every step)."""
        own = self.clone()
        if own.structured_outputs is not own._guided_from:
            own.guided = None if own.structured_outputs is None else own.structured_outputs.to_spec()
            own._guided_from = own.structured_outputs
        own._normalize()
        own._validate()
        return own

    def _normalize(self) -> None:
        """Plain Python values: numpy's numbers as ints and floats, `stop` a list (a generator was
        used up by the first look), `stop_token_ids` a list."""
        for name in _INTEGERS:
            value = getattr(self, name)
            if isinstance(value, numbers.Integral) and not isinstance(value, bool):
                setattr(self, name, int(value))
        for name in _NUMBERS:
            value = getattr(self, name)
            if isinstance(value, numbers.Real) and not isinstance(value, bool):
                setattr(self, name, float(value))
        if self.stop is not None and not isinstance(self.stop, str | list):
            self.stop = list(self.stop)
        self.stop_token_ids = [] if self.stop_token_ids is None else list(self.stop_token_ids)

    def clone(self) -> SamplingParams:
        """A deep copy (vLLM's name)."""
        return copy.deepcopy(self)

    def _validate(self) -> None:
        for name in _NUMBERS:  # (a string was "'<' not supported", NaN sampled token 0 for ever)
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 or 0 (disabled) or a positive integer, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if not 0.0 < self.repetition_penalty < math.inf:  # (vLLM: any positive value)
            raise ValueError(f"repetition_penalty must be positive and finite, got {self.repetition_penalty}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs must be in [0, 20], got {self.logprobs}")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be at most max_tokens ({self.max_tokens})")
        if any(not isinstance(s, str) or not s for s in self.stop_strings):
            raise ValueError("stop strings must be non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids or []):
            raise ValueError("stop_token_ids must be non-negative integers")
        if len(self.stop_token_ids or ()) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"stop_token_ids has {len(self.stop_token_ids or ())} entries, "
                             f"more than {MAX_STOP_TOKEN_IDS}")  # fmt: skip
        bias = self.logit_bias or {}
        if len(bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias has {len(bias)} entries, more than {MAX_LOGIT_BIAS}")
        if any(type(t) is not int or t < 0 for t in bias):
            raise ValueError("logit_bias keys must be non-negative token ids")
        if any(not isinstance(v, int | float) or not -100.0 <= v <= 100.0 for v in bias.values()):
            raise ValueError("logit_bias values must be numbers in [-100, 100]")
        words = self.bad_words
        if words is not None:
            if len(words) > MAX_BAD_WORDS:
                raise ValueError(f"bad_words has {len(words)} entries, more than {MAX_BAD_WORDS}")
            if any(not isinstance(w, str) or not w.strip() or len(w) > MAX_BAD_WORD_CHARS for w in words):
                raise ValueError(
                    f"bad_words must be non-blank strings of at most {MAX_BAD_WORD_CHARS} characters"
                )
        truncate = self.truncate_prompt_tokens
        if truncate is not None and (type(truncate) is not int or not (truncate == -1 or truncate >= 1)):
            raise ValueError("truncate_prompt_tokens must be -1 (the context's length) or at least 1")
        allowed = self.allowed_token_ids
        if allowed is not None:
            if not allowed or len(allowed) > MAX_ALLOWED_TOKEN_IDS:
                raise ValueError(f"allowed_token_ids must hold 1 to {MAX_ALLOWED_TOKEN_IDS} token ids")
            if any(type(t) is not int or t < 0 for t in allowed):
                raise ValueError("allowed_token_ids must be non-negative token ids")

    @property
    def stop_strings(self) -> list[str]:
        """The stop strings as a list (the `stop` field accepts a single string too)."""
        stop = self.stop
        return [stop] if isinstance(stop, str) else list(stop or ())

    @property
    def is_greedy(self) -> bool:
        """Temperature zero means argmax decoding."""
        return self.temperature < _GREEDY_EPS

    @property
    def effective_top_k(self) -> int:
        """top_k with 0 and -1 both meaning 'disabled' (0)."""
        return max(self.top_k, 0)

    @property
    def has_penalties(self) -> bool:
        """Whether a repetition-style penalty or a logit bias changes the logits."""
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
            or bool(self.logit_bias)
            or self.allowed_token_ids is not None
            or bool(self.bad_words)
        )
