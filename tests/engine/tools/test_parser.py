"""Calls read back out of answers: whole, and streamed in pieces of any size, agree exactly."""

from __future__ import annotations

import json
import random

from engine.tools.grammar import call_text
from engine.tools.parser import StreamedCalls, parse_calls

WEATHER_ARGS = '{"city": "Pa\\"ris {x}", "days": [1, {"n": 2}]}'
ANSWER = "Checking both.\n" + call_text("get_weather", WEATHER_ARGS) + "\n" + call_text("add", '{"a": 1}')


def test_a_whole_answer_gives_its_text_and_each_call_with_an_openai_id() -> None:
    content, calls = parse_calls(ANSWER)
    assert content == "Checking both.\n"
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": 'Pa"ris {x}', "days": [1, {"n": 2}]}),
        ("add", {"a": 1}),
    ]
    assert all(c.id.startswith("call_") and len(c.id) == 29 for c in calls)
    assert len({c.id for c in calls}) == 2
    assert calls[0].as_openai()["type"] == "function"


def test_only_calls_means_no_content_and_no_calls_means_all_content() -> None:
    assert parse_calls(call_text("add", "{}"))[0] is None
    assert parse_calls("plain <tool_ text") == ("plain <tool_ text", [])


def test_a_call_cut_short_is_a_call_with_its_arguments_so_far_and_no_markup_in_the_content() -> None:
    cut = ANSWER[: ANSWER.rindex('{"a"') + 3]
    content, calls = parse_calls(cut)
    assert [(c.name, c.arguments) for c in calls[:1]] == [("get_weather", WEATHER_ARGS)]
    assert [(c.name, c.arguments) for c in calls[1:]] == [("add", '{"a')]
    assert content == "Checking both.\n"
    before_the_name = ANSWER[: ANSWER.rindex('"add"') + 2]
    content, calls = parse_calls(before_the_name)
    assert [c.name for c in calls] == ["get_weather"] and content == "Checking both.\n"


def test_an_answer_cut_anywhere_reads_the_same_whole_and_streamed() -> None:
    for end in range(len(ANSWER) + 1):
        cut = ANSWER[:end]
        content, calls = parse_calls(cut)
        assert streamed(cut, [1] * len(cut)) == (content or "", [(c.name, c.arguments) for c in calls]), end


def streamed(text: str, sizes: list[int]) -> tuple[str, list[tuple[str | None, str]]]:
    reader = StreamedCalls()
    content = ""
    calls: list[tuple[str | None, str]] = []
    pos = 0
    for size in sizes:
        text_piece, deltas = reader.feed(text[pos : pos + size])
        pos += size
        content += text_piece
        for d in deltas:
            if d.id is not None:
                assert d.index == len(calls)
                calls.append((d.name, d.arguments))
            else:
                name, args = calls[d.index]
                calls[d.index] = (name, args + d.arguments)
    return content + reader.finish(), calls


def test_streamed_pieces_of_any_size_give_what_the_whole_answer_gives() -> None:
    rng = random.Random(7)
    whole = parse_calls(ANSWER)
    expected = [(c.name, c.arguments) for c in whole[1]]
    for trial in range(200):
        sizes = [1] * len(ANSWER) if trial == 0 else [rng.randint(1, 12) for _ in range(len(ANSWER))]
        content, calls = streamed(ANSWER, sizes)
        assert content == whole[0]
        assert calls == expected


def test_text_that_only_looks_like_the_tag_is_released_when_it_turns_out_not_to_be() -> None:
    reader = StreamedCalls()
    assert reader.feed("a <tool") == ("a ", [])  # held back: it may be the tag
    assert reader.feed("box> b") == ("<toolbox> b", [])
    assert reader.feed(" <tool_c")[0] == " "
    assert reader.finish() == "<tool_c"  # the answer ended: what was held back is text


def test_an_answer_that_can_only_be_calls_has_no_content_even_cut_inside_its_tag() -> None:
    assert parse_calls("<tool_c") == ("<tool_c", [])  # auto: it may have been text
    assert parse_calls("<tool_c", calls_only=True) == (None, [])  # required / named: only a tag
    reader = StreamedCalls(calls_only=True)
    assert reader.feed("<tool_c") == ("", []) and reader.finish() == ""


def test_a_tag_spelled_inside_an_answer_is_text_whole_as_streamed() -> None:
    # was: a JSON answer beside tools (`answer | calls`) that spells the tag in a string was cut there,
    # whole ('{"t": "see '), while the stream gave it all
    json_answer = '{\n  "t": "see <tool_call> here",\n  "n": 1\n}'
    assert parse_calls(json_answer) == (json_answer, [])
    assert streamed(json_answer, [1] * len(json_answer)) == (json_answer, [])
    then_a_call = "note <tool_call> is the tag\n" + call_text("add", '{"a": 1}')
    content, calls = parse_calls(then_a_call)
    assert content == "note <tool_call> is the tag\n" and [c.name for c in calls] == ["add"]
    rng = random.Random(3)
    for end in range(len(then_a_call) + 1):  # and cut anywhere, both ways read it alike
        cut = then_a_call[:end]
        content, calls = parse_calls(cut)
        expected = (content or "", [(c.name, c.arguments) for c in calls])
        assert streamed(cut, [1] * len(cut)) == expected, end
        assert streamed(cut, [rng.randint(1, 40) for _ in cut]) == expected, end  # (the tag and the
        # call in one piece: the call was taken for text)
