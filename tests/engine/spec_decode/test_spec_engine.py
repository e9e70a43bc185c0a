"""Speculative decoding inside continuous batching, on a tiny random model: greedy output equal to
plain decoding's under batching, chunked prefill, prefix caching and preemption; blocks given back
and never polluted; stops, logprobs, seeds and the per-request opt-out as without speculation."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from engine import LLM, RequestOutput, SamplingParams
from engine.models.config import ModelConfig
from tests.engine.spec_decode.chi2 import chi2_limit, two_sample_stat

# min_acceptance_rate 0: a random model accepts few drafts, and every one of them should be verified
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         "min_acceptance_rate": 0.0}  # fmt: skip


def _prompts(count: int = 6, seed: int = 0) -> list[list[int]]:
    """Prompts that repeat a random phrase (prompt lookup finds what to propose)."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(count):
        phrase = [rng.randrange(3, 500) for _ in range(rng.randrange(4, 24))]
        prompts.append(phrase * 3 + phrase[: rng.randrange(1, 4)])
    return prompts


def _tokens(outs: list[RequestOutput]) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outs]


def _pair(path: Path, **options: Any) -> tuple[LLM, LLM]:
    options = {"max_model_len": 512, **options}
    return LLM(str(path), **options), LLM(str(path), speculative_config=NGRAM, **options)


def _accepted(llm: LLM) -> int:
    assert llm.engine.speculator is not None
    return llm.engine.speculator.stats().num_accepted_tokens


GREEDY = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tiny_model_factory: Callable[..., Path]) -> Path:
    return tiny_model_factory("llama")


@pytest.mark.parametrize(
    "options",
    [
        {},  # the prompts batched together
        {"max_num_batched_tokens": 24},  # chunked prefill beside speculating decodes
        {"enable_prefix_caching": False},
    ],
    ids=["batched", "chunked", "no-prefix-cache"],
)
def test_greedy_output_is_identical_with_and_without_speculation(
    model: Path, options: dict[str, Any]
) -> None:
    plain, spec = _pair(model, **options)
    prompts = _prompts()
    expected = _tokens(plain.generate(prompts, GREEDY, use_tqdm=False))
    assert _tokens(spec.generate(prompts, GREEDY, use_tqdm=False)) == expected
    assert _accepted(spec) > 10  # drafts were accepted, not only proposed
    for prompt, tokens in zip(prompts, expected, strict=True):  # one at a time, too
        assert _tokens(spec.generate([prompt], GREEDY, use_tqdm=False)) == [tokens]


def test_a_logit_bias_is_applied_to_every_verified_position(model: Path) -> None:
    plain, spec = _pair(model)
    changed = 0
    for prompt in _prompts(seed=3):  # tokens outside the prompt pushed up: some drafts still match
        rng = random.Random(len(prompt))
        bias = {t: 3.0 for t in rng.sample([t for t in range(3, 500) if t not in prompt], 40)}
        params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logit_bias=bias)
        expected = _tokens(plain.generate([prompt], params, use_tqdm=False))
        changed += expected != _tokens(plain.generate([prompt], GREEDY, use_tqdm=False))
        assert _tokens(spec.generate([prompt], params, use_tqdm=False)) == expected
    assert changed >= 3 and _accepted(spec) > 10  # the bias mattered, and drafts were verified


def test_prefix_cache_hits_and_preemption_keep_the_output(model: Path) -> None:
    cfg = ModelConfig.from_dir(model)
    per_block = 2 * cfg.num_layers * 16 * cfg.num_kv_heads * cfg.head_dim * 4
    prompts = _prompts(8, seed=1)
    plain = LLM(str(model), max_model_len=512)
    expected = _tokens(plain.generate(prompts, GREEDY, use_tqdm=False))
    spec = LLM(str(model), max_model_len=512, speculative_config=NGRAM, kv_cache_memory=24 * per_block)
    assert _tokens(spec.generate(prompts, GREEDY, use_tqdm=False)) == expected
    assert spec.engine.stats().num_preemptions > 0  # 8 sequences of ~100 tokens in 384 slots
    again = spec.generate(prompts, GREEDY, use_tqdm=False)  # now from the prefix cache
    assert _tokens(again) == expected
    assert sum(o.metrics.num_cached_tokens for o in again if o.metrics is not None) > 0


def test_rejected_drafts_leak_no_block_and_never_reach_the_prefix_cache(model: Path) -> None:
    _, spec = _pair(model)
    prompts = _prompts(6, seed=2)
    outs = spec.generate(prompts, GREEDY, use_tqdm=False)
    stats = spec.engine.speculator.stats()  # type: ignore[union-attr]
    assert stats.num_accepted_tokens < stats.num_draft_tokens  # some drafts were rejected
    bm = spec.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks  # every block came back
    sequences = [o.prompt_token_ids + list(o.outputs[0].token_ids) for o in outs]
    cached = [b for b in bm.blocks if b.block_hash is not None]
    assert cached
    for block in cached:  # each cached block holds tokens some sequence really has at its place
        width = len(block.token_ids)
        assert any(
            tuple(s[i : i + width]) == block.token_ids
            for s in sequences
            for i in range(0, len(s) - width + 1, width)
        ), block


def test_stop_tokens_stop_strings_and_max_tokens_end_as_without_speculation(model: Path) -> None:
    plain, spec = _pair(model)
    prompts = _prompts(4, seed=3)
    free_run = _tokens(plain.generate(prompts, GREEDY, use_tqdm=False))
    for prompt, tokens in zip(prompts, free_run, strict=True):
        stop_at = tokens[len(tokens) // 2]  # a token the output really reaches
        for params in (
            SamplingParams(temperature=0, max_tokens=48, stop_token_ids=[stop_at]),
            SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),
            SamplingParams(
                temperature=0, max_tokens=48, ignore_eos=True, min_tokens=30, stop_token_ids=[tokens[3]]
            ),
        ):
            a = plain.generate([prompt], params, use_tqdm=False)[0].outputs[0]
            b = spec.generate([prompt], params, use_tqdm=False)[0].outputs[0]
            ends = [(o.token_ids, o.finish_reason, o.stop_reason) for o in (a, b)]
            assert ends[0] == ends[1]
    assert _accepted(spec) > 0


def test_logprobs_and_seeded_sampling_under_speculation(model: Path) -> None:
    plain, spec = _pair(model)
    prompt = _prompts(1, seed=4)[0]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=3)
    a = plain.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    b = spec.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert b.logprobs is not None and a.logprobs is not None and len(b.logprobs) == 32
    assert b.logprobs == a.logprobs and b.cumulative_logprob == a.cumulative_logprob
    seeded = SamplingParams(temperature=0.8, seed=1234, max_tokens=32, ignore_eos=True)
    runs = [_tokens(spec.generate([prompt] * 3, seeded, use_tqdm=False)) for _ in range(2)]
    assert runs[0] == runs[1] and runs[0][0] == runs[0][1] == runs[0][2]


def test_seeded_sampling_gives_the_same_tokens_with_and_without_speculation(model: Path) -> None:
    # the verifier draws each position's token as the sampler would (its own seeded noise): drafts,
    # accepted or not, never change which token a seeded request emits (a resumed stream relies on it)
    plain, spec = _pair(model)
    prompts = _prompts(6, seed=6)
    accepted = _accepted(spec)
    for temperature in (0.3, 1.0):
        seeded = SamplingParams(temperature=temperature, seed=77, max_tokens=40, ignore_eos=True)
        expected = _tokens(plain.generate(prompts, seeded, use_tqdm=False))
        assert _tokens(spec.generate(prompts, seeded, use_tqdm=False)) == expected
        assert _tokens(spec.generate(prompts[:1], seeded, use_tqdm=False)) == expected[:1]  # alone, too
    assert _accepted(spec) > accepted  # drafts were accepted along the way, not only proposed


def test_a_request_that_opts_out_is_never_speculated(model: Path) -> None:
    _, spec = _pair(model)
    prompts = _prompts(3, seed=5)
    opted_out = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, speculative=False)
    spec.generate(prompts, opted_out, use_tqdm=False)
    assert spec.engine.speculator.stats().num_drafts == 0  # type: ignore[union-attr]


def test_low_acceptance_turns_speculation_off(model: Path) -> None:
    # any draft of a sampled (temperature 2) sequence is rarely the token drawn
    spec = LLM(
        str(model),
        max_model_len=512,
        speculative_config={**NGRAM, "acceptance_window": 8, "min_acceptance_rate": 0.95},
    )
    hot = SamplingParams(temperature=2.0, seed=7, max_tokens=200, ignore_eos=True)
    spec.generate(_prompts(1, seed=6), hot, use_tqdm=False)
    stats = spec.engine.speculator.stats()  # type: ignore[union-attr]
    assert 8 <= stats.num_draft_tokens < 8 + NGRAM["num_speculative_tokens"]  # one window, then off


def test_sampled_tokens_at_the_first_speculated_position_follow_the_targets_distribution(model: Path) -> None:
    # the prompt is the model's own greedy text: a token sampled after it has often occurred in it,
    # followed by what the model likes next, so the first speculated position is verified with
    # drafts accepted and rejected
    plain, spec = _pair(model, max_model_len=1024)
    long_run = SamplingParams(temperature=0, max_tokens=500, ignore_eos=True)
    prompt = [5, 6, 7] + _tokens(plain.generate([[5, 6, 7]], long_run, use_tqdm=False))[0]
    runs = 400
    counts: list[dict[int, int]] = []
    for llm, first_seed in ((plain, 0), (spec, runs)):  # independent seeds for the two samples
        params = [
            SamplingParams(temperature=1.0, top_k=4, seed=first_seed + i, max_tokens=3, ignore_eos=True)
            for i in range(runs)
        ]
        outs = llm.generate([prompt] * runs, params, use_tqdm=False)
        counts.append(dict(Counter(o.outputs[0].token_ids[1] for o in outs)))
    stats = spec.engine.speculator.stats()  # type: ignore[union-attr]
    assert stats.num_drafts > runs // 4 and 0 < stats.accepted_per_pos[0] < stats.num_drafts
    stat, df = two_sample_stat(counts[0], counts[1])
    assert stat < chi2_limit(df), (stat, df, counts)
