"""Block ownership mirrored in etcd under each owner's lease, written in batches.

A key ``blocks/<worker>/<hash>`` lives under the worker's own registration lease, so when a
worker dies its blocks leave etcd by themselves; a restarted kv-metadata reads them back.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from kvmesh.cluster.etcd_store import ClusterError, EtcdStore
from kvmesh.hashing import BlockHash, hash_from_hex
from kvmesh.protocol import Keys
from kvmesh.tasks import pause

logger = logging.getLogger(__name__)


class EtcdMirror:
    def __init__(self, store: EtcdStore, keys: Keys, lease_of: Callable[[str], int | None]) -> None:
        self.store = store
        self.keys = keys
        self.lease_of = lease_of
        self._puts: dict[str, dict[str, str]] = {}  # worker -> hash hex -> tier
        self._deletes: dict[str, set[str]] = {}  # worker -> hash hex
        self._replace: set[str] = set()  # workers whose mirror is rewritten from scratch

    def stored(self, worker_id: str, hashes: list[str], tier: str) -> None:
        puts = self._puts.setdefault(worker_id, {})
        deletes = self._deletes.get(worker_id)
        for h in hashes:
            puts[h] = tier
            if deletes:
                deletes.discard(h)

    def removed(self, worker_id: str, hashes: list[str]) -> None:
        deletes = self._deletes.setdefault(worker_id, set())
        puts = self._puts.get(worker_id)
        for h in hashes:
            deletes.add(h)
            if puts:
                puts.pop(h, None)

    def replace(self, worker_id: str, hashes: list[str], tier: str) -> None:
        """The worker's blocks are exactly ``hashes`` now (after a resync)."""
        self._replace.add(worker_id)
        self._deletes.pop(worker_id, None)
        self._puts[worker_id] = dict.fromkeys(hashes, tier)

    def forget(self, worker_id: str) -> None:
        for pending in (self._puts, self._deletes):
            pending.pop(worker_id, None)
        self._replace.discard(worker_id)

    async def flush(self) -> None:
        workers = set(self._puts) | set(self._deletes) | self._replace
        for worker_id in workers:
            puts = self._puts.pop(worker_id, {})
            deletes = self._deletes.pop(worker_id, set())
            replace = worker_id in self._replace
            self._replace.discard(worker_id)
            lease = self.lease_of(worker_id)
            if lease is None:
                continue  # not (or no longer) registered: its blocks are not mirrored
            prefix = self.keys.blocks(worker_id)
            try:
                if replace:
                    await self.store.delete_prefix(prefix)
                await self.store.write_batch(
                    [(prefix + h, tier.encode(), lease) for h, tier in puts.items()],
                    [prefix + h for h in deletes],
                )
            except ClusterError as exc:
                # A lease that just expired fails the transaction: the worker is gone anyway.
                logger.warning("mirroring %d blocks of %s failed: %s", len(puts) + len(deletes), worker_id, exc)

    async def load(self) -> dict[str, dict[BlockHash, str]]:
        """Every mirrored block: worker -> hash -> tier."""
        items, _ = await self.store.get_prefix(self.keys.blocks())
        owned: dict[str, dict[BlockHash, str]] = {}
        root = len(self.keys.blocks())
        for item in items:
            worker_id, _, hex_hash = item.key[root:].partition("/")
            try:
                owned.setdefault(worker_id, {})[hash_from_hex(hex_hash)] = item.value.decode() or "device"
            except ValueError:
                logger.warning("ignoring a malformed block key %s", item.key)
        return owned

    async def run(self, interval: float) -> None:
        while True:
            await pause(interval)
            await self.flush()


__all__ = ["EtcdMirror"]
