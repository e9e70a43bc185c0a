"""Counting tokens when a backend reported no usage (e.g. a stream the client left): tiktoken, offline.

The BPE files come from litellm's package (it bundles cl100k_base and o200k_base), found without
importing litellm. OpenAI's GPT-4o family and later use o200k_base; every other model is counted
with cl100k_base, an estimate for non-OpenAI tokenizers: rows counted here are marked `estimated`.
"""

from __future__ import annotations

import importlib.util
import os
from functools import lru_cache
from pathlib import Path
from typing import Any

_O200K_PREFIXES = ("gpt-4o", "gpt-4.1", "gpt-4.5", "gpt-5", "o1", "o3", "o4", "chatgpt-4o")


@lru_cache(maxsize=2)
def _encoding(name: str) -> Any:
    spec = importlib.util.find_spec("litellm")
    if spec is not None and spec.submodule_search_locations:
        bundled = Path(next(iter(spec.submodule_search_locations))) / "litellm_core_utils" / "tokenizers"
        os.environ.setdefault("TIKTOKEN_CACHE_DIR", str(bundled))  # never fetch the BPE files
    import tiktoken

    return tiktoken.get_encoding(name)


def encoding_for(model: str) -> str:
    """o200k_base for OpenAI's newer models, cl100k_base otherwise."""
    bare = model.rsplit("/", 1)[-1].lower()
    return "o200k_base" if bare.startswith(_O200K_PREFIXES) else "cl100k_base"


def count(text: str, model: str) -> int:
    """Tokens in `text` for `model` (special-token text counted as plain text)."""
    if not text:
        return 0
    return len(_encoding(encoding_for(model)).encode(text, disallowed_special=()))


def prompt_text(body: dict[str, Any]) -> str:
    """The text a chat or completions request sends (message contents, text parts, or the prompt)."""
    if "messages" in body:
        parts: list[str] = []
        for message in body.get("messages") or []:
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, str):
                parts.append(content)
            elif isinstance(content, list):
                parts += [str(p.get("text") or "") for p in content if isinstance(p, dict)]
        return "\n".join(parts)
    prompt = body.get("prompt")
    if isinstance(prompt, list):
        return "\n".join(p for p in prompt if isinstance(p, str))
    return prompt if isinstance(prompt, str) else ""


def completion_text(chunks: list[dict[str, Any]]) -> str:
    """The text in whole responses' choices or in stream chunks' deltas."""
    parts: list[str] = []
    for chunk in chunks:
        for choice in chunk.get("choices") or []:
            if not isinstance(choice, dict):
                continue
            message = choice.get("message") or choice.get("delta") or {}
            text = message.get("content") if isinstance(message, dict) else None
            parts.append(text if isinstance(text, str) else str(choice.get("text") or ""))
    return "".join(parts)
