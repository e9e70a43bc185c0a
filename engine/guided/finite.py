"""Whether a JSON schema has any finite instance, checked before a request is admitted.

A `$ref` cycle through required properties (or through arrays with minItems > 0) has none: every
instance of `{"properties": {"next": {"$ref": "#"}}, "required": ["next"]}` holds another. The
grammar library compiles such a schema and the answer then fails mid-way, once its forced tokens
pass the parser's limits, after a stream has started. This check finds those cycles up front.

It is conservative: it answers False only when every way to build an instance must recurse through
a `$ref` forever. Keywords it does not model (not, if/then/else, enum, const, type lists with a
scalar type, missing `type`, non-local refs) count as satisfiable.
"""

from __future__ import annotations

from typing import Any

_MAX_ROUNDS = 64  # fixpoint rounds; a schema needing more is left to the library


def has_finite_instance(schema: Any) -> bool:
    """False when `schema` (a parsed JSON schema) admits no finite JSON value at all."""
    targets: dict[str, Any] = {}
    _collect_refs(schema, schema, targets, depth=0)
    # least fixpoint: a target is finite once proven so. A bare alias loop (`{"$ref": "#"}`) is the
    # grammar library's to refuse ("no output can satisfy it"), so it counts as finite here.
    finite = {ref: _alias_loop(ref, targets) for ref in targets}
    for _ in range(_MAX_ROUNDS):
        changed = False
        for ref, node in targets.items():
            if not finite[ref] and _finite(node, finite, depth=0):
                finite[ref] = changed = True
        if not changed:
            return _finite(schema, finite, depth=0)
    return True


def _alias_loop(ref: str, targets: dict[str, Any]) -> bool:
    """Whether following `ref` through nodes that are only `$ref`s comes back to a ref seen before."""
    seen = set()
    while ref in targets and ref not in seen:
        seen.add(ref)
        node = targets[ref]
        if not isinstance(node, dict) or not isinstance(node.get("$ref"), str) or "type" in node:
            return False
        ref = node["$ref"]
    return ref in seen


def _collect_refs(node: Any, root: Any, targets: dict[str, Any], depth: int) -> None:
    if depth > 200:
        return
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str) and ref not in targets:
            target = _resolve(root, ref)
            if target is not None:
                targets[ref] = target
        for value in node.values():
            _collect_refs(value, root, targets, depth + 1)
    elif isinstance(node, list):
        for value in node:
            _collect_refs(value, root, targets, depth + 1)


def _resolve(root: Any, ref: str) -> Any:
    """The node a local JSON pointer (`#`, `#/$defs/a`) names, or None."""
    if ref == "#":
        return root
    if not ref.startswith("#/"):
        return None
    node = root
    for raw in ref[2:].split("/"):
        part = raw.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _finite(node: Any, finite: dict[str, bool], depth: int) -> bool:
    if not isinstance(node, dict) or depth > 200:
        return True  # `true`/`false` schemas and anything deeper: not this check's to refuse
    ref = node.get("$ref")
    if isinstance(ref, str) and not finite.get(ref, True):
        return False
    for key in ("allOf",):
        subs = node.get(key)
        if isinstance(subs, list) and not all(_finite(s, finite, depth + 1) for s in subs):
            return False
    for key in ("anyOf", "oneOf"):
        subs = node.get(key)
        if isinstance(subs, list) and subs and not any(_finite(s, finite, depth + 1) for s in subs):
            return False
    if "enum" in node or "const" in node:
        return True
    kind = node.get("type")
    if kind == "object":
        props, required = node.get("properties"), node.get("required")
        if isinstance(props, dict) and isinstance(required, list):
            for name in required:
                if isinstance(name, str) and name in props and not _finite(props[name], finite, depth + 1):
                    return False
    elif kind == "array":
        least = node.get("minItems")
        if isinstance(least, int) and least > 0:
            prefix = node.get("prefixItems")
            prefix = prefix if isinstance(prefix, list) else []
            if not all(_finite(s, finite, depth + 1) for s in prefix[:least]):
                return False
            if least > len(prefix) and not _finite(node.get("items", True), finite, depth + 1):
                return False
    return True
