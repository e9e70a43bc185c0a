"""has_finite_instance: $ref cycles that every instance must follow are found; optional ones are not."""

from __future__ import annotations

from typing import Any

import pytest

from engine.guided import GuidedDecodingError, GuidedSpec
from engine.guided.finite import has_finite_instance


def _node(next_schema: dict[str, Any], required: bool) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"next": next_schema},
        "required": ["next"] if required else [],
    }


@pytest.mark.parametrize(
    "schema",
    [
        _node({"$ref": "#"}, required=True),
        {"$ref": "#/$defs/n", "$defs": {"n": _node({"$ref": "#/$defs/n"}, required=True)}},
        {  # two definitions that require each other
            "$ref": "#/$defs/a",
            "$defs": {"a": _node({"$ref": "#/$defs/b"}, True), "b": _node({"$ref": "#/$defs/a"}, True)},
        },
        {"type": "array", "minItems": 1, "items": {"$ref": "#"}},
        {"anyOf": [_node({"$ref": "#"}, True), {"allOf": [{"$ref": "#"}]}]},
    ],
)
def test_a_cycle_every_instance_must_follow_has_no_finite_instance(schema: dict[str, Any]) -> None:
    assert not has_finite_instance(schema)
    with pytest.raises(GuidedDecodingError) as info:
        GuidedSpec.json_schema(schema, param="structured_outputs.json")
    assert info.value.param == "structured_outputs.json" and info.value.code == "invalid_json_schema"
    assert "no finite instance" in str(info.value)


@pytest.mark.parametrize(
    "schema",
    [
        _node({"$ref": "#"}, required=False),  # a linked list may end
        _node({"anyOf": [{"$ref": "#"}, {"type": "null"}]}, required=True),
        _node({"type": ["object", "null"], "$ref": "#"}, required=True) | {"type": ["object", "null"]},
        {"type": "array", "items": {"$ref": "#"}},  # the empty array
        {"type": "object", "properties": {"x": {"$ref": "#/$defs/missing"}}, "required": ["x"]},
        {"type": "object", "properties": {"x": {"$ref": "https://example.com/s.json"}}, "required": ["x"]},
        {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]},
    ],
)
def test_schemas_with_a_way_out_are_left_to_the_library(schema: dict[str, Any]) -> None:
    assert has_finite_instance(schema)
