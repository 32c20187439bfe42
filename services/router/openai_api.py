"""The OpenAI wire format: request models, response and SSE chunk builders, error bodies.

Pydantic lives here and nowhere else in the router: a request is validated into a model, turned
into a ``SamplingSpec`` and prompt, and the answer is built as plain dicts.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

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
    "error_type",
    "sse_event",
]

MAX_STOP_SEQUENCES = 4
SSE_DONE = "data: [DONE]\n\n"


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


# --------------------------------------------------------------------------- field parsers
def _parse_prompt(value: Any) -> Any:
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        if any(isinstance(item, (str, list)) for item in value):
            raise ValueError("only one prompt per request (batches of prompts are not supported)")
        if all(type(item) is int for item in value):
            return value
    raise ValueError("prompt must be a string or a list of token ids")


def _parse_stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise ValueError("stop must be a string or a list of strings")
    if len(stops) > MAX_STOP_SEQUENCES:
        raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences are allowed, got {len(stops)}")
    if any(s == "" for s in stops):
        raise ValueError("stop sequences must not be empty strings")
    return tuple(stops)


def _parse_content(value: Any) -> str:
    """A message's content: a string, or text parts joined by newlines."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        texts = []
        for part in value:
            if not isinstance(part, dict) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ValueError(f"only text content parts are supported, got {kind!r}")
            if not isinstance(part.get("text"), str):
                raise ValueError("a text content part needs a string 'text'")
            texts.append(part["text"])
        return "\n".join(texts)
    raise ValueError("content must be a string or a list of text parts")


def _is_off(value: Any) -> bool:
    return value is None or value is False


def _is_zero(value: Any) -> bool:
    return value is None or (not isinstance(value, bool) and value == 0)


def _is_one(value: Any) -> bool:
    return value is None or (not isinstance(value, bool) and value == 1)


def _only_off(accepted: Callable[[Any], bool], message: str) -> BeforeValidator:
    """A field we accept only at its "off" value; anything else is a clear 400."""

    def check(value: Any) -> Any:
        if not accepted(value):
            raise ValueError(message)
        return value

    return BeforeValidator(check)


# --------------------------------------------------------------------------- requests
class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")

    include_usage: bool | None = False


class _GenerationRequest(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model_config = ConfigDict(extra="allow")

    model: str
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)  # extension; 0 and -1 mean off
    seed: int | None = None
    stop: Annotated[tuple[str, ...], BeforeValidator(_parse_stop)] = ()
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # extension
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None  # extension
    user: str | None = None
    # accepted only at their "off" values
    n: Annotated[Any, _only_off(_is_one, "only n=1 is supported (one choice per request)")] = 1
    logprobs: Annotated[Any, _only_off(_is_off, "logprobs are not supported")] = None
    presence_penalty: Annotated[Any, _only_off(_is_zero, "presence_penalty is not supported (only 0)")] = None
    frequency_penalty: Annotated[Any, _only_off(_is_zero, "frequency_penalty is not supported (only 0)")] = (
        None
    )
    logit_bias: Annotated[Any, _only_off(lambda v: v is None or v == {}, "logit_bias is not supported")] = (
        None
    )

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
    prompt: Annotated[str | list[int], BeforeValidator(_parse_prompt)]
    max_tokens: int | None = Field(default=16, ge=1)
    best_of: Annotated[Any, _only_off(_is_one, "best_of > 1 is not supported")] = None
    echo: Annotated[Any, _only_off(_is_off, "echo is not supported")] = None
    suffix: Annotated[Any, _only_off(lambda v: v is None or v == "", "suffix is not supported")] = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant"]
    content: Annotated[str, BeforeValidator(_parse_content)]


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    top_logprobs: Annotated[Any, _only_off(_is_zero, "top_logprobs are not supported")] = None
    tools: Annotated[Any, _only_off(lambda v: v is None or v == [], "tools are not supported")] = None
    tool_choice: Annotated[
        Any, _only_off(lambda v: v is None or v == "none", "tool_choice is not supported")
    ] = None
    response_format: Annotated[
        Any,
        _only_off(
            lambda v: v is None or v == {"type": "text"}, "response_format is not supported (only text)"
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
