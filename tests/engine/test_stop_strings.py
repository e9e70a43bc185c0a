"""StopStringMatcher: the same answers as a plain search, at a cost per new character."""

from __future__ import annotations

import random
import time

from engine.detokenizer import IncrementalDetokenizer
from engine.stop_strings import StopStringMatcher


def _naive_first_end(text: str, stops: list[str]) -> tuple[int, str] | None:
    """The stop string that completes first (longest on a tie), by brute force."""
    for end in range(1, len(text) + 1):
        hits = [s for s in stops if text[:end].endswith(s)]
        if hits:
            best = max(hits, key=len)
            return end - len(best), best
    return None


def test_matches_like_a_brute_force_search_across_chunk_boundaries() -> None:
    rng = random.Random(0)
    for _ in range(300):
        stops = [
            "".join(rng.choice("ab") for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))
        ]
        text = "".join(rng.choice("abc") for _ in range(rng.randint(0, 30)))
        matcher = StopStringMatcher(stops)
        found, fed = None, 0
        while fed < len(text) and found is None:
            step = rng.randint(1, 4)
            hit = matcher.feed(text[fed : fed + step])
            found = None if hit is None else (fed + hit[0], hit[1])
            fed += step
        assert found == _naive_first_end(text, stops), (text, stops)


def test_held_is_the_longest_suffix_that_may_still_become_a_stop() -> None:
    matcher = StopStringMatcher(["END", "ENOUGH"])
    assert matcher.feed("the EN") is None
    assert matcher.held == 2
    assert matcher.feed("O") is None and matcher.held == 3
    assert matcher.feed("x") is None and matcher.held == 0


def test_a_match_before_min_tokens_is_passed_over() -> None:
    matcher = StopStringMatcher(["ab"])
    assert matcher.feed("ab", report=False) is None
    assert matcher.feed("xab") == (1, "ab")


def test_cost_per_token_does_not_grow_with_text_or_stop_length() -> None:
    stops = [f"{i:02d}" + "y" * 254 for i in range(16)]  # 16 stops of 256 characters: the caps
    detok = IncrementalDetokenizer(lambda ids: "".join("y" if t else "z" for t in ids), [], stops)
    start = time.perf_counter()
    for i in range(4000):  # 4000 tokens, each may extend a partial match of every stop
        detok.add_token(i % 7)
        detok.take()  # called every step for streaming
    elapsed = time.perf_counter() - start
    assert detok.stopped_on is None
    assert elapsed < 1.5, elapsed  # before: every step re-tested each stop's every prefix (~4 s)
