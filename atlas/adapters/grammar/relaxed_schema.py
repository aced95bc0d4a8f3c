"""A JSON schema's looser twin without string length bounds, for cheap superset masks.

llguidance checks `maxLength` / `minLength` with a counting lexer, so every mask inside such a
string walks the whole vocabulary (~0.3-1 ms on SmolLM2's 49k tokens, against ~10 us for an
unbounded string). The schema without those bounds accepts every document the schema accepts
and more, so its masks are a superset of the exact ones: the engine samples under them and
checks each token against the exact grammar (`atlas.domain.constraints`).

Only keywords whose subschemas count positively are followed (properties, items, allOf, anyOf,
$defs, ...). A schema that uses `not`, `if` or `oneOf` anywhere gets no twin: dropping a bound
under those could reject a document the schema accepts (`oneOf` wants exactly one branch).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

_BOUNDS = ("maxLength", "minLength")
_NOT_MONOTONIC = ("not", "if", "oneOf")
_SCHEMA = ("additionalProperties", "items", "additionalItems", "contains", "propertyNames", "unevaluatedItems",
           "unevaluatedProperties", "then", "else")
_SCHEMA_LISTS = ("allOf", "anyOf", "prefixItems", "items")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


class _NotMonotonic(Exception):
    pass


def relaxed_schema(schema: Mapping[str, Any]) -> dict[str, Any] | None:
    """`schema` without its string length bounds, or None when it has none or cannot be
    relaxed safely (see the module doc)."""
    removed = []

    def walk(node: Any) -> Any:
        if isinstance(node, list):
            return [walk(item) for item in node]
        if not isinstance(node, Mapping):
            return node  # true / false
        if any(key in node for key in _NOT_MONOTONIC):
            raise _NotMonotonic
        relaxed: dict[str, Any] = {}
        for key, value in node.items():
            if key in _BOUNDS and isinstance(value, int) and not isinstance(value, bool):
                removed.append(key)
            elif key in _SCHEMA_MAPS and isinstance(value, Mapping):
                relaxed[key] = {name: walk(sub) for name, sub in value.items()}
            elif key in _SCHEMA or key in _SCHEMA_LISTS:
                relaxed[key] = walk(value)
            else:
                relaxed[key] = value  # a keyword's data (enum, const, required, ...): as it is
        return relaxed

    try:
        result = walk(schema)
    except _NotMonotonic:
        return None
    return result if removed else None
