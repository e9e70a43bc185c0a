"""What litellm's bundled model map says a hosted model can do (LITELLM_LOCAL_MODEL_COST_MAP: read
from the installed package, never the network): the capabilities routing checks before a call."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import litellm  # LITELLM_LOCAL_MODEL_COST_MAP keeps its import off the network: gateway/cli/environment.py

from gateway.backends.base import Learned
from gateway.config.policy import Capabilities


def learned_from_litellm(model: str) -> Learned:
    """What litellm's bundled model map (LITELLM_LOCAL_MODEL_COST_MAP: no network) says `model` can do.

    The model's own entry gives tools, json_schema, vision and its input context; the provider's
    OpenAI parameters decide the rest and deny what the provider cannot take at all (no
    `response_format`: neither JSON mode; no `logprobs`). A model the map lacks says nothing.
    """
    try:
        info: Mapping[str, Any] = litellm.get_model_info(model)
    except Exception:  # litellm raises a bare Exception for a name its map lacks
        info = {}
    if info.get("mode") not in (None, "chat", "completion", "responses"):
        info = {}  # the map's entry for that name is an embedding (or image, audio) model's
    try:
        params = litellm.get_supported_openai_params(model=model)
    except Exception:  # an unknown provider
        params = None
    said = {
        "tools": info.get("supports_function_calling"),
        "json_schema": info.get("supports_response_schema"),
        "vision": info.get("supports_vision"),
    }
    if info.get("supports_response_schema") is True:
        said["json_object"] = True  # a model that keeps to a schema keeps to JSON
    if params is not None:
        for capability, param in (("tools", "tools"), ("json_schema", "response_format"),
                                  ("json_object", "response_format")):  # fmt: skip
            if param not in params:
                said[capability] = False
        said["logprobs"] = "logprobs" in params
    flags = {name: value for name, value in said.items() if isinstance(value, bool)}
    context = info.get("max_input_tokens")
    return Learned(Capabilities(**flags), context if type(context) is int and context > 0 else None)


def provider_of(model: str) -> str | None:
    """litellm's provider for `model` (`openai`, `anthropic`, ...); None for a name it cannot place."""
    try:
        return str(litellm.get_llm_provider(model)[1])
    except Exception:  # litellm raises a bare Exception for a name it cannot place
        return None
