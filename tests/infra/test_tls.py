"""TLS on the mesh's servers, on real nats-server and etcd: clients that trust the mesh's CA
get in, plaintext clients and clients trusting another CA are refused, and a service never
sends its NATS password to a server that does not prove it holds the mesh's certificate."""

from __future__ import annotations

import asyncio
import json
import ssl
from pathlib import Path

import nats
import pytest
from cryptography import x509

from kvmesh.cluster.connect import connect_nats
from kvmesh.cluster.etcd_store import ClusterError, EtcdStore, _dns_target
from kvmesh.infra.servers import start_etcd, start_nats
from kvmesh.security.credentials import UserPassword, write_credentials
from kvmesh.security.tls import LOCAL_HOSTS, MeshTLS, client_context
from kvmesh.settings.flags import SettingsParser
from kvmesh.settings.mesh import MeshSettings, add_mesh_args, mesh_settings


@pytest.fixture(scope="module")
def tls(tmp_path_factory) -> MeshTLS:
    return MeshTLS.generate(tmp_path_factory.mktemp("tls"), {"nats": LOCAL_HOSTS, "etcd": LOCAL_HOSTS})


@pytest.fixture(scope="module")
def other_ca(tmp_path_factory) -> Path:
    """A CA of another mesh, with a certificate for the same host names."""
    return MeshTLS.generate(tmp_path_factory.mktemp("other"), {"nats": LOCAL_HOSTS}).ca_file


@pytest.fixture(scope="module")
def nats_tls(tmp_path_factory, tls):
    server = start_nats(tmp_path_factory.mktemp("nats"), tls=tls)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def etcd_tls(tmp_path_factory, tls):
    server = start_etcd(tmp_path_factory.mktemp("etcd"), tls=tls)
    yield server
    server.stop()


def test_certificates_name_the_hosts_and_keys_are_private(tls):
    for name in ("nats", "etcd"):
        cert = x509.load_pem_x509_certificate(tls.server(name).cert_file.read_bytes())
        names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert [str(ip) for ip in names.get_values_for_type(x509.IPAddress)] == ["127.0.0.1"]
        assert names.get_values_for_type(x509.DNSName) == ["localhost"]
        assert tls.server(name).key_file.stat().st_mode & 0o777 == 0o600
    assert not list(tls.ca_file.parent.glob("ca.key"))  # the CA's key is never written
    assert tls.ca_file.parent.stat().st_mode & 0o777 == 0o700


async def test_nats_with_the_mesh_ca_gets_in(nats_tls):
    nc = await nats.connect(nats_tls.address, connect_timeout=5, **nats_tls.connect_options())
    try:
        assert nc.is_connected
        await nc.publish("x", b"y")
        await nc.flush(timeout=5)
    finally:
        await nc.close()


async def test_nats_plaintext_client_is_refused(nats_tls):
    with pytest.raises(nats.errors.Error):
        await nats.connect(nats_tls.address, connect_timeout=3, allow_reconnect=False, max_reconnect_attempts=0)


async def test_nats_client_trusting_another_ca_is_refused(nats_tls, other_ca):
    with pytest.raises(ssl.SSLCertVerificationError):
        await nats.connect(
            nats_tls.address, tls=client_context(other_ca), tls_handshake_first=True,
            connect_timeout=3, allow_reconnect=False, max_reconnect_attempts=0,
        )  # fmt: skip


async def test_etcd_with_the_mesh_ca_gets_in(etcd_tls, tls):
    assert etcd_tls.url.startswith("https://")
    async with EtcdStore([etcd_tls.address], timeout=3, tls_ca=tls.ca_file) as store:
        await store.put("/t/a", b"1")
        assert (await store.get("/t/a")).value == b"1"
    async with EtcdStore([f"https://localhost:{etcd_tls.port}"], timeout=3, tls_ca=tls.ca_file) as store:
        assert (await store.get("/t/a")).value == b"1"


async def test_etcd_with_several_endpoints_over_tls(etcd_tls, tls):
    # One gRPC channel for the list: its name for the certificate check comes from the first.
    async with EtcdStore([etcd_tls.address, f"localhost:{etcd_tls.port}"], timeout=3, tls_ca=tls.ca_file) as store:
        await store.put("/t/b", b"2")
        assert (await store.get("/t/b")).value == b"2"


async def test_etcd_plaintext_client_is_refused(etcd_tls):
    async with EtcdStore([etcd_tls.address], timeout=3) as store:
        with pytest.raises(ClusterError, match="UNAVAILABLE"):
            await store.get("/t/a")


async def test_etcd_client_trusting_another_ca_is_refused(etcd_tls, other_ca):
    async with EtcdStore([etcd_tls.address], timeout=3, tls_ca=other_ca) as store:
        with pytest.raises(ClusterError, match="UNAVAILABLE"):
            await store.get("/t/a")


def test_https_endpoint_without_a_ca_is_refused_at_once():
    with pytest.raises(ClusterError, match="--etcd-tls-ca"):
        EtcdStore(["https://127.0.0.1:2379"])


def test_a_host_name_endpoint_goes_through_the_dns_resolver():
    # etcd3aio's own ``ipv4:`` target cannot take ``etcd:2379`` (the deployment files' endpoint).
    assert _dns_target(["etcd:2379"]) == "dns:///etcd:2379"
    assert _dns_target(["127.0.0.1:2379"]) is None and _dns_target(["localhost:2379"]) is None
    assert _dns_target(["127.0.0.1:2379", "127.0.0.2:2379", "localhost:2379"]) is None


def test_several_endpoints_naming_hosts_are_refused_at_once_with_the_way_out():
    """gRPC's one channel takes one DNS name: a list of names used to fail at the first call."""
    with pytest.raises(ClusterError, match=r"\(not etcd-0:2379, etcd-1:2379\); give one name"):
        EtcdStore(["etcd-0:2379", "etcd-1:2379"])


async def test_no_password_goes_to_a_server_that_skips_tls(tmp_path, tls):
    """Someone who took the NATS port (say while nats-server restarts) and says "no TLS
    needed" gets the TLS handshake, never the CONNECT with the password."""
    received = bytearray()

    async def impostor(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        info = {"server_id": "x", "version": "2.15.1", "max_payload": 1048576, "auth_required": True, "tls_required": False}
        writer.write(b"INFO " + json.dumps(info).encode() + b"\r\n")
        await writer.drain()
        try:
            while data := await asyncio.wait_for(reader.read(4096), 3):
                received.extend(data)
        except (TimeoutError, ConnectionError):
            pass
        writer.close()

    server = await asyncio.start_server(impostor, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    secret = "s3cret-password-of-the-router"
    creds = write_credentials(tmp_path / "router.json", nats=UserPassword("router", secret))
    mesh = MeshSettings(
        f"nats://127.0.0.1:{port}", ("127.0.0.1:1",), request_timeout=2, nats_credentials=str(creds), nats_tls_ca=str(tls.ca_file)
    )
    try:
        with pytest.raises(Exception):  # noqa: B017  # whatever nats-py raises, it must not get in
            nc = await asyncio.wait_for(connect_nats(mesh, "test"), 5)  # gives up after request_timeout
            await nc.close()
    finally:
        server.close()
        await server.wait_closed()
    assert received, "the client said nothing"
    assert secret.encode() not in received and b"CONNECT" not in received
    assert received[0] == 0x16  # a TLS handshake record


def test_require_tls_refuses_a_service_without_cas_or_credentials(tmp_path, tls, capsys):
    parser = SettingsParser(prog="svc")
    add_mesh_args(parser)
    base = ["--nats-url", "nats://127.0.0.1:1", "--etcd", "127.0.0.1:2", "--require-tls"]
    with pytest.raises(SystemExit) as exit_info:
        mesh_settings(parser.parse_args(base + ["--nats-tls-ca", str(tls.ca_file)]), parser)
    assert exit_info.value.code == 2
    assert "--etcd-tls-ca, --nats-credentials, --etcd-credentials missing" in capsys.readouterr().err
    creds = write_credentials(tmp_path / "c.json", nats=UserPassword("a", "b"), etcd=UserPassword("a", "c"))
    full = base + ["--nats-tls-ca", str(tls.ca_file), "--etcd-tls-ca", str(tls.ca_file)]
    full += ["--nats-credentials", str(creds), "--etcd-credentials", str(creds)]
    settings = mesh_settings(parser.parse_args(full), parser)
    assert settings.nats_tls_ca == settings.etcd_tls_ca == str(tls.ca_file)
    (tmp_path / "junk.pem").write_text("not a certificate\n")
    with pytest.raises(SystemExit):
        mesh_settings(parser.parse_args(base[:-1] + ["--etcd-tls-ca", str(tmp_path / "junk.pem")]), parser)


@pytest.fixture
def own_etcd_tls(tmp_path, tls):
    server = start_etcd(tmp_path / "etcd", tls=tls)
    yield server
    server.stop()


async def test_etcd_auth_job_runs_again_with_new_passwords(tmp_path, own_etcd_tls, tls):
    """The deployment's etcd-auth job on a fresh etcd, then again after the passwords were
    made anew (as after a second ``kvmesh credentials``): the new ones work, the old do not."""
    from kvmesh.infra import etcd_auth
    from kvmesh.security.etcd_roles import Grant

    users_file = tmp_path / "etcd-users.json"
    grants = (Grant("/kvmesh/default/workers/", "READ", prefix=True),)
    etcd_auth.write_users(users_file, "root-1", {"router": ("old-pw", grants)})
    await asyncio.to_thread(etcd_auth.run, [own_etcd_tls.address], users_file, tls_ca=str(tls.ca_file), wait=5)
    etcd_auth.write_users(users_file, "root-1", {"router": ("new-pw", grants)})
    await asyncio.to_thread(etcd_auth.run, [own_etcd_tls.address], users_file, tls_ca=str(tls.ca_file), wait=5)
    async with EtcdStore([own_etcd_tls.address], timeout=3, tls_ca=tls.ca_file, credentials=UserPassword("router", "new-pw")) as store:
        assert (await store.get_prefix("/kvmesh/default/workers/"))[0] == []
        with pytest.raises(ClusterError, match="permission denied"):
            await store.put("/kvmesh/default/workers/decode/evil", b"{}")
    with pytest.raises(ClusterError, match="authentication failed"):
        await EtcdStore([own_etcd_tls.address], timeout=3, tls_ca=tls.ca_file, credentials=UserPassword("router", "old-pw")).connect()


async def test_etcd_auth_job_run_again_revokes_what_the_file_no_longer_says(tmp_path, own_etcd_tls, tls):
    """A second deploy with fewer workers and narrower grants: the user no longer named cannot
    log in, and a grant no longer listed no longer works."""
    from kvmesh.infra import etcd_auth
    from kvmesh.security.etcd_roles import Grant

    users_file = tmp_path / "etcd-users.json"
    workers = Grant("/kvmesh/default/workers/", "READ", prefix=True)
    pins = Grant("/kvmesh/default/pins/", "READWRITE", prefix=True)
    etcd_auth.write_users(users_file, "root-1", {"router": ("pw", (workers, pins)), "decode-9": ("pw-9", (pins,))})
    await asyncio.to_thread(etcd_auth.run, [own_etcd_tls.address], users_file, tls_ca=str(tls.ca_file), wait=5)
    async with EtcdStore([own_etcd_tls.address], timeout=3, tls_ca=tls.ca_file, credentials=UserPassword("router", "pw")) as store:
        await store.put("/kvmesh/default/pins/p", b"1")  # granted for now
    etcd_auth.write_users(users_file, "root-1", {"router": ("pw", (workers,))})
    await asyncio.to_thread(etcd_auth.run, [own_etcd_tls.address], users_file, tls_ca=str(tls.ca_file), wait=5)
    async with EtcdStore([own_etcd_tls.address], timeout=3, tls_ca=tls.ca_file, credentials=UserPassword("router", "pw")) as store:
        assert (await store.get_prefix("/kvmesh/default/workers/"))[0] == []
        with pytest.raises(ClusterError, match="permission denied"):
            await store.put("/kvmesh/default/pins/p", b"2")
    with pytest.raises(ClusterError, match="authentication failed"):
        await EtcdStore([own_etcd_tls.address], timeout=3, tls_ca=tls.ca_file, credentials=UserPassword("decode-9", "pw-9")).connect()
