"""What the generation endpoints answer, for /openapi.json: an OpenAI error body for every error
status, and for 200 the answer's JSON object or its SSE stream. Loose where other parts add to an
answer (extra fields are allowed), exact where clients depend on it, so that a fuzzer checking
answers against the schema catches a malformed one."""

from __future__ import annotations

from typing import Any

__all__ = [
    "CHAT_ANSWER",
    "CHAT_CHUNK",
    "COMPLETION_ANSWER",
    "COMPLETION_CHUNK",
    "ERROR_BODY",
    "RESPONSE_ANSWER",
    "RESPONSE_EVENT",
    "generation_responses",
]

_TEXT_OR_NULL = {"type": ["string", "null"]}
ERROR_BODY: dict[str, Any] = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": _TEXT_OR_NULL,
                "code": _TEXT_OR_NULL,
            },
        }
    },
}
_COUNT = {"type": "integer", "minimum": 0}
_CHAT_USAGE = {
    "type": "object",
    "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
    "properties": {"prompt_tokens": _COUNT, "completion_tokens": _COUNT, "total_tokens": _COUNT},
}
_FINISH = {"type": ["string", "null"]}


def _answer(obj: str, choice: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "required": ["id", "object", "created", "model", "choices", "usage"],
        "properties": {
            "id": {"type": "string"},
            "object": {"const": obj},
            "created": {"type": "integer"},
            "model": {"type": "string"},
            "choices": {"type": "array", "minItems": 1, "items": choice},
            "usage": _CHAT_USAGE,
        },
    }


COMPLETION_ANSWER = _answer(
    "text_completion",
    {
        "type": "object",
        "required": ["index", "text", "finish_reason"],
        "properties": {"index": _COUNT, "text": {"type": "string"}, "finish_reason": _FINISH},
    },
)
CHAT_ANSWER = _answer(
    "chat.completion",
    {
        "type": "object",
        "required": ["index", "message", "finish_reason"],
        "properties": {
            "index": _COUNT,
            "message": {"type": "object", "required": ["role"], "properties": {"role": {"const": "assistant"}}},
            "finish_reason": _FINISH,
        },
    },
)


def _chunk(obj: str) -> dict[str, Any]:
    """A streamed chunk (the last may carry only ``usage``), or an error ending the stream."""
    chunk = {
        "type": "object",
        "required": ["id", "object", "created", "model", "choices"],
        "properties": {
            "id": {"type": "string"},
            "object": {"const": obj},
            "created": {"type": "integer"},
            "model": {"type": "string"},
            "choices": {"type": "array", "items": {"type": "object", "required": ["index"], "properties": {"index": _COUNT}}},
        },
    }
    return {"anyOf": [chunk, ERROR_BODY]}


COMPLETION_CHUNK = _chunk("text_completion")
CHAT_CHUNK = _chunk("chat.completion.chunk")
RESPONSE_EVENT: dict[str, Any] = {
    "type": "object",
    "required": ["type", "sequence_number"],
    "properties": {
        "type": {"type": "string", "pattern": "^(response\\.[a-z_.]+|error)$"},
        "sequence_number": _COUNT,
    },
}
_OUTPUT_TEXT = {
    "type": "object",
    "required": ["type", "text", "annotations"],
    "properties": {"type": {"const": "output_text"}, "text": {"type": "string"}, "annotations": {"type": "array"}},
}
RESPONSE_ANSWER: dict[str, Any] = {
    "type": "object",
    "required": ["id", "object", "created_at", "status", "model", "output", "usage"],
    "properties": {
        "id": {"type": "string", "pattern": "^resp_"},
        "object": {"const": "response"},
        "created_at": {"type": "integer"},
        "status": {"enum": ["completed", "incomplete"]},
        "model": {"type": "string"},
        "output": {
            "type": "array",
            "minItems": 1,
            "maxItems": 1,
            "items": {
                "type": "object",
                "required": ["type", "id", "status", "role", "content"],
                "properties": {
                    "type": {"const": "message"},
                    "id": {"type": "string", "pattern": "^msg_"},
                    "status": {"enum": ["completed", "incomplete"]},
                    "role": {"const": "assistant"},
                    "content": {"type": "array", "minItems": 1, "maxItems": 1, "items": _OUTPUT_TEXT},
                },
            },
        },
        "usage": {
            "type": "object",
            "required": ["input_tokens", "input_tokens_details", "output_tokens", "total_tokens"],
            "properties": {
                "input_tokens": _COUNT,
                "input_tokens_details": {
                    "type": "object",
                    "required": ["cached_tokens", "cache_write_tokens"],
                    "properties": {"cached_tokens": _COUNT, "cache_write_tokens": _COUNT},
                },
                "output_tokens": _COUNT,
                "total_tokens": _COUNT,
            },
        },
    },
}
_ERRORS = {
    400: "bad request: the field is named in `param`",
    401: "no or a wrong API key",
    404: "an unknown model",
    408: "the request did not arrive in time",
    413: "the request is too large",
    429: "over a rate limit",
    500: "a server error",
    503: "no worker can take it now (retry)",
    504: "the request's deadline passed",
}


def _event(data: dict[str, Any], *, done: bool) -> dict[str, Any]:
    """One server-sent event whose ``data`` is JSON as ``data`` describes (or ``[DONE]``)."""
    json_data = {"type": "string", "contentMediaType": "application/json", "contentSchema": data}
    return {
        "type": "object",
        "required": ["data"],
        "properties": {"data": {"anyOf": [{"const": "[DONE]"}, json_data]} if done else json_data},
    }


def generation_responses(
    answer: dict[str, Any], chunk: dict[str, Any], *, done: bool = True
) -> dict[int | str, dict[str, Any]]:
    """FastAPI's ``responses=`` for a generation endpoint whose JSON answer is ``answer`` and
    whose streamed events carry ``chunk`` (and a last ``[DONE]`` when ``done``)."""
    responses: dict[int | str, dict[str, Any]] = {
        200: {
            "description": "the answer, or with `stream: true` its server-sent events",
            "content": {"application/json": {"schema": answer}, "text/event-stream": {"schema": _event(chunk, done=done)}},
        }
    }
    for status, description in _ERRORS.items():
        responses[status] = {"description": description, "content": {"application/json": {"schema": ERROR_BODY}}}
    return responses
