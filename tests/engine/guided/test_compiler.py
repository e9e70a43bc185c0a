"""GuidedCompiler: compiles off the caller's thread, once per constraint, and refuses with the reason."""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any

import pytest

from engine.guided import CompiledGrammar, GuidedCompiler, GuidedDecodingError, GuidedSpec

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
