"""has_finite_instance: $ref cycles that every instance must follow are found; optional ones are not."""

from __future__ import annotations

import time
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


def _chain(n: int, link: dict[str, Any] | None = None) -> dict[str, Any]:
    """`#/$defs/d0` .. `d{n}`: each requires (or, `link` None, is an alias of) the next; the last a string."""
    defs: dict[str, Any] = {}
    for i in range(n):
        ref = {"$ref": f"#/$defs/d{i + 1}"}
        defs[f"d{i}"] = ref if link is None else {**link, "properties": {"x": ref}, "required": ["x"]}
    defs[f"d{n}"] = {"type": "string"}
    return {"$ref": "#/$defs/d0", "$defs": defs}


@pytest.mark.parametrize("link", [{"type": "object"}, None])
def test_a_long_chain_of_refs_costs_its_length_not_its_square(link: dict[str, Any] | None) -> None:
    # 20,000 definitions (about 2 MB): a fixpoint by rounds took 1.2 s, an alias walk per ref was
    # quadratic; both ran on the server's event loop before the request's size was checked
    schema = _chain(20_000, link)
    started = time.perf_counter()
    assert has_finite_instance(schema)
    closed = _chain(20_000, link)
    closed["$defs"]["d20000"] = {"$ref": "#/$defs/d0"} if link is None else {**link, "properties": {
        "x": {"$ref": "#/$defs/d0"}}, "required": ["x"]}  # fmt: skip
    assert has_finite_instance(closed) is (link is None)  # a pure alias loop is the library's to refuse
    assert time.perf_counter() - started < 1.0


def test_a_schema_past_the_visit_budget_is_left_to_the_library() -> None:
    cycle = _node({"$ref": "#"}, required=True)
    assert not has_finite_instance(cycle)
    assert has_finite_instance(cycle, visits=0)
