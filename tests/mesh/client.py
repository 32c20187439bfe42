"""Small HTTP and NATS helpers for the end-to-end tests."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import nats

from kvmesh.protocol import STREAM_MESSAGE, Message, Progress, Subjects, TokenEvent, WorkerStats


async def post(base_url: str, path: str, body: dict, timeout: float = 120.0) -> httpx.Response:
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout) as client:
        return await client.post(path, json=body)


async def stream(
    base_url: str,
    path: str,
    body: dict,
    timeout: float = 120.0,
    *,
    on_event: Callable[[list[dict]], Awaitable[None]] | None = None,
    leave_after: int | None = None,
) -> list[dict]:
    """The JSON objects of an SSE response, in order, up to ``[DONE]`` (which must come).
    ``on_event(events so far)`` runs after each one; with ``leave_after`` the client goes
    away after that many events instead."""
    events: list[dict] = []
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout) as client:
        async with client.stream("POST", path, json={**body, "stream": True}) as response:
            assert response.status_code == 200, await response.aread()
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: ") :]
                if data == "[DONE]":
                    return events
                events.append(json.loads(data))
                if on_event is not None:
                    await on_event(events)
                if leave_after is not None and len(events) >= leave_after:
                    return events
    raise AssertionError(f"the stream ended without [DONE] after {len(events)} events")


def streamed_text(events: list[dict]) -> str:
    parts = []
    for event in events:
        for choice in event.get("choices", []):
            parts.append(choice.get("text") or (choice.get("delta") or {}).get("content") or "")
    return "".join(parts)


async def worker_stats(nats_url: str, namespace: str, worker_id: str, **connect_options: Any) -> WorkerStats:
    """``connect_options``: what a TLS server needs (``NatsServer.connect_options()``)."""
    nc = await nats.connect(nats_url, connect_timeout=5, **connect_options)
    try:
        reply = await nc.request(Subjects(namespace).stats(worker_id), b"", timeout=5)
        return WorkerStats.decode(reply.data)
    finally:
        await nc.close()


async def send_work(nc: nats.NATS, subject: str, payload: bytes, reply: str, *, timeout: float = 30.0) -> list[Message]:
    """Send work as a router does (answers on ``reply``) and collect what comes back,
    progress left out, up to a prefill response or a decode stream's last token event."""
    subscription = await nc.subscribe(reply)
    try:
        await nc.publish(subject, payload, reply=reply)
        answers: list[Message] = []
        while True:
            message = STREAM_MESSAGE.validate_json((await subscription.next_msg(timeout=timeout)).data)
            if isinstance(message, Progress):
                continue
            answers.append(message)
            if message.kind == "prefill" or (isinstance(message, TokenEvent) and message.finished):
                return answers
            if message.kind == "ack" and not message.accepted:  # type: ignore[attr-defined]
                return answers
    finally:
        await subscription.unsubscribe()
