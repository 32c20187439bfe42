"""The OpenAI wire format: request models, response and SSE chunk builders, error bodies.

Pydantic lives here and nowhere else in the router: a request is validated into a model, turned
into a ``SamplingSpec`` and prompt, and the answer is built as plain dicts.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    GetCoreSchemaHandler,
    GetJsonSchemaHandler,
    WithJsonSchema,
)
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import CoreSchema, core_schema

from kvmesh.protocol import SamplingSpec

__all__ = [
    "APIError",
    "ChatCompletionRequest",
    "ChatFormat",
    "ChatMessage",
    "CompletionFormat",
    "CompletionRequest",
    "SSE_DONE",
    "StreamOptions",
    "Usage",
    "error_body",
    "error_json",
    "error_type",
    "sse_event",
]

MAX_STOP_SEQUENCES = 4  # OpenAI's limit
MAX_STOP_CHARS = 1024  # per stop sequence; four of them stay far below what a NATS message carries
MAX_STOP_TOKEN_IDS = 64
MAX_MESSAGES = 2048  # OpenAI's limit
MAX_TOKEN_ID = 2**31 - 1
SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed takes
SSE_DONE = "data: [DONE]\n\n"
_SURROGATE = re.compile("[\ud800-\udfff]")


# --------------------------------------------------------------------------- errors
class APIError(Exception):
    """A request that ends with an OpenAI-style error response."""

    def __init__(
        self, status: int, message: str, *, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, param=self.param, code=self.code)


def error_type(status: int) -> str:
    """OpenAI's error ``type`` for an HTTP status."""
    if status == 503:
        return "service_unavailable"
    if status >= 500:
        return "server_error"
    return "invalid_request_error"


def error_body(
    status: int, message: str, *, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type(status), "param": param, "code": code}}


def error_json(body: dict[str, Any]) -> bytes:
    """An error body as JSON bytes. ASCII-only, so whatever a message quotes (even a lone
    surrogate from the request) encodes."""
    return json.dumps(body, ensure_ascii=True, separators=(",", ":")).encode("ascii")


# --------------------------------------------------------------------------- text
def unicode_problem(text: str) -> str | None:
    """Why ``text`` is not valid Unicode (a lone surrogate, which JSON's ``\\ud800`` escapes
    can carry but UTF-8 cannot), or None when it is."""
    match = _SURROGATE.search(text)
    if match is None:
        return None
    return f"must be valid Unicode text, but has a lone surrogate U+{ord(match.group()):04X} at character {match.start()}"


def _valid_text(value: str) -> str:
    problem = unicode_problem(value)
    if problem is not None:
        raise ValueError(problem)
    return value


Text = Annotated[str, AfterValidator(_valid_text)]


# --------------------------------------------------------------------------- field parsers
def _parse_prompt(value: Any) -> Any:
    if isinstance(value, str):
        return _valid_text(value)
    if isinstance(value, list):
        if any(isinstance(item, (str, list)) for item in value):
            raise ValueError("only one prompt per request (batches of prompts are not supported)")
        if all(type(item) is int or (type(item) is float and item.is_integer()) for item in value):
            return [int(item) for item in value]  # 7.0 is an integer to JSON Schema, so to us
    raise ValueError("prompt must be a string or a list of token ids")


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
PROMPT_SCHEMA = {
    "anyOf": [_text_schema(min=1), {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}]
}
_TEXT_PART = {
    "type": "object",
    "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
    "required": ["type", "text"],
}
CONTENT_SCHEMA = {"anyOf": [{"type": "string"}, {"type": "array", "items": _TEXT_PART}]}


# --------------------------------------------------------------------------- requests
class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")

    include_usage: bool | None = False


class _GenerationRequest(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model_config = ConfigDict(extra="allow")

    model: Text
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)  # extension; 0 and -1 mean off
    seed: int | None = Field(default=None, ge=SEED_RANGE[0], le=SEED_RANGE[1])
    stop: Annotated[tuple[str, ...], BeforeValidator(_parse_stop), WithJsonSchema(STOP_SCHEMA)] = ()
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # extension
    stop_token_ids: (
        list[Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]] | None
    ) = Field(default=None, max_length=MAX_STOP_TOKEN_IDS)  # extension
    user: str | None = None
    # accepted only at their "off" values
    n: Annotated[Any, _only_off(_is_one, "only n=1 is supported (one choice per request)", 1)] = 1
    logprobs: Annotated[Any, _only_off(_is_off, "logprobs are not supported", False)] = None
    presence_penalty: Annotated[Any, _only_off(_is_zero, "presence_penalty is not supported (only 0)", 0)] = None
    frequency_penalty: Annotated[
        Any, _only_off(_is_zero, "frequency_penalty is not supported (only 0)", 0)
    ] = None
    logit_bias: Annotated[
        Any, _only_off(lambda v: v is None or v == {}, "logit_bias is not supported", {})
    ] = None

    max_tokens: int | None = Field(default=None, ge=1)

    @property
    def requested_max_tokens(self) -> int | None:
        """What the client asked for; the subclasses refine it."""
        return self.max_tokens

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def sampling_spec(self, max_tokens: int) -> SamplingSpec:
        """The engine's sampling parameters; ``max_tokens`` is resolved by the caller."""
        return SamplingSpec(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=max(self.top_k or 0, 0),
            seed=self.seed,
            max_tokens=max_tokens,
            stop=self.stop,
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
        )


class CompletionRequest(_GenerationRequest):
    prompt: Annotated[str | list[int], BeforeValidator(_parse_prompt), WithJsonSchema(PROMPT_SCHEMA)]
    max_tokens: int | None = Field(default=16, ge=1)
    best_of: Annotated[Any, _only_off(_is_one, "best_of > 1 is not supported", 1)] = None
    echo: Annotated[Any, _only_off(_is_off, "echo is not supported", False)] = None
    suffix: Annotated[Any, _only_off(lambda v: v is None or v == "", "suffix is not supported", "")] = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant"]
    content: Annotated[str, BeforeValidator(_parse_content), WithJsonSchema(CONTENT_SCHEMA)]


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    top_logprobs: Annotated[Any, _only_off(_is_zero, "top_logprobs are not supported", 0)] = None
    tools: Annotated[Any, _only_off(lambda v: v is None or v == [], "tools are not supported", [])] = None
    tool_choice: Annotated[
        Any, _only_off(lambda v: v is None or v == "none", "tool_choice is not supported", "none")
    ] = None
    response_format: Annotated[
        Any,
        _only_off(
            lambda v: v is None or v == {"type": "text"},
            "response_format is not supported (only text)",
            {"type": "text"},
        ),
    ] = None

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def template_messages(self) -> list[dict[str, str]]:
        """The messages as the chat template wants them: role and string content."""
        return [{"role": m.role, "content": m.content} for m in self.messages]


# --------------------------------------------------------------------------- responses
@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


class _Format:
    """Builds one request's response objects; every object of a request shares id and created."""

    id_prefix = ""
    chunk_object = ""

    def __init__(
        self, request_id: str, model: str, *, include_usage: bool = False, created: int | None = None
    ) -> None:
        self.id = f"{self.id_prefix}{request_id}"
        self.model = model
        self.include_usage = include_usage
        self.created = int(time.time()) if created is None else created

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def _chunk(self, obj: str, choice: dict[str, Any]) -> dict[str, Any]:
        chunk = self._envelope(obj, [choice])
        if self.include_usage:
            chunk["usage"] = None
        return chunk

    def opening_chunks(self) -> list[dict[str, Any]]:
        return []

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        return {**self._envelope(self.chunk_object, []), "usage": usage.to_dict()}


class CompletionFormat(_Format):
    """``text_completion`` objects for /v1/completions."""

    id_prefix = "cmpl-"
    chunk_object = "text_completion"

    def response(self, text: str, finish_reason: str | None, usage: Usage) -> dict[str, Any]:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        return {**self._envelope("text_completion", [choice]), "usage": usage.to_dict()}

    def content_chunk(self, text: str) -> dict[str, Any]:
        return self._chunk(
            self.chunk_object, {"index": 0, "text": text, "logprobs": None, "finish_reason": None}
        )

    def final_chunk(self, finish_reason: str | None) -> dict[str, Any]:
        return self._chunk(
            self.chunk_object, {"index": 0, "text": "", "logprobs": None, "finish_reason": finish_reason}
        )


class ChatFormat(_Format):
    """``chat.completion`` and ``chat.completion.chunk`` objects for /v1/chat/completions."""

    id_prefix = "chatcmpl-"
    chunk_object = "chat.completion.chunk"

    def response(self, text: str, finish_reason: str | None, usage: Usage) -> dict[str, Any]:
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": None,
            "finish_reason": finish_reason,
        }
        return {**self._envelope("chat.completion", [choice]), "usage": usage.to_dict()}

    def opening_chunks(self) -> list[dict[str, Any]]:
        return [self._delta({"role": "assistant", "content": ""}, None)]

    def content_chunk(self, text: str) -> dict[str, Any]:
        return self._delta({"content": text}, None)

    def final_chunk(self, finish_reason: str | None) -> dict[str, Any]:
        return self._delta({}, finish_reason)

    def _delta(self, delta: dict[str, Any], finish_reason: str | None) -> dict[str, Any]:
        return self._chunk(
            self.chunk_object, {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        )


def sse_event(data: dict[str, Any]) -> str:
    """One server-sent event carrying ``data`` as compact JSON."""
    return f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"
