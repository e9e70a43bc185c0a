"""Incremental detokenization with stop-string matching across token boundaries."""

from __future__ import annotations

from collections.abc import Callable

from engine.stop_strings import StopStringMatcher

# Decoding a short window of earlier tokens with the new ones lets byte-level BPE pieces and
# leading-space markers resolve exactly as a full decode would, at O(window) cost per token.
_CONTEXT_TOKENS = 5
_REPLACEMENT = "\ufffd"

DecodeFn = Callable[[list[int]], str]


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text, one token at a time, handed out by `take()`.

    Text is only emitted once it is complete: a token that ends inside a multi-byte UTF-8
    character yields nothing until the character's last byte arrives. Only the text not taken yet
    is kept, so a token costs O(its text), whatever the length of the output so far.
    """

    def __init__(
        self,
        decode: DecodeFn,
        prompt_token_ids: list[int],
        stop_strings: list[str],
        include_stop: bool = False,
    ) -> None:
        self._decode = decode
        self._ids: list[int] = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = _whole_characters(decode, self._ids)
        # stop strings are matched as text arrives: work per new character, not per text length
        self._stops = StopStringMatcher(stop_strings) if stop_strings else None
        self._pending = ""  # decoded text not taken yet (stop strings already cut off)
        self._include_stop = include_stop  # vLLM's include_stop_str_in_output: cut after it, not before
        self.stopped_on: str | None = None

    def add_token(self, token_id: int, check_stop: bool = True) -> str | None:
        """Append one token; returns the stop string if the text now contains one.

        With `check_stop=False` (before min_tokens) stop strings are not looked for.
        """
        assert self.stopped_on is None, "no tokens may follow a stop string"
        self._ids.append(token_id)
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT):
            return None  # incomplete character (or a token with no text): wait for more
        return self._append(new_text[len(prefix_text) :], check_stop)

    def flush(self, check_stop: bool = True) -> str | None:
        """Emit whatever is pending but an incomplete character at the very end (never sent, as
        vLLM: it was U+FFFD); returns the stop string that text completes, if any (it is cut off, as
        any stop string: the caller reports the sequence stopped on it, not on its length)."""
        if self.stopped_on is not None or self._read_offset >= len(self._ids):
            return None
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :]).rstrip(_REPLACEMENT)
        if len(new_text) > len(prefix_text):
            return self._append(new_text[len(prefix_text) :], check_stop)
        return None

    def _append(self, delta: str, check_stop: bool = True) -> str | None:
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        before = len(self._pending)
        self._pending += delta
        if self._stops is None:
            return None
        match = self._stops.feed(delta, report=check_stop)
        if match is None:
            return None
        start, stop = match
        # the match began at most `held` characters before `delta`: text `take()` kept back
        cut = before + start
        assert cut >= 0, "a stop string began in text already taken"
        self._pending = self._pending[: cut + len(stop) if self._include_stop else cut]
        self.stopped_on = stop
        return stop

    def take(self, final: bool = False) -> str:
        """The text no later token can change, since the last call (all of it when `final`).

        A suffix that may be the start of a stop string is held back until it is decided.
        """
        pending = self._pending
        held = 0 if final or self.stopped_on is not None or self._stops is None else self._stops.held
        if held == 0:
            self._pending = ""
            return pending
        self._pending = pending[len(pending) - held :]
        return pending[: len(pending) - held]


def _whole_characters(decode: DecodeFn, window: list[int]) -> int:
    """Where the prompt's last whole character ends in its last tokens: a prompt of token ids may
    end inside a character (an output cut mid-emoji, continued), whose remaining bytes the first
    output tokens bring; that character is the output's (as vLLM), not lost as prompt text. At most
    three tokens back (a character has at most four bytes); a window with no such place (bytes
    that never make a character) is left as it is."""
    whole = len(window)
    for back in range(min(3, len(window)) + 1):
        if not decode(window[: whole - back]).endswith(_REPLACEMENT):
            return whole - back
    return whole
