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


def test_default_valued_openai_fields_are_accepted() -> None:
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
            "store": False,
            "user": "u-1",
            "metadata": {"team": "search"},
            "temperature": None,
        }
    )
    assert req.sampling_spec(1) == SamplingSpec(temperature=1.0, max_tokens=1, top_p=1.0)


@pytest.mark.parametrize("field", ["some_future_field", "guided_grammar", "parallel_tool_calls", "reasoning_effort"])
def test_unknown_fields_are_refused_by_name(field: str) -> None:
    with pytest.raises(ValidationError) as info:
        CompletionRequest.model_validate({"model": "m", "prompt": "x", field: {"a": 1}})
    (error,) = info.value.errors()
    assert (error["type"], error["loc"]) == ("extra_forbidden", (field,))


def test_new_sampling_fields_reach_the_spec() -> None:
    req = ChatCompletionRequest.model_validate(
        {
            "model": "m",
            "messages": [{"role": "developer", "content": [{"type": "text", "text": "Be brief."}]}],
            "presence_penalty": 0.5,
            "frequency_penalty": -0.25,
            "repetition_penalty": 1.2,
            "logit_bias": {"7": 100, "9": -300},
            "min_p": 0.05,
            "min_tokens": 3,
        }
    )
    spec = req.sampling_spec(8)
    assert (spec.presence_penalty, spec.frequency_penalty, spec.repetition_penalty) == (0.5, -0.25, 1.2)
    assert (spec.logit_bias, spec.min_p, spec.min_tokens) == ({7: 100.0, 9: -300.0}, 0.05, 3)
    assert spec.to_params().logit_bias == {7: 100.0, 9: -100.0}  # clamped by the engine
    assert req.template_messages() == [{"role": "system", "content": "Be brief."}]


def test_an_echoed_assistant_message_with_empty_fields_is_accepted() -> None:
    echoed = {"role": "assistant", "content": "Hi", "refusal": None, "tool_calls": [], "function_call": None, "name": None}
    req = ChatCompletionRequest.model_validate({"model": "m", "messages": [echoed, {"role": "user", "content": "x"}]})
    assert req.template_messages()[0] == {"role": "assistant", "content": "Hi"}


def test_a_messages_name_goes_to_the_chat_template() -> None:
    """OpenAI and vLLM take a participant's ``name`` (LangChain sends it whenever a message has
    one, as LangGraph's agents' do); it used to be refused with a 400."""
    messages = [{"role": "user", "content": "Hi", "name": "alice"}, {"role": "assistant", "content": "Hello", "name": "bot"}]
    req = ChatCompletionRequest.model_validate({"model": "m", "messages": messages})
    assert req.template_messages() == messages
    with pytest.raises(ValidationError, match="at most 256"):
        ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "x", "name": "n" * 257}]})


def test_prompt_lists() -> None:
    def prompts(value: object) -> list:
        return CompletionRequest.model_validate({"model": "m", "prompt": value}).prompts

    assert prompts("a") == ["a"]
    assert prompts([1, 2]) == [[1, 2]]
    assert prompts(["a", "b"]) == ["a", "b"]
    assert prompts([[1, 2], [3.0]]) == [[1, 2], [3]]
    assert prompts(["only"]) == ["only"]


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("n", 129, "less than or equal to 128"),
        ("logprobs", 21, "less than or equal to 20"),
        ("logprobs", -1, "greater than or equal to 0"),
        ("best_of", 3, "best_of > 1 is not supported"),
        ("presence_penalty", 2.5, "less than or equal to 2"),
        ("frequency_penalty", -2.5, "greater than or equal to -2"),
        ("logit_bias", {"-5": 10}, "logit_bias keys must be token ids"),
        ("logit_bias", {"5": float("nan")}, "must be a finite number"),
        ("logit_bias", {str(i): 1 for i in range(301)}, "at most 300 entries"),
        ("metadata", {"k": 1}, "metadata must be an object of string values"),
        ("metadata", {str(i): "v" for i in range(17)}, "at most 16 pairs"),
        ("store", True, "store is not supported"),
        ("min_p", -0.1, "greater than or equal to 0"),
        ("repetition_penalty", -1, "greater than 0"),
        ("suffix", "end", "suffix is not supported"),
        ("stop", ["a", "b", "c", "d", "e"], "at most 4 stop sequences are allowed, got 5"),
        ("stop", [""], "stop sequences must not be empty strings"),
        ("stop", 3, "stop must be a string or a list of strings"),
        ("prompt", ["a", [1]], "prompt must be a string, a list of token ids, or a non-empty list of either"),
        ("prompt", [[1, 2], []], "prompt must be a string, a list of token ids, or a non-empty list of either"),
        ("prompt", [1, True], "prompt must be a string, a list of token ids, or a non-empty list of either"),
        ("prompt", ["a"] * 65, "at most 64 prompts are allowed in one request, got 65"),
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


def test_chat_max_tokens_defaults_to_none_and_stream_options_need_stream() -> None:
    req = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "x"}]})
    assert req.requested_max_tokens is None
    assert req.include_usage is False
    with pytest.raises(ValidationError, match="stream_options is only allowed when stream is true"):
        ChatCompletionRequest.model_validate(
            {"model": "m", "messages": [{"role": "user", "content": "x"}], "stream_options": {"include_usage": True}}
        )
    streamed = {"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": True}
    assert ChatCompletionRequest.model_validate({**streamed, "stream_options": {"include_usage": True}}).include_usage
    with pytest.raises(ValidationError, match="stream_options.continuous_usage_stats"):
        ChatCompletionRequest.model_validate({**streamed, "stream_options": {"continuous_usage_stats": True}})


@pytest.mark.parametrize(
    ("messages", "loc", "message"),
    [
        ([], ("messages",), "at least 1 item"),
        ([{"role": "function", "content": "x"}], ("messages", 0, "role"), "'system', 'developer', 'user', 'assistant' or 'tool'"),
        ([{"role": "user", "content": "x", "name": 7}], ("messages", 0, "name"), "Input should be a valid string"),
        ([{"role": "user", "content": "x", "audio": None}], ("messages", 0, "audio"), "Extra inputs are not permitted"),
        (
            [{"role": "user", "content": [{"type": "text", "text": "x", "cache_control": {}}]}],
            ("messages", 0, "content"),
            "unsupported parameter in text part 0: cache_control",
        ),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
            ("messages", 0, "content"),
            "only text content parts are supported, got 'image_url'",
        ),
        (
            [{"role": "user", "content": None}],
            ("messages", 0),
            "content may be null only in an assistant message with tool_calls",
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
        ("top_logprobs", 3, "top_logprobs requires logprobs to be true"),
        ("tools", [{"type": "function"}], "tools[0].function must be an object with a name"),
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
