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
from kvmesh.protocol import LogprobSpec, SamplingSpec, TokenEvent
from kvmesh.services.router.app import create_app
from kvmesh.services.router.choices import check_prompt_logprobs
from kvmesh.services.router.openai_api import APIError
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


# --------------------------------------------------------------------------- n, logprobs, echo
@dataclass
class LogprobBackend(FakeBackend):
    """Answers every request with tokens 7 then 8 (text from the tokenizer), with scripted
    logprobs when asked (top: tokens 9 and 7), the prompt's on the first event when asked;
    records in ``log`` when each request's iteration began and yielded its first event."""

    log: list[tuple[str, str]] = field(default_factory=list)

    def generate(
        self, request_id: str, prompt_token_ids: list[int], sampling: SamplingSpec, *, session_id: str | None = None
    ) -> AsyncIterator[TokenEvent]:
        self.calls.append(Call(request_id, list(prompt_token_ids), sampling, session_id))
        return self._lp(request_id, list(prompt_token_ids), sampling)

    async def _lp(self, request_id: str, prompt: list[int], sampling: SamplingSpec) -> AsyncIterator[TokenEvent]:
        self.log.append(("begin", request_id))
        await asyncio.sleep(0.01)
        want = sampling.logprobs is not None

        def lp(token: int, value: float) -> LogprobSpec:
            return LogprobSpec(t=token, lp=value, top=[(9, -0.5), (7, -1.0)][: sampling.logprobs or 0])

        prompt_lps = None
        if sampling.prompt_logprobs is not None:
            prompt_lps = [None] + [LogprobSpec(t=t, lp=-2.0 - i) for i, t in enumerate(prompt[1:])]
        self.log.append(("first", request_id))
        text = self.tokenizer.decode
        yield TokenEvent(
            request_id=request_id, seq=0, token_ids=[7], text=text([7]),
            logprobs=[lp(7, -1.0)] if want else None, prompt_logprobs=prompt_lps,
        )  # fmt: skip
        yield TokenEvent(
            request_id=request_id, seq=1, token_ids=[8], text=text([8]), finished=True, finish_reason="length",
            num_prompt_tokens=len(prompt), num_cached_tokens=0, logprobs=[lp(8, -3.0)] if want else None,
        )  # fmt: skip


@pytest.fixture
def lp_fake(tokenizer) -> LogprobBackend:
    return LogprobBackend(tokenizer)


@pytest.fixture
async def lp_client(lp_fake: LogprobBackend) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(lp_fake)), base_url="http://test") as c:
        yield c


def _text(tokenizer, token: int) -> str:
    return tokenizer.decode([token], skip_special_tokens=False)


async def test_n_choices_derive_seeds_share_a_session_and_count_the_prompt_once(
    lp_client: httpx.AsyncClient, lp_fake: LogprobBackend
) -> None:
    payload = {"model": MODEL, "prompt": "The river", "n": 3, "seed": 2**64 - 2, "max_tokens": 2}
    body = (await lp_client.post(COMPLETIONS, json=payload)).json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    text = _text(lp_fake.tokenizer, 7) + _text(lp_fake.tokenizer, 8)
    assert [c["text"] for c in body["choices"]] == [text] * 3
    assert body["usage"] == usage(3, 6)  # the prompt once, every choice's tokens
    assert [c.sampling.seed for c in lp_fake.calls] == [2**64 - 2, 2**64 - 1, 0]  # seed + j, mod 2**64 past the top
    assert len({c.session_id for c in lp_fake.calls}) == 1 and lp_fake.calls[0].session_id is not None
    assert len({c.request_id for c in lp_fake.calls}) == 3
    # the other choices begin only once the first one's first token came (its prompt is cached)
    leader = lp_fake.calls[0].request_id
    assert lp_fake.log.index(("first", leader)) < min(lp_fake.log.index(("begin", c.request_id)) for c in lp_fake.calls[1:])


async def test_n_with_a_list_of_prompts_indexes_prompt_major(lp_client: httpx.AsyncClient, lp_fake: LogprobBackend) -> None:
    payload = {"model": MODEL, "prompt": [[5, 6], [5, 6, 7]], "n": 2, "max_tokens": 2}
    body = (await lp_client.post(COMPLETIONS, json=payload)).json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert [c.prompt_token_ids for c in lp_fake.calls] == [[5, 6], [5, 6], [5, 6, 7], [5, 6, 7]]
    assert body["usage"] == usage(5, 8)
    sessions = [c.session_id for c in lp_fake.calls]
    assert sessions[0] == sessions[1] != sessions[2] == sessions[3]


async def test_a_clients_session_is_kept_for_every_choice(lp_client: httpx.AsyncClient, lp_fake: LogprobBackend) -> None:
    payload = {"model": MODEL, "prompt": "The river", "n": 2, "max_tokens": 2}
    await lp_client.post(COMPLETIONS, json=payload, headers={"x-session-id": "s-1"})
    assert [c.session_id for c in lp_fake.calls] == ["s-1", "s-1"]


async def test_n_streamed_tags_each_choice(lp_client: httpx.AsyncClient, lp_fake: LogprobBackend) -> None:
    payload = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "n": 2, "stream": True,
               "stream_options": {"include_usage": True}, "max_tokens": 2}  # fmt: skip
    _, events = await sse(lp_client, CHAT, payload)
    *chunks, usage_chunk, done = events
    assert done == "[DONE]"
    prompt_len = len(lp_fake.calls[0].prompt_token_ids)
    assert usage_chunk["usage"] == usage(prompt_len, 4)
    roles = [c["choices"][0]["index"] for c in chunks if c["choices"][0]["delta"].get("role")]
    assert roles == [0, 1]
    texts: dict[int, str] = {}
    for chunk in chunks:
        (choice,) = chunk["choices"]
        texts[choice["index"]] = texts.get(choice["index"], "") + (choice["delta"].get("content") or "")
    expected = _text(lp_fake.tokenizer, 7) + _text(lp_fake.tokenizer, 8)
    assert texts == {0: expected, 1: expected}


def _entry(tokenizer, token: int, logprob: float, tops) -> dict:
    text = _text(tokenizer, token)
    return {
        "token": text,
        "logprob": logprob,
        "bytes": list(text.encode()),
        "top_logprobs": [{"token": _text(tokenizer, t), "logprob": v, "bytes": list(_text(tokenizer, t).encode())} for t, v in tops],
    }


async def test_chat_logprobs_in_openais_shape(lp_client: httpx.AsyncClient, lp_fake: LogprobBackend) -> None:
    payload = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "logprobs": True, "top_logprobs": 2}
    body = (await lp_client.post(CHAT, json=payload)).json()
    assert lp_fake.calls[0].sampling.logprobs == 2 and lp_fake.calls[0].sampling.prompt_logprobs is None
    tok = lp_fake.tokenizer
    assert body["choices"][0]["logprobs"] == {
        "content": [_entry(tok, 7, -1.0, [(9, -0.5), (7, -1.0)]), _entry(tok, 8, -3.0, [(9, -0.5), (7, -1.0)])],
        "refusal": None,
    }
    payload = {**payload, "top_logprobs": 0}
    body = (await lp_client.post(CHAT, json=payload)).json()
    assert body["choices"][0]["logprobs"]["content"] == [_entry(tok, 7, -1.0, []), _entry(tok, 8, -3.0, [])]
    body = (await lp_client.post(CHAT, json={**payload, "logprobs": False, "top_logprobs": None})).json()
    assert body["choices"][0]["logprobs"] is None and lp_fake.calls[-1].sampling.logprobs is None


async def test_chat_logprobs_streamed(lp_client: httpx.AsyncClient, lp_fake: LogprobBackend) -> None:
    payload = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "logprobs": True, "top_logprobs": 1,
               "stream": True}  # fmt: skip
    _, events = await sse(lp_client, CHAT, payload)
    content = [e for c in events[:-1] if (lp := c["choices"][0]["logprobs"]) for e in lp["content"]]
    tok = lp_fake.tokenizer
    assert content == [_entry(tok, 7, -1.0, [(9, -0.5)]), _entry(tok, 8, -3.0, [(9, -0.5)])]


async def test_completion_logprobs_and_echo(lp_client: httpx.AsyncClient, lp_fake: LogprobBackend) -> None:
    tok = lp_fake.tokenizer
    t7, t8, t9 = (_text(tok, t) for t in (7, 8, 9))
    body = (await lp_client.post(COMPLETIONS, json={"model": MODEL, "prompt": "The river", "logprobs": 1, "max_tokens": 2})).json()
    assert lp_fake.calls[0].sampling.prompt_logprobs is None
    assert body["choices"][0]["logprobs"] == {
        "tokens": [t7, t8],
        "token_logprobs": [-1.0, -3.0],
        "top_logprobs": [{t9: -0.5, t7: -1.0}, {t9: -0.5, t8: -3.0}],  # the top 1, and the sampled token's
        "text_offset": [0, len(t7)],
    }
    payload = {"model": MODEL, "prompt": "The river", "logprobs": 0, "echo": True, "max_tokens": 2, "n": 2}
    body = (await lp_client.post(COMPLETIONS, json=payload)).json()
    leader, sibling = lp_fake.calls[1:]
    assert leader.sampling.prompt_logprobs == 0 and sibling.sampling.prompt_logprobs is None  # computed once
    prompt_texts = [_text(tok, t) for t in RIVER_IDS]
    for choice in body["choices"]:
        assert choice["text"] == "The river" + t7 + t8
        lp = choice["logprobs"]
        assert lp["tokens"] == [*prompt_texts, t7, t8]
        assert lp["token_logprobs"] == [None, -2.0, -3.0, -1.0, -3.0]
        assert lp["top_logprobs"] == [None, {prompt_texts[1]: -2.0}, {prompt_texts[2]: -3.0}, {t7: -1.0}, {t8: -3.0}]
        offsets = [sum(len(t) for t in lp["tokens"][:i]) for i in range(5)]
        assert lp["text_offset"] == offsets
    # streamed: the prompt (and its logprobs) first, then the completion's
    _, events = await sse(lp_client, COMPLETIONS, {**payload, "n": 1, "stream": True})
    chunks = [c["choices"][0] for c in events[:-1]]
    assert chunks[0]["text"] == "The river" and chunks[0]["logprobs"]["token_logprobs"] == [None, -2.0, -3.0]
    streamed = [o for c in chunks if c["logprobs"] for o in c["logprobs"]["text_offset"]]
    assert streamed == offsets
    assert "".join(c["text"] for c in chunks) == "The river" + t7 + t8


async def test_echo_without_logprobs(lp_client: httpx.AsyncClient, lp_fake: LogprobBackend) -> None:
    body = (await lp_client.post(COMPLETIONS, json={"model": MODEL, "prompt": [5, 6], "echo": True, "max_tokens": 2})).json()
    assert body["choices"][0]["text"] == lp_fake.tokenizer.decode([5, 6], skip_special_tokens=False) + _text(
        lp_fake.tokenizer, 7
    ) + _text(lp_fake.tokenizer, 8)
    assert body["choices"][0]["logprobs"] is None
    assert lp_fake.calls[0].sampling.prompt_logprobs is None and lp_fake.calls[0].sampling.logprobs is None


def test_echoed_prompt_logprobs_must_fit_a_message() -> None:
    """They cross NATS in one message: a prompt too long for them is a 400 naming echo."""
    check_prompt_logprobs(None, [[1] * 100_000])
    check_prompt_logprobs(20, [[1] * 1000])
    with pytest.raises(APIError) as info:
        check_prompt_logprobs(20, [[1] * 10, [1] * 2000])
    assert (info.value.status, info.value.param) == (400, "echo")
    assert "up to 1228 tokens; this one has 2000" in info.value.message


async def test_n_charges_the_prompt_once_to_input_token_limits(tokenizer) -> None:
    from tests.router.test_rate_limits import RIVER, T0, Clock, bearer, limited_app

    fake = FakeBackend(tokenizer)
    app = limited_app(fake, Clock(T0), {"keys": {"alice": {"input_tokens_per_minute": 7}}})
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        alice = bearer("sk-alice")
        resp = await client.post(COMPLETIONS, json={**RIVER, "n": 4}, headers=alice)  # 3 of 7, not 12
        assert resp.status_code == 200 and len(resp.json()["choices"]) == 4
        assert (await client.post(COMPLETIONS, json=RIVER, headers=alice)).status_code == 200  # 6
        assert (await client.post(COMPLETIONS, json=RIVER, headers=alice)).status_code == 429  # 9 > 7


def test_progress_carries_logprobs_across_attempts(tokenizer) -> None:
    from kvmesh.services.router.progress import RequestProgress

    spec = SamplingSpec(max_tokens=3, logprobs=1, prompt_logprobs=1)
    progress = RequestProgress("r", tokenizer, spec, (2,), 4)
    assert progress.attempt_sampling().prompt_logprobs == 1  # nothing sent yet: the retry computes them
    progress.prompt_logprobs = [None, LogprobSpec(t=6, lp=-1.0)]
    first = progress.add([7], None, [LogprobSpec(t=7, lp=-0.5)])
    assert first is not None and first.prompt_logprobs == progress.prompt_logprobs and first.logprobs == [LogprobSpec(t=7, lp=-0.5)]
    retry = progress.attempt_sampling()
    assert (retry.prompt_logprobs, retry.logprobs, retry.prior_output_tokens) == (None, 1, 1)  # sent once
    # a token that ends the request keeps its logprob; those after it are dropped with it
    last = progress.add([2, 9], "stop", [LogprobSpec(t=2, lp=-0.1), LogprobSpec(t=9, lp=-0.2)])
    assert last is not None and last.token_ids == [2] and last.logprobs == [LogprobSpec(t=2, lp=-0.1)]
    assert last.prompt_logprobs is None


async def test_n_times_prompts_is_bounded(lp_client: httpx.AsyncClient, lp_fake: LogprobBackend) -> None:
    payload = {"model": MODEL, "prompt": [[5]] * 3, "n": 43, "max_tokens": 2}
    resp = await lp_client.post(COMPLETIONS, json=payload)
    assert (resp.status_code, resp.json()) == (400, error("n x prompts may be at most 128 choices per request, got 43 x 3", param="n"))
    assert lp_fake.calls == []
    assert (await lp_client.post(COMPLETIONS, json={**payload, "n": 42})).status_code == 200
    assert len(lp_fake.calls) == 126


async def test_logprobs_with_tools_streamed_and_not(lp_client: httpx.AsyncClient, lp_fake: LogprobBackend) -> None:
    """With tools the text may be held back to be parsed; its tokens' logprobs still come, once each."""
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
    lp_fake.max_model_len = 4096  # the tools' system prompt
    for tool_choice in ("auto", "none"):
        payload = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "logprobs": True, "top_logprobs": 1,
                   "tools": [tool], "tool_choice": tool_choice, "max_tokens": 2}  # fmt: skip
        body = (await lp_client.post(CHAT, json=payload)).json()
        assert "choices" in body, body
        tokens = [e["token"] for e in body["choices"][0]["logprobs"]["content"]]
        assert tokens == [_text(lp_fake.tokenizer, 7), _text(lp_fake.tokenizer, 8)]
        _, events = await sse(lp_client, CHAT, {**payload, "stream": True})
        streamed = [e["token"] for c in events[:-1] if (lp := c["choices"][0]["logprobs"]) for e in lp["content"]]
        assert streamed == tokens
