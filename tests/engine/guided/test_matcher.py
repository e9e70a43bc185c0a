"""GuidedMatcher over a real tokenizer: masked decoding yields valid output, and states rebuild exactly."""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import pytest
import torch

from engine.guided import (
    BitmaskFiller,
    CompiledGrammar,
    GuidedCompiler,
    GuidedMatcher,
    GuidedSpec,
    allocate_bitmask,
    apply_token_bitmask,
)

# every string, array and number bounded, so a walk over random logits must end
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "status": {"enum": ["active", "inactive", "banned"]},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 6},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "orders": {
            "type": "array",
            "maxItems": 3,
            "items": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 1, "maximum": 999},
                    "paid": {"type": "boolean"},
                },
                "required": ["id", "paid"],
                "additionalProperties": False,
            },
        },
    },
    "required": ["name", "age", "status", "address", "orders"],
    "additionalProperties": False,
}
VALID = {
    "name": "Ada",
    "age": 36,
    "status": "active",
    "address": {"city": "London", "zip": "01234"},
    "orders": [],
}


def _decode(compiled: CompiledGrammar, seed: int, max_tokens: int = 300) -> tuple[list[int], GuidedMatcher]:
    """Greedy over random logits under the mask, as the sampler will run it; stops at a stop token."""
    matcher = compiled.matcher()
    gen = torch.Generator().manual_seed(seed)
    bitmask = allocate_bitmask(1, compiled.vocab_size)
    out: list[int] = []
    for _ in range(max_tokens):
        if matcher.is_terminated():
            break
        matcher.fill_bitmask(bitmask, 0)
        logits = torch.randn(1, compiled.vocab_size, generator=gen)
        apply_token_bitmask(logits, bitmask)
        token = int(logits.argmax())
        assert matcher.accept_token(token)
        out.append(token)
    assert matcher.is_terminated(), "the walk must end inside max_tokens"
    return out, matcher


def _text(tokenizer: Any, tokens: list[int]) -> str:
    return str(tokenizer.decode([t for t in tokens if t != tokenizer.eos_token_id]))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_masked_greedy_decoding_over_random_logits_gives_json_valid_for_the_schema(
    compiler: GuidedCompiler, hf_tokenizer: Any, seed: int
) -> None:
    compiled = compiler.compile(GuidedSpec.json_schema(SCHEMA, any_whitespace=False))
    tokens, _ = _decode(compiled, seed)
    jsonschema.validate(json.loads(_text(hf_tokenizer, tokens)), SCHEMA)


@pytest.mark.parametrize("seed", [0, 1])
def test_choice_and_regex_constraints_hold(compiler: GuidedCompiler, hf_tokenizer: Any, seed: int) -> None:
    choices = ["positive", "negative", "mixed feelings"]
    tokens, _ = _decode(compiler.compile(GuidedSpec.choice(choices)), seed)
    assert _text(hf_tokenizer, tokens) in choices
    pattern = r"[a-z]{3,8}@[a-z]{2,5}\.(com|org)"
    tokens, _ = _decode(compiler.compile(GuidedSpec.regex(pattern)), seed)
    assert re.fullmatch(pattern, _text(hf_tokenizer, tokens))


def test_json_object_allows_any_object_and_nothing_else(compiler: GuidedCompiler, hf_tokenizer: Any) -> None:
    compiled = compiler.compile(GuidedSpec.json_object())
    matcher = compiled.matcher()
    for token in hf_tokenizer.encode('{"a": [1, 2.5, null], "b": {"c": "d"}}', add_special_tokens=False):
        assert matcher.accept_token(token)
    assert matcher.is_accepting()
    assert not compiled.matcher().accept_token(hf_tokenizer.encode("[", add_special_tokens=False)[0])


def test_masking_leaves_exactly_the_tokens_the_matcher_accepts(
    compiler: GuidedCompiler, hf_tokenizer: Any
) -> None:
    compiled = compiler.compile(GuidedSpec.json_schema(SCHEMA, any_whitespace=False))
    matcher = compiled.matcher()
    prefix = hf_tokenizer.encode('{"name":"Ada","age":3', add_special_tokens=False)
    assert all(matcher.accept_token(t) for t in prefix)
    bitmask = allocate_bitmask(1, compiled.vocab_size)
    matcher.fill_bitmask(bitmask, 0)
    logits = torch.zeros(1, compiled.vocab_size)
    apply_token_bitmask(logits, bitmask)
    finite = set(torch.isfinite(logits[0]).nonzero().flatten().tolist())
    assert finite == set(matcher.allowed_tokens())
    assert max(finite) < len(hf_tokenizer)  # the padded ids past the vocabulary never are
    digit, quote = (hf_tokenizer.encode(s, add_special_tokens=False)[0] for s in ("7", '"'))
    assert digit in finite and quote not in finite  # "age":37 may go on; a string may not start
    probe = compiled.matcher()
    assert all(probe.accept_token(t) for t in prefix)
    assert not probe.accept_token(quote)  # refused, and the state is as it was:
    assert probe.num_tokens == len(prefix) and probe.accept_token(digit)


def test_rebuilding_from_tokens_gives_the_state_reached_step_by_step(
    compiler: GuidedCompiler, hf_tokenizer: Any
) -> None:
    compiled = compiler.compile(GuidedSpec.json_schema(SCHEMA, any_whitespace=False))
    tokens = hf_tokenizer.encode(json.dumps(VALID, separators=(",", ":")), add_special_tokens=False)
    stepwise = compiled.matcher()
    rebuilt = compiled.matcher()
    for cut in range(0, len(tokens) + 1, 5):
        while stepwise.num_tokens < cut:
            assert stepwise.accept_token(tokens[stepwise.num_tokens])
        assert rebuilt.rebuild(tokens[:cut])
        assert rebuilt.allowed_tokens() == stepwise.allowed_tokens()
        assert rebuilt.is_accepting() == stepwise.is_accepting()
    assert rebuilt.rebuild(tokens) and rebuilt.is_accepting()
    assert rebuilt.allowed_tokens() == [hf_tokenizer.eos_token_id]
    assert rebuilt.accept_token(hf_tokenizer.eos_token_id) and rebuilt.is_terminated()
    brace = hf_tokenizer.encode("}", add_special_tokens=False)[0]
    assert not rebuilt.rebuild([tokens[0], brace, tokens[1]])  # '{"' then '}': no such key
    one = compiled.matcher()
    assert one.accept_token(tokens[0])
    assert rebuilt.num_tokens == 1 and rebuilt.allowed_tokens() == one.allowed_tokens()


def test_n_sequences_of_one_request_hold_independent_states(compiler: GuidedCompiler) -> None:
    compiled = compiler.compile(GuidedSpec.json_schema(SCHEMA, any_whitespace=False))
    first, _ = _decode(compiled, seed=10)
    second, _ = _decode(compiled, seed=11)
    assert first != second
    again, _ = _decode(compiled, seed=10)
    assert again == first  # seeded sampling repeats exactly: the state depends on the tokens only


def test_the_batch_fill_writes_the_rows_the_per_sequence_fill_writes(
    compiler: GuidedCompiler, hf_tokenizer: Any
) -> None:
    compiled = compiler.compile(GuidedSpec.json_schema(SCHEMA, any_whitespace=False))
    tokens = hf_tokenizer.encode(json.dumps(VALID, separators=(",", ":")), add_special_tokens=False)
    matchers = [compiled.matcher() for _ in range(6)]
    for i, m in enumerate(matchers):
        assert m.rebuild(tokens[: i * 4])
    by_row = allocate_bitmask(len(matchers), compiled.vocab_size)
    for i, m in enumerate(matchers):
        m.fill_bitmask(by_row, i)
    batched = allocate_bitmask(len(matchers), compiled.vocab_size)
    BitmaskFiller(threads=2).fill(matchers, batched)
    assert torch.equal(batched, by_row)


def test_a_structural_tag_constrains_only_the_tool_call(compiler: GuidedCompiler, hf_tokenizer: Any) -> None:
    weather = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    tag = {
        "structures": [
            {
                "begin": '<tool_call>{"name":"get_weather","arguments":',
                "schema": weather,
                "end": "}</tool_call>",
            }
        ],
        "triggers": ["<tool_call>"],
    }
    compiled = compiler.compile(GuidedSpec.structural_tag(tag))

    def accepts(text: str) -> bool:
        matcher = compiled.matcher()
        return all(matcher.accept_token(t) for t in hf_tokenizer.encode(text, add_special_tokens=False))

    call = '<tool_call>{"name":"get_weather","arguments":{"city":"Paris"}}</tool_call>'
    assert accepts("Let me check. " + call)
    assert accepts("No tool needed here.")
    assert not accepts(call.replace('"city"', '"town"'))
