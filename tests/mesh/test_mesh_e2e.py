"""The mesh through real processes: nats-server, etcd, router, a prefill and a decode worker
on SmolLM2, KV moved between them by the Mooncake transfer engine."""

from __future__ import annotations

import asyncio
import time

import pytest

from kvmesh.engine.llm_engine import EngineConfig, LLMEngine
from kvmesh.engine.request import SamplingParams
from kvmesh.infra.local_mesh import LocalMesh, MeshOptions
from tests.mesh.client import post, stream, streamed_text, worker_stats
from tests.mesh.meshes import MODEL, NEW_TOKENS, PROMPTS

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def mesh(tmp_path_factory, default_model_dir, sink):
    env = {
        "KVMESH_CACHE_DIR": str(default_model_dir.parent.parent),
        "OTEL_EXPORTER_OTLP_ENDPOINT": sink.endpoint,
        "OTEL_BSP_SCHEDULE_DELAY": "200",
    }
    local = LocalMesh(MeshOptions(kv_cache_mib=64, lease_ttl=2, env=env), tmp_path_factory.mktemp("mesh"))
    local.start()
    yield local
    local.stop()


@pytest.fixture(scope="module")
def single_process(default_model_dir):
    """What one process gives for each prompt, greedy: the reference for the mesh."""
    engine = LLMEngine(EngineConfig(model=str(default_model_dir), served_model_name=MODEL, kv_cache_bytes=64 * 2**20))
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
    outs = engine.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
    chat = engine.tokenizer.encode(
        engine.tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    )
    [chat_out] = engine.generate([chat], SamplingParams(max_tokens=32))
    # A conversation by token ids: each turn the previous prompt, its answer and a new message
    # (the last a long one); the greedy answer of each.
    turns, prompt = [], engine.tokenizer.encode(FOLLOW_UP[0])
    for message in FOLLOW_UP[1:]:
        [out] = engine.generate([prompt], SamplingParams(max_tokens=FOLLOW_UP_TOKENS, ignore_eos=True))
        turns.append({"prompt": prompt, "token_ids": out.new_token_ids, "text": out.text})
        prompt = prompt + out.new_token_ids + engine.tokenizer.encode(message)
    return {"texts": [o.text for o in outs], "chat": chat_out.text, "turns": turns}


FOLLOW_UP = [
    "A lighthouse keeper writes to the sea every evening. Here is tonight's letter:",
    " Thank you. And what did the sea answer?",
    " Now the keeper's long reply, every word of it. " + "The lamp turns, the gulls sleep, the tide comes in. " * 24,
    "",
]
FOLLOW_UP_TOKENS = 40


def completion_body(prompt: str) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}


async def test_models_and_health(mesh):
    import httpx

    async with httpx.AsyncClient(base_url=mesh.base_url, timeout=10) as client:
        models = (await client.get("/v1/models")).json()
        assert [m["id"] for m in models["data"]] == [MODEL]
        assert (await client.get("/health")).status_code == 200


async def test_completion_equals_single_process(mesh, single_process):
    for prompt, want in zip(PROMPTS[:3], single_process["texts"]):
        response = await post(mesh.base_url, "/v1/completions", completion_body(prompt))
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["choices"][0]["text"] == want
        assert body["usage"]["completion_tokens"] == NEW_TOKENS
        assert body["choices"][0]["finish_reason"] == "length"


async def test_chat_streamed_and_not(mesh, single_process):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 32, "temperature": 0}
    response = await post(mesh.base_url, "/v1/chat/completions", body)
    assert response.status_code == 200, response.text
    content = response.json()["choices"][0]["message"]["content"]
    assert content == single_process["chat"] and "Paris" in content
    events = await stream(mesh.base_url, "/v1/chat/completions", body)
    assert streamed_text(events) == content
    assert events[-1]["choices"][0]["finish_reason"] == "stop"


async def test_eight_concurrent_streams(mesh, single_process):
    results = await asyncio.gather(
        *(stream(mesh.base_url, "/v1/completions", completion_body(p)) for p in PROMPTS)
    )
    assert [streamed_text(events) for events in results] == single_process["texts"]


async def test_kv_crossed_through_mooncake_and_nothing_leaks(mesh):
    await post(mesh.base_url, "/v1/completions", completion_body(PROMPTS[0]))
    nats_url = mesh.nats.url
    prefill = await worker_stats(nats_url, "default", "prefill-1")
    decode = await worker_stats(nats_url, "default", "decode-2")
    assert decode.bytes_pulled > 0 and decode.transfers > 0
    assert prefill.bytes_served == decode.bytes_pulled  # counted on both sides
    for stats in (prefill, decode):
        assert stats.num_in_use == 0 and stats.num_held == 0 and stats.pins == 0


async def test_a_pin_pulled_at_once_never_reaches_etcd(mesh):
    """A prefill's pin is written to etcd only once held ``--pin-write-delay`` (1 s): a
    request served through the API, whose pull comes milliseconds after the prefill, costs
    etcd no pin key (the code before wrote one and revoked it for every request)."""
    from kvmesh.cluster.etcd_store import EtcdStore
    from kvmesh.protocol import Keys

    pins = Keys("default").pins("prefill-1")
    async with EtcdStore([mesh.etcd.endpoint], **mesh.etcd.store_options()) as store:
        _, before = await store.get_prefix(pins)
        answer = await post(mesh.base_url, "/v1/completions", completion_body(PROMPTS[1]))
        assert answer.status_code == 200, answer.text
        await asyncio.sleep(1.5)  # past the delay: a pin still held would be written by now
        assert (await worker_stats(mesh.nats.url, "default", "prefill-1")).pins == 0

        seen: list[str] = []  # every change under the prefix since ``before``

        async def watch() -> None:
            async for event in store.watch_prefix(pins, start_revision=before + 1):
                seen.append(f"{event.kind} {event.key}")

        watching = asyncio.create_task(watch())
        await asyncio.sleep(1.0)
        watching.cancel()
        await asyncio.gather(watching, return_exceptions=True)
    assert seen == []


async def test_one_trace_spans_all_three_services(mesh, sink):
    before = {s.trace_id for s in sink.snapshot()}
    response = await post(mesh.base_url, "/v1/completions", completion_body(PROMPTS[1]))
    assert response.status_code == 200
    wanted_services = {"kvmesh-router", "kvmesh-prefill-worker", "kvmesh-decode-worker"}
    wanted_names = {"mesh_request", "route", "prefill_call", "prefill", "queue_wait", "pin", "decode", "kv_transfer"}
    deadline = time.monotonic() + 15
    complete: list[str] = []
    while not complete and time.monotonic() < deadline:  # spans arrive as each service exports them
        by_trace: dict[str, list] = {}
        for span in sink.snapshot():
            if span.trace_id not in before:
                by_trace.setdefault(span.trace_id, []).append(span)
        complete = [
            trace_id
            for trace_id, spans in by_trace.items()
            if wanted_services <= {s.service for s in spans} and wanted_names <= {s.name for s in spans}
        ]
        await asyncio.sleep(0.2)
    assert len(complete) == 1, {t: sorted((s.service, s.name) for s in spans) for t, spans in by_trace.items()}
    spans = by_trace[complete[0]]
    roots = [s for s in spans if not s.parent_span_id]
    assert [(s.service, s.name) for s in roots] == [("kvmesh-router", "POST /v1/completions")]
    # one HTTP span (the router's own, not FastAPI's beside it): the mesh's work directly under it
    (request,) = [s for s in spans if s.name == "mesh_request"]
    assert request.parent_span_id == roots[0].span_id
    route = next(s for s in spans if s.name == "route")
    assert route.attributes["kvmesh.route.worker"] == "prefill-1"
    # which workers hold the prompt's prefix: the router's own copy of the index, no kv-metadata round trip
    assert [s.attributes["kvmesh.route.kv_index"] for s in spans if "kvmesh.route.kv_index" in s.attributes] == ["replica"]
    assert "kv_query" not in {s.name for s in spans}
    assert any(key.startswith("kvmesh.route.scores.prefix.") for key in route.attributes)
    transfer = [s for s in sink.snapshot() if s.trace_id == complete[0] and s.name == "kv_transfer"][0]
    assert transfer.attributes["kvmesh.bytes"] > 0


async def test_prefix_reuse_is_reported(mesh):
    prompt = "A long shared context about rivers, mountains and the sea. " * 8
    first = (await post(mesh.base_url, "/v1/completions", completion_body(prompt))).json()
    again = (await post(mesh.base_url, "/v1/completions", completion_body(prompt))).json()
    prompt_tokens = first["usage"]["prompt_tokens"]
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == (prompt_tokens - 1) // 16 * 16
    assert again["choices"][0]["text"] == first["choices"][0]["text"]


async def test_a_follow_up_turn_is_prefilled_on_the_decode_worker_holding_the_answer(mesh, sink, single_process):
    """Conditional disaggregation: the decode worker generated (and cached) turn 1's answer,
    so turn 2, whose new tokens are few, is prefilled there and nowhere else (the trace has
    no prefill span; route reason ``decode_prefix``), with the greedy text of one process and
    the answer's full blocks counted in ``cached_tokens``; turn 3, with a long new message,
    goes to the prefill worker again. Nothing is left held."""
    import nats

    from kvmesh.hashing import hash_to_hex, hash_token_blocks
    from kvmesh.protocol import KVQuery, KVQueryReply, Subjects

    nc = await nats.connect(mesh.nats.url, connect_timeout=5, **mesh.nats.connect_options())

    async def decode_holds(ids: list[int], blocks: int) -> None:
        """Wait until kv-metadata has the decode worker's events for ``blocks`` leading blocks."""
        chain = [hash_to_hex(h) for h in hash_token_blocks(ids, 16, (MODEL,))]
        for _ in range(50):
            reply = await nc.request(Subjects("default").kv_query, KVQuery(block_hashes=chain).encode(), timeout=5)
            if KVQueryReply.decode(reply.data).matches.get("decode-2", 0) >= blocks:
                return
            await asyncio.sleep(0.1)
        raise AssertionError(f"kv-metadata never saw {blocks} blocks on decode-2")

    async def turn(number: int) -> tuple[dict, list]:
        want = single_process["turns"][number]
        before = {s.span_id for s in sink.snapshot()}
        body = {"model": MODEL, "prompt": want["prompt"], "max_tokens": FOLLOW_UP_TOKENS, "temperature": 0, "ignore_eos": True}
        response = await post(mesh.base_url, "/v1/completions", body)
        assert response.status_code == 200, response.text
        answer = response.json()
        assert answer["choices"][0]["text"] == want["text"]
        rid = answer["id"].removeprefix("cmpl-")  # the router's request id (an earlier test's spans may come late)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:  # this request's spans, once the decode worker's is in
            spans = [s for s in sink.snapshot() if s.span_id not in before]
            request = [s for s in spans if s.name == "mesh_request" and s.attributes.get("kvmesh.request_id") == rid]
            if request and any(s.name == "decode" and s.trace_id == request[0].trace_id for s in spans):
                return answer, [s for s in spans if s.trace_id == request[0].trace_id]
            await asyncio.sleep(0.2)
        raise AssertionError("no trace of the turn")

    try:
        turns = single_process["turns"]
        first, _ = await turn(0)
        served_before = (await worker_stats(mesh.nats.url, "default", "prefill-1", **mesh.nats.connect_options())).bytes_served
        held = (len(turns[0]["prompt"]) + FOLLOW_UP_TOKENS - 1) // 16  # the last answer token is never fed back
        assert held > len(turns[0]["prompt"]) // 16  # the answer fills blocks of its own
        await decode_holds(turns[1]["prompt"], held)
        second, spans = await turn(1)
        [request] = [s for s in spans if s.name == "mesh_request"]
        assert request.attributes["kvmesh.route.reason"] == "decode_prefix", request.attributes
        assert request.attributes["kvmesh.prefill_worker"] == "" and request.attributes["kvmesh.decode_worker"] == "decode-2"
        assert "tokens to prefill" in request.attributes["kvmesh.route.local_prefill"]
        assert not {"prefill_call", "prefill", "kv_transfer"} & {s.name for s in spans}
        [decode] = [s for s in spans if s.name == "decode"]
        assert decode.attributes["kvmesh.local_prefill"] is True
        assert second["usage"]["prompt_tokens"] == len(turns[1]["prompt"])
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == held * 16  # the previous answer's full blocks too
        prefill = await worker_stats(mesh.nats.url, "default", "prefill-1", **mesh.nats.connect_options())
        assert prefill.bytes_served == served_before  # no KV moved for it
        await decode_holds(turns[2]["prompt"], (len(turns[1]["prompt"]) + FOLLOW_UP_TOKENS - 1) // 16)
        third, spans = await turn(2)  # a long new message: the prefill worker's again
        assert len(turns[2]["prompt"]) - len(turns[1]["prompt"]) - FOLLOW_UP_TOKENS > 256
        [request] = [s for s in spans if s.name == "mesh_request"]
        assert request.attributes["kvmesh.prefill_worker"] == "prefill-1"
        assert request.attributes["kvmesh.route.reason"] in ("prefix_cache", "load", "peer_prefix")
        assert {"prefill", "kv_transfer"} <= {s.name for s in spans}
        for worker_id in ("prefill-1", "decode-2"):
            stats = await worker_stats(mesh.nats.url, "default", worker_id, **mesh.nats.connect_options())
            assert (stats.num_in_use, stats.num_held, stats.pins) == (0, 0, 0), stats
    finally:
        await nc.close()


async def test_decode_workers_prefill_themselves_without_prefill_workers(tmp_path, default_model_dir, single_process):
    env = {"KVMESH_CACHE_DIR": str(default_model_dir.parent.parent)}
    # Anonymous: the prefill worker started below has no credentials made at the mesh's start.
    local = LocalMesh(MeshOptions(prefill=0, decode=1, kv_cache_mib=32, auth=False, env=env), tmp_path)
    await asyncio.to_thread(local.start)
    try:
        response = await post(local.base_url, "/v1/completions", completion_body(PROMPTS[0]))
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["text"] == single_process["texts"][0]
        stats = await worker_stats(local.nats.url, "default", "decode-1")
        assert stats.transfers == 0 and stats.num_in_use == 0  # no KV moved: prefilled in place
        # A prefill worker whose KV layout the decode worker cannot pull (other blocks) is
        # never paired with it; the router says why, and the decode worker goes on prefilling.
        prefill = local.start_worker("prefill", ["--block-size", "32"])
        await asyncio.to_thread(local.wait_worker_ready, prefill)
        await until_ready(local.base_url, "prefill")
        response = await post(local.base_url, "/v1/completions", completion_body(PROMPTS[0]))
        assert response.json()["choices"][0]["text"] == single_process["texts"][0]
        stats = await worker_stats(local.nats.url, "default", "decode-1")
        assert stats.transfers == 0
        router_log = (tmp_path / "logs" / "router.log").read_text()
        assert (
            f"not pairing prefill worker {prefill} with decode worker decode-1: "
            f"{prefill}'s KV layout does not match decode-1's (block size 32 vs 16)"
        ) in router_log
    finally:
        await asyncio.to_thread(local.stop)


async def until_ready(base_url: str, role: str, timeout: float = 30.0) -> None:
    """Wait for the router to count a ready worker of ``role``."""
    import httpx

    async with httpx.AsyncClient(base_url=base_url, timeout=5) as client:
        for _ in range(int(timeout / 0.2)):
            response = await client.get("/health")
            if response.status_code == 200 and response.json()["workers"].get(role):
                return
            await asyncio.sleep(0.2)
    raise AssertionError(f"the router never counted a ready {role} worker")


async def test_kv_events_and_snapshots_name_the_prompts_blocks(mesh, default_model_dir):
    """Both workers publish numbered batches of stored blocks with the shared hash function's
    values; a snapshot lists the same blocks."""
    import nats

    from kvmesh.engine.tokenizer import Tokenizer
    from kvmesh.hashing import hash_to_hex, hash_token_blocks
    from kvmesh.protocol import KVEventBatch, KVSnapshot, Subjects

    subjects = Subjects("default")
    nc = await nats.connect(mesh.nats.url, connect_timeout=5)
    batches: list[KVEventBatch] = []

    async def collect(msg):
        batches.append(KVEventBatch.decode(msg.data))

    await nc.subscribe(subjects.kv_events, cb=collect)
    try:
        prompt = "Blocks for the index: " + "granite, basalt, marble, slate. " * 12
        response = await post(mesh.base_url, "/v1/completions", completion_body(prompt))
        assert response.status_code == 200
        ids = Tokenizer.from_dir(default_model_dir).encode(prompt)
        want = [hash_to_hex(h) for h in hash_token_blocks(ids, 16, (MODEL,))]
        assert len(want) >= 4
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            stored = {w: [h for b in batches if b.worker_id == w for e in b.events if e.kind == "stored" for h in e.block_hashes] for w in ("prefill-1", "decode-2")}
            if all(set(want) <= set(hashes) for hashes in stored.values()):
                break
            await asyncio.sleep(0.1)
        for worker_id, hashes in stored.items():
            assert set(want) <= set(hashes), worker_id
            seqs = [b.seq for b in batches if b.worker_id == worker_id]
            assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # numbered without gaps
        reply = await nc.request(subjects.kv_snapshot("prefill-1"), b"", timeout=5)
        snapshot = KVSnapshot.decode(reply.data)
        assert set(want) <= set(snapshot.block_hashes)
        assert snapshot.seq >= max(b.seq for b in batches if b.worker_id == "prefill-1")
    finally:
        await nc.close()



@pytest.mark.parametrize("routing", ["kv-aware", "load-only"])
async def test_prefix_reuse_across_prefill_workers(tmp_path, default_model_dir, routing):
    """Two prefill workers and kv-metadata; each topic's context is sent, then extended.
    kv-aware: the follow-up goes to the worker holding the context (no pull needed).
    load-only (the control): follow-ups land on either worker; one without the context pulls
    it from its peer through Mooncake instead of recomputing it. Either way every follow-up
    reuses the whole context and its tokens equal one process's."""
    import json

    env = {"KVMESH_CACHE_DIR": str(default_model_dir.parent.parent)}
    config = None
    if routing == "load-only":
        config = tmp_path / "routing.json"
        config.write_text(json.dumps({"plugins": [{"name": "load", "weight": 1}, {"name": "random", "weight": 0.1, "args": {"seed": 3}}]}))
    options = MeshOptions(prefill=2, decode=1, kv_cache_mib=32, num_threads=1, env=env, routing_config=str(config) if config else None)
    local = LocalMesh(options, tmp_path)
    await asyncio.to_thread(local.start)
    reference = LLMEngine(EngineConfig(model=str(default_model_dir), served_model_name=MODEL, kv_cache_bytes=32 * 2**20))
    try:
        topics = ["volcanoes", "glaciers", "deserts", "coral reefs", "rivers", "forests"]
        for topic in topics:
            context = f"Notes on {topic}. " + f"The study of {topic} covers their formation, history and change. " * 6
            first = (await post(local.base_url, "/v1/completions", {**completion_body(context), "max_tokens": 2})).json()
            await asyncio.sleep(0.5)  # the KV events reach kv-metadata (batches every 0.1 s)
            follow_prompt = context + " Summary:"
            follow = (await post(local.base_url, "/v1/completions", {**completion_body(follow_prompt), "max_tokens": 8})).json()
            cached = follow["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert cached >= (first["usage"]["prompt_tokens"] // 16 - 1) * 16, (topic, cached)
            [want] = reference.generate([reference.tokenizer.encode(follow_prompt)], SamplingParams(max_tokens=8, ignore_eos=True))
            assert follow["choices"][0]["text"] == want.text
        pulled = [(await worker_stats(local.nats.url, "default", w)).bytes_pulled for w in ("prefill-1", "prefill-2")]
        if routing == "kv-aware":
            assert pulled == [0, 0]  # every follow-up went where its context was
        else:
            assert sum(pulled) > 0  # some follow-ups pulled their context from the peer
    finally:
        await asyncio.to_thread(local.stop)


async def test_trace_replay_drives_the_mesh(mesh, tmp_path):
    """A tiny Mooncake-format trace replayed through the router: equal hash_ids give equal
    prompt prefixes, so later requests are served from the KV cache."""
    import json as jsonlib

    from kvmesh.replay import load_trace
    from kvmesh.replay.driver import DriveConfig, drive, oracle_cached_tokens

    lines = [
        {"timestamp": 0, "input_length": 2048, "output_length": 4, "hash_ids": [901, 902, 903, 904]},
        {"timestamp": 500, "input_length": 2048, "output_length": 4, "hash_ids": [901, 902, 903, 905]},
        {"timestamp": 1000, "input_length": 1536, "output_length": 4, "hash_ids": [901, 902, 906]},
    ]
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(jsonlib.dumps(line) for line in lines) + "\n")
    trace = load_trace(path)
    config = DriveConfig(base_url=mesh.base_url, model=MODEL, tokens_per_block=32, max_output_tokens=4, time_scale=1.0)
    result = await drive(trace, config)
    assert result.failed == 0 and result.output_tokens == 12
    assert result.prompt_tokens == 4 * 32 + 4 * 32 + 3 * 32
    assert oracle_cached_tokens(trace, config) == 3 * 32 + 2 * 32  # shared hash prefixes only
    assert result.cached_tokens == result.oracle_cached_tokens  # spaced out: every possible hit happens
