"""The OpenAI wire format: request validation, SamplingSpec, response and chunk shapes, errors."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from kvmesh.protocol import SamplingSpec
from kvmesh.services.router.openai_api import (
    APIError,
    ChatCompletionRequest,
    ChatFormat,
    CompletionFormat,
    CompletionRequest,
    Usage,
    error_body,
    error_type,
    sse_event,
)


def test_completion_defaults_build_openai_sampling() -> None:
    req = CompletionRequest.model_validate({"model": "m", "prompt": "hi"})
    assert req.requested_max_tokens == 16
    assert req.include_usage is False
    assert req.sampling_spec(16) == SamplingSpec(
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        seed=None,
        max_tokens=16,
        stop=(),
        stop_token_ids=(),
        ignore_eos=False,
    )


def test_sampling_fields_pass_through() -> None:
    req = CompletionRequest.model_validate(
        {
            "model": "m",
            "prompt": [3, 4],
            "temperature": 0,
            "top_p": 0.5,
            "top_k": 7,
            "seed": 11,
            "stop": "\n",
            "stop_token_ids": [2, 9],
            "ignore_eos": True,
            "max_tokens": 5,
        }
    )
    assert req.prompt == [3, 4]
    assert req.sampling_spec(5) == SamplingSpec(
        temperature=0.0,
        top_p=0.5,
        top_k=7,
        seed=11,
        max_tokens=5,
        stop=("\n",),
        stop_token_ids=(2, 9),
        ignore_eos=True,
    )


def test_top_k_minus_one_means_off_and_stop_list_is_kept() -> None:
    req = CompletionRequest.model_validate({"model": "m", "prompt": "x", "top_k": -1, "stop": ["a", "b"]})
    spec = req.sampling_spec(3)
    assert (spec.top_k, spec.stop) == (0, ("a", "b"))


def test_unknown_and_default_valued_openai_fields_are_tolerated() -> None:
    req = CompletionRequest.model_validate(
        {
            "model": "m",
            "prompt": "x",
            "logprobs": None,
            "presence_penalty": 0,
            "frequency_penalty": 0.0,
            "logit_bias": {},
            "n": 1,
            "best_of": 1,
            "echo": False,
            "temperature": None,
            "some_future_field": {"a": 1},
        }
    )
    assert req.sampling_spec(1).temperature == 1.0


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("n", 2, "only n=1 is supported"),
        ("logprobs", 1, "logprobs are not supported"),
        ("echo", True, "echo is not supported"),
        ("best_of", 3, "best_of > 1 is not supported"),
        ("presence_penalty", 0.5, "presence_penalty is not supported"),
        ("frequency_penalty", -1, "frequency_penalty is not supported"),
        ("logit_bias", {"5": 10}, "logit_bias is not supported"),
        ("suffix", "end", "suffix is not supported"),
        ("stop", ["a", "b", "c", "d", "e"], "at most 4 stop sequences are allowed, got 5"),
        ("stop", [""], "stop sequences must not be empty strings"),
        ("stop", 3, "stop must be a string or a list of strings"),
        ("prompt", ["a", "b"], "only one prompt per request"),
        ("prompt", [[1, 2], [3]], "only one prompt per request"),
        ("prompt", [1, True], "prompt must be a string or a list of token ids"),
    ],
)
def test_completion_rejects_unsupported_values(field: str, value: object, message: str) -> None:
    with pytest.raises(ValidationError) as info:
        CompletionRequest.model_validate({"model": "m", "prompt": "x", field: value})
    (error,) = info.value.errors()
    assert error["loc"] == (field,)
    assert message in error["msg"]


@pytest.mark.parametrize(
    ("field", "value", "type_"),
    [
        ("temperature", 2.5, "less_than_equal"),
        ("temperature", -0.1, "greater_than_equal"),
        ("top_p", 0, "greater_than"),
        ("top_p", 1.5, "less_than_equal"),
        ("max_tokens", 0, "greater_than_equal"),
    ],
)
def test_completion_range_checks(field: str, value: object, type_: str) -> None:
    with pytest.raises(ValidationError) as info:
        CompletionRequest.model_validate({"model": "m", "prompt": "x", field: value})
    (error,) = info.value.errors()
    assert (error["loc"], error["type"]) == ((field,), type_)


def test_chat_joins_text_parts_and_prefers_max_completion_tokens() -> None:
    req = ChatCompletionRequest.model_validate(
        {
            "model": "m",
            "messages": [
                {"role": "system", "content": "Be brief."},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}],
                },
            ],
            "max_tokens": 9,
            "max_completion_tokens": 4,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    )
    assert req.template_messages() == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "one\ntwo"},
    ]
    assert req.requested_max_tokens == 4
    assert req.include_usage is True


def test_chat_max_tokens_defaults_to_none_and_usage_needs_stream() -> None:
    req = ChatCompletionRequest.model_validate(
        {
            "model": "m",
            "messages": [{"role": "user", "content": "x"}],
            "stream_options": {"include_usage": True},
        }
    )
    assert req.requested_max_tokens is None
    assert req.include_usage is False


@pytest.mark.parametrize(
    ("messages", "loc", "message"),
    [
        ([], ("messages",), "at least 1 item"),
        ([{"role": "tool", "content": "x"}], ("messages", 0, "role"), "'system', 'user' or 'assistant'"),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
            ("messages", 0, "content"),
            "only text content parts are supported, got 'image_url'",
        ),
        (
            [{"role": "user", "content": None}],
            ("messages", 0, "content"),
            "content must be a string or a list",
        ),
    ],
)
def test_chat_message_validation(messages: list, loc: tuple, message: str) -> None:
    with pytest.raises(ValidationError) as info:
        ChatCompletionRequest.model_validate({"model": "m", "messages": messages})
    (error,) = info.value.errors()
    assert error["loc"] == loc
    assert message in error["msg"]


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("logprobs", True, "logprobs are not supported"),
        ("top_logprobs", 3, "top_logprobs are not supported"),
        ("tools", [{"type": "function"}], "tools are not supported"),
        ("response_format", {"type": "json_object"}, "response_format is not supported"),
    ],
)
def test_chat_rejects_unsupported_values(field: str, value: object, message: str) -> None:
    with pytest.raises(ValidationError) as info:
        ChatCompletionRequest.model_validate(
            {"model": "m", "messages": [{"role": "user", "content": "x"}], field: value}
        )
    assert message in info.value.errors()[0]["msg"]


def test_usage_dict() -> None:
    assert Usage(7, 3, 4).to_dict() == {
        "prompt_tokens": 7,
        "completion_tokens": 3,
        "total_tokens": 10,
        "prompt_tokens_details": {"cached_tokens": 4},
    }


def test_completion_format_objects() -> None:
    fmt = CompletionFormat("abc", "tiny", created=100)
    assert fmt.response("Hello", "length", Usage(2, 1)) == {
        "id": "cmpl-abc",
        "object": "text_completion",
        "created": 100,
        "model": "tiny",
        "choices": [{"index": 0, "text": "Hello", "logprobs": None, "finish_reason": "length"}],
        "usage": {
            "prompt_tokens": 2,
            "completion_tokens": 1,
            "total_tokens": 3,
            "prompt_tokens_details": {"cached_tokens": 0},
        },
    }
    assert fmt.opening_chunks() == []
    assert fmt.content_chunk("He") == {
        "id": "cmpl-abc",
        "object": "text_completion",
        "created": 100,
        "model": "tiny",
        "choices": [{"index": 0, "text": "He", "logprobs": None, "finish_reason": None}],
    }
    assert fmt.final_chunk("stop")["choices"] == [
        {"index": 0, "text": "", "logprobs": None, "finish_reason": "stop"}
    ]


def test_chat_format_objects_with_usage() -> None:
    fmt = ChatFormat("abc", "tiny", include_usage=True, created=100)
    head = {"id": "chatcmpl-abc", "object": "chat.completion.chunk", "created": 100, "model": "tiny"}
    assert fmt.opening_chunks() == [
        {
            **head,
            "choices": [
                {
                    "index": 0,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
            ],
            "usage": None,
        }
    ]
    assert fmt.content_chunk("Hi") == {
        **head,
        "choices": [{"index": 0, "delta": {"content": "Hi"}, "logprobs": None, "finish_reason": None}],
        "usage": None,
    }
    assert fmt.final_chunk("stop") == {
        **head,
        "choices": [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}],
        "usage": None,
    }
    assert fmt.usage_chunk(Usage(5, 2, 1)) == {
        **head,
        "choices": [],
        "usage": {
            "prompt_tokens": 5,
            "completion_tokens": 2,
            "total_tokens": 7,
            "prompt_tokens_details": {"cached_tokens": 1},
        },
    }
    assert fmt.response("Hi", "stop", Usage(5, 2))["choices"] == [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "Hi"},
            "logprobs": None,
            "finish_reason": "stop",
        }
    ]
    assert fmt.response("Hi", "stop", Usage(5, 2))["object"] == "chat.completion"


@pytest.mark.parametrize(
    ("status", "type_"),
    [
        (400, "invalid_request_error"),
        (401, "invalid_request_error"),
        (404, "invalid_request_error"),
        (500, "server_error"),
        (503, "service_unavailable"),
    ],
)
def test_error_types(status: int, type_: str) -> None:
    assert error_type(status) == type_


def test_error_bodies() -> None:
    assert error_body(400, "bad", param="n") == {
        "error": {"message": "bad", "type": "invalid_request_error", "param": "n", "code": None}
    }
    assert APIError(503, "down", code="unavailable").body() == {
        "error": {"message": "down", "type": "service_unavailable", "param": None, "code": "unavailable"}
    }


def test_sse_event_is_compact_json_line() -> None:
    assert sse_event({"a": "é", "b": [1, 2]}) == 'data: {"a":"é","b":[1,2]}\n\n'
