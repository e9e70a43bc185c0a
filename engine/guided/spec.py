"""GuidedSpec: what one request constrains its output to, checked at the boundary.

A spec is immutable and hashable on its constraint alone (not on `param`, the field to blame), so
equal constraints from different requests share one compile-cache entry. Builders take the
request's own shapes: OpenAI's `response_format`, and vLLM's `structured_outputs` object under its
current field names (the older `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`
were removed in vLLM 0.12). Only the shape is checked here; whether the grammar library can compile
a schema, regex or grammar is the compiler's to say (`engine.guided.compiler`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from engine.guided.errors import GuidedDecodingError
from engine.guided.finite import has_finite_instance

GuidedKind = Literal["json_schema", "json_object", "regex", "choice", "grammar", "structural_tag"]

_SHAPE = "invalid_value"  # the code of a request field in the wrong shape, not of a constraint
_SCHEMA_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
# vLLM's options beside the constraint; disable_fallback is accepted and has no effect (one library)
_OPTIONS = (
    "disable_any_whitespace",
    "disable_additional_properties",
    "whitespace_pattern",
    "disable_fallback",
)


# Whitespace between two JSON tokens when a request allows any: up to 16 spaces or tabs, or one or
# two line breaks and up to 48 of indentation (pretty-printed JSON 12 levels deep at 4 spaces).
# llguidance's own default, [\x20\x0A\x0D\x09]+, has no bound, and a model can then spend every
# token on whitespace: 8 of 8 seeded outputs of a small random model ran out of max_tokens so.
BOUNDED_WHITESPACE = r"(?:[\x20\x09]{1,16}|[\x20\x09]{0,2}(?:\x0D?\x0A){1,2}[\x20\x09]{0,48})"


@dataclass(frozen=True)
class GuidedSpec:
    """One constraint: its kind, its canonical source text and the JSON layout options."""

    kind: GuidedKind
    # compact JSON for json_schema / choice / structural_tag; the pattern or grammar otherwise
    text: str
    any_whitespace: bool = True  # JSON kinds: whitespace allowed between tokens
    whitespace_pattern: str | None = None  # JSON kinds: a regex for that whitespace instead
    param: str | None = field(default=None, compare=False)  # the request field a 400 names
    # specs this one is built from (each function's parameters in a tools grammar): when the whole
    # is refused, the first refused part is named instead (`tools[1].function.parameters`)
    parts: tuple[GuidedSpec, ...] = field(default=(), compare=False)

    @classmethod
    def json_schema(
        cls,
        schema: Any,
        *,
        param: str = "response_format.json_schema.schema",
        any_whitespace: bool = True,
        whitespace_pattern: str | None = None,
        close_objects: bool = False,
    ) -> GuidedSpec:
        """A JSON schema (a dict, or its JSON text). close_objects: additionalProperties false by default."""
        code = "invalid_json_schema"
        value = _json_value(schema, param, "the JSON schema", code)
        if not isinstance(value, dict):
            raise GuidedDecodingError("the JSON schema must be a JSON object", param=param, code=code)
        if "x-guidance" in value:  # llguidance's own options (lenient: unimplemented keywords ignored)
            message = "x-guidance is not accepted in a schema: the server sets the grammar engine's options"
            raise GuidedDecodingError(message, param=param, code=code)
        if close_objects:
            try:
                value = _closed(value)
            except RecursionError:
                raise GuidedDecodingError(
                    "the JSON schema is nested too deeply", param=param, code=code
                ) from None
        if (inexact := _inexact_integer(value)) is not None:
            keyword, number = inexact
            message = (
                f"the JSON schema's {keyword} holds the integer {number}, past 2^53: the grammar engine "
                "reads a schema's numbers as doubles and would round it, and the answer could break "
                "the schema (a 64-bit id: spell it as a string; bounds: within 2^53)"
            )
            raise GuidedDecodingError(message, param=param, code=code)
        if not has_finite_instance(value):
            message = (
                "the JSON schema has no finite instance: a $ref cycle runs through required "
                "properties (or non-empty arrays), so every answer would nest forever"
            )
            raise GuidedDecodingError(message, param=param, code=code)
        text = _compact(value, param, code)
        return cls("json_schema", text, any_whitespace, _pattern(whitespace_pattern), param)

    @classmethod
    def json_object(
        cls,
        *,
        param: str = "response_format",
        any_whitespace: bool = True,
        whitespace_pattern: str | None = None,
    ) -> GuidedSpec:
        """Any JSON object (OpenAI's json_object mode)."""
        return cls("json_object", '{"type":"object"}', any_whitespace, _pattern(whitespace_pattern), param)

    @classmethod
    def regex(cls, pattern: Any, *, param: str = "structured_outputs.regex") -> GuidedSpec:
        """The whole output matches `pattern` (Rust regex syntax, anchored at both ends)."""
        return cls("regex", _text(pattern, param, "the regex"), param=param)

    @classmethod
    def choice(cls, choices: Any, *, param: str = "structured_outputs.choice") -> GuidedSpec:
        """The output is exactly one of `choices`."""
        if not isinstance(choices, list) or not choices:
            raise GuidedDecodingError("choice must be a non-empty list of strings", param=param)
        if not all(isinstance(c, str) and c for c in choices):
            raise GuidedDecodingError("every choice must be a non-empty string", param=param)
        return cls("choice", _compact(choices, param), param=param)

    @classmethod
    def grammar(cls, text: Any, *, param: str = "structured_outputs.grammar") -> GuidedSpec:
        """A context-free grammar: Lark syntax, or GBNF/EBNF (`root ::= ...`), which is converted."""
        return cls("grammar", _text(text, param, "the grammar"), param=param)

    @classmethod
    def structural_tag(cls, tag: Any, *, param: str = "structured_outputs.structural_tag") -> GuidedSpec:
        """Free text in which each `begin` ... `end` region follows its JSON schema (tool calls).

        vLLM's shape: {"structures": [{"begin", "schema", "end"}], "triggers": [...]}, each begin
        starting with one of the triggers (the text that switches the constraint on).
        """
        value = _json_value(tag, param, "the structural tag")
        if not isinstance(value, dict):
            raise GuidedDecodingError("the structural tag must be a JSON object", param=param)
        structures, triggers = value.get("structures"), value.get("triggers")
        if (
            not isinstance(triggers, list)
            or not triggers
            or not all(isinstance(t, str) and t for t in triggers)
        ):
            raise GuidedDecodingError("triggers must be a non-empty list of non-empty strings", param=param)
        if not isinstance(structures, list) or not structures:
            raise GuidedDecodingError("structures must be a non-empty list", param=param)
        for i, s in enumerate(structures):
            where = f"structures[{i}]"
            if (
                not isinstance(s, dict)
                or not isinstance(s.get("begin"), str)
                or not isinstance(s.get("end"), str)
            ):
                raise GuidedDecodingError(f"{where} needs string begin and end", param=param)
            if not isinstance(s.get("schema"), dict):
                raise GuidedDecodingError(f"{where}.schema must be a JSON object", param=param)
            if not any(s["begin"].startswith(t) for t in triggers):
                raise GuidedDecodingError(f"{where}.begin starts with none of the triggers", param=param)
        tidy = {"structures": [{k: s[k] for k in ("begin", "schema", "end")} for s in structures]}
        return cls("structural_tag", _compact(tidy | {"triggers": triggers}, param), param=param)

    def inline_json(self) -> str:
        """A JSON kind's schema for a Lark grammar's `%json` (one rule of a larger grammar), with the
        whitespace options the compiler gives it alone (llguidance reads them from `x-guidance`)."""
        assert self.kind in ("json_schema", "json_object")
        options: dict[str, Any] = {"whitespace_flexible": self.any_whitespace}
        if self.whitespace_pattern is not None:
            options["whitespace_pattern"] = self.whitespace_pattern
        elif self.any_whitespace:
            options["whitespace_pattern"] = BOUNDED_WHITESPACE
        return json.dumps({**json.loads(self.text), "x-guidance": options}, separators=(",", ":"))

    def trigger_of(self, begin: str) -> str:
        """The longest trigger `begin` starts with (structural tags only)."""
        assert self.kind == "structural_tag"
        triggers: list[str] = json.loads(self.text)["triggers"]
        return max((t for t in triggers if begin.startswith(t)), key=len)


def from_response_format(response_format: Any) -> GuidedSpec | None:
    """OpenAI's response_format (text / json_object / json_schema; vLLM's structural_tag too), or None."""
    param = "response_format"
    if response_format is None:
        return None
    if not isinstance(response_format, Mapping):
        raise GuidedDecodingError("response_format must be an object", code=_SHAPE, param=param)
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return GuidedSpec.json_object(param=param)
    if kind == "structural_tag":
        body = {k: response_format.get(k) for k in ("structures", "triggers")}
        return GuidedSpec.structural_tag(body, param=param)
    if kind != "json_schema":
        raise GuidedDecodingError(
            f"response_format.type must be text, json_object, json_schema or structural_tag, not {kind!r}",
            code=_SHAPE,
            param="response_format.type",
        )
    schema_format = response_format.get("json_schema")
    if not isinstance(schema_format, Mapping):
        raise GuidedDecodingError(
            "response_format.json_schema must be an object", code=_SHAPE, param="response_format.json_schema"
        )
    name = schema_format.get("name")
    if not isinstance(name, str) or not _SCHEMA_NAME.fullmatch(name):
        raise GuidedDecodingError(
            "response_format.json_schema.name must be 1-64 letters, digits, _ or -",
            code=_SHAPE,
            param="response_format.json_schema.name",
        )
    if schema_format.get("strict") is not None and not isinstance(schema_format.get("strict"), bool):
        raise GuidedDecodingError(
            "strict must be a boolean", code=_SHAPE, param="response_format.json_schema.strict"
        )
    # strict or not, the output is held to the schema: constrained decoding has no best-effort mode
    if schema_format.get("schema") is None:
        return GuidedSpec.json_object(param="response_format.json_schema")
    return GuidedSpec.json_schema(schema_format["schema"], param="response_format.json_schema.schema")


def from_structured_outputs(options: Any) -> GuidedSpec:
    """vLLM's `structured_outputs` object: exactly one of json, regex, choice, grammar, json_object,
    structural_tag, with disable_any_whitespace / disable_additional_properties / whitespace_pattern."""
    param = "structured_outputs"
    if not isinstance(options, Mapping):
        raise GuidedDecodingError("structured_outputs must be an object", code=_SHAPE, param=param)
    unknown = sorted(set(options) - set(_CONSTRAINTS) - set(_OPTIONS))
    if unknown:
        raise GuidedDecodingError(
            f"unknown structured_outputs field {unknown[0]!r}", code=_SHAPE, param=f"{param}.{unknown[0]}"
        )
    given = [k for k in _CONSTRAINTS if options.get(k) is not None and options.get(k) is not False]
    if len(given) != 1:
        raise GuidedDecodingError(
            f"structured_outputs takes exactly one of {', '.join(_CONSTRAINTS)} (got {len(given)})",
            code=_SHAPE,
            param=param,
        )
    for flag in ("disable_any_whitespace", "disable_additional_properties"):
        if not isinstance(options.get(flag, False), bool):
            raise GuidedDecodingError(f"{flag} must be a boolean", code=_SHAPE, param=f"{param}.{flag}")
    which, value = given[0], options[given[0]]
    where = f"{param}.{which}"
    any_whitespace = not options.get("disable_any_whitespace", False)
    pattern = _pattern(options.get("whitespace_pattern"), f"{param}.whitespace_pattern")
    if which == "json":
        close = bool(options.get("disable_additional_properties", False))
        return GuidedSpec.json_schema(
            value, param=where, close_objects=close, any_whitespace=any_whitespace, whitespace_pattern=pattern
        )
    if which == "json_object":
        if value is not True:
            raise GuidedDecodingError("json_object must be true", param=where)
        return GuidedSpec.json_object(param=where, any_whitespace=any_whitespace, whitespace_pattern=pattern)
    if which == "regex":
        return GuidedSpec.regex(value, param=where)
    if which == "choice":
        return GuidedSpec.choice(value, param=where)
    if which == "grammar":
        return GuidedSpec.grammar(value, param=where)
    return GuidedSpec.structural_tag(value, param=where)


_EXACT_INTEGERS = 1 << 53  # a double holds every integer up to it, and not all past it
_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")
_VALUES = ("const", "enum")


def _inexact_integer(schema: Any) -> tuple[str, int] | None:
    """(keyword, integer) of the first bound, const or enum value that llguidance, which reads a
    schema's numbers as doubles, would round: `const: 9007199254740993` gave 9007199254740992, an
    enum of 64-bit ids gave ids outside it, and both bounds at 2^62 + 1 gave 2^62 (finish "stop")."""
    stack: list[Any] = [schema]
    while stack:
        node = stack.pop()
        items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        for key, value in items:
            if key in _BOUNDS and _past_exact(value):
                return str(key), value
            if key in _VALUES and (found := _integer_past_exact(value)) is not None:
                return str(key), found
            if isinstance(value, dict | list):
                stack.append(value)
    return None


def _past_exact(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and abs(value) > _EXACT_INTEGERS


def _integer_past_exact(value: Any) -> int | None:
    """The first integer past 2^53 anywhere in a const's or an enum's value."""
    stack = [value]
    while stack:
        node = stack.pop()
        if _past_exact(node):
            return int(node)
        if isinstance(node, dict):
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return None


def _json_value(value: Any, param: str, what: str, code: str = "invalid_grammar") -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError as exc:
            raise GuidedDecodingError(f"{what} is not valid JSON: {exc}", param=param, code=code) from exc
        except RecursionError:  # nested deeper than Python's stack (a body's own JSON is bounded)
            raise GuidedDecodingError(f"{what} is nested too deeply", param=param, code=code) from None
        except ValueError as exc:  # an integer past Python's digit limit
            raise GuidedDecodingError(f"{what} cannot be read: {exc}", param=param, code=code) from exc
    return value


def _compact(value: Any, param: str, code: str = "invalid_grammar") -> str:
    """Key order kept: a schema's property order is the order the output writes them in."""
    try:
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise GuidedDecodingError(f"not representable as JSON: {exc}", param=param, code=code) from exc
    except RecursionError:
        raise GuidedDecodingError("nested too deeply", param=param, code=code) from None


def _text(value: Any, param: str, what: str) -> str:
    if not isinstance(value, str) or not value:
        raise GuidedDecodingError(f"{what} must be a non-empty string", param=param)
    return value


def _pattern(value: Any, param: str = "structured_outputs.whitespace_pattern") -> str | None:
    if value is None:
        return None
    return _text(value, param, "whitespace_pattern")


# where a JSON schema nests schemas: one, a list of them, or a map of name -> schema
_SUBSCHEMA = ("items", "additionalProperties", "not", "if", "then", "else", "contains")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")


def _closed(schema: Any) -> Any:
    """The schema with additionalProperties: false on every object schema that leaves it unset.

    Walks only the keywords that hold schemas, so data (enum, const, default) is left as it is.
    """
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMA:
        if isinstance(out.get(key), dict):
            out[key] = _closed(out[key])
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [_closed(s) for s in out[key]]
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: _closed(s) for name, s in out[key].items()}
    if (out.get("type") == "object" or "properties" in out) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out
