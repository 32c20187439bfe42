"""A mesh with TLS on (``kvmesh up``'s default): every service reaches NATS and etcd over TLS
trusting the mesh's own CA, the greedy answer is the one a plaintext mesh gives, and neither
a plaintext client nor one trusting another CA gets in, even with the admin's password."""

from __future__ import annotations

import asyncio
import dataclasses
import ssl
from pathlib import Path

import nats
import pytest

from kvmesh.cluster.etcd_store import ClusterError, EtcdStore
from kvmesh.infra.local_mesh import LocalMesh
from kvmesh.protocol import Keys, Subjects, WorkerStats
from kvmesh.security.tls import LOCAL_HOSTS, MeshTLS, client_context
from tests.mesh.client import post
from tests.mesh.meshes import MODEL, make_mesh

pytestmark = pytest.mark.slow

PROMPT = "A river runs from the mountains to the sea, past towns, fields and forests. " * 3 + "The capital of France is"
GREEDY = {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "temperature": 0}


@pytest.fixture(scope="module")
def mesh(tmp_path_factory, default_model_dir):
    local = make_mesh(tmp_path_factory.mktemp("tls"), default_model_dir, prefill=1, decode=1, tls=True)
    yield local
    local.stop()


@pytest.fixture(scope="module")
def other_ca(tmp_path_factory) -> Path:
    return MeshTLS.generate(tmp_path_factory.mktemp("other"), {"nats": LOCAL_HOSTS}).ca_file


def cmdline(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")


async def test_every_service_is_given_the_ca_by_path(mesh):
    assert mesh.tls is not None and mesh.credentials is not None
    ca = str(mesh.tls.ca_file)
    services = {"kv-metadata": mesh.kv_metadata, "router": mesh.router, **mesh.workers}
    for name, process in services.items():
        argv = cmdline(process.pid)
        assert argv[argv.index("--nats-tls-ca") + 1] == ca and argv[argv.index("--etcd-tls-ca") + 1] == ca, name
        assert "--require-tls" in argv, name
    nats_argv = " ".join(cmdline(mesh.nats.process.pid))
    assert "nats-server.conf" in nats_argv and "--pass" not in nats_argv
    assert "https://" in " ".join(cmdline(mesh.etcd.process.pid))


async def test_tls_mesh_answers_as_a_plaintext_mesh(mesh, tmp_path):
    response = await post(mesh.base_url, "/v1/completions", GREEDY)
    assert response.status_code == 200, response.text
    answer = response.json()["choices"][0]["text"]
    assert answer != ""
    # Both workers report over TLS'd NATS; the decode side pulled the prefill's KV.
    nc = await nats.connect(mesh.nats.url, connect_timeout=5, **mesh.nats.connect_options())
    try:
        for worker_id in mesh.workers:
            reply = await nc.request(Subjects("default").stats(worker_id), b"", timeout=5)
            assert WorkerStats.decode(reply.data).num_blocks > 0
    finally:
        await nc.close()
    plain = LocalMesh(dataclasses.replace(mesh.options, tls=False), tmp_path)
    await asyncio.to_thread(plain.start)
    try:
        assert plain.tls is None and plain.etcd.url.startswith("http://")
        response = await post(plain.base_url, "/v1/completions", GREEDY)
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["text"] == answer
    finally:
        await asyncio.to_thread(plain.stop)


async def test_plaintext_clients_are_refused_even_with_the_admins_password(mesh):
    with pytest.raises(nats.errors.Error):
        await nats.connect(mesh.nats.url, connect_timeout=3, allow_reconnect=False, max_reconnect_attempts=0)
    with pytest.raises(ClusterError):
        await EtcdStore([mesh.etcd.endpoint], timeout=3).connect()  # as root, in plaintext


async def test_clients_trusting_another_ca_are_refused(mesh, other_ca):
    with pytest.raises(ssl.SSLCertVerificationError):
        await nats.connect(
            mesh.nats.url, tls=client_context(other_ca), tls_handshake_first=True,
            connect_timeout=3, allow_reconnect=False, max_reconnect_attempts=0,
        )  # fmt: skip
    with pytest.raises(ClusterError):
        await EtcdStore([mesh.etcd.endpoint], timeout=3, tls_ca=other_ca).connect()


async def test_clients_trusting_the_mesh_ca_see_the_workers(mesh):
    async with EtcdStore([mesh.etcd.endpoint], timeout=3, **mesh.etcd.store_options()) as store:
        records, _ = await store.get_prefix(Keys("default").workers())
    assert {r.key.rsplit("/", 1)[1] for r in records} >= set(mesh.workers)
