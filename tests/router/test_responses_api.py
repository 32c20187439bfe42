"""POST /v1/responses against a scripted backend: the request becomes the chat path's (same
prompt ids, same sampling), the answer a ``response`` object or the Responses stream's events in
order, errors name the Responses fields, and the official client's ``responses.create`` and
``responses.stream`` read it."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest
from fastapi import FastAPI

from kvmesh.protocol import SamplingSpec
from kvmesh.services.router.responses_api import TextConfig
from tests.router.fakes import Emit, Fail, FakeBackend, Finish
from tests.router.test_app import CHAT_HI_IDS, MODEL, error

RESPONSES = "/v1/responses"
CHAT = "/v1/chat/completions"


async def events(client: httpx.AsyncClient, payload: dict) -> list[dict[str, Any]]:
    """The stream's events in order, each checked to name its type in ``event:`` too."""
    async with client.stream("POST", RESPONSES, json=payload) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        raw = (await resp.aread()).decode()
    out = []
    for block in raw.split("\n\n")[:-1]:
        head, data = block.split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert head == f"event: {event['type']}"
        out.append(event)
    return out


async def test_a_text_input_is_one_user_message(client: httpx.AsyncClient, fake: FakeBackend) -> None:
    fake.script = [Emit((10,), "Hel"), Emit((11,), "lo"), Finish("stop", num_cached_tokens=8)]
    resp = await client.post(RESPONSES, json={"model": MODEL, "input": "Hi", "max_output_tokens": 5, "top_p": 0.9})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    (call,) = fake.calls
    assert call.prompt_token_ids == CHAT_HI_IDS  # the chat path's prompt for user "Hi"
    assert call.sampling == SamplingSpec(temperature=1.0, top_p=0.9, max_tokens=5)
    assert isinstance(body.pop("created_at"), int) and isinstance(body.pop("completed_at"), int)
    assert body == {
        "id": f"resp_{call.request_id}",
        "object": "response",
        "status": "completed",
        "error": None,
        "incomplete_details": None,
        "instructions": None,
        "max_output_tokens": 5,
        "model": MODEL,
        "output": [
            {
                "type": "message",
                "id": f"msg_{call.request_id}",
                "status": "completed",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "Hello", "annotations": [], "logprobs": []}],
            }
        ],
        "parallel_tool_calls": False,
        "previous_response_id": None,
        "reasoning": None,
        "store": False,
        "background": False,
        "temperature": 1.0,
        "top_p": 0.9,
        "text": {"format": {"type": "text"}, "verbosity": "medium"},
        "tool_choice": "auto",
        "tools": [],
        "top_logprobs": 0,
        "truncation": "disabled",
        "usage": {
            "input_tokens": 15,
            "input_tokens_details": {"cached_tokens": 8, "cache_write_tokens": 0},
            "output_tokens": 2,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": 17,
        },
        "user": None,
        "metadata": {},
    }


async def test_cut_by_max_output_tokens_is_incomplete(client: httpx.AsyncClient, fake: FakeBackend) -> None:
    fake.script = [Emit((10,), "Hel"), Finish("length")]
    body = (await client.post(RESPONSES, json={"model": MODEL, "input": "Hi", "max_output_tokens": 1})).json()
    assert (body["status"], body["incomplete_details"]) == ("incomplete", {"reason": "max_output_tokens"})
    assert body["output"][0]["status"] == "incomplete"


async def test_instructions_and_message_items_make_the_chat_prompt(client: httpx.AsyncClient, fake: FakeBackend) -> None:
    fake.max_model_len = 256
    """Instructions come first as the system message; every role and content form of ``input``
    reaches the template as the chat endpoint's messages would."""
    chat_messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "developer", "content": "Use English."},
        {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "Bye"},
    ]
    items = [
        {"role": "developer", "content": "Use English."},
        {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": "Hi"}, {"type": "input_text", "text": "there"}],
        },
        {  # an earlier response's output item, sent back as history
            "type": "message",
            "id": "msg_1",
            "status": "completed",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "Hello", "annotations": [], "logprobs": []}],
        },
        {"role": "user", "content": "Bye"},
    ]
    options = {"temperature": 0.5, "seed": 7, "stop": ["x"], "top_k": 3, "repetition_penalty": 1.2, "user": "u1"}
    chat = await client.post(CHAT, json={"model": MODEL, "messages": chat_messages, "max_tokens": 4, **options})
    assert chat.status_code == 200, chat.text
    resp = await client.post(
        RESPONSES, json={"model": MODEL, "instructions": "Be brief.", "input": items, "max_output_tokens": 4, **options}
    )
    assert resp.status_code == 200, resp.text
    via_chat, via_responses = fake.calls
    assert via_responses.prompt_token_ids == via_chat.prompt_token_ids
    assert via_responses.sampling == via_chat.sampling
    assert via_responses.sampling.temperature == 0.5 and via_responses.sampling.stop == ("x",)
    body = resp.json()
    assert (body["instructions"], body["temperature"], body["user"]) == ("Be brief.", 0.5, "u1")


async def test_streamed_events_in_order(client: httpx.AsyncClient, fake: FakeBackend) -> None:
    fake.script = [Emit((10,), "Hel"), Emit((11,), "lo"), Finish("stop", num_cached_tokens=3)]
    got = await events(client, {"model": MODEL, "input": "Hi", "stream": True, "metadata": {"k": "v"}})
    (call,) = fake.calls
    assert [e["type"] for e in got] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e["sequence_number"] for e in got] == list(range(10))
    where = {"item_id": f"msg_{call.request_id}", "output_index": 0, "content_index": 0}
    assert got[0]["response"]["status"] == "in_progress" and got[0]["response"]["output"] == []
    assert got[2]["item"] == {
        "type": "message",
        "id": f"msg_{call.request_id}",
        "status": "in_progress",
        "role": "assistant",
        "content": [],
    }
    assert {k: got[3][k] for k in where} == where
    assert [(e["delta"], {k: e[k] for k in where}) for e in got[4:6]] == [("Hel", where), ("lo", where)]
    assert got[6]["text"] == "Hello" and got[7]["part"]["text"] == "Hello"
    assert got[8]["item"]["status"] == "completed" and got[8]["item"]["content"][0]["text"] == "Hello"
    final = got[9]["response"]
    assert (final["id"], final["status"], final["output"], final["metadata"]) == (
        f"resp_{call.request_id}",
        "completed",
        [got[8]["item"]],
        {"k": "v"},
    )
    assert final["usage"] == {
        "input_tokens": 15,
        "input_tokens_details": {"cached_tokens": 3, "cache_write_tokens": 0},
        "output_tokens": 2,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 17,
    }


async def test_a_stream_cut_by_the_limit_ends_incomplete(client: httpx.AsyncClient, fake: FakeBackend) -> None:
    fake.script = [Emit((10,), "Hel"), Finish("length")]
    got = await events(client, {"model": MODEL, "input": "Hi", "stream": True, "max_output_tokens": 1})
    assert got[-1]["type"] == "response.incomplete"
    assert got[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}


async def test_an_error_mid_stream_fails_the_response(client: httpx.AsyncClient, fake: FakeBackend) -> None:
    fake.script = [Emit((10,), "Hel"), Fail("unavailable", "decode worker lost")]
    got = await events(client, {"model": MODEL, "input": "Hi", "stream": True})
    assert [e["type"] for e in got][-3:] == ["response.output_text.delta", "error", "response.failed"]
    assert {k: got[-2][k] for k in ("code", "message")} == {"code": "unavailable", "message": "decode worker lost"}
    failed = got[-1]["response"]
    assert (failed["status"], failed["error"]) == ("failed", {"code": "server_error", "message": "decode worker lost"})


@pytest.mark.parametrize("stream", [False, True])
async def test_an_error_before_the_first_token_is_an_http_error(
    client: httpx.AsyncClient, fake: FakeBackend, stream: bool
) -> None:
    fake.script = [Fail("overloaded", "no room")]
    resp = await client.post(RESPONSES, json={"model": MODEL, "input": "Hi", "stream": stream})
    assert resp.status_code == 503
    assert resp.json() == error("no room", type_="service_unavailable", code="overloaded")


@pytest.mark.parametrize(
    ("extra", "message", "param"),
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id: previous_response_id is not supported: responses are not stored; send the whole conversation as input", "previous_response_id"),
        ({"store": True}, "store: store is not supported: responses are not stored (send store: false)", "store"),
        ({"reasoning": {"effort": "low"}}, "unsupported parameter: reasoning", "reasoning"),
        ({"service_tier": "auto"}, "unsupported parameter: service_tier", "service_tier"),
        ({"tools": [{"type": "web_search"}]}, "tools: tools are not supported", "tools"),
        ({"input": []}, "input: input must not be empty", "input"),
        ({"input": [{"type": "function_call_output", "call_id": "c", "output": "1"}]}, "input: input item 0: type 'function_call_output' is not supported (only message items)", "input"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input.0.content: content part 0: type 'input_image' is not supported (only input_text and output_text)", "input.0.content"),
        ({"input": [{"role": "tool", "content": "x"}]}, "input.0.role: Input should be 'user', 'assistant', 'system' or 'developer'", "input.0.role"),
        ({"temperature": 3}, "temperature: Input should be less than or equal to 2", "temperature"),
        ({"max_output_tokens": 0}, "max_output_tokens: Input should be greater than or equal to 1", "max_output_tokens"),
        ({"text": {"verbosity": "low"}}, "text.verbosity: only verbosity medium is supported", "text.verbosity"),
    ],
)
async def test_what_is_not_implemented_is_refused_by_name(
    client: httpx.AsyncClient, fake: FakeBackend, extra: dict, message: str, param: str
) -> None:
    resp = await client.post(RESPONSES, json={"model": MODEL, "input": "Hi", **extra})
    assert resp.status_code == 400
    assert resp.json() == error(message, param=param)
    assert fake.calls == []


async def test_store_false_and_the_off_values_are_accepted(client: httpx.AsyncClient, fake: FakeBackend) -> None:
    off = {"store": False, "tools": [], "tool_choice": "auto", "truncation": "disabled", "include": [], "text": {"format": {"type": "text"}}}
    resp = await client.post(RESPONSES, json={"model": MODEL, "input": "Hi", **off})
    assert resp.status_code == 200, resp.text
    assert resp.json()["store"] is False


async def test_too_long_names_the_responses_fields(client: httpx.AsyncClient, fake: FakeBackend) -> None:
    resp = await client.post(RESPONSES, json={"model": MODEL, "input": "Hi", "max_output_tokens": 60})
    assert (resp.status_code, resp.json()["error"]["param"]) == (400, "max_output_tokens")
    resp = await client.post(RESPONSES, json={"model": MODEL, "input": "the river " * 40})
    assert (resp.status_code, resp.json()["error"]["param"]) == (400, "input")


async def test_an_unknown_model_is_404(client: httpx.AsyncClient) -> None:
    resp = await client.post(RESPONSES, json={"model": "gpt-5", "input": "Hi"})
    assert resp.status_code == 404
    assert resp.json()["error"]["code"] == "model_not_found"


async def test_requests_are_counted_under_their_endpoint(client: httpx.AsyncClient, app: FastAPI) -> None:
    await client.post(RESPONSES, json={"model": MODEL, "input": "Hi"})
    await client.post(RESPONSES, json={"model": MODEL, "input": "Hi", "store": True})
    metrics = (await client.get("/metrics")).text
    assert 'kvmesh_router_requests_total{endpoint="/v1/responses",status="200"} 1.0' in metrics
    assert 'kvmesh_router_requests_total{endpoint="/v1/responses",status="400"} 1.0' in metrics


def test_text_format_is_the_chat_paths_response_format() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    fmt = {"type": "json_schema", "name": "thing", "schema": schema, "strict": True}
    assert TextConfig(format=fmt).response_format() == {
        "type": "json_schema",
        "json_schema": {"name": "thing", "schema": schema, "strict": True},
    }
    assert TextConfig(format={"type": "json_object"}).response_format() == {"type": "json_object"}
    assert TextConfig().response_format() is None


async def test_the_official_client_creates_and_streams(app: FastAPI, fake: FakeBackend) -> None:
    fake.script = [Emit((10,), "Hel"), Emit((11,), "lo"), Finish("stop")]
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as http:
        client = openai.AsyncOpenAI(base_url="http://test/v1", api_key="unused", http_client=http, max_retries=0)
        got = await client.responses.create(model=MODEL, input="Hi", instructions="Be brief.", max_output_tokens=5)
        prompt = len(fake.calls[0].prompt_token_ids)
        assert (got.output_text, got.status, got.usage.input_tokens, got.usage.output_tokens) == ("Hello", "completed", prompt, 2)
        deltas = []
        async with client.responses.stream(model=MODEL, input="Hi", instructions="Be brief.", max_output_tokens=5) as stream:
            async for event in stream:
                if event.type == "response.output_text.delta":
                    deltas.append(event.delta)
            final = await stream.get_final_response()
        assert deltas == ["Hel", "lo"]
        assert (final.output_text, final.status, final.usage.output_tokens) == ("Hello", "completed", 2)
    assert fake.calls[0].prompt_token_ids == fake.calls[1].prompt_token_ids
    assert fake.calls[0].sampling == fake.calls[1].sampling


@pytest.mark.parametrize("spec_version", ["2.3", "2.4"])
async def test_a_client_gone_mid_stream_cancels_the_request(fake: FakeBackend, spec_version: str) -> None:
    """The translated stream still closes the chat path's: the backend request is cancelled,
    counted as 499 under /v1/responses, nothing left in flight."""
    from starlette.requests import ClientDisconnect

    from kvmesh.services.router.app import create_app
    from tests.router.fakes import Sleep
    from tests.router.test_streaming import Disconnecting

    fake.script = [Emit((10,), "Hel"), Emit((11,), "lo"), Sleep(30), Finish("stop")]
    fake.cancel_seconds = 0.01
    app = create_app(fake)
    client = Disconnecting({"model": MODEL, "input": "Hi", "stream": True}, after_chunks=5, spec_version=spec_version, fake=fake)
    if spec_version == "2.4":
        with pytest.raises(ClientDisconnect):
            await client.run(app, RESPONSES)
    else:
        await client.run(app, RESPONSES)
    assert fake.cancelled == [fake.calls[0].request_id] and fake.finished == []
    assert client.body_chunks()[0].startswith("event: response.created\n")
    metrics = app.state.metrics.render().decode()
    assert 'kvmesh_router_requests_total{endpoint="/v1/responses",status="499"} 1.0' in metrics
    assert "kvmesh_router_requests_in_flight 0.0" in metrics


async def test_text_format_json_reaches_the_engine_as_a_grammar(client: httpx.AsyncClient, fake: FakeBackend) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    fmt = {"type": "json_schema", "name": "thing", "schema": schema, "strict": True}
    resp = await client.post(RESPONSES, json={"model": MODEL, "input": "Hi", "text": {"format": fmt}})
    assert resp.status_code == 200, resp.text
    guided = fake.calls[0].sampling.guided
    assert guided is not None and guided.kind == "json_schema" and json.loads(guided.value) == schema
    assert resp.json()["text"]["format"] == fmt
    resp = await client.post(RESPONSES, json={"model": MODEL, "input": "Hi", "text": {"format": {"type": "json_object"}}})
    assert resp.status_code == 200, resp.text
    assert fake.calls[1].sampling.guided is not None and fake.calls[1].sampling.guided.kind == "json_object"


async def test_a_bad_text_format_is_refused_by_name(client: httpx.AsyncClient, fake: FakeBackend) -> None:
    bad = {"type": "json_schema", "name": "thing", "schema": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}
    resp = await client.post(RESPONSES, json={"model": MODEL, "input": "Hi", "text": {"format": bad}})
    assert resp.status_code == 400
    assert resp.json()["error"]["param"] == "text.format"
    assert fake.calls == []


@pytest.mark.parametrize(
    ("script", "last"),
    [
        ([Emit((10,), "Hel"), Emit((11,), "lo"), Finish("stop")], "response.completed"),
        ([Emit((10,), "Hel"), Finish("length")], "response.incomplete"),
        ([Emit((10,), "Hel"), Fail("request_failed", "boom")], "response.failed"),
        ([Emit((10,), "Hel"), Fail("bad_request", "no")], "response.failed"),
    ],
)
async def test_every_event_has_the_openai_clients_shape(client: httpx.AsyncClient, fake: FakeBackend, script: list, last: str) -> None:
    """Each streamed event validates as openai's ``ResponseStreamEvent`` (usage's
    ``cache_write_tokens``; a failure's code from OpenAI's fixed set), the final object as a ``Response``."""
    from openai.types.responses import Response, ResponseStreamEvent
    from pydantic import TypeAdapter

    adapter = TypeAdapter(ResponseStreamEvent)
    fake.script = script
    got = await events(client, {"model": MODEL, "input": "Hi", "stream": True, "tool_choice": "none"})
    for event in got:
        adapter.validate_python(event)
    assert got[-1]["type"] == last
    final = Response.model_validate(got[-1]["response"])
    assert final.tool_choice == "none"  # echoed as sent
    if last == "response.failed":
        assert final.error is not None
        assert final.error.code == ("invalid_prompt" if script[-1].code == "bad_request" else "server_error")
    else:
        assert final.usage is not None and final.usage.input_tokens_details.cache_write_tokens == 0
    fake.script = [Emit((10,), "Hel"), Finish("stop")]
    resp = await client.post(RESPONSES, json={"model": MODEL, "input": "Hi"})
    answer = Response.model_validate(resp.json())
    assert answer.tool_choice == "auto" and answer.output_text == "Hel"


@pytest.mark.parametrize(
    ("input_", "message", "param"),
    [
        ("", "input: input must not be empty", "input"),
        ([{"role": "user", "content": []}], "input.0.content: content must not be empty", "input.0.content"),
    ],
)
async def test_empty_input_is_refused(client: httpx.AsyncClient, fake: FakeBackend, input_: Any, message: str, param: str) -> None:
    resp = await client.post(RESPONSES, json={"model": MODEL, "input": input_, "instructions": "Be brief."})
    assert resp.status_code == 400
    assert resp.json() == error(message, param=param)
    assert fake.calls == []
