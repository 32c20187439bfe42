"""Credentials files, and etcd with auth on: a store authenticates, renews an expired token
by itself, and a watch it may not make fails instead of waiting forever."""

from __future__ import annotations

import asyncio
import json

import pytest

from kvmesh.cluster.etcd_store import ClusterError, EtcdStore
from kvmesh.infra.credentials import MeshCredentials
from kvmesh.infra.servers import start_etcd
from kvmesh.protocol import Keys
from kvmesh.security.credentials import CredentialsError, UserPassword, load_credentials, write_credentials
from kvmesh.security.etcd_roles import worker_grants

KEYS = Keys("authtest")


def test_a_credentials_file_is_private_and_read_by_section(tmp_path):
    path = write_credentials(tmp_path / "w.json", nats=UserPassword("w1", "pw-n"), etcd=UserPassword("w1", "pw-e"))
    assert path.stat().st_mode & 0o777 == 0o600
    assert load_credentials(path, "etcd") == UserPassword("w1", "pw-e")
    assert load_credentials(path, "nats").inbox_prefix == "_INBOX_w1"
    assert "pw-n" not in repr(load_credentials(path, "nats"))
    with pytest.raises(CredentialsError, match="no usable 'other' section"):
        load_credentials(path, "other")
    path.chmod(0o644)
    with pytest.raises(CredentialsError, match="readable by others"):
        load_credentials(path, "nats")


def test_mesh_credentials_give_each_identity_a_private_file(tmp_path):
    creds = MeshCredentials.generate(tmp_path / "auth", "authtest", {"prefill-1": "prefill", "decode-2": "decode"}, "kv-metadata")
    assert set(creds.files) == {"router", "kv-metadata", "prefill-1", "decode-2"}
    assert (tmp_path / "auth").stat().st_mode & 0o777 == 0o700
    passwords = set()
    for identity, path in creds.files.items():
        assert path.stat().st_mode & 0o777 == 0o600
        body = json.loads(path.read_text())
        assert body["nats"]["user"] == body["etcd"]["user"] == identity
        passwords |= {body["nats"]["password"], body["etcd"]["password"]}
    assert len(passwords) == 8  # all different
    assert creds.nats_config.stat().st_mode & 0o777 == 0o600
    with pytest.raises(KeyError, match="decode-3"):
        creds.file_of("decode-3")


def test_workers_may_answer_work_for_the_mesh_request_deadline(tmp_path):
    """A worker's right to answer a piece of work (its stream, ``allow_responses``) lasts the
    services' request deadline and a margin: a shorter window would cut long streams."""
    short = MeshCredentials.generate(tmp_path / "a", "ns", {"decode-1": "decode"}, "kv-metadata")
    long = MeshCredentials.generate(tmp_path / "b", "ns", {"decode-1": "decode"}, "kv-metadata", request_deadline=7200)
    assert '"expires": "1860s"' in short.nats_config.read_text()
    assert '"expires": "7260s"' in long.nats_config.read_text()


def test_local_mesh_takes_the_window_from_the_services_deadline(tmp_path):
    from kvmesh.infra.local_mesh import LocalMesh, MeshOptions

    mesh = LocalMesh(MeshOptions(env={"KVMESH_REQUEST_DEADLINE": "7200"}), workdir=tmp_path)
    assert mesh._request_deadline() == 7200.0
    bad = LocalMesh(MeshOptions(env={"KVMESH_REQUEST_DEADLINE": "soon"}), workdir=tmp_path)
    with pytest.raises(ValueError, match="KVMESH_REQUEST_DEADLINE"):
        bad._request_deadline()


@pytest.fixture
async def etcd_with_auth(tmp_path):
    server = await asyncio.to_thread(start_etcd, tmp_path, auth_token_ttl=1)
    try:
        users = {"prefill-1": ("pw-1", worker_grants(KEYS, "prefill", "prefill-1"))}
        await asyncio.to_thread(server.enable_auth, "root-pw", users)
        yield server
    finally:
        server.stop()


async def test_an_expired_token_is_renewed_on_the_next_call(etcd_with_auth):
    own = KEYS.worker("prefill", "prefill-1")
    store = EtcdStore([etcd_with_auth.address], timeout=3, credentials=UserPassword("prefill-1", "pw-1"), token_refresh=3600)
    async with store:
        await store.put(own, b"1")
        await asyncio.sleep(3)  # idle past the 1 s token TTL
        await store.put(own, b"2")  # refused once as unauthenticated, then made again
        assert (await store.get(own)).value == b"2"
        with pytest.raises(ClusterError, match="permission denied"):
            await store.put(KEYS.worker("decode", "evil-1"), b"x")
    async with EtcdStore([etcd_with_auth.endpoint]) as root:  # root:password@host:port
        assert [kv.key for kv in (await root.get_prefix(KEYS.root))[0]] == [own]
    assert etcd_with_auth.delete_key(own)  # the supervisor's way, as root


async def test_a_watch_it_may_not_make_fails(etcd_with_auth):
    async with EtcdStore([etcd_with_auth.address], timeout=3, credentials=UserPassword("prefill-1", "pw-1")) as store:
        with pytest.raises(ClusterError, match="cancelled the watch"):
            async for _ in store.watch_prefix(KEYS.blocks()):
                pass


async def test_a_wrong_password_fails_at_connect(etcd_with_auth):
    with pytest.raises(ClusterError, match="authentication as prefill-1 failed"):
        await EtcdStore([etcd_with_auth.address], timeout=3, credentials=UserPassword("prefill-1", "nope")).connect()
