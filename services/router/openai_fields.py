"""Parsers and JSON schemas for the OpenAI request fields that plain pydantic types do not
cover: text that must be valid Unicode, prompts, stop sequences, message content, logit bias,
metadata, and the fields accepted only at their "off" values."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import AfterValidator, GetCoreSchemaHandler, GetJsonSchemaHandler
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import CoreSchema, core_schema

MAX_STOP_SEQUENCES = 4  # OpenAI's limit
MAX_STOP_CHARS = 1024  # per stop sequence; four of them stay far below what a NATS message carries
MAX_PROMPTS = 64  # prompts in one completions request; each is a request of its own in the mesh
MAX_LOGIT_BIAS = 300  # entries; it crosses to the workers in every message of the request
MAX_METADATA = (16, 64, 512)  # OpenAI's: pairs, characters per key, characters per value
_SURROGATE = re.compile("[\ud800-\udfff]")


# --------------------------------------------------------------------------- text
def unicode_problem(text: str) -> str | None:
    """Why ``text`` is not valid Unicode (a lone surrogate, which JSON's ``\\ud800`` escapes
    can carry but UTF-8 cannot), or None when it is."""
    match = _SURROGATE.search(text)
    if match is None:
        return None
    return f"must be valid Unicode text, but has a lone surrogate U+{ord(match.group()):04X} at character {match.start()}"


def lone_surrogate(value: Any) -> tuple[str, str] | None:
    """The first string anywhere in a decoded JSON request (object keys included) that is not
    valid Unicode, as (its field's path, why); None when every string is valid. Run after
    the fields' own checks (which say it their way): it catches the rest (a tool's description
    or schema, a tool call's arguments), text that reaches the tokenizer or a grammar, which
    take only valid Unicode. Numbers and the like are passed over where they lie (a prompt of
    token ids is thousands of them), and a field's path is spelled only for the one found.
    ``value`` is decoded JSON, whose types are exact: a list is passed over whole when none of
    its items' types is ``str``, ``dict`` or ``list`` themselves (a subclass would be missed)."""
    pending: list[tuple[_Where, Any]] = [(None, value)]
    while pending:
        where, item = pending.pop()
        if isinstance(item, str):
            problem = unicode_problem(item)
            if problem is not None:
                return _path(where), problem
        elif isinstance(item, dict):
            for key, inner in reversed(item.items()):
                if isinstance(key, str) and unicode_problem(key) is not None:
                    return _path(where) or "body", f"has a key that {unicode_problem(key)}"
                if isinstance(inner, _TEXT_HOLDERS):
                    pending.append(((where, key), inner))
        elif isinstance(item, list) and not _TEXT_HOLDERS_SET.isdisjoint(map(type, item)):
            for index in range(len(item) - 1, -1, -1):
                if isinstance(item[index], _TEXT_HOLDERS):
                    pending.append(((where, index), item[index]))
    return None


# Where a value lies in a request: (where its container lies, its key or index); None: the body.
_Where = tuple[Any, Any] | None
_TEXT_HOLDERS = (str, dict, list)
_TEXT_HOLDERS_SET = frozenset(_TEXT_HOLDERS)


def _path(where: _Where) -> str:
    """``messages.0.content`` for (((None, "messages"), 0), "content")."""
    keys: list[Any] = []
    while where is not None:
        where, key = where
        keys.append(key)
    path = ""
    for key in reversed(keys):
        path = f"{path}.{key}" if path else str(key)
    return path


def _valid_text(value: str) -> str:
    problem = unicode_problem(value)
    if problem is not None:
        raise ValueError(problem)
    return value


Text = Annotated[str, AfterValidator(_valid_text)]


# --------------------------------------------------------------------------- field parsers
def _parse_prompt(value: Any) -> Any:
    """A string, token ids, or a list of either (each its own choice)."""
    if isinstance(value, str):
        return _valid_text(value)
    if not isinstance(value, list):
        raise ValueError("prompt must be a string, a list of token ids, or a non-empty list of either")
    if _INTS.issuperset(map(type, value)):  # token ids as clients send them ([] too: "the prompt is empty")
        return value
    if all(_is_token_id(item) for item in value):
        return [int(item) for item in value]  # 7.0 is an integer to JSON Schema, so to us
    if len(value) > MAX_PROMPTS:
        raise ValueError(f"at most {MAX_PROMPTS} prompts are allowed in one request, got {len(value)}")
    if all(isinstance(item, str) for item in value):
        for i, item in enumerate(value):
            problem = unicode_problem(item)
            if problem is not None:
                raise ValueError(f"prompt {i} {problem}")
        return list(value)
    if all(isinstance(item, list) and item and all(_is_token_id(t) for t in item) for item in value):
        return [[int(t) for t in item] for item in value]
    raise ValueError("prompt must be a string, a list of token ids, or a non-empty list of either")


_INTS = frozenset({int})


def _is_token_id(item: Any) -> bool:
    return type(item) is int or (type(item) is float and item.is_integer())


def _parse_logit_bias(value: Any) -> dict[int, float] | None:
    """OpenAI's ``{"token id": bias}``; a bias is clamped to [-100, 100] by the engine."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError("logit_bias must be an object mapping token ids to numbers")
    if len(value) > MAX_LOGIT_BIAS:
        raise ValueError(f"logit_bias may have at most {MAX_LOGIT_BIAS} entries, got {len(value)}")
    bias: dict[int, float] = {}
    for key, number in value.items():
        if not isinstance(key, str) or not key.isascii() or not key.isdigit():
            raise ValueError(f"logit_bias keys must be token ids (non-negative integers), got {key!r}")
        if isinstance(number, bool) or not isinstance(number, (int, float)) or not math.isfinite(number):
            raise ValueError(f"logit_bias[{key!r}] must be a finite number, got {number!r}")
        bias[int(key)] = float(number)
    return bias


def _parse_metadata(value: Any) -> dict[str, str] | None:
    if value is None:
        return None
    pairs, key_chars, value_chars = MAX_METADATA
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise ValueError("metadata must be an object of string values")
    if len(value) > pairs:
        raise ValueError(f"metadata may have at most {pairs} pairs, got {len(value)}")
    for key, text in value.items():
        if len(key) > key_chars or len(text) > value_chars:
            raise ValueError(f"metadata keys have at most {key_chars} characters and values {value_chars}")
        if unicode_problem(key) or unicode_problem(text):
            raise ValueError("metadata must be valid Unicode text")
    return dict(value)


def _parse_stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise ValueError("stop must be a string or a list of strings")
    if len(stops) > MAX_STOP_SEQUENCES:
        raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences are allowed, got {len(stops)}")
    for i, stop in enumerate(stops):
        if stop == "":
            raise ValueError("stop sequences must not be empty strings")
        if len(stop) > MAX_STOP_CHARS:
            raise ValueError(f"stop sequence {i} has {len(stop)} characters; at most {MAX_STOP_CHARS} are allowed")
        problem = unicode_problem(stop)
        if problem is not None:
            raise ValueError(f"stop sequence {i} {problem}")
    return tuple(stops)


def _parse_content(value: Any) -> str:
    """A message's content: a string, or text parts joined by newlines."""
    if isinstance(value, str):
        return _valid_text(value)
    if isinstance(value, list):
        texts = []
        for i, part in enumerate(value):
            if not isinstance(part, dict) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ValueError(f"only text content parts are supported, got {kind!r}")
            if not isinstance(part.get("text"), str):
                raise ValueError("a text content part needs a string 'text'")
            unknown = sorted(set(part) - {"type", "text"})
            if unknown:
                raise ValueError(f"unsupported parameter in text part {i}: {unknown[0]}")
            problem = unicode_problem(part["text"])
            if problem is not None:
                raise ValueError(f"text part {i} {problem}")
            texts.append(part["text"])
        return "\n".join(texts)
    raise ValueError("content must be a string or a list of text parts")


def _is_off(value: Any) -> bool:
    return value is None or value is False


def _is_zero(value: Any) -> bool:
    return value is None or (not isinstance(value, bool) and value == 0)


def _is_one(value: Any) -> bool:
    return value is None or (not isinstance(value, bool) and value == 1)


@dataclass(frozen=True)
class _OnlyOff:
    """A field we accept only at its "off" values (``off``, or null); anything else is a clear
    400. Its JSON schema names those values, so what is generated from /openapi.json is valid."""

    accepted: Callable[[Any], bool]
    message: str
    off: tuple[Any, ...]

    def __get_pydantic_core_schema__(self, source: Any, handler: GetCoreSchemaHandler) -> CoreSchema:
        return core_schema.no_info_before_validator_function(self._check, handler(source))

    def __get_pydantic_json_schema__(self, schema: CoreSchema, handler: GetJsonSchemaHandler) -> JsonSchemaValue:
        return {"anyOf": [*({"const": value} for value in self.off), {"type": "null"}]}

    def _check(self, value: Any) -> Any:
        if not self.accepted(value):
            raise ValueError(self.message)
        return value


def _only_off(accepted: Callable[[Any], bool], message: str, *off: Any) -> _OnlyOff:
    return _OnlyOff(accepted, message, off)


def _text_schema(**bounds: int) -> dict[str, Any]:
    return {"type": "string", **{f"{k}Length": v for k, v in bounds.items()}}


# What the parsers above accept, for /openapi.json (pydantic would describe their output).
_STOP = _text_schema(min=1, max=MAX_STOP_CHARS)
STOP_SCHEMA = {"anyOf": [_STOP, {"type": "array", "items": _STOP, "maxItems": MAX_STOP_SEQUENCES}, {"type": "null"}]}
_TOKEN_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
PROMPT_SCHEMA = {
    "anyOf": [
        _text_schema(min=1),
        _TOKEN_IDS,
        {"type": "array", "items": _text_schema(min=1), "minItems": 1, "maxItems": MAX_PROMPTS},
        {"type": "array", "items": _TOKEN_IDS, "minItems": 1, "maxItems": MAX_PROMPTS},
    ]
}
LOGIT_BIAS_SCHEMA = {
    "anyOf": [
        {
            "type": "object",
            "propertyNames": {"pattern": "^[0-9]+$"},
            "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100},
            "maxProperties": MAX_LOGIT_BIAS,
        },
        {"type": "null"},
    ]
}
METADATA_SCHEMA = {
    "anyOf": [
        {
            "type": "object",
            "propertyNames": {"maxLength": MAX_METADATA[1]},
            "additionalProperties": {"type": "string", "maxLength": MAX_METADATA[2]},
            "maxProperties": MAX_METADATA[0],
        },
        {"type": "null"},
    ]
}
_TEXT_PART = {
    "type": "object",
    "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
    "required": ["type", "text"],
    "additionalProperties": False,
}
CONTENT_SCHEMA = {"anyOf": [{"type": "string"}, {"type": "array", "items": _TEXT_PART}]}
