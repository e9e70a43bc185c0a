"""Per-request caps (EngineConfig's max_* fields), checked before a request reaches the engine.

Each cap bounds what one request can claim: sequences (prompts x n), stop-string matching work per
token, logprob payload per token, the size of a guided-decoding constraint (its compile time). A
request over a cap is a 400 naming the parameter, so a client learns which field to change; the
limit's value is in the message.
"""

from __future__ import annotations

import json

from engine.config import EngineConfig
from engine.guided import GuidedSpec
from engine.http.protocol import APIError


def _over(param: str, what: str, limit: int, got: int, option: str) -> APIError:
    return APIError(
        400,
        f"'{param}': at most {limit} {what} per request on this server (got {got}; "
        f"the operator sets this with --{option})",
        param=param,
        code="limit_exceeded",
    )


def check_request_limits(
    config: EngineConfig, num_prompts: int, n: int, stop: list[str], logprobs: int | None, logprobs_param: str
) -> None:
    """Raise a 400 APIError for the first cap the request exceeds."""
    if num_prompts > config.max_prompts:
        raise _over("prompt", "prompts", config.max_prompts, num_prompts, "max-prompts")
    if n > config.max_n:
        raise _over("n", "completions per prompt", config.max_n, n, "max-n")
    if num_prompts * n > config.max_choices:
        raise _over("n", "choices (prompts x n)", config.max_choices, num_prompts * n, "max-choices")
    if len(stop) > config.max_stop_strings:
        raise _over("stop", "stop strings", config.max_stop_strings, len(stop), "max-stop-strings")
    longest = max((len(s) for s in stop), default=0)
    if longest > config.max_stop_string_len:
        raise _over(
            "stop", "characters in a stop string", config.max_stop_string_len, longest, "max-stop-string-len"
        )
    if logprobs is not None and logprobs > config.max_logprobs:
        raise _over(logprobs_param, "logprobs per token", config.max_logprobs, logprobs, "max-logprobs")


def check_guided_limits(config: EngineConfig, spec: GuidedSpec | None) -> None:
    """Raise a 400 APIError naming the constraint's field when its source is over a cap."""
    if spec is None:
        return
    param = spec.param or "structured_outputs"
    if spec.kind == "choice":
        count = len(json.loads(spec.text))
        if count > config.max_guided_choices:
            raise _over(param, "choices", config.max_guided_choices, count, "max-guided-choices")
    if spec.kind == "regex":
        limit = config.max_guided_regex_len
        if len(spec.text) > limit:
            raise _over(param, "characters in a regex", limit, len(spec.text), "max-guided-regex-len")
        return
    size = len(spec.text.encode())
    if size > config.max_guided_bytes:
        what = "bytes of " + ("JSON schema" if spec.kind.startswith("json") else spec.kind.replace("_", " "))
        raise _over(param, what, config.max_guided_bytes, size, "max-guided-bytes")
