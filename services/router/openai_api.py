"""The OpenAI wire format: request models, response and SSE chunk builders, error bodies.

Pydantic lives here and nowhere else in the router: a request is validated into a model, turned
into a ``SamplingSpec`` and prompt, and the answer is built as plain dicts.
"""

from __future__ import annotations

import json
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationInfo, WithJsonSchema, field_validator

from kvmesh.engine.request import MAX_LOGPROBS, PENALTY_RANGE
from kvmesh.protocol import SamplingSpec
from kvmesh.services.router.openai_fields import (
    CONTENT_SCHEMA,
    LOGIT_BIAS_SCHEMA,
    METADATA_SCHEMA,
    PROMPT_SCHEMA,
    STOP_SCHEMA,
    Text,
    _is_off,
    _is_one,
    _only_off,
    _parse_content,
    _parse_logit_bias,
    _parse_metadata,
    _parse_prompt,
    _parse_stop,
    unicode_problem,
)

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
    "unicode_problem",
]

MAX_STOP_TOKEN_IDS = 64
MAX_N = 128  # OpenAI's limit on choices per prompt
MAX_MESSAGES = 2048  # OpenAI's limit
MAX_TOKEN_ID = 2**31 - 1
SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed takes
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


def error_json(body: dict[str, Any]) -> bytes:
    """An error body as JSON bytes. ASCII-only, so whatever a message quotes (even a lone
    surrogate from the request) encodes."""
    return json.dumps(body, ensure_ascii=True, separators=(",", ":")).encode("ascii")


# --------------------------------------------------------------------------- requests
# Every model forbids fields it does not declare: a field kvmesh does not implement is a 400
# naming it ("unsupported parameter: guided_json"), never silently ignored. Declared fields it
# implements only in part are refused at their other values (``_only_off``).
_STRICT = ConfigDict(extra="forbid")
_PENALTY = Field(default=None, ge=PENALTY_RANGE[0], le=PENALTY_RANGE[1])


class StreamOptions(BaseModel):
    model_config = _STRICT

    include_usage: bool | None = False


class _GenerationRequest(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model_config = _STRICT

    model: Text
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)  # extension; 0 and -1 mean off
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)  # extension (vLLM)
    seed: int | None = Field(default=None, ge=SEED_RANGE[0], le=SEED_RANGE[1])
    stop: Annotated[tuple[str, ...], BeforeValidator(_parse_stop), WithJsonSchema(STOP_SCHEMA)] = ()
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # extension
    stop_token_ids: (
        list[Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]] | None
    ) = Field(default=None, max_length=MAX_STOP_TOKEN_IDS)  # extension
    presence_penalty: float | None = _PENALTY
    frequency_penalty: float | None = _PENALTY
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=100.0)  # extension (vLLM)
    logit_bias: Annotated[
        dict[int, float] | None, BeforeValidator(_parse_logit_bias), WithJsonSchema(LOGIT_BIAS_SCHEMA)
    ] = None
    min_tokens: int | None = Field(default=None, ge=0)  # extension (vLLM)
    # accepted, for the client's own bookkeeping: nothing is stored, so nothing reads them
    user: Text | None = None
    metadata: Annotated[
        dict[str, str] | None, BeforeValidator(_parse_metadata), WithJsonSchema(METADATA_SCHEMA)
    ] = None
    # accepted only at their "off" values
    store: Annotated[Any, _only_off(_is_off, "store is not supported (completions are not stored)", False)] = None
    n: int | None = Field(default=None, ge=1, le=MAX_N)  # choices per prompt (``choices``)

    max_tokens: int | None = Field(default=None, ge=1)

    @field_validator("stream_options")
    @classmethod
    def _only_when_streaming(cls, value: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        if value is not None and not info.data.get("stream"):
            raise ValueError("stream_options is only allowed when stream is true")
        return value

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
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            logit_bias=self.logit_bias or {},
            min_p=self.min_p or 0.0,
            min_tokens=self.min_tokens or 0,
            logprobs=self.num_logprobs,
            prompt_logprobs=self.num_prompt_logprobs,
        )

    @property
    def num_choices(self) -> int:
        """Choices per prompt."""
        return self.n or 1

    @property
    def num_logprobs(self) -> int | None:
        """Top logprobs per generated token; None: no logprobs (the subclasses say)."""
        return None

    @property
    def num_prompt_logprobs(self) -> int | None:
        return None


class CompletionRequest(_GenerationRequest):
    prompt: Annotated[
        str | list[int] | list[str] | list[list[int]], BeforeValidator(_parse_prompt), WithJsonSchema(PROMPT_SCHEMA)
    ]
    max_tokens: int | None = Field(default=16, ge=1)
    best_of: Annotated[Any, _only_off(_is_one, "best_of > 1 is not supported", 1)] = None
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)  # the sampled token's and the top k
    echo: bool | None = False  # the prompt before the completion (with logprobs: the prompt's too)

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs

    @property
    def num_prompt_logprobs(self) -> int | None:
        return self.logprobs if self.echo else None
    suffix: Annotated[Any, _only_off(lambda v: v is None or v == "", "suffix is not supported", "")] = None

    @property
    def prompts(self) -> list[str | list[int]]:
        """Each prompt of the request, one choice each: a string or token ids."""
        prompt = self.prompt
        if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int):
            return [prompt]  # type: ignore[list-item]
        return list(prompt)  # type: ignore[arg-type]


def _is_null(value: Any) -> bool:
    return value is None


class ChatMessage(BaseModel):
    model_config = _STRICT

    role: Literal["system", "developer", "user", "assistant"]
    content: Annotated[str, BeforeValidator(_parse_content), WithJsonSchema(CONTENT_SCHEMA)]
    # what a client echoes back in an assistant message of the history, accepted when empty
    name: Annotated[Any, _only_off(_is_null, "a message's name is not supported")] = None
    refusal: Annotated[Any, _only_off(_is_null, "a message's refusal is not supported")] = None
    tool_calls: Annotated[
        Any, _only_off(lambda v: v is None or v == [], "tool_calls in messages are not supported", [])
    ] = None
    function_call: Annotated[Any, _only_off(_is_null, "function_call in messages is not supported")] = None

    @property
    def template_role(self) -> str:
        """The role the chat template sees: OpenAI's ``developer`` is the system prompt."""
        return "system" if self.role == "developer" else self.role


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)

    @field_validator("top_logprobs")
    @classmethod
    def _needs_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value and not info.data.get("logprobs"):
            raise ValueError("top_logprobs requires logprobs to be true")
        return value

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None
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
        return [{"role": m.template_role, "content": m.content} for m in self.messages]


# --------------------------------------------------------------------------- responses
@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0

    @classmethod
    def total(cls, usages: list[Usage]) -> Usage:
        """One request's usage over its choices."""
        return cls(
            sum(u.prompt_tokens for u in usages),
            sum(u.completion_tokens for u in usages),
            sum(u.cached_tokens for u in usages),
        )

    def completion_only(self) -> Usage:
        """This choice's share when another choice of its prompt counts the prompt (``n``)."""
        return Usage(0, self.completion_tokens, 0)

    def to_dict(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


class _Format(ABC):
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

    def opening_chunks(self, num_choices: int = 1) -> list[dict[str, Any]]:
        return []

    @abstractmethod
    def response_choices(
        self, results: list[tuple[str, str | None]], usage: Usage, logprobs: list[dict[str, Any] | None] | None = None
    ) -> dict[str, Any]:
        """The whole answer, one choice per (text, finish reason), and its logprobs object."""

    def response(self, text: str, finish_reason: str | None, usage: Usage) -> dict[str, Any]:
        """A one-choice answer."""
        return self.response_choices([(text, finish_reason)], usage)

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        return {**self._envelope(self.chunk_object, []), "usage": usage.to_dict()}


class CompletionFormat(_Format):
    """``text_completion`` objects for /v1/completions."""

    id_prefix = "cmpl-"
    chunk_object = "text_completion"

    def response_choices(
        self, results: list[tuple[str, str | None]], usage: Usage, logprobs: list[dict[str, Any] | None] | None = None
    ) -> dict[str, Any]:
        """One choice per prompt (``n`` each): (text, finish reason), in prompt order."""
        choices = [
            {"index": i, "text": text, "logprobs": logprobs[i] if logprobs else None, "finish_reason": reason}
            for i, (text, reason) in enumerate(results)
        ]
        return {**self._envelope("text_completion", choices), "usage": usage.to_dict()}

    def content_chunk(self, text: str, index: int = 0, logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
        return self._chunk(
            self.chunk_object, {"index": index, "text": text, "logprobs": logprobs, "finish_reason": None}
        )

    def final_chunk(self, finish_reason: str | None, index: int = 0) -> dict[str, Any]:
        return self._chunk(
            self.chunk_object, {"index": index, "text": "", "logprobs": None, "finish_reason": finish_reason}
        )


class ChatFormat(_Format):
    """``chat.completion`` and ``chat.completion.chunk`` objects for /v1/chat/completions."""

    id_prefix = "chatcmpl-"
    chunk_object = "chat.completion.chunk"

    def response_choices(
        self, results: list[tuple[str, str | None]], usage: Usage, logprobs: list[dict[str, Any] | None] | None = None
    ) -> dict[str, Any]:
        choices = [
            {
                "index": i,
                "message": {"role": "assistant", "content": text},
                "logprobs": logprobs[i] if logprobs else None,
                "finish_reason": reason,
            }
            for i, (text, reason) in enumerate(results)
        ]
        return {**self._envelope("chat.completion", choices), "usage": usage.to_dict()}

    def opening_chunks(self, num_choices: int = 1) -> list[dict[str, Any]]:
        return [self._delta({"role": "assistant", "content": ""}, None, index) for index in range(num_choices)]

    def content_chunk(self, text: str, index: int = 0, logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
        return self._delta({"content": text}, None, index, logprobs)

    def final_chunk(self, finish_reason: str | None, index: int = 0) -> dict[str, Any]:
        return self._delta({}, finish_reason, index)

    def _delta(
        self, delta: dict[str, Any], finish_reason: str | None, index: int = 0, logprobs: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        return self._chunk(
            self.chunk_object, {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        )


def sse_event(data: dict[str, Any]) -> str:
    """One server-sent event carrying ``data`` as compact JSON."""
    return f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"
