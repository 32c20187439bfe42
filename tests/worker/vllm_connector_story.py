"""Run by tests/worker/test_vllm_connector.py with .venv-vllm's python: the KV cache layout
kvmesh's connector asks vLLM for, checked against vLLM's own names; and what its worker side
reports sent and received, learnt from the metadata its scheduler side builds each step."""

from __future__ import annotations

import types

from vllm.v1.kv_cache_layout import KVCacheLayout

from kvmesh.worker.vllm_connector import KvmeshConnector, KvmeshMetadata
from kvmesh.worker.vllm_exchange import Exchange


def config(device_type: str) -> types.SimpleNamespace:
    return types.SimpleNamespace(device_config=types.SimpleNamespace(device_type=device_type))


def main() -> None:
    assert KvmeshConnector.get_required_kvcache_layout(config("cpu")) is None
    for device in ("cuda", "npu"):
        asked = KvmeshConnector.get_required_kvcache_layout(config(device))
        assert asked is not None and KVCacheLayout[asked] is KVCacheLayout.BLHNC, asked
        assert KVCacheLayout[asked].is_block_outermost and KVCacheLayout[asked].is_block_compact
    reports_from_each_steps_metadata()
    print("ok")


def scheduler_side(exchange: Exchange) -> types.SimpleNamespace:
    return types.SimpleNamespace(exchange=exchange)


def worker_side(meta: KvmeshMetadata | None) -> types.SimpleNamespace:
    """A rank's connector (no exchange there): only the step's metadata."""
    return types.SimpleNamespace(has_connector_metadata=lambda: meta is not None, _get_connector_metadata=lambda: meta)


def step(exchange: Exchange, finished: set[str]) -> tuple[set[str] | None, set[str] | None]:
    """One engine step: the scheduler side builds the metadata, every rank's worker side
    reports from it (each the same)."""
    meta = KvmeshConnector.build_connector_meta(scheduler_side(exchange), types.SimpleNamespace(finished_req_ids=finished))
    reports = [KvmeshConnector.get_finished(worker_side(meta), finished) for _ in range(2)]
    assert reports[0] == reports[1]
    return reports[0]


def reports_from_each_steps_metadata() -> None:
    """An export's blocks are reported sent once its release is asked for and the worker
    side has been told the request finished (in that step or before), never twice; an
    import's, received the step after it was filled; nothing without metadata."""
    exchange = Exchange()
    exchange.exports["handle-a"] = ("a", [3, 4])
    assert step(exchange, {"a"}) == (None, None)  # finished, kept: nobody released it yet
    exchange.exports.pop("handle-a")
    exchange.to_release.add("a")
    assert step(exchange, set()) == ({"a"}, None)  # told it finished the step before
    assert step(exchange, set()) == (None, None)  # reported once
    exchange.to_release.add("b")  # released before its finish reached the worker side
    assert step(exchange, set()) == (None, None)
    assert step(exchange, {"b"}) == ({"b"}, None)
    exchange.loaded.add("c")
    assert step(exchange, set()) == (None, {"c"}) and step(exchange, set()) == (None, None)
    assert not exchange.busy() and not exchange.finished_seen
    assert KvmeshConnector.get_finished(worker_side(None), set()) == (None, None)


if __name__ == "__main__":
    main()
