"""The structured-output fields of a request: OpenAI's ``response_format`` and vLLM's
``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``structured_outputs``.

Each parser turns its field into a ``GuidedDecoding`` and compiles it once (``check_guided``),
so an invalid schema or regex, or a schema feature the grammar library does not support, is a
400 naming the field, never a 5xx on a worker or output that silently ignores the schema.
"""

from __future__ import annotations

import json
from typing import Any

from kvmesh.engine.structured import GrammarError, GuidedDecoding, check_guided

__all__ = [
    "GUIDED_FIELDS",
    "RESPONSE_FORMAT_SCHEMA",
    "parse_guided_choice",
    "parse_guided_json",
    "parse_guided_regex",
    "parse_response_format",
    "parse_structured_outputs",
]

# The fields that ask for structured output: at most one of them per request.
GUIDED_FIELDS = ("response_format", "guided_json", "guided_regex", "guided_choice", "structured_outputs")
_NAME_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-")


def _checked(spec: GuidedDecoding) -> GuidedDecoding:
    try:
        check_guided(spec)
    except GrammarError as exc:
        raise ValueError(str(exc)) from exc
    return spec


def _schema_spec(schema: Any, what: str) -> GuidedDecoding:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{what} is not valid JSON: {exc}") from exc
    if schema is True:
        schema = {}
    if not isinstance(schema, dict):
        raise ValueError(f"{what} must be a JSON schema object")
    try:
        spec = GuidedDecoding.json_schema(schema)
        check_guided(spec)
    except GrammarError as exc:
        raise ValueError(f"{what} is not a JSON schema kvmesh can enforce: {exc}") from exc
    return spec


def parse_response_format(value: Any) -> GuidedDecoding | None:
    """``{"type": "text"}`` (or null): none; ``{"type": "json_object"}``; ``{"type":
    "json_schema", "json_schema": {"name", "schema", "strict", "description"}}``."""
    if value is None:
        return None
    if isinstance(value, GuidedDecoding):
        return value
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise ValueError('response_format must be an object with a "type": "text", "json_object" or "json_schema"')
    kind = value["type"]
    extra = sorted(set(value) - {"type", "json_schema"})
    if extra:
        raise ValueError(f"unsupported parameter in response_format: {extra[0]}")
    if kind == "text":
        return None
    if kind == "json_object":
        return _checked(GuidedDecoding("json_object"))
    if kind != "json_schema":
        raise ValueError(f'response_format.type must be "text", "json_object" or "json_schema", got {kind!r}')
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise ValueError('response_format of type "json_schema" needs a "json_schema" object with its "name" and "schema"')
    extra = sorted(set(spec) - {"name", "schema", "strict", "description"})
    if extra:
        raise ValueError(f"unsupported parameter in response_format.json_schema: {extra[0]}")
    name = spec.get("name")
    if not isinstance(name, str) or not name or len(name) > 64 or not set(name) <= _NAME_CHARS:
        raise ValueError("response_format.json_schema.name must be 1-64 characters of a-z, A-Z, 0-9, _ and -")
    if spec.get("strict") not in (None, True, False):
        raise ValueError("response_format.json_schema.strict must be a boolean")
    if spec.get("description") is not None and not isinstance(spec["description"], str):
        raise ValueError("response_format.json_schema.description must be a string")
    # Strict or not, the output is constrained to the schema (OpenAI's strict mode guarantees
    # it; without it OpenAI tries its best, and a grammar does not need to try).
    return _schema_spec(spec.get("schema", {}), "response_format.json_schema.schema")


def parse_guided_json(value: Any) -> GuidedDecoding | None:
    """vLLM's ``guided_json``: a JSON schema, as an object or as JSON text."""
    if value is None or isinstance(value, GuidedDecoding):
        return value
    return _schema_spec(value, "guided_json")


def parse_guided_regex(value: Any) -> GuidedDecoding | None:
    if value is None or isinstance(value, GuidedDecoding):
        return value
    if not isinstance(value, str) or not value:
        raise ValueError("guided_regex must be a non-empty string")
    try:
        return _checked(GuidedDecoding("regex", value))
    except GrammarError as exc:
        raise ValueError(str(exc)) from exc


def parse_guided_choice(value: Any) -> GuidedDecoding | None:
    if value is None or isinstance(value, GuidedDecoding):
        return value
    if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
        raise ValueError("guided_choice must be a non-empty list of non-empty strings")
    try:
        return _checked(GuidedDecoding.choice(value))
    except GrammarError as exc:
        raise ValueError(str(exc)) from exc


def parse_structured_outputs(value: Any) -> GuidedDecoding | None:
    """vLLM >= 0.10's ``structured_outputs``: exactly one of ``json``, ``regex``, ``choice``
    (``json_object: true`` too)."""
    if value is None or isinstance(value, GuidedDecoding):
        return value
    if not isinstance(value, dict):
        raise ValueError("structured_outputs must be an object with one of json, regex, choice or json_object")
    known = {"json", "regex", "choice", "json_object"}
    extra = sorted(set(value) - known)
    if extra:
        raise ValueError(f"unsupported parameter in structured_outputs: {extra[0]}")
    given = {k: v for k, v in value.items() if v is not None and v is not False}
    if len(given) != 1:
        raise ValueError("structured_outputs must set exactly one of json, regex, choice or json_object")
    (key, item), = given.items()
    if key == "json":
        return _schema_spec(item, "structured_outputs.json")
    if key == "regex":
        return parse_guided_regex(item)
    if key == "choice":
        return parse_guided_choice(item)
    if item is not True:
        raise ValueError("structured_outputs.json_object must be true")
    return _checked(GuidedDecoding("json_object"))


_JSON_SCHEMA_FORMAT = {
    "type": "object",
    "properties": {
        "type": {"const": "json_schema"},
        "json_schema": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "pattern": "^[a-zA-Z0-9_-]{1,64}$"},
                "description": {"type": "string"},
                "schema": {"type": "object"},
                "strict": {"anyOf": [{"type": "boolean"}, {"type": "null"}]},
            },
            "required": ["name"],
            "additionalProperties": False,
        },
    },
    "required": ["type", "json_schema"],
    "additionalProperties": False,
}
RESPONSE_FORMAT_SCHEMA = {
    "anyOf": [
        {"type": "object", "properties": {"type": {"enum": ["text", "json_object"]}}, "required": ["type"], "additionalProperties": False},
        _JSON_SCHEMA_FORMAT,
        {"type": "null"},
    ]
}
GUIDED_JSON_SCHEMA = {"anyOf": [{"type": "object"}, {"type": "string"}, {"type": "null"}]}
GUIDED_REGEX_SCHEMA = {"anyOf": [{"type": "string", "minLength": 1}, {"type": "null"}]}
GUIDED_CHOICE_SCHEMA = {"anyOf": [{"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1}, {"type": "null"}]}
STRUCTURED_OUTPUTS_SCHEMA = {
    "anyOf": [
        {
            "type": "object",
            "properties": {
                "json": {"anyOf": [{"type": "object"}, {"type": "string"}]},
                "regex": {"type": "string", "minLength": 1},
                "choice": {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1},
                "json_object": {"const": True},
            },
            "minProperties": 1,
            "maxProperties": 1,
            "additionalProperties": False,
        },
        {"type": "null"},
    ]
}
