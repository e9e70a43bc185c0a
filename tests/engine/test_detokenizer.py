"""Incremental detokenization: multi-byte characters, stop strings across token boundaries."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from engine.detokenizer import IncrementalDetokenizer
from engine.tokenizer import load_tokenizer

TEXTS = [
    "Hello, world! Ça va? Größe: 10 µm — naïve café.",
    "日本語のテキストと絵文字 🤖🎨✨ mixed with English 👩‍👩‍👧.",
    "def f(x):\n    return x ** 2  # ünïcödé\n\n\tTabs too",
]


@pytest.fixture(scope="module")
def tokenizer(default_model_dir: Path) -> Any:
    return load_tokenizer(default_model_dir)


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_text_equals_full_decode_and_never_shows_partial_characters(
    tokenizer: Any, text: str
) -> None:
    prompt = tokenizer("Prompt:").input_ids
    ids = tokenizer(text, add_special_tokens=False).input_ids
    detok = IncrementalDetokenizer(lambda t: tokenizer.decode(t, skip_special_tokens=True), prompt, [])
    pieces = []
    for token in ids:
        detok.add_token(token)
        pieces.append(detok.take())
        assert "\ufffd" not in pieces[-1]
    detok.flush()
    pieces.append(detok.take(final=True))
    assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=True)


def _until_stop(tokenizer: Any, include_stop: bool = False) -> tuple[str | None, str]:
    """(the stop string hit, the text handed out) for a sentence whose "forty-two" spans tokens."""
    ids = tokenizer("The answer is forty-two, obviously.", add_special_tokens=False).input_ids
    detok = IncrementalDetokenizer(lambda t: tokenizer.decode(t), [], ["y-tw", "never"], include_stop)
    hit = None
    pieces = []
    for token in ids:
        hit = detok.add_token(token)
        pieces.append(detok.take())
        if hit:
            break
    pieces.append(detok.take(final=True))
    return hit, "".join(pieces)


def test_stop_string_spanning_tokens_truncates_text(tokenizer: Any) -> None:
    assert _until_stop(tokenizer) == ("y-tw", "The answer is fort")


def test_partial_stop_string_is_held_back_for_streaming(tokenizer: Any) -> None:
    detok = IncrementalDetokenizer(lambda t: tokenizer.decode(t), [], ["END"])
    pieces = []
    for token in tokenizer("abc EN", add_special_tokens=False).input_ids:
        detok.add_token(token)
        pieces.append(detok.take())
    assert "".join(pieces) == "abc "
    assert detok.take(final=True) == "EN"


def test_held_back_text_that_turns_out_no_stop_string_is_sent_later(tokenizer: Any) -> None:
    detok = IncrementalDetokenizer(lambda t: tokenizer.decode(t), [], ["END"])
    pieces = []
    for token in tokenizer("abc EN and more", add_special_tokens=False).input_ids:
        assert detok.add_token(token) is None
        pieces.append(detok.take())
    assert "".join(pieces) == "abc EN and more"


# byte-level tokens of our own: a token may end one character and begin the next (2: "c" and the
# first byte of "日")
_BYTES = {1: b"ab", 2: b"c\xe6", 3: b"\x97", 4: b"\xa5", 5: b"\x80"}


def _bytes_decode(ids: list[int]) -> str:
    return b"".join(_BYTES[i] for i in ids).decode("utf-8", errors="replace")


def test_the_final_flush_sends_whole_characters_only_and_cuts_a_stop_string_they_complete() -> None:
    """Text that waited on a character's next bytes is sent at the end without that character
    (vLLM never sends one incomplete: it was U+FFFD, and a stop string "\ufffd" turned a `length`
    into a `stop`); a stop string the rest completes cuts the text as any other and is returned, so
    that the sequence ends "stop" on it."""
    for stops, expected, text in ((["\ufffd"], None, "abc"), (["bc"], "bc", "a"), (["zz"], None, "abc")):
        detok = IncrementalDetokenizer(_bytes_decode, [], stops)
        assert detok.add_token(1) is None
        assert detok.add_token(2) is None and detok.add_token(3) is None  # "c" waits with the 日 begun
        pieces = [detok.take()]
        assert detok.flush() == expected
        pieces.append(detok.take(final=True))
        assert "".join(pieces) == text
    detok = IncrementalDetokenizer(_bytes_decode, [], ["bc"])
    for token in (1, 2, 3):
        detok.add_token(token, check_stop=False)
    assert detok.flush(check_stop=False) is None  # before min_tokens: no stop string counts


def test_a_prompt_that_ends_inside_a_character_leaves_it_to_the_output(tokenizer: Any) -> None:
    """A prompt of token ids cut mid-emoji (an output cut off, continued): the first output token
    completes the emoji, which is the output's (it was lost, taken for prompt text)."""
    ids = tokenizer("Emoji party: 😀🎉🍕🍕").input_ids
    detok = IncrementalDetokenizer(lambda t: tokenizer.decode(t), ids[:-1], [])
    detok.add_token(ids[-1])
    assert detok.take() == "🍕"
    garbage = IncrementalDetokenizer(_bytes_decode, [1, 3, 5, 5, 5], [])  # bytes that are no character
    garbage.add_token(1)
    assert garbage.take() == "ab"  # not taken for the output's


def test_include_stop_keeps_the_stop_string_at_the_end_of_the_text(tokenizer: Any) -> None:
    """vLLM's include_stop_str_in_output: cut after the stop string, not before it."""
    assert _until_stop(tokenizer, include_stop=True) == ("y-tw", "The answer is forty-tw")
