"""Who may do what on a mesh started with ``kvmesh up``'s defaults (auth and TLS on): nobody anonymous
gets into NATS or etcd, a worker's credentials speak only for that worker and only into the
streams it was handed, a release needs its pin's token, a lender caps what one peer may
hold, a forged KV batch naming another worker is dropped, implausible worker records are
not used, Mooncake listens on the advertised address only, and the mesh still answers as
before (issue #8)."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import httpx
import nats
import pytest

from kvmesh.cluster.etcd_store import ClusterError, EtcdStore
from kvmesh.infra.local_mesh import LocalMesh, MeshOptions
from kvmesh.protocol import (
    STREAM_MESSAGE,
    KVEventBatch,
    KVEventSpec,
    KVIndexStats,
    KVQuery,
    KVQueryReply,
    Keys,
    KVLendReply,
    KVLendRequest,
    KVSnapshot,
    LoadReport,
    PrefillRequest,
    PrefillResponse,
    ReleaseRequest,
    SamplingSpec,
    Subjects,
    TokenEvent,
    WorkerRecord,
)
from kvmesh.security.credentials import load_credentials
from tests.mesh.client import post, send_work, stream, streamed_text, worker_stats
from tests.mesh.meshes import assert_pools_at_baseline, listening

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
S, K = Subjects("default"), Keys("default")
PROMPT = "A river runs from the mountains to the sea, past towns, fields and forests. " * 3 + "The capital of France is"
GREEDY = {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "temperature": 0}  # a few full KV blocks
FAKE_BLOCK = "ab" * 16


@pytest.fixture(scope="module")
def mesh(tmp_path_factory, default_model_dir):
    options = MeshOptions(
        prefill=1, decode=1, kv_cache_mib=32, num_threads=1, request_timeout=20, tls=True,
        env={"KVMESH_CACHE_DIR": str(default_model_dir.parent.parent)},
    )  # fmt: skip
    local = LocalMesh(options, tmp_path_factory.mktemp("trust"))
    local.start()
    yield local
    local.stop()


@pytest.fixture(scope="module")
def first_answer(mesh) -> str:
    """The greedy answer before anyone tried anything (it also fills prefill-1's cache)."""
    response = httpx.post(mesh.base_url + "/v1/completions", json=GREEDY, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


class Connection:
    """A NATS connection as one mesh identity, collecting what the server refused."""

    def __init__(self) -> None:
        self.errors: list[str] = []
        self.nc: nats.NATS

    async def open(self, mesh: LocalMesh, identity: str) -> Connection:
        assert mesh.credentials is not None
        user = load_credentials(mesh.credentials.file_of(identity), "nats")

        async def collect(exc: Exception) -> None:
            self.errors.append(str(exc))

        self.nc = await nats.connect(
            mesh.nats.address, user=user.user, password=user.password, inbox_prefix=user.inbox_prefix,
            error_cb=collect, connect_timeout=5, **mesh.nats.connect_options(),
        )  # fmt: skip
        return self

    async def refused(self, what: str, count: int, timeout: float = 5.0) -> list[str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = [e for e in self.errors if what in e]
            if len(found) >= count:
                return found
            await asyncio.sleep(0.05)
        raise AssertionError(f"expected {count} {what!r} errors, got {self.errors}")


async def kv_stats(nc: nats.NATS) -> KVIndexStats:
    return KVIndexStats.decode((await nc.request(S.kv_stats, b"", timeout=5)).data)


async def test_anonymous_nats_connect_is_refused(mesh):
    with pytest.raises(nats.errors.Error, match="Authorization Violation"):
        await nats.connect(
            mesh.nats.address, connect_timeout=5, allow_reconnect=False, max_reconnect_attempts=0,
            **mesh.nats.connect_options(),
        )  # fmt: skip


async def test_anonymous_etcd_get_and_put_are_refused(mesh):
    async with EtcdStore([mesh.etcd.address], timeout=3, **mesh.etcd.store_options()) as store:
        with pytest.raises(ClusterError, match="user name is empty"):
            await store.get_prefix(K.workers())
        with pytest.raises(ClusterError, match="user name is empty"):
            await store.put(K.worker("decode", "evil-1"), b"{}")


async def test_a_worker_speaks_only_for_itself_on_nats(mesh, first_answer):
    admin = await nats.connect(mesh.nats.url, connect_timeout=5, **mesh.nats.connect_options())
    seen: list[str] = []

    async def watch(msg) -> None:
        if msg.data.startswith(b"forged"):
            seen.append(msg.subject)

    await admin.subscribe("kvmesh.default.>", cb=watch)
    worker = await Connection().open(mesh, "decode-2")
    try:
        await asyncio.sleep(0.2)  # nats-py's flush is no barrier for a subscription
        forged = [
            S.kv_events_from("prefill-1"),
            S.load_from("prefill-1"),
            S.decode(),
            S.decode("decode-2"),
            S.cancel,
            S.prefill(),
        ]
        for subject in forged:
            await worker.nc.publish(subject, b"forged")
        await worker.nc.publish(S.load_from("decode-2"), b"forged")  # allowed: shows what arrives does
        spied = [S.kv_events, f"{S.root}.stream.>"]  # nor may it read others' events or any stream
        for subject in spied:
            await worker.nc.subscribe(subject, cb=watch)
        await worker.nc.flush()
        refused = await worker.refused("permissions violation for publish", len(forged))
        assert sorted(e.rsplit(" ", 1)[-1].strip('"') for e in refused) == sorted(s.lower() for s in forged)
        refused = await worker.refused("permissions violation for subscription", len(spied))
        assert sorted(e.rsplit(" ", 1)[-1].strip('"') for e in refused) == sorted(s.lower() for s in spied)
        deadline = time.monotonic() + 5
        while not seen and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert seen == [S.load_from("decode-2")]  # nothing forged got through
        assert worker.nc.is_connected  # a refused publish does not cut the connection
    finally:
        await worker.nc.close()
        await admin.close()


async def test_a_forged_batch_naming_another_worker_is_dropped(mesh, first_answer):
    admin = await nats.connect(mesh.nats.url, connect_timeout=5, **mesh.nats.connect_options())
    worker = await Connection().open(mesh, "decode-2")
    try:
        deadline = time.monotonic() + 10
        while not (before := await kv_stats(admin)).workers.get("prefill-1"):  # the first request's blocks
            assert time.monotonic() < deadline, before
            await asyncio.sleep(0.1)
        # decode-2 may publish on its own subject, but the batch says it is prefill-1's.
        batch = KVEventBatch(
            worker_id="prefill-1", epoch="forged", seq=0, block_size=16,
            events=[KVEventSpec(kind="cleared"), KVEventSpec(kind="stored", block_hashes=[FAKE_BLOCK])],
        )  # fmt: skip
        await worker.nc.publish(S.kv_events_from("decode-2"), batch.encode())
        await worker.nc.flush()
        assert mesh.kv_metadata is not None
        deadline = time.monotonic() + 10
        while "dropped a KV event batch for prefill-1" not in mesh.kv_metadata.tail(50):
            assert time.monotonic() < deadline, mesh.kv_metadata.tail(50)
            await asyncio.sleep(0.05)
        after = await kv_stats(admin)
        assert after.workers.get("prefill-1") == before.workers["prefill-1"]
        reply = await admin.request(S.kv_query, KVQuery(block_hashes=[FAKE_BLOCK]).encode(), timeout=5)
        assert KVQueryReply.decode(reply.data).matches == {}
        assert worker.errors == []  # its own subject was allowed: kv-metadata did the dropping
    finally:
        await worker.nc.close()
        await admin.close()


async def test_a_forged_load_report_naming_another_worker_is_dropped(mesh):
    worker = await Connection().open(mesh, "decode-2")
    try:
        forged = LoadReport(worker_id="prefill-1", role="prefill", running=0, waiting=99, free_blocks=0,
                            total_blocks=1, draining=True, ready=False, timestamp=time.time())  # fmt: skip
        await worker.nc.publish(S.load_from("decode-2"), forged.encode())
        await worker.nc.flush()
        assert mesh.router is not None
        deadline = time.monotonic() + 10
        while "dropped a LoadReport for prefill-1 published on decode-2's subject" not in mesh.router.tail(50):
            assert time.monotonic() < deadline, mesh.router.tail(50)
            await asyncio.sleep(0.05)
        assert worker.errors == []
    finally:
        await worker.nc.close()


async def test_a_worker_writes_only_its_own_etcd_keys(mesh):
    assert mesh.credentials is not None
    evil = WorkerRecord(worker_id="evil-1", role="decode", model=MODEL, max_model_len=2048, subject=S.decode("evil-1"),
                        host="h", pid=1, started_at=time.time())  # fmt: skip
    for identity in ("prefill-1", "decode-2", "router"):
        creds = load_credentials(mesh.credentials.file_of(identity), "etcd")
        async with EtcdStore([mesh.etcd.address], timeout=3, credentials=creds, **mesh.etcd.store_options()) as store:
            workers, _ = await store.get_prefix(K.workers())  # everyone may read the directory
            assert {kv.key for kv in workers} >= {K.worker("prefill", "prefill-1"), K.worker("decode", "decode-2")}
            with pytest.raises(ClusterError, match="permission denied"):
                await store.put(K.worker("decode", "evil-1"), evil.encode())
            other = K.worker("prefill", "prefill-1") if identity == "decode-2" else K.worker("decode", "decode-2")
            with pytest.raises(ClusterError, match="permission denied"):
                await store.delete(other)
    async with EtcdStore([mesh.etcd.endpoint], timeout=3, **mesh.etcd.store_options()) as store:  # as root
        assert await store.get(K.worker("decode", "evil-1")) is None


async def test_mooncake_listens_on_the_advertised_address_only(mesh, first_answer):
    """Mooncake binds its two listeners to the unspecified address whatever it is told; the
    bind guard (preloaded into every worker) puts them on the advertised 127.0.0.1. Before,
    each worker listened on 0.0.0.0 and * (every interface) on its two transfer ports."""
    async with EtcdStore([mesh.etcd.endpoint], timeout=3, **mesh.etcd.store_options()) as store:  # as root
        workers, _ = await store.get_prefix(K.workers())
    records = {record.worker_id: record for record in (WorkerRecord.decode(kv.value) for kv in workers)}
    for worker_id, process in mesh.workers.items():
        record = records[worker_id]
        assert record.host == "127.0.0.1" and record.transfer_endpoint is not None
        sockets = listening(process.pid)
        rpc_port = int(record.transfer_endpoint.rsplit(":", 1)[1])
        transfer = [(address, port) for address, port in sockets if 15000 <= port <= 17000]  # Mooncake's default range
        assert len(transfer) == 2 and ("127.0.0.1", rpc_port) in transfer, (worker_id, sockets)
        assert {address for address, _ in sockets} <= {"127.0.0.1", "::ffff:127.0.0.1"}, (worker_id, sockets)
        assert "listen on every interface" not in process.tail(200)
    # The greedy request before this test was served by a KV pull through those listeners.
    decode = await worker_stats(mesh.nats.url, "default", "decode-2", **mesh.nats.connect_options())
    assert decode.bytes_pulled > 0 and decode.transfers > 0


async def test_the_mesh_still_answers_as_before(mesh, first_answer, tmp_path):
    response = await post(mesh.base_url, "/v1/completions", GREEDY)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] == first_answer != ""
    # Without auth (no credentials anywhere, as before issue #8) the answer is the same.
    anonymous = LocalMesh(dataclasses.replace(mesh.options, auth=False, tls=False), tmp_path)
    await asyncio.to_thread(anonymous.start)
    try:
        assert anonymous.credentials is None and "@" not in anonymous.nats.url
        response = await post(anonymous.base_url, "/v1/completions", GREEDY)
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["text"] == first_answer
    finally:
        await asyncio.to_thread(anonymous.stop)


async def wait_for_line(process, needle: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while needle not in process.tail(100):
        assert time.monotonic() < deadline, process.tail(100)
        await asyncio.sleep(0.05)


async def test_a_worker_cannot_stream_into_a_request_it_was_not_handed(mesh, first_answer):
    """Streams are the NATS reply subjects of the work: the decode worker handed the work
    answers there, and nobody else may, though they know the subject (here an admin spy
    tells them) and the attempt id. Before, any worker could publish on stream.>."""
    admin = await nats.connect(mesh.nats.url, connect_timeout=5, **mesh.nats.connect_options())
    attackers = [await Connection().open(mesh, "decode-2"), await Connection().open(mesh, "prefill-1")]
    forged_on: list[str] = []

    async def forge(msg) -> None:
        if not msg.subject.endswith(".decode") or forged_on:
            return
        forged_on.append(msg.subject)
        attempt_id = STREAM_MESSAGE.validate_json(msg.data).request_id
        for attacker in attackers:
            for seq in range(8):
                event = TokenEvent(request_id=attempt_id, seq=seq, token_ids=[1234], text="EVIL", finished=seq == 7)
                await attacker.nc.publish(msg.subject, event.encode())
            await attacker.nc.flush()

    await admin.subscribe(f"{S.root}.stream.>", cb=forge)
    try:
        await asyncio.sleep(0.2)  # the spy's subscription reaches the server
        events = await stream(mesh.base_url, "/v1/completions", GREEDY)
        assert streamed_text(events) == first_answer  # the honest answer, nothing forged in it
        assert len(forged_on) == 1, forged_on
        for attacker in attackers:
            refused = await attacker.refused("permissions violation for publish", 8)
            assert {e.rsplit(" ", 1)[-1].strip('"') for e in refused} == {forged_on[0].lower()}
            assert attacker.nc.is_connected
    finally:
        for attacker in attackers:
            await attacker.nc.close()
        await admin.close()


async def test_a_worker_cannot_give_itself_the_right_to_answer_into_a_stream(mesh):
    """A worker publishing to a subject it subscribes to, with a victim's stream as the reply
    subject, would be handed a response right there; those subjects are denied, and a
    lend may name only its sender as the borrower."""
    prefill = await Connection().open(mesh, "prefill-1")
    decode = await Connection().open(mesh, "decode-2")
    victim = S.stream("router", "key", "decode")
    try:
        refused_prefill = [S.release("prefill-1"), S.kv_lend("prefill-1", "prefill-1"), S.kv_lend("prefill-9", "decode-2")]
        for subject in refused_prefill:
            await prefill.nc.publish(subject, b"{}", reply=victim)
        refused_decode = [S.kv_lend("prefill-1", "decode-2"), S.stream("router", "key", "prefill")]
        for subject in refused_decode:
            await decode.nc.publish(subject, b"{}", reply=victim)
        for connection, subjects in ((prefill, refused_prefill), (decode, refused_decode)):
            await connection.nc.flush()
            refused = await connection.refused("permissions violation for publish", len(subjects))
            assert sorted(e.rsplit(" ", 1)[-1].strip('"') for e in refused) == sorted(x.lower() for x in subjects)
    finally:
        await prefill.nc.close()
        await decode.nc.close()


async def test_a_release_needs_its_pins_token(mesh):
    """Any worker may publish on release.<prefill>, so a release counts only with the token
    the pin was made with, which only the handle carries. Before, decode-2's credentials
    (or any worker's) freed another request's pinned blocks under a pull in progress."""
    admin = await nats.connect(mesh.nats.url, connect_timeout=5, **mesh.nats.connect_options())
    worker = await Connection().open(mesh, "decode-2")
    try:
        prefill = PrefillRequest(request_id="pinned-1", prompt_token_ids=list(range(300, 340)), sampling=SamplingSpec(max_tokens=4))
        [answer] = await send_work(admin, S.prefill("prefill-1"), prefill.encode(), S.stream("test", "pin", "prefill"))
        assert isinstance(answer, PrefillResponse) and answer.kv is not None
        assert answer.kv.pin_ttl == 30  # the producer's --pin-ttl (MeshOptions' default): bounds the decode side's wait
        assert (await worker_stats(mesh.nats.url, "default", "prefill-1", **mesh.nats.connect_options())).pins == 1
        for guess in ("", "guessed", answer.kv.pin_token[:-1] + "x"):
            await worker.nc.publish(S.release("prefill-1"), ReleaseRequest(request_id="pinned-1", pin_token=guess).encode())
        await worker.nc.flush()
        await wait_for_line(mesh.workers["prefill-1"], "refused a release of pinned-1: wrong pin token")
        assert (await worker_stats(mesh.nats.url, "default", "prefill-1", **mesh.nats.connect_options())).pins == 1
        honest = ReleaseRequest(request_id="pinned-1", pin_token=answer.kv.pin_token, ok=False)
        await worker.nc.publish(S.release("prefill-1"), honest.encode())  # as the handle's holder
        await worker.nc.flush()
        await assert_pools_at_baseline(mesh, ["prefill-1"])
        assert worker.errors == []
    finally:
        await worker.nc.close()
        await admin.close()


async def test_a_flood_of_lends_from_one_peer_pins_at_most_its_cap(mesh, first_answer):
    """Twenty lends per cached block from one borrower, all at once (the sniffing attack of issue #8
    pinned 45 of a worker's 364 free blocks until the pin TTL): the lender holds at most a
    quarter of its pool for that borrower and refuses the rest by name; another borrower is
    still lent to, and every loan is released with its token."""
    admin = await nats.connect(mesh.nats.url, connect_timeout=5, **mesh.nats.connect_options())
    try:
        snapshot = KVSnapshot.decode((await admin.request(S.kv_snapshot("prefill-1"), b"", timeout=5)).data)
        assert snapshot.block_hashes
        stats = await worker_stats(mesh.nats.url, "default", "prefill-1", **mesh.nats.connect_options())
        cap = stats.num_blocks // 4

        async def lend(number: int) -> KVLendReply:
            block = snapshot.block_hashes[number % len(snapshot.block_hashes)]
            request = KVLendRequest(handle=f"flood-{number}", block_hashes=[block])
            return KVLendReply.decode((await admin.request(S.kv_lend("prefill-1", "mallory"), request.encode(), timeout=10)).data)

        replies = await asyncio.gather(*(lend(number) for number in range(20 * len(snapshot.block_hashes))))  # all at once
        loans = [reply for reply in replies if reply.error is None]
        refusals = [reply for reply in replies if reply.error is not None]
        assert sum(len(loan.block_ids) for loan in loans) == cap < 20 * len(snapshot.block_hashes)
        assert refusals and {r.error.code for r in refusals if r.error} == {"overloaded"}
        assert refusals[0].error is not None and refusals[0].error.message == f"mallory holds {cap} of at most {cap} lent blocks here"
        other = KVLendRequest(handle="alice-1", block_hashes=[snapshot.block_hashes[0]])
        alice = KVLendReply.decode((await admin.request(S.kv_lend("prefill-1", "alice"), other.encode(), timeout=5)).data)
        assert alice.error is None and len(alice.block_ids) == 1
        assert (await worker_stats(mesh.nats.url, "default", "prefill-1", **mesh.nats.connect_options())).pins == cap + 1
        for loan in [*loans, alice]:
            await admin.publish(S.release("prefill-1"), ReleaseRequest(request_id=loan.loan_id, pin_token=loan.pin_token).encode())
        await admin.flush()
        await assert_pools_at_baseline(mesh, ["prefill-1"])
    finally:
        await admin.close()


async def test_implausible_worker_records_are_not_used_by_the_router(mesh, first_answer):
    """Records that cannot be what they say (written here as root; a worker can write only
    its own key): another worker's id, another role, a transfer endpoint off its host, a
    max_model_len beyond the model's. Each made attractive with a fresh load report; the
    router refuses each with a log line, sends them nothing and keeps serving."""
    decoy = S.decode("evil-1")
    base = dict(model=MODEL, max_model_len=2048, subject=decoy, host="127.0.0.1", pid=1, started_at=time.time())
    fakes = {
        K.worker("decode", "evil-1"): WorkerRecord(worker_id="evil-2", role="decode", **base),  # type: ignore[arg-type]
        K.worker("decode", "evil-3"): WorkerRecord(worker_id="evil-3", role="prefill", **base),  # type: ignore[arg-type]
        K.worker("decode", "evil-4"): WorkerRecord(worker_id="evil-4", role="decode", transfer_endpoint="10.6.6.6:1", **base),  # type: ignore[arg-type]
        K.worker("decode", "evil-5"): WorkerRecord(worker_id="evil-5", role="decode", **{**base, "max_model_len": 10**7}),  # type: ignore[arg-type]
    }
    admin = await nats.connect(mesh.nats.url, connect_timeout=5, **mesh.nats.connect_options())
    stolen: list[str] = []

    async def steal(msg) -> None:
        stolen.append(msg.subject)

    await admin.subscribe(decoy, cb=steal)
    for worker_id in ("evil-1", "evil-2", "evil-3", "evil-4", "evil-5"):
        await admin.subscribe(S.decode(worker_id), cb=steal)
    async with EtcdStore([mesh.etcd.endpoint], timeout=3, **mesh.etcd.store_options()) as store:  # as root
        try:
            for key, record in fakes.items():
                await store.put(key, record.encode())
            assert mesh.router is not None
            for key in fakes:
                await wait_for_line(mesh.router, f"refusing the worker record at {key}")
            for worker_id in ("evil-1", "evil-2", "evil-3", "evil-4", "evil-5"):
                report = LoadReport(worker_id=worker_id, role="decode", running=0, waiting=0, free_blocks=10**6,
                                    total_blocks=10**6, timestamp=time.time())  # fmt: skip
                await admin.publish(S.load_from(worker_id), report.encode())
            for _ in range(4):
                response = await post(mesh.base_url, "/v1/completions", GREEDY)
                assert response.status_code == 200, response.text
                assert response.json()["choices"][0]["text"] == first_answer
            assert stolen == []
        finally:
            for key in fakes:
                await store.delete(key)
            await admin.close()


async def test_a_burst_of_snapshot_requests_costs_the_engine_one_snapshot(mesh, first_answer):
    """The router's credentials may ask any worker for its KV snapshot (its copy of the index
    resyncs from one). Two hundred requests at once, the mesh idle, are all answered with the
    same snapshot, taken of the engine once (``kvmesh:kv_snapshots``): asking without end
    cannot keep a worker's engine answering."""
    assert mesh.credentials is not None
    router = await Connection().open(mesh, "router")
    creds = load_credentials(mesh.credentials.file_of("router"), "etcd")
    async with EtcdStore([mesh.etcd.address], timeout=3, credentials=creds, **mesh.etcd.store_options()) as store:
        item = await store.get(K.worker("prefill", "prefill-1"))
    assert item is not None
    metrics_url = f"{WorkerRecord.decode(item.value).health_url}/metrics"

    async def answers(client: httpx.AsyncClient) -> dict[str, float]:
        found = {"engine": 0.0, "kept": 0.0}
        for line in (await client.get(metrics_url)).text.splitlines():
            if line.startswith("kvmesh:kv_snapshots_total{"):
                found[line.split('answered="', 1)[1].split('"', 1)[0]] = float(line.rsplit(" ", 1)[1])
        return found

    try:
        async with httpx.AsyncClient(timeout=10) as client:
            before = await answers(client)
            replies = await asyncio.gather(
                *(router.nc.request(S.kv_snapshot("prefill-1"), b"", timeout=10) for _ in range(200))
            )
            after = await answers(client)
        snapshots = {reply.data for reply in replies}
        assert len(snapshots) == 1 and KVSnapshot.decode(replies[0].data).block_hashes  # prefill-1 holds the answer's prompt
        assert after["engine"] - before["engine"] <= 1
        assert after["engine"] + after["kept"] - before["engine"] - before["kept"] == 200
        response = await post(mesh.base_url, "/v1/completions", GREEDY)
        assert response.status_code == 200 and response.json()["choices"][0]["text"] == first_answer
        assert router.errors == []
    finally:
        await router.nc.close()


async def test_a_worker_claiming_more_blocks_than_its_pool_is_bounded_in_every_index(mesh, first_answer):
    """decode-2's credentials publish, on its own subject, a fresh epoch's first batch of
    invented hashes, many more than its pool holds: kv-metadata and the router's own copy of
    the index take at most twice its pool's blocks (``pool_capacity``), and the mesh answers
    as before. Run last in this module: decode-2's real blocks are out of the indexes after."""
    admin = await nats.connect(mesh.nats.url, connect_timeout=5, **mesh.nats.connect_options())
    worker = await Connection().open(mesh, "decode-2")
    try:
        pool = (await worker_stats(mesh.nats.url, "default", "decode-2", **mesh.nats.connect_options())).num_blocks
        invented = [f"{n:032x}" for n in range(1, 2 * pool + 500)]
        batch = KVEventBatch(
            worker_id="decode-2", epoch="invented", seq=0, block_size=16,
            events=[KVEventSpec(kind="stored", block_hashes=invented)],
        )  # fmt: skip
        await worker.nc.publish(S.kv_events_from("decode-2"), batch.encode())
        await worker.nc.flush()
        deadline = time.monotonic() + 10
        while (held := (await kv_stats(admin)).workers.get("decode-2", 0)) < 2 * pool:
            assert time.monotonic() < deadline, held
            await asyncio.sleep(0.1)
        stats = await kv_stats(admin)
        assert stats.workers["decode-2"] == 2 * pool
        async with httpx.AsyncClient(base_url=mesh.base_url, timeout=10) as client:
            while True:  # the router's copy took the same batch
                text = (await client.get("/metrics")).text
                line = next(line for line in text.splitlines() if line.startswith("kvmesh:router_kv_index_blocks{"))
                router_blocks = float(line.rsplit(" ", 1)[1])
                if router_blocks >= 2 * pool or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.1)
        assert 2 * pool <= router_blocks <= 2 * pool + stats.workers.get("prefill-1", 0)
        response = await post(mesh.base_url, "/v1/completions", GREEDY)
        assert response.status_code == 200 and response.json()["choices"][0]["text"] == first_answer
        assert worker.errors == []  # its own subject: allowed, and bounded by the indexes
    finally:
        await worker.nc.close()
        await admin.close()
