"""URLs in a chat request's content parts that a hosted provider's library would fetch itself.

litellm downloads an `image_url` (and a file's URL) from inside the gateway for providers whose
API takes only the bytes (Anthropic, among others), following redirects: any client with a key
could make the gateway read a URL on its own network (SSRF: metadata services, internal admin
pages) and time it. Only the providers that pass a URL on to the provider, which fetches it on its
side (OpenAI, Azure), get URLs; the others take `data:` URLs (base64) only, and a request with a
URL for them is refused before litellm sees it.
"""

from __future__ import annotations

from typing import Any

from gateway.errors import GatewayError

# litellm providers that hand a part's URL to the provider as it is (nothing fetched here)
_PASS_URLS = frozenset({"openai", "azure", "text-completion-openai", "azure_text"})
_SCHEMES = ("http://", "https://", "ftp://", "file://")
_MAX_DEPTH = 8  # a part's nesting looked through (image_url.url, file.file_data: two levels)


def fetches_urls(provider: str | None) -> bool:
    """Whether litellm would fetch a content part's URL itself for a model of `provider`
    (litellm_map.provider_of; an unknown provider: yes)."""
    return provider not in _PASS_URLS


def refuse_fetched_urls(params: dict[str, Any]) -> None:
    """400 naming the first content part of `params["messages"]` that holds a URL to fetch."""
    messages = params.get("messages")
    for i, message in enumerate(messages if isinstance(messages, list) else []):
        content = message.get("content") if isinstance(message, dict) else None
        for j, part in enumerate(content if isinstance(content, list) else []):
            if isinstance(part, dict) and _holds_url(part, 0):
                raise GatewayError(
                    400,
                    "this model takes images and files as data: URLs (base64) only: the gateway does "
                    "not fetch URLs for it",
                    param=f"messages[{i}].content[{j}]",
                    code="url_not_supported",
                )


def _holds_url(value: Any, depth: int) -> bool:
    """Whether a part holds a URL-looking string anywhere but in its text."""
    if depth > _MAX_DEPTH:
        return True  # nested past any part's shape: not looked through, not passed on
    if isinstance(value, str):
        return value.lstrip()[:8].lower().startswith(_SCHEMES)
    if isinstance(value, dict):
        return any(_holds_url(v, depth + 1) for k, v in value.items() if k != "text")
    if isinstance(value, list):
        return any(_holds_url(v, depth + 1) for v in value)
    return False
