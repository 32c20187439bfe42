"""A worker's heartbeat for one request: a beat every interval, none while token events
already say the request is alive."""

from __future__ import annotations

import asyncio

from kvmesh.protocol import Progress
from kvmesh.worker.heartbeat import Heartbeat


class Recorder:
    """Stands in for the NATS client: what was published where."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, bytes]] = []

    async def publish(self, subject: str, payload: bytes) -> None:
        self.sent.append((subject, payload))


async def test_beats_only_while_nothing_else_was_said():
    nc = Recorder()
    beat = Heartbeat(nc, "stream.r.k.decode", "req-1", "decode-1", interval=0.05, stage="decode", engine_stepping=lambda: True)  # type: ignore[arg-type]
    async with beat:
        for _ in range(12):  # 0.36 s of token events every 0.03 s: each beat would repeat them
            beat.spoke()
            await asyncio.sleep(0.03)
        assert nc.sent == []
        await asyncio.sleep(0.3)  # then silence (a long prefill, a queue): it beats again
    assert len(nc.sent) >= 3
    subject, payload = nc.sent[0]
    assert subject == "stream.r.k.decode"
    assert Progress.model_validate_json(payload) == Progress(request_id="req-1", worker_id="decode-1", stage="decode")


async def test_a_stalled_engine_never_beats():
    nc = Recorder()
    async with Heartbeat(nc, "s", "req-2", "decode-1", interval=0.02, stage="prefill", engine_stepping=lambda: False):  # type: ignore[arg-type]
        await asyncio.sleep(0.15)
    assert nc.sent == []
