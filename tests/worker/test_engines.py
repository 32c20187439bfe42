"""A worker hosts an engine chosen by name, through one interface; kvmesh's own engine
describes its pool as data (read from the pool's tensor)."""

from __future__ import annotations

import pytest

from kvmesh.engine.request import SamplingParams
from kvmesh.transfer.layout import block_major
from kvmesh.worker.engines import create_engine, unavailable
from kvmesh.worker.settings import MeshSettings, WorkerSettings, worker_settings

MESH = ["--nats-url", "nats://127.0.0.1:1", "--etcd", "127.0.0.1:1"]


async def test_the_kvmesh_engine_serves_through_the_interface_and_publishes_its_pool(tiny_model_dir):
    settings = WorkerSettings(
        role="prefill", mesh=MeshSettings("nats://127.0.0.1:1", ("127.0.0.1:1",)), model=str(tiny_model_dir),
        block_size=4, kv_cache_bytes=2**20,
    )  # fmt: skip
    engine = await create_engine(settings)
    try:
        layout = engine.kv_layout
        assert layout == block_major(
            dtype="float32", block_size=4, num_blocks=layout.num_blocks, num_layers=layout.num_layers,
            num_kv_heads=layout.num_kv_heads, head_dim=layout.head_dim, base_address=layout.base_address,
        )  # fmt: skip
        assert layout.pool_bytes == layout.num_blocks * layout.block_bytes <= 2**20
        assert engine.load_now()["free_blocks"] == layout.num_blocks
        prompt = list(range(3, 12))
        assert len(engine.block_hashes(prompt)) == 2  # full blocks of 4 tokens
        out = await engine.prefill_export("r1", prompt, SamplingParams(max_tokens=4))
        assert out.kv_export is not None and len(out.kv_export.block_ids) == 3
        assert 0 <= out.new_token_ids[0] < engine.vocab_size
        assert await engine.release_export("r1")
    finally:
        await engine.shutdown()


def test_vllm_is_refused_with_one_clear_line(capsys):
    assert unavailable("kvmesh") is None
    assert "vllm" in (unavailable("vllm") or "")
    with pytest.raises(SystemExit) as exit_:
        worker_settings("decode", [*MESH, "--engine", "vllm"])
    assert exit_.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.endswith(unavailable("vllm") or "?")
    assert worker_settings("decode", [*MESH, "--engine", "kvmesh"]).engine == "kvmesh"
