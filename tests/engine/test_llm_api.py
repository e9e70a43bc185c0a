"""Offline API: prompt order, per-prompt params, admission errors, abort, metrics, no leaks."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from engine import (
    LLM,
    ContextLengthExceededError,
    InvalidRequestError,
    KVCacheCapacityError,
    RequestOutput,
    SamplingParams,
)
from engine.models.config import ModelConfig


@pytest.fixture(scope="module")
def tiny(tiny_model_factory: Callable[..., Path]) -> LLM:
    return LLM(str(tiny_model_factory("llama")), max_model_len=256)


def test_outputs_come_back_in_prompt_order_with_per_prompt_params(tiny: LLM) -> None:
    prompts = [[5] * n for n in (40, 3, 90, 7)]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (4, 9, 2, 6)]
    outs = tiny.generate(prompts, params, use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == prompts
    assert [len(o.token_ids) for o in outs] == [4, 9, 2, 6]
    assert all(o.finish_reason == "length" and o.finished for o in outs)
    assert len({o.request_id for o in outs}) == 4


def test_single_token_list_prompt_is_one_request(tiny: LLM) -> None:
    outs = tiny.generate([5, 6, 7], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    assert len(outs) == 1 and outs[0].prompt_token_ids == [5, 6, 7]


def test_params_list_of_wrong_length_is_rejected(tiny: LLM) -> None:
    with pytest.raises(ValueError, match="one per prompt"):
        tiny.generate([[1, 2], [3, 4]], [SamplingParams()], use_tqdm=False)


def test_n_gives_several_completions(tiny: LLM) -> None:
    out = tiny.generate(
        [[9, 8, 7]], SamplingParams(n=3, temperature=1.0, max_tokens=5, ignore_eos=True), use_tqdm=False
    )[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 5 for c in out.outputs)


def test_metrics_are_reported(tiny: LLM) -> None:
    out = tiny.generate([[3] * 50], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)[0]
    m = out.metrics
    assert m.time_to_first_token is not None and m.latency is not None
    assert 0 <= m.time_to_first_token <= m.latency
    again = tiny.generate([[3] * 50], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)[0]
    assert again.num_cached_tokens == 48 and again.metrics.num_cached_tokens == 48


def test_prompt_plus_max_tokens_over_context_is_rejected_at_add(tiny: LLM) -> None:
    with pytest.raises(ContextLengthExceededError, match="maximum context length is 256"):
        tiny.engine.add_request("too-long", [1] * 200, SamplingParams(max_tokens=57))
    with pytest.raises(ContextLengthExceededError, match=r"has 256 tokens \(the completion needs at least"):
        tiny.engine.add_request("too-long", [1] * 256, SamplingParams(max_tokens=None))
    assert not tiny.engine.has_unfinished_requests()


def test_request_that_can_never_fit_the_pool_is_rejected(tiny_model_factory: Callable[..., Path]) -> None:
    path = tiny_model_factory("llama")
    cfg = ModelConfig.from_dir(path)
    per_block = 2 * cfg.num_layers * 16 * cfg.num_kv_heads * cfg.head_dim * 4
    llm = LLM(str(path), kv_cache_memory=4 * per_block)  # 64 token slots
    with pytest.raises(KVCacheCapacityError, match="whole pool holds 64") as refused:
        llm.generate([[1] * 60], SamplingParams(max_tokens=10), use_tqdm=False)
    assert refused.value.param == "max_tokens"
    with pytest.raises(KVCacheCapacityError, match="prompt needs 65 tokens") as refused:
        llm.generate([[1] * 65], SamplingParams(max_tokens=1), use_tqdm=False)
    assert refused.value.param == "prompt"  # no max_tokens would help
    # the last token sampled is never stored: prompt + max_tokens - 1 slots, the pool's 64 exactly
    for prompt, max_tokens in ((55, 10), (64, 1)):
        ok = llm.generate(
            [[1] * prompt], SamplingParams(max_tokens=max_tokens, ignore_eos=True), use_tqdm=False
        )
        assert len(ok[0].outputs[0].token_ids) == max_tokens
    unbounded = llm.generate([[1] * 60], SamplingParams(max_tokens=None, ignore_eos=True), use_tqdm=False)
    assert len(unbounded[0].outputs[0].token_ids) == 5  # as many as fit the pool
    # four of them at once: preempted in turn, all finish
    many = llm.generate(
        [[i + 1] * 55 for i in range(4)], SamplingParams(max_tokens=10, ignore_eos=True), use_tqdm=False
    )
    assert [len(o.outputs[0].token_ids) for o in many] == [10] * 4
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


@pytest.mark.parametrize(
    ("prompt", "message"),
    [([], "empty"), ([1, 99999], "outside the vocabulary"), ("text needs a tokenizer", "no tokenizer")],
)
def test_bad_prompts_are_rejected(tiny: LLM, prompt: list[int] | str, message: str) -> None:
    with pytest.raises(InvalidRequestError, match=message):
        tiny.engine.add_request("bad", prompt, SamplingParams())


def test_failed_batch_leaves_no_request_behind(tiny: LLM) -> None:
    with pytest.raises(InvalidRequestError):
        tiny.generate([[1, 2, 3], []], SamplingParams(), use_tqdm=False)
    assert not tiny.engine.has_unfinished_requests()
    assert tiny.engine.block_manager.num_free_blocks == tiny.engine.block_manager.num_blocks


def test_abort_frees_blocks_immediately(tiny: LLM) -> None:
    engine = tiny.engine
    bm = engine.block_manager
    engine.add_request("a", [4] * 100, SamplingParams(max_tokens=50, ignore_eos=True))
    engine.add_request("b", [5] * 30, SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    engine.step()
    assert bm.num_free_blocks < bm.num_blocks
    out = engine.abort_request("a")
    assert out is not None and out.finished and out.finish_reason == "abort"
    engine.abort_request("b")
    assert bm.num_free_blocks == bm.num_blocks
    assert not engine.has_unfinished_requests()
    assert engine.step() == []
    assert engine.abort_request("unknown") is None


def test_unknown_engine_option_is_a_clear_error(tiny_model_factory: Callable[..., Path]) -> None:
    with pytest.raises(TypeError, match="unknown engine option"):
        LLM(str(tiny_model_factory("llama")), max_num_seq=4)


def test_invalid_sampling_params_are_rejected() -> None:
    for bad in (
        dict(temperature=-1),
        dict(top_p=0),
        dict(n=0),
        dict(max_tokens=0),
        dict(logprobs=50),
        dict(stop=[""]),
        dict(repetition_penalty=0),
        dict(repetition_penalty=float("inf")),
    ):
        with pytest.raises(ValueError):
            SamplingParams(**bad)  # type: ignore[arg-type]
    assert SamplingParams(repetition_penalty=2.5).repetition_penalty == 2.5  # vLLM: any positive value


def test_unsupported_architecture_is_rejected(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}')
    with pytest.raises(ValueError, match="unsupported architecture"):
        LLM(str(tmp_path))


def test_missing_model_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="never downloads"):
        LLM("meta-llama/Llama-3-8B")


def _logprob_values(out: RequestOutput) -> list[list[tuple[int, float]]]:
    assert out.outputs[0].logprobs is not None
    return [sorted((t, lp.logprob) for t, lp in entry.items()) for entry in out.outputs[0].logprobs]


def test_prompt_served_from_prefix_cache_gives_bit_identical_logprobs(tiny: LLM) -> None:
    prompt = [(i * 37) % 500 + 3 for i in range(150)]
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=5, ignore_eos=True)
    fresh = tiny.generate([prompt], params, use_tqdm=False)[0]
    cached = tiny.generate([prompt], params, use_tqdm=False)[0]
    assert fresh.num_cached_tokens == 0 and cached.num_cached_tokens == 144
    assert cached.token_ids == fresh.token_ids
    assert _logprob_values(cached) == _logprob_values(fresh)  # exact equality, not approx


@pytest.mark.parametrize(("batch_invariant", "prompt_len"), [(True, 150), (True, 530), (False, 150)])
def test_batch_invariant_mode_makes_batching_and_chunking_bit_identical(
    tiny_model_factory: Callable[..., Path], batch_invariant: bool, prompt_len: int
) -> None:
    path = str(tiny_model_factory("qwen2"))
    prompt = [(i * 53) % 500 + 3 for i in range(prompt_len)]  # spans of 16..256, or past 512
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=5, ignore_eos=True)
    alone = LLM(path, enable_prefix_caching=False, batch_invariant=batch_invariant)
    reference = _logprob_values(alone.generate([prompt], params, use_tqdm=False)[0])
    chunked = LLM(
        path, enable_prefix_caching=False, max_num_batched_tokens=37, batch_invariant=batch_invariant
    )
    others = [[7] * 40, prompt[:33], [9] * 90]
    in_batch = chunked.generate([others[0], prompt, *others[1:]], params, use_tqdm=False)[1]
    cached = LLM(path, enable_prefix_caching=True, batch_invariant=batch_invariant)
    cached.generate([prompt[:100] + [5]], params, use_tqdm=False)
    shared = cached.generate([others[2], prompt], params, use_tqdm=False)[1]
    assert shared.num_cached_tokens == 96
    if batch_invariant:
        assert _logprob_values(in_batch) == reference
        assert _logprob_values(shared) == reference
    else:  # the fast path only promises equal tokens (ties aside), not equal bits
        assert (
            in_batch.token_ids
            == shared.token_ids
            == [t for t, _ in [max(e, key=lambda x: x[1]) for e in reference]]
        )


def test_vllm_style_dict_prompts_are_accepted(tiny: LLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    outs = tiny.generate([{"prompt_token_ids": [4, 5, 6]}, [4, 5, 6]], params, use_tqdm=False)
    assert outs[0].prompt_token_ids == [4, 5, 6] and outs[0].token_ids == outs[1].token_ids
    with pytest.raises(ValueError, match="prompt_token_ids"):
        tiny.generate([{"text": "x"}], params, use_tqdm=False)
