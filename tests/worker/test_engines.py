"""A worker hosts an engine chosen by name, through one interface; kvmesh's own engine
describes its pool as data (read from the pool's tensor)."""

from __future__ import annotations

import pytest

from kvmesh.engine.request import SamplingParams
from kvmesh.transfer.layout import block_major
from kvmesh.hashing import hash_token_blocks
from kvmesh.worker.engine_api import AllBlocksCleared, BlockRemoved, BlockStored
from kvmesh.worker.engines import create_engine, unavailable, worker_python
from kvmesh.settings.worker import EngineSettings, worker_settings

MESH = ["--nats-url", "nats://127.0.0.1:1", "--etcd", "127.0.0.1:1"]


async def test_the_kvmesh_engine_serves_through_the_interface_and_publishes_its_pool(tiny_model_dir):
    settings = EngineSettings(model=str(tiny_model_dir), block_size=4, kv_cache_bytes=2**20)
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


def test_vllm_is_refused_with_one_clear_line_where_it_is_not_installed(capsys):
    assert unavailable("kvmesh") is None
    assert "make vllm" in (unavailable("vllm") or "")  # kvmesh's own virtualenv has no vLLM
    with pytest.raises(SystemExit) as exit_:
        worker_settings("decode", [*MESH, "--engine", "vllm"])
    assert exit_.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.endswith(unavailable("vllm") or "?")
    assert worker_settings("decode", [*MESH, "--engine", "kvmesh"]).engine.name == "kvmesh"


def test_a_launcher_finds_the_vllm_python_or_says_why(monkeypatch, tmp_path):
    import sys

    assert worker_python("kvmesh") == sys.executable
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    monkeypatch.setenv("KVMESH_VLLM_PYTHON", str(fake))
    assert worker_python("vllm") == str(fake)
    monkeypatch.setenv("KVMESH_VLLM_PYTHON", str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="KVMESH_VLLM_PYTHON=.*missing is not an executable; run `make vllm`"):
        worker_python("vllm")


def _vllm_event(kind: str, **fields):
    event = type(kind, (), {})()
    event.__dict__.update(fields)
    return event


def test_vllm_kv_events_are_renamed_with_kvmeshs_chained_hashes():
    from kvmesh.worker.vllm_core import KVEventNames

    names = KVEventNames(block_size=4, model_name="m")
    tokens = list(range(12))
    want = hash_token_blocks(tokens, 4, ("m",))
    stored = _vllm_event("BlockStored", block_hashes=[101, 102], parent_block_hash=None, token_ids=tokens[:8], block_size=4)
    child = _vllm_event("BlockStored", block_hashes=[103], parent_block_hash=102, token_ids=tokens[8:], block_size=4)
    twice = _vllm_event("BlockStored", block_hashes=[101], parent_block_hash=None, token_ids=tokens[:4], block_size=4)
    orphan = _vllm_event("BlockStored", block_hashes=[201], parent_block_hash=999, token_ids=tokens[:4], block_size=4)
    assert names.translate([stored, child, twice, orphan]) == [
        BlockStored((want[0], want[1]), None, (), 4),
        BlockStored((want[2],), want[1], (), 4),
    ]  # a hash stored in a second block is not announced again; an unknown parent's child is dropped
    assert sorted(names.cached()) == sorted(want)
    removed = names.translate([_vllm_event("BlockRemoved", block_hashes=[101, 103])])
    assert removed == [BlockRemoved((want[2],))]  # 101 is still in its other block
    assert names.translate([_vllm_event("BlockRemoved", block_hashes=[101])]) == [BlockRemoved((want[0],))]
    assert names.translate([_vllm_event("AllBlocksCleared")]) == [AllBlocksCleared()] and names.cached() == []


async def test_a_worker_with_identity_slots_imports_its_engine_before_it_claims_one(monkeypatch):
    """Importing the engine (torch) took seconds on the event loop after the identity was
    claimed; on a busy machine the slot's 5 s lease ran out meanwhile and another replica
    took the identity (seen in tests/test_deploy.py's compose run). Now the import comes
    first, off the loop."""
    import threading

    from kvmesh.cluster.identity_slots import IdentitySlot, SlotError
    from kvmesh.settings.mesh import MeshSettings
    from kvmesh.settings.worker import WorkerSettings
    from kvmesh.worker import runtime

    order: list[str] = []
    loop_thread = threading.current_thread()

    def preload(name: str) -> None:
        order.append(f"preload {name}" + (" on the loop" if threading.current_thread() is loop_thread else ""))

    async def claim(settings: WorkerSettings) -> IdentitySlot:
        order.append("claim")
        raise SlotError("every identity is held")

    monkeypatch.setattr(runtime, "preload", preload)
    monkeypatch.setattr(IdentitySlot, "claim", classmethod(lambda cls, settings: claim(settings)))
    monkeypatch.setattr(runtime.bind_guard, "enforce", lambda *args, **kwargs: None)
    mesh = MeshSettings(nats_url="nats://127.0.0.1:1", etcd_endpoints=("127.0.0.1:1",))
    worker = runtime.WorkerRuntime(WorkerSettings(role="decode", mesh=mesh, identity_slots=("decode-worker-0.json",)))
    with pytest.raises(SystemExit):
        await worker.prepare()
    assert order == ["preload kvmesh", "claim"]


def test_preload_imports_the_engines_module():
    import sys

    from kvmesh.worker.engines import preload

    preload("kvmesh")
    assert "kvmesh.worker.kvmesh_engine" in sys.modules
