"""The offline API as vLLM users drive it: from two threads, interrupted, params changed after they
were made, chat content parts, prompt kinds it must refuse rather than misread."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from engine import LLM, InvalidRequestError, SamplingParams, StructuredOutputsParams

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tiny_model_factory: Callable[..., Path]) -> LLM:
    return LLM(str(tiny_model_factory("llama")), max_model_len=256)


@pytest.fixture(scope="module")
def chat_llm(tiny_chat_model: Path) -> LLM:
    return LLM(str(tiny_chat_model), max_model_len=512)


def test_two_threads_sharing_one_llm_each_get_their_own_answers(tiny: LLM) -> None:
    """Both stepped the engine at once: each took the other's outputs, an AssertionError, and every
    later call failed too."""
    prompts = {"a": [[5, 6, 7]] * 2, "b": [[9, 10]] * 2}
    alone = {
        k: [o.outputs[0].token_ids for o in tiny.generate(p, GREEDY, use_tqdm=False)]
        for k, p in prompts.items()
    }
    got: dict[str, list[Any]] = {"a": [], "b": []}
    errors: list[BaseException] = []

    def work(name: str) -> None:
        try:
            for _ in range(3):
                outs = tiny.generate(prompts[name], GREEDY, use_tqdm=False)
                got[name].append([o.outputs[0].token_ids for o in outs])
        except BaseException as exc:  # (reported below)
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(name,)) for name in prompts]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert errors == []
    assert got == {k: [v] * 3 for k, v in alone.items()}
    assert not tiny.engine.has_unfinished_requests()


def test_an_interrupted_generate_leaves_nothing_for_the_next_call(tiny: LLM) -> None:
    """Ctrl-C in a notebook: the requests ran on, and the next call (3 tokens) took 152 s finishing them."""
    steps = 0
    real = tiny.engine.step

    def interrupted() -> Any:
        nonlocal steps
        steps += 1
        if steps == 3:
            raise KeyboardInterrupt
        return real()

    tiny.engine.step = interrupted  # type: ignore[method-assign]
    try:
        with pytest.raises(KeyboardInterrupt):
            tiny.generate([[5] * 8] * 4, SamplingParams(max_tokens=200, ignore_eos=True), use_tqdm=False)
    finally:
        del tiny.engine.step
    assert not tiny.engine.has_unfinished_requests()
    assert tiny.generate([[5, 6]], GREEDY, use_tqdm=False)[0].outputs[0].finish_reason == "length"


def test_params_changed_after_they_were_made_are_read_as_they_are(chat_llm: LLM) -> None:
    """`sp.stop = [...]` and `sp.structured_outputs = ...` after construction were ignored."""
    free = chat_llm.generate("The capital", SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0]
    text = free.outputs[0].text
    stop = text[3:6]
    params = SamplingParams(temperature=0, max_tokens=12)
    params.stop = [stop]
    out = chat_llm.generate("The capital", params, use_tqdm=False)[0].outputs[0]
    assert out.text == text[: text.index(stop)] and out.finish_reason == "stop"
    params = SamplingParams(temperature=0, max_tokens=12)
    params.structured_outputs = StructuredOutputsParams(choice=["yes", "no"])
    assert chat_llm.generate("Is it?", params, use_tqdm=False)[0].outputs[0].text in ("yes", "no")
    params.structured_outputs = None
    assert chat_llm.generate("Is it?", params, use_tqdm=False)[0].outputs[0].text not in ("yes", "no")
    held = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(choice=["a"]))
    import dataclasses

    assert dataclasses.replace(held, max_tokens=5).guided == held.guided  # (replace() raised)
    assert held.clone() == held and held.clone() is not held


def test_chat_takes_openai_content_parts(chat_llm: LLM) -> None:
    as_text = chat_llm.chat([{"role": "user", "content": "What is 2+2?\nAnswer"}], GREEDY, use_tqdm=False)[0]
    parts = [{"type": "text", "text": "What is 2+2?"}, {"type": "text", "text": "Answer"}]
    as_parts = chat_llm.chat([{"role": "user", "content": parts}], GREEDY, use_tqdm=False)[0]
    assert as_parts.prompt_token_ids == as_text.prompt_token_ids
    with pytest.raises(ValueError, match=r"messages\[0\].content: only text parts"):
        chat_llm.chat(
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], GREEDY
        )


@pytest.mark.parametrize(
    ("prompt", "message"),
    [
        ({"prompt": "hi", "multi_modal_data": {"image": 1}}, "'prompt' or 'prompt_token_ids' only"),
        (b"hello", "unsupported prompt type bytes"),
        ({"prompt_token_ids": ["a", "b"]}, "prompt_token_ids must be a list of integers"),
    ],
)
def test_prompts_it_would_misread_are_refused(tiny: LLM, prompt: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        tiny.generate(prompt, GREEDY, use_tqdm=False)


def test_numpy_token_ids_are_token_ids(tiny: LLM) -> None:
    """They were "outside the vocabulary" (np.int64 is no int)."""
    ids = np.array([5, 6, 7])
    got = tiny.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False)[0]
    assert (
        got.outputs[0].token_ids == tiny.generate([[5, 6, 7]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    )


@pytest.mark.parametrize(
    "fields",
    [
        {"max_tokens": 3, "min_tokens": 10},
        {"temperature": float("nan")},
        {"temperature": "0.5"},
        {"top_p": float("inf")},
    ],
)
def test_sampling_values_vllm_refuses_are_refused(fields: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=next(iter(fields))):
        SamplingParams(**fields)


def test_engine_options_of_the_wrong_type_name_the_option_and_seed_none_is_the_default(
    tiny_model_factory: Callable[..., Path],
) -> None:
    from engine.config import EngineConfig

    with pytest.raises(TypeError, match="max_model_len"):
        EngineConfig.from_kwargs("m", max_model_len="512")
    with pytest.raises(TypeError, match="gpu_memory_utilization"):
        EngineConfig.from_kwargs("m", gpu_memory_utilization="0.5")
    assert EngineConfig.from_kwargs("m", seed=None).seed == 0
    assert EngineConfig.from_kwargs("m", kv_cache_memory=16e6).kv_cache_memory == 16_000_000


def test_stop_strings_without_a_tokenizer_are_refused(tiny: LLM) -> None:
    """They were never looked for: the answer ran to its length."""
    with pytest.raises(InvalidRequestError, match="stop strings"):
        tiny.generate([[1, 2, 3]], SamplingParams(stop=["a"], max_tokens=20), use_tqdm=False)


def test_a_request_keeps_the_params_it_was_added_with(tiny: LLM) -> None:
    """The sampler read the caller's object at every step: a change made while it ran reached it."""
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    before = tiny.generate([[5, 6, 7]], params, use_tqdm=False)[0].outputs[0].token_ids
    own = params.checked()
    assert own is not params and own == params
    params.temperature = 2.0
    assert (
        own.temperature == 0
        and tiny.generate([[5, 6, 7]], own, use_tqdm=False)[0].outputs[0].token_ids == before
    )


def test_numpy_numbers_and_whole_floats_are_taken_as_before() -> None:
    """The type checks refused numpy's numbers (they used to work) and let 64e6 through as a float."""
    from engine.config import EngineConfig

    options = {"max_model_len": np.int64(512), "gpu_memory_utilization": np.float32(0.5),
               "kv_cache_memory": 64e6, "enforce_eager": 1, "seed": np.int64(3)}  # fmt: skip
    config = EngineConfig.from_kwargs("m", **options)
    assert (config.max_model_len, config.kv_cache_memory, config.seed) == (512, 64_000_000, 3)
    assert type(config.kv_cache_memory) is int and config.enforce_eager is True
    params = SamplingParams(temperature=np.float32(0.5), min_tokens=np.int64(2), max_tokens=np.int64(8))
    assert type(params.temperature) is float and type(params.min_tokens) is int
    assert SamplingParams(stop=(s for s in ["END"])).stop_strings == ["END"]  # (a generator was used up)


def test_numpy_ids_in_a_plain_list_are_a_prompt(tiny: LLM) -> None:
    want = tiny.generate([[5, 6, 7]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert (
        tiny.generate([np.int64(5), np.int64(6), np.int64(7)], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        == want
    )
