"""A chat request's prompt: the conversation through the model's chat template, as text, or as
token ids where client text spelled special tokens (engine/http/special_text.py).

Rendering a long conversation takes a while: past `INLINE_CHARS` characters of content (each
message counting `MESSAGE_CHARS` more) it runs in a worker thread, as does tokenizing a shielded
rendering (never the event loop).
"""

from __future__ import annotations

import asyncio
from typing import Any

from jinja2 import TemplateError

from engine.errors import ContextLengthExceededError
from engine.http.protocol import OPEN_TURN, APIError, TemplateOptions
from engine.http.special_text import Shielded, SpecialText
from engine.prompt_length import tokens_at_least
from engine.tools.prompt import OWN_MARKERS

INLINE_CHARS = 64 * 1024
# A template pays per message too (~5 us each): 50k empty messages (1.6 MB) held the event loop
# 0.3 s when only their characters counted. With this, at most ~1k messages render inline.
MESSAGE_CHARS = 64


class ChatRenderer:
    """Renders conversations for one server (the tokenizer's special tokens found once)."""

    def __init__(self) -> None:
        self._special: tuple[Any, SpecialText] | None = None  # (tokenizer, its special tokens)

    async def render(
        self,
        tokenizer: Any,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        max_model_len: int,
        options: TemplateOptions = OPEN_TURN,
    ) -> str | list[int]:
        """The prompt: text (the engine tokenizes it in its tokenizer threads), or token ids."""
        special = self.special_text(tokenizer)
        if sum(len(m["content"]) + MESSAGE_CHARS for m in messages) <= INLINE_CHARS:
            text, shielded = render_shielded(tokenizer, special, messages, tools, options)
        else:
            text, shielded = await asyncio.to_thread(
                render_shielded, tokenizer, special, messages, tools, options
            )
        if shielded is None:
            return text
        return await asyncio.to_thread(shielded_ids, tokenizer, shielded, text, max_model_len)

    def special_text(self, tokenizer: Any) -> SpecialText:
        """The tokenizer's special tokens, minus our tool prompt's own markers."""
        if self._special is None or self._special[0] is not tokenizer:
            self._special = (tokenizer, SpecialText(tokenizer, keep=OWN_MARKERS))
        return self._special[1]


def render_prompt(
    tokenizer: Any,
    special: SpecialText,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    max_model_len: int,
) -> str | list[int]:
    """The rendered conversation: text, or token ids where client strings spelled special tokens
    (ChatRenderer.render's two steps in one call, on this thread)."""
    text, shielded = render_shielded(tokenizer, special, messages, tools)
    return text if shielded is None else shielded_ids(tokenizer, shielded, text, max_model_len)


def render_shielded(
    tokenizer: Any,
    special: SpecialText,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    options: TemplateOptions = OPEN_TURN,
) -> tuple[str, Shielded | None]:
    """The conversation rendered with the special tokens its strings spell shielded, if any."""
    (messages, tools), shielded = special.shield((messages, tools))
    return render_template(tokenizer, messages, tools, options), shielded


def shielded_ids(tokenizer: Any, shielded: Shielded, text: str, max_model_len: int) -> list[int]:
    """A shielded rendering's token ids; a text surely over the context is refused first, without
    tokenizing all of it (engine/prompt_length.py; the engine does the same for other prompts)."""
    # read with its special tokens, the text has at most the tokens it has read as plain text
    at_least = tokens_at_least(tokenizer, shielded.restore(text), max_model_len)
    if at_least is not None:
        raise ContextLengthExceededError(
            f"This model's maximum context length is {max_model_len} tokens, "
            f"but the prompt has at least {at_least} tokens",
            param="messages",
        )
    return shielded.tokenize(tokenizer, text)


def render_template(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    options: TemplateOptions = OPEN_TURN,
) -> str:
    """The chat template's text (its own refusals, e.g. of the roles' order, are the client's 400)."""
    try:
        text = tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=options.generation_prompt,
            continue_final_message=options.continue_final, tokenize=False,
        )  # fmt: skip
    except TemplateError as exc:  # the template's own checks (e.g. role order): the client's to fix
        raise APIError(400, f"the chat template rejected the messages: {exc}", param="messages") from exc
    except ValueError as exc:  # transformers': a final message the template does not show as given
        if not options.continue_final:
            raise
        message = f"the final message cannot be continued with this model's chat template: {exc}"
        raise APIError(400, message, param="continue_final_message") from exc
    return str(text)
