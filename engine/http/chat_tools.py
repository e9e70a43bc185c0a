"""Tool calls in chat answers, as OpenAI gives them: `message.tool_calls` in a whole answer,
`delta.tool_calls` pieces in a stream (index, id, type and name once, then the arguments in
pieces), and finish_reason "tool_calls" when an answer that ended by itself made calls (a stop
string or a `stop_token_ids` token that ends it is a "stop": the call it cut is not whole; so is
the call to a named function, as OpenAI, and vLLM since 0.11, end it).
A request in the legacy `functions` spelling gets the legacy answer: `message.function_call`
(`delta.function_call` pieces) and "function_call", as OpenAI answers it; its client reads nothing else.

The answer was decoded under engine.tools.grammar, so the calls are read exactly
(engine.tools.parser). With tool_choice none, or without tools, the text is passed as it is.
"""

from __future__ import annotations

from typing import Any

from engine.tools.parser import StreamedCalls, parse_calls
from engine.tools.request import ToolRequest


def reads_calls(tools: ToolRequest | None) -> bool:
    """Whether the answer may hold calls to read out of it."""
    return tools is not None and tools.calls_allowed


def whole_message(
    text: str, finish_reason: str | None, tools: ToolRequest | None, stop_reason: int | str | None = None
) -> tuple[dict[str, Any], str | None]:
    """(message, finish_reason) of one choice of a whole answer."""
    if not reads_calls(tools):
        return {"role": "assistant", "content": text}, finish_reason
    content, calls = parse_calls(text, tools is not None and tools.calls_only)
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if not calls:
        return message, finish_reason
    assert tools is not None
    if tools.legacy:  # parallel calls are off: one call
        message["function_call"] = calls[0].as_openai()["function"]
    else:
        message["tool_calls"] = [c.as_openai() for c in calls]
    return message, finish_reason if tools.named else _reason(finish_reason, stop_reason, tools.legacy)


class StreamedChoices:
    """The stream readers of a request's n choices."""

    def __init__(self, n: int, calls_only: bool = False, legacy: bool = False, named: bool = False) -> None:
        self._readers = [StreamedCalls(calls_only) for _ in range(n)]
        self._legacy = legacy
        self._named = named  # a named function's call ends as the answer did ("stop")

    def deltas(self, index: int, text: str) -> list[dict[str, Any]]:
        """The deltas (content, or one call piece each) a choice's new text completes, in order."""
        content, calls = self._readers[index].feed(text)
        out: list[dict[str, Any]] = [{"content": content}] if content else []
        for call in calls:
            piece = call.as_openai()
            out.append({"function_call": piece["function"]} if self._legacy else {"tool_calls": [piece]})
        return out

    def finish(
        self, index: int, finish_reason: str, stop_reason: int | str | None = None
    ) -> tuple[list[dict[str, Any]], str]:
        """The deltas still held back when a choice ends, and its finish_reason."""
        reader = self._readers[index]
        rest = reader.finish()
        calls = reader.calls and not self._named
        reason = _reason(finish_reason, stop_reason, self._legacy) if calls else finish_reason
        return ([{"content": rest}] if rest else []), reason or finish_reason


def _reason(finish_reason: str | None, stop_reason: int | str | None, legacy: bool = False) -> str | None:
    """An answer with calls: "tool_calls" ("function_call" in the legacy spelling) when it ended by
    itself (EOS, the grammar's end), else as it ended (a stop string or stop token cut it; max_tokens)."""
    if finish_reason == "stop" and stop_reason is None:
        return "function_call" if legacy else "tool_calls"
    return finish_reason
