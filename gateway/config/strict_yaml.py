"""YAML as the policy is read: safe, and a mapping that names a key twice is an error.

PyYAML keeps the last of two equal keys without a word: a policy with two `backends.local:` blocks
was "valid", the first (an invalid one, even) silently dropped. A merge (`<<: *base`) still lets a
key given beside it override the merged one, as YAML means it to.
"""

from __future__ import annotations

from typing import Any

import yaml
from yaml.constructor import ConstructorError
from yaml.nodes import MappingNode

_MERGE = "tag:yaml.org,2002:merge"


class _UniqueKeyLoader(yaml.SafeLoader):  # type: ignore[misc]
    """The safe loader, refusing a key a mapping gives twice."""

    def construct_mapping(self, node: MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if key_node.tag == _MERGE:
                continue
            key = self.construct_object(key_node, deep=deep)
            try:
                duplicate = key in seen
            except TypeError:  # an unhashable key: the safe loader refuses it itself
                continue
            if duplicate:
                raise ConstructorError(
                    "while reading a mapping",
                    node.start_mark,
                    f"the key {key!r} is given twice",
                    key_node.start_mark,
                )
            seen.add(key)
        return super().construct_mapping(node, deep)  # type: ignore[no-any-return]


def strict_load(text: str) -> Any:
    """`yaml.safe_load`, a key given twice in a mapping raising a yaml.YAMLError."""
    return yaml.load(text, Loader=_UniqueKeyLoader)  # (a SafeLoader subclass)
