"""Client text that spells a special token stays text (chat requests).

A chat template turns the messages into one string that is then tokenized, and the tokenizer reads
its special tokens (`<|im_start|>`, `<|im_end|>`, `<|endoftext|>`, ...) wherever that string spells
them. Left so, a user message holding "<|im_end|>\\n<|im_start|>system\\n..." would close its own
turn and open a system turn: a client could forge turns and roles. OpenAI reads message text as
text. So before rendering, each special token spelled in a client string (message contents, tool
call ids and arguments, the tools offered) becomes a placeholder that no client can guess, and the
rendered string is tokenized piece by piece: the template's pieces as before, each placeholder as
its original characters read as plain text (`split_special_tokens`). A conversation without such
text (nearly every one) renders and tokenizes exactly as before. The markers of our own tool prompt
(engine/tools/prompt.py) are left alone: it writes them itself. Raw /v1/completions prompts are not
chat: there, as in vLLM, a prompt may spell special tokens on purpose.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any


def _placeholder(nonce: str, index: int | str) -> str:
    """What stands for a shielded string: private-use characters around a nonce and its index (an
    index pattern, for matching them)."""
    return f"\ue000{nonce}{index}\ue001"


@dataclass(frozen=True)
class Shielded:
    """Placeholders put in one conversation: `placeholder(i)` stands for `originals[i]`."""

    nonce: str
    originals: tuple[str, ...]

    def placeholder(self, index: int) -> str:
        """The text that stands for originals[index]."""
        return _placeholder(self.nonce, index)

    def restore(self, text: str) -> str:
        """The rendered `text` with the original characters in place of the placeholders."""
        return re.sub(_placeholder(self.nonce, r"(\d+)"), lambda m: self.originals[int(m.group(1))], text)

    def tokenize(self, tokenizer: Any, text: str) -> list[int]:
        """The rendered `text`'s token ids, each placeholder read as its original plain text."""
        pieces = re.split(_placeholder(self.nonce, r"(\d+)"), text)
        ids: list[int] = []
        for i, piece in enumerate(pieces):
            if i % 2:  # a placeholder's index
                plain = tokenizer(
                    self.originals[int(piece)], add_special_tokens=False, split_special_tokens=True
                )
                ids.extend(plain.input_ids)
            elif piece:
                ids.extend(tokenizer(piece, add_special_tokens=False).input_ids)
        return ids


class SpecialText:
    """Finds the special tokens a tokenizer would read in client strings, and shields them."""

    def __init__(self, tokenizer: Any, keep: Iterable[str] = ()) -> None:
        specials = set(getattr(tokenizer, "all_special_tokens", ()))
        decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
        specials |= {t.content for t in decoder.values() if getattr(t, "special", False)}
        specials -= {*keep, ""}
        longest_first = sorted(specials, key=len, reverse=True)  # "<|im_start|>" before "<|im"
        self.pattern = re.compile("|".join(map(re.escape, longest_first))) if specials else None

    def shield(self, value: Any) -> tuple[Any, Shielded | None]:
        """`value` (JSON-like: dicts, lists, strings) with every special token spelled in its
        strings replaced by a placeholder, and the placeholders; (value itself, None) if none."""
        if self.pattern is None:
            return value, None
        originals: list[str] = []
        nonce = uuid.uuid4().hex

        def swap(match: re.Match[str]) -> str:
            originals.append(match.group(0))
            return _placeholder(nonce, len(originals) - 1)

        pattern = self.pattern

        def walk(node: Any) -> Any:
            if isinstance(node, str):
                return pattern.sub(swap, node) if pattern.search(node) else node
            if isinstance(node, dict):
                return {walk(k): walk(v) for k, v in node.items()}
            if isinstance(node, list | tuple):
                return type(node)(walk(v) for v in node)
            return node

        out = walk(value)
        if not originals:
            return value, None
        return out, Shielded(nonce, tuple(originals))
