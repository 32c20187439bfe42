"""Choosing a worker: the least loaded usable one, never one this request gave up on, unless
it has restarted since."""

from __future__ import annotations

import asyncio
import time

from kvmesh.protocol import KVLayoutSpec, LoadReport, WorkerRecord
from kvmesh.services.router.worker_choice import (
    Excluded,
    LayoutPairing,
    LoadBoard,
    kv_aware_decode,
    layout_mismatch,
    least_loaded,
    local_prefill_reason,
)


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


def test_workers_whose_pools_are_split_differently_across_processes_are_not_paired():
    """A vLLM worker with tensor parallel 2 publishes rank 0's pool, marked split, and where
    the others lie: it is paired with a worker split alike, not with a one-process pool of
    the same heads in all, and the reason says why (the decode worker then prefills itself)."""
    split = spec(engine="vllm", num_kv_heads=1, ranks=2, rank_stride=10**9)
    assert KVLayoutSpec.model_validate_json(split.model_dump_json()) == split  # the record carries it
    assert "ranks" not in spec().model_dump() and "rank_stride" not in spec().model_dump()  # a one-process pool's record is as before
    decode = worker("d-tp", "decode", split)
    assert layout_mismatch(worker("p", "prefill", split), decode) is None
    whole = spec(engine="vllm", num_kv_heads=1)
    why = "p's KV layout does not match d-tp's (tensor parallel 1 vs 2 (kvmesh moves KV only between pools split alike))"
    assert layout_mismatch(worker("p", "prefill", whole), decode) == why
    assert "tensor parallel 2 vs 1" in (layout_mismatch(worker("p", "prefill", split), worker("d", "decode", whole)) or "")



def test_workers_whose_k_and_v_lie_apart_pair_by_the_order_inside_a_piece():
    """FlashAttention-like pools (K and V apart, layers allocated one by one) pair with
    kvmesh's pool when their pieces are token,head,dim (the same bytes as kvmesh's K and V),
    and not when they are head,token,dim (HND), with the reason."""
    piece = 16 * 3 * 64 * 4
    planes = tuple(address for layer in range(30) for address in (2**32 + layer * 2**24, 2**32 + layer * 2**24 + 64 * piece))
    nhd = spec(engine="vllm", arrangement="token,head,dim", kv_split=True, block_stride=piece, layer_stride=0,
               base_address=2**32, pool_bytes=29 * 2**24 + 128 * piece, planes=planes)  # fmt: skip
    hnd = nhd.model_copy(update={"arrangement": "head,token,dim"})
    decode = worker("d1", "decode", spec())
    assert layout_mismatch(worker("p-nhd", "prefill", nhd), decode) is None
    assert layout_mismatch(worker("p-hnd", "prefill", hnd), decode) == (
        "p-hnd's KV layout does not match d1's (arrangement head,token,dim (K and V apart) vs kv,token,head,dim)"
    )
    assert layout_mismatch(worker("p-hnd", "prefill", hnd), worker("d-hnd", "decode", hnd)) is None

def test_pairing_compares_two_published_layouts_once_and_a_new_layout_again(monkeypatch):
    import kvmesh.services.router.worker_choice as worker_choice

    compared: list[tuple[str, str]] = []
    real = worker_choice.compare_layouts

    def counted(a: KVLayoutSpec, b: KVLayoutSpec) -> str | None:
        compared.append((a.dtype, b.dtype))
        return real(a, b)

    monkeypatch.setattr(worker_choice, "compare_layouts", counted)
    decode = worker("d1", "decode", spec())
    prefills = [worker("p1", "prefill", spec()), worker("p2", "prefill", spec(dtype="bfloat16"))]
    pairing = LayoutPairing()
    for _ in range(3):  # request after request
        kept, skipped = pairing.pairable(prefills, decode)
        assert [w.worker_id for w in kept] == ["p1"]
        assert skipped == {"p2": "p2's KV layout does not match d1's (dtype bfloat16 vs float32)"}
    assert compared == [("float32", "float32"), ("bfloat16", "float32")]
    # p2 restarted with another layout (a new record): compared anew, and now paired
    prefills[1] = worker("p2", "prefill", spec(), started_at=2.0)
    kept, skipped = pairing.pairable(prefills, decode)
    assert [w.worker_id for w in kept] == ["p1", "p2"] and skipped == {}
    assert compared[2:] == [("float32", "float32")]
    # bounded: full, it starts over (and still answers the same)
    monkeypatch.setattr(worker_choice, "MAX_COMPARED_LAYOUTS", 3)
    pairing.pairable([worker("p3", "prefill", spec(dtype="bfloat16"))], decode)
    assert len(pairing._compared) == 1
    assert pairing.pairable(prefills, decode)[0] == prefills


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

    async def no_matches(block_size: int) -> dict[str, int]:
        return {}

    routed = await backend._choose_prefill("a-0", list(range(40)), Excluded({}), None, span, workers["decode"][0], no_matches)
    assert routed is not None and routed[0].worker.worker_id == "p-ok"
    workers["prefill"] = workers["prefill"][:1]  # nobody it can pull from: the decode worker prefills itself
    assert await backend._choose_prefill("a-1", list(range(40)), Excluded({}), None, span, workers["decode"][0], no_matches) is None


def test_the_decode_worker_holding_most_of_the_prefix_is_chosen_unless_much_busier():
    workers = [record("d1"), record("d2"), record("d3")]
    board = LoadBoard()
    for worker_id, running in (("d1", 0), ("d2", 2), ("d3", 1)):
        board.update(report(worker_id, running))
    choice = kv_aware_decode(workers, board, (), {"d2": 5, "d3": 3})
    assert (choice.worker.worker_id, choice.cached_blocks) == ("d2", 5)  # 2 busier than d1: within the slack
    assert choice.reason == "holds 5 prefix blocks, 2 queued (least loaded 0) of 3"
    board.update(report("d2", 3))  # 3 busier: passed over for the next best holder
    assert kv_aware_decode(workers, board, (), {"d2": 5, "d3": 3}).worker.worker_id == "d3"
    assert kv_aware_decode(workers, board, {"d3"}, {"d2": 5, "d3": 3}).worker.worker_id == "d1"  # excluded: no holder left
    none = kv_aware_decode(workers, board, (), {})  # no hit anywhere: the least loaded, as before
    assert (none.worker.worker_id, none.cached_blocks) == ("d1", 0)
    for worker_id, running in (("d1", 10), ("d2", 14), ("d3", 16)):
        board.update(report(worker_id, running))  # busy: the slack grows with the load (half of 10)
    assert kv_aware_decode(workers, board, (), {"d2": 5, "d3": 7}).worker.worker_id == "d2"
    board.update(report("d2", 10))  # two holders of as much: the less loaded of them
    assert kv_aware_decode(workers, board, (), {"d1": 5, "d2": 5}).worker.worker_id in {"d1", "d2"}
    assert kv_aware_decode([], board, (), {"d1": 5}) is None


def test_a_decode_worker_prefills_itself_only_what_saves_work_and_is_short():
    # a follow-up turn: 5 blocks of 16 held by the decode worker, 3 by the best prefill worker
    why = local_prefill_reason(100, 16, 5, 3, 256)
    assert why == "the decode worker holds 5 prefix blocks (the best prefill worker 3); 20 tokens to prefill (at most 256)"
    assert local_prefill_reason(100, 16, 5, 5, 256) is None  # a tie: the prefill worker keeps the work
    assert local_prefill_reason(100, 16, 0, 0, 256) is None  # nothing cached anywhere
    assert local_prefill_reason(400, 16, 5, 3, 256) is None  # 320 tokens left: too long for the decode worker
    assert local_prefill_reason(336, 16, 5, 3, 256) is not None  # 256 left: still its
    assert local_prefill_reason(100, 16, 5, 3, 0) is None  # 0: off, today's routing


async def test_a_follow_up_whose_prefix_the_decode_worker_holds_is_prefilled_there(tiny_model_dir, monkeypatch):
    """The route of one attempt, from kv-metadata's answer: the decode worker holding the
    previous answer prefills a short rest itself; a long rest, a tie, prompt logprobs or the
    setting at 0 go to the prefill worker as before."""
    from types import SimpleNamespace

    from opentelemetry import trace

    from kvmesh.protocol import SamplingSpec
    from kvmesh.services.router.mesh_backend import MeshBackend
    from kvmesh.settings.mesh import MeshSettings

    backend = MeshBackend(MeshSettings("nats://127.0.0.1:1", ("127.0.0.1:1",)), model=str(tiny_model_dir))
    workers = {
        "prefill": [worker("p1", "prefill", spec())],
        "decode": [worker("d1", "decode", spec()), worker("d2", "decode", spec())],
        "kv-metadata": [],
    }
    backend.directory = SimpleNamespace(alive=lambda role: workers[role], workers={})  # type: ignore[assignment]
    held = {"p1": 4, "d2": 6}  # the prefill worker has the previous prompt, d2 the answer too
    queries: list[int] = []

    async def prefix_matches(prompt, block_size, span=None):
        queries.append(block_size)
        return {w: min(n, len(prompt) // block_size) for w, n in held.items()}

    monkeypatch.setattr(backend, "_prefix_matches", prefix_matches)
    span = trace.get_tracer("test").start_span("request")
    sampling = SamplingSpec(max_tokens=4)

    async def route(prompt_len: int, **overrides):
        deadline = asyncio.get_running_loop().time() + 5
        spec_ = sampling.model_copy(update=overrides)
        return await backend._route("a-0", list(range(prompt_len)), spec_, Excluded({}), None, span, deadline)

    follow_up = await route(6 * 16 + 30)  # 30 tokens past what d2 holds
    assert (follow_up.decode.worker.worker_id, follow_up.prefill, follow_up.reason) == ("d2", None, "decode_prefix")
    assert "30 tokens to prefill" in follow_up.decode.reason and queries == [16]  # one kv-metadata query for both choices
    long_rest = await route(6 * 16 + 300)
    assert (long_rest.decode.worker.worker_id, long_rest.prefill.worker.worker_id, long_rest.reason) == ("d2", "p1", "prefix_cache")
    with_logprobs = await route(6 * 16 + 30, prompt_logprobs=0)
    assert with_logprobs.prefill is not None and with_logprobs.reason == "prefix_cache"
    held["p1"] = 6  # as much on the prefill worker: it keeps the work
    assert (await route(6 * 16 + 30)).prefill is not None
    held["p1"] = 4
    backend.local_prefill_max_tokens = 0  # off: today's routing
    off = await route(6 * 16 + 30)
    assert off.prefill.worker.worker_id == "p1" and off.reason == "prefix_cache"
    assert off.decode.reason.startswith("least loaded")  # and the decode worker by load, as before
    workers["prefill"] = []  # no prefill worker at all: each decode worker prefills, its cache counts
    alone = await route(6 * 16 + 30)
    assert (alone.decode.worker.worker_id, alone.decode.cached_blocks, alone.reason) == ("d2", 6, "local_prefill")
