"""What workers answer into a router's stream subjects, sorted into its attempts' queues.

Each attempt has a random key; its work goes out with ``stream.<router>.<key>.<phase>`` as
the NATS reply subject, so only the worker handed that work can answer there (NATS's
``allow_responses``). Here each message is taken only if it is what that phase carries
(``STREAM_KINDS``) for that attempt: progress moves its ``last_heard``, anything else is
queued; NATS's 503 status (nobody took the work) is queued as ``NoResponders``.
"""

from __future__ import annotations

import logging
import secrets

from nats.aio.msg import Msg
from pydantic import ValidationError

from kvmesh.protocol import STREAM_KINDS, STREAM_MESSAGE, Progress
from kvmesh.services.router.attempts import Attempt, NoResponders

logger = logging.getLogger(__name__)


def new_key() -> str:
    """An attempt's stream key: 128 random bits, a valid NATS token."""
    return secrets.token_urlsafe(16)


class Streams:
    def __init__(self) -> None:
        self._by_key: dict[str, Attempt] = {}

    def open(self, attempt: Attempt) -> None:
        self._by_key[attempt.key] = attempt

    def close(self, attempt: Attempt) -> None:
        self._by_key.pop(attempt.key, None)

    async def handle(self, msg: Msg) -> None:
        key, phase = msg.subject.rsplit(".", 2)[-2:]
        attempt = self._by_key.get(key)
        if attempt is None or phase not in STREAM_KINDS:
            return
        if msg.headers and msg.headers.get("Status") == "503":
            attempt.events.put_nowait(NoResponders(phase))
            return
        try:
            message = STREAM_MESSAGE.validate_json(msg.data)
        except ValidationError:
            logger.warning("malformed message on %s", msg.subject)
            return
        if not isinstance(message, STREAM_KINDS[phase]) or message.request_id != attempt.attempt_id:
            logger.warning("dropped a %s on %s: not what that stream carries", type(message).__name__, msg.subject)
            return
        attempt.heard()
        if not isinstance(message, Progress):
            attempt.events.put_nowait(message)
