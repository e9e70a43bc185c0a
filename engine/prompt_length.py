"""Rejecting a prompt that cannot fit the context without tokenizing all of it.

The Rust tokenizer holds the GIL for the whole of one call (measured: 2 MiB of text, 2.1 s during
which no other Python thread ran, so no step and no event loop either). A prompt far longer than
the context would stall every request for as long as it takes to tokenize. So a long text is first
counted in pieces of `_PIECE_CHARS` characters, cut at whitespace, which lets other threads run
between pieces, and the count stops as soon as it is surely over the limit: rejecting costs about
`limit` tokens of work whatever the prompt's size. Only a text that may fit is then tokenized in
one call, and its cost is bounded by the context length.

Cutting text at whitespace leaves byte-level BPE tokens as they are, except around the cut; each
cut is allowed `_SLACK_PER_CUT` tokens of difference before a prompt is called too long.
"""

from __future__ import annotations

from typing import Any

_PIECE_CHARS = 16 * 1024  # ~15 ms of tokenizing per piece
_SLACK_PER_CUT = 4


def tokens_at_least(tokenizer: Any, text: str, limit: int) -> int | None:
    """A lower bound on the token count of `text` when it surely exceeds `limit`, else None."""
    if len(text) <= _PIECE_CHARS:
        return None  # one cheap call does it
    counted = 0
    cuts = 0
    start = 0
    while start < len(text):
        end = min(start + _PIECE_CHARS, len(text))
        if end < len(text):
            space = text.rfind(" ", start + _PIECE_CHARS // 2, end)
            end = space if space > start else end
        counted += len(tokenizer(text[start:end], add_special_tokens=False).input_ids)
        cuts += 1
        start = end
        bound = counted - _SLACK_PER_CUT * cuts
        if bound > limit:
            return bound
    return None
