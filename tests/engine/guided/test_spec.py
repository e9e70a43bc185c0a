"""GuidedSpec: request shapes become one canonical constraint, or a 400 naming the field at fault."""

from __future__ import annotations

import json
from typing import Any

import pytest

from engine.errors import InvalidRequestError
from engine.guided import GuidedDecodingError, GuidedSpec, from_response_format, from_structured_outputs

SCHEMA = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}


def _error(call: Any, *args: Any, **kwargs: Any) -> GuidedDecodingError:
    with pytest.raises(GuidedDecodingError) as info:
        call(*args, **kwargs)
    return info.value


def test_response_format_json_schema_keeps_property_order_and_equals_the_same_schema_as_text() -> None:
    spec = from_response_format({"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}})
    assert spec is not None and spec.kind == "json_schema"
    assert list(json.loads(spec.text)["properties"]) == ["b", "a"]  # the output writes them in this order
    assert spec.param == "response_format.json_schema.schema"
    same = GuidedSpec.json_schema(json.dumps(SCHEMA, indent=2), param="structured_outputs.json")
    assert same == spec and hash(same) == hash(spec)  # one cache entry, whatever field it came through


def test_response_format_text_means_no_constraint_and_json_object_means_any_object() -> None:
    assert from_response_format(None) is None
    assert from_response_format({"type": "text"}) is None
    spec = from_response_format({"type": "json_object"})
    assert spec is not None and spec.kind == "json_object"


@pytest.mark.parametrize(
    ("response_format", "param"),
    [
        ({"type": "xml"}, "response_format.type"),
        ({"type": "json_schema"}, "response_format.json_schema"),
        (
            {"type": "json_schema", "json_schema": {"name": "has space", "schema": {}}},
            "response_format.json_schema.name",
        ),
        (
            {"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "strict": "yes"}},
            "response_format.json_schema.strict",
        ),
        (
            {"type": "json_schema", "json_schema": {"name": "x", "schema": "{not json"}},
            "response_format.json_schema.schema",
        ),
        (
            {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}},
            "response_format.json_schema.schema",
        ),
    ],
)
def test_a_malformed_response_format_is_a_400_naming_the_field(response_format: Any, param: str) -> None:
    exc = _error(from_response_format, response_format)
    assert isinstance(exc, InvalidRequestError)
    assert (exc.status, exc.type, exc.param) == (400, "invalid_request_error", param)


def test_structured_outputs_maps_each_constraint_under_vllms_current_field_names() -> None:
    assert from_structured_outputs({"json": SCHEMA}).kind == "json_schema"
    assert from_structured_outputs({"json_object": True}).kind == "json_object"
    assert from_structured_outputs({"regex": "[a-z]+"}).text == "[a-z]+"
    assert json.loads(from_structured_outputs({"choice": ["yes", "no"]}).text) == ["yes", "no"]
    assert from_structured_outputs({"grammar": 'root ::= "a"'}).kind == "grammar"
    tag = {"structures": [{"begin": "<f>", "schema": {}, "end": "</f>"}], "triggers": ["<f"]}
    spec = from_structured_outputs({"structural_tag": json.dumps(tag)})
    assert spec.kind == "structural_tag" and spec.trigger_of("<f>") == "<f"


def test_structured_outputs_options_set_the_json_layout_and_close_objects() -> None:
    spec = from_structured_outputs(
        {"json": SCHEMA, "disable_any_whitespace": True, "disable_additional_properties": True}
    )
    assert not spec.any_whitespace
    assert json.loads(spec.text)["additionalProperties"] is False
    nested = {"type": "object", "properties": {"o": {"type": "object", "const": {"type": "object"}}}}
    closed = json.loads(GuidedSpec.json_schema(nested, close_objects=True).text)
    assert closed["properties"]["o"]["additionalProperties"] is False
    assert closed["properties"]["o"]["const"] == {"type": "object"}  # data is not a schema: untouched


@pytest.mark.parametrize(
    ("options", "param"),
    [
        ({}, "structured_outputs"),
        ({"regex": "a", "choice": ["a"]}, "structured_outputs"),
        ({"guided_regex": "a"}, "structured_outputs.guided_regex"),
        ({"choice": []}, "structured_outputs.choice"),
        ({"choice": ["a", ""]}, "structured_outputs.choice"),
        ({"regex": ""}, "structured_outputs.regex"),
        ({"grammar": 3}, "structured_outputs.grammar"),
        ({"json_object": "yes"}, "structured_outputs.json_object"),
        ({"json": "{", "disable_any_whitespace": 1}, "structured_outputs.disable_any_whitespace"),
        ({"structural_tag": {"structures": [], "triggers": ["<f"]}}, "structured_outputs.structural_tag"),
        (
            {
                "structural_tag": {
                    "structures": [{"begin": "<g>", "schema": {}, "end": ""}],
                    "triggers": ["<f"],
                }
            },
            "structured_outputs.structural_tag",
        ),
    ],
)
def test_a_malformed_structured_outputs_is_a_400_naming_the_field(
    options: dict[str, Any], param: str
) -> None:
    exc = _error(from_structured_outputs, options)
    assert (exc.status, exc.param) == (400, param)
    assert str(exc)


def test_a_schema_that_is_not_json_says_so() -> None:
    exc = _error(GuidedSpec.json_schema, '{"type": ', param="structured_outputs.json")
    assert exc.code == "invalid_json_schema" and "not valid JSON" in str(exc)


BIG = 2**53 + 1  # the first integer a double cannot hold


@pytest.mark.parametrize(
    ("schema", "keyword"),
    [
        ({"const": BIG}, "const"),
        ({"type": "object", "properties": {"id": {"enum": [2, 12345678901234567]}}}, "enum"),
        ({"const": {"ids": [1, 2**70]}}, "const"),
        ({"type": "integer", "minimum": 2**62 + 1, "maximum": 2**62 + 1}, "minimum"),
        ({"type": "array", "items": {"type": "integer", "exclusiveMaximum": -BIG}}, "exclusiveMaximum"),
        ({"$defs": {"n": {"type": "integer", "multipleOf": BIG}}, "$ref": "#/$defs/n"}, "multipleOf"),
    ],
)
def test_an_integer_the_grammar_engine_would_round_is_a_400_naming_its_keyword(
    schema: dict[str, Any], keyword: str
) -> None:
    # was: llguidance read it as a double: const 9007199254740993 answered 9007199254740992, finish "stop"
    error = _error(GuidedSpec.json_schema, schema)
    assert error.param == "response_format.json_schema.schema" and error.code == "invalid_json_schema"
    assert f"schema's {keyword} holds the integer" in str(error)


def test_integers_a_double_holds_exactly_are_taken_as_they_are() -> None:
    for schema in ({"const": 2**53}, {"enum": [-(2**53), 1.5e300]}, {"type": "integer", "maximum": 2**53},
                   {"properties": {"const": {"type": "string"}}}, {"description": str(BIG)}):  # fmt: skip
        assert GuidedSpec.json_schema(schema).kind == "json_schema"
