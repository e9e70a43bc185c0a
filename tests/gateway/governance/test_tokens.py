"""Token counting for rows without usage: offline tiktoken, the right encoding per model."""

from __future__ import annotations

from pathlib import Path

from gateway.governance import tokens


def test_counts_offline_with_the_models_encoding() -> None:
    assert tokens.encoding_for("openai/gpt-4o-mini") == "o200k_base"
    assert tokens.encoding_for("gpt-3.5-turbo") == "cl100k_base"
    assert tokens.encoding_for("SmolLM2-135M-Instruct") == "cl100k_base"
    assert tokens.count("hello world", "gpt-4o") == 2
    assert tokens.count("", "gpt-4o") == 0
    assert tokens.count("<|endoftext|> is text here", "gpt-3.5-turbo") > 1  # special tokens: plain text


def test_prompt_and_completion_text_from_every_request_and_answer_shape() -> None:
    parts = [{"type": "text", "text": "hi"}, {"type": "image_url"}]
    body = {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": parts}]}
    assert tokens.prompt_text(body) == "be brief\nhi\n"
    assert tokens.prompt_text({"prompt": ["a", "b"]}) == "a\nb" and tokens.prompt_text({"prompt": 3}) == ""
    whole = [{"choices": [{"message": {"content": "answer"}}]}]
    streamed = [{"choices": [{"delta": {"role": "assistant", "content": ""}}]},
                {"choices": [{"delta": {"content": "ans"}}]}, {"choices": [{"delta": {"content": "wer"}}]},
                {"choices": [{"text": "!"}]}, {"choices": []}]  # fmt: skip
    assert tokens.completion_text(whole) == "answer" and tokens.completion_text(streamed) == "answer!"


def test_tools_calls_and_token_id_prompts_are_counted_too() -> None:
    """A 305 KB tools array was billed 1 prompt token, a 30,000-id prompt 0, a tool-call answer 0."""
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
    call = {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": '{"q": "x"}'}}
    body = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [call]}],
            "tools": tools}  # fmt: skip
    text = tokens.prompt_text(body)
    assert "hi" in text and '{"q": "x"}' in text and '"name":"lookup"' in text
    assert tokens.prompt_token_ids({"prompt": [1, 2, 3]}) == 3
    assert tokens.prompt_token_ids({"prompt": [[1, 2], [3]]}) == 3
    assert (
        tokens.prompt_token_ids({"prompt": "text"}) == 0 and tokens.prompt_token_ids({"prompt": ["a"]}) == 0
    )
    streamed = [
        {"choices": [{"delta": {"tool_calls": [{"index": 0, **call}]}}]},
        {"choices": [{"delta": {"tool_calls": [{"index": 0, "function": {"arguments": "more"}}]}}]},
    ]
    assert tokens.completion_text(streamed) == 'lookup{"q": "x"}more'
    whole = [{"choices": [{"message": {"content": None, "function_call": {"name": "f", "arguments": "{}"}}}]}]
    assert tokens.completion_text(whole) == "f{}"


def test_an_engine_tokenizer_from_the_policy_counts_with_the_models_own_vocabulary(
    default_model_dir: Path,
) -> None:
    from tokenizers import Tokenizer

    text = "Switchboard counts tokens the way SmolLM2 does: ünïcödé, 日本語, code()"
    want = len(
        Tokenizer.from_file(str(default_model_dir / "tokenizer.json"))
        .encode(text, add_special_tokens=False)
        .ids
    )
    assert tokens.count(text, "SmolLM2-135M-Instruct", str(default_model_dir)) == want
    assert tokens.count(text, "SmolLM2-135M-Instruct", str(default_model_dir / "tokenizer.json")) == want
    assert want != tokens.count(text, "SmolLM2-135M-Instruct")  # tiktoken's estimate differs


def test_a_missing_tokenizer_falls_back_to_tiktoken(tmp_path: Path) -> None:
    assert not tokens.tokenizer_exists(str(tmp_path))
    assert tokens.count("hello world", "gpt-4o", str(tmp_path)) == tokens.count("hello world", "gpt-4o") == 2


def test_claude_models_are_counted_with_the_bundled_anthropic_tokenizer() -> None:
    text = "hello world, this is Claude"
    claude = tokens.count(text, "anthropic/claude-3-5-haiku-latest")
    assert claude > 0 and claude == tokens.count(text, "claude-3-opus")


def test_count_until_is_exact_under_its_limit_and_stops_early_past_it(default_model_dir: Path) -> None:
    tokenizer = str(default_model_dir)
    words = " ".join(f"w{i % 97}" for i in range(12_000))  # ~60k characters: four pieces
    exact = tokens.count(words, "SmolLM2-135M-Instruct", tokenizer)
    counted = tokens.count_until(words, "SmolLM2-135M-Instruct", tokenizer, exact + 100)
    assert exact - 4 * 4 <= counted <= exact  # pieces cut at spaces: low by at most the slack per cut
    assert tokens.count_until(words, "SmolLM2-135M-Instruct", tokenizer, 1000) > 1000
    assert tokens.count_until("short text", "gpt-4o", None, 1) == tokens.count("short text", "gpt-4o")
    assert tokens.counted_by("x", tokenizer) == tokenizer
    assert tokens.counted_by("anthropic/claude-haiku-4-5") == "anthropic"
    assert tokens.counted_by("openai/gpt-4o") == "o200k_base"
