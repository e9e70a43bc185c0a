"""An upstream's `usage` object, checked before it is billed.

The upstream is not trusted with money: a negative count would refund a budget, 2**40 tokens would
lock a key out for years, a string or a float would break the log batch. Usage is accepted only as
non-negative integers within MAX_TOKENS whose parts add up, and no more tokens than the request
could hold or ask for; anything else is rejected here and the answer is counted with the tokenizer
instead (the row is marked estimated).
"""

from __future__ import annotations

from typing import Any

import orjson

MAX_TOKENS = 1 << 24  # 16.7M: above any context window served today, far below int32 and money overflow


def _count(value: Any) -> int | None:
    """A token count, or None when it is not one (bool is an int in Python, but not a count)."""
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_TOKENS:
        return value
    return None


def checked_usage(
    raw: Any, body: dict[str, Any] | None = None, size: int | None = None, output_cap: int | None = None
) -> dict[str, Any] | None:
    """The usage fields we bill from, normalised; None when `raw` is missing or not believable: a
    count past MAX_TOKENS, parts that disagree with the total, or (given the request's `body`, of
    `size` bytes as received) more completion tokens than its max_tokens allows each of its answers
    (else `output_cap`, the chain's known cap on one answer when it names none: a one-word answer
    billed as millions of tokens locked its key out) or more prompt tokens than it
    can hold (max_prompt)."""
    if not isinstance(raw, dict):
        return None
    prompt, completion = _count(raw.get("prompt_tokens")), _count(raw.get("completion_tokens"))
    if prompt is None or completion is None:
        return None
    limit = (max_output(body) or output_cap) if body is not None else None
    if limit is not None and body is not None and completion > limit * choices(body):
        return None
    most = max_prompt(body, size) if body is not None else None
    if most is not None and prompt > most:
        return None  # a 60-byte question billed as 900,000 prompt tokens: 18x its key's budget
    total = raw.get("total_tokens")
    if total is not None and _count(total) != prompt + completion:
        return None  # the parts and the total disagree: believe neither
    usage: dict[str, Any] = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }
    details = raw.get("prompt_tokens_details")
    if isinstance(details, dict) and details.get("cached_tokens") is not None:
        cached = _count(details.get("cached_tokens"))
        if cached is None or cached > prompt:
            return None
        usage["prompt_tokens_details"] = {"cached_tokens": cached}
    return usage


# prompt tokens a request may be billed for beyond its own bytes: chat templates and default system
# prompts, a provider's tool-use preamble (Anthropic's: a few hundred). A budgeted request's usage is
# also held to what it reserved (pipeline/finish.py), which takes a token a byte.
PROMPT_SLACK = 4096


def max_prompt(body: dict[str, Any], size: int | None = None) -> int | None:
    """The most prompt tokens a request can be billed for: its size in bytes (byte-level tokenizers,
    and SentencePiece with byte fallback, make at most one token of a byte; `size` as received,
    else its encoding's, a pass over megabytes that the callers on the loop avoid), once (OpenAI,
    vLLM and our engine count a prompt once however many answers it gets, and a legacy
    completion's prompts are parts of its bytes), plus PROMPT_SLACK. None when a message holds more
    than text (an image, audio, a file id: many tokens in a few bytes) or the provider may add to
    the prompt itself (`web_search_options`, or a tool it runs: the pages it read, a code run's
    output)."""
    if body.get("web_search_options") is not None or _provider_tools(body.get("tools")):
        return None
    messages = body.get("messages")
    for message in messages if isinstance(messages, list) else ():
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list) and not all(
            isinstance(p, dict) and p.get("type") == "text" for p in content
        ):
            return None
    given = len(orjson.dumps(body)) if size is None else size
    return given + PROMPT_SLACK


def _provider_tools(tools: object) -> bool:
    """Whether `tools` holds one the provider runs itself (Anthropic's web_search_*, web_fetch_*,
    code_execution_*, an `mcp` server; Gemini's googleSearch, which has no type): anything but a
    function (or custom tool) that the client runs and whose bytes are all it adds."""
    return isinstance(tools, list) and any(
        not isinstance(t, dict) or t.get("type") not in ("function", "custom") for t in tools
    )


MAX_CHOICES = 128  # OpenAI's own cap on `n`
MAX_ANSWERS = 2048  # answers of one request (prompts x n): OpenAI caps a list of prompts at 2,048


def max_output(body: dict[str, Any]) -> int | None:
    """The output tokens a request may produce per choice, as it asks (None: it names no limit): the
    larger of `max_tokens` and `max_completion_tokens`, since upstreams differ in which one they read
    (our engine's legacy completions read only `max_tokens`). Taking the first one named let a request
    with `max_completion_tokens: 1, max_tokens: 4000` reserve one output token on its budget and be
    answered, and billed, 4,000: 30 at once overspent a budget by far more than one reservation."""
    asked = [
        v
        for v in (body.get("max_completion_tokens"), body.get("max_tokens"))
        if isinstance(v, int) and not isinstance(v, bool) and v > 0
    ]
    return min(max(asked), MAX_TOKENS) if asked else None


def choices(body: dict[str, Any]) -> int:
    """How many answers a request asks for: `n` (or `best_of`, generated server-side) for each of
    its prompts (a legacy completion's list of prompts is answered prompt by prompt), within bounds."""
    asked = (body.get("n"), body.get("best_of"))
    counts = [v for v in asked if isinstance(v, int) and not isinstance(v, bool)]
    return min(min(max([1, *counts]), MAX_CHOICES) * prompts(body), MAX_ANSWERS)


def prompts(body: dict[str, Any]) -> int:
    """The prompts of a legacy completion: a list of strings or of token-id lists holds several; a
    string, a list of token ids (one prompt) or a chat request, one."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(p, str | list) for p in prompt):
        return len(prompt)
    return 1


ZERO_COUNTS = ("prompt_tokens", "completion_tokens")


def says_zero(usage: dict[str, Any]) -> bool:
    """Checked usage that claims no prompt or no answer: believed only once the text agrees (a provider
    whose usage is null comes back from litellm as zeros, which would make the answer free)."""
    return any(usage.get(name) == 0 for name in ZERO_COUNTS)
