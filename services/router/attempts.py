"""One attempt of a request, as the router waits on it: everything it waits for (token
events, the prefill reply, word that a worker left) arrives in one queue, and the attempt is
given up on (for a retry elsewhere) when the worker it waits on leaves the directory, goes
silent (no event, no heartbeat) for the silence timeout, or loses an event; the request's
own deadline bounds it all."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from kvmesh.errors import ErrorCode, MeshError, is_retryable
from kvmesh.protocol import DecodeAck, TokenEvent
from kvmesh.settings.mesh import MeshSettings

OVERLOADED_BACKOFF = 0.25  # seconds before retrying a request a worker had no room for
DRAINED_GRACE = 1.0  # seconds a drained worker's last events may trail its record's removal
LOST_EVENT_TIMEOUT = 2.0  # seconds a missing token event is waited for once later ones came


@dataclass(slots=True, frozen=True)
class WorkerGone:
    """Put in an attempt's queue when a worker it waits on leaves the directory."""

    worker_id: str


@dataclass(slots=True, frozen=True)
class NoResponders:
    """Put in an attempt's queue when NATS says nobody took its work (a 503 status on the
    reply subject of that phase)."""

    phase: str


@dataclass(slots=True)
class Attempt:
    """One try of a request. Everything it waits for arrives in ``events``: the decode
    worker's token events, the prefill reply, and word that a worker it waits on is gone.
    ``last_heard`` moves with every message about it, heartbeats (``Progress``) included."""

    attempt_id: str
    decode_worker: str
    prefill_worker: str | None
    deadline: float  # the request's own, on the event loop's clock
    key: str = ""  # random: the token of its stream subjects (``Subjects.stream``)
    stage: str = "prefill"  # then "decode"
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    last_heard: float = field(default_factory=lambda: asyncio.get_running_loop().time())
    incarnations: dict[str, float] = field(default_factory=dict)  # worker id -> started_at, as chosen

    def waits_on(self, worker_id: str) -> bool:
        if self.stage == "prefill" and self.prefill_worker == worker_id:
            return True
        return self.decode_worker == worker_id

    def heard(self) -> None:
        self.last_heard = asyncio.get_running_loop().time()

    def incarnation(self, worker_id: str) -> float | None:
        """The ``started_at`` of the worker this attempt chose under that id."""
        return self.incarnations.get(worker_id)


RETRY_KINDS = (
    "worker_gone", "silent", "event_lost", "no_responders", "kv_lost", "overloaded", "worker_error",
    "refused", "no_first_token", "publish_failed", "stream_ended",
)  # fmt: skip


class Retry(Exception):
    """Try again elsewhere; ``exclude``: give up on ``bad_worker`` for this request (not
    when it was only too busy: then wait a moment instead). ``kind``: one of
    ``RETRY_KINDS``, the bounded reason the router's retry counter goes by."""

    def __init__(
        self,
        reason: str,
        bad_worker: str | None,
        *,
        exclude: bool = True,
        incarnation: float | None = None,
        kind: str = "worker_error",
    ) -> None:
        super().__init__(reason)
        self.bad_worker = bad_worker
        self.exclude = exclude
        self.incarnation = incarnation  # the ``started_at`` of the worker given up on, when known
        self.kind = kind


def _wanted(attempt: Attempt, item: object) -> bool:
    """False for word of a departure that does not concern the attempt; raises ``Retry``
    for one that does."""
    if not isinstance(item, WorkerGone):
        return True
    if attempt.waits_on(item.worker_id):
        raise Retry(f"worker {item.worker_id} is gone", item.worker_id, incarnation=attempt.incarnation(item.worker_id), kind="worker_gone")
    return False


async def next_item(attempt: Attempt, mesh: MeshSettings, waiting_on: str, until: float | None = None) -> object:
    """The attempt's next item (``None`` once the loop's clock passes ``until``). Raises
    ``Retry`` when the worker it waits on left the directory or has been silent (no
    event, no heartbeat) for ``silence_timeout``, and ``MeshError(timeout)`` when the
    request's deadline passes."""
    loop = asyncio.get_running_loop()
    while True:
        try:  # what has arrived is taken first, however long the consumer took to ask
            item = attempt.events.get_nowait()
        except asyncio.QueueEmpty:
            pass
        else:
            if _wanted(attempt, item):
                return item
            continue
        now = loop.time()
        if until is not None and now >= until:
            return None
        if now >= attempt.deadline:
            raise MeshError(ErrorCode.TIMEOUT, f"the request took longer than {mesh.request_deadline:g}s")
        silent = now - attempt.last_heard
        if silent >= mesh.silence_timeout:
            raise Retry(f"no word from {waiting_on} for {silent:.1f}s", waiting_on, incarnation=attempt.incarnation(waiting_on), kind="silent")
        wait = min(mesh.silence_timeout - silent, attempt.deadline - now)
        if until is not None:
            wait = min(wait, until - now)
        try:
            # In this task, not in one of ``wait_for``'s: an event is taken on the loop's next
            # turn after it is queued (wait_for took three turns and a task per wait). An
            # event queued as the timeout fires stays queued and is taken above.
            async with asyncio.timeout(wait):
                item = await attempt.events.get()
        except TimeoutError:
            continue  # a heartbeat may have moved last_heard; look again
        if _wanted(attempt, item):
            return item

async def events_in_order(attempt: Attempt, mesh: MeshSettings) -> AsyncIterator[TokenEvent]:
    """The attempt's events by sequence number, until the last one. An event that does
    not come while later ones have (lost in a NATS reconnect, say) ends the attempt
    after ``LOST_EVENT_TIMEOUT``: the request resumes elsewhere instead of hanging."""
    loop = asyncio.get_running_loop()
    expected = 0
    early: dict[int, TokenEvent] = {}
    gap_deadline: float | None = None  # while a later event waits for an earlier one
    while True:
        item = await next_item(attempt, mesh, attempt.decode_worker, gap_deadline)
        if item is None:
            raise Retry(f"token event {expected} from {attempt.decode_worker} was lost", attempt.decode_worker, exclude=False, kind="event_lost")
        if isinstance(item, NoResponders) and item.phase == "decode":
            raise Retry(f"decode on {attempt.decode_worker}: no responders", attempt.decode_worker, incarnation=attempt.incarnation(attempt.decode_worker), kind="no_responders")
        if isinstance(item, DecodeAck):
            _check_ack(attempt, item)
            continue
        if not isinstance(item, TokenEvent):
            continue  # a late prefill reply
        if item.seq < expected:
            continue  # a duplicate of one already handled
        early[item.seq] = item
        while expected in early:
            event = early.pop(expected)
            expected += 1
            if event.error is not None:
                code = event.error.code
                if code is ErrorCode.KV_LOST and attempt.prefill_worker:  # the pull failed: the prefill side is gone
                    raise Retry(event.error.message, attempt.prefill_worker, incarnation=attempt.incarnation(attempt.prefill_worker), kind="kv_lost")
                if is_retryable(code):
                    raise Retry(
                        event.error.message,
                        attempt.decode_worker,
                        exclude=code is not ErrorCode.OVERLOADED,
                        incarnation=attempt.incarnation(attempt.decode_worker),
                        kind="overloaded" if code is ErrorCode.OVERLOADED else "worker_error",
                    )
                raise MeshError(code, event.error.message)
            yield event
            if event.finished:
                return
        if not early:
            gap_deadline = None
        elif gap_deadline is None:
            gap_deadline = loop.time() + LOST_EVENT_TIMEOUT


def _check_ack(attempt: Attempt, ack: DecodeAck) -> None:
    """A decode worker that refused the work: retried elsewhere unless the request itself
    is at fault."""
    if ack.accepted:
        return
    error = ack.error
    if error is None or is_retryable(error.code):
        raise Retry(
            f"decode on {attempt.decode_worker} refused: {error.message if error else '?'}",
            attempt.decode_worker,
            exclude=error is None or error.code is not ErrorCode.OVERLOADED,
            incarnation=attempt.incarnation(attempt.decode_worker),
            kind="overloaded" if error is not None and error.code is ErrorCode.OVERLOADED else "refused",
        )
    raise MeshError(error.code, error.message)
