"""Schemas with and without an instance of finite size (``kvmesh.engine.schema_finite``)."""

from __future__ import annotations

import pytest

from kvmesh.engine.schema_finite import has_finite_instance

SELF = {"$ref": "#"}


@pytest.mark.parametrize(
    ("schema", "finite"),
    [
        ({"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}, False),  # a name for itself
        ({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}, False),
        ({"type": "object", "properties": {"x": SELF}, "required": ["x"]}, False),  # each needs another
        ({"type": "array", "items": SELF, "minItems": 1}, False),
        ({"type": "object", "properties": {"x": SELF}}, True),  # x may be left out
        ({"type": "object", "properties": {"x": {"anyOf": [SELF, {"type": "null"}]}}, "required": ["x"]}, True),
        ({"type": ["object", "null"], "properties": {"x": SELF}, "required": ["x"]}, True),  # null ends it
        ({"type": "array", "items": SELF}, True),  # [] ends it
        (  # a linked list: next is optional
            {
                "$defs": {"node": {"type": "object", "properties": {"next": {"$ref": "#/$defs/node"}, "v": {"type": "integer"}}, "required": ["v"]}},
                "$ref": "#/$defs/node",
            },
            True,
        ),
        ({"type": "object", "required": ["y"], "additionalProperties": False}, False),
        ({"type": "string"}, True),
        ({}, True),
        (True, True),
        (False, False),
        ({"$ref": "https://example.com/s.json"}, True),  # not local: llguidance judges it
    ],
)
def test_a_schema_has_a_finite_instance_unless_recursion_never_ends(schema, finite: bool) -> None:
    assert has_finite_instance(schema) is finite
