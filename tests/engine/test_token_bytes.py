"""Logprob tokens that hold part of a character keep their own bytes (OpenAI's `bytes`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from engine.http.openai_format import chat_logprobs, completion_logprobs
from engine.outputs import CompletionOutput
from engine.sequence import Logprob
from engine.token_bytes import TokenBytes, escaped
from engine.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def tokenizer(default_model_dir: Path) -> Any:
    return load_tokenizer(default_model_dir)


def test_the_pieces_of_an_emoji_give_back_its_bytes(tokenizer: Any) -> None:
    text = "🐱 日本 plain"
    ids = tokenizer(text, add_special_tokens=False).input_ids
    token_bytes = TokenBytes(tokenizer)
    assert token_bytes.byte_level
    joined = b""
    partial = 0
    for token_id in ids:
        decoded = tokenizer.decode([token_id])
        raw = token_bytes.partial(token_id, decoded)
        partial += raw is not None
        joined += decoded.encode() if raw is None else raw
    assert partial >= 4 and joined.decode() == text


def test_sentencepiece_byte_tokens_and_unknown_spellings() -> None:
    class Piece:
        def convert_ids_to_tokens(self, token_id: int) -> str:
            return {1: "<0xF0>", 2: "▁\ufffd"}[token_id]

    token_bytes = TokenBytes(Piece())
    assert not token_bytes.byte_level
    assert token_bytes.partial(1, "\ufffd") == b"\xf0"
    assert token_bytes.partial(2, "\ufffd") is None  # not a byte spelling: the text stands
    assert token_bytes.partial(1, "whole") is None


def _output(entries: list[dict[int, Logprob]], ids: list[int]) -> CompletionOutput:
    return CompletionOutput(0, "", ids, None, logprobs=entries)


def test_chat_logprobs_write_a_partial_token_as_escaped_bytes() -> None:
    entry = {7: Logprob(-0.5, 1, "\ufffd", b"\xf0\x9f"), 8: Logprob(-1.5, 2, "a")}
    content = chat_logprobs(_output([entry], [7]), 2)["content"]
    assert content[0]["token"] == "\\xf0\\x9f" == escaped(b"\xf0\x9f") and content[0]["bytes"] == [0xF0, 0x9F]
    assert [t["bytes"] for t in content[0]["top_logprobs"]] == [[0xF0, 0x9F], [ord("a")]]


def test_legacy_logprobs_list_the_sampled_token_among_the_top_ones() -> None:
    entries = [
        {9: Logprob(-3.0, 5, " where"), 1: Logprob(-1.0, 1, " of"), 2: Logprob(-1.5, 2, ",")},
        {7: Logprob(-0.1, 1, "\ufffd", b"\xe6\x97")},
    ]
    lp = completion_logprobs(_output(entries, [9, 7]), 10, 2)
    assert lp["tokens"] == [" where", "bytes:\\xe6\\x97"]
    assert lp["top_logprobs"][0] == {" of": -1.0, ",": -1.5, " where": -3.0}  # k + 1
    assert lp["top_logprobs"][1] == {"bytes:\\xe6\\x97": -0.1}
    assert lp["text_offset"] == [10, 16]
    none_asked = completion_logprobs(_output(entries[:1], [9]), 0, 0)
    assert none_asked["top_logprobs"] == [{" where": -3.0}]
