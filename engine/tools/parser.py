"""Tool calls read back out of an answer decoded under engine.tools.grammar: whole, or as a stream.

The grammar fixes the form (`<tool_call>\\n{"name": "N", "arguments": A}\\n</tool_call>`, calls
separated by newlines, text only before the first), so reading is exact rather than heuristic.
An answer cut short inside a call (max_tokens, a stop string) reads the same whole or streamed, as
OpenAI's do: a call cut after its name is a call with its arguments as far as they came (what the
stream has sent of them); one cut before its name is whole is left out (the stream cannot have
announced it); the markup never reaches the content.
"""

from __future__ import annotations

import json
import secrets
import string
from dataclasses import dataclass

from engine.tools.grammar import CALL_BEGIN, CALL_END

_NAME_OPEN = '\n{"name": "'
_ARGS_OPEN = '", "arguments": '
_CLOSE = "}\n" + CALL_END
_ID_ALPHABET = string.ascii_letters + string.digits


def new_call_id() -> str:
    """An id in OpenAI's style: call_ and 24 letters or digits."""
    return "call_" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(24))


@dataclass
class ToolCall:
    """One call: its id, the function's name and the arguments as JSON text."""

    id: str
    name: str
    arguments: str

    def as_openai(self) -> dict[str, object]:
        """The call as a message's `tool_calls` entry."""
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


def parse_calls(text: str, calls_only: bool = False) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a whole answer; content is None when only calls were written, or when the
    answer can only be calls (`calls_only`: what else an answer cut short holds is its tag's start)."""
    start = _call_start(text)
    if start == -1:
        return (None if calls_only else text), []
    calls: list[ToolCall] = []
    pos = start
    while text.startswith(CALL_BEGIN, pos):
        call = _one_call(text, pos + len(CALL_BEGIN))
        if call is None:  # cut short: the answer ends inside this call
            cut = _cut_call(text, pos + len(CALL_BEGIN))
            calls.extend([] if cut is None else [cut])
            pos = len(text)
            break
        calls.append(call[0])
        pos = call[1]
        while pos < len(text) and text[pos] == "\n":
            pos += 1
    if CALL_BEGIN.startswith(text[pos:]):  # cut inside the next call's tag (or nothing left)
        pos = len(text)
    content = text[:start] + text[pos:]
    return (content if content.strip() and not calls_only else None), calls


def _call_start(text: str) -> int:
    """Where the first call begins: an opening tag followed by the call's form (or by as much of it
    as an answer cut short holds); -1 if none. A tag followed by anything else is text, as the
    stream reads it: an answer in a JSON format beside tools may spell it inside a string, and the
    whole answer was cut there (`{"t": "see `, finish_reason stop)."""
    at = text.find(CALL_BEGIN)
    while at != -1:
        rest = text[at + len(CALL_BEGIN) : at + len(CALL_BEGIN) + len(_NAME_OPEN)]
        if rest.startswith(_NAME_OPEN) or _NAME_OPEN.startswith(rest):
            return at
        at = text.find(CALL_BEGIN, at + 1)
    return -1


def _one_call(text: str, pos: int) -> tuple[ToolCall, int] | None:
    """The call whose body starts at `pos`, and where it ends; None if it is incomplete."""
    if not text.startswith(_NAME_OPEN, pos):
        return None
    name_end = text.find('"', pos + len(_NAME_OPEN))
    if name_end == -1 or not text.startswith(_ARGS_OPEN, name_end):
        return None
    args_start = name_end + len(_ARGS_OPEN)
    try:
        _, args_end = json.JSONDecoder().raw_decode(text, args_start)
    except json.JSONDecodeError:
        return None
    if not text.startswith(_CLOSE, args_end):
        return None
    name = text[pos + len(_NAME_OPEN) : name_end]
    return ToolCall(new_call_id(), name, text[args_start:args_end]), args_end + len(_CLOSE)


def _cut_call(text: str, pos: int) -> ToolCall | None:
    """The call the answer ends inside (its body starts at `pos`), as far as a stream would have
    sent it: None before its name is whole, else its arguments up to where they stopped."""
    if not text.startswith(_NAME_OPEN, pos):
        return None
    name_end = text.find(_ARGS_OPEN, pos + len(_NAME_OPEN))
    if name_end == -1:
        return None
    args_start = name_end + len(_ARGS_OPEN)
    try:
        _, args_end = json.JSONDecoder().raw_decode(text, args_start)
    except json.JSONDecodeError:
        args_end = len(text)  # the arguments themselves were cut
    return ToolCall(new_call_id(), text[pos + len(_NAME_OPEN) : name_end], text[args_start:args_end])


@dataclass
class CallDelta:
    """A piece of a streamed call: id and name once (its first piece), then argument text."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None

    def as_openai(self) -> dict[str, object]:
        """The piece as a `delta.tool_calls` entry."""
        out: dict[str, object] = {"index": self.index}
        if self.id is not None:
            out["id"] = self.id
            out["type"] = "function"
            out["function"] = {"name": self.name, "arguments": self.arguments}
        else:
            out["function"] = {"arguments": self.arguments}
        return out


@dataclass
class StreamedCalls:
    """Reads a streamed answer's text pieces; gives content text and call pieces as they complete.

    Text that may be the start of the opening tag is held back until it is known not to be; an
    argument piece is sent as soon as its characters arrive (the grammar guarantees what follows).
    States: text (content) -> head (up to the arguments: the call's id and name go out) -> args
    (until their object closes) -> tail (the closing tag) -> between (newlines; another call or
    the end).
    """

    calls_only: bool = False  # the answer can only be calls (tool_choice required or named)
    calls: int = 0  # calls begun so far
    _state: str = "text"
    _buffer: str = ""
    _depth: int = 0  # nesting inside the arguments, strings aware
    _opened: bool = False  # the arguments' object has begun
    _in_string: bool = False
    _escaped: bool = False

    def feed(self, piece: str) -> tuple[str, list[CallDelta]]:
        """(content text, call pieces) that `piece` completes."""
        self._buffer += piece
        content = ""
        out: list[CallDelta] = []
        while True:
            buf = self._buffer
            if self._state == "text":
                at = buf.find(CALL_BEGIN)
                if at == -1:
                    keep = _partial_suffix(buf, CALL_BEGIN)
                    content += buf[: len(buf) - keep]
                    self._buffer = buf[len(buf) - keep :]
                    return content, out
                content += buf[:at]
                self._buffer, self._state = buf[at + len(CALL_BEGIN) :], "head"
            elif self._state == "head":
                name_end = buf.find(_ARGS_OPEN, len(_NAME_OPEN)) if buf.startswith(_NAME_OPEN) else -1
                if name_end == -1:
                    if buf.startswith(_NAME_OPEN) or _NAME_OPEN.startswith(buf):
                        return content, out  # the name is not complete yet
                    content += CALL_BEGIN  # not the grammar's form: the tag was text, and what
                    self._state = "text"  # follows it is read as text again (another tag may come)
                    continue
                out.append(CallDelta(self.calls, "", new_call_id(), buf[len(_NAME_OPEN) : name_end]))
                self.calls += 1
                self._buffer, self._state = buf[name_end + len(_ARGS_OPEN) :], "args"
                self._depth, self._opened, self._in_string, self._escaped = 0, False, False, False
            elif self._state == "args":
                end, done = self._scan_arguments()
                if end:
                    out.append(CallDelta(self.calls - 1, buf[:end]))
                self._buffer = buf[end:]
                if not done:
                    return content, out
                self._state = "tail"
            elif self._state == "tail":
                if buf.startswith(_CLOSE):
                    self._buffer, self._state = buf[len(_CLOSE) :], "between"
                elif _CLOSE.startswith(buf):
                    return content, out
                else:
                    content += buf  # not the grammar's form: keep it as text
                    self._buffer, self._state = "", "text"
            else:  # between calls
                rest = buf.lstrip("\n")
                self._buffer = rest
                if rest.startswith(CALL_BEGIN):
                    self._buffer, self._state = rest[len(CALL_BEGIN) :], "head"
                elif not rest or CALL_BEGIN.startswith(rest):
                    return content, out
                else:
                    self._state = "text"

    def _scan_arguments(self) -> tuple[int, bool]:
        """How much of the buffer belongs to the arguments, and whether their object closed there."""
        for i, c in enumerate(self._buffer):
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif c == "\\":
                    self._escaped = True
                elif c == '"':
                    self._in_string = False
            elif c == '"':
                self._in_string = True
            elif c in "{[":
                self._depth += 1
                self._opened = True
            elif c in "}]":
                self._depth -= 1
                if self._depth == 0 and self._opened:
                    return i + 1, True
        return len(self._buffer), False

    def finish(self) -> str:
        """What is still held back, as content (the answer ended there)."""
        rest, self._buffer = self._buffer, ""
        return rest if self._state == "text" and not self.calls_only else ""


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is a proper beginning of `tag`."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0
