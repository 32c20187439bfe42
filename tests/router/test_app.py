"""The router's HTTP API against a scripted backend: shapes, values, errors, auth, health, metrics."""

from __future__ import annotations

import re

import httpx
import pytest

from kvmesh.engine.tokenizer import Tokenizer
from kvmesh.protocol import SamplingSpec
from kvmesh.services.router.app import create_app
from kvmesh.services.router.backend import GenerationBackend
from tests.router.fakes import Emit, Fail, FakeBackend, Finish

MODEL = "tiny-llama"
RIVER_IDS = [381, 487, 311]  # "The river" in the tiny tokenizer
CHAT_HI_IDS = [1, 394, 265, 201, 42, 75, 2, 201, 1, 382, 85, 435, 299, 86, 201]  # ChatML of user "Hi"


def usage(prompt: int, completion: int, cached: int = 0) -> dict:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def error(
    message: str, type_: str = "invalid_request_error", param: str | None = None, code: str | None = None
) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def test_fake_is_a_generation_backend(fake: FakeBackend) -> None:
    assert isinstance(fake, GenerationBackend)


def test_tokenizer_facts_used_below(tokenizer: Tokenizer) -> None:
    assert tokenizer.encode("The river", add_special_tokens=True) == RIVER_IDS
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True)
    assert tokenizer.encode(text) == CHAT_HI_IDS


# --------------------------------------------------------------------------- non-streamed
async def test_completion(client: httpx.AsyncClient, fake: FakeBackend) -> None:
    fake.script = [
        Emit((10,), "Hello"),
        Emit((11, 12), " world"),
        Finish("length", num_cached_tokens=2, token_ids=(13,), text="!"),
    ]
    resp = await client.post(
        "/v1/completions", json={"model": MODEL, "prompt": "The river", "max_tokens": 4, "temperature": 0}
    )
    assert resp.status_code == 200
    body = resp.json()
    (call,) = fake.calls
    assert re.fullmatch(r"[0-9a-f]{32}", call.request_id)
    assert call.prompt_token_ids == RIVER_IDS
    assert call.sampling == SamplingSpec(temperature=0.0, top_p=1.0, top_k=0, max_tokens=4)
    assert isinstance(body.pop("created"), int)
    assert body == {
        "id": f"cmpl-{call.request_id}",
        "object": "text_completion",
        "model": MODEL,
        "choices": [{"index": 0, "text": "Hello world!", "logprobs": None, "finish_reason": "length"}],
        "usage": usage(3, 4, cached=2),
    }
    assert fake.finished == [call.request_id]
    assert fake.cancelled == []


async def test_completion_with_token_ids_and_stop_string(
    client: httpx.AsyncClient, fake: FakeBackend
) -> None:
    resp = await client.post(
        "/v1/completions", json={"model": MODEL, "prompt": [5, 6, 7], "stop": "\n", "seed": 3}
    )
    assert resp.status_code == 200
    (call,) = fake.calls
    assert call.prompt_token_ids == [5, 6, 7]
    assert call.sampling == SamplingSpec(temperature=1.0, max_tokens=16, stop=("\n",), seed=3)
    assert resp.json()["usage"] == usage(3, 1)


async def test_chat_completion(client: httpx.AsyncClient, fake: FakeBackend) -> None:
    fake.script = [Emit((10,), "Hel"), Emit((11,), "lo"), Finish("stop", num_cached_tokens=8)]
    resp = await client.post(
        "/v1/chat/completions",
        json={
            "model": MODEL,
            "messages": [{"role": "user", "content": "Hi"}],
            "max_completion_tokens": 5,
            "top_p": 0.9,
        },
    )
    assert resp.status_code == 200
    body = resp.json()
    (call,) = fake.calls
    assert call.prompt_token_ids == CHAT_HI_IDS
    assert call.sampling == SamplingSpec(temperature=1.0, top_p=0.9, max_tokens=5)
    assert isinstance(body.pop("created"), int)
    assert body == {
        "id": f"chatcmpl-{call.request_id}",
        "object": "chat.completion",
        "model": MODEL,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "Hello"},
                "logprobs": None,
                "finish_reason": "stop",
            }
        ],
        "usage": usage(15, 2, cached=8),
    }


async def test_chat_text_parts_are_joined(
    client: httpx.AsyncClient, fake: FakeBackend, tokenizer: Tokenizer
) -> None:
    parts = [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]
    resp = await client.post(
        "/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": parts}], "max_tokens": 2},
    )
    assert resp.status_code == 200
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "Hi\nthere"}])
    assert fake.calls[0].prompt_token_ids == tokenizer.encode(rendered)


async def test_chat_without_max_tokens_gets_the_rest_of_the_context(
    client: httpx.AsyncClient, fake: FakeBackend
) -> None:
    resp = await client.post(
        "/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}
    )
    assert resp.status_code == 200
    assert fake.calls[0].sampling.max_tokens == 64 - 15


# --------------------------------------------------------------------------- request errors
async def post_error(client: httpx.AsyncClient, path: str, payload: object, status: int = 400) -> dict:
    resp = await client.post(path, json=payload)
    assert resp.status_code == status, resp.text
    return resp.json()


@pytest.mark.parametrize(
    ("extra", "message", "param"),
    [
        ({"n": 129}, "n: Input should be less than or equal to 128", "n"),
        ({"logprobs": 21}, "logprobs: Input should be less than or equal to 20", "logprobs"),
        ({"echo": "yes please"}, "echo: Input should be a valid boolean, unable to interpret input", "echo"),
        ({"best_of": 2}, "best_of: best_of > 1 is not supported", "best_of"),
        ({"best_of": 1, "n": 2}, "best_of: best_of (1) must be at least n (2)", "best_of"),  # was taken
        ({"presence_penalty": 2.5}, "presence_penalty: Input should be less than or equal to 2", "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty: Input should be greater than or equal to -2", "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty: Input should be greater than 0", "repetition_penalty"),
        ({"min_p": 1.5}, "min_p: Input should be less than or equal to 1", "min_p"),
        ({"min_tokens": -1}, "min_tokens: Input should be greater than or equal to 0", "min_tokens"),
        ({"min_tokens": 17}, "min_tokens (17) must not exceed max_tokens (16)", "min_tokens"),
        (
            {"logit_bias": {"one": 5}},
            "logit_bias: logit_bias keys must be token ids (non-negative integers), got 'one'",
            "logit_bias",
        ),
        ({"logit_bias": {"1": "5"}}, "logit_bias: logit_bias['1'] must be a finite number, got '5'", "logit_bias"),
        ({"logit_bias": {"512": 5}}, "logit_bias token id 512 is out of range for a vocabulary of 512", "logit_bias"),
        ({"stop_token_ids": [3, 512]}, "stop_token_ids token id 512 is out of range for a vocabulary of 512", "stop_token_ids"),
        ({"store": True}, "store: store is not supported (completions are not stored)", "store"),
        ({"guided_json": {"type": "strin"}}, "guided_json: guided_json is not a JSON schema kvmesh can enforce: Invalid type: strin", "guided_json"),
        ({"stream_options": {"include_usage": True}}, "stream_options: stream_options is only allowed when stream is true", "stream_options"),
        ({"temperature": 2.5}, "temperature: Input should be less than or equal to 2", "temperature"),
        ({"top_p": 0}, "top_p: Input should be greater than 0", "top_p"),
        ({"max_tokens": 0}, "max_tokens: Input should be greater than or equal to 1", "max_tokens"),
        ({"stop": ["1", "2", "3", "4", "5"]}, "stop: at most 4 stop sequences are allowed, got 5", "stop"),
        ({"prompt": ""}, "the prompt is empty", "prompt"),
        ({"prompt": []}, "the prompt is empty", "prompt"),
        ({"prompt": [1, 512]}, "prompt token id 512 is out of range for a vocabulary of 512", "prompt"),
        (
            {"max_tokens": 62},
            "This model's maximum context length is 64 tokens. However, you requested 65 tokens "
            "(3 in the prompt, 62 in the completion). Please reduce the length of the prompt or completion.",
            "max_tokens",
        ),
    ],
)
async def test_completion_400s(
    client: httpx.AsyncClient, fake: FakeBackend, extra: dict, message: str, param: str
) -> None:
    body = await post_error(client, "/v1/completions", {"model": MODEL, "prompt": "The river", **extra})
    code = "context_length_exceeded" if "context length" in message else None
    assert body == error(message, param=param, code=code)
    assert fake.calls == []


async def test_context_exactly_full_is_accepted(client: httpx.AsyncClient, fake: FakeBackend) -> None:
    resp = await client.post(
        "/v1/completions", json={"model": MODEL, "prompt": "The river", "max_tokens": 61}
    )
    assert resp.status_code == 200
    assert fake.calls[0].sampling.max_tokens == 61


async def test_chat_prompt_filling_the_context_is_400(client: httpx.AsyncClient, fake: FakeBackend) -> None:
    fake.max_model_len = 15
    body = await post_error(
        client, "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}
    )
    assert body == error(
        "This model's maximum context length is 15 tokens. However, your prompt has 15 tokens, which leaves no "
        "room for the completion. Please reduce the length of the prompt.",
        param="messages",
        code="context_length_exceeded",
    )


@pytest.mark.parametrize(
    ("payload", "message", "param"),
    [
        ({"messages": []}, "messages: List should have at least 1 item after validation, not 0", "messages"),
        (
            {"messages": [{"role": "function", "content": "x"}]},
            "messages.0.role: Input should be 'system', 'developer', 'user', 'assistant' or 'tool'",
            "messages.0.role",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "messages.0.content: only text content parts are supported, got 'image_url'",
            "messages.0.content",
        ),
        (
            {"messages": [{"role": "user", "content": "x"}], "n": 0},
            "n: Input should be greater than or equal to 1",
            "n",
        ),
        (
            {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21},
            "top_logprobs: Input should be less than or equal to 20",
            "top_logprobs",
        ),
        (
            {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
            "top_logprobs: top_logprobs requires logprobs to be true",
            "top_logprobs",
        ),
        ({}, "messages: Field required", "messages"),
    ],
)
async def test_chat_400s(client: httpx.AsyncClient, payload: dict, message: str, param: str) -> None:
    body = await post_error(client, "/v1/chat/completions", {"model": MODEL, **payload})
    assert body == error(message, param=param)


async def test_missing_model_and_several_errors_are_all_named(client: httpx.AsyncClient) -> None:
    body = await post_error(client, "/v1/completions", {"prompt": "x", "temperature": 9})
    assert body == error(
        "model: Field required; temperature: Input should be less than or equal to 2", param="model"
    )


async def test_chat_template_error_is_400(fake: FakeBackend, tokenizer: Tokenizer) -> None:
    fake.tokenizer = Tokenizer(
        tokenizer.backend, chat_template="{{ raise_exception('no system role here') }}"
    )
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=create_app(fake)), base_url="http://test"
    ) as client:
        body = await post_error(
            client, "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}
        )
    assert body == error("chat template error: no system role here", param="messages")


async def test_invalid_json_is_400(client: httpx.AsyncClient) -> None:
    resp = await client.post(
        "/v1/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert resp.status_code == 400
    assert resp.json() == error(
        "Invalid JSON in the request body: Expecting property name enclosed in double quotes"
    )


async def test_body_must_be_a_json_object(client: httpx.AsyncClient) -> None:
    resp = await client.post("/v1/completions", json=[1, 2])
    assert resp.status_code == 400
    assert resp.json() == error("Input should be a valid dictionary or object to extract fields from")
    resp = await client.post("/v1/completions", content=b"prompt=x", headers={"content-type": "text/plain"})
    assert resp.status_code == 400
    assert resp.json() == error("the request body must be a JSON object (Content-Type: application/json)")
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/responses"):
        resp = await client.post(path, content=b"", headers={"content-type": "application/json"})
        assert resp.status_code == 400  # it said "Field required", naming no field
        assert resp.json() == error("the request body is empty: send a JSON object (Content-Type: application/json)"), path


async def test_wrong_model_is_404(client: httpx.AsyncClient, fake: FakeBackend) -> None:
    for path, payload in [
        ("/v1/completions", {"model": "gpt-4", "prompt": "x"}),
        ("/v1/chat/completions", {"model": "gpt-4", "messages": [{"role": "user", "content": "x"}]}),
    ]:
        body = await post_error(client, path, payload, status=404)
        assert body == error(
            "The model `gpt-4` does not exist. This server serves `tiny-llama`.",
            param="model",
            code="model_not_found",
        )
    assert fake.calls == []


async def test_unknown_route_has_an_openai_error_body(client: httpx.AsyncClient) -> None:
    resp = await client.get("/v1/nothing")
    assert (resp.status_code, resp.json()) == (404, error("Invalid URL (GET /v1/nothing)", code="not_found"))
    resp = await client.post("/v1/embeddings", json={})
    assert (resp.status_code, resp.json()) == (404, error("Invalid URL (POST /v1/embeddings)", code="not_found"))
    resp = await client.get("/v1/completions")
    assert (resp.status_code, resp.json()) == (
        405,
        error("Method not allowed (GET /v1/completions)", code="method_not_allowed"),
    )


async def test_version_and_one_model(client: httpx.AsyncClient) -> None:
    from kvmesh import __version__

    resp = await client.get("/version")
    assert (resp.status_code, resp.json()) == (200, {"version": __version__})
    resp = await client.get(f"/v1/models/{MODEL}")
    assert resp.status_code == 200 and resp.json()["id"] == MODEL and resp.json()["object"] == "model"
    resp = await client.get("/v1/models/gpt-4")
    assert resp.status_code == 404 and resp.json()["error"]["code"] == "model_not_found"


# --------------------------------------------------------------------------- backend errors
@pytest.mark.parametrize(
    ("code", "status", "type_"),
    [
        ("unavailable", 503, "service_unavailable"),
        ("overloaded", 503, "service_unavailable"),
        ("bad_request", 400, "invalid_request_error"),
        ("internal", 500, "server_error"),
    ],
)
@pytest.mark.parametrize("stream", [False, True])
async def test_mesh_error_before_first_event_is_an_http_error(
    client: httpx.AsyncClient, fake: FakeBackend, code: str, status: int, type_: str, stream: bool
) -> None:
    fake.script = [Fail(code, "no luck")]
    resp = await client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "stream": stream})
    assert resp.status_code == status
    assert resp.headers["content-type"] == "application/json"
    assert resp.json() == error("no luck", type_=type_, code=code)


async def test_mesh_error_mid_request_non_streamed(client: httpx.AsyncClient, fake: FakeBackend) -> None:
    fake.script = [Emit((4,), "a"), Fail("unavailable", "decode worker lost")]
    resp = await client.post(
        "/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "x"}]}
    )
    assert resp.status_code == 503
    assert resp.json() == error("decode worker lost", type_="service_unavailable", code="unavailable")
    assert fake.cancelled == []


async def test_stream_ending_without_a_final_event_is_500(
    client: httpx.AsyncClient, fake: FakeBackend
) -> None:
    fake.script = [Emit((4,), "a")]
    resp = await client.post("/v1/completions", json={"model": MODEL, "prompt": "x"})
    assert resp.status_code == 500
    assert resp.json() == error(
        "the token stream ended before the request finished", type_="server_error", code="internal"
    )


# --------------------------------------------------------------------------- auth, models, health
async def test_api_key(fake: FakeBackend) -> None:
    app = create_app(fake, api_key="s3cret")
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        payload = {"model": MODEL, "prompt": "x"}
        resp = await client.post("/v1/completions", json=payload)
        assert (resp.status_code, resp.json()) == (
            401,
            error("Missing API key: use 'Authorization: Bearer <key>'.", code="invalid_api_key"),
        )
        resp = await client.get("/v1/models", headers={"Authorization": "Bearer wrong"})
        assert (resp.status_code, resp.json()) == (
            401,
            error("Incorrect API key provided.", code="invalid_api_key"),
        )
        resp = await client.post("/v1/completions", json=payload, headers={"Authorization": "Bearer s3cret"})
        assert resp.status_code == 200
        assert (await client.get("/metrics")).status_code == 200
    assert len(fake.calls) == 1


async def test_models(client: httpx.AsyncClient) -> None:
    resp = await client.get("/v1/models")
    assert resp.status_code == 200
    body = resp.json()
    created = body["data"][0]["created"]
    assert isinstance(created, int)
    card = {"id": MODEL, "object": "model", "created": created, "owned_by": "kvmesh", "max_model_len": 64}
    assert body == {"object": "list", "data": [card]}
    assert (await client.get(f"/v1/models/{MODEL}")).json() == card
    assert (await client.get("/v1/models/other")).status_code == 404


async def test_health_when_ready(client: httpx.AsyncClient) -> None:
    for path in ("/health", "/health/ready"):
        resp = await client.get(path)
        assert (resp.status_code, resp.json()) == (200, {"status": "ok", "workers": {"prefill": 1, "decode": 1}})


async def test_health_when_not_ready_is_503_with_the_backends_reason(
    client: httpx.AsyncClient, fake: FakeBackend
) -> None:
    fake.ready = False
    fake.workers = {"prefill": 1, "decode": 0}
    fake.detail = "no decode worker is ready (registered: decode=1, prefill=1)"
    for path in ("/health", "/health/ready"):
        resp = await client.get(path)
        assert (resp.status_code, resp.json()) == (
            503,
            error(fake.detail, type_="service_unavailable", code="unavailable"),
        )
    fake.detail = ""
    assert (await client.get("/health")).json()["error"]["message"] == "not ready"


async def test_health_when_the_backend_fails_or_hangs(
    client: httpx.AsyncClient, fake: FakeBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake.health_error = RuntimeError("etcd is gone")
    resp = await client.get("/health/ready")
    assert (resp.status_code, resp.json()) == (
        503,
        error("health check failed: etcd is gone", type_="service_unavailable", code="unavailable"),
    )
    fake.health_error = None
    fake.health_seconds = 5.0
    monkeypatch.setattr("kvmesh.services.router.app.HEALTH_TIMEOUT", 0.05)
    resp = await client.get("/health")
    assert (resp.status_code, resp.json()["error"]["message"]) == (
        503,
        "health check failed: no answer in 0.05 s",
    )


async def test_liveness_does_not_ask_the_backend(client: httpx.AsyncClient, fake: FakeBackend) -> None:
    fake.health_error = RuntimeError("must not be called")
    fake.ready = False
    resp = await client.get("/health/live")
    assert (resp.status_code, resp.json()) == (200, {"status": "alive"})


async def test_health_is_not_behind_the_api_key(fake: FakeBackend) -> None:
    app = create_app(fake, api_key="s3cret")
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        for path in ("/health", "/health/ready", "/health/live"):
            assert (await client.get(path)).status_code == 200, path


# --------------------------------------------------------------------------- metrics
def sample(text: str, name: str, labels: str = "") -> float:
    match = re.search(rf"^{re.escape(name + labels)} (\S+)$", text, re.MULTILINE)
    assert match, f"{name}{labels} not in metrics"
    return float(match.group(1))


async def test_metrics_after_requests(client: httpx.AsyncClient, fake: FakeBackend) -> None:
    fake.script = [Emit((10,), "a"), Emit((11, 12), "b"), Finish("stop", num_cached_tokens=2)]
    assert (
        await client.post("/v1/completions", json={"model": MODEL, "prompt": "The river"})
    ).status_code == 200
    assert (
        await client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "n": 0})
    ).status_code == 400
    resp = await client.get("/metrics")
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("text/plain")
    text = resp.text
    assert sample(text, "kvmesh_router_requests_total", '{endpoint="/v1/completions",status="200"}') == 1
    assert sample(text, "kvmesh_router_requests_total", '{endpoint="/v1/completions",status="400"}') == 1
    assert sample(text, "kvmesh_router_prompt_tokens_total") == 3
    assert sample(text, "kvmesh_router_generation_tokens_total") == 3
    assert sample(text, "kvmesh_router_cached_prompt_tokens_total") == 2
    assert sample(text, "kvmesh_router_time_to_first_token_seconds_count") == 1
    assert sample(text, "kvmesh_router_inter_token_latency_seconds_count") == 1
    assert sample(text, "kvmesh_router_e2e_request_latency_seconds_count") == 1
    assert sample(text, "kvmesh_router_requests_in_flight") == 0


async def test_two_apps_have_separate_metrics(fake: FakeBackend) -> None:
    first, second = create_app(fake), create_app(fake)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=first), base_url="http://test") as client:
        assert (await client.post("/v1/completions", json={"model": MODEL, "prompt": "x"})).status_code == 200
        text_first = (await client.get("/metrics")).text
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=second), base_url="http://test") as client:
        text_second = (await client.get("/metrics")).text
    assert (
        sample(text_first, "kvmesh_router_requests_total", '{endpoint="/v1/completions",status="200"}') == 1
    )
    assert "kvmesh_router_requests_total{" not in text_second
    assert sample(text_second, "kvmesh_router_prompt_tokens_total") == 0


async def test_one_log_line_per_request(
    client: httpx.AsyncClient, fake: FakeBackend, caplog: pytest.LogCaptureFixture
) -> None:
    fake.script = [Emit((10, 11), "ab"), Finish("length", num_cached_tokens=1)]
    with caplog.at_level("INFO", logger="kvmesh.services.router.metrics"):
        assert (
            await client.post("/v1/completions", json={"model": MODEL, "prompt": "The river"})
        ).status_code == 200
    lines = [r.getMessage() for r in caplog.records if r.name == "kvmesh.services.router.metrics"]
    assert len(lines) == 1
    assert re.fullmatch(
        rf"request {fake.calls[0].request_id} /v1/completions key=anonymous status=200 prompt_tokens=3 cached_tokens=1 "
        r"output_tokens=2 finish_reason=length seconds=\d+\.\d{3}",
        lines[0],
    )


async def test_session_header_reaches_the_backend(client: httpx.AsyncClient, fake: FakeBackend) -> None:
    response = await client.post(
        "/v1/completions", json={"model": MODEL, "prompt": "The river"}, headers={"x-session-id": "chat-42"}
    )
    assert response.status_code == 200
    assert fake.calls[-1].session_id == "chat-42"
    await client.post("/v1/completions", json={"model": MODEL, "prompt": "The river"})
    assert fake.calls[-1].session_id is None
