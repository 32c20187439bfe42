"""kvmesh's KV connector for vLLM (vLLM's KV connector V1 API), loaded by vLLM from
``kv_transfer_config={"kv_connector": "KvmeshConnector", "kv_connector_module_path":
"kvmesh.worker.vllm_connector", ...}``. Its scheduler side runs in the worker's process, where
vLLM's engine core runs (``kvmesh.worker.vllm_engine``), and shares one ``Exchange`` with
``VllmCore``, named in ``kv_connector_extra_config["kvmesh_exchange"]``; its worker side runs
where the model does (that process too, or each of vLLM's tensor-parallel ranks) and learns
from each step's metadata (``KvmeshMetadata``) which requests to report sent and received.

- **Export** (a prefill worker): a request whose ``kv_transfer_params`` carry
  ``kvmesh_export`` keeps its blocks when it finishes normally (``request_finished``
  returns True; aborted or failed, they go at once: nobody will pull or release them);
  ``VllmCore.release_export`` (the decode side pulled them, or the pin expired) hands its
  id to the worker side's ``get_finished`` as sent, and vLLM frees them.
- **Import** (a decode worker): the request's prompt is the prompt plus the prefill's first
  token, with ``kvmesh_import`` (the handle) and ``num_tokens`` (the prompt's), or, for
  structured output, the prompt alone with ``num_tokens`` one less (vLLM outputs the first
  token again, forced: ``kvmesh.worker.vllm_forced``); or (a prefill
  worker that pulled a prefix from a peer) the prompt, with ``num_tokens`` the prefix's and
  ``from_token`` where the pulled part starts (vLLM's own cached blocks before it). The scheduler
  side claims every prompt token vLLM has not cached itself, asynchronously
  (``get_num_new_matched_tokens``), and records the blocks vLLM allocated for them
  (``update_state_after_alloc``); ``VllmCore`` copies the pulled KV in and marks the request
  loaded, and the worker side reports it received. vLLM then computes only the first
  token's position and samples the second: the first token is never sampled again (a
  prefix import: the rest of the prompt). Where vLLM no longer holds its own blocks up to
  ``from_token``, nothing is claimed and vLLM computes the prompt itself.

No bytes move here: the worker's Mooncake pulls (by the producer's published layout) fill
blocks of this pool, as for kvmesh's engine (a tensor-parallel pool is mapped in the worker's
process: ``kvmesh.worker.shared_pool``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # type: ignore[import-not-found]
    KVConnectorBase_V1,
    KVConnectorMetadata,
)
from vllm.v1.request import RequestStatus  # type: ignore[import-not-found]

from kvmesh.worker.vllm_exchange import EXCHANGES, EXPORT, FROM_TOKEN, IMPORT, NUM_TOKENS, Exchange, Import


CROSS_LAYER_LAYOUT = "BLHNC"  # vLLM's KVCacheLayout: [blocks, layers, heads, tokens, content]
_EXPORTED = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED)  # an export's first token


@dataclass
class KvmeshMetadata(KVConnectorMetadata):  # type: ignore[misc]
    """What the worker side reports from this step's ``get_finished``, by vLLM's request ids
    (every rank the same: vLLM counts a request done once every rank has reported it)."""

    sent: set[str] = field(default_factory=set)  # kept blocks vLLM may free now
    received: set[str] = field(default_factory=set)  # imports filled: vLLM may go on with them


class KvmeshConnector(KVConnectorBase_V1):  # type: ignore[misc]
    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
        # the scheduler side's (the worker's process); None in a tensor-parallel rank's process,
        # whose worker side needs only each step's metadata
        self._exchange = EXCHANGES.get(extra["kvmesh_exchange"])
        self.block_size = vllm_config.cache_config.block_size

    @property
    def exchange(self) -> Exchange:
        if self._exchange is None:
            raise RuntimeError("kvmesh's connector has no exchange outside the worker's process")
        return self._exchange

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> str | None:
        """Layers inside blocks (``CROSS_LAYER_LAYOUT``) off CPU: a block's KV of every layer
        is then one range, as in kvmesh's own pool, and a pull of a run of blocks one
        Mooncake read instead of one per layer. vLLM keeps its own layout where a backend
        cannot take it (with a warning), and ``VLLM_KV_CACHE_LAYOUT`` overrides both. On CPU,
        whose backend takes only ``LBHNC``, nothing is asked."""
        if vllm_config.device_config.device_type == "cpu":
            return None
        return CROSS_LAYER_LAYOUT

    # -- scheduler side ------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        params = request.kv_transfer_params or {}
        with self.exchange.lock:
            claimed = request.request_id in self.exchange.claimed
        if IMPORT not in params or claimed:
            return 0, False
        if num_computed_tokens < int(params.get(FROM_TOKEN, 0)):
            return 0, False  # vLLM lost some of its own prefix meanwhile: it computes the whole prompt
        wanted = int(params[NUM_TOKENS]) - num_computed_tokens
        return (wanted, True) if wanted > 0 else (0, False)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        params = request.kv_transfer_params or {}
        if num_external_tokens <= 0 or IMPORT not in params:
            return
        cached = int(params[NUM_TOKENS]) - num_external_tokens
        with self.exchange.lock:
            self.exchange.claimed.add(request.request_id)
            self.exchange.imports[request.request_id] = Import(
                str(params[IMPORT]), list(blocks.get_block_ids()[0]), cached // self.block_size
            )

    def build_connector_meta(self, scheduler_output: Any) -> KvmeshMetadata:
        """The kept blocks whose release was asked for, once the worker side has been told
        their request finished (this step's ``finished_req_ids`` at the latest), and the
        imports filled since the last step."""
        exchange = self.exchange
        with exchange.lock:
            kept = {vllm_id for vllm_id, _ in exchange.exports.values()} | exchange.to_release
            exchange.finished_seen |= set(scheduler_output.finished_req_ids) & kept  # only exports wait to be sent
            sent = {r for r in exchange.to_release if r in exchange.finished_seen}
            exchange.to_release -= sent
            exchange.finished_seen -= sent
            received, exchange.loaded = exchange.loaded, set()
        return KvmeshMetadata(sent, received)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        params = request.kv_transfer_params or {}
        with self.exchange.lock:
            self.exchange.claimed.discard(request.request_id)
        if EXPORT not in params or request.status not in _EXPORTED:
            return False, None  # aborted (a cancel) or failed: no export, nobody will release it
        with self.exchange.lock:
            self.exchange.exports[str(params[EXPORT])] = (request.request_id, list(block_ids))
        return True, None  # the blocks stay until get_finished reports the request sent

    def has_pending_push_work(self) -> bool:
        return self.exchange.busy()

    # -- worker side ---------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        pass  # VllmCore reads the pool from the model runner

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        pass

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        pass

    def wait_for_save(self) -> None:
        pass

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        meta = self._get_connector_metadata() if self.has_connector_metadata() else None
        if not isinstance(meta, KvmeshMetadata):
            return None, None
        return set(meta.sent) or None, set(meta.received) or None
