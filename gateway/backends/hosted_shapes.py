"""litellm's answers in OpenAI's shapes: its stream chunks (every choice with its delta or text, a
usage chunk without choices), its whole answers without the fields it adds, and a whole answer
sent as the stream of it (several choices, a legacy completion's logprobs: see `whole_for_stream`)."""

from __future__ import annotations

from typing import Any

import orjson


def openai_chunk(chunk: dict[str, Any], chat: bool) -> dict[str, Any] | None:
    """A litellm stream chunk in OpenAI's shape, or None for one that carries nothing: every choice
    has its `delta` (chat) or `text` (completions: the SDK idiom joins them), and the usage chunk
    has no choices (litellm gives it an empty one, and sends an empty chunk after the last)."""
    choices = chunk.get("choices")
    if not isinstance(choices, list):
        return chunk
    field = "delta" if chat else "text"
    for choice in choices:
        if isinstance(choice, dict):
            choice.setdefault(field, {} if chat else "")
    empty = all(
        isinstance(c, dict) and not c.get(field) and c.get("finish_reason") is None and not c.get("logprobs")
        for c in choices
    )
    if empty and choices:
        if chunk.get("usage") is None:
            return None  # nothing in it
        chunk["choices"] = []
    return chunk


def without_litellm_fields(answer: dict[str, Any]) -> dict[str, Any]:
    """A whole answer without the fields litellm adds to it (`provider_specific_fields` on the
    choices and messages): they are not OpenAI's, and an application that sends the SDK's message
    object back in its next turn would send them upstream."""
    choices = answer.get("choices")
    for choice in choices if isinstance(choices, list) else []:
        if isinstance(choice, dict):
            choice.pop("provider_specific_fields", None)
            message = choice.get("message")
            if isinstance(message, dict):
                specific = message.pop("provider_specific_fields", None)
                refusal = specific.get("refusal") if isinstance(specific, dict) else None
                if isinstance(refusal, str) and refusal and not message.get("refusal"):
                    message["refusal"] = refusal  # OpenAI's own field, which litellm moves in there
    answer.pop("provider_specific_fields", None)
    return answer


def whole_for_stream(body: bytes, chat: bool) -> bool:
    """Whether a stream is asked for whole (see `HostedModel.stream`): several answers (n, best_of,
    a list of prompts), or a legacy completion's logprobs."""
    try:
        parsed = orjson.loads(body)
    except orjson.JSONDecodeError:
        return False
    if not isinstance(parsed, dict):
        return False
    n = max([v for v in (parsed.get("n"), parsed.get("best_of")) if type(v) is int] + [1])
    prompt = parsed.get("prompt")
    prompts = isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, str | list) for p in prompt)
    return n > 1 or prompts or (not chat and parsed.get("logprobs") not in (None, False))


def as_stream(answer: dict[str, Any], chat: bool) -> list[str]:
    """A whole answer as the SSE lines of its stream: per choice its content (and tool calls) in one
    delta, then its own finish_reason; then the usage chunk (the relay drops it for a client that
    did not ask for usage); then [DONE]."""
    head: dict[str, Any] = {
        k: answer[k] for k in ("id", "created", "model", "system_fingerprint") if k in answer
    }
    head["object"] = "chat.completion.chunk" if chat else "text_completion"
    lines = []
    given = answer.get("choices")
    choices: list[Any] = given if isinstance(given, list) else []
    for choice in choices:
        if not isinstance(choice, dict):
            continue
        index, logprobs = choice.get("index", 0), choice.get("logprobs")
        if chat:
            said = choice.get("message")
            message: dict[str, Any] = said if isinstance(said, dict) else {}
            delta: dict[str, Any] = {"role": "assistant", "content": message.get("content") or ""}
            calls = message.get("tool_calls")
            if isinstance(calls, list) and calls:
                delta["tool_calls"] = [{"index": j, **c} for j, c in enumerate(calls) if isinstance(c, dict)]
            if message.get("refusal"):
                delta["refusal"] = message["refusal"]
            first = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": None}
            last = {"index": index, "delta": {}, "finish_reason": choice.get("finish_reason")}
        else:
            first = {
                "index": index,
                "text": choice.get("text") or "",
                "logprobs": logprobs,
                "finish_reason": None,
            }
            last = {"index": index, "text": "", "finish_reason": choice.get("finish_reason")}
        lines += ["data: " + orjson.dumps({**head, "choices": [part]}).decode() for part in (first, last)]
    if answer.get("usage") is not None:
        lines.append("data: " + orjson.dumps({**head, "choices": [], "usage": answer["usage"]}).decode())
    return [*lines, "data: [DONE]"]
