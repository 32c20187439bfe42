"""How the router waits on workers for one attempt: events in order, and an attempt ended
(for a retry elsewhere) when its worker leaves, goes silent, or an event is lost; the
request's own deadline bounds it all."""

from __future__ import annotations

import asyncio

import pytest

import kvmesh.services.router.attempts as attempts
from kvmesh.errors import ErrorCode, MeshError
from kvmesh.protocol import TokenEvent
from kvmesh.services.router.attempts import Attempt, Retry, WorkerGone, events_in_order
from kvmesh.settings.mesh import MeshSettings


def mesh(**settings) -> MeshSettings:
    return MeshSettings("nats://127.0.0.1:1", ("127.0.0.1:1",), **settings)


def attempt(deadline_in: float = 60.0) -> Attempt:
    return Attempt("a-0", "decode-1", "prefill-1", asyncio.get_running_loop().time() + deadline_in, stage="decode")


def event(seq: int, *, finished: bool = False) -> TokenEvent:
    return TokenEvent(request_id="a-0", seq=seq, token_ids=[seq], finished=finished)


async def test_events_come_out_in_order():
    a = attempt()
    for seq in (1, 0, 3, 2):
        a.events.put_nowait(event(seq, finished=seq == 3))
    seqs = [e.seq async for e in events_in_order(a, mesh())]
    assert seqs == [0, 1, 2, 3]


async def test_a_lost_event_ends_the_attempt_instead_of_hanging(monkeypatch):
    monkeypatch.setattr(attempts, "LOST_EVENT_TIMEOUT", 0.2)
    a = attempt()
    a.events.put_nowait(event(0))
    a.events.put_nowait(event(2))  # 1 never comes
    events = events_in_order(a, mesh())
    assert (await anext(events)).seq == 0
    with pytest.raises(Retry, match="token event 1 from decode-1 was lost") as retry:
        await asyncio.wait_for(anext(events), 2)
    assert retry.value.exclude is False  # the worker is fine; the message was lost


async def test_the_worker_leaving_ends_the_attempt_at_once():
    a = attempt()
    a.events.put_nowait(WorkerGone("prefill-1"))  # not waited on any more: ignored
    a.events.put_nowait(WorkerGone("decode-1"))
    with pytest.raises(Retry, match="worker decode-1 is gone") as retry:
        await asyncio.wait_for(anext(events_in_order(a, mesh())), 1)
    assert retry.value.bad_worker == "decode-1" and retry.value.exclude


async def test_silence_ends_the_attempt_and_heartbeats_keep_it():
    settings = mesh(silence_timeout=0.4, heartbeat_interval=0.1)
    a = attempt()

    async def beat() -> None:
        for _ in range(6):  # 0.6 s of heartbeats: longer than the silence timeout
            await asyncio.sleep(0.1)
            a.heard()

    beating = asyncio.create_task(beat())
    started = asyncio.get_running_loop().time()
    with pytest.raises(Retry, match="no word from decode-1"):
        await asyncio.wait_for(anext(events_in_order(a, settings)), 5)
    waited = asyncio.get_running_loop().time() - started
    assert waited >= 0.6 + 0.3  # kept alive while it beat, given up on soon after
    await beating


async def test_the_deadline_is_the_requests_own():
    a = attempt(deadline_in=0.2)
    with pytest.raises(MeshError) as err:
        await asyncio.wait_for(anext(events_in_order(a, mesh())), 2)
    assert err.value.code is ErrorCode.TIMEOUT


async def test_events_already_queued_are_taken_however_late_the_consumer_asks():
    """A slow client: the worker finished (no more heartbeats) long before the router's
    generator asks for the rest; what has arrived is still delivered, not retried."""
    settings = mesh(silence_timeout=0.2, heartbeat_interval=0.1)
    a = attempt()
    for seq in range(3):
        a.events.put_nowait(event(seq, finished=seq == 2))
    a.last_heard -= 10  # silent for far longer than the timeout
    assert [e.seq async for e in events_in_order(a, settings)] == [0, 1, 2]


async def test_a_duplicate_event_is_ignored(monkeypatch):
    monkeypatch.setattr(attempts, "LOST_EVENT_TIMEOUT", 0.2)
    a = attempt()
    for seq in (0, 0, 1):
        a.events.put_nowait(event(seq, finished=seq == 1))
    assert [e.seq async for e in events_in_order(a, mesh())] == [0, 1]


async def test_a_retry_names_the_incarnation_it_gave_up_on():
    a = attempt()
    a.incarnations["decode-1"] = 42.0
    a.events.put_nowait(WorkerGone("decode-1"))
    with pytest.raises(Retry) as retry:
        await anext(events_in_order(a, mesh()))
    assert retry.value.incarnation == 42.0


async def test_an_event_is_taken_on_the_loops_next_turn():
    """The waiting generator is woken by the event itself, not through a task of its own
    (``asyncio.wait_for`` took three turns of the loop: the first token was later by them)."""
    a = attempt()
    events = events_in_order(a, mesh())
    taken = asyncio.ensure_future(anext(events))
    for _ in range(3):
        await asyncio.sleep(0)
    assert not taken.done()  # waiting
    a.events.put_nowait(event(0))
    await asyncio.sleep(0)  # one turn
    assert taken.done() and taken.result().seq == 0
    await events.aclose()
