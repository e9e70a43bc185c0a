"""Tools and tool history into the prompt: through the model's chat template when it takes them,
else through our own tool prompt.

A template takes tools when it reads a `tools` variable (Qwen2.5, Llama 3.1, Hermes-style ones):
it then gets them, assistant turns with `tool_calls` (arguments as objects, as Hugging Face
templates expect) and `tool` turns, as it wants them. Any other template (the default model's
ChatML among them) gets plain turns: a system message that lists the functions and shows the one
call form the grammar allows, assistant calls written in that form, and tool results as a user
turn in <tool_response> tags (consecutive results joined into one turn, so that templates which
insist on alternating roles still render).
"""

from __future__ import annotations

import json
from typing import Any

from engine.tools.grammar import call_text
from engine.tools.request import ToolRequest

_INSTRUCTIONS = """You can call functions to help with the request. They are listed here, one JSON \
object per line:
{functions}

To call one, write exactly this, with the arguments as a JSON object that fits its parameters:
<tool_call>
{{"name": "<function name>", "arguments": <arguments>}}
</tool_call>
Several calls may follow one another. Each call's result comes back in <tool_response> tags."""


# what our tool prompt writes itself (engine/http/special_text.py leaves them alone)
OWN_MARKERS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")


def template_takes_tools(tokenizer: Any) -> bool:
    """Whether the model's chat template renders a `tools` list itself."""
    template = getattr(tokenizer, "chat_template", None)
    return isinstance(template, str) and "tools" in template


def with_tools(
    messages: list[dict[str, Any]], tools: ToolRequest | None, native: bool
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, tools for the template) for a conversation that may hold tool calls and results.

    `messages` are checked already: role, content (text or None), and for assistant turns an
    optional `tool_calls` list of {"id", "function": {"name", "arguments" (JSON text)}}, for tool
    turns a `tool_call_id`. With tool_choice none the functions are not offered (the answer cannot
    call them), but a history that used them still renders.
    """
    offered = tools is not None and tools.calls_allowed
    if native:
        listed = [f.as_openai() for f in tools.functions] if tools is not None and offered else None
        return [_native(m) for m in messages], listed
    out: list[dict[str, Any]] = []
    # a run of tool results, joined once when it ends: appending each to the turn so far copied the
    # whole turn per result, quadratic on the event loop (20k results in a 2 MB body: seconds)
    results: list[str] = []
    for message in [*messages, None]:
        if results and (message is None or message["role"] != "tool"):
            if out and out[-1]["role"] == "user" and out[-1]["content"].startswith("<tool_response>"):
                results.insert(0, out.pop()["content"])
            out.append({"role": "user", "content": "\n".join(results)})
            results = []
        if message is None:
            break
        role, content = message["role"], message.get("content") or ""
        if role == "assistant" and message.get("tool_calls"):
            calls = [
                call_text(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]
            ]
            out.append({"role": "assistant", "content": "\n".join([content, *calls] if content else calls)})
        elif role == "tool":
            results.append(f"<tool_response>\n{content}\n</tool_response>")
        else:
            out.append({"role": role, "content": content})
    if offered:
        assert tools is not None
        listing = "\n".join(
            json.dumps(f.as_openai()["function"], ensure_ascii=False) for f in tools.functions
        )
        prompt = _INSTRUCTIONS.format(functions=listing)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + prompt}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out, None


def _native(message: dict[str, Any]) -> dict[str, Any]:
    """A turn as Hugging Face chat templates take it (tool call arguments as objects)."""
    out: dict[str, Any] = {"role": message["role"], "content": message.get("content") or ""}
    if message.get("tool_calls"):
        out["tool_calls"] = [
            {
                "id": c.get("id"),
                "type": "function",
                "function": {"name": c["function"]["name"], "arguments": _object(c["function"]["arguments"])},
            }
            for c in message["tool_calls"]
        ]
    if message["role"] == "tool":
        out["tool_call_id"] = message.get("tool_call_id")
    return out


def _object(arguments: str) -> Any:
    """The arguments' JSON text as a value (text that is not JSON stays text)."""
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        return arguments
