"""Ordering of KV event batches per worker stream: apply, drop, reset or resync.

Each worker numbers its event batches ``0, 1, 2, ...`` within an ``epoch`` (a string the
worker picks at start, e.g. a UUID); a restarted worker starts a new epoch at 0 with an
empty cache. For each batch the receiver asks :meth:`EventSequencer.offer` what to do:

- :attr:`Verdict.APPLY`: the next expected batch; apply it.
- :attr:`Verdict.RESET`: the first batch (seq 0) of a new epoch of a known worker: the
  worker restarted, so drop all its blocks, then apply the batch.
- :attr:`Verdict.DROP`: a duplicate or an old batch, or one from a retired epoch; ignore it.
- :class:`Gap`: batches are missing (or the worker was first seen mid-stream); the receiver
  must resync the worker (take a snapshot of its blocks) and then call
  :meth:`EventSequencer.resynced`. Until then every batch past the gap is a ``Gap`` again.

Pure logic: no I/O, no clock.
"""

from __future__ import annotations

import enum
import logging
from collections import deque
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

RETIRED_EPOCHS_KEPT = 8


class Verdict(enum.Enum):
    APPLY = "apply"
    RESET = "reset"
    DROP = "drop"


@dataclass(slots=True, frozen=True)
class Gap:
    """Batches ``expected .. got - 1`` of ``worker_id``'s stream ``epoch`` are missing."""

    worker_id: str
    epoch: str
    expected: int
    got: int


@dataclass(slots=True)
class _Stream:
    epoch: str | None = None  # None: no epoch seen yet (or forgotten)
    expected: int = 0
    retired: deque[str] = field(default_factory=lambda: deque(maxlen=RETIRED_EPOCHS_KEPT))


class EventSequencer:
    """Per-worker expectation of the next event batch."""

    def __init__(self) -> None:
        self._streams: dict[str, _Stream] = {}

    def offer(self, worker_id: str, epoch: str, seq: int) -> Verdict | Gap:
        """What to do with batch ``seq`` of ``worker_id``'s stream ``epoch``; advances the
        expectation on ``APPLY`` and ``RESET``."""
        if seq < 0:
            raise ValueError(f"seq must be >= 0, got {seq}")
        stream = self._streams.get(worker_id)
        if stream is None:
            stream = self._streams[worker_id] = _Stream()
        if epoch != stream.epoch:
            if epoch in stream.retired:
                return Verdict.DROP
            first_sight = stream.epoch is None
            if stream.epoch is not None:
                stream.retired.append(stream.epoch)
                logger.info("worker %s restarted: epoch %s -> %s", worker_id, stream.epoch, epoch)
            stream.epoch, stream.expected = epoch, 0
            if seq == 0:
                stream.expected = 1
                return Verdict.APPLY if first_sight else Verdict.RESET
            return Gap(worker_id, epoch, 0, seq)
        if seq == stream.expected:
            stream.expected += 1
            return Verdict.APPLY
        if seq < stream.expected:
            return Verdict.DROP
        return Gap(worker_id, epoch, stream.expected, seq)

    def resynced(self, worker_id: str, epoch: str, next_seq: int) -> None:
        """The receiver replaced ``worker_id``'s blocks with a snapshot that includes every
        batch before ``next_seq`` of ``epoch``: expect ``next_seq`` from now on."""
        stream = self._streams.get(worker_id)
        if stream is None:
            stream = self._streams[worker_id] = _Stream()
        if stream.epoch is not None and stream.epoch != epoch and epoch not in stream.retired:
            stream.retired.append(stream.epoch)
        stream.epoch, stream.expected = epoch, next_seq

    def forget(self, worker_id: str) -> None:
        """The worker is gone: its current epoch is retired, so late batches from it drop."""
        stream = self._streams.get(worker_id)
        if stream is not None and stream.epoch is not None:
            stream.retired.append(stream.epoch)
            stream.epoch, stream.expected = None, 0

    def rejoined(self, worker_id: str) -> None:
        """The worker is registered again, perhaps the same process (its lease lapsed and came
        back): its retired epochs are no longer dropped. A batch of one is then a first sight
        (a ``Gap`` unless it is batch 0), so the receiver resyncs from its snapshot."""
        stream = self._streams.get(worker_id)
        if stream is not None:
            stream.retired.clear()

    def expected(self, worker_id: str) -> tuple[str, int] | None:
        """(epoch, next expected seq) of ``worker_id``, or None when no epoch is current."""
        stream = self._streams.get(worker_id)
        if stream is None or stream.epoch is None:
            return None
        return stream.epoch, stream.expected
