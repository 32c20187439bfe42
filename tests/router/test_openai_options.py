"""The router's newer OpenAI options against a scripted backend: lists of prompts (one choice
each, streamed or not), the developer role and text parts, sampling options passed through,
and every field it does not implement refused by name."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import httpx
import pytest
from fastapi import FastAPI

from kvmesh.errors import MeshError
from kvmesh.protocol import SamplingSpec, TokenEvent
from kvmesh.services.router.app import create_app
from tests.router.fakes import Call, FakeBackend
from tests.router.test_app import MODEL, RIVER_IDS, error, usage
from tests.router.test_streaming import sse

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"


@dataclass
class PerPromptBackend(FakeBackend):
    """Answers each request with text naming its prompt's length, the longest prompt's answer
    ending first (each waits for the longer ones); a prompt holding token 13 fails after its
    first event."""

    ended: set[str] = field(default_factory=set)

    async def _longer_ones_ended(self, n: int) -> None:
        while any(len(c.prompt_token_ids) > n and c.request_id not in self.ended for c in self.calls):
            await asyncio.sleep(0.001)

    def generate(
        self, request_id: str, prompt_token_ids: list[int], sampling: SamplingSpec, *, session_id: str | None = None
    ) -> AsyncIterator[TokenEvent]:
        self.calls.append(Call(request_id, list(prompt_token_ids), sampling, session_id))
        return self._answer(request_id, list(prompt_token_ids))

    async def _answer(self, request_id: str, prompt: list[int]) -> AsyncIterator[TokenEvent]:
        n = len(prompt)
        done = False
        try:
            yield TokenEvent(request_id=request_id, seq=0, token_ids=[n], text=f"<{n}")
            await self._longer_ones_ended(n)
            done = True
            self.ended.add(request_id)
            if 13 in prompt:
                raise MeshError("internal", "scripted failure")
            yield TokenEvent(
                request_id=request_id,
                seq=1,
                token_ids=[n, n],
                text=">",
                finished=True,
                finish_reason="length" if n % 2 else "stop",
                num_prompt_tokens=n,
                num_cached_tokens=1,
            )
        finally:
            if not done:
                self.cancelled.append(request_id)


@pytest.fixture
def fake(tokenizer) -> PerPromptBackend:
    return PerPromptBackend(tokenizer)


@pytest.fixture
def app(fake: FakeBackend) -> FastAPI:
    return create_app(fake)


PROMPTS = [[5, 6, 7], [5, 6], [5, 6, 7, 8, 9]]


async def test_a_list_of_prompts_is_one_choice_each(client: httpx.AsyncClient, fake: FakeBackend) -> None:
    resp = await client.post(COMPLETIONS, json={"model": MODEL, "prompt": PROMPTS, "max_tokens": 4})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["choices"] == [
        {"index": 0, "text": "<3>", "logprobs": None, "finish_reason": "length"},
        {"index": 1, "text": "<2>", "logprobs": None, "finish_reason": "stop"},
        {"index": 2, "text": "<5>", "logprobs": None, "finish_reason": "length"},
    ]
    assert body["usage"] == usage(10, 9, cached=3)
    assert [c.prompt_token_ids for c in fake.calls] == PROMPTS
    ids = [c.request_id for c in fake.calls]
    assert len(set(ids)) == 3 and all(i.startswith(body["id"].removeprefix("cmpl-")) for i in ids)


async def test_a_list_of_strings(client: httpx.AsyncClient, fake: FakeBackend) -> None:
    resp = await client.post(COMPLETIONS, json={"model": MODEL, "prompt": ["The river", "The"]})
    assert [c["text"] for c in resp.json()["choices"]] == ["<3>", "<1>"]
    assert [c.prompt_token_ids for c in fake.calls] == [RIVER_IDS, RIVER_IDS[:1]]


async def test_a_one_prompt_list_is_the_prompt(client: httpx.AsyncClient, fake: FakeBackend) -> None:
    """What LangChain's OpenAI class sends."""
    listed = (await client.post(COMPLETIONS, json={"model": MODEL, "prompt": ["The river"]})).json()
    plain = (await client.post(COMPLETIONS, json={"model": MODEL, "prompt": "The river"})).json()
    assert listed["choices"] == plain["choices"] and listed["usage"] == plain["usage"]
    assert fake.calls[0].request_id == listed["id"].removeprefix("cmpl-")  # one prompt: the request's own id


async def test_a_list_of_prompts_streamed(client: httpx.AsyncClient, fake: FakeBackend) -> None:
    payload = {"model": MODEL, "prompt": PROMPTS, "stream": True, "stream_options": {"include_usage": True}}
    _, events = await sse(client, COMPLETIONS, payload)
    assert events[-1] == "[DONE]"
    *chunks, usage_chunk = events[:-1]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"] == usage(10, 9, cached=3)
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    for chunk in chunks:
        (choice,) = chunk["choices"]
        assert choice["index"] not in reasons, "nothing after a choice's finish_reason"
        texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
        if choice["finish_reason"]:
            reasons[choice["index"]] = choice["finish_reason"]
    assert texts == {0: "<3>", 1: "<2>", 2: "<5>"}
    assert reasons == {0: "length", 1: "stop", 2: "length"}
    finished = [c["choices"][0]["index"] for c in chunks if c["choices"][0]["finish_reason"]]
    assert finished == [2, 0, 1]  # as they came: the longest prompt's answer ended first


async def test_one_failing_prompt_fails_the_request_and_cancels_the_rest(
    client: httpx.AsyncClient, fake: FakeBackend
) -> None:
    prompts = [[5, 6], [13, 5, 6, 7, 8, 9, 10, 11, 12, 14]]  # the second fails before the first ends
    resp = await client.post(COMPLETIONS, json={"model": MODEL, "prompt": prompts})
    assert resp.status_code == 500
    assert resp.json() == error("scripted failure", type_="server_error", code="internal")
    await asyncio.sleep(0.1)
    assert fake.cancelled == [fake.calls[0].request_id]
    _, events = await sse(client, COMPLETIONS, {"model": MODEL, "prompt": prompts, "stream": True})
    assert events[-2] == error("scripted failure", type_="server_error", code="internal")
    assert events[-1] == "[DONE]"


async def test_one_request_counted_however_many_prompts(client: httpx.AsyncClient) -> None:
    await client.post(COMPLETIONS, json={"model": MODEL, "prompt": PROMPTS})
    metrics = (await client.get("/metrics")).text
    assert 'kvmesh_router_requests_total{endpoint="/v1/completions",status="200"} 1.0' in metrics


async def test_sampling_options_reach_the_backend(client: httpx.AsyncClient, fake: FakeBackend) -> None:
    payload = {
        "model": MODEL,
        "prompt": "The river",
        "max_tokens": 8,
        "presence_penalty": 0.5,
        "frequency_penalty": 1.5,
        "repetition_penalty": 1.2,
        "logit_bias": {"7": 50, "9": -100},
        "min_p": 0.1,
        "min_tokens": 3,
        "user": "u-1",
        "metadata": {"k": "v"},
        "store": False,
    }
    assert (await client.post(COMPLETIONS, json=payload)).status_code == 200
    spec = fake.calls[0].sampling
    assert spec == SamplingSpec(
        temperature=1.0,
        max_tokens=8,
        presence_penalty=0.5,
        frequency_penalty=1.5,
        repetition_penalty=1.2,
        logit_bias={7: 50.0, 9: -100.0},
        min_p=0.1,
        min_tokens=3,
    )


async def test_developer_role_and_text_parts(client: httpx.AsyncClient, fake: FakeBackend) -> None:
    system = {"role": "system", "content": "Be brief."}
    developer = {"role": "developer", "content": [{"type": "text", "text": "Be"}, {"type": "text", "text": "brief."}]}
    user = {"role": "user", "content": "Hi"}
    for messages in ([system, user], [developer, user]):
        assert (await client.post(CHAT, json={"model": MODEL, "messages": messages})).status_code == 200
    def rendered(system_text: str) -> list[int]:
        messages = [{"role": "system", "content": system_text}, user]
        return fake.tokenizer.encode(
            fake.tokenizer.apply_chat_template(messages, add_generation_prompt=True), add_special_tokens=False
        )

    assert fake.calls[0].prompt_token_ids == rendered("Be brief.")
    assert fake.calls[1].prompt_token_ids == rendered("Be\nbrief.")  # text parts joined by newlines, as vLLM does


@pytest.mark.parametrize(
    "field",
    [
        "guided_grammar",
        "reasoning_effort",
        "functions",
        "function_call",
        "service_tier",
        "modalities",
        "prediction",
        "web_search_options",
        "chat_template_kwargs",
        "add_generation_prompt",
        "skip_special_tokens",
        "include_stop_str_in_output",
    ],
)
async def test_fields_not_implemented_are_refused_by_name(
    client: httpx.AsyncClient, fake: FakeBackend, field: str
) -> None:
    for path, payload in [
        (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}),
        (COMPLETIONS, {"model": MODEL, "prompt": "Hi"}),
    ]:
        resp = await client.post(path, json={**payload, field: False})
        assert (resp.status_code, resp.json()) == (400, error(f"unsupported parameter: {field}", param=field))
    assert fake.calls == []


async def test_nested_unknown_fields_are_named(client: httpx.AsyncClient) -> None:
    resp = await client.post(
        CHAT, json={"model": MODEL, "messages": [{"role": "user", "content": "Hi", "cache_control": {}}]}
    )
    assert resp.json() == error("unsupported parameter: messages.0.cache_control", param="messages.0.cache_control")
    resp = await client.post(
        CHAT, json={"model": MODEL, "messages": [{"role": "assistant", "content": "Hi", "tool_calls": [{"id": "1"}]}]}
    )
    assert resp.json() == error(
        'messages.0.tool_calls: tool_calls[0] must be {"id", "type": "function", "function": {"name", "arguments"}} with string values',
        param="messages.0.tool_calls",
    )
