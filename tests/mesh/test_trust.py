"""Who may do what on a mesh started with LocalMesh's defaults (auth on): nobody anonymous
gets into NATS or etcd, a worker's credentials speak only for that worker, a forged KV batch
naming another worker is dropped, and the mesh still answers as before (issue #8)."""

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
    KVEventBatch,
    KVEventSpec,
    KVIndexStats,
    KVQuery,
    KVQueryReply,
    Keys,
    LoadReport,
    Subjects,
    WorkerRecord,
)
from kvmesh.security.credentials import load_credentials
from tests.mesh.client import post

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
S, K = Subjects("default"), Keys("default")
PROMPT = "A river runs from the mountains to the sea, past towns, fields and forests. " * 3 + "The capital of France is"
GREEDY = {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "temperature": 0}  # a few full KV blocks
FAKE_BLOCK = "ab" * 16


@pytest.fixture(scope="module")
def mesh(tmp_path_factory, default_model_dir):
    options = MeshOptions(
        prefill=1, decode=1, kv_cache_mib=32, num_threads=1, request_timeout=20,
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
            error_cb=collect, connect_timeout=5,
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
        await nats.connect(mesh.nats.address, connect_timeout=5, allow_reconnect=False, max_reconnect_attempts=0)


async def test_anonymous_etcd_get_and_put_are_refused(mesh):
    async with EtcdStore([mesh.etcd.address], timeout=3) as store:
        with pytest.raises(ClusterError, match="user name is empty"):
            await store.get_prefix(K.workers())
        with pytest.raises(ClusterError, match="user name is empty"):
            await store.put(K.worker("decode", "evil-1"), b"{}")


async def test_a_worker_speaks_only_for_itself_on_nats(mesh, first_answer):
    admin = await nats.connect(mesh.nats.url, connect_timeout=5)
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
        await worker.nc.publish(S.progress("nobody", "x"), b"forged")  # allowed: shows what arrives does
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
        assert seen == [S.progress("nobody", "x")]  # nothing forged got through
        assert worker.nc.is_connected  # a refused publish does not cut the connection
    finally:
        await worker.nc.close()
        await admin.close()


async def test_a_forged_batch_naming_another_worker_is_dropped(mesh, first_answer):
    admin = await nats.connect(mesh.nats.url, connect_timeout=5)
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
        async with EtcdStore([mesh.etcd.address], timeout=3, credentials=creds) as store:
            workers, _ = await store.get_prefix(K.workers())  # everyone may read the directory
            assert {kv.key for kv in workers} >= {K.worker("prefill", "prefill-1"), K.worker("decode", "decode-2")}
            with pytest.raises(ClusterError, match="permission denied"):
                await store.put(K.worker("decode", "evil-1"), evil.encode())
            other = K.worker("prefill", "prefill-1") if identity == "decode-2" else K.worker("decode", "decode-2")
            with pytest.raises(ClusterError, match="permission denied"):
                await store.delete(other)
    async with EtcdStore([mesh.etcd.endpoint], timeout=3) as store:  # as root
        assert await store.get(K.worker("decode", "evil-1")) is None


async def test_the_mesh_still_answers_as_before(mesh, first_answer, tmp_path):
    response = await post(mesh.base_url, "/v1/completions", GREEDY)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] == first_answer != ""
    # Without auth (no credentials anywhere, as before issue #8) the answer is the same.
    anonymous = LocalMesh(dataclasses.replace(mesh.options, auth=False), tmp_path)
    await asyncio.to_thread(anonymous.start)
    try:
        assert anonymous.credentials is None and "@" not in anonymous.nats.url
        response = await post(anonymous.base_url, "/v1/completions", GREEDY)
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["text"] == first_answer
    finally:
        await asyncio.to_thread(anonymous.stop)
