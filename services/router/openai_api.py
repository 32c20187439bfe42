"""The OpenAI wire format: request models, response and SSE chunk builders, error bodies.

Pydantic lives here and nowhere else in the router: a request is validated into a model, turned
into a ``SamplingSpec`` and prompt, and the answer is built as plain dicts.
"""

from __future__ import annotations

import dataclasses
import json
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ModelWrapValidatorHandler,
    PrivateAttr,
    ValidationError,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
    model_validator,
)

from kvmesh.engine.request import MAX_LOGPROBS, PENALTY_RANGE, SEED_RANGE
from kvmesh.engine.structured import GrammarError, GuidedDecoding, check_guided
from kvmesh.protocol import GuidedSpec, SamplingSpec
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
    lone_surrogate,
    unicode_problem,
)
from kvmesh.services.router.tools import (
    MESSAGE_TOOL_CALLS_SCHEMA,
    TOOL_CHOICE_SCHEMA,
    TOOLS_SCHEMA,
    Tool,
    ToolSet,
    parse_message_tool_calls,
    parse_tool_choice,
    parse_tools,
)
from kvmesh.services.router.structured_fields import (
    GUIDED_CHOICE_SCHEMA,
    GUIDED_FIELDS,
    GUIDED_JSON_SCHEMA,
    GUIDED_REGEX_SCHEMA,
    RESPONSE_FORMAT_SCHEMA,
    STRUCTURED_OUTPUTS_SCHEMA,
    parse_guided_choice,
    parse_guided_json,
    parse_guided_regex,
    parse_response_format,
    parse_structured_outputs,
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


def _ignore_eos_with_grammar() -> APIError:
    """A grammar's end is the request's: ignoring EOS past it would generate nothing the grammar allows."""
    return APIError(
        400, "ignore_eos cannot be combined with structured output or tool_choice required / a named function", param="ignore_eos"
    )


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
    # structured output (``structured_fields``): OpenAI's, and vLLM's spellings; at most one
    response_format: Annotated[
        GuidedDecoding | None, BeforeValidator(parse_response_format), WithJsonSchema(RESPONSE_FORMAT_SCHEMA)
    ] = None
    guided_json: Annotated[
        GuidedDecoding | None, BeforeValidator(parse_guided_json), WithJsonSchema(GUIDED_JSON_SCHEMA)
    ] = None
    guided_regex: Annotated[
        GuidedDecoding | None, BeforeValidator(parse_guided_regex), WithJsonSchema(GUIDED_REGEX_SCHEMA)
    ] = None
    guided_choice: Annotated[
        GuidedDecoding | None, BeforeValidator(parse_guided_choice), WithJsonSchema(GUIDED_CHOICE_SCHEMA)
    ] = None
    structured_outputs: Annotated[
        GuidedDecoding | None, BeforeValidator(parse_structured_outputs), WithJsonSchema(STRUCTURED_OUTPUTS_SCHEMA)
    ] = None

    @model_validator(mode="wrap")
    @classmethod
    def _all_text_valid(cls, data: Any, handler: ModelWrapValidatorHandler[Any]) -> Any:
        """Every string valid Unicode (``lone_surrogate``): a field that checks its own text
        refuses it in its words; any other is refused here, before it reaches the tokenizer."""
        found = lone_surrogate(data)
        if found is None:
            return handler(data)
        try:
            handler(data)
        except ValidationError:
            raise
        except Exception:  # noqa: BLE001, S110 - what the text does elsewhere; refused below either way
            pass
        raise APIError(400, f"{found[0]}: {found[1]}", param=found[0])

    @model_validator(mode="after")
    def _one_guided_field(self) -> _GenerationRequest:
        given = [name for name in GUIDED_FIELDS if getattr(self, name) is not None]
        if len(given) > 1:
            raise ValueError(f"only one of {', '.join(GUIDED_FIELDS)} may be given, got {' and '.join(given)}")
        if given and self.ignore_eos:
            raise _ignore_eos_with_grammar()
        return self

    @property
    def guided(self) -> GuidedDecoding | None:
        """What the output must match, if the request asks for structured output."""
        return next((getattr(self, n) for n in GUIDED_FIELDS if getattr(self, n) is not None), None)

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
            guided=None if self.guided is None else GuidedSpec(kind=self.guided.kind, value=self.guided.value),
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

    @field_validator("best_of")
    @classmethod
    def _best_of_covers_n(cls, value: Any, info: ValidationInfo) -> Any:
        n = info.data.get("n") or 1  # validated before: a field of the base class
        if value is not None and n > value:  # OpenAI's rule: best_of is at least n
            raise ValueError(f"best_of ({value}) must be at least n ({n})")
        return value

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


def _parse_optional_content(value: Any) -> str | None:
    return None if value is None else _parse_content(value)


def _message_variants(schema: dict[str, Any]) -> None:
    """A message's schema, one variant per role, with what ``_content_or_tool_calls`` checks:
    content null only in an assistant message with tool calls, tool calls only in assistant
    messages, ``tool_call_id`` exactly in tool messages (so a client, or a fuzzer, that keeps
    to the schema sends what is accepted)."""
    props = schema["properties"]
    text = props["content"]["anyOf"][0]
    tool_calls = {**props["tool_calls"]["anyOf"][0], "minItems": 1}

    def variant(roles: list[str], required: list[str], **own: Any) -> dict[str, Any]:
        return {
            "type": "object",
            "properties": {"role": {"enum": roles}, "name": props["name"], "refusal": props["refusal"], **own},
            "required": ["role", *required],
            "additionalProperties": False,
        }

    variants = [
        variant(["system", "developer", "user"], ["content"], content=text),
        variant(["assistant"], ["content"], content=text, tool_calls=props["tool_calls"]),
        variant(["assistant"], ["tool_calls"], content={"type": "null"}, tool_calls=tool_calls),
        variant(["tool"], ["content", "tool_call_id"], content=text, tool_call_id={"type": "string"}),
    ]
    title = schema.get("title", "ChatMessage")
    schema.clear()
    schema.update({"title": title, "anyOf": variants})


class ChatMessage(BaseModel):
    model_config = ConfigDict(**_STRICT, json_schema_extra=_message_variants)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    # null only in an assistant message with tool calls
    content: Annotated[
        str | None, BeforeValidator(_parse_optional_content), WithJsonSchema({"anyOf": [CONTENT_SCHEMA, {"type": "null"}]})
    ] = None
    # the participant's name (LangGraph's agents set one): handed to the chat template, as vLLM does
    name: Text | None = Field(default=None, max_length=256)
    # what a client echoes back in an assistant message of the history, accepted when empty
    refusal: Annotated[Any, _only_off(_is_null, "a message's refusal is not supported")] = None
    # an assistant message's tool calls, and a tool message's answer to one (``tools``)
    tool_calls: Annotated[
        tuple[dict[str, Any], ...] | None, BeforeValidator(parse_message_tool_calls), WithJsonSchema(MESSAGE_TOOL_CALLS_SCHEMA)
    ] = None
    tool_call_id: Text | None = None
    function_call: Annotated[Any, _only_off(_is_null, "function_call in messages is not supported")] = None

    @model_validator(mode="after")
    def _content_or_tool_calls(self) -> ChatMessage:
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages may have tool_calls")
        if (self.role == "tool") != (self.tool_call_id is not None):
            raise ValueError("a tool message needs its tool_call_id, and only a tool message has one")
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content may be null only in an assistant message with tool_calls")
        return self

    def template_message(self) -> dict[str, Any]:
        message: dict[str, Any] = {"role": self.template_role, "content": self.content}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = list(self.tool_calls)
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message

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

    # tool calling (``tools``)
    tools: Annotated[tuple[Tool, ...] | None, BeforeValidator(parse_tools), WithJsonSchema(TOOLS_SCHEMA)] = None
    tool_choice: Annotated[str | None, BeforeValidator(parse_tool_choice), WithJsonSchema(TOOL_CHOICE_SCHEMA)] = None
    parallel_tool_calls: bool | None = None
    _tools: ToolSet | None = PrivateAttr(default=None)
    _tools_guided: GuidedDecoding | None = PrivateAttr(default=None)

    @model_validator(mode="after")
    def _tool_set(self) -> ChatCompletionRequest:
        self._tools = ToolSet.of(self.tools, self.tool_choice, self.parallel_tool_calls)
        if self._tools is None:
            return self
        try:
            grammar = self._tools.guided()
            if grammar is not None:
                check_guided(grammar)  # the combined grammar compiles, as each schema did alone
        except GrammarError as exc:
            raise APIError(400, f"tools: the tools' schemas cannot be enforced together: {exc}", param="tools") from exc
        self._tools_guided = grammar
        if grammar is None:
            return self
        if super().guided is not None:
            raise ValueError("tool_choice required or a named function cannot be combined with structured output")
        if self.ignore_eos:
            raise _ignore_eos_with_grammar()
        # Arguments cut short by a stop string or stop token would be a call that does not parse.
        for name in ("stop", "stop_token_ids"):
            if getattr(self, name):
                raise APIError(400, f"{name} cannot be combined with tool_choice required or a named function", param=name)
        return self

    @property
    def tool_set(self) -> ToolSet | None:
        """The request's tools and what it may answer with them; None without tools."""
        return self._tools

    @property
    def guided(self) -> GuidedDecoding | None:
        tools = self._tools_guided
        return tools if tools is not None else super().guided

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def template_messages(self) -> list[dict[str, Any]]:
        """The messages as the chat template wants them: role and content (and tool calls)."""
        return [m.template_message() for m in self.messages]


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

    def final_chunks(self, finish_reason: str | None, index: int = 0) -> list[dict[str, Any]]:
        """What ends a streamed choice: its final chunk (and, for tool calls, what was held back)."""
        return [self.final_chunk(finish_reason, index)]

    @abstractmethod
    def final_chunk(self, finish_reason: str | None, index: int = 0) -> dict[str, Any]: ...

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
    def __init__(self, request_id: str, model: str, *, include_usage: bool = False, created: int | None = None) -> None:
        super().__init__(request_id, model, include_usage=include_usage, created=created)
        # A request with tools: its answers are parsed for tool calls (``tools.ToolSet``).
        self.tools: ToolSet | None = None
        self._tool_sets: dict[int, ToolSet] = {}  # per choice: its own call ids
        self._held_text: dict[int, list[str]] = {}  # per choice: the text held back to parse
        self._sent_chars: dict[int, int] = {}  # per choice, with tool_choice auto: of it, the characters sent as content

    def response_choices(
        self, results: list[tuple[str, str | None]], usage: Usage, logprobs: list[dict[str, Any] | None] | None = None
    ) -> dict[str, Any]:
        choices = []
        for i, (text, reason) in enumerate(results):
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if self._parses_tools:
                assert self.tools is not None
                message, reason = self._tool_set(i).message(text, reason)
            choice_logprobs = logprobs[i] if logprobs else None
            choices.append({"index": i, "message": message, "logprobs": choice_logprobs, "finish_reason": reason})
        return {**self._envelope("chat.completion", choices), "usage": usage.to_dict()}

    @property
    def _parses_tools(self) -> bool:
        return self.tools is not None and self.tools.mode != "none"

    def _tool_set(self, index: int) -> ToolSet:
        """Each choice's own call ids."""
        assert self.tools is not None
        if index not in self._tool_sets:
            self._tool_sets[index] = dataclasses.replace(self.tools, call_ids=[])
        return self._tool_sets[index]

    def _held(self, index: int) -> list[str]:
        return self._held_text.setdefault(index, [])

    def opening_chunks(self, num_choices: int = 1) -> list[dict[str, Any]]:
        return [self._delta({"role": "assistant", "content": ""}, None, index) for index in range(num_choices)]

    def content_chunk(self, text: str, index: int = 0, logprobs: dict[str, Any] | None = None) -> dict[str, Any] | None:
        """A content delta (with its tokens' ``logprobs``, when asked for); with tool calls, a
        named function's argument fragment, or None while the answer is held back to be parsed
        when it ends (``required``; with ``auto``, from where a ``<tool_call>`` may begin); the
        logprobs then come in a delta of their own."""
        if not self._parses_tools:
            return self._delta({"content": text}, None, index, logprobs)
        chunk = self._tool_content_chunk(text, index) if text else None
        if logprobs is None:
            return chunk
        if chunk is None:
            return self._delta({}, None, index, logprobs)
        chunk["choices"][0]["logprobs"] = logprobs
        return chunk

    def _tool_content_chunk(self, text: str, index: int) -> dict[str, Any] | None:
        tools = self._tool_set(index)
        held = self._held(index)
        held.append(text)
        if tools.mode == "auto":
            whole = "".join(held)
            sent = self._sent_chars.get(index, 0)
            safe = tools.text_before_calls(whole)
            if safe <= sent:
                return None
            self._sent_chars[index] = safe
            return self._delta({"content": whole[sent:safe]}, None, index)
        return None  # required, a named function: sent when it ends, a call only if it parses

    def final_chunks(self, finish_reason: str | None, index: int = 0) -> list[dict[str, Any]]:
        if not self._parses_tools:
            return [self.final_chunk(finish_reason, index)]
        tools = self._tool_set(index)
        message, reason = tools.message("".join(self._held(index))[self._sent_chars.get(index, 0) :], finish_reason)
        chunks: list[dict[str, Any]] = []
        if message["content"]:
            chunks.append(self._delta({"content": message["content"]}, None, index))
        for i, call in enumerate(message.get("tool_calls", [])):
            function = call["function"]
            head = {"index": i, "id": call["id"], "type": "function", "function": {"name": function["name"], "arguments": ""}}
            chunks.append(self._delta({"tool_calls": [head]}, None, index))
            chunks.append(self._delta({"tool_calls": [{"index": i, "function": {"arguments": function["arguments"]}}]}, None, index))
        return [*chunks, self.final_chunk(reason, index)]

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
