"""Counting tokens when a backend reported no usage (e.g. a stream the client left), offline.

An engine pool whose policy names its model's `tokenizer` (tokenizer.json) is counted with it, and
Claude models with the Anthropic tokenizer litellm bundles. Otherwise tiktoken, with the BPE
files litellm's package bundles (found without importing litellm): OpenAI's GPT-4o family and
later use o200k_base, every other model cl100k_base (an estimate for other tokenizers). Rows
counted here are marked `estimated` either way.
"""

from __future__ import annotations

import logging
import math
from functools import lru_cache
from pathlib import Path
from typing import Any

import orjson

from gateway.governance.costs import litellm_file

logger = logging.getLogger(__name__)

_O200K_PREFIXES = ("gpt-4o", "gpt-4.1", "gpt-4.5", "gpt-5", "o1", "o3", "o4", "chatgpt-4o")
# Characters counted exactly; the rest of a longer text is extrapolated at the same rate. BPE is
# slow on long runs without spaces (1 MiB of one letter: ~0.7 s here), and megabytes of text must
# not hold a worker thread for seconds.
EXACT_CHARS = 1 << 18
PIECE_CHARS = 16 * 1024  # count_until's pieces: ~15 ms of tokenizing each
_SLACK_PER_CUT = 4


@lru_cache(maxsize=2)
def _encoding(name: str) -> Any:
    import tiktoken  # TIKTOKEN_CACHE_DIR names litellm's bundled BPE files (gateway/cli/environment.py)

    return tiktoken.get_encoding(name)


def encoding_for(model: str) -> str:
    """o200k_base for OpenAI's newer models, cl100k_base otherwise."""
    bare = model.rsplit("/", 1)[-1].lower()
    return "o200k_base" if bare.startswith(_O200K_PREFIXES) else "cl100k_base"


def count(text: str, model: str, tokenizer: str | None = None) -> int:
    """Tokens in `text` for `model` (special-token text counted as plain text; past EXACT_CHARS,
    extrapolated from the first EXACT_CHARS)."""
    if not text:
        return 0
    if len(text) > EXACT_CHARS:
        return math.ceil(count(text[:EXACT_CHARS], model, tokenizer) * len(text) / EXACT_CHARS)
    if tokenizer is None and "claude" in model.lower():
        tokenizer = _bundled("anthropic_tokenizer.json")  # litellm ships Anthropic's tokenizer too
    if tokenizer is not None:
        try:
            return len(hf_tokenizer(tokenizer).encode(text, add_special_tokens=False).ids)
        except Exception:  # unreadable since the policy was checked: tiktoken's estimate instead
            logger.warning("tokenizer %s is unreadable; counting with tiktoken", tokenizer, exc_info=True)
    return len(_encoding(encoding_for(model)).encode(text, disallowed_special=()))


def counted_by(model: str, tokenizer: str | None = None) -> str:
    """What `count` counts `model`'s text with: two models with the same answer count alike."""
    if tokenizer is not None:
        return tokenizer
    return "anthropic" if "claude" in model.lower() else encoding_for(model)


def count_until(text: str, model: str, tokenizer: str | None, limit: int) -> int:
    """Tokens in `text`, stopping once surely past `limit`: a number above `limit` then, else the count.

    Counted in pieces of PIECE_CHARS characters cut at a space, so the work (and the GIL, which the
    Rust tokenizer holds for a whole call) stays near `limit` tokens whatever the text's size. A
    cut can split what would be one token: each cut is granted _SLACK_PER_CUT tokens, so a text is
    called too long only when it surely is, and a count near the limit is low by at most that.
    """
    if len(text) <= PIECE_CHARS:
        return count(text, model, tokenizer)
    counted = cuts = start = 0
    while start < len(text):
        end = min(start + PIECE_CHARS, len(text))
        if end < len(text):
            space = text.rfind(" ", start + PIECE_CHARS // 2, end)
            end = space if space > start else end
            cuts += 1
        counted += count(text[start:end], model, tokenizer)
        start = end
        if counted - _SLACK_PER_CUT * cuts > limit:
            break
    return max(0, counted - _SLACK_PER_CUT * cuts)


def _bundled(name: str) -> str | None:
    path = litellm_file("litellm_core_utils", "tokenizers", name)
    return str(path) if path is not None and path.is_file() else None


def tokenizer_exists(path: str) -> bool:
    """Whether `path` is a tokenizer.json or a folder holding one."""
    file = Path(path)
    return (file / "tokenizer.json" if file.is_dir() else file).is_file()


@lru_cache(maxsize=8)
def hf_tokenizer(path: str) -> Any:
    """The `tokenizers` Tokenizer of a tokenizer.json or its folder (loaded once)."""
    from tokenizers import Tokenizer

    file = Path(path)
    return Tokenizer.from_file(str(file / "tokenizer.json" if file.is_dir() else file))


def prompt_text(body: dict[str, Any]) -> str:
    """The text a chat or completions request sends: message contents and text parts, the calls an
    assistant message made and the tools offered (a model reads them as prompt), or the prompt."""
    if "messages" in body:
        parts: list[str] = []
        messages = body.get("messages")
        for message in messages if isinstance(messages, list) else []:
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, str):
                parts.append(content)
            elif isinstance(content, list):
                parts += [str(p.get("text") or "") for p in content if isinstance(p, dict)]
            if isinstance(message, dict):
                parts += _calls_text(message)
        for field in ("tools", "functions"):
            if body.get(field):
                parts.append(orjson.dumps(body[field]).decode())
        return "\n".join(parts)
    prompt = body.get("prompt")
    if isinstance(prompt, list):
        return "\n".join(p for p in prompt if isinstance(p, str))
    return prompt if isinstance(prompt, str) else ""


# a chat's tokens beside its texts, as OpenAI counts them for its chat models: 3 per message (its
# role and delimiters), 1 more for a `name`, 3 priming the reply. A model's own chat template may
# spend more (a default system prompt): our engine says its exact count (`: prompt_tokens`).
_PER_MESSAGE, _PER_NAME, _REPLY_PRIMING = 3, 1, 3


def chat_overhead(body: dict[str, Any]) -> int:
    """The tokens a chat request's template adds to its texts' (0 for a text completion)."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        return 0
    names = sum(1 for m in messages if isinstance(m, dict) and m.get("name"))
    return _PER_MESSAGE * len(messages) + _PER_NAME * names + _REPLY_PRIMING


def prompt_token_ids(body: dict[str, Any]) -> int:
    """The tokens a legacy completion sends as ids (a list of ids, or of id lists): no text to count."""
    prompt = body.get("prompt")
    if not isinstance(prompt, list) or not prompt:
        return 0
    if all(type(t) is int for t in prompt):
        return len(prompt)
    return sum(len(p) for p in prompt if isinstance(p, list))


def _calls_text(message: dict[str, Any]) -> list[str]:
    """The names and arguments of the calls in a message or delta (tool_calls, legacy function_call)."""
    calls = message.get("tool_calls")
    found = [c.get("function") for c in calls if isinstance(c, dict)] if isinstance(calls, list) else []
    found.append(message.get("function_call"))
    parts = []
    for function in found:
        if isinstance(function, dict):
            parts += [v for v in (function.get("name"), function.get("arguments")) if isinstance(v, str)]
    return parts


def completion_text(chunks: list[dict[str, Any]]) -> str:
    """The text in whole responses' choices or in stream chunks' deltas."""
    parts: list[str] = []
    for chunk in chunks:
        choices = chunk.get("choices")
        for choice in choices if isinstance(choices, list) else []:
            if not isinstance(choice, dict):
                continue
            message = choice.get("message") or choice.get("delta") or {}
            text = message.get("content") if isinstance(message, dict) else None
            if not isinstance(text, str):
                text = choice.get("text")
            parts.append(text if isinstance(text, str) else "")
            if isinstance(message, dict):
                parts += _calls_text(message)  # an answer of tool calls is answer text too
    return "".join(parts)
