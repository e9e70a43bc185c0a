"""Sampling on the default model: seeds, stop strings and tokens, logprobs, penalties, min_tokens."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.sequence import choice_seed

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "Tell me a short story about a robot who learns to paint."}]


@pytest.fixture(scope="module")
def llm(default_model_dir: Path) -> LLM:
    return LLM("default", max_model_len=2048)


@pytest.fixture(scope="module")
def chat_prompt(llm: LLM) -> list[int]:
    tok = llm.get_tokenizer()
    return list(tok.apply_chat_template(QUESTION, add_generation_prompt=True, return_dict=False))


@pytest.fixture(scope="module")
def hf_model(default_model_dir: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(default_model_dir), dtype=torch.float32).eval()


def test_seeded_request_is_independent_of_batch_composition(llm: LLM, chat_prompt: list[int]) -> None:
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=24, ignore_eos=True)
    alone = llm.generate([chat_prompt], params, use_tqdm=False)[0].token_ids
    others = [[7] * 30, chat_prompt[:10], [100 + i for i in range(70)]]
    noisy = SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True)
    batch = llm.generate(others + [chat_prompt], [noisy, noisy, noisy, params], use_tqdm=False)
    assert batch[-1].token_ids == alone
    other_seed = SamplingParams(temperature=0.9, top_p=0.95, seed=4321, max_tokens=24, ignore_eos=True)
    assert llm.generate([chat_prompt], other_seed, use_tqdm=False)[0].token_ids != alone


def test_seeds_that_differ_past_63_bits_draw_different_answers(llm: LLM, chat_prompt: list[int]) -> None:
    # was: folded onto 63 bits, 42 and 42 + 2^63 (and -1 and 2^63 - 1) drew the same answer
    def drawn(seed: int) -> list[int]:
        params = SamplingParams(temperature=1.0, seed=seed, max_tokens=12, ignore_eos=True)
        return llm.generate([chat_prompt], params, use_tqdm=False)[0].token_ids

    assert drawn(42) != drawn(42 + 2**63) and drawn(-1) != drawn(2**63 - 1)
    assert drawn(42) == drawn(42)
    assert len({choice_seed(s, i) for s in (42, 42 + 2**63, -1, 2**63 - 1) for i in range(4)}) == 16


def test_top_k_one_and_tiny_top_p_equal_greedy(llm: LLM, chat_prompt: list[int]) -> None:
    greedy = llm.generate([chat_prompt], SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)[0]
    k1 = llm.generate([chat_prompt], SamplingParams(temperature=1.5, top_k=1, max_tokens=16), use_tqdm=False)[
        0
    ]
    p0 = llm.generate(
        [chat_prompt], SamplingParams(temperature=1.5, top_p=1e-6, max_tokens=16), use_tqdm=False
    )[0]
    assert k1.token_ids == greedy.token_ids == p0.token_ids


def test_stop_string_across_tokens_is_excluded_from_output(llm: LLM, chat_prompt: list[int]) -> None:
    free = llm.generate([chat_prompt], SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)[0]
    text = free.text
    assert len(text) > 30
    stop = text[20:27]  # 7 characters that most likely straddle a token boundary
    out = llm.generate(
        [chat_prompt], SamplingParams(temperature=0, max_tokens=40, stop=[stop, "zzzz"]), use_tqdm=False
    )[0]
    assert out.text == text[: text.index(stop)]
    assert out.finish_reason == "stop" and out.outputs[0].stop_reason == stop


def test_stop_token_id_ends_generation(llm: LLM, chat_prompt: list[int]) -> None:
    free = llm.generate([chat_prompt], SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)[0]
    target = free.token_ids[5]
    first = free.token_ids.index(target)
    out = llm.generate(
        [chat_prompt], SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[target]), use_tqdm=False
    )[0]
    assert out.token_ids == free.token_ids[: first + 1]
    assert out.finish_reason == "stop" and out.outputs[0].stop_reason == target
    decode = llm.get_tokenizer().decode
    assert out.text == decode(free.token_ids[:first], skip_special_tokens=True)
    kept = SamplingParams(
        temperature=0, max_tokens=20, stop_token_ids=[target], include_stop_str_in_output=True
    )
    with_stop = llm.generate([chat_prompt], kept, use_tqdm=False)[0]  # vLLM: the stop token's text kept too
    assert with_stop.token_ids == out.token_ids
    assert with_stop.text == decode(free.token_ids[: first + 1], skip_special_tokens=True) != out.text


def test_eos_stops_unless_ignored(llm: LLM) -> None:
    tok = llm.get_tokenizer()
    prompt = list(
        tok.apply_chat_template(
            [{"role": "user", "content": "Say hi."}], add_generation_prompt=True, return_dict=False
        )
    )
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=200), use_tqdm=False)[0]
    assert out.finish_reason == "stop" and out.token_ids[-1] == tok.eos_token_id
    assert "<|im_end|>" not in out.text
    n = len(out.token_ids)
    ignored = llm.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=n + 5, ignore_eos=True), use_tqdm=False
    )[0]
    assert ignored.finish_reason == "length" and len(ignored.token_ids) == n + 5
    at_least = llm.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=n + 5, min_tokens=n + 2), use_tqdm=False
    )[0]
    assert len(at_least.token_ids) >= n + 2
    assert tok.eos_token_id not in at_least.token_ids[: n + 2]


def test_logprobs_match_hf_log_softmax(llm: LLM, chat_prompt: list[int], hf_model: torch.nn.Module) -> None:
    out = llm.generate(
        [chat_prompt], SamplingParams(temperature=0.8, seed=7, max_tokens=12, logprobs=5), use_tqdm=False
    )[0]
    logprobs = out.outputs[0].logprobs
    assert logprobs is not None and len(logprobs) == 12
    ids = torch.tensor([chat_prompt + out.token_ids[:-1]])
    with torch.inference_mode():
        hf = torch.log_softmax(hf_model(ids).logits[0, len(chat_prompt) - 1 :].float(), dim=-1)
    for step, (token, entry) in enumerate(zip(out.token_ids, logprobs, strict=True)):
        assert token in entry
        assert entry[token].logprob == pytest.approx(float(hf[step, token]), abs=1e-4)
        top_ids = hf[step].topk(5).indices.tolist()
        assert set(top_ids) <= set(entry)
        ranks = sorted(lp.rank for tid, lp in entry.items() if tid in top_ids)
        assert ranks == [1, 2, 3, 4, 5]
        assert entry[token].rank == int((hf[step] > hf[step, token]).sum()) + 1
        assert entry[token].decoded_token == llm.get_tokenizer().decode([token])
    assert out.outputs[0].cumulative_logprob == pytest.approx(
        sum(e[t].logprob for e, t in zip(logprobs, out.token_ids, strict=True))
    )


def test_repetition_penalty_matches_hf(llm: LLM, chat_prompt: list[int], hf_model: torch.nn.Module) -> None:
    out = llm.generate(
        [chat_prompt], SamplingParams(temperature=0, max_tokens=20, repetition_penalty=1.3), use_tqdm=False
    )[0]
    ids = torch.tensor([chat_prompt])
    with torch.inference_mode():
        hf = hf_model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=20,
            do_sample=False,
            repetition_penalty=1.3,
            pad_token_id=0,
        )
    assert out.token_ids == hf[0, len(chat_prompt) :].tolist()


def test_frequency_and_presence_penalties_reduce_repetition(llm: LLM) -> None:
    prompt = llm.get_tokenizer()("the the the the the the the the").input_ids
    plain = llm.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True), use_tqdm=False
    )[0]
    penal = llm.generate(
        [prompt],
        SamplingParams(
            temperature=0, max_tokens=30, ignore_eos=True, frequency_penalty=2.0, presence_penalty=2.0
        ),
        use_tqdm=False,
    )[0]
    assert len(set(penal.token_ids)) > len(set(plain.token_ids))


def test_logit_bias_forces_and_forbids_tokens_greedy_and_seeded(llm: LLM, chat_prompt: list[int]) -> None:
    def run(**kw: object) -> list[int]:
        params = SamplingParams(max_tokens=8, ignore_eos=True, **kw)  # type: ignore[arg-type]
        return list(llm.generate([chat_prompt], params, use_tqdm=False)[0].token_ids)

    greedy = run(temperature=0)
    assert run(temperature=0, logit_bias={42: 100.0}) == [42] * 8
    banned = run(temperature=0, logit_bias={t: -100.0 for t in set(greedy)})
    assert not set(banned) & set(greedy)
    seeded = run(temperature=1.0, seed=7, logit_bias={42: 100.0})
    assert seeded == [42] * 8  # +100 outweighs any other logit at temperature 1
    assert run(temperature=0, logit_bias={greedy[0]: 0.0}) == greedy  # a zero bias changes nothing


@pytest.mark.parametrize("bias", [{-1: 1.0}, {5: 100.5}, {5: float("nan")}, {i: 1.0 for i in range(301)}])
def test_bad_logit_bias_is_refused(bias: dict[int, float]) -> None:
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias=bias)


def test_a_logit_bias_past_the_vocabulary_is_refused(llm: LLM, chat_prompt: list[int]) -> None:
    with pytest.raises(ValueError, match="logit_bias token id 10000000 is outside the vocabulary"):
        llm.generate([chat_prompt], SamplingParams(logit_bias={10_000_000: 1.0}), use_tqdm=False)


def test_stop_token_ids_past_the_vocabulary_or_too_many_are_refused(llm: LLM, chat_prompt: list[int]) -> None:
    with pytest.raises(ValueError, match="stop_token_ids: token id 10000000 is outside the vocabulary"):
        llm.generate([chat_prompt], SamplingParams(stop_token_ids=[5, 10_000_000]), use_tqdm=False)
    with pytest.raises(ValueError, match="stop_token_ids has 1025 entries, more than 1024"):
        SamplingParams(stop_token_ids=list(range(1025)))


def test_min_tokens_no_token_can_meet_is_refused_not_broken(tiny_model_factory: Callable[..., Path]) -> None:
    # every token a stop (or the end of sequence): the mask left nothing to sample, and the answer
    # used to end at once with "stop", min_tokens silently broken
    tiny = LLM(str(tiny_model_factory("llama")), max_model_len=64)
    vocab = tiny.engine.model_config.vocab_size
    assert vocab <= 1024  # every id fits in one stop_token_ids list
    every = SamplingParams(min_tokens=3, max_tokens=5, stop_token_ids=list(range(vocab)))
    with pytest.raises(ValueError, match="min_tokens cannot be met"):
        tiny.generate([[1, 2, 3]], every, use_tqdm=False)
    # one token left (the end of sequence ignored): min_tokens is met with it
    all_but_0 = list(range(1, vocab))
    one_left = SamplingParams(min_tokens=3, max_tokens=3, ignore_eos=True, stop_token_ids=all_but_0)
    out = tiny.generate([[1, 2, 3]], one_left, use_tqdm=False)[0].outputs[0]
    assert list(out.token_ids) == [0, 0, 0] and out.finish_reason == "length"


def test_allowed_token_ids_hold_greedy_seeded_and_batched_choices_to_them(
    llm: LLM, chat_prompt: list[int]
) -> None:
    """vLLM's allowed_token_ids: every sampled token is one of them (the rest -inf), whatever else
    runs in the batch; with min_tokens and only stop tokens allowed, nothing is masked to a dead end."""
    plain = llm.generate([chat_prompt], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                         use_tqdm=False)[0].outputs[0].token_ids  # fmt: skip
    allowed = sorted({plain[0] + 1, plain[0] + 2, 300, 301})  # greedy's own first choice not among them
    for kw in ({"temperature": 0.0}, {"temperature": 1.0, "seed": 5}):
        params = SamplingParams(max_tokens=6, ignore_eos=True, allowed_token_ids=allowed, **kw)  # type: ignore[arg-type]
        free = SamplingParams(max_tokens=6, ignore_eos=True, **kw)  # type: ignore[arg-type]
        outs = llm.generate([chat_prompt, chat_prompt], [params, free], use_tqdm=False)
        held, other = outs[0].outputs[0].token_ids, outs[1].outputs[0].token_ids
        assert len(held) == 6 and set(held) <= set(allowed), held
        assert not set(other) <= set(allowed)  # the batch's other request is not held to them
    eos = llm.get_tokenizer().eos_token_id
    only_stop = SamplingParams(max_tokens=4, min_tokens=2, allowed_token_ids=[eos])
    with pytest.raises(ValueError, match="min_tokens cannot be met"):  # it ended at once, min_tokens ignored
        llm.generate([chat_prompt], only_stop, use_tqdm=False)
    ignored = SamplingParams(max_tokens=3, min_tokens=2, allowed_token_ids=[eos], ignore_eos=True)
    out = llm.generate([chat_prompt], ignored, use_tqdm=False)[0].outputs[0]
    assert list(out.token_ids) == [eos] * 3 and out.finish_reason == "length"
    with pytest.raises(ValueError, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=[])
    with pytest.raises(ValueError, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=[-1])


def test_truncate_prompt_tokens_reads_the_prompts_last_tokens_even_past_the_context(llm: LLM) -> None:
    """vLLM's truncate_prompt_tokens: a prompt longer than the context (2,048 here) is cut to its
    last k tokens (left truncation) instead of refused; the answer is that of those tokens alone."""
    text = " ".join(f"w{i}" for i in range(1500))  # ~3,000 tokens
    ids = llm.get_tokenizer()(text).input_ids
    assert len(ids) > 2048
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    with pytest.raises(ValueError, match="context length"):
        llm.generate([text], params, use_tqdm=False)
    cut = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, truncate_prompt_tokens=16)
    out = llm.generate([text], cut, use_tqdm=False)[0]
    assert out.prompt_token_ids == ids[-16:]
    assert (
        out.outputs[0].token_ids == llm.generate([ids[-16:]], params, use_tqdm=False)[0].outputs[0].token_ids
    )
    short = llm.generate([ids[:10]], cut, use_tqdm=False)[0]  # shorter than k: as it is
    assert short.prompt_token_ids == ids[:10]
    whole = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, truncate_prompt_tokens=-1)
    assert llm.generate([text], whole, use_tqdm=False)[0].prompt_token_ids == ids[-(2048 - 5) :]  # room for 5
    huge = " ".join(f"w{i}" for i in range(8000))  # over 4 contexts: refused before it is tokenized
    with pytest.raises(ValueError, match="context length"):
        llm.generate([huge], cut, use_tqdm=False)
    for bad in (0, -2):
        with pytest.raises(ValueError, match="truncate_prompt_tokens"):
            SamplingParams(truncate_prompt_tokens=bad)


def test_bad_words_are_never_completed_greedy_or_seeded(llm: LLM, chat_prompt: list[int]) -> None:
    """vLLM's bad_words: a word the answer would say is never completed (its last token is forbidden
    where the output ends with the rest of it), at the start or after a space alike."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = llm.generate([chat_prompt], params, use_tqdm=False)[0].outputs[0].text
    words = [w.strip(".,;:!?\"'()") for w in plain.split()]
    word = next(w for w in words if len(w) >= 4 and w.isalpha())
    for kw in ({"temperature": 0.0}, {"temperature": 1.0, "seed": 3}):
        banned = SamplingParams(max_tokens=24, ignore_eos=True, bad_words=[word], **kw)  # type: ignore[arg-type]
        text = llm.generate([chat_prompt], banned, use_tqdm=False)[0].outputs[0].text
        assert word not in text, (word, text)
    assert llm.generate([chat_prompt], params, use_tqdm=False)[0].outputs[0].text == plain  # no leak
    for bad in (["  "], ["x" * 257], ["a"] * 129):
        with pytest.raises(ValueError, match="bad_words"):
            SamplingParams(bad_words=bad)
