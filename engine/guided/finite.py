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

_MAX_VISITS = 50_000  # schema nodes looked at in all (~25 ms); past it the schema is left to the library


class _Budget:
    """Nodes left to look at: a hostile schema (thousands of refs in a chain) costs a bounded time."""

    def __init__(self, visits: int) -> None:
        self.left = visits

    def spend(self) -> None:
        self.left -= 1
        if self.left < 0:
            raise _OverBudgetError


class _OverBudgetError(Exception):
    pass


def has_finite_instance(schema: Any, visits: int = _MAX_VISITS) -> bool:
    """False when `schema` (a parsed JSON schema) admits no finite JSON value at all; True when
    it does, or when telling would take more than `visits` node visits."""
    targets: dict[str, Any] = {}
    _collect_refs(schema, schema, targets, depth=0)
    # least fixpoint, by a work list: a target is finite once proven so, and a target found not
    # finite is looked at again only when a ref it read is proven finite. A bare alias loop
    # (`{"$ref": "#"}`) is the grammar library's to refuse ("no output can satisfy it"): finite here.
    loops = _alias_loops(targets)
    finite = {ref: loops[ref] for ref in targets}
    readers: dict[str, set[str]] = {}  # ref -> the targets whose last look stopped at it
    pending = [ref for ref in targets if not finite[ref]]
    budget = _Budget(visits)
    try:
        while pending:
            ref = pending.pop()
            if finite[ref]:
                continue
            blocked: set[str] = set()
            if _finite(targets[ref], finite, 0, blocked, budget):
                finite[ref] = True
                pending.extend(readers.pop(ref, ()))
            else:
                for other in blocked:
                    readers.setdefault(other, set()).add(ref)
        return _finite(schema, finite, 0, set(), budget)
    except _OverBudgetError:
        return True


def _alias_loops(targets: dict[str, Any]) -> dict[str, bool]:
    """For each ref, whether following it through nodes that are only `$ref`s runs into a loop
    (each ref walked once: a chain of thousands of aliases costs its length, not its square)."""
    verdict: dict[str, bool] = {}
    for start in targets:
        path: list[str] = []
        on_path: set[str] = set()
        ref = start
        while ref not in verdict:
            node = targets.get(ref)
            if ref in on_path:  # a loop: every ref on the path leads into it
                result = True
                break
            if not isinstance(node, dict) or not isinstance(node.get("$ref"), str) or "type" in node:
                result = False  # the chain ends in a schema of its own
                break
            path.append(ref)
            on_path.add(ref)
            ref = node["$ref"]
        else:
            result = verdict[ref]
        for seen in path:
            verdict[seen] = result
        verdict.setdefault(start, result)
    return verdict


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


def _finite(node: Any, finite: dict[str, bool], depth: int, blocked: set[str], budget: _Budget) -> bool:
    """Whether `node` has a finite instance given what is known of the refs (`finite`); the refs
    that made it answer False go into `blocked`."""
    budget.spend()
    if not isinstance(node, dict) or depth > 200:
        return True  # `true`/`false` schemas and anything deeper: not this check's to refuse
    ref = node.get("$ref")
    if isinstance(ref, str) and not finite.get(ref, True):
        blocked.add(ref)
        return False
    deeper = depth + 1
    subs = node.get("allOf")
    if isinstance(subs, list) and not all(_finite(s, finite, deeper, blocked, budget) for s in subs):
        return False
    for key in ("anyOf", "oneOf"):
        subs = node.get(key)
        if (
            isinstance(subs, list)
            and subs
            and not any(_finite(s, finite, deeper, blocked, budget) for s in subs)
        ):
            return False
    if "enum" in node or "const" in node:
        return True
    kind = node.get("type")
    if kind == "object":
        props, required = node.get("properties"), node.get("required")
        if isinstance(props, dict) and isinstance(required, list):
            for name in required:
                if (
                    isinstance(name, str)
                    and name in props
                    and not _finite(props[name], finite, deeper, blocked, budget)
                ):
                    return False
    elif kind == "array":
        least = node.get("minItems")
        if isinstance(least, int) and least > 0:
            prefix = node.get("prefixItems")
            prefix = prefix if isinstance(prefix, list) else []
            if not all(_finite(s, finite, deeper, blocked, budget) for s in prefix[:least]):
                return False
            if least > len(prefix) and not _finite(node.get("items", True), finite, deeper, blocked, budget):
                return False
    return True
