"""Bounded inputs through the app (in-process): field limits, valid Unicode, the prompt's character
limit, the body limit, and tokenization off the event loop."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator

import httpx
import pytest

from kvmesh.engine.tokenizer import Tokenizer
from kvmesh.services.router.app import INLINE_TOKENIZE_BYTES, create_app
from kvmesh.services.router.limits import Limits
from tests.router.fakes import FakeBackend

MODEL = "tiny-llama"
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
CHAT_COMPLETIONS = "/v1/chat/completions"


def error(message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": "invalid_request_error", "param": param, "code": code}}


def chat(content: object = "Hi", **extra: object) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **extra}


async def post_raw(client: httpx.AsyncClient, path: str, body: bytes) -> httpx.Response:
    return await client.post(path, content=body, headers={"content-type": "application/json"})


class CountingTokenizer(Tokenizer):
    """The tiny tokenizer, counting its encodes and naming the threads they ran on; ``delay``
    makes each one block that long."""

    def __init__(self, base: Tokenizer, delay: float = 0.0) -> None:
        super().__init__(base.backend, chat_template=base.chat_template)
        self.encodes = 0
        self.threads: list[int] = []
        self.delay = delay

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        self.encodes += 1
        self.threads.append(threading.get_ident())
        if self.delay:
            time.sleep(self.delay)  # blocks whichever thread runs it
        return super().encode(text, add_special_tokens=add_special_tokens)


# --------------------------------------------------------------------------- field limits
@pytest.mark.parametrize(
    ("extra", "message", "param"),
    [
        ({"stop": ["a" * 1025]}, "stop: stop sequence 0 has 1025 characters; at most 1024 are allowed", "stop"),
        (
            {"stop": ["x", "y" * 2000]},
            "stop: stop sequence 1 has 2000 characters; at most 1024 are allowed",
            "stop",
        ),
        (
            {"stop_token_ids": list(range(65))},
            "stop_token_ids: List should have at most 64 items after validation, not 65",
            "stop_token_ids",
        ),
        (
            {"stop_token_ids": [2**31]},
            "stop_token_ids.0: Input should be less than or equal to 2147483647",
            "stop_token_ids.0",
        ),
        ({"seed": 2**64}, "seed: Input should be less than or equal to 18446744073709551615", "seed"),
        ({"seed": -(2**63) - 1}, "seed: Input should be greater than or equal to -9223372036854775808", "seed"),
    ],
)
async def test_sampling_field_limits(
    client: httpx.AsyncClient, fake: FakeBackend, extra: dict, message: str, param: str
) -> None:
    resp = await client.post(COMPLETIONS, json={"model": MODEL, "prompt": "x", **extra})
    assert (resp.status_code, resp.json()) == (400, error(message, param=param))
    assert fake.calls == []


async def test_field_limits_at_their_bounds_are_accepted(client: httpx.AsyncClient, fake: FakeBackend) -> None:
    payload = {
        "model": MODEL,
        "prompt": "x",
        "stop": ["a" * 1024] * 4,
        "stop_token_ids": list(range(64)),
        "seed": 2**64 - 1,
    }
    assert (await client.post(COMPLETIONS, json=payload)).status_code == 200
    assert fake.calls[0].sampling.stop == ("a" * 1024,) * 4


async def test_too_many_messages(client: httpx.AsyncClient, fake: FakeBackend) -> None:
    messages = [{"role": "user", "content": "x"}] * 2049
    resp = await client.post(CHAT, json={"model": MODEL, "messages": messages})
    assert (resp.status_code, resp.json()) == (
        400,
        error("messages: List should have at most 2048 items after validation, not 2049", param="messages"),
    )
    assert fake.calls == []


# --------------------------------------------------------------------------- valid Unicode
LONE = "a\\ud800b"  # a lone surrogate as a JSON escape: valid JSON, not valid Unicode
PROBLEM = "must be valid Unicode text, but has a lone surrogate U+D800 at character 1"


@pytest.mark.parametrize(
    ("path", "body", "message", "param"),
    [
        (COMPLETIONS, f'{{"model": "{MODEL}", "prompt": "{LONE}"}}', f"prompt: {PROBLEM}", "prompt"),
        (COMPLETIONS, f'{{"model": "{LONE}", "prompt": "x"}}', f"model: {PROBLEM}", "model"),
        (
            COMPLETIONS,
            f'{{"model": "{MODEL}", "prompt": "x", "stop": ["ok", "{LONE}"]}}',
            f"stop: stop sequence 1 {PROBLEM}",
            "stop",
        ),
        (COMPLETIONS, f'{{"model": "{MODEL}", "prompt": "x", "stop": "{LONE}"}}', f"stop: stop sequence 0 {PROBLEM}", "stop"),
        (
            CHAT,
            f'{{"model": "{MODEL}", "messages": [{{"role": "user", "content": "{LONE}"}}]}}',
            f"messages.0.content: {PROBLEM}",
            "messages.0.content",
        ),
        (
            CHAT,
            f'{{"model": "{MODEL}", "messages": [{{"role": "user", "content": '
            f'[{{"type": "text", "text": "ok"}}, {{"type": "text", "text": "{LONE}"}}]}}]}}',
            f"messages.0.content: text part 1 {PROBLEM}",
            "messages.0.content",
        ),
        (CHAT, f'{{"model": "{LONE}", "messages": [{{"role": "user", "content": "x"}}]}}', f"model: {PROBLEM}", "model"),
        # fields without a check of their own: found wherever they are
        (
            CHAT,
            f'{{"model": "{MODEL}", "messages": [{{"role": "user", "content": "x"}}], '
            f'"tools": [{{"type": "function", "function": {{"name": "f", "description": "{LONE}"}}}}]}}',
            f"tools.0.function.description: {PROBLEM}",
            "tools.0.function.description",
        ),
        (
            CHAT,
            f'{{"model": "{MODEL}", "messages": [{{"role": "user", "content": "x"}}], "tools": [{{"type": "function", '
            f'"function": {{"name": "f", "parameters": {{"type": "object", "properties": {{"{LONE}": {{}}}}}}}}}}]}}',
            f"tools.0.function.parameters.properties: has a key that {PROBLEM}",
            "tools.0.function.parameters.properties",
        ),
    ],
)
async def test_a_lone_surrogate_is_a_400_naming_the_field(
    client: httpx.AsyncClient, fake: FakeBackend, path: str, body: str, message: str, param: str
) -> None:
    resp = await post_raw(client, path, body.encode())
    assert (resp.status_code, resp.json()) == (400, error(message, param=param))
    assert fake.calls == []


async def test_a_lone_surrogate_is_found_past_thousands_of_numbers(client: httpx.AsyncClient, fake: FakeBackend) -> None:
    """The check passes numbers over where they lie (a prompt of token ids, an enum of them) and
    still names the field of the one string that is not valid Unicode."""
    numbers = ", ".join(str(i) for i in range(4000))
    parameters = f'{{"type": "object", "properties": {{"n": {{"enum": [{numbers}, null, true, "ok"]}}}}}}'
    body = (
        f'{{"model": "{MODEL}", "messages": [{{"role": "user", "content": "x"}}], "tools": [{{"type": "function", '
        f'"function": {{"name": "f", "parameters": {parameters}, "description": "{LONE}"}}}}]}}'
    )
    where = "tools.0.function.description"
    resp = await post_raw(client, CHAT, body.encode())
    assert (resp.status_code, resp.json()) == (400, error(f"{where}: {PROBLEM}", param=where))
    # a long prompt of valid token ids passes the checks whole, to be measured against the model
    ids = ", ".join(str(100 + i % 400) for i in range(4000))
    resp = await post_raw(client, COMPLETIONS, f'{{"model": "{MODEL}", "prompt": [{ids}], "max_tokens": 1}}'.encode())
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "context_length_exceeded", resp.text
    assert "(4000 in the prompt, 1 in the completion)" in resp.json()["error"]["message"]
    assert fake.calls == []


async def test_surrogate_bytes_and_invalid_utf8_are_400s(client: httpx.AsyncClient) -> None:
    # UTF-8-encoded surrogate bytes: json.loads lets them through as a lone surrogate
    resp = await post_raw(client, COMPLETIONS, b'{"model": "tiny-llama", "prompt": "a\xed\xa0\x80b"}')
    assert (resp.status_code, resp.json()) == (400, error(f"prompt: {PROBLEM}", param="prompt"))
    resp = await post_raw(client, COMPLETIONS, b'{"model": "tiny-llama", "prompt": "\xff\xfe"}')
    assert (resp.status_code, resp.json()) == (400, error("There was an error parsing the body"))


async def test_an_error_that_quotes_a_lone_surrogate_still_encodes(client: httpx.AsyncClient) -> None:
    """A wrong model is echoed in the 404; the body is ASCII JSON, so even this encodes."""
    resp = await client.post(COMPLETIONS, json={"model": "gpt-\u00e9", "prompt": "x"})
    assert resp.status_code == 404
    assert b"\\u00e9" in resp.content
    assert resp.json()["error"]["message"].startswith("The model `gpt-\u00e9` does not exist.")


# --------------------------------------------------------------------------- prompt characters
async def test_a_prompt_too_long_for_the_context_is_refused_before_tokenizing(
    fake: FakeBackend, tokenizer: Tokenizer
) -> None:
    counting = CountingTokenizer(tokenizer)
    fake.tokenizer = counting  # max_model_len 64: at most 16 x 64 = 1024 characters
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(fake)), base_url="http://t") as client:
        resp = await client.post(COMPLETIONS, json={"model": MODEL, "prompt": "a" * 1025})
        assert (resp.status_code, resp.json()) == (
            400,
            error(
                "This model's maximum context length is 64 tokens. However, your prompt has 1025 characters, "
                "more than that context can hold (at most 1024 characters are accepted). Please reduce the "
                "length of the prompt.",
                param="prompt",
                code="context_length_exceeded",
            ),
        )
        content = [{"type": "text", "text": "a" * 600}, {"type": "text", "text": "b" * 600}]
        resp = await client.post(CHAT, json=chat(content))
        assert resp.status_code == 400
        assert resp.json()["error"]["param"] == "messages"
        assert "1201 characters" in resp.json()["error"]["message"]
        assert counting.encodes == 0
        resp = await client.post(COMPLETIONS, json={"model": MODEL, "prompt": "a " * 512})  # 1024: tokenized
        assert resp.json()["error"]["code"] == "context_length_exceeded"
        assert "tokens" in resp.json()["error"]["message"]
        assert counting.encodes == 1
    assert fake.calls == []


async def test_tokenizing_a_large_body_runs_off_the_event_loop(fake: FakeBackend, tokenizer: Tokenizer) -> None:
    # The encode blocks its thread for 3 s: if it ran on the event loop, /health would wait for it.
    fake.tokenizer = CountingTokenizer(tokenizer, delay=3.0)
    body = {"model": MODEL, "prompt": "The river", "user": "u" * INLINE_TOKENIZE_BYTES}  # over the inline bound
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(fake)), base_url="http://t") as client:
        started = time.monotonic()
        request = asyncio.create_task(client.post(COMPLETIONS, json=body))
        while not fake.tokenizer.encodes:  # the request is being tokenized
            await asyncio.sleep(0.01)
        health = await client.get("/health")
        assert time.monotonic() - started < 2.0  # well inside the encode's 3 s, however loaded the machine
        assert health.status_code == 200
        assert not request.done()
        assert (await request).status_code == 200


@pytest.mark.parametrize("endpoint", [COMPLETIONS, CHAT_COMPLETIONS])
async def test_a_short_prompt_is_tokenized_on_the_event_loop(fake: FakeBackend, tokenizer: Tokenizer, endpoint: str) -> None:
    # a hop to the tokenizer threads and back costs more than the encode itself
    fake.tokenizer = counting = CountingTokenizer(tokenizer)
    body = {"model": MODEL, "prompt": "The river"} if endpoint == COMPLETIONS else {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(fake)), base_url="http://t") as client:
        assert (await client.post(endpoint, json=body)).status_code == 200
    assert counting.threads == [threading.get_ident()]  # this test's loop


# --------------------------------------------------------------------------- the body
@pytest.fixture
async def small(fake: FakeBackend) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(fake, limits=Limits(max_body_bytes=1000))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
        yield client


TOO_LARGE = {
    "error": {
        "message": "The request body is larger than this server accepts (1000 bytes).",
        "type": "invalid_request_error",
        "param": None,
        "code": "request_too_large",
    }
}


async def test_a_body_over_the_limit_is_413(small: httpx.AsyncClient, fake: FakeBackend) -> None:
    body = f'{{"model": "{MODEL}", "prompt": "{"a" * 1000}"}}'.encode()
    resp = await post_raw(small, COMPLETIONS, body)
    assert (resp.status_code, resp.json()) == (413, TOO_LARGE)
    at_limit = f'{{"model": "{MODEL}", "prompt": "x", "user": "{"a" * (1000 - 50)}"}}'.encode()
    assert len(at_limit) == 1000
    assert (await post_raw(small, COMPLETIONS, at_limit)).status_code == 200
    assert len(fake.calls) == 1


async def test_a_chunked_body_is_counted_as_it_arrives(small: httpx.AsyncClient, fake: FakeBackend) -> None:
    sent = 0

    async def chunks() -> AsyncIterator[bytes]:
        nonlocal sent
        yield f'{{"model": "{MODEL}", "prompt": "'.encode()
        for _ in range(1000):
            sent += 1
            yield b"a" * 100
        yield b'"}'

    resp = await small.post(COMPLETIONS, content=chunks(), headers={"content-type": "application/json"})
    assert (resp.status_code, resp.json()) == (413, TOO_LARGE)
    assert fake.calls == []


async def test_a_json_body_limit_reached_by_a_chat_request(small: httpx.AsyncClient) -> None:
    resp = await small.post(CHAT, json=chat("x" * 2000))
    assert resp.status_code == 413


# --------------------------------------------------------------------------- JSON Schema integers
async def test_integral_floats_are_token_ids_but_fractions_and_bools_are_not(
    client: httpx.AsyncClient, fake: FakeBackend
) -> None:
    """7.0 is an integer to JSON Schema (schemathesis sends such prompts)."""
    assert (await client.post(COMPLETIONS, json={"model": MODEL, "prompt": [5.0, 6, 7.0]})).status_code == 200
    assert fake.calls[0].prompt_token_ids == [5, 6, 7]
    for prompt in ([5.5], [True, 6]):
        resp = await client.post(COMPLETIONS, json={"model": MODEL, "prompt": prompt})
        assert (resp.status_code, resp.json()) == (
            400,
            error("prompt: prompt must be a string, a list of token ids, or a non-empty list of either", param="prompt"),
        )


async def test_a_refused_body_is_counted(small: httpx.AsyncClient) -> None:
    assert (await small.post(COMPLETIONS, json={"model": MODEL, "prompt": "a" * 2000})).status_code == 413
    text = (await small.get("/metrics")).text
    assert 'kvmesh_router_requests_total{endpoint="/v1/completions",status="413"} 1.0' in text
