"""Whether a JSON schema has an instance of finite size (``has_finite_instance``).

A schema whose every instance must contain another instance of itself (``{"$ref": "#"}`` as a
required property, or a ``$ref`` to itself) has none: llguidance compiles its grammar all the
same, and then a request under it ends at once with nothing (the grammar allows no first
token) or fails mid-answer (its parser's item limit). The router refuses such a schema with a
400 instead, as it refuses one llguidance cannot compile.

The check is the least fixpoint of "has a finite instance" over the schema's subschemas: a
subschema has one when its local ``$ref`` (if any) has one, every ``allOf`` branch has one,
some ``anyOf`` / ``oneOf`` branch has one, and some type it allows does: scalars always; an
object when every required property's schema does; an array when it may be empty or the
items it must have do. Starting from "none has one" and repeating until nothing changes
finds exactly the subschemas with a finite derivation. It looks only at the structure that
recursion goes through: other keywords (``minimum``, ``pattern``, ``not`` ...) may still make
a schema unsatisfiable; llguidance reports what it can of those.
"""

from __future__ import annotations

from typing import Any

__all__ = ["has_finite_instance"]

_SCALARS = {"string", "number", "integer", "boolean", "null"}
_SUBSCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")
_SUBSCHEMAS = ("items", "additionalProperties", "not", "if", "then", "else", "contains")


def has_finite_instance(schema: Any) -> bool:
    """Whether ``schema`` (decoded JSON) admits an instance of finite size; local ``$ref``s
    (``#``, ``#/$defs/name``, any JSON pointer into the document) are followed, others are
    taken to have one."""
    nodes = _subschemas(schema)
    finite: dict[int, bool] = {id(node): False for node in nodes}
    changed = True
    while changed:
        changed = False
        for node in nodes:
            if not finite[id(node)] and _finite(node, schema, finite):
                finite[id(node)] = changed = True
    return _finite_value(schema, schema, finite)


def _subschemas(schema: Any) -> list[dict[str, Any]]:
    """Every object in the schema that is a schema, the root first."""
    found: list[dict[str, Any]] = []
    seen: set[int] = set()
    pending = [schema]
    while pending:
        node = pending.pop()
        if not isinstance(node, dict) or id(node) in seen:
            continue
        seen.add(id(node))
        found.append(node)
        for key in _SUBSCHEMAS:
            pending.append(node.get(key))
        for key in _SUBSCHEMA_LISTS:
            value = node.get(key)
            if isinstance(value, list):
                pending.extend(value)
        for key in _SUBSCHEMA_MAPS:
            value = node.get(key)
            if isinstance(value, dict):
                pending.extend(value.values())
    return found


def _finite_value(node: Any, root: Any, finite: dict[int, bool]) -> bool:
    """A subschema's current estimate: ``true`` and ``{}`` have instances, ``false`` none."""
    if isinstance(node, bool):
        return node
    if not isinstance(node, dict):
        return True  # not a schema: llguidance judges it
    return finite.get(id(node), True)


def _finite(node: dict[str, Any], root: Any, finite: dict[int, bool]) -> bool:
    ref = node.get("$ref")
    if isinstance(ref, str) and ref.startswith("#"):
        target = _resolve(root, ref)
        if target is not None and not _finite_value(target, root, finite):
            return False
    all_of = node.get("allOf")
    if isinstance(all_of, list) and not all(_finite_value(s, root, finite) for s in all_of):
        return False
    for key in ("anyOf", "oneOf"):
        branches = node.get(key)
        if isinstance(branches, list) and branches and not any(_finite_value(s, root, finite) for s in branches):
            return False
    if "const" in node or "enum" in node:
        return True
    types = node.get("type")
    allowed = [types] if isinstance(types, str) else types if isinstance(types, list) else None
    if allowed is None:
        return True  # any type: null is an instance
    return any(_type_finite(t, node, root, finite) for t in allowed)


def _type_finite(kind: Any, node: dict[str, Any], root: Any, finite: dict[int, bool]) -> bool:
    if kind in _SCALARS:
        return True
    if kind == "object":
        required = node.get("required")
        declared = node.get("properties")
        properties: dict[str, Any] = declared if isinstance(declared, dict) else {}
        if not isinstance(required, list):
            return True
        extra = node.get("additionalProperties", True)
        return all(_finite_value(properties.get(name, extra), root, finite) for name in required if isinstance(name, str))
    if kind == "array":
        need = node.get("minItems", 0)
        need = need if isinstance(need, int) and need > 0 else 0
        listed = node.get("prefixItems")
        prefix: list[Any] = listed if isinstance(listed, list) else []
        items = node.get("items", True)
        return all(_finite_value(prefix[i] if i < len(prefix) else items, root, finite) for i in range(min(need, len(prefix) + 1)))
    return True  # a type llguidance will judge


def _resolve(root: Any, ref: str) -> Any:
    """The subschema a local ``$ref`` (a JSON pointer after ``#``) names; None if none."""
    node = root
    for part in ref[1:].split("/")[1:] if ref != "#" else []:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node
