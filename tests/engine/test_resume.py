"""A completion resumed from the tokens another replica streamed goes on exactly where it was cut:
the same tokens and text for greedy and seeded requests (penalties, stop strings, output formats
included), the true totals, and a clear refusal of tokens the request could not have produced."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from engine.errors import InvalidRequestError
from engine.guided import from_response_format
from engine.llm_engine import LLMEngine

PROMPT = "The quick brown fox jumps over"


@dataclass
class Run:
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    replayed: str = ""
    finish: str | None = None
    generated: int = 0
    prompt: int = 0
    cached: int = 0


def run(engine: LLMEngine, params: SamplingParams, resume: list[int] | None = None, rid: str = "r") -> Run:
    engine.add_request(rid, PROMPT, params, resume_token_ids=resume)
    out = Run()
    while engine.has_unfinished_requests():
        for delta in engine.step():
            (c,) = delta.outputs
            out.tokens += c.token_ids
            out.text += c.text
            out.replayed += c.replayed_text
            out.finish = c.finish_reason or out.finish
            out.generated = delta.num_generated_tokens
            out.prompt, out.cached = len(delta.prompt_token_ids), delta.num_cached_tokens
    return out


@pytest.fixture(scope="module")
def engine(tiny_chat_model: Path) -> Iterator[LLMEngine]:
    llm = LLM(str(tiny_chat_model), max_model_len=256)
    yield llm.engine


SETTINGS = {
    "greedy": dict(temperature=0.0),
    "seeded": dict(temperature=1.0, top_p=0.9, seed=1234),
    "seeded-penalties": dict(temperature=0.8, seed=7, presence_penalty=0.5, repetition_penalty=1.2, top_k=50),
}


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_a_resumed_completion_is_the_one_that_was_cut(engine: LLMEngine, setting: str) -> None:
    params = SamplingParams(max_tokens=24, ignore_eos=True, min_tokens=4, **SETTINGS[setting])  # type: ignore[arg-type]
    whole = run(engine, params)
    assert len(whole.tokens) == 24 and whole.finish == "length"
    for cut in (0, 1, 5, 23, 24):  # before the first token, after one, mid-answer, before the end, at it
        resumed = run(engine, params, whole.tokens[:cut], rid=f"{setting}-{cut}")
        assert whole.tokens[:cut] + resumed.tokens == whole.tokens, cut
        assert resumed.replayed + resumed.text == whole.text, cut
        assert resumed.finish == "length" and resumed.generated == 24  # usage: the true totals


def test_a_stop_string_held_back_at_the_cut_still_ends_the_answer(engine: LLMEngine) -> None:
    probe = run(engine, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
    stop = probe.text[len(probe.text) // 2 :][:3]  # a stop string from the middle of the answer
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, stop=[stop])
    whole = run(engine, params)
    assert whole.finish == "stop" and stop not in whole.text
    for cut in range(len(whole.tokens) + 1):
        resumed = run(engine, params, whole.tokens[:cut], rid=f"stop-{cut}")
        assert whole.tokens[:cut] + resumed.tokens == whole.tokens
        assert resumed.replayed + resumed.text == whole.text  # text held back at the cut comes out
        assert resumed.finish == "stop"


def test_an_output_format_goes_on_under_the_same_grammar_state(engine: LLMEngine) -> None:
    spec = from_response_format(
        {
            "type": "json_schema",
            "json_schema": {
                "name": "pet",
                "schema": {
                    "type": "object",
                    "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
                    "required": ["name", "age"],
                },
            },
        }
    )
    params = SamplingParams(max_tokens=40, temperature=1.0, seed=3, guided=spec)
    whole = run(engine, params)
    for cut in (1, len(whole.tokens) // 2, len(whole.tokens) - 1):
        resumed = run(engine, params, whole.tokens[:cut], rid=f"json-{cut}")
        assert whole.tokens[:cut] + resumed.tokens == whole.tokens
    allowed = whole.tokens[0]  # `{` or whitespace: never a letter where the object must begin
    forbidden = next(t for t in range(100, 400) if t != allowed and engine.tokenizer.decode([t]).isalpha())
    with pytest.raises(InvalidRequestError, match="not allowed by the request's output format"):
        engine.add_request("bad-json", PROMPT, params, resume_token_ids=[forbidden])


def test_tokens_it_could_not_have_produced_are_refused(engine: LLMEngine) -> None:
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    whole = run(engine, params)
    cases = {
        "past its max_tokens": (params, [*whole.tokens, 5]),
        "outside the vocabulary": (params, [1, 10**6]),
        "past its end": (
            SamplingParams(max_tokens=8, temperature=0.0, stop_token_ids=[whole.tokens[1]]),
            whole.tokens,
        ),
        "several choices": (SamplingParams(max_tokens=8, n=2), whole.tokens[:2]),
    }
    for name, (p, tokens) in cases.items():
        with pytest.raises(InvalidRequestError) as err:
            engine.add_request(f"bad-{name}", PROMPT, p, resume_token_ids=tokens)
        assert err.value.param in ("resume", "resume.token_ids"), name
    assert not engine.has_unfinished_requests()
    assert run(engine, params).tokens == whole.tokens  # nothing of the refused ones stayed behind


def test_a_resumed_request_counts_only_its_prompts_cache_hits(engine: LLMEngine) -> None:
    """Its replayed answer, cached from the first try, was counted as cached prompt: cached_tokens
    passed prompt_tokens, and the gateway disbelieved (and did not relay) the whole usage."""
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    whole = run(engine, params, rid="cached-whole")  # the prompt and the answer now in the cache
    resumed = run(engine, params, whole.tokens[:36], rid="cached-resumed")
    assert whole.tokens[:36] + resumed.tokens == whole.tokens
    assert 0 < resumed.cached <= resumed.prompt < 36, (resumed.cached, resumed.prompt)
