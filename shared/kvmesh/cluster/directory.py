"""The live set of workers, read from etcd and kept current by a watch.

A worker whose lease expires disappears from etcd and so from here; a broken watch is
re-established from a fresh read, so the view converges after an etcd restart.

A record that cannot be what it says is refused, with a log line, and never used (and a
record it replaces is dropped): its worker id or role not those of its key, its transfer
endpoint on another host than the one it advertises, its ``max_model_len`` beyond the
model's (when the reader knows the model's, as a router does). etcd's RBAC lets a worker
write only its own key; these checks keep a worker (or whoever holds its credentials) from
passing itself off as another, or steering peers' pulls to another host.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from pydantic import ValidationError

from kvmesh.cluster.etcd_store import ClusterError, EtcdStore
from kvmesh.protocol import Keys, WorkerRecord
from kvmesh.tasks import cancel_and_wait, cancel_requested, pause

logger = logging.getLogger(__name__)


class WorkerDirectory:
    def __init__(self, store: EtcdStore, keys: Keys, *, max_model_len: int | None = None) -> None:
        self.store = store
        self.prefix = keys.workers()
        self.max_model_len = max_model_len  # the model's own limit, when the reader knows it
        self.workers: dict[str, WorkerRecord] = {}  # by worker id
        self.leases: dict[str, int] = {}  # the lease each worker's record lives under
        self._changed = asyncio.Event()
        self._listeners: list[Callable[[str, WorkerRecord | None], None]] = []
        self._task: asyncio.Task | None = None

    def on_change(self, listener: Callable[[str, WorkerRecord | None], None]) -> None:
        """``listener(worker_id, record or None when gone)``."""
        self._listeners.append(listener)

    async def start(self) -> None:
        revision = await self._load()
        self._task = asyncio.create_task(self._follow(revision), name="worker-directory")

    async def stop(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None

    def alive(self, role: str) -> list[WorkerRecord]:
        return [record for record in self.workers.values() if record.role == role]

    async def wait_for(self, predicate: Callable[[WorkerDirectory], bool], timeout: float) -> None:
        async with asyncio.timeout(timeout):
            while not predicate(self):
                self._changed.clear()
                await self._changed.wait()

    async def _load(self) -> int:
        items, revision = await self.store.get_prefix(self.prefix)
        seen = {}
        for item in items:
            record = self._parse(item.key, item.value)
            if record is not None:
                seen[record.worker_id] = record
                self.leases[record.worker_id] = item.lease
        for worker_id in set(self.workers) - set(seen):
            self._set(worker_id, None)
        for worker_id, record in seen.items():
            self._set(worker_id, record)
        return revision

    async def _follow(self, revision: int) -> None:
        while True:
            if cancel_requested():  # a stop swallowed during the last reload: the watch would not end
                raise asyncio.CancelledError
            try:
                async for event in self.store.watch_prefix(self.prefix, start_revision=revision + 1):
                    worker_id = event.key.rsplit("/", 1)[-1]
                    if event.kind == "delete":
                        self._set(worker_id, None)
                    else:
                        record = self._parse(event.key, event.value)
                        if record is not None:
                            self.leases[worker_id] = event.lease
                            self._set(worker_id, record)
                        elif worker_id in self.workers:  # what it replaced is not to be trusted either
                            self._set(worker_id, None)
                raise ClusterError("watch ended")
            except (ClusterError, OSError) as exc:
                logger.warning("worker watch broke (%s); reloading", exc)
                while True:
                    await pause(0.5)
                    try:
                        revision = await self._load()
                        break
                    except ClusterError:
                        continue

    def _parse(self, key: str, value: bytes) -> WorkerRecord | None:
        try:
            record = WorkerRecord.decode(value)
        except ValidationError:
            logger.warning("ignoring a malformed worker record at %s", key)
            return None
        problem = implausible(key[len(self.prefix) :], record, self.max_model_len)
        if problem is not None:
            logger.warning("refusing the worker record at %s: %s", key, problem)
            return None
        return record

    def _set(self, worker_id: str, record: WorkerRecord | None) -> None:
        if record is None:
            self.leases.pop(worker_id, None)
            if self.workers.pop(worker_id, None) is None:
                return
            logger.info("worker %s left", worker_id)
        else:
            old = self.workers.get(worker_id)
            if old is not None and (old.pid, old.started_at, old.host) != (record.pid, record.started_at, record.host):
                # A restarted worker under the same id: the old one is gone, with whatever it held.
                logger.info("worker %s restarted", worker_id)
                for listener in self._listeners:
                    listener(worker_id, None)
            elif old is None:
                logger.info("worker %s (%s) joined", worker_id, record.role)
            self.workers[worker_id] = record
        self._changed.set()
        for listener in self._listeners:
            listener(worker_id, record)


def implausible(relative_key: str, record: WorkerRecord, model_max_len: int | None = None) -> str | None:
    """Why a record at ``workers/<relative_key>`` cannot be what it says (None: it can).

    These catch inconsistent records (a copy under another key, a stale or hand-edited one),
    not a lying worker: the host is the worker's own word too, so a worker's credentials can
    still point its own endpoint anywhere (etcd RBAC keeps it to its own record)."""
    role, _, worker_id = relative_key.partition("/")
    if record.worker_id != worker_id:
        return f"it names worker {record.worker_id!r}, its key {worker_id!r}"
    if record.role != role:
        return f"its role {record.role!r} is not its key's {role!r}"
    if record.transfer_endpoint is not None:
        host = record.transfer_endpoint.rsplit(":", 1)[0].strip("[]")
        if host != record.host.strip("[]"):
            return f"its transfer endpoint {record.transfer_endpoint} is not on its host {record.host}"
    if model_max_len is not None and record.max_model_len > model_max_len:
        return f"its max_model_len {record.max_model_len} is beyond the model's {model_max_len}"
    return None
