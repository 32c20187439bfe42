"""OpenAI's Responses API (``POST /v1/responses``) for text in and text out, as a translation onto
the chat completions path.

A Responses request is validated (``ResponsesRequest``: every field it does not implement is
refused by name, as on the chat path), turned into the ``ChatCompletionRequest`` it means
(``instructions`` as the first system message, ``input`` as the messages, ``max_output_tokens``
as ``max_completion_tokens``, ``text.format`` as ``response_format``; the sampling options are
the chat path's own fields, copied with their validation), and served by the chat path. Its
answer, a ``chat.completion`` or a chat SSE stream, is rewritten as a ``response`` object or as
the Responses stream's events (``response.created`` ... ``response.completed``, each with its
``sequence_number``). So whatever the chat endpoint supports, this one gets.

Stateless: nothing is stored (``store`` may only be false or absent, and the answer says
``store: false``); ``previous_response_id`` is refused, so a conversation is sent whole as
``input``. A response cut by ``max_output_tokens`` is ``status: incomplete`` and its stream ends
with ``response.incomplete``, as OpenAI's does; an error during a stream is an ``error`` event
then ``response.failed``.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterable, AsyncIterator
from typing import TYPE_CHECKING, Annotated, Any, Literal

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, WithJsonSchema, create_model

from kvmesh.services.router.openai_api import APIError, ChatCompletionRequest
from kvmesh.services.router.openai_fields import Text, _is_off, _is_zero, _only_off, unicode_problem
from kvmesh.services.router.streaming import EventStreamResponse

__all__ = ["RESPONSES", "ResponsesRequest", "chat_request", "renamed", "responses_answer"]

RESPONSES = "/v1/responses"

# The chat path's fields that mean the same in a Responses request: sampling, and what only
# shapes which tokens come (never the answer's form). Copied with their types and validators,
# so both endpoints take the same values; those another part adds to the chat path later (the
# guided decoding spellings) join once there.
SHARED_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "min_tokens",
    "ignore_eos",
    "stop_token_ids",
    "user",
    "metadata",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
)
# a chat field's name in an error about a Responses request
_RESPONSES_NAMES = {
    "messages": "input",
    "max_completion_tokens": "max_output_tokens",
    "max_tokens": "max_output_tokens",
    "response_format": "text.format",
}
_STRICT = ConfigDict(extra="forbid")
_ITEM_TYPES = ("message",)
_PART_TYPES = ("input_text", "output_text")


# --------------------------------------------------------------------------- requests
class InputText(BaseModel):
    model_config = _STRICT

    type: Literal["input_text"]
    text: Text


class OutputText(BaseModel):
    """An earlier answer's text, as a client sends the output of a response back as history."""

    model_config = _STRICT

    type: Literal["output_text"]
    text: Text
    annotations: Annotated[Any, _only_off(lambda v: v is None or v == [], "annotations are not supported", [])] = None
    logprobs: Annotated[Any, _only_off(lambda v: v is None or v == [], "logprobs in input are not supported", [])] = None


def _parse_parts(value: Any) -> Any:
    if isinstance(value, list):
        if not value:
            raise ValueError("content must not be empty")
        for i, part in enumerate(value):
            kind = part.get("type") if isinstance(part, dict) else None
            if isinstance(kind, str) and kind not in _PART_TYPES:
                raise ValueError(f"content part {i}: type {kind!r} is not supported (only input_text and output_text)")
    return value


class InputMessage(BaseModel):
    """A message item of ``input``: OpenAI's easy form (``role`` and ``content``) or the full one."""

    model_config = _STRICT

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Annotated[str | list[InputText | OutputText], BeforeValidator(_parse_parts)]
    id: str | None = None  # an output message sent back as history carries these
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    def chat_message(self) -> dict[str, Any]:
        """The chat path's message: the same role, text parts as its text parts."""
        content = self.content
        if isinstance(content, list):
            return {"role": self.role, "content": [{"type": "text", "text": part.text} for part in content]}
        return {"role": self.role, "content": content}


def _parse_input(value: Any) -> Any:
    """A string is one user message; a list holds message items, each refused by its type otherwise."""
    if isinstance(value, str):
        if not value:
            raise ValueError("input must not be empty")
        problem = unicode_problem(value)
        if problem is not None:
            raise ValueError(problem)
        return [{"role": "user", "content": value}]
    if isinstance(value, list):
        if not value:
            raise ValueError("input must not be empty")
        for i, item in enumerate(value):
            kind = item.get("type", "message") if isinstance(item, dict) else None
            if isinstance(kind, str) and kind not in _ITEM_TYPES:
                raise ValueError(f"input item {i}: type {kind!r} is not supported (only message items)")
    return value


_INPUT_SCHEMA = {
    "anyOf": [
        {"type": "string", "minLength": 1},
        {"type": "array", "items": {"$ref": "#/components/schemas/InputMessage"}, "minItems": 1},
    ]
}
_FORMAT_SCHEMA = {
    "anyOf": [
        {
            "type": "object",
            "properties": {"type": {"enum": ["text", "json_object"]}},
            "required": ["type"],
            "additionalProperties": False,
        },
        {
            "type": "object",
            "properties": {
                "type": {"const": "json_schema"},
                "name": {"type": "string", "pattern": "^[a-zA-Z0-9_-]{1,64}$"},
                "schema": {"type": "object"},
                "strict": {"type": ["boolean", "null"]},
                "description": {"type": "string"},
            },
            "required": ["type", "name", "schema"],
            "additionalProperties": False,
        },
        {"type": "null"},
    ]
}


class TextConfig(BaseModel):
    """``text``: the answer's format. ``format`` becomes the chat path's ``response_format``, which
    decides what it takes."""

    model_config = _STRICT

    format: Annotated[dict[str, Any] | None, WithJsonSchema(_FORMAT_SCHEMA)] = None
    verbosity: Annotated[Any, _only_off(lambda v: v is None or v == "medium", "only verbosity medium is supported", "medium")] = None

    def response_format(self) -> dict[str, Any] | None:
        """OpenAI's chat spelling of ``format``: a json_schema's name, schema, description and
        strict move under ``json_schema``."""
        fmt = self.format
        if fmt is None or fmt.get("type") != "json_schema":
            return fmt
        return {"type": "json_schema", "json_schema": {k: v for k, v in fmt.items() if k != "type"}}


def _is_empty(value: Any) -> bool:
    return value is None or value == []


class _ResponsesFields(BaseModel):
    """The Responses API's own fields; ``ResponsesRequest`` adds the chat path's shared ones."""

    model_config = _STRICT

    model: Text
    input: Annotated[list[InputMessage], BeforeValidator(_parse_input), WithJsonSchema(_INPUT_SCHEMA)]
    instructions: Text | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    stream: bool | None = False
    text: TextConfig | None = None
    # accepted only at their "off" values: stateless, no tools, nothing extra to include
    store: Annotated[
        Any, _only_off(_is_off, "store is not supported: responses are not stored (send store: false)", False)
    ] = None
    previous_response_id: Annotated[
        Any,
        _only_off(
            lambda v: v is None,
            "previous_response_id is not supported: responses are not stored; send the whole conversation as input",
        ),
    ] = None
    background: Annotated[Any, _only_off(_is_off, "background responses are not supported", False)] = None
    include: Annotated[Any, _only_off(_is_empty, "include is not supported", [])] = None
    tools: Annotated[Any, _only_off(_is_empty, "tools are not supported", [])] = None
    tool_choice: Annotated[
        Any, _only_off(lambda v: v is None or v in ("none", "auto"), "tool_choice is not supported", "none", "auto")
    ] = None
    truncation: Annotated[
        Any, _only_off(lambda v: v is None or v == "disabled", "only truncation disabled is supported", "disabled")
    ] = None
    top_logprobs: Annotated[Any, _only_off(_is_zero, "top_logprobs are not supported", 0)] = None


def _shared_fields() -> dict[str, Any]:
    chat = ChatCompletionRequest.model_fields
    return {name: (chat[name].annotation, chat[name]) for name in SHARED_FIELDS if name in chat}


if TYPE_CHECKING:

    class ResponsesRequest(_ResponsesFields):
        temperature: float | None
        top_p: float | None
        metadata: dict[str, str] | None
        user: str | None

else:
    ResponsesRequest = create_model("ResponsesRequest", __base__=_ResponsesFields, **_shared_fields())
    ResponsesRequest.__doc__ = "A ``POST /v1/responses`` body: the Responses API's fields and the chat path's sampling options."


def renamed(error: APIError) -> APIError:
    """An error of the chat path, naming the Responses request's field."""
    if error.param in _RESPONSES_NAMES:
        error.param = _RESPONSES_NAMES[error.param]
    return error


def chat_request(body: ResponsesRequest, raw: dict[str, Any]) -> ChatCompletionRequest:
    """The chat completions request ``body`` means. The shared fields are taken from the raw JSON
    ``raw`` and validated by the chat path's model; its errors name the Responses fields."""
    messages = [{"role": "system", "content": body.instructions}] if body.instructions is not None else []
    messages += [item.chat_message() for item in body.input]
    chat: dict[str, Any] = {name: raw[name] for name in SHARED_FIELDS if name in raw}
    chat.update(model=body.model, messages=messages, stream=bool(body.stream))
    if body.stream:
        chat["stream_options"] = {"include_usage": True}  # response.completed carries the usage
    if body.max_output_tokens is not None:
        chat["max_completion_tokens"] = body.max_output_tokens
    response_format = body.text.response_format() if body.text is not None else None
    if response_format is not None:
        chat["response_format"] = response_format
    try:
        return ChatCompletionRequest.model_validate(chat)
    except ValidationError as exc:
        errors = []
        for err in exc.errors():
            loc = tuple(err.get("loc", ()))
            if loc and loc[0] in _RESPONSES_NAMES:
                loc = (_RESPONSES_NAMES[str(loc[0])], *loc[1:])
            errors.append({**err, "loc": ("body", *loc)})
        raise RequestValidationError(errors) from exc


# --------------------------------------------------------------------------- answers
def _usage(chat_usage: dict[str, Any] | None) -> dict[str, Any] | None:
    if chat_usage is None:
        return None
    details = chat_usage.get("prompt_tokens_details") or {}
    return {
        "input_tokens": chat_usage["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": details.get("cached_tokens", 0), "cache_write_tokens": 0},
        "output_tokens": chat_usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": chat_usage["total_tokens"],
    }


class _Answer:
    """One response's objects: its envelope echoes the request, its message item holds the text."""

    def __init__(self, body: ResponsesRequest, chat_body: ChatCompletionRequest, chat_id: str, created: int) -> None:
        request_id = chat_id.removeprefix("chatcmpl-")
        self.id = f"resp_{request_id}"
        self.item_id = f"msg_{request_id}"
        self.body = body
        self.chat_body = chat_body  # the sampling as served
        self.created = created

    def part(self, text: str) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def item(self, status: str, text: str | None) -> dict[str, Any]:
        content = [] if text is None else [self.part(text)]
        return {"type": "message", "id": self.item_id, "status": status, "role": "assistant", "content": content}

    def response(
        self,
        status: str,
        output: list[dict[str, Any]],
        *,
        usage: dict[str, Any] | None = None,
        error: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        body = self.body
        fmt = body.text.format if body.text is not None and body.text.format is not None else {"type": "text"}
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "completed_at": int(time.time()) if status in ("completed", "incomplete") else None,
            "status": status,
            "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": body.instructions,
            "max_output_tokens": self.chat_body.requested_max_tokens,
            "model": body.model,
            "output": output,
            "parallel_tool_calls": False,
            "previous_response_id": None,
            "reasoning": None,
            "store": False,
            "background": False,
            "temperature": 1.0 if self.chat_body.temperature is None else self.chat_body.temperature,
            "top_p": 1.0 if self.chat_body.top_p is None else self.chat_body.top_p,
            "text": {"format": fmt, "verbosity": "medium"},
            "tool_choice": "auto" if body.tool_choice is None else body.tool_choice,  # as sent
            "tools": [],
            "top_logprobs": 0,
            "truncation": "disabled",
            "usage": usage,
            "user": body.user,
            "metadata": body.metadata or {},
        }


# kvmesh's error codes as the Responses API's ``ResponseError.code``, whose values are a fixed set
_INVALID_PROMPT = {"bad_request", "too_large", "invalid_request_error", "context_length_exceeded"}
_RATE_LIMITED = {"rate_limit_exceeded"}


def _failure_code(code: str | None) -> str:
    """``response.failed``'s ``error.code``: ``invalid_prompt`` for the request's own fault,
    ``rate_limit_exceeded`` for a rate limit, ``server_error`` for the rest (the ``error`` event
    before it carries kvmesh's own code)."""
    if code in _INVALID_PROMPT:
        return "invalid_prompt"
    if code in _RATE_LIMITED:
        return "rate_limit_exceeded"
    return "server_error"


def _status(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


def responses_answer(answer: Response, body: ResponsesRequest, chat_body: ChatCompletionRequest) -> Response:
    """The chat path's answer to ``chat_body`` (``chat_request(body)``, with the model's defaults)
    as the Responses API's."""
    if isinstance(answer, EventStreamResponse):
        answer.body_iterator = _events(answer.body_iterator, body, chat_body)
        return answer
    assert isinstance(answer, JSONResponse), answer
    chat = json.loads(bytes(answer.body))
    [choice] = chat["choices"]
    out = _Answer(body, chat_body, chat["id"], chat["created"])
    status = _status(choice["finish_reason"])
    text = choice["message"]["content"] or ""
    return JSONResponse(out.response(status, [out.item(status, text)], usage=_usage(chat.get("usage"))))


def _sse(event: dict[str, Any]) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False, separators=(',', ':'))}\n\n"


def _chat_events(raw: str) -> list[dict[str, Any] | None]:
    """The chat stream's events in one chunk of its body: parsed objects, None for ``[DONE]``."""
    events: list[dict[str, Any] | None] = []
    for block in raw.split("\n\n"):
        data = block.removeprefix("data: ").strip()
        if data:
            events.append(None if data == "[DONE]" else json.loads(data))
    return events


async def _events(chunks: AsyncIterable[Any], body: ResponsesRequest, chat_body: ChatCompletionRequest) -> AsyncIterator[str]:
    """The chat stream's SSE, re-told as the Responses stream's events."""
    out: _Answer | None = None
    seq = 0
    texts: list[str] = []
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None

    def event(kind: str, **fields: Any) -> str:
        nonlocal seq
        seq += 1
        return _sse({"type": kind, "sequence_number": seq - 1, **fields})

    def where() -> dict[str, Any]:
        assert out is not None
        return {"item_id": out.item_id, "output_index": 0, "content_index": 0}

    async for raw in chunks:
        text = raw if isinstance(raw, str) else bytes(raw).decode()
        for chat in _chat_events(text):
            if chat is None:  # [DONE]: the chat stream ended well
                if out is None:
                    return
                full = "".join(texts)
                status = _status(finish_reason)
                item = out.item(status, full)
                yield event("response.output_text.done", **where(), text=full, logprobs=[])
                yield event("response.content_part.done", **where(), part=out.part(full))
                yield event("response.output_item.done", output_index=0, item=item)
                yield event(f"response.{status}", response=out.response(status, [item], usage=usage))
                return
            if "error" in chat:
                error = chat["error"]
                code = error.get("code") or error.get("type")
                yield event("error", code=code, message=error.get("message"), param=error.get("param"))
                if out is not None:
                    failed = out.response(
                        "failed",
                        [out.item("incomplete", "".join(texts))],
                        error={"code": _failure_code(code), "message": error.get("message")},
                    )
                    yield event("response.failed", response=failed)
                return
            if out is None:
                out = _Answer(body, chat_body, chat["id"], chat["created"])
                yield event("response.created", response=out.response("in_progress", []))
                yield event("response.in_progress", response=out.response("in_progress", []))
                yield event("response.output_item.added", output_index=0, item=out.item("in_progress", None))
                yield event("response.content_part.added", **where(), part=out.part(""))
            if chat.get("usage"):
                usage = _usage(chat["usage"])
            for choice in chat.get("choices", ()):
                delta = choice.get("delta", {}).get("content")
                if delta:
                    texts.append(delta)
                    yield event("response.output_text.delta", **where(), delta=delta, logprobs=[])
                finish_reason = choice.get("finish_reason") or finish_reason
