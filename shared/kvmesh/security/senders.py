"""A per-worker subject (``load.<id>``, ``kv.events.<id>``) may be published on only with
that worker's credentials; a payload naming another worker is a forgery and is dropped."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from nats.aio.msg import Msg
from pydantic import ValidationError

from kvmesh.protocol import Message, Subjects

logger = logging.getLogger(__name__)


def from_own_subject(handler: Callable[[Msg], Awaitable[None]], payload: type[Message]) -> Callable[[Msg], Awaitable[None]]:
    """``handler``, for messages whose ``payload.worker_id`` is their subject's last token."""

    async def checked(msg: Msg) -> None:
        try:
            worker_id = payload.decode(msg.data).worker_id
        except ValidationError:
            await handler(msg)  # malformed: the handler says so, as before
            return
        sender = Subjects.sender(msg.subject)
        if worker_id != sender:
            logger.warning("dropped a %s for %s published on %s's subject", payload.__name__, worker_id, sender)
            return
        await handler(msg)

    return checked
