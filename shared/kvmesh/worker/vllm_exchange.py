"""What kvmesh's vLLM KV connector (``kvmesh.worker.vllm_connector``, loaded by vLLM) and
``kvmesh.worker.vllm_core`` share in the worker's process: the keys of a request's
``kv_transfer_params`` and, per engine, one ``Exchange`` of blocks kept, allocated,
filled and released. Free of vLLM."""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass, field

EXPORT = "kvmesh_export"  # kv_transfer_params key: this request's blocks are kept for a peer
IMPORT = "kvmesh_import"  # kv_transfer_params key: this request's prompt KV comes from a peer
NUM_TOKENS = "num_tokens"  # with IMPORT: how many prompt tokens the imported KV holds
FROM_TOKEN = "from_token"  # with IMPORT: the first of them it holds (a prefix pulled from a peer: past vLLM's own)


@dataclass
class Import:
    handle: str
    block_ids: list[int]  # every block vLLM gave the request (its own cached ones first)
    first_block: int  # the first of them the import fills (the ones before vLLM had cached)


@dataclass
class Exchange:
    """What the connector's two roles and ``VllmCore`` share, guarded by ``lock``."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    exports: dict[str, tuple[str, list[int]]] = field(default_factory=dict)  # handle -> (vLLM's id, blocks)
    to_release: set[str] = field(default_factory=set)  # vLLM ids whose kept blocks may go
    finished_seen: set[str] = field(default_factory=set)  # vLLM ids get_finished was told of
    imports: dict[str, Import] = field(default_factory=dict)  # vLLM id -> blocks allocated, not yet filled
    loaded: set[str] = field(default_factory=set)  # vLLM ids filled, to report received
    # vLLM ids whose import was claimed once: never again (after a preemption vLLM recomputes
    # the prompt itself, rather than wait for blocks that are gone)
    claimed: set[str] = field(default_factory=set)

    def busy(self) -> bool:
        """Work that needs the engine to step although no request runs."""
        with self.lock:
            return bool(self.to_release or self.loaded)


EXCHANGES: dict[str, Exchange] = {}  # one per engine in this process, by name
_names = itertools.count()


def new_exchange() -> str:
    name = f"exchange-{next(_names)}"
    EXCHANGES[name] = Exchange()
    return name
