"""Identity slots against a real etcd with auth on: claimants that race get different
identities, a slot is held while its holder lives and free once it stops or dies, and no
identity may write another's slot key."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from kvmesh.cluster.etcd_store import ClusterError, EtcdStore
from kvmesh.cluster.identity_slots import IdentitySlot, SlotError, slot_files
from kvmesh.infra.credentials import MeshCredentials
from kvmesh.infra.servers import start_etcd
from kvmesh.protocol import Keys
from kvmesh.security.credentials import load_credentials
from kvmesh.settings.mesh import MeshSettings
from kvmesh.settings.worker import WorkerSettings, worker_settings

NAMESPACE = "slots"
KEYS = Keys(NAMESPACE)
DECODE = [f"decode-worker-{i}" for i in range(3)]


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    """etcd with auth on and the users ``kvmesh credentials`` makes for one prefill and three decode identities."""
    workdir = tmp_path_factory.mktemp("slots")
    workers = {"prefill-worker-0": "prefill", **dict.fromkeys(DECODE, "decode")}
    creds = MeshCredentials.generate(workdir / "auth", NAMESPACE, workers, "kv-metadata")
    server = start_etcd(workdir)
    try:
        server.enable_auth("root-pw", creds.etcd_users)
        yield server, creds
    finally:
        server.stop()


def settings_of(server, creds, *, ttl: int = 2, role: str = "decode") -> WorkerSettings:
    mesh_settings = MeshSettings(
        nats_url="nats://127.0.0.1:1", etcd_endpoints=(server.address,), namespace=NAMESPACE, request_timeout=3
    )
    files = tuple(str(p) for p in slot_files(str(creds.directory), role))
    return WorkerSettings(role=role, mesh=mesh_settings, lease_ttl=ttl, identity_slots=files)  # type: ignore[arg-type]


async def kept(settings: WorkerSettings) -> IdentitySlot:
    """A claim kept alive, as a live worker keeps its own."""
    slot = await IdentitySlot.claim(settings)
    slot.keep(on_lost=lambda: None)
    return slot


async def held_slots(server) -> list[str]:
    async with EtcdStore([server.endpoint], timeout=3) as root:
        return [kv.key.rsplit("/", 1)[1] for kv in (await root.get_prefix(KEYS.root + "slots/decode/"))[0]]


async def test_racing_claimants_get_different_identities_and_one_too_many_gets_none(mesh):
    server, creds = mesh
    settings = settings_of(server, creds)
    claims = await asyncio.gather(*(kept(settings) for _ in range(3)), return_exceptions=True)
    try:
        assert sorted(c.identity for c in claims if isinstance(c, IdentitySlot)) == DECODE
        assert sorted(await held_slots(server)) == DECODE
        with pytest.raises(SlotError, match=r"no free identity slot for this decode worker: 3 of 3 held by live workers"):
            await IdentitySlot.claim(settings)
        claimed = next(c for c in claims if isinstance(c, IdentitySlot) and c.identity == "decode-worker-1")
        runs_as = claimed.settings(settings)  # the worker's id and both credentials are the identity's
        assert runs_as.worker_id == "decode-worker-1"
        assert runs_as.mesh.nats_credentials == runs_as.mesh.etcd_credentials == str(creds.file_of("decode-worker-1"))
        await claimed.release()  # a clean stop frees the slot at once
        again = await kept(settings)
        assert again.identity == "decode-worker-1"
        claims = [c for c in claims if c is not claimed] + [again]
    finally:
        for claim in claims:
            if isinstance(claim, IdentitySlot):
                await claim.release()
    assert await held_slots(server) == []


async def test_a_dead_holders_slot_is_free_after_its_lease_and_a_live_record_keeps_it_taken(mesh):
    server, creds = mesh
    settings = settings_of(server, creds)
    first = await IdentitySlot.claim(settings)
    assert first.identity == "decode-worker-0"
    await first.store.close()  # dies: nobody refreshes or revokes the lease
    second = await kept(settings)
    assert second.identity == "decode-worker-1"  # -0 is still held
    started = time.monotonic()
    async with EtcdStore([server.endpoint], timeout=3) as root:  # a worker record of -0 outlives its slot
        lease = await root.grant(30)
        await root.put(KEYS.worker("decode", "decode-worker-0"), b"{}", lease=lease)
        while "decode-worker-0" in await held_slots(server):
            await asyncio.sleep(0.2)
        assert time.monotonic() - started < 2 + 2  # within the TTL (and etcd's rounding)
        third = await kept(settings)
        assert third.identity == "decode-worker-2"  # -0's record says a worker still runs as it
        await root.revoke(lease)
    fourth = await kept(settings)
    assert fourth.identity == "decode-worker-0"
    for claim in (second, third, fourth):
        await claim.release()


async def test_an_identity_may_write_only_its_own_slot(mesh):
    server, creds = mesh
    own = load_credentials(creds.file_of("decode-worker-0"), "etcd")
    async with EtcdStore([server.address], timeout=3, credentials=own) as store:
        for other in (KEYS.slot("decode", "decode-worker-1"), KEYS.slot("prefill", "prefill-worker-0"), KEYS.slot("decode", "x")):
            with pytest.raises(ClusterError, match="permission denied"):
                await store.create(other, b"{}")
            with pytest.raises(ClusterError, match="permission denied"):
                await store.put(other, b"{}")
        assert await store.create(KEYS.slot("decode", "decode-worker-0"), b"{}")
        assert not await store.create(KEYS.slot("decode", "decode-worker-0"), b"{}")  # once only
        assert await store.delete(KEYS.slot("decode", "decode-worker-0"))
    # An identity etcd does not know (or a wrong password) is refused, never claimed.
    settings = settings_of(server, creds)
    bad = creds.directory / "decode-worker-9.json"
    bad.write_text(
        json.dumps({"nats": {"user": "decode-worker-9", "password": "x"}, "etcd": {"user": "decode-worker-9", "password": "x"}})
    )
    bad.chmod(0o600)
    try:
        with pytest.raises(
            SlotError, match=r"0 of 1 held.*refused: decode-worker-9 \(etcd authentication as decode-worker-9 failed"
        ):
            await IdentitySlot.claim(WorkerSettings(role="decode", mesh=settings.mesh, identity_slots=(str(bad),)))
    finally:
        bad.unlink()


async def test_a_holder_cut_off_past_its_lease_claims_again_or_stops_if_taken(mesh):
    server, creds = mesh
    settings = settings_of(server, creds)
    key = KEYS.slot("decode", "decode-worker-0")
    lost = asyncio.Event()
    slot = await IdentitySlot.claim(settings)
    slot.keep(on_lost=lost.set)
    async with EtcdStore([server.endpoint], timeout=3) as root:
        first = slot.lease_id
        await root.revoke(first)  # as if etcd forgot the lease: the slot is free, and still its
        for _ in range(50):
            kv = await root.get(key)
            if kv is not None and kv.lease != first:
                break
            await asyncio.sleep(0.1)
        assert kv is not None and kv.lease == slot.lease_id != first and not lost.is_set()
        await root.revoke(slot.lease_id)
        other = await IdentitySlot.claim(settings)  # this time another replica takes it first
    assert other.identity == "decode-worker-0"
    await asyncio.wait_for(lost.wait(), 5)
    await slot.release()
    await other.release()


def test_the_worker_flag_takes_a_folder_of_its_roles_files_or_a_list(tmp_path, monkeypatch):
    folder = tmp_path / "secrets"
    creds = MeshCredentials.generate(
        folder, "ns", {f"decode-worker-{i}": "decode" for i in (0, 2, 10)} | {"prefill-worker-0": "prefill"}, "kv-metadata"
    )
    (folder / "ca.crt").write_text("x")
    assert [p.name for p in slot_files(str(folder), "decode")] == [
        "decode-worker-0.json",
        "decode-worker-2.json",
        "decode-worker-10.json",
    ]
    listed = f"{creds.file_of('decode-worker-2')},{creds.file_of('decode-worker-0')}"
    assert [p.name for p in slot_files(listed, "decode")] == ["decode-worker-0.json", "decode-worker-2.json"]
    with pytest.raises(SlotError, match="no decode-x-.*json credentials files"):
        slot_files(str(folder), "decode-x")
    with pytest.raises(SlotError, match="no credentials file at .*nope.json"):
        slot_files(f"{folder}/nope.json", "decode")
    monkeypatch.setenv("KVMESH_IDENTITY_SLOTS", str(folder))
    base = ["--nats-url", "nats://127.0.0.1:1", "--etcd", "127.0.0.1:2"]
    settings = worker_settings("decode", base)
    assert [p.rsplit("/", 1)[1] for p in settings.identity_slots] == [
        "decode-worker-0.json",
        "decode-worker-2.json",
        "decode-worker-10.json",
    ]
    with pytest.raises(SystemExit):  # the slot gives the id and credentials
        worker_settings("decode", [*base, "--worker-id", "decode-worker-0"])


async def test_etcd_auth_run_again_lets_identities_made_before_slots_claim_theirs(tmp_path):
    """A deployment's identities from before identity slots: the etcd-auth job, run again with
    the new users file, grants each its slot key (and still no other's)."""
    from kvmesh.infra import etcd_auth
    from kvmesh.security.credentials import UserPassword
    from kvmesh.security.etcd_roles import worker_grants

    server = await asyncio.to_thread(start_etcd, tmp_path)
    users_file, own, other = tmp_path / "etcd-users.json", KEYS.slot("decode", "decode-worker-0"), KEYS.slot("decode", "d-1")
    grants = worker_grants(KEYS, "decode", "decode-worker-0")
    try:
        etcd_auth.write_users(
            users_file, "root-pw", {"decode-worker-0": ("pw", tuple(g for g in grants if "/slots/" not in g.key))}
        )
        await asyncio.to_thread(etcd_auth.run, [server.address], users_file, tls_ca=None, wait=5)
        user = UserPassword("decode-worker-0", "pw")
        async with EtcdStore([server.address], timeout=3, credentials=user) as store:
            with pytest.raises(ClusterError, match="permission denied"):
                await store.create(own, b"{}")
        etcd_auth.write_users(users_file, "root-pw", {"decode-worker-0": ("pw", grants)})
        await asyncio.to_thread(etcd_auth.run, [server.address], users_file, tls_ca=None, wait=5)
        async with EtcdStore([server.address], timeout=3, credentials=user) as store:
            assert await store.create(own, b"{}")
            with pytest.raises(ClusterError, match="permission denied"):
                await store.create(other, b"{}")
    finally:
        server.stop()


async def test_a_worker_whose_start_fails_after_its_claim_frees_the_identity_at_once(mesh, tmp_path, monkeypatch):
    """A claim followed by a start that fails (here: no model at the path given) used to hold
    the identity until its lease ran out; the worker's main now frees it before it exits."""
    from kvmesh.services.decode_worker import main as decode_main
    from kvmesh.transfer import bind_guard

    server, creds = mesh
    monkeypatch.setattr(bind_guard, "enforce", lambda *args, **kwargs: "off")  # no re-exec, no preload variables
    argv = [
        "--nats-url", "nats://127.0.0.1:1", "--etcd", server.address, "--namespace", NAMESPACE,
        "--identity-slots", str(creds.directory), "--lease-ttl", "30", "--model", str(tmp_path / "no-model"),
    ]  # fmt: skip
    with pytest.raises(Exception):  # noqa: B017 - whatever the engine raises for a missing model
        await decode_main.main(argv)
    assert await held_slots(server) == []  # freed now, not in 30 s
