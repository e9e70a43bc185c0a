"""GuidedCompiler: compiles off the caller's thread, once per constraint, and refuses with the reason."""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any

import pytest
import torch
from llguidance import LLMatcher, LLParserLimits

from engine.guided import CompiledGrammar, GuidedCompiler, GuidedDecodingError, GuidedSpec
from engine.guided.bitmask import bitmask_width

SCHEMA = {"type": "object", "properties": {"id": {"type": "integer"}}, "required": ["id"]}


def test_the_same_constraint_compiles_once_and_is_then_served_from_the_cache(
    compiler: GuidedCompiler,
) -> None:
    spec = GuidedSpec.json_schema({**SCHEMA, "title": "cache-hit"})
    hits, misses = compiler.hits, compiler.misses
    first = compiler.compile(spec)
    as_text = json.dumps({**SCHEMA, "title": "cache-hit"}, indent=1)
    again = compiler.compile(GuidedSpec.json_schema(as_text, param="structured_outputs.json"))
    assert again is first and isinstance(first, CompiledGrammar)
    assert (compiler.hits - hits, compiler.misses - misses) == (1, 1)
    assert compiler.cached(spec)


def test_compiles_run_on_the_pool_not_on_the_callers_thread(
    compiler: GuidedCompiler, lltokenizer: Any
) -> None:
    seen: list[str] = []

    class Recording(GuidedCompiler):
        def _compile(self, spec: GuidedSpec) -> CompiledGrammar:
            seen.append(threading.current_thread().name)
            return super()._compile(spec)

    recording = Recording(lltokenizer, compiler.vocab_size, [0])
    try:
        recording.compile(GuidedSpec.regex("[0-9]+"))
        asyncio.run(recording.compile_async(GuidedSpec.choice(["a", "b"])))
    finally:
        recording.close()
    assert len(seen) == 2 and all(name.startswith("guided-compile") for name in seen)


def test_the_cache_is_bounded_in_entries_and_drops_the_least_recently_used(
    compiler: GuidedCompiler, lltokenizer: Any
) -> None:
    small = GuidedCompiler(lltokenizer, compiler.vocab_size, [0], max_entries=2)
    try:
        a, b, c = (GuidedSpec.choice([word]) for word in ("a", "b", "c"))
        small.compile(a)
        small.compile(b)
        small.compile(a)  # a is now the most recent
        small.compile(c)
        assert small.cached(a) and small.cached(c) and not small.cached(b)
    finally:
        small.close()


def test_async_compile_shares_one_compile_between_concurrent_requests(compiler: GuidedCompiler) -> None:
    spec = GuidedSpec.regex("[a-f]{4}-async")

    async def both() -> tuple[CompiledGrammar, CompiledGrammar]:
        return await asyncio.gather(compiler.compile_async(spec), compiler.compile_async(spec))

    misses = compiler.misses
    first, second = asyncio.run(both())
    assert first is second and compiler.misses == misses + 1


@pytest.mark.parametrize(
    ("schema", "reason"),
    [
        ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems"),
        ({"type": "strnig"}, "strnig"),
        ({"type": "integer", "minimum": 5, "maximum": 1}, "minimum"),
        ({"$ref": "#/$defs/missing"}, "missing"),
    ],
)
def test_a_schema_the_library_cannot_compile_is_a_400_that_says_why(
    compiler: GuidedCompiler, schema: dict[str, Any], reason: str
) -> None:
    with pytest.raises(GuidedDecodingError) as info:
        compiler.compile(GuidedSpec.json_schema(schema, param="response_format.json_schema.schema"))
    exc = info.value
    assert (exc.status, exc.type, exc.code) == (400, "invalid_request_error", "invalid_json_schema")
    assert exc.param == "response_format.json_schema.schema"
    assert reason in str(exc) and "\n" not in str(exc) and len(str(exc)) < 500


@pytest.mark.parametrize(
    ("spec", "reason"),
    [
        (GuidedSpec.regex("a(b"), "unclosed group"),
        (GuidedSpec.grammar("start: foo"), "foo"),
        (GuidedSpec.grammar("root ::= ("), "Expected"),
    ],
)
def test_a_regex_or_grammar_the_library_cannot_compile_is_a_400_that_says_why(
    compiler: GuidedCompiler, spec: GuidedSpec, reason: str
) -> None:
    with pytest.raises(GuidedDecodingError) as info:
        compiler.compile(spec)
    assert info.value.code == "invalid_grammar" and reason in str(info.value)
    assert info.value.param == spec.param
    assert str(info.value).count("cannot be used for guided decoding") == 1  # said once, not nested


def test_a_cached_refusal_names_the_field_of_the_request_that_asked(compiler: GuidedCompiler) -> None:
    bad = {"not": {"type": "string"}}
    with pytest.raises(GuidedDecodingError):
        compiler.compile(GuidedSpec.json_schema(bad, param="response_format.json_schema.schema"))
    with pytest.raises(GuidedDecodingError) as info:
        asyncio.run(compiler.compile_async(GuidedSpec.json_schema(bad, param="structured_outputs.json")))
    assert info.value.param == "structured_outputs.json" and "not" in str(info.value)


def test_any_whitespace_is_bounded_between_two_json_tokens(
    compiler: GuidedCompiler, hf_tokenizer: Any
) -> None:
    compiled = compiler.compile(GuidedSpec.json_schema({**SCHEMA, "title": "ws"}))

    def accepts(text: str) -> bool:
        matcher = compiled.matcher()
        return all(matcher.accept_token(t) for t in hf_tokenizer.encode(text, add_special_tokens=False))

    assert accepts('{"id": 1}') and accepts('{\n    "id" :  1\n}') and accepts('{\r\n\r\n\t"id":1}')
    assert accepts("{" + " " * 16 + '"id":1}')
    assert not accepts("{" + " " * 17 + '"id":1}')  # a model cannot spend its tokens on blanks
    assert not accepts('{\n\n\n"id":1}')
    free = compiler.compile(GuidedSpec.json_schema({**SCHEMA, "title": "ws"}, whitespace_pattern=r"[ ]*"))
    matcher = free.matcher()
    assert all(matcher.accept_token(t) for t in hf_tokenizer.encode("{" + " " * 40, add_special_tokens=False))


@pytest.mark.parametrize(
    "spec",
    [
        GuidedSpec.json_schema({"$ref": "#"}),
        GuidedSpec.json_schema(
            {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}
        ),
        GuidedSpec.regex("[^\\s\\S]"),
        GuidedSpec.grammar("start: X\nX: /[a-z]+/ & /[0-9]+/\n"),
    ],
    ids=["ref self", "ref cycle", "empty class", "empty intersection"],
)
def test_a_constraint_no_output_can_satisfy_is_a_400_not_an_empty_answer(
    compiler: GuidedCompiler, spec: GuidedSpec
) -> None:
    """Such grammars build; their matcher fails at its first mask and then allows only EOS, which
    ended the request at once with an empty answer and finish_reason "stop"."""
    with pytest.raises(GuidedDecodingError, match="no output can satisfy it") as info:
        compiler.compile(spec)
    assert info.value.param == spec.param


def test_schemas_too_deep_or_too_large_to_read_are_400s_naming_the_field(compiler: GuidedCompiler) -> None:
    param = "structured_outputs.json"
    for text in ("[" * 3000 + "]" * 3000, '{"maxLength": ' + "9" * 5000 + "}"):
        with pytest.raises(GuidedDecodingError) as info:
            GuidedSpec.json_schema(text, param=param)
        assert info.value.param == param
    nested = "{" + '"properties":{"a":{' * 150 + "}}" * 150 + "}"  # Python reads it; the library refuses
    with pytest.raises(GuidedDecodingError, match="recursion") as info:
        compiler.compile(GuidedSpec.json_schema(nested, param=param))
    assert info.value.param == param
    with pytest.raises(GuidedDecodingError, match="x-guidance"):
        GuidedSpec.json_schema({"type": "array", "uniqueItems": True, "x-guidance": {"lenient": True}})


def test_a_compile_every_waiter_left_before_it_started_is_cancelled(
    compiler: GuidedCompiler, lltokenizer: Any
) -> None:
    """One worker: a slow compile runs; the abandoned ones queued behind it never run and leave the
    cache; a compile that another request still waits on goes on."""
    release, ran = threading.Event(), []

    class Slow(GuidedCompiler):
        def _compile(self, spec: GuidedSpec) -> CompiledGrammar:
            ran.append(spec.text)
            if spec.text == "slow":
                release.wait(10)
            return super()._compile(spec)

    slow = Slow(lltokenizer, compiler.vocab_size, [0])
    abandoned, shared = GuidedSpec.regex("abandoned"), GuidedSpec.regex("shared")

    async def scenario() -> CompiledGrammar:
        running = asyncio.ensure_future(slow.compile_async(GuidedSpec.regex("slow")))
        left = asyncio.ensure_future(slow.compile_async(abandoned))
        first, second = (asyncio.ensure_future(slow.compile_async(shared)) for _ in range(2))
        await asyncio.sleep(0.05)
        left.cancel()
        first.cancel()
        await asyncio.sleep(0.05)
        release.set()
        await running
        return await second

    try:
        assert isinstance(asyncio.run(scenario()), CompiledGrammar)
        assert ran == ["slow", "shared"] and not slow.cached(abandoned) and slow.cached(shared)
        assert isinstance(slow.compile(abandoned), CompiledGrammar)  # asked again: compiled then
    finally:
        release.set()
        slow.close()


def test_a_matcher_that_meets_a_parser_limit_fails_and_never_ends_as_a_whole_output(
    compiler: GuidedCompiler, hf_tokenizer: Any, lltokenizer: Any
) -> None:
    """Past a lexer limit llguidance's mask allows only EOS and the matcher says it is stopped: the
    sequence must fail (a 400 or an error event), not finish with the text so far."""
    spec = GuidedSpec.json_schema(
        {"type": "object", "properties": {"a": {"type": "string", "pattern": "^[a-z]{3,40}q$"}}}
    )
    tight = LLParserLimits(step_lexer_fuel=100, verbose_errors=False)
    template = LLMatcher(
        lltokenizer, LLMatcher.grammar_from_json_schema(spec.text), log_level=0, limits=tight
    )
    matcher = CompiledGrammar(spec, template, compiler.vocab_size).matcher()
    bitmask = torch.zeros((1, bitmask_width(compiler.vocab_size)), dtype=torch.int32)
    for token in hf_tokenizer.encode('{"a": "abc', add_special_tokens=False):
        matcher.fill_bitmask(bitmask, 0)
        if not matcher.accept_token(token):
            break
    else:
        pytest.fail("the tight limit was never met")
    matcher.fill_bitmask(bitmask, 0)
    assert not matcher.accept_token(hf_tokenizer.eos_token_id)  # the one token its mask allows
    assert "too complex" in str(matcher.failure()) and "too many" in str(matcher.failure())
