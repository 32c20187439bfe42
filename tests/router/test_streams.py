"""What the router takes from its stream subjects: on each phase only what that phase
carries, for that attempt; progress is heard, not queued; NATS's 503 is "nobody took it"."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from kvmesh.protocol import DecodeAck, PrefillResponse, Progress, Subjects, TokenEvent
from kvmesh.services.router.attempts import Attempt, NoResponders
from kvmesh.services.router.streams import Streams, new_key

S = Subjects("default")


def msg(attempt: Attempt, phase: str, message=None, headers=None) -> SimpleNamespace:
    data = message.encode() if message is not None else b""
    return SimpleNamespace(subject=S.stream("r1", attempt.key, phase), data=data, headers=headers)  # type: ignore[arg-type]


def queued(attempt: Attempt) -> list:
    items = []
    while not attempt.events.empty():
        items.append(attempt.events.get_nowait())
    return items


async def test_each_phase_takes_only_its_own_messages_for_its_own_attempt():
    attempt = Attempt("a-0", "decode-1", "prefill-1", asyncio.get_running_loop().time() + 60, key=new_key())
    other = Attempt("b-0", "decode-1", None, asyncio.get_running_loop().time() + 60, key=new_key())
    streams = Streams()
    streams.open(attempt)
    token = TokenEvent(request_id="a-0", seq=0, token_ids=[5])
    ack = DecodeAck(request_id="a-0", accepted=True)
    prefill = PrefillResponse(request_id="a-0", first_token_id=5)
    for m in (
        msg(attempt, "prefill", token),  # a token event on the prefill's stream: no
        msg(attempt, "decode", prefill),  # a prefill answer on the decode's stream: no
        msg(attempt, "decode", TokenEvent(request_id="b-0", seq=0)),  # another attempt's id: no
        msg(other, "decode", token),  # a stream not open here: no
        SimpleNamespace(subject=msg(attempt, "decode").subject, data=b'{"block_ids": []}', headers=None),  # not a stream message
    ):
        await streams.handle(m)
    assert queued(attempt) == []
    before = attempt.last_heard
    await asyncio.sleep(0.01)
    await streams.handle(msg(attempt, "prefill", Progress(request_id="a-0", worker_id="prefill-1", stage="prefill")))
    assert attempt.last_heard > before and queued(attempt) == []  # heard, nothing to queue
    for m in (msg(attempt, "prefill", prefill), msg(attempt, "decode", ack), msg(attempt, "decode", token)):
        await streams.handle(m)
    await streams.handle(msg(attempt, "decode", headers={"Status": "503"}))
    assert queued(attempt) == [prefill, ack, token, NoResponders("decode")]
    streams.close(attempt)
    await streams.handle(msg(attempt, "decode", token))
    assert queued(attempt) == []
