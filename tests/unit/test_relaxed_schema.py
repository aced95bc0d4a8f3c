"""The schema twin without string length bounds, whose masks are a cheap superset."""

from __future__ import annotations

import pytest

from atlas.adapters.grammar.relaxed_schema import relaxed_schema


def test_bounds_go_wherever_a_subschema_counts_positively():
    schema = {
        "type": "object",
        "properties": {
            "maxLength": {"type": "string", "maxLength": 3},  # a property named like the keyword stays
            "tags": {"type": "array", "items": {"type": "string", "minLength": 1}, "maxItems": 4},
            "pair": {"prefixItems": [{"type": "string", "maxLength": 2}, {"$ref": "#/$defs/code"}]},
            "either": {"anyOf": [{"type": "string", "maxLength": 5}, {"type": "null"}]},
        },
        "additionalProperties": {"type": "string", "maxLength": 9},
        "required": ["maxLength"],
        "$defs": {"code": {"type": "string", "minLength": 3, "maxLength": 3, "pattern": "^[A-Z]+$"}},
    }
    assert relaxed_schema(schema) == {
        "type": "object",
        "properties": {
            "maxLength": {"type": "string"},
            "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
            "pair": {"prefixItems": [{"type": "string"}, {"$ref": "#/$defs/code"}]},
            "either": {"anyOf": [{"type": "string"}, {"type": "null"}]},
        },
        "additionalProperties": {"type": "string"},
        "required": ["maxLength"],
        "$defs": {"code": {"type": "string", "pattern": "^[A-Z]+$"}},
    }


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {"a": {"type": "string"}}},  # nothing to relax
    {"oneOf": [{"type": "string", "maxLength": 3}, {"type": "string", "minLength": 2}]},  # exactly one
    {"type": "string", "maxLength": 3, "not": {"const": "abc"}},
    {"if": {"type": "string", "maxLength": 2}, "then": {"minLength": 1}},
    {"type": "array", "items": {"not": {"type": "string", "maxLength": 1}}},
    {"type": "object", "properties": {"enum_of_names": {"enum": [{"maxLength": 3}]}}},  # data, not a bound
])
def test_no_twin_where_dropping_a_bound_could_reject_a_valid_document_or_changes_nothing(schema):
    assert relaxed_schema(schema) is None
