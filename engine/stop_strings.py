"""StopStringMatcher: finds stop strings in text that grows at its end, in time per new character.

One Knuth-Morris-Pratt automaton per stop string: its state is the length of the longest suffix of
the text that is a prefix of that stop string. A new character costs O(1) amortized per stop
string, whatever the length of the text so far; the held-back length for streaming (a suffix that
may still become a stop string) is the largest state. The number and length of stop strings are
capped at admission (EngineConfig.max_stop_strings, max_stop_string_len).
"""

from __future__ import annotations


def _failure(pattern: str) -> list[int]:
    """KMP failure function: fail[i] = length of the longest proper border of pattern[: i + 1]."""
    fail = [0] * len(pattern)
    k = 0
    for i in range(1, len(pattern)):
        while k and pattern[i] != pattern[k]:
            k = fail[k - 1]
        if pattern[i] == pattern[k]:
            k += 1
        fail[i] = k
    return fail


class StopStringMatcher:
    """Feeds text chunk by chunk; reports the first stop string that completes."""

    def __init__(self, stop_strings: list[str]) -> None:
        assert all(stop_strings), "stop strings are non-empty"
        self.stop_strings = list(stop_strings)
        self._fail = [_failure(s) for s in self.stop_strings]
        self._state = [0] * len(self.stop_strings)  # matched prefix length per stop string, < its length

    def feed(self, text: str, report: bool = True) -> tuple[int, str] | None:
        """Advance over `text`; return (index in `text` where the match starts, stop string) for the
        first stop string that completes, the longest when several complete at the same character.

        With `report=False` (before min_tokens) matches are passed over. After a reported match the
        matcher must not be fed again.
        """
        for pos, ch in enumerate(text):
            hit: str | None = None
            for j, stop in enumerate(self.stop_strings):
                k = self._state[j]
                fail = self._fail[j]
                while k and stop[k] != ch:
                    k = fail[k - 1]
                if stop[k] == ch:
                    k += 1
                if k == len(stop):
                    if report and (hit is None or len(stop) > len(hit)):
                        hit = stop
                    k = fail[k - 1]
                self._state[j] = k
            if hit is not None:
                return pos - len(hit) + 1, hit
        return None

    @property
    def held(self) -> int:
        """Characters at the end of the text fed so far that may still begin a stop string."""
        return max(self._state, default=0)
