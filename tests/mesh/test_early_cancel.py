"""A cancel that reaches a worker before its engine has the request (issue #8's review):
one while the decode worker waits to pull (here its pull is delayed 3 s) stops the request
there, its blocks given back and the prefill's pin released, instead of decoding 300
tokens for nobody; one that comes before or while a prefill borrows a peer's prefix leaves
no pin until the TTL, on either worker."""

from __future__ import annotations

import asyncio
import time

import nats
import pytest

from kvmesh.protocol import STREAM_MESSAGE, CancelRequest, PeerPrefix, PrefillRequest, PrefillResponse, ReleaseRequest, SamplingSpec, Subjects
from tests.mesh.client import post, send_work
from tests.mesh.meshes import MODEL, assert_pools_at_baseline, make_mesh

pytestmark = pytest.mark.slow

S = Subjects("default")
PULL_DELAY = 3.0


@pytest.fixture(scope="module")
def mesh(tmp_path_factory, default_model_dir):
    # pin_ttl 30: a pin left behind would outlive every wait below.
    mesh = make_mesh(
        tmp_path_factory.mktemp("cancel"), default_model_dir, prefill=2, decode=1, pin_ttl=30,
        env={"KVMESH_FAULT_PULL_DELAY": str(PULL_DELAY), "KVMESH_PIN_WRITE_DELAY": "0"},  # pins in etcd at once: a test deletes one
    )  # fmt: skip
    try:
        yield mesh
    finally:
        mesh.stop()


async def test_a_cancel_while_the_decode_worker_waits_to_pull_stops_the_request(mesh):
    """Once the decode worker has acknowledged the work (an admin spy on the streams sees
    the ack) it waits 3 s before the pull; the router's cancel comes then (sent here as
    the router does: when a client leaves, tests/mesh/test_faults.py)."""
    body = {"model": MODEL, "prompt": "The rivers of Europe, from west to east:", "max_tokens": 300,
            "temperature": 0, "ignore_eos": True}  # fmt: skip
    admin = await nats.connect(mesh.nats.url, connect_timeout=5)
    acked: asyncio.Queue[str] = asyncio.Queue()

    async def spy(msg) -> None:
        if msg.subject.endswith(".decode"):
            acked.put_nowait(STREAM_MESSAGE.validate_json(msg.data).request_id)

    await admin.subscribe(f"{S.root}.stream.>", cb=spy)
    try:
        await asyncio.sleep(0.2)  # the spy's subscription reaches the server
        client = asyncio.create_task(post(mesh.base_url, "/v1/completions", body))
        attempt_id = await asyncio.wait_for(acked.get(), 30)
        await admin.publish(S.cancel, CancelRequest(request_id=attempt_id).encode())
        cancelled = time.monotonic()
        response = await asyncio.wait_for(client, 30)
        assert response.status_code == 499, response.text  # cancelled, not decoded for nobody
    finally:
        await admin.close()
    decode = mesh.workers["decode-3"]
    assert f"request {attempt_id} failed: cancelled before decoding started" in decode.tail(50)
    assert time.monotonic() < cancelled + PULL_DELAY + 2
    await assert_pools_at_baseline(mesh, ["prefill-1", "prefill-2", "decode-3"])


async def test_a_cancel_before_or_during_a_peer_borrow_leaves_no_pin(mesh):
    nc = await nats.connect(mesh.nats.url, connect_timeout=5)
    try:
        prompt = list(range(1000, 1100))  # 6 full blocks for prefill-2 to lend
        sampling = SamplingSpec(max_tokens=4)
        warm = PrefillRequest(request_id="warm-1", prompt_token_ids=prompt, sampling=sampling)
        [held] = await send_work(nc, S.prefill("prefill-2"), warm.encode(), S.stream("test", "warm", "prefill"))
        assert isinstance(held, PrefillResponse) and held.kv is not None
        await nc.publish(S.release("prefill-2"), ReleaseRequest(request_id="warm-1", pin_token=held.kv.pin_token).encode())
        for number in range(3):
            rid = f"borrow-{number}"
            request = PrefillRequest(request_id=rid, prompt_token_ids=prompt, sampling=sampling, peer=PeerPrefix(worker_id="prefill-2", num_blocks=6))
            reply = S.stream("test", rid, "prefill")
            answer = asyncio.create_task(send_work(nc, S.prefill("prefill-1"), request.encode(), reply))
            await asyncio.sleep(0.01 * number)  # before it arrives, as it arrives, while it borrows
            await nc.publish(S.cancel, CancelRequest(request_id=rid).encode())
            [response] = await answer
            assert isinstance(response, PrefillResponse)
            if response.error is None and number > 0:
                # A borrow quicker than the sleep finished before the cancel came (the next test
                # cancels deterministically during one): the router releases such a pin itself.
                assert response.kv is not None, response
                await nc.publish(S.release("prefill-1"), ReleaseRequest(request_id=rid, pin_token=response.kv.pin_token).encode())
                continue
            assert response.error is not None and response.error.code == "cancelled", response
        await assert_pools_at_baseline(mesh, ["prefill-1", "prefill-2"])
    finally:
        await nc.close()


async def test_a_cancel_while_the_peer_is_asked_to_lend_stops_the_prefill(mesh):
    """Deterministically during the borrow: the "peer" is this test, which sends the
    router's cancel when the lend request reaches it and only then answers (refusing)."""
    nc = await nats.connect(mesh.nats.url, connect_timeout=5)
    try:
        prompt = list(range(2000, 2100))

        async def lender(msg) -> None:
            await nc.publish(S.cancel, CancelRequest(request_id="ghost-borrow").encode())
            await nc.flush()
            await asyncio.sleep(0.3)  # the cancel is handled while the borrower waits
            await msg.respond(b"{}")  # not a lend reply: the borrower computes instead

        await nc.subscribe(S.kv_lend("ghost", "prefill-1"), cb=lender)
        await nc.flush()
        request = PrefillRequest(request_id="ghost-borrow", prompt_token_ids=prompt, sampling=SamplingSpec(max_tokens=4),
                                 peer=PeerPrefix(worker_id="ghost", num_blocks=6))  # fmt: skip
        [response] = await send_work(nc, S.prefill("prefill-1"), request.encode(), S.stream("test", "ghost", "prefill"))
        assert isinstance(response, PrefillResponse)
        assert response.error is not None and response.error.code == "cancelled", response
        await assert_pools_at_baseline(mesh, ["prefill-1"])
    finally:
        await nc.close()


async def test_a_prefix_whose_loan_expired_during_the_pull_is_not_used(mesh):
    """The borrower's pull waits 3 s (the fault delay); meanwhile the loan's pin goes (its
    etcd key deleted, as a lease that ran out). The lender may have reused those blocks, so the
    borrower, hearing that the pin was gone, drops what it read and computes the prefix:
    nothing borrowed counts as cached, nothing of it is kept, and the answer is the one
    computed without a peer."""
    from kvmesh.cluster.etcd_store import EtcdStore
    from kvmesh.protocol import Keys

    nc = await nats.connect(mesh.nats.url, connect_timeout=5, **mesh.nats.connect_options())
    try:
        prompt = list(range(3000, 3100))  # 6 full blocks for prefill-2 to lend
        sampling = SamplingSpec(max_tokens=4)

        async def prefill(worker: str, rid: str, peer: PeerPrefix | None = None) -> PrefillResponse:
            request = PrefillRequest(request_id=rid, prompt_token_ids=prompt, sampling=sampling, peer=peer)
            [answer] = await send_work(nc, S.prefill(worker), request.encode(), S.stream("test", rid, "prefill"))
            assert isinstance(answer, PrefillResponse) and answer.error is None and answer.kv is not None, answer
            await nc.publish(S.release(worker), ReleaseRequest(request_id=rid, pin_token=answer.kv.pin_token).encode())
            return answer

        lent = await prefill("prefill-2", "lender-warm")
        async with EtcdStore([mesh.etcd.endpoint], **mesh.etcd.store_options()) as store:
            borrowing = asyncio.create_task(prefill("prefill-1", "late-borrow", PeerPrefix(worker_id="prefill-2", num_blocks=6)))
            loan_key = Keys("default").pin("prefill-2", "lend:prefill-1:late-borrow")
            for _ in range(50):  # written beside the lend reply; the pull waits 3 s after it
                if await store.get(loan_key) is not None:
                    break
                await asyncio.sleep(0.05)
            assert await store.delete(loan_key)
            borrowed = await asyncio.wait_for(borrowing, 30)
        assert borrowed.num_cached_tokens == 0  # computed here, not taken from the expired loan
        assert borrowed.first_token_id == lent.first_token_id
        assert "pin of lend:prefill-1:late-borrow released: lease expired" in mesh.workers["prefill-2"].tail(200)
        assert "not using the prefix pulled from prefill-2 for late-borrow (the pin was gone" in mesh.workers["prefill-1"].tail(200)
        await assert_pools_at_baseline(mesh, ["prefill-1", "prefill-2"])
    finally:
        await nc.close()
