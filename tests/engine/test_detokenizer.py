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


def test_a_stop_string_the_final_flush_completes_is_cut_and_reported(tokenizer: Any) -> None:
    """A last incomplete character flushes as U+FFFD at the end; a stop string it completes cuts the
    text as any other and is returned, so that the sequence ends "stop" on it (it used to keep
    "length" with the text cut)."""
    ids = tokenizer("Japanese: 日本語は", add_special_tokens=False).input_ids
    cut = next(k for k in range(len(ids), 0, -1) if tokenizer.decode(ids[:k]).endswith("\ufffd"))
    whole = tokenizer.decode(ids[:cut])
    for stops, expected in ((["\ufffd"], "\ufffd"), ([whole[-2:]], whole[-2:]), (["zz"], None)):
        detok = IncrementalDetokenizer(lambda t: tokenizer.decode(t), [], stops)
        pieces = []
        for token in ids[:cut]:
            assert detok.add_token(token) is None
            pieces.append(detok.take())
        assert detok.flush() == expected
        pieces.append(detok.take(final=True))
        text = "".join(pieces)
        assert text == (whole if expected is None else whole[: whole.index(expected)])
    detok = IncrementalDetokenizer(lambda t: tokenizer.decode(t), [], ["\ufffd"])
    for token in ids[:cut]:
        detok.add_token(token, check_stop=False)
    assert detok.flush(check_stop=False) is None  # before min_tokens: no stop string counts


def test_include_stop_keeps_the_stop_string_at_the_end_of_the_text(tokenizer: Any) -> None:
    """vLLM's include_stop_str_in_output: cut after the stop string, not before it."""
    assert _until_stop(tokenizer, include_stop=True) == ("y-tw", "The answer is forty-tw")
