"""ModelInfo: what the HTTP layer needs of the loaded model, published once loading finished.

The engine thread owns LLMEngine; the server reads this frozen object instead of reaching into
it. Everything here is fixed by loading: the served name, the context length, the tokenizer (the
Rust tokenizer is safe to use from several threads) and the model's own sampling defaults.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

# Sampling fields a model folder's generation_config.json may default (vLLM applies the same).
_DEFAULTABLE = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


@dataclass(frozen=True)
class ModelInfo:
    """The loaded model as the server sees it."""

    served_name: str
    root: str  # the --model value (a folder or an alias)
    max_model_len: int  # prompt plus completion tokens
    tokenizer: Any  # None for folders without one (prompts are then token ids)
    generation_defaults: Mapping[str, float]  # read-only: generation_config.json's sampling fields
    # what is served: {"dtype", "quantization", "batch_invariant"} (GET /v1/models, the startup log)
    precision: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    # speculative decoding's settings ({"method", "num_speculative_tokens", ...}); None: off
    speculative: Mapping[str, Any] | None = None

    def capabilities(self) -> dict[str, bool | int]:
        """What requests to this model may ask for (GET /v1/models), for a router to filter on.

        Guided decoding (response_format json_schema / json_object, structured_outputs) and tool
        calls (decoded under a grammar) need the tokenizer; image parts are not served.
        """
        guided = self.tokenizer is not None
        return {
            "json_schema": guided,
            "json_object": guided,
            "structured_outputs": guided,
            "tools": guided,
            "vision": False,
            "logprobs": True,
            "context_length": self.max_model_len,
        }


def load_generation_defaults(model_dir: Path) -> dict[str, float]:
    """Sampling defaults a model folder ships in generation_config.json (as vLLM applies them)."""
    path = model_dir / "generation_config.json"
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(raw, dict):
        return {}
    return {
        k: float(raw[k])
        for k in _DEFAULTABLE
        if isinstance(raw.get(k), (int, float)) and not isinstance(raw.get(k), bool)
    }


def model_info(
    served_name: str,
    root: str,
    max_model_len: int,
    tokenizer: Any,
    model_dir: Path,
    precision: Mapping[str, Any] | None = None,
    speculative: Mapping[str, Any] | None = None,
) -> ModelInfo:
    """The info of a model loaded from `model_dir`."""
    defaults = MappingProxyType(load_generation_defaults(model_dir))
    return ModelInfo(
        served_name,
        root,
        max_model_len,
        tokenizer,
        defaults,
        MappingProxyType(dict(precision or {})),
        None if speculative is None else MappingProxyType(dict(speculative)),
    )
