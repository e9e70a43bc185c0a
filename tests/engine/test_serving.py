"""Request fields -> SamplingParams, and the model's generation_config defaults."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.http.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    build_sampling_params,
)
from engine.model_info import load_generation_defaults


def _chat(**fields: object) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], **fields})


def test_model_defaults_fill_only_absent_fields(tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"temperature": 0.3, "top_p": 0.8, "top_k": 20, "do_sample": True, "eos_token_id": 2})
    )
    defaults = load_generation_defaults(tmp_path)
    assert defaults == {"temperature": 0.3, "top_p": 0.8, "top_k": 20.0}
    implicit = build_sampling_params(_chat(), None, None, defaults)
    assert (implicit.temperature, implicit.top_p, implicit.top_k) == (0.3, 0.8, 20)
    explicit = build_sampling_params(_chat(temperature=1.0, top_p=1.0, top_k=-1), None, None, defaults)
    assert (explicit.temperature, explicit.top_p, explicit.effective_top_k) == (1.0, 1.0, 0)


def test_openai_defaults_without_a_generation_config(tmp_path: Path) -> None:
    assert load_generation_defaults(tmp_path) == {}
    (tmp_path / "generation_config.json").write_text("not json")
    assert load_generation_defaults(tmp_path) == {}
    p = build_sampling_params(_chat(), 7, None, {})
    assert (p.temperature, p.top_p, p.n, p.max_tokens, p.stop_strings) == (1.0, 1.0, 1, 7, [])


def test_top_p_zero_means_greedy() -> None:
    p = build_sampling_params(_chat(top_p=0.0), None, None, {})
    assert p.is_greedy and p.top_p == 1.0


def test_stop_accepts_a_string_or_a_list_and_rejects_anything_else() -> None:
    assert build_sampling_params(_chat(stop="END"), None, None, {}).stop_strings == ["END"]
    assert build_sampling_params(_chat(stop=["a", "b"]), None, None, {}).stop_strings == ["a", "b"]
    for bad in (5, ["a", 3], [""]):
        with pytest.raises(APIError) as info:
            build_sampling_params(_chat(stop=bad), None, None, {})
        assert info.value.status == 400 and info.value.param == "stop"


def test_completion_logprobs_become_the_engine_top_k() -> None:
    req = CompletionRequest.model_validate({"prompt": "x", "logprobs": 3})
    assert build_sampling_params(req, 4, req.logprobs, {}).logprobs == 3


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("prompt_logprobs", 1),
        ("logits_processors", ["x"]),
        ("continue_final_message", True),
        ("add_generation_prompt", False),
        ("chat_template", "{{ messages }}"),
        ("chat_template_kwargs", {"enable_thinking": False}),
        ("return_tokens_as_token_ids", True),  # logprob tokens would be "token_id:N"
        ("return_token_ids", True),
        ("use_beam_search", True),
    ],
)
def test_a_vllm_extension_that_would_change_the_answer_is_a_400_naming_it(field: str, value: object) -> None:
    """Ignored like an unknown field, it would leave the client an answer that disregards it
    (allowed_token_ids and bad_words constrain the output, as the removed guided_* fields did)."""
    from engine.http.protocol import validation_error

    chat_reads_it = field in ("continue_final_message", "add_generation_prompt")  # a chat's own switches
    for model in (CompletionRequest,) if chat_reads_it else (ChatCompletionRequest, CompletionRequest):
        base = (
            {"messages": [{"role": "user", "content": "x"}]}
            if model is ChatCompletionRequest
            else {"prompt": "x"}
        )
        with pytest.raises(Exception) as err:
            model.model_validate({**base, field: value})
        error = validation_error(err.value)  # type: ignore[arg-type]
        assert error.status == 400 and error.param == field and "not supported" in error.message


def test_the_neutral_values_of_vllms_extensions_pass() -> None:
    """A client (or a vLLM SDK wrapper) that always sends the defaults is not refused."""
    neutral = {"allowed_token_ids": None, "bad_words": [], "include_stop_str_in_output": False,
               "prompt_logprobs": None, "truncate_prompt_tokens": None, "logits_processors": None,
               "continue_final_message": False, "add_generation_prompt": True, "chat_template": None,
               "chat_template_kwargs": {}}  # fmt: skip
    assert _chat(**neutral).messages


def test_the_chat_template_switches_open_the_assistants_turn_leave_the_last_message_open_or_neither() -> None:
    """vLLM's continue_final_message (an answer "prefilled" by the client) and add_generation_prompt."""
    from engine.http.protocol import TemplateOptions

    prefilled = [{"role": "user", "content": "x"}, {"role": "assistant", "content": '{"city": "'}]
    assert _chat().template_options() == TemplateOptions(True, False)
    assert _chat(add_generation_prompt=False).template_options() == TemplateOptions(False, False)
    asked = ChatCompletionRequest.model_validate({"messages": prefilled, "continue_final_message": True})
    assert asked.template_options() == TemplateOptions(False, True)
    for fields, param in (
        ({"continue_final_message": True}, "continue_final_message"),  # the last message is the user's
        ({"messages": prefilled, "continue_final_message": True, "add_generation_prompt": True},
         "add_generation_prompt"),
    ):  # fmt: skip
        with pytest.raises(APIError) as info:
            ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], **fields}
                                                 ).template_options()  # fmt: skip
        assert info.value.status == 400 and info.value.param == param


def test_a_chat_before_the_model_has_loaded_is_a_503_that_says_so(tiny_chat_model: Path) -> None:
    """Not a 400 "this model has no tokenizer": the client (or the gateway) retries a 503."""
    import asyncio

    from engine.async_engine import AsyncLLMEngine
    from engine.config import EngineConfig
    from engine.engine_state import EngineUnavailableError
    from engine.http.error_mapping import api_error
    from engine.http.serving import OpenAIServing

    engine = AsyncLLMEngine(EngineConfig(model=str(tiny_chat_model), kv_cache_memory=32 << 20), "tiny")
    serving = OpenAIServing(engine, ["tiny"])  # not started: no model loaded
    request = _chat(max_tokens=4)
    with pytest.raises(EngineUnavailableError) as info:
        asyncio.run(serving.chat(request))
    error = api_error(info.value)
    assert error.status == 503 and error.code in ("engine_loading", "engine_stopped")


def test_a_text_completion_with_a_stray_messages_field_still_refuses_the_template_switches() -> None:
    from engine.http.protocol import validation_error

    with pytest.raises(Exception) as err:
        CompletionRequest.model_validate({"prompt": "x", "messages": 1, "continue_final_message": True})
    assert validation_error(err.value).param == "continue_final_message"  # type: ignore[arg-type]


@pytest.mark.parametrize("choice", ["auto", "required"])
def test_tools_beside_a_format_that_is_not_json_is_a_400_whatever_the_tool_choice(choice: str) -> None:
    from engine.guided import GuidedDecodingError

    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    request = _chat(tools=tools, tool_choice=choice, structured_outputs={"regex": "a+"})
    with pytest.raises(GuidedDecodingError) as info:
        request.guided_spec()
    assert info.value.param == "structured_outputs"
    json_format = _chat(tools=tools, tool_choice=choice, response_format={"type": "json_object"})
    assert json_format.guided_spec() is not None  # a JSON format goes with them


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("field", ["temperature", "top_p", "presence_penalty", "frequency_penalty"])
def test_nan_and_infinities_are_refused_as_such_not_as_out_of_range(field: str, value: float) -> None:
    """Python's JSON reader takes NaN and Infinity; a NaN temperature was told "less than or equal to 2"."""
    from engine.http.protocol import validation_error

    with pytest.raises(Exception) as err:
        ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], field: value})
    error = validation_error(err.value)  # type: ignore[arg-type]
    assert error.status == 400 and error.param == field and "finite" in error.message, error.message


def test_a_chats_echo_and_usage_on_every_chunk_are_refused_not_ignored() -> None:
    """Ignored, a chat's `echo` left out the last message vLLM prepends, and continuous_usage_stats
    left every chunk's usage null."""
    from engine.http.protocol import validation_error

    chat = {"messages": [{"role": "user", "content": "x"}]}
    every_chunk = {"stream": True, "stream_options": {"continuous_usage_stats": True}}
    for model, base, extra, param in (
        (ChatCompletionRequest, chat, {"echo": True}, "echo"),
        (ChatCompletionRequest, chat, every_chunk, "stream_options.continuous_usage_stats"),
        (CompletionRequest, {"prompt": "x"}, every_chunk, "stream_options.continuous_usage_stats"),
    ):
        with pytest.raises(Exception) as err:
            model.model_validate({**base, **extra})
        error = validation_error(err.value)  # type: ignore[arg-type]
        assert error.status == 400 and error.param == param and "not supported" in error.message
    assert CompletionRequest.model_validate({"prompt": "x", "echo": True}).echo  # a text completion's: served
    neutral = {"echo": False, "stream": True, "stream_options": {"continuous_usage_stats": False}}
    ChatCompletionRequest.model_validate({**chat, **neutral})
