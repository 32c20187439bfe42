"""Run by tests/worker/test_vllm_connector.py with .venv-vllm's python: the KV cache layout
kvmesh's connector asks vLLM for, checked against vLLM's own names."""

from __future__ import annotations

import types

from vllm.v1.kv_cache_layout import KVCacheLayout

from kvmesh.worker.vllm_connector import KvmeshConnector


def config(device_type: str) -> types.SimpleNamespace:
    return types.SimpleNamespace(device_config=types.SimpleNamespace(device_type=device_type))


def main() -> None:
    assert KvmeshConnector.get_required_kvcache_layout(config("cpu")) is None
    for device in ("cuda", "npu"):
        asked = KvmeshConnector.get_required_kvcache_layout(config(device))
        assert asked is not None and KVCacheLayout[asked] is KVCacheLayout.BLHNC, asked
        assert KVCacheLayout[asked].is_block_outermost and KVCacheLayout[asked].is_block_compact
    print("ok")


if __name__ == "__main__":
    main()
