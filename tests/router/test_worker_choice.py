"""Choosing a worker: the least loaded usable one, never one this request gave up on, unless
it has restarted since."""

from __future__ import annotations

import time

from kvmesh.protocol import KVLayoutSpec, LoadReport, WorkerRecord
from kvmesh.services.router.worker_choice import Excluded, LayoutPairing, LoadBoard, layout_mismatch, least_loaded


def record(worker_id: str, started_at: float = 1.0) -> WorkerRecord:
    return WorkerRecord(
        worker_id=worker_id, role="decode", model="m", max_model_len=64, subject=f"s.{worker_id}",
        host="127.0.0.1", pid=1, started_at=started_at,
    )  # fmt: skip


def report(worker_id: str, running: int, *, ready: bool = True, draining: bool = False) -> LoadReport:
    return LoadReport(worker_id=worker_id, role="decode", running=running, waiting=0, free_blocks=10, total_blocks=10,
                      ready=ready, draining=draining, timestamp=time.time())  # fmt: skip


def test_an_excluded_worker_is_skipped_until_it_restarts():
    workers = {"d1": record("d1"), "d2": record("d2")}
    board = LoadBoard()
    board.update(report("d1", 0))
    board.update(report("d2", 5))
    excluded = Excluded(workers)
    assert least_loaded(list(workers.values()), board, excluded).worker.worker_id == "d1"
    excluded.add("d1")
    assert "d1" in excluded
    assert least_loaded(list(workers.values()), board, excluded).worker.worker_id == "d2"
    workers["d1"] = record("d1", started_at=2.0)  # restarted under the same id
    assert "d1" not in excluded
    assert least_loaded(list(workers.values()), board, excluded).worker.worker_id == "d1"


def test_every_live_worker_given_up_on_gets_one_second_chance_per_request():
    """A worker that fell silent only because its NATS connection dropped is worth one more
    try when nobody else is left; a second time it is not."""
    workers = {"d1": record("d1"), "d2": record("d2")}
    excluded = Excluded(workers)
    excluded.add("d1")
    assert not excluded.second_chance([workers["d2"]])  # d2 was never given up on
    excluded.add("d2")
    assert excluded.second_chance(list(workers.values()))
    assert "d1" not in excluded and "d2" not in excluded
    excluded.add("d1")
    assert not excluded.second_chance([workers["d1"]]) and "d1" in excluded


def test_a_worker_gone_when_excluded_is_new_when_it_comes_back():
    workers: dict[str, WorkerRecord] = {}
    excluded = Excluded(workers)
    excluded.add("d1")  # already gone from the directory
    assert "d1" in excluded
    workers["d1"] = record("d1", started_at=3.0)
    assert "d1" not in excluded


def test_unready_draining_or_silent_workers_are_not_usable():
    board = LoadBoard(stale_after=0.2)
    assert board.usable("new") and not board.ready("new")  # not heard from yet: usable, not ready
    board.update(report("a", 0, ready=False))
    board.update(report("b", 0, draining=True))
    board.update(report("c", 0))
    assert [board.usable(w) for w in "abc"] == [False, False, True]
    time.sleep(0.25)
    assert not board.usable("c") and not board.ready("c")


def test_the_incarnation_given_up_on_is_the_one_excluded():
    """A worker restarted by overwriting its record before the attempt ended: the new one
    is not excluded, since the attempt names the incarnation it used."""
    workers = {"d1": record("d1", started_at=1.0)}
    excluded = Excluded(workers)
    workers["d1"] = record("d1", started_at=2.0)  # already replaced
    excluded.add("d1", started_at=1.0)
    assert "d1" not in excluded


def spec(**overrides) -> KVLayoutSpec:
    fields = dict(num_blocks=64, block_size=16, num_layers=30, num_kv_heads=3, head_dim=64, dtype="float32")
    fields.update(overrides)
    return KVLayoutSpec(**fields)


def worker(worker_id: str, role: str, layout: KVLayoutSpec | None, started_at: float = 1.0) -> WorkerRecord:
    return WorkerRecord(
        worker_id=worker_id, role=role, model="m", max_model_len=64, subject=f"s.{worker_id}", host="127.0.0.1", pid=1,
        started_at=started_at, kv_base_address=4096, kv_layout=layout,
    )  # fmt: skip


def test_prefill_workers_are_paired_only_with_decode_workers_that_can_pull_their_layout(caplog):
    segment = 2 * 128 * 3 * 64 * 4
    vllm = spec(engine="vllm", block_size=128, arrangement="head,kv,token,dim", layer_stride=64 * segment, block_stride=segment)
    prefills = [
        worker("p-same", "prefill", spec(num_blocks=512)),  # another pool size: fine
        worker("p-bf16", "prefill", spec(dtype="bfloat16")),
        worker("p-vllm", "prefill", vllm),
        worker("p-bare", "prefill", None),
    ]
    decode = worker("d1", "decode", spec())
    pairing = LayoutPairing()
    with caplog.at_level("WARNING"):
        kept, skipped = pairing.pairable(prefills, decode)
        pairing.pairable(prefills, decode)  # said once per pair, not per request
    assert [w.worker_id for w in kept] == ["p-same"]
    assert skipped == {
        "p-bf16": "p-bf16's KV layout does not match d1's (dtype bfloat16 vs float32)",
        "p-vllm": "p-vllm's KV layout does not match d1's (block size 128 vs 16)",
        "p-bare": "p-bare has published no KV layout",
    }
    assert [r.getMessage() for r in caplog.records] == [
        f"not pairing prefill worker {w} with decode worker d1: {why}" for w, why in skipped.items()
    ]
    same_shape = spec(engine="vllm", arrangement="head,kv,token,dim")
    assert layout_mismatch(worker("p", "prefill", same_shape), decode) == (
        "p's KV layout does not match d1's (arrangement head,kv,token,dim vs kv,token,head,dim)"
    )
    assert layout_mismatch(worker("p", "prefill", same_shape), worker("d2", "decode", same_shape)) is None


async def test_the_router_prefills_only_where_the_chosen_decode_worker_can_pull(tiny_model_dir):
    from types import SimpleNamespace

    from opentelemetry import trace

    from kvmesh.services.router.mesh_backend import MeshBackend
    from kvmesh.settings.mesh import MeshSettings

    backend = MeshBackend(MeshSettings("nats://127.0.0.1:1", ("127.0.0.1:1",)), model=str(tiny_model_dir))
    workers = {
        "prefill": [worker("p-bf16", "prefill", spec(dtype="bfloat16")), worker("p-ok", "prefill", spec())],
        "decode": [worker("d1", "decode", spec())],
        "kv-metadata": [],
    }
    backend.directory = SimpleNamespace(alive=lambda role: workers[role], workers={})  # type: ignore[assignment]
    span = trace.get_tracer("test").start_span("request")
    routed = await backend._choose_prefill("a-0", list(range(40)), Excluded({}), None, span, workers["decode"][0])
    assert routed is not None and routed[0].worker.worker_id == "p-ok"
    workers["prefill"] = workers["prefill"][:1]  # nobody it can pull from: the decode worker prefills itself
    assert await backend._choose_prefill("a-1", list(range(40)), Excluded({}), None, span, workers["decode"][0]) is None
