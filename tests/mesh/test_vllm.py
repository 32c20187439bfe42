"""vLLM behind the engine interface (``--engine vllm``): a mesh of a vLLM prefill worker and
a vLLM decode worker, the KV moved between their pools through Mooncake by vLLM's layer-major
layout and kvmesh's KV connector, gives the greedy text of one vLLM process
(``LLM.generate``), chat and completion, streamed and not; the bytes are counted on both
sides and no block is left held; the prefix cache shows in ``cached_tokens``, the KV events
reach kv-metadata under kvmesh's block hashes. Two vLLM decode workers that prefill
themselves survive the death of the one streaming. Of two vLLM prefill workers, one pulls
a prefix the other holds (lent from vLLM's block pool, taken through the connector); pins
that expire and forged handles free or refuse, and nothing is left held.

The test process runs in kvmesh's virtualenv; the workers and the reference run with
``.venv-vllm/bin/python`` (``make vllm``), and the module is skipped without it.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
from pathlib import Path

import nats
import pytest

from kvmesh.engine.tokenizer import Tokenizer
from kvmesh.hashing import hash_to_hex, hash_token_blocks
from kvmesh.machine import usable_cores
from kvmesh.protocol import (
    DecodeAck,
    DecodeRequest,
    Keys,
    KVLendReply,
    KVLendRequest,
    KVQuery,
    KVQueryReply,
    PeerPrefix,
    PrefillRequest,
    PrefillResponse,
    SamplingSpec,
    Subjects,
    TokenEvent,
    WorkerRecord,
)
from kvmesh.worker.engines import DEFAULT_BLOCK_SIZE, worker_python
from tests.mesh.client import post, send_work, stream, streamed_text, worker_stats
from tests.mesh.meshes import MODEL, NEW_TOKENS, PROMPTS, assert_pools_at_baseline, make_mesh, wait_for_a_pin
from tests.mesh.meshes import WEATHER_TOOL

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

BLOCK = DEFAULT_BLOCK_SIZE["vllm"]
SYSTEM = "You are a careful assistant. Answer in one short sentence, and name the city first. " * 3
CHAT = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is the capital of France?"}]
CHAT_TOKENS = 32


@pytest.fixture(scope="module")
def vllm_python() -> str:
    try:
        return worker_python("vllm")
    except ValueError as exc:
        pytest.skip(f"no vLLM virtualenv for the workers ({exc})")


@pytest.fixture(scope="module")
def prompt_ids(default_model_dir) -> dict:
    """The token ids the router makes of each prompt (completions with special tokens, chat
    through the template without)."""
    tokenizer = Tokenizer.from_dir(default_model_dir)
    chat = tokenizer.encode(tokenizer.apply_chat_template(CHAT, add_generation_prompt=True), add_special_tokens=False)
    return {"completions": [tokenizer.encode(p, add_special_tokens=True) for p in PROMPTS], "chat": chat}


@pytest.fixture(scope="module")
def reference(vllm_python, default_model_dir, prompt_ids) -> dict:
    """One vLLM process's greedy output for every prompt: the reference for the mesh."""
    requests = [{"prompt_token_ids": ids, "max_tokens": NEW_TOKENS, "ignore_eos": True} for ids in prompt_ids["completions"]]
    requests.append({"prompt_token_ids": prompt_ids["chat"], "max_tokens": CHAT_TOKENS, "ignore_eos": False})
    extra = options_reference_requests(default_model_dir)  # logprobs and structured output, after those
    extra += follow_up_reference_requests(default_model_dir, first=len(requests) + len(extra))
    requests.extend(r for _, r in extra)
    job = {"model": str(default_model_dir), "block_size": BLOCK, "requests": requests}
    done = subprocess.run(
        [vllm_python, str(Path(__file__).with_name("vllm_reference.py"))],
        input=json.dumps(job), capture_output=True, text=True, timeout=600, env={"VLLM_CPU_OMP_THREADS_BIND": "nobind", **_env()},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    outputs = json.loads(done.stdout.strip().splitlines()[-1])["outputs"]
    outputs, options = outputs[: len(outputs) - len(extra)], outputs[len(outputs) - len(extra) :]
    return {"completions": outputs[:-1], "chat": outputs[-1], **{name: out for (name, _), out in zip(extra, options)}}


FOLLOW_UP = [
    "A lighthouse keeper writes to the sea every evening. Here is tonight's letter, in full:",
    " Thank you. And what did the sea answer?",
    " Now the keeper's long reply, every word of it. " + "The lamp turns, the gulls sleep, the tide comes in. " * 24,
]
FOLLOW_UP_TOKENS = 2 * BLOCK


def follow_up_reference_requests(model_dir: Path, *, first: int) -> list[tuple[str, dict]]:
    """A conversation by token ids, one turn a group (after every other): each turn the
    previous prompt, its answer and a new message, the last one long (``vllm_reference``'s
    ``after``); ``first``: the index of the first of them among the reference's requests."""
    tokenizer = Tokenizer.from_dir(model_dir)
    base = {"max_tokens": FOLLOW_UP_TOKENS, "ignore_eos": True}
    turns = [("turn-0", {**base, "prompt_token_ids": tokenizer.encode(FOLLOW_UP[0], add_special_tokens=True), "group": 10})]
    for number, message in enumerate(FOLLOW_UP[1:], start=1):
        turns.append((f"turn-{number}", {**base, "after": first + number - 1, "then": tokenizer.encode(message), "group": 10 + number}))
    return turns


def _env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}


_meshes: list = []  # the module's meshes, each stopped before the next one starts: one at a time


def _one_mesh_at_a_time() -> None:
    while _meshes:
        _meshes.pop().stop()


@pytest.fixture(scope="module")
def mesh(tmp_path_factory, default_model_dir, vllm_python, reference):
    """A vLLM prefill worker and a vLLM decode worker, a core each (started after the
    reference has finished)."""
    local = make_mesh(tmp_path_factory.mktemp("vllm-mesh"), default_model_dir, prefill=1, decode=1, engine="vllm", kv_cache_mib=64)
    _meshes.append(local)
    try:
        yield local
    finally:
        local.stop()


def completion_body(prompt: str | list[int]) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}


def chat_body() -> dict:
    return {"model": MODEL, "messages": CHAT, "max_tokens": CHAT_TOKENS, "temperature": 0}


async def test_completions_equal_one_vllm_process(mesh, reference):
    texts = [r["text"] for r in reference["completions"]]
    for prompt, want in zip(PROMPTS, reference["completions"]):
        response = await post(mesh.base_url, "/v1/completions", completion_body(prompt))
        assert response.status_code == 200, response.text
        body = response.json()
        assert (body["choices"][0]["text"], body["usage"]["completion_tokens"]) == (want["text"], len(want["token_ids"]))
        assert body["choices"][0]["finish_reason"] == "length"
    streamed = await asyncio.gather(*(stream(mesh.base_url, "/v1/completions", completion_body(p)) for p in PROMPTS))
    assert [streamed_text(events) for events in streamed] == texts  # eight at once, batched by vLLM


async def test_token_id_prompts_equal_one_vllm_process(mesh, reference, prompt_ids):
    for ids, want in zip(prompt_ids["completions"][:2], reference["completions"][:2]):
        response = await post(mesh.base_url, "/v1/completions", completion_body(ids))
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["text"] == want["text"]


async def test_chat_streamed_and_not_with_cached_tokens(mesh, reference, prompt_ids):
    want = reference["chat"]
    first = await post(mesh.base_url, "/v1/chat/completions", chat_body())
    assert first.status_code == 200, first.text
    body = first.json()
    assert body["choices"][0]["message"]["content"] == want["text"] and "Paris" in want["text"]
    assert body["choices"][0]["finish_reason"] == want["finish_reason"] == "stop"
    events = await stream(mesh.base_url, "/v1/chat/completions", chat_body())
    assert streamed_text(events) == want["text"]
    again = (await post(mesh.base_url, "/v1/chat/completions", chat_body())).json()
    n = len(prompt_ids["chat"])
    assert again["usage"]["prompt_tokens"] == n > 2 * BLOCK
    # vLLM reuses every full block but the one holding the last prompt token, which it recomputes
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == (n - 1) // BLOCK * BLOCK


async def test_the_kv_crossed_through_mooncake_and_no_block_is_left_held(mesh):
    response = await post(mesh.base_url, "/v1/completions", completion_body(PROMPTS[3]))
    assert response.status_code == 200, response.text
    await assert_pools_at_baseline(mesh, ["prefill-1", "decode-2"])
    prefill = await worker_stats(mesh.nats.url, "default", "prefill-1")
    decode = await worker_stats(mesh.nats.url, "default", "decode-2")
    assert decode.bytes_pulled > 0 and decode.transfers > 0
    assert prefill.bytes_served == decode.bytes_pulled  # counted on both sides


async def test_kv_events_reach_kv_metadata_under_kvmesh_hashes(mesh, prompt_ids):
    await post(mesh.base_url, "/v1/chat/completions", chat_body())
    chain = [hash_to_hex(h) for h in hash_token_blocks(prompt_ids["chat"], BLOCK, (MODEL,))]
    nc = await nats.connect(mesh.nats.url, connect_timeout=5, **mesh.nats.connect_options())
    try:
        for _ in range(50):
            reply = await nc.request(Subjects("default").kv_query, KVQuery(block_hashes=chain).encode(), timeout=5)
            matches = KVQueryReply.decode(reply.data).matches
            if matches.get("prefill-1") == len(chain):
                break
            await asyncio.sleep(0.1)
        assert matches["prefill-1"] == len(chain)  # where it was prefilled (the decode side caches what it imported too)
    finally:
        await nc.close()


async def test_the_worker_publishes_vllms_layer_major_pool_and_leaks_nothing(mesh):
    from kvmesh.cluster.etcd_store import EtcdStore

    async with EtcdStore([mesh.etcd.endpoint], **mesh.etcd.store_options()) as store:
        record = await store.get(Keys("default").worker("decode", "decode-2"))
    assert record is not None
    spec = WorkerRecord.decode(record.value).kv_layout
    assert spec is not None
    layout = spec.to_layout()
    assert (layout.engine, layout.block_size, layout.num_layers, layout.num_kv_heads, layout.head_dim) == ("vllm", BLOCK, 30, 3, 64)
    assert layout.block_stride == layout.segment_bytes and layout.layer_stride == layout.num_blocks * layout.segment_bytes
    stats = await worker_stats(mesh.nats.url, "default", "prefill-1")
    assert (stats.num_in_use, stats.num_held, stats.pins) == (0, 0, 0) and stats.num_cached > 0


# -- logprobs and structured output on vLLM workers (the module's prefill -> decode mesh) ----------
LOGPROBS_CHAT = [{"role": "user", "content": "Name three colors."}]
LOGPROBS_TOKENS = 8
TOP = 3
JSON_ASK = [{"role": "user", "content": "Give me an example JSON value about a city."}]
JSON_TOKENS = 80
JSON_SCHEMAS = [
    {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}, "population": {"type": "integer", "maximum": 100000000}},
        "required": ["city", "population"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"answer": {"enum": ["yes", "no"]}, "reason": {"type": "string", "maxLength": 30}},
        "required": ["answer", "reason"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 2},
        },
        "required": ["name", "tags"],
        "additionalProperties": False,
    },
]
LOGPROB_TOLERANCE = 2e-3  # float32, the prefill and the decode worker's batches against one process's


def _chat_ids(tokenizer: Tokenizer, messages: list[dict]) -> list[int]:
    return tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True), add_special_tokens=False)


def options_reference_requests(model_dir) -> list[tuple[str, dict]]:
    """The reference's requests for the tests of logprobs and structured output (generated
    after the others, in a group of their own): greedy, the mesh's structured output as vLLM's."""
    from kvmesh.engine.structured import GuidedDecoding
    from kvmesh.worker.vllm_outputs import structured_outputs_kwargs

    tokenizer = Tokenizer.from_dir(model_dir)
    base = {"ignore_eos": False, "group": 1}
    out = [
        ("logprobs_chat", {**base, "prompt_token_ids": _chat_ids(tokenizer, LOGPROBS_CHAT), "max_tokens": LOGPROBS_TOKENS, "logprobs": TOP}),
        (
            "echo",
            {**base, "prompt_token_ids": tokenizer.encode(PROMPTS[1], add_special_tokens=True), "max_tokens": LOGPROBS_TOKENS,
             "logprobs": 2, "prompt_logprobs": 2},
        ),
    ]  # fmt: skip
    for i, schema in enumerate(JSON_SCHEMAS):
        structured = structured_outputs_kwargs(GuidedDecoding.json_schema(schema))
        ids = _chat_ids(tokenizer, JSON_ASK)
        out.append((f"json{i}", {**base, "prompt_token_ids": ids, "max_tokens": JSON_TOKENS, "structured_outputs": structured}))
    return out


def _top_k(position: list, k: int) -> tuple[int, float, list[tuple[int, float]]]:
    """The reference's sampled token, its logprob and the top k, from vLLM's dict for a
    position as the reference printed it (sampled token first; a top-k repeat holds its place)."""
    token, value, _ = position[0]
    others = [(t, v, rank) for t, v, rank in position if t != token]
    tops = sorted(position, key=lambda e: e[2])[:k] if len(position) == k else others[:k]
    return token, value, [(t, v) for t, v, _ in tops]


def _assert_close(got: float | None, want: float) -> None:
    assert got is not None and abs(got - max(want, -9999.0)) <= LOGPROB_TOLERANCE, (got, want)


@pytest.fixture
async def openai_client(mesh):
    import openai

    client = openai.AsyncOpenAI(base_url=f"{mesh.base_url}/v1", api_key="unused", max_retries=0, timeout=300)
    try:
        yield client
    finally:
        await client.close()


async def test_chat_logprobs_equal_one_vllm_process(mesh, reference, openai_client, default_model_dir):
    """Through the official client, streamed and not: the sampled tokens and their logprobs
    and top logprobs are the reference's (the first token's from the prefill worker, the rest
    from the decode worker)."""
    tokenizer = Tokenizer.from_dir(default_model_dir)
    want = reference["logprobs_chat"]
    kwargs = {"model": MODEL, "messages": LOGPROBS_CHAT, "max_tokens": LOGPROBS_TOKENS, "temperature": 0, "logprobs": True, "top_logprobs": TOP}
    answer = await openai_client.chat.completions.create(**kwargs)
    content = answer.choices[0].logprobs.content
    streamed = []
    async for chunk in await openai_client.chat.completions.create(**kwargs, stream=True):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            streamed.extend(chunk.choices[0].logprobs.content or [])
    assert answer.choices[0].message.content == want["text"]
    for entries in (content, streamed):
        assert len(entries) == len(want["token_ids"]) == len(want["logprobs"])
        for entry, token, position in zip(entries, want["token_ids"], want["logprobs"]):
            sampled, value, tops = _top_k(position, TOP)
            assert sampled == token and entry.token == tokenizer.decode([token], skip_special_tokens=False)
            _assert_close(entry.logprob, value)
            assert [t.token for t in entry.top_logprobs] == [tokenizer.decode([t], skip_special_tokens=False) for t, _ in tops]
            for top, (_, top_value) in zip(entry.top_logprobs, tops):
                _assert_close(top.logprob, top_value)


async def test_completions_echo_with_logprobs_equals_one_vllm_process_cached_or_not(mesh, reference, openai_client, default_model_dir):
    """Completions' ``logprobs: 2`` with ``echo``: the prompt's logprobs (computed by the vLLM
    prefill worker, whose prefix cache holds the prompt the second time: vLLM skips it for
    them) and the answer's are the reference's."""
    tokenizer = Tokenizer.from_dir(default_model_dir)
    want = reference["echo"]
    prompt_ids = tokenizer.encode(PROMPTS[1], add_special_tokens=True)
    for _ in range(2):
        answer = await openai_client.completions.create(
            model=MODEL, prompt=PROMPTS[1], max_tokens=LOGPROBS_TOKENS, temperature=0, logprobs=2, echo=True
        )
        choice = answer.choices[0]
        assert choice.text == PROMPTS[1] + want["text"]
        lp = choice.logprobs
        ids = prompt_ids + want["token_ids"]
        positions = want["prompt_logprobs"] + want["logprobs"]
        assert len(lp.tokens) == len(ids) == len(positions) and lp.token_logprobs[0] is None
        for i, (token, position) in enumerate(zip(ids, positions)):
            assert lp.tokens[i] == tokenizer.decode([token], skip_special_tokens=False)
            if i == 0:
                assert position is None
                continue
            sampled, value, tops = _top_k(position, 2)
            assert sampled == token
            _assert_close(lp.token_logprobs[i], value)
            expected = {tokenizer.decode([t], skip_special_tokens=False): v for t, v in tops}
            expected.setdefault(lp.tokens[i], value)
            assert set(lp.top_logprobs[i]) == set(expected)
            for text, top_value in expected.items():
                _assert_close(lp.top_logprobs[i][text], top_value)
    await assert_pools_at_baseline(mesh, ["prefill-1", "decode-2"])


async def test_json_schemas_parse_validate_and_equal_one_vllm_process(mesh, reference, openai_client):
    """``response_format`` json_schema, streamed and not: the grammar runs on the vLLM prefill
    worker's first token and on from there on the decode worker (which has vLLM output that
    token again, forced, under its grammar); the answer validates and is the reference's
    greedy text for the same structured-output request. Sampled (temperature 1), it validates too."""
    import jsonschema

    pulled = (await worker_stats(mesh.nats.url, "default", "decode-2")).bytes_pulled
    for i, schema in enumerate(JSON_SCHEMAS):
        want = reference[f"json{i}"]
        fmt = {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema, "strict": True}}
        kwargs = {"model": MODEL, "messages": JSON_ASK, "max_tokens": JSON_TOKENS, "temperature": 0, "response_format": fmt}
        answer = await openai_client.chat.completions.create(**kwargs)
        text = answer.choices[0].message.content or ""
        streamed, reason = "", None
        async for chunk in await openai_client.chat.completions.create(**kwargs, stream=True):
            if chunk.choices:
                streamed += chunk.choices[0].delta.content or ""
                reason = chunk.choices[0].finish_reason or reason
        assert text == streamed == want["text"], (schema, text, streamed, want["text"])
        assert answer.choices[0].finish_reason == reason == want["finish_reason"] == "stop"
        jsonschema.validate(json.loads(text), schema)
        sampled = await openai_client.chat.completions.create(**{**kwargs, "temperature": 1.0, "seed": i})  # the forced token too
        if sampled.choices[0].finish_reason == "stop":
            jsonschema.validate(json.loads(sampled.choices[0].message.content or ""), schema)
        else:  # cut by max_tokens: a prefix of the grammar's language, never another text
            assert sampled.choices[0].finish_reason == "length" and (sampled.choices[0].message.content or "").startswith("{")
    assert (await worker_stats(mesh.nats.url, "default", "decode-2")).bytes_pulled > pulled  # handed off, not prefilled there
    await assert_pools_at_baseline(mesh, ["prefill-1", "decode-2"])


async def test_a_named_tool_call_on_vllm_workers_parses(mesh, openai_client):
    import jsonschema

    answer = await openai_client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is the weather in Paris right now?"}], max_tokens=60,
        temperature=0, tools=[WEATHER_TOOL], tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )  # fmt: skip
    calls = answer.choices[0].message.tool_calls
    assert calls and calls[0].function.name == "get_weather"
    jsonschema.validate(json.loads(calls[0].function.arguments), WEATHER_TOOL["function"]["parameters"])
METRICS_PROMPT = "Inventory of the lighthouse keeper's shed, counted twice for the metrics: " + "rope, lamp oil, brass polish, spare wicks, " * 8


async def test_vllm_workers_metrics_come_from_vllms_stats(mesh):
    """What vLLM's own stats say (``kvmesh.worker.vllm_stats``): the preemption counter, one
    queue / prefill / decode time per request served on each side, the prefix cache queried
    and hit on a repeated prompt, and KV usage in [0, 1] while a request decodes and 0 once
    every block is back (vLLM's null block not counted as used)."""
    from tests.mesh.test_metrics import metrics_urls, scrape, value

    urls = await metrics_urls(mesh)
    roles = ("prefill", "decode")
    before = {role: await scrape(urls[role]) for role in roles}
    during: list = []

    async def sample(events: list[dict]) -> None:
        if len(events) == 3:
            during.append(await scrape(urls["decode"]))

    body = completion_body(METRICS_PROMPT)
    first = await post(mesh.base_url, "/v1/completions", body)
    assert first.status_code == 200, first.text
    again = await post(mesh.base_url, "/v1/completions", body)
    assert again.status_code == 200, again.text
    events = await stream(mesh.base_url, "/v1/completions", body, on_event=sample)
    assert streamed_text(events) == again.json()["choices"][0]["text"] == first.json()["choices"][0]["text"]
    served = 3
    n = first.json()["usage"]["prompt_tokens"]
    assert n > 2 * BLOCK
    await assert_pools_at_baseline(mesh, ["prefill-1", "decode-2"])
    after = {role: await scrape(urls[role]) for role in roles}

    def delta(role: str, name: str, suffix: str) -> float:
        return value(after[role], name, suffix) - value(before[role], name, suffix)

    for role in roles:
        assert "kvmesh:num_preemptions" in after[role] and delta(role, "kvmesh:num_preemptions", "_total") >= 0
        for phase in ("queue", "prefill", "decode"):
            assert delta(role, f"kvmesh:request_{phase}_time_seconds", "_count") == served, (role, phase)
        assert value(after[role], "kvmesh:kv_cache_usage_perc") == 0.0, role  # idle: every block free or cached
        assert value(after[role], "kvmesh:num_requests_running") == value(after[role], "kvmesh:num_requests_waiting") == 0
    assert delta("prefill", "kvmesh:request_prefill_time_seconds", "_sum") > 0
    assert delta("decode", "kvmesh:request_decode_time_seconds", "_sum") > 0
    # The prefill worker looked every prompt up; the second and third found all its whole blocks
    # but the one holding the last token (vLLM recomputes it). The decode worker prefilled nothing.
    assert delta("prefill", "kvmesh:prefix_cache_queries", "_total") == served * n
    assert delta("prefill", "kvmesh:prefix_cache_hits", "_total") == (served - 1) * ((n - 1) // BLOCK * BLOCK)
    assert delta("decode", "kvmesh:prefix_cache_queries", "_total") == 0
    usage = value(during[0], "kvmesh:kv_cache_usage_perc")
    assert 0 < usage <= 1 and value(during[0], "kvmesh:num_requests_running") == 1


async def test_vllm_workers_export_the_same_names_and_count_as_they_go(mesh):
    """The metrics come from the engine interface (its steps, its pool), so vLLM workers
    export them too: tokens per step, both sides of a pull (counted from before this test:
    the module's mesh has served others)."""
    from kvmesh.metrics.contract import WORKER
    from tests.mesh.test_metrics import completion, metrics_urls, scrape, value

    urls = await metrics_urls(mesh)
    before = {role: await scrape(urls[role]) for role in ("prefill", "decode")}
    during: list = []

    async def sample(events: list[dict]) -> None:
        if len(events) == 10:
            during.append(await scrape(urls["decode"]))

    new_tokens = 60
    prompt = "Here is a list of three fruits: apples, pears and plums. Here are three more fruits:"
    body = {**completion(prompt, new_tokens), "stream_options": {"include_usage": True}}
    events = await stream(mesh.base_url, "/v1/completions", body, on_event=sample)
    gen = "kvmesh:generation_tokens"
    assert 0 < value(during[0], gen, "_total") - value(before["decode"], gen, "_total") < new_tokens - 1

    def delta(role: str, name: str, suffix: str, **labels: str) -> float:
        return value(after[role], name, suffix, **labels) - value(before[role], name, suffix, **labels)

    for _ in range(50):
        after = {role: await scrape(urls[role]) for role in ("prefill", "decode")}
        if delta("prefill", "kvmesh:kv_transfer_seconds", "_count", direction="out") > 0:
            break
        await asyncio.sleep(0.1)
    for role in ("prefill", "decode"):
        missing = [m.name for m in WORKER if m.name not in after[role]]
        assert not missing, f"vLLM {role} does not export {missing}"
    assert delta("prefill", gen, "_total") == 1
    assert delta("decode", gen, "_total") == new_tokens - 1
    assert delta("prefill", "kvmesh:prompt_tokens", "_total") == events[-1]["usage"]["prompt_tokens"]
    pulled = delta("decode", "kvmesh:kv_transfer_bytes", "_total", direction="in")
    assert pulled > 0 and delta("prefill", "kvmesh:kv_transfer_bytes", "_total", direction="out") == pulled
    assert delta("decode", "kvmesh:e2e_request_latency_seconds", "_count") == 1


async def test_a_follow_up_turn_is_prefilled_on_the_vllm_decode_worker_holding_the_answer(mesh, reference, default_model_dir):
    """Conditional disaggregation on vLLM workers: the decode worker generated (and vLLM
    cached) turn 1's answer, so turn 2, whose new tokens are few, is prefilled there (route
    reason ``decode_prefix`` in the router's metrics, no KV served by the prefill worker),
    with one vLLM process's greedy text and the answer's full blocks in ``cached_tokens``;
    turn 3, with a long new message, goes to the prefill worker again. Nothing is left held."""
    from tests.mesh.test_metrics import scrape, value

    router = f"{mesh.base_url}/metrics"
    turns = [reference[f"turn-{n}"] for n in range(3)]
    prompts = [follow_up_reference_requests(default_model_dir, first=0)[0][1]["prompt_token_ids"]]
    prompts += [t["prompt_token_ids"] for t in turns[1:]]

    async def turn(number: int) -> tuple[dict, float]:
        before = await scrape(router)
        body = {"model": MODEL, "prompt": prompts[number], "max_tokens": FOLLOW_UP_TOKENS, "temperature": 0, "ignore_eos": True}
        response = await post(mesh.base_url, "/v1/completions", body)
        assert response.status_code == 200, response.text
        answer = response.json()
        assert answer["choices"][0]["text"] == turns[number]["text"]
        after = await scrape(router)
        local = value(after, "kvmesh:router_routing_decisions", "_total", reason="decode_prefix")
        return answer, local - value(before, "kvmesh:router_routing_decisions", "_total", reason="decode_prefix")

    async def decode_holds(ids: list[int], blocks: int) -> None:
        chain = [hash_to_hex(h) for h in hash_token_blocks(ids, BLOCK, (MODEL,))]
        for _ in range(50):
            if (await cached_blocks(mesh, chain)).get("decode-2", 0) >= blocks:
                return
            await asyncio.sleep(0.1)
        raise AssertionError(f"kv-metadata never saw {blocks} blocks on decode-2")

    _, local = await turn(0)
    assert local == 0
    served = (await worker_stats(mesh.nats.url, "default", "prefill-1")).bytes_served
    held = (len(prompts[0]) + FOLLOW_UP_TOKENS - 1) // BLOCK  # vLLM never computes the last answer token's KV
    assert held > len(prompts[0]) // BLOCK  # the answer fills blocks of its own
    await decode_holds(prompts[1], held)
    second, local = await turn(1)
    assert local == 1
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == held * BLOCK  # the previous answer's full blocks too
    assert (await worker_stats(mesh.nats.url, "default", "prefill-1")).bytes_served == served  # no KV moved for it
    await decode_holds(prompts[2], (len(prompts[1]) + FOLLOW_UP_TOKENS - 1) // BLOCK)
    assert len(prompts[2]) - len(prompts[1]) - FOLLOW_UP_TOKENS > 256
    _, local = await turn(2)  # a long new message: the prefill worker's again
    assert local == 0
    assert (await worker_stats(mesh.nats.url, "default", "prefill-1")).bytes_served > served
    await assert_pools_at_baseline(mesh, ["prefill-1", "decode-2"])


async def test_a_vllm_decode_worker_killed_mid_stream_resumes_on_the_other(tmp_path, default_model_dir, vllm_python, reference):
    """Two vLLM decode workers (one core each): the stream goes on from the tokens already
    sent on the survivor, and the client gets the same text as without the fault."""
    _one_mesh_at_a_time()  # the module's mesh is done with (the tests from here on)
    pair = make_mesh(tmp_path, default_model_dir, prefill=0, decode=2, engine="vllm", kv_cache_mib=64)
    try:
        body = {"model": MODEL, "prompt": "Tell me a long story:", "max_tokens": 60, "temperature": 0, "ignore_eos": True}
        want = (await post(pair.base_url, "/v1/completions", body)).json()["choices"][0]["text"]
        victim = None

        async def kill_the_streaming_worker(events: list[dict]) -> None:
            nonlocal victim
            if len(events) == 5:
                for worker_id in ("decode-1", "decode-2"):
                    if (await worker_stats(pair.nats.url, "default", worker_id)).num_in_use > 0:
                        victim = worker_id
                assert victim is not None
                pair.workers[victim].kill()

        events = await stream(pair.base_url, "/v1/completions", body, on_event=kill_the_streaming_worker)
        assert victim is not None and "error" not in events[-1], events[-1]
        assert events[-1]["choices"][0]["finish_reason"] == "length"
        assert streamed_text(events) == want
        assert "retrying" in pair.router.tail(200)
        await assert_pools_at_baseline(pair, ["decode-2" if victim == "decode-1" else "decode-1"])
    finally:
        pair.stop()


S = Subjects("default")


@pytest.fixture(scope="module")
def trio(tmp_path_factory, default_model_dir, vllm_python, reference):
    """Two vLLM prefill workers and a vLLM decode worker that waits 1.5 s before each pull
    (so that a test can act between a prefill and its pull), kv-aware routing."""
    _one_mesh_at_a_time()  # the first mesh is done with (these tests run last)
    local = make_mesh(
        tmp_path_factory.mktemp("vllm-trio"), default_model_dir, prefill=2, decode=1, engine="vllm", kv_cache_mib=64,
        env={"KVMESH_FAULT_PULL_DELAY": "1.5", "KVMESH_PIN_WRITE_DELAY": "0"},  # pins in etcd at once: the tests act on them
    )  # fmt: skip
    try:
        yield local
    finally:
        local.stop()


async def cached_blocks(mesh, chain: list[str]) -> dict[str, int]:
    """kv-metadata's answer: how many leading blocks of ``chain`` each worker holds."""
    nc = await nats.connect(mesh.nats.url, connect_timeout=5, **mesh.nats.connect_options())
    try:
        reply = await nc.request(S.kv_query, KVQuery(block_hashes=chain).encode(), timeout=5)
        return KVQueryReply.decode(reply.data).matches
    finally:
        await nc.close()


async def wait_cached(mesh, chain: list[str], worker_id: str) -> dict[str, int]:
    """kv-metadata's answer once ``worker_id`` holds the whole chain (or after 5 s)."""
    for _ in range(50):
        matches = await cached_blocks(mesh, chain)
        if matches.get(worker_id) == len(chain):
            break
        await asyncio.sleep(0.1)
    return matches


async def prefill_directly(nc, worker_id: str, request_id: str, prompt: list[int], *, peer: PeerPrefix | None = None, max_tokens: int = 8) -> PrefillResponse:
    """A prefill sent to one worker as a router sends it."""
    request = PrefillRequest(request_id=request_id, prompt_token_ids=prompt, sampling=SamplingSpec(max_tokens=max_tokens), peer=peer)
    [answer] = await send_work(nc, S.prefill(worker_id), request.encode(), S.stream("test", request_id, "prefill"), timeout=120)
    assert isinstance(answer, PrefillResponse) and answer.error is None and answer.kv is not None, answer
    return answer


async def decode_directly(nc, request_id: str, prompt: list[int], answer: PrefillResponse, kv=None, max_tokens: int = 8) -> list:
    """A decode from ``answer``'s handle (or ``kv``) sent to decode-3 as a router sends it:
    its ack and token events."""
    request = DecodeRequest(
        request_id=request_id, prompt_token_ids=prompt, sampling=SamplingSpec(max_tokens=max_tokens),
        first_token_id=answer.first_token_id, kv=kv or answer.kv, prefill_cached_tokens=answer.num_cached_tokens,
    )  # fmt: skip
    return await send_work(nc, S.decode("decode-3"), request.encode(), S.stream("test", request_id, "decode"), timeout=120)


async def test_kv_aware_routing_and_a_prefix_pulled_from_a_peer_vllm_worker(trio, reference, prompt_ids):
    """A repeated chat goes each time to the prefill worker whose vLLM cache holds its
    prefix (from its KV events in kv-metadata: the other has none of it). Then the other is
    asked to prefill it with the holder as its peer: it pulls the prefix from the holder's
    vLLM pool (lent: referenced there until released), vLLM takes it through the connector
    and computes the rest; the decode worker's greedy tokens from that prefill equal one vLLM
    process's, the bytes were pulled and served, vLLM cached the pulled blocks as its own, and
    every pool is back to its baseline."""
    n = len(prompt_ids["chat"])
    first = (await post(trio.base_url, "/v1/chat/completions", chat_body())).json()
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    for _ in range(3):  # kv-aware routing: each time the worker that holds the prefix
        again = (await post(trio.base_url, "/v1/chat/completions", chat_body())).json()
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == (n - 1) // BLOCK * BLOCK
        assert again["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]
    chain = [hash_to_hex(h) for h in hash_token_blocks(prompt_ids["chat"], BLOCK, (MODEL,))]
    matches = await cached_blocks(trio, chain)
    [holder] = [w for w in ("prefill-1", "prefill-2") if matches.get(w) == len(chain)]
    borrower = "prefill-2" if holder == "prefill-1" else "prefill-1"
    assert matches.get(borrower, 0) == 0
    before = {w: await worker_stats(trio.nats.url, "default", w, **trio.nats.connect_options()) for w in (holder, borrower)}
    want = reference["chat"]["token_ids"]
    nc = await nats.connect(trio.nats.url, connect_timeout=5, **trio.nats.connect_options())
    try:
        peer = PeerPrefix(worker_id=holder, num_blocks=len(chain))
        answer = await prefill_directly(nc, borrower, "peer-1", prompt_ids["chat"], peer=peer, max_tokens=CHAT_TOKENS)
        pulled_blocks = (n - 1) // BLOCK  # all but the block of the last prompt token, which vLLM computes
        assert answer.first_token_id == want[0]
        assert answer.num_cached_tokens == pulled_blocks * BLOCK  # vLLM's count: the blocks the connector loaded
        ack, *events = await decode_directly(nc, "peer-1", prompt_ids["chat"], answer, max_tokens=CHAT_TOKENS)
        assert isinstance(ack, DecodeAck) and ack.accepted
        assert all(isinstance(e, TokenEvent) and e.error is None for e in events), events[-1]
        assert [t for e in events for t in e.token_ids] == want  # the first event carries the prefill's token
    finally:
        await nc.close()
    after = {w: await worker_stats(trio.nats.url, "default", w, **trio.nats.connect_options()) for w in (holder, borrower)}
    layout_bytes = after[borrower].bytes_pulled - before[borrower].bytes_pulled
    assert layout_bytes == pulled_blocks * 30 * 3 * BLOCK * 2 * 64 * 4  # blocks x layers x heads x tokens x K,V x dim x fp32
    assert after[holder].bytes_served - before[holder].bytes_served == layout_bytes  # the lender counted the loan's release
    assert (await wait_cached(trio, chain, borrower)).get(borrower) == len(chain)  # vLLM cached what it pulled
    await assert_pools_at_baseline(trio, [holder, borrower, "decode-3"])


async def test_an_expired_pin_frees_vllms_blocks(trio):
    """A prefill whose pull never comes: its pin's etcd key goes (as when its lease runs
    out), and the vLLM prefill worker frees the blocks vLLM kept for it; so does a loan's pin
    (a borrower that died), and vLLM's references to the lent blocks go. A request whose pin
    goes while its pull waits: the pull, late, hears from the prefill worker that the pin was
    gone (its blocks may be another request's), fails kv_lost and the request is retried:
    the same text, soon, and nothing left held."""
    from kvmesh.cluster.etcd_store import EtcdStore
    from kvmesh.protocol import Keys

    prompt = list(range(300, 400))  # four blocks of 32 tokens
    nc = await nats.connect(trio.nats.url, connect_timeout=5, **trio.nats.connect_options())
    try:
        answer = await prefill_directly(nc, "prefill-1", "expiring-1", prompt)
    finally:
        await nc.close()
    assert answer.kv is not None
    stats = await worker_stats(trio.nats.url, "default", "prefill-1", **trio.nats.connect_options())
    assert (stats.pins, stats.num_held) == (1, len(answer.kv.block_ids)) and stats.num_in_use >= 4
    async with EtcdStore([trio.etcd.endpoint], **trio.etcd.store_options()) as store:
        for _ in range(50):  # written beside the answer
            if await store.get(answer.kv.pin_key) is not None:
                break
            await asyncio.sleep(0.1)
        assert await store.delete(answer.kv.pin_key)
    await assert_pools_at_baseline(trio, ["prefill-1"])
    assert "pin of expiring-1 released: lease expired" in trio.workers["prefill-1"].tail(200)

    # a loan of those blocks (now cached) to a borrower that never releases it: the lend's
    # pin goes too, and vLLM's references to the lent blocks with it
    chain = [hash_to_hex(h) for h in hash_token_blocks(prompt, BLOCK, (MODEL,))]
    nc = await nats.connect(trio.nats.url, connect_timeout=5, **trio.nats.connect_options())
    try:
        lend = KVLendRequest(handle="gone-1", block_hashes=chain)
        loan = KVLendReply.decode((await nc.request(S.kv_lend("prefill-1", "gone"), lend.encode(), timeout=10)).data)
    finally:
        await nc.close()
    assert loan.error is None and len(loan.block_ids) == len(chain) == 3, loan
    stats = await worker_stats(trio.nats.url, "default", "prefill-1", **trio.nats.connect_options())
    assert (stats.pins, stats.num_held, stats.num_in_use) == (1, 3, 3)
    async with EtcdStore([trio.etcd.endpoint], **trio.etcd.store_options()) as store:
        for _ in range(50):
            if await store.get(Keys("default").pin("prefill-1", loan.loan_id)) is not None:
                break
            await asyncio.sleep(0.1)
        assert await store.delete(Keys("default").pin("prefill-1", loan.loan_id))
    await assert_pools_at_baseline(trio, ["prefill-1"])

    body = {"model": MODEL, "prompt": PROMPTS[5], "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    want = (await post(trio.base_url, "/v1/completions", body)).json()["choices"][0]["text"]
    async with EtcdStore([trio.etcd.endpoint], **trio.etcd.store_options()) as store:
        started = asyncio.get_running_loop().time()
        request = asyncio.create_task(post(trio.base_url, "/v1/completions", body))
        holder = await wait_for_a_pin(store, ["prefill-1", "prefill-2"])  # prefill done, the pull waits 1.5 s
        assert holder is not None
        [pin], _ = await store.get_prefix(Keys("default").pins(holder))
        assert await store.delete(pin.key)  # expired
        response = await asyncio.wait_for(request, 60)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] == want
    assert asyncio.get_running_loop().time() - started < 15  # two pulls of 1.5 s and a retry
    assert "was gone before the pull ended" in trio.workers["decode-3"].tail(200)
    assert "retrying" in trio.router.tail(200)
    await assert_pools_at_baseline(trio, ["prefill-1", "prefill-2", "decode-3"])


async def test_forged_handles_are_refused_by_a_vllm_decode_worker(trio, reference):
    """Handles with another pin token, naming another worker, an earlier incarnation, blocks
    outside the producer's pool, more blocks than the prompt needs or another request's pin: each refused with an
    error event (retryable where the KV is gone), never a crash, nothing allocated; the
    worker goes on serving, with one vLLM process's text."""
    prompt = list(range(500, 600))
    nc = await nats.connect(trio.nats.url, connect_timeout=5, **trio.nats.connect_options())
    try:
        answer = await prefill_directly(nc, "prefill-1", "forged-1", prompt)
        kv = answer.kv
        assert kv is not None
        forged = [
            # another token: pulled (the blocks are real), but the release is refused, so
            # the pin is not known to have held them all along (it stays until released)
            (kv.model_copy(update={"pin_token": "forged"}), "kv_lost"),
            (kv.model_copy(update={"prefill_worker_id": "prefill-9"}), "kv_lost"),  # no such worker
            (kv.model_copy(update={"producer_started_at": kv.producer_started_at - 60}), "kv_lost"),  # another incarnation
            (kv.model_copy(update={"block_ids": (*kv.block_ids[:-1], 10_000)}), "bad_request"),  # outside its pool
            (kv.model_copy(update={"block_ids": (*kv.block_ids, kv.block_ids[0] + 1)}), "bad_request"),  # more than the prompt's
            (kv.model_copy(update={"pin_key": kv.pin_key + "x"}), "bad_request"),  # not this request's pin
        ]
        for number, (handle, code) in enumerate(forged):
            ack, event = await decode_directly(nc, "forged-1", prompt, answer, kv=handle)
            assert isinstance(ack, DecodeAck) and ack.accepted
            assert isinstance(event, TokenEvent) and event.finished and event.error is not None, event
            assert event.error.code == code, (number, event)
            await assert_pools_at_baseline(trio, ["decode-3"])
        assert "refused a release of forged-1: wrong pin token" in trio.workers["prefill-1"].tail(200)
        # each pull refused later released the pin (ok=False, with the handle's own token)
    finally:
        await nc.close()
    await assert_pools_at_baseline(trio, ["prefill-1", "decode-3"])
    response = await post(trio.base_url, "/v1/completions", completion_body(PROMPTS[0]))
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] == reference["completions"][0]["text"]


async def test_a_vllm_prefill_worker_killed_before_the_pull_is_retried(trio, prompt_ids):
    """The prefill worker holding a request's pin is killed before the pull (the decode
    worker waits 1.5 s): the pull fails, the request is retried and completes with the same
    text, and the survivors hold no block (the decode side's pulled-into blocks go back)."""
    from kvmesh.cluster.etcd_store import EtcdStore

    body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
    want = (await post(trio.base_url, "/v1/completions", body)).json()["choices"][0]["text"]
    async with EtcdStore([trio.etcd.endpoint], **trio.etcd.store_options()) as store:
        request = asyncio.create_task(post(trio.base_url, "/v1/completions", body))
        victim = await wait_for_a_pin(store, ["prefill-1", "prefill-2"])  # prefill done, pull pending
        assert victim is not None
        trio.workers[victim].kill()
        response = await asyncio.wait_for(request, 60)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] == want
    assert "retrying" in trio.router.tail(200)
    survivor = "prefill-2" if victim == "prefill-1" else "prefill-1"
    await assert_pools_at_baseline(trio, [survivor, "decode-3"])


# ------------------------------------------------------------- kvmesh up --engine vllm, as users run it
def test_kvmesh_up_engine_vllm_gives_the_official_client_kvmesh_ups_greedy_text(tmp_path, default_model_dir, vllm_python, reference, prompt_ids):
    """``kvmesh up --engine vllm`` from the README (a vLLM prefill and a vLLM decode worker,
    lending each other their cores by default): the official ``openai`` client gets one vLLM
    process's greedy text, completions and chat, streamed and not, and it is the text kvmesh's
    own engine (what plain ``kvmesh up`` runs, float32) makes of the same prompts."""
    import openai

    from kvmesh.engine.llm_engine import EngineConfig, LLMEngine
    from kvmesh.engine.request import SamplingParams
    from tests.mesh.test_up import scrape, start_up, worker_metrics

    _one_mesh_at_a_time()
    up = start_up(tmp_path, default_model_dir, "--engine", "vllm", kv_cache_mib=64)
    try:
        if usable_cores() >= 2:  # the workers lend each other their cores (between steps), unbound
            assert any(line.startswith("kvmesh up: cores lent between idle workers: ") for line in up.lines), up.lines
            for name in ("prefill-1", "decode-2"):
                argv = Path(f"/proc/{up.pid(name)}/cmdline").read_bytes().decode().split("\0")
                assert "--lend-cores" in argv and "--cpu-bind" not in argv, argv
        client = openai.OpenAI(base_url=f"{up.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
        got = []
        for prompt in PROMPTS[:2]:
            answer = client.completions.create(
                model=MODEL, prompt=prompt, max_tokens=NEW_TOKENS, temperature=0, extra_body={"ignore_eos": True}
            )
            got.append(answer.choices[0].text)
        chunks = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=CHAT_TOKENS, temperature=0, stream=True)
        chat = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
        assert up.popen.poll() is None
        if usable_cores() >= 2:  # one worker busy while the other idled: steps on both cores
            borrowed = [worker_metrics(asyncio.run(scrape(up, name)), "kvmesh:core_lending_total", "event")["borrowed"] for name in ("prefill-1", "decode-2")]
            assert sum(borrowed) >= 1, borrowed
    finally:
        up.cleanup()
    assert got == [r["text"] for r in reference["completions"][:2]]
    assert chat == reference["chat"]["text"]
    engine = LLMEngine(EngineConfig(model=str(default_model_dir), served_model_name=MODEL, dtype="float32", kv_cache_bytes=32 * 2**20))
    own = engine.generate(prompt_ids["completions"][:2], SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
    assert [out.text for out in own] == got
    [own_chat] = engine.generate([prompt_ids["chat"]], SamplingParams(max_tokens=CHAT_TOKENS))
    assert own_chat.text == chat


# ------------------------------------------------------------- tensor parallel, through kvmesh up
TP_PROMPTS = [
    "The lighthouse keeper opened the door and saw",
    "A river runs under the old stone bridge, and the children " * 4,  # more than a block: cached on a repeat
    "Bread is made from",
]


def test_kvmesh_up_with_tensor_parallel_2_moves_kv_between_split_pools_as_one_tensor_parallel_vllm_process(tmp_path, vllm_python):
    """``kvmesh up --engine vllm --tensor-parallel-size 2``: a prefill and a decode worker,
    each with its model and KV pool split across two vLLM worker processes, each rank's pool
    shared with its worker's process. The prompts' KV moves from the prefill worker's ranks
    to the decode worker's, rank to rank, through Mooncake (counted on both sides, whole
    blocks of both ranks); completions, streamed and not, equal one vLLM process's with
    tensor parallel 2 (the decode worker computes from the pulled KV: every head of it is
    used), a repeated prompt is served from a prefix cache, no block is left held, and the
    rank processes end with their workers. The model is a tiny random Llama whose 4 heads
    split in two (SmolLM2's 9 do not)."""
    import httpx

    from kvmesh.testing.tiny_model import build_tiny_model
    from tests.mesh.test_up import Up, scrape, wait_all_gone, worker_metrics

    if usable_cores() < 2:
        pytest.skip("tensor parallel 2 here puts a rank on each of two cores")
    model = build_tiny_model(tmp_path / "tiny", hidden_size=256, num_heads=4, num_kv_heads=2, intermediate_size=512)
    tokenizer = Tokenizer.from_dir(model)
    ids = [tokenizer.encode(p, add_special_tokens=True) for p in TP_PROMPTS]
    assert len(ids[1]) > BLOCK
    job = {"model": str(model), "block_size": BLOCK, "tensor_parallel_size": 2,
           "requests": [{"prompt_token_ids": i, "max_tokens": 8, "ignore_eos": True} for i in ids]}  # fmt: skip
    done = subprocess.run(
        [vllm_python, str(Path(__file__).with_name("vllm_reference.py"))],
        input=json.dumps(job), capture_output=True, text=True, timeout=600, env={**_env(), "VLLM_CPU_OMP_THREADS_BIND": "0|1"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    last = next(line for line in reversed(done.stdout.splitlines()) if line.startswith('{"outputs"'))  # vLLM logs its shutdown after
    reference = [out["text"] for out in json.loads(last)["outputs"]]

    _one_mesh_at_a_time()
    (tmp_path / "up").mkdir()
    up = Up(tmp_path / "up", tmp_path, "--engine", "vllm", "--tensor-parallel-size", "2", "--model", str(model), "--dtype", "float32", kv_cache_mib=64)
    workers = ["prefill-1", "decode-2"]
    try:
        assert sorted(up.info["processes"]) == ["decode-2", "etcd", "kv-metadata", "nats-server", "prefill-1", "router"], up.info
        ranks = []
        for name in workers:
            pid = up.pid(name)
            children = [int(child) for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
            names = [Path(f"/proc/{child}/comm").read_text().strip() for child in children]
            assert names.count("VLLM::Worker_TP") == 2, names  # VLLM::Worker_TP0 and 1, cut to 15 characters
            ranks += children
        with httpx.Client(base_url=up.base_url, timeout=120) as client:
            [served] = [m["id"] for m in client.get("/v1/models").json()["data"]]
            body = {"model": served, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
            got = [client.post("/v1/completions", json={**body, "prompt": p}).json() for p in TP_PROMPTS]
            with client.stream("POST", "/v1/completions", json={**body, "prompt": TP_PROMPTS[1], "stream": True}) as response:
                streamed = "".join(
                    json.loads(line[6:])["choices"][0]["text"]
                    for line in response.iter_lines() if line.startswith("data: {") and json.loads(line[6:])["choices"]
                )  # fmt: skip
            again = client.post("/v1/completions", json={**body, "prompt": TP_PROMPTS[1]}).json()
        assert [answer["choices"][0]["text"] for answer in got] == reference
        assert streamed == again["choices"][0]["text"] == reference[1]
        assert got[1]["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= BLOCK  # a prefix cache of a rank-split pool
        moved_in = worker_metrics(asyncio.run(scrape(up, "decode-2")), "kvmesh:kv_transfer_bytes_total", "direction")["in"]
        moved_out = worker_metrics(asyncio.run(scrape(up, "prefill-1")), "kvmesh:kv_transfer_bytes_total", "direction")["out"]
        rank_block = 2 * 2 * BLOCK * 1 * 64 * 4  # layers, K and V, tokens, one head a rank, head dim, float32
        assert moved_in == moved_out > 0 and moved_in % (2 * rank_block) == 0, (moved_in, moved_out)  # both ranks' share
        for name in workers:
            for _ in range(50):  # nothing in use: no request's, no export's, no import's (held ones count as used)
                blocks = worker_metrics(asyncio.run(scrape(up, name)), "kvmesh:kv_blocks", "state")
                if blocks.get("used") == 0.0:
                    break
                time.sleep(0.2)
            assert blocks.get("used") == 0.0 and blocks.get("cached", 0.0) > 0, (name, blocks)
            log = (tmp_path / "up" / "logs" / f"{name}.log").read_text()
            assert "in each of 2 worker processes (tensor parallel), mapped here" in log
        code, _ = up.stop()
        assert code == 0
        assert wait_all_gone(ranks, timeout=15) == []  # vLLM's rank processes went with their workers
    finally:
        up.cleanup()
