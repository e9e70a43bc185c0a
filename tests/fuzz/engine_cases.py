"""Seeded hostile request bodies for the engine's OpenAI routes: one to a few fields per request set
to a wrong type, an out-of-range value, or a constraint built to break the grammar library (wide,
recursive, contradictory schemas; bad regexes and grammars), tools, tool choices and message
lists of every shape, prompts of token ids out of the vocabulary, and bodies cut or made invalid.

`engine_cases(seed, count, model)` is deterministic: [(path, raw body)].
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from typing import Any

NASTY = [
    "",
    "\x00",
    "\ud800",
    "a\udfffb",
    "\u202e",
    "x" * 5000,
    "data: [DONE]",
    "\r\n\r\n",
    "{{ 7*7 }}",
    "{% for x in range(10**9) %}{% endfor %}",
    "<|im_start|>",
    "<|im_end|>",
]
SCALARS: list[Any] = [
    None,
    True,
    False,
    0,
    -1,
    1,
    2,
    17,
    2**31,
    2**63,
    2**64,
    -(2**63) - 1,
    1e308,
    -1e308,
    0.5,
    -0.5,
    3.7,
    "",
    "x",
    "1",
    "true",
    [],
    {},
    [None],
    [1, 2],
    {"a": 1},
]
SCHEMAS: list[Any] = [
    {"type": "object", "properties": {"a": {"type": "string", "pattern": "(unclosed"}}},
    {"$ref": "#/definitions/x", "definitions": {"x": {"$ref": "#/definitions/x"}}},
    {"type": "object", "properties": {"a": {"$ref": "#/nope"}}},
    {"type": "string", "minLength": 10**9},
    {"type": "array", "minItems": 10**6, "items": {"type": "integer"}},
    {"enum": list(range(5000))},
    {"type": "integer", "minimum": 5, "maximum": 1},
    {"anyOf": [{"type": "object"}] * 500},  # compiles, then outgrows llguidance's parser rows
    {"type": ["string", "null", "object"], "properties": {"x": {"type": "number", "multipleOf": 0}}},
    {"type": "object", "properties": {"k" * 10000: {"type": "string"}}},
    {"format": "date-time", "type": "string"},
    {"type": "object", "additionalProperties": False, "required": ["x"]},
    {"not": {}},
    {},
    True,
    False,
    "string",
    5,
    None,
]
CHAT_FIELDS = [
    "model",
    "messages",
    "stream",
    "stream_options",
    "max_tokens",
    "max_completion_tokens",
    "n",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "stop",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "logprobs",
    "top_logprobs",
    "seed",
    "response_format",
    "structured_outputs",
    "logit_bias",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_tokens",
    "stop_token_ids",
    "ignore_eos",
    "skip_special_tokens",
    "user",
    "stream_token_ids",
    "resume",
    "speculative",
    "functions",
    "function_call",
    "best_of",
    "echo",
    "allowed_token_ids",
    "include_stop_str_in_output",
    "continue_final_message",
    "add_generation_prompt",
    "stream_prompt_tokens",
    "bad_words",
]
TEXT_FIELDS = [
    "model",
    "prompt",
    "stream",
    "stream_options",
    "max_tokens",
    "n",
    "best_of",
    "echo",
    "suffix",
    "stop",
    "logprobs",
    "temperature",
    "top_p",
    "seed",
    "logit_bias",
    "response_format",
    "structured_outputs",
    "min_tokens",
    "stop_token_ids",
    "stream_token_ids",
    "resume",
    "ignore_eos",
    "allowed_token_ids",
    "include_stop_str_in_output",
    "stream_prompt_tokens",
    "truncate_prompt_tokens",
]


class _Gen:
    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        r = self.rng
        self.special: dict[str, Callable[[], Any]] = {
            "messages": self.messages,
            "prompt": self.prompt,
            "tools": self.tools,
            "tool_choice": self.tool_choice,
            "response_format": self.response_format,
            "structured_outputs": self.structured,
            "logit_bias": lambda: r.choice(
                [
                    {"1": 100},
                    {"abc": 1},
                    {"-5": 1},
                    {"99999999": 1},
                    {str(i): 1 for i in range(400)},
                    {"1": 1e308},
                    self.value(),
                ]
            ),
            "stop": lambda: r.choice(["\n", ["a"] * 100, [""], ["x" * 5000], [None], self.value()]),
            "resume": lambda: r.choice(
                [
                    {"token_ids": [1, 2, 3]},
                    {"token_ids": [-1]},
                    {"token_ids": [10**9]},
                    {"token_ids": list(range(5000))},
                    {"token_ids": [1], "id": "a/b"},
                    self.value(),
                ]
            ),
            "stop_token_ids": lambda: r.choice([[0], [-1], [10**10], list(range(1000)), self.value()]),
            "allowed_token_ids": lambda: r.choice(
                [[0], [1, 2, 3], [], [-1], [10**10], list(range(5000)), [True], self.value()]
            ),
            "n": lambda: r.choice([1, 2, 8, 128, 129, 0, self.value()]),
            "max_tokens": lambda: r.choice([1, 4, 16, 10**9, 0, -1, self.value()]),
            "logprobs": lambda: r.choice([True, 5, 20, 21, self.value()]),
            "top_logprobs": lambda: r.choice([0, 5, 20, 21, self.value()]),
            "best_of": lambda: r.choice([1, 2, 3, 200, self.value()]),
            "stream": lambda: r.choice([True, False, self.value()]),
            "stream_options": lambda: r.choice(
                [{"include_usage": True}, {"include_usage": "x"}, self.value()]
            ),
        }

    def value(self, depth: int = 0) -> Any:
        r = self.rng
        roll = r.random()
        if depth < 3 and roll < 0.1:
            return [self.value(depth + 1) for _ in range(r.randint(0, 4))]
        if depth < 3 and roll < 0.2:
            keys = ["type", "a", "json_schema", "schema", "name", "regex", "choice", "grammar"]
            return {r.choice(keys): self.value(depth + 1) for _ in range(r.randint(0, 3))}
        return r.choice(NASTY) if roll < 0.35 else r.choice(SCALARS)

    def response_format(self) -> Any:
        r = self.rng
        roll = r.random()
        if roll < 0.3:
            schema = {
                "name": r.choice(["x", "", "a" * 300, None, 5]),
                "schema": r.choice(SCHEMAS),
                "strict": r.choice([True, False, "yes", None]),
            }
            return {"type": "json_schema", "json_schema": schema}
        if roll < 0.45:
            return {"type": r.choice(["json_object", "text", "regex", "grammar", "", None, 7])}
        return {"type": "json_schema"} if roll < 0.55 else self.value()

    def structured(self) -> Any:
        r = self.rng
        kind = r.choice(["json", "regex", "choice", "grammar", "json_object", "structural_tag", "bogus"])
        what = r.choice(
            [
                r.choice(SCHEMAS),
                "(a",
                "a{1000000}",
                "[",
                "root ::= ",
                "root ::= root",
                ["a"] * 3,
                [],
                [""],
                ["x"] * 5000,
                "\\p{L}+",
                ".*",
                "a" * 100000,
                self.value(),
            ]
        )
        return r.choice([{kind: what}, {kind: what, "json": {}}, self.value()])

    def tools(self) -> Any:
        r = self.rng
        fn = {
            "name": r.choice(["f", "", "a b", "x" * 300, None, 3, "get_weather"]),
            "description": r.choice(["d", None, 5]),
            "parameters": r.choice([*SCHEMAS, self.value()]),
        }
        roll = r.random()
        if roll < 0.5:
            return [
                {"type": r.choice(["function", "f", None]), "function": fn} for _ in range(r.randint(1, 3))
            ]
        return [{"type": "function", "function": fn}] * 300 if roll < 0.6 else self.value()

    def tool_choice(self) -> Any:
        named = {"type": "function", "function": {"name": "f"}}
        missing = {"type": "function", "function": {"name": "missing"}}
        return self.rng.choice(
            ["auto", "none", "required", "any", "", None, named, missing, {"type": "function"}, self.value()]
        )

    def messages(self) -> Any:
        r = self.rng
        roll = r.random()
        if roll < 0.4:
            return [self.message() for _ in range(r.randint(1, 5))]
        if roll < 0.5:
            return [{"role": "user", "content": "hi " * r.choice([1000, 5000, 20000])}]
        return [{"role": "user", "content": "x"}] * r.choice([1000, 10000]) if roll < 0.55 else self.value()

    def message(self) -> dict[str, Any]:
        r = self.rng
        m: dict[str, Any] = {
            "role": r.choice(
                ["user", "system", "assistant", "tool", "developer", "function", "", None, "bogus", 3]
            )
        }
        roll = r.random()
        if roll < 0.4:
            m["content"] = r.choice(["hi", "", None, r.choice(NASTY)])
        elif roll < 0.6:
            parts = [
                {"type": "text", "text": "hi"},
                {"type": "image_url", "image_url": {"url": "http://x"}},
                {"type": "text"},
                {"type": "input_audio"},
                {"text": 5},
                "str",
                None,
                {},
            ]
            m["content"] = [r.choice(parts) for _ in range(r.randint(0, 3))]
        elif roll < 0.7:
            arguments = r.choice(["{}", "{bad", "", None, {"a": 1}, 5])
            call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}
            m["tool_calls"] = r.choice([[call], [{}], "x", [None], []])
        elif roll < 0.8:
            m["tool_call_id"], m["content"] = r.choice(["c1", None, 5, ""]), "r"
        else:
            m[str(self.value())] = self.value()
        return m

    def prompt(self) -> Any:
        return self.rng.choice(
            [
                "hello",
                "",
                [1, 2, 3],
                [[1, 2], [3]],
                [-1],
                [49152],
                [10**12],
                [1.5],
                ["a", "b"],
                ["a"] * 200,
                [[]],
                [],
                [[1] * 600],
                list(range(100, 700)),
                [True],
                None,
                {"a": 1},
                "x" * 100000,
                self.value(),
            ]
        )

    def case(self, model: str) -> tuple[str, bytes]:
        r = self.rng
        chat = r.random() < 0.6
        body: dict[str, Any] = {"model": model, "max_tokens": 4}
        body["messages" if chat else "prompt"] = [{"role": "user", "content": "hello"}] if chat else "hello"
        fields = CHAT_FIELDS if chat else TEXT_FIELDS
        for name in r.sample(fields, r.choice([1, 1, 1, 1, 2])):
            body[name] = self.special.get(name, self.value)()
        if r.random() < 0.05:
            del body[r.choice(list(body))]
        raw = json.dumps(body, ensure_ascii=r.random() < 0.5).encode("utf-8", "surrogatepass")
        if r.random() < 0.03:
            raw = raw[: r.randint(0, len(raw))]
        if r.random() < 0.02:
            raw = raw.replace(b"4", b"NaN", 1)
        return ("/v1/chat/completions" if chat else "/v1/completions"), raw


def engine_cases(seed: int, count: int, model: str) -> list[tuple[str, bytes]]:
    """`count` (path, raw body) pairs from `seed`."""
    gen = _Gen(seed)
    return [gen.case(model) for _ in range(count)]
