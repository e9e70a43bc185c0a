"""Guided decoding through the offline engine (tiny random model with SmolLM2's tokenizer): every
constraint holds, n > 1, batch invariance, recompute preemption, grammar ends, masked logprobs."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from engine import LLM, SamplingParams, StructuredOutputsParams
from engine.guided import GuidedDecodingError, GuidedSpec
from engine.models.config import ModelConfig

# bounded everywhere, so that even random logits reach the end of the grammar
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3},
    },
    "required": ["name", "age", "role", "tags"],
    "additionalProperties": False,
}
PROMPTS = ["Describe a user.", "Who is on call tonight?", "Make up a person", "JSON please:"]


@pytest.fixture(scope="module")
def llm(tiny_chat_model: Path) -> LLM:
    return LLM(str(tiny_chat_model), kv_cache_memory=64 << 20)


def _json(seed: int, **options: Any) -> SamplingParams:
    so = StructuredOutputsParams(json=SCHEMA)
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=200, structured_outputs=so, **options)


def test_every_constraint_kind_holds_under_random_logits(llm: LLM) -> None:
    choices = ["positive", "negative", "mixed feelings"]
    pattern = r"[a-z]{3,8}@[a-z]{2,5}\.(com|org)"
    kinds = [
        StructuredOutputsParams(json=SCHEMA),
        StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True),
        StructuredOutputsParams(choice=choices),
        StructuredOutputsParams(regex=pattern),
        StructuredOutputsParams(grammar='root ::= "I feel " ("good" | "bad") "."'),
    ]
    params = [
        SamplingParams(temperature=1.0, seed=seed, max_tokens=200, structured_outputs=so)
        for so in kinds
        for seed in (1, 2)
    ]
    outs = llm.generate([PROMPTS[i % 4] for i in range(len(params))], params, use_tqdm=False)
    texts = [o.text for o in outs]
    assert all(o.finish_reason == "stop" for o in outs), [(o.finish_reason, o.text) for o in outs]
    for text in texts[:4]:
        jsonschema.validate(json.loads(text), SCHEMA)
    assert all(t.startswith('{"name":"') for t in texts[2:4])  # compact: no whitespace between tokens
    assert texts[4] in choices and texts[5] in choices
    assert re.fullmatch(pattern, texts[6]) and re.fullmatch(pattern, texts[7])
    assert texts[8] in ("I feel good.", "I feel bad.") and texts[9] in ("I feel good.", "I feel bad.")


def test_each_of_n_completions_holds_its_own_grammar_state(llm: LLM) -> None:
    out = llm.generate(["Describe a user."], _json(seed=7, n=4), use_tqdm=False)[0]
    assert len(out.outputs) == 4 and all(c.finish_reason == "stop" for c in out.outputs)
    values = [json.loads(c.text) for c in out.outputs]
    for value in values:
        jsonschema.validate(value, SCHEMA)
    assert len({json.dumps(v) for v in values}) > 1  # each sequence sampled its own path


def test_a_seeded_guided_request_is_the_same_whatever_else_is_in_the_batch(llm: LLM) -> None:
    params = _json(seed=11, logprobs=3)
    alone = llm.generate([PROMPTS[0]], params, use_tqdm=False)[0].outputs[0]
    free = SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True)
    other = SamplingParams(
        temperature=0.7, max_tokens=40, structured_outputs=StructuredOutputsParams(regex="[a-z ]{5,40}")
    )
    batch = llm.generate(
        ["noise " * 20, PROMPTS[1], PROMPTS[0], "x"], [free, other, params, free], use_tqdm=False
    )
    mixed = batch[2].outputs[0]
    assert mixed.token_ids == alone.token_ids and mixed.text == alone.text
    assert mixed.logprobs == alone.logprobs  # bit for bit: the mask is per row
    seeded_free = SamplingParams(max_tokens=30, ignore_eos=True, seed=5)
    free_alone = llm.generate(["noise " * 20], seeded_free, use_tqdm=False)[0]
    free_mixed = llm.generate(["noise " * 20, PROMPTS[2]], [seeded_free, params], use_tqdm=False)[0]
    assert free_alone.token_ids == free_mixed.token_ids  # guided rows leave the others untouched


def test_recompute_preemption_leaves_guided_outputs_exactly_as_without_it(
    llm: LLM, tiny_chat_model: Path
) -> None:
    cfg = ModelConfig.from_dir(tiny_chat_model)
    block_bytes = 2 * cfg.num_layers * 16 * cfg.num_kv_heads * cfg.head_dim * 4
    small = LLM(str(tiny_chat_model), kv_cache_memory=14 * block_bytes, max_num_batched_tokens=48)
    prompts = [f"{p} Please answer in JSON, request {i}." for i, p in enumerate(PROMPTS * 2)]
    params = [_json(seed=100 + i) for i in range(len(prompts))]
    roomy = llm.generate(prompts, params, use_tqdm=False)
    tight = small.generate(prompts, params, use_tqdm=False)
    assert small.engine.scheduler.num_preemptions > 0, "the small pool should have forced preemptions"
    assert [o.token_ids for o in tight] == [o.token_ids for o in roomy]
    for out in tight:
        jsonschema.validate(json.loads(out.text), SCHEMA)


def test_a_complete_grammar_ends_the_sequence_despite_ignore_eos_and_min_tokens(llm: LLM) -> None:
    params = SamplingParams(
        temperature=1.0,
        seed=3,
        max_tokens=50,
        ignore_eos=True,
        min_tokens=20,
        structured_outputs=StructuredOutputsParams(choice=["yes", "no"]),
    )
    out = llm.generate([PROMPTS[1]], params, use_tqdm=False)[0]
    assert out.text in ("yes", "no") and out.finish_reason == "stop"
    assert len(out.token_ids) <= 3  # ended with the grammar, no EOS needed


def test_logprobs_describe_the_distribution_the_grammar_leaves(llm: LLM) -> None:
    choices = ["yes", "no", "maybe"]
    params = SamplingParams(
        temperature=1.0,
        seed=4,
        max_tokens=10,
        logprobs=20,
        structured_outputs=StructuredOutputsParams(choice=choices),
    )
    out = llm.generate([PROMPTS[3]], params, use_tqdm=False)[0].outputs[0]
    tokenizer = llm.get_tokenizer()
    assert out.logprobs
    first = out.logprobs[0]
    # every listed token may start a choice, and together they hold all the probability
    assert all(any(c.startswith(tokenizer.decode([t])) for c in choices) for t in first)
    assert math.isclose(sum(math.exp(lp.logprob) for lp in first.values()), 1.0, rel_tol=1e-4)
    assert all(entry[t].rank >= 1 for entry, t in zip(out.logprobs, out.token_ids, strict=True))


@pytest.mark.parametrize(
    ("options", "param"),
    [
        (dict(), "structured_outputs"),
        (dict(regex="a", choice=["a"]), "structured_outputs"),
        (dict(json="{not json"), "structured_outputs.json"),
        (dict(choice=[]), "structured_outputs.choice"),
        (dict(json_object=True, disable_any_whitespace="no"), "structured_outputs.disable_any_whitespace"),
    ],
)
def test_structured_outputs_are_checked_when_the_sampling_params_are_made(
    options: dict[str, Any], param: str
) -> None:
    with pytest.raises(GuidedDecodingError) as info:
        SamplingParams(structured_outputs=StructuredOutputsParams(**options))
    assert isinstance(info.value, ValueError) and info.value.param == param


def test_structured_outputs_and_a_spec_together_are_refused() -> None:
    with pytest.raises(ValueError, match="not both"):
        SamplingParams(structured_outputs=StructuredOutputsParams(regex="a+"), guided=GuidedSpec.regex("b+"))
    params = SamplingParams(structured_outputs=StructuredOutputsParams(regex="a+"))
    assert params.guided == GuidedSpec.regex("a+")


def test_a_schema_the_library_refuses_fails_the_call_and_leaves_nothing_queued(llm: LLM) -> None:
    bad = StructuredOutputsParams(json={"type": "array", "uniqueItems": True})
    with pytest.raises(GuidedDecodingError) as info:
        llm.generate(PROMPTS[:2], [_json(seed=1), SamplingParams(structured_outputs=bad)], use_tqdm=False)
    assert info.value.param == "structured_outputs.json" and "uniqueItems" in str(info.value)
    assert not llm.engine.has_unfinished_requests()


def test_a_model_folder_without_a_tokenizer_refuses_guided_requests(
    tiny_model_factory: Callable[..., Path],
) -> None:
    bare = LLM(str(tiny_model_factory("llama")), kv_cache_memory=8 << 20)
    params = SamplingParams(structured_outputs=StructuredOutputsParams(regex="[0-9]+"))
    with pytest.raises(GuidedDecodingError, match="no tokenizer") as info:
        bare.generate([[5, 6, 7]], params, use_tqdm=False)
    assert info.value.param == "structured_outputs.regex"


# hundreds of alternatives: the mask allows '{' but llguidance's parser refuses it on its row
# limit ("Current row has 3500 items; max is 2000") for some sampled paths
TOO_WIDE: dict[str, Any] = {"anyOf": [{"type": "object"}] * 500}


def test_a_token_the_grammar_refuses_after_its_mask_allowed_it_fails_that_request_alone(llm: LLM) -> None:
    engine = llm.engine
    plain = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    engine.add_request("plain", PROMPTS[0], plain)
    engine.add_request("guided", PROMPTS[1], _json(seed=1))
    guided = engine._requests["guided"].seqs[0].guided
    assert guided is not None

    def refused(token: int) -> bool:  # as llguidance does when a parser limit is hit on consuming
        guided.refusal = "Parser Error: Current row has 3500 items; max is 2000\n<non-verbose/>"
        return False

    guided.accept_token = refused  # type: ignore[method-assign]
    failed: dict[str, Exception] = {}
    dropped: list[Any] = []
    finished: dict[str, Any] = {}
    tokens: dict[str, int] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():  # deltas
            tokens[out.request_id] = tokens.get(out.request_id, 0) + len(out.outputs[0].token_ids)
            if out.finished:
                finished[out.request_id] = out
        failed.update(engine.failed)
        dropped += engine.dropped
    assert list(failed) == ["guided"] and "plain" in finished and "guided" not in finished
    ends = [(d.request_id, d.finished, d.outputs[0].finish_reason) for d in dropped]
    assert ends == [("guided", True, "abort")]  # its end, for the metrics of finished requests
    error = failed["guided"]
    assert isinstance(error, GuidedDecodingError) and error.status == 400
    assert error.param == "structured_outputs.json" and error.code == "invalid_json_schema"
    assert "too complex" in str(error) and "3500 items" in str(error) and "non-verbose" not in str(error)
    assert tokens["plain"] == 12
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_the_offline_call_raises_a_request_s_own_failure_and_leaves_nothing_running(llm: LLM) -> None:
    wide = StructuredOutputsParams(json=TOO_WIDE)
    failures = 0
    for seed in range(12):  # some sampled paths pass, others hit the limit
        wide_params = SamplingParams(temperature=1.0, seed=seed, max_tokens=8, structured_outputs=wide)
        params = [wide_params, _json(seed)]
        try:
            llm.generate(PROMPTS[:2], params, use_tqdm=False)
        except GuidedDecodingError as exc:
            failures += 1
            assert exc.param == "structured_outputs.json" and "too complex" in str(exc)
        assert not llm.engine.has_unfinished_requests()
        assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks
    assert failures > 0
