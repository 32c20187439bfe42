"""Scheduler + KVCacheManager driven without a model: made-up sampled tokens each step."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvmesh.engine.block_pool import BlockPool, BlockRemoved, BlockStored
from kvmesh.engine.kv_cache_manager import KVCacheManager
from kvmesh.engine.request import FinishReason, Request, RequestStatus, SamplingParams
from kvmesh.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput, max_model_len

BS = 4


def make(
    num_blocks: int = 32, *, max_num_seqs: int = 8, budget: int = 64, model_len: int | None = None, reserve_growth: bool = False
) -> Scheduler:
    """A scheduler over a pool of ``num_blocks``; admission by what fits now unless
    ``reserve_growth`` (most tests here drive preemption and batching by hand; the reserve's
    own tests turn it on)."""
    kv = KVCacheManager(BlockPool(num_blocks, block_size=BS), extra_keys=("m",))
    model_len = model_len if model_len is not None else num_blocks * BS
    return Scheduler(kv, SchedulerConfig(max_num_seqs, budget, model_len, reserve_growth))


def new_req(rid: str, prompt: list[int], max_tokens: int = 16, **kw: object) -> Request:
    eos = kw.pop("eos_token_ids", ())
    export = kw.pop("export_kv", False)
    return Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens, **kw), eos, export_kv=export)


def default_token(req: Request) -> int:
    return 1000 + req.num_output_tokens


def step(sched: Scheduler, token: Callable[[Request], int] = default_token) -> tuple[SchedulerOutput, list[tuple[str, int, bool]]]:
    """One engine step: schedule, then hand back one made-up token per sampling item."""
    out = sched.schedule()
    plan = [(item.request.request_id, item.num_new_tokens, item.samples) for item in out.scheduled]
    sampled = [token(item.request) for item in out.scheduled if item.samples]
    advanced = sched.update_from_output(out, sampled)
    assert [r.request_id for r in advanced] == [rid for rid, _, s in plan if s]
    return out, plan


def ids(sched: Scheduler, rid: str) -> list[int]:
    return sched.kv.block_ids(rid)


def waiting(sched: Scheduler) -> list[str]:
    return [r.request_id for r in sched.waiting]


def running(sched: Scheduler) -> list[str]:
    return [r.request_id for r in sched.running]


def test_max_model_len() -> None:
    assert max_model_len(2048, 100, 16) == 1600
    assert max_model_len(512, 100, 16) == 512


def test_chunked_prefill_under_token_budget() -> None:
    sched = make(budget=8, max_num_seqs=4)
    a = new_req("a", list(range(10)), max_tokens=3)
    b = new_req("b", list(range(100, 107)), max_tokens=3)
    sched.add_request(a)
    sched.add_request(b)
    assert waiting(sched) == ["a", "b"]

    _, plan = step(sched)
    assert plan == [("a", 8, False)]  # the budget is spent on a's first chunk; b waits
    assert (a.num_computed_tokens, a.num_output_tokens) == (8, 0)
    assert ids(sched, "a") == [0, 1]
    assert running(sched) == ["a"] and waiting(sched) == ["b"]
    assert a.status is RequestStatus.RUNNING and b.status is RequestStatus.WAITING

    _, plan = step(sched)
    assert plan == [("a", 2, True), ("b", 6, False)]  # a finishes its prompt and samples
    assert a.output_token_ids == [1000]
    assert (a.num_computed_tokens, b.num_computed_tokens) == (10, 6)
    assert ids(sched, "a") == [0, 1, 2] and ids(sched, "b") == [3, 4]

    _, plan = step(sched)
    assert plan == [("a", 1, True), ("b", 1, True)]

    _, plan = step(sched)
    assert plan == [("a", 1, True), ("b", 1, True)]
    assert a.is_finished and a.finish_reason is FinishReason.LENGTH
    assert a.output_token_ids == [1000, 1001, 1002]
    assert running(sched) == ["b"]

    _, plan = step(sched)
    assert plan == [("b", 1, True)]
    assert b.is_finished and b.output_token_ids == [1000, 1001, 1002]
    assert not sched.has_unfinished()
    assert sched.requests == {}
    # a freed 2,1,0 (tail first) at step 4, then b freed 5,4,3.
    assert sched.kv.pool.free_queue.block_ids()[-6:] == [2, 1, 0, 5, 4, 3]
    assert sched.kv.stats().num_in_use == 0

    # Nothing to do: an empty step.
    out = sched.schedule()
    assert out.scheduled == [] and out.preempted == [] and out.num_tokens == 0


def test_budget_caps_each_step_and_samples_only_at_the_end() -> None:
    sched = make(budget=5)
    a = new_req("a", list(range(13)), max_tokens=1)
    sched.add_request(a)
    plans = [step(sched)[1] for _ in range(3)]
    assert plans == [[("a", 5, False)], [("a", 5, False)], [("a", 3, True)]]
    assert a.is_finished and a.num_computed_tokens == 13
    assert a.num_cached_tokens == 0


def test_continuous_batching_new_request_joins_decoders() -> None:
    sched = make(budget=16)
    a = new_req("a", [1, 2, 3, 4, 5], max_tokens=8)
    b = new_req("b", [6, 7, 8], max_tokens=8)
    sched.add_request(a)
    sched.add_request(b)
    out, plan = step(sched)
    assert plan == [("a", 5, True), ("b", 3, True)]
    assert out.num_tokens == 8
    _, plan = step(sched)
    assert plan == [("a", 1, True), ("b", 1, True)]
    # c arrives while a and b decode; it joins the very next step with its whole prompt.
    c = new_req("c", list(range(50, 60)), max_tokens=2)
    sched.add_request(c)
    out, plan = step(sched)
    assert plan == [("a", 1, True), ("b", 1, True), ("c", 10, True)]
    assert out.num_tokens == 12
    assert running(sched) == ["a", "b", "c"]
    # A prompt bigger than what is left of the budget is chunked alongside the decoders.
    d = new_req("d", list(range(60, 80)), max_tokens=1)
    sched.add_request(d)
    _, plan = step(sched)
    assert plan == [("a", 1, True), ("b", 1, True), ("c", 1, True), ("d", 13, False)]
    assert c.is_finished and c.output_token_ids == [1000, 1001]
    _, plan = step(sched)
    assert plan == [("a", 1, True), ("b", 1, True), ("d", 7, True)]
    assert d.is_finished


def test_max_num_seqs_is_respected() -> None:
    sched = make(max_num_seqs=2)
    reqs = [new_req(f"r{i}", [10 * i + 1, 10 * i + 2], max_tokens=2) for i in range(3)]
    for r in reqs:
        sched.add_request(r)
    _, plan = step(sched)
    assert plan == [("r0", 2, True), ("r1", 2, True)]
    assert waiting(sched) == ["r2"]
    _, plan = step(sched)
    assert plan == [("r0", 1, True), ("r1", 1, True)]
    assert reqs[0].is_finished and reqs[1].is_finished
    assert waiting(sched) == ["r2"]  # admission happens in the next schedule
    _, plan = step(sched)
    assert plan == [("r2", 2, True)]


def test_preemption_of_most_recently_admitted_and_resume_with_hits() -> None:
    sched = make(6, max_num_seqs=2)
    a = new_req("a", list(range(8)), max_tokens=6)
    b = new_req("b", list(range(100, 106)), max_tokens=16)
    c = new_req("c", [200, 201, 202, 203], max_tokens=2)
    for r in (a, b, c):
        sched.add_request(r)
    kv, pool = sched.kv, sched.kv.pool

    _, plan = step(sched)  # c cannot run: max_num_seqs
    assert plan == [("a", 8, True), ("b", 6, True)]
    assert ids(sched, "a") == [0, 1] and ids(sched, "b") == [2, 3]
    for _ in range(4):  # a grows into block 4 (9th token), b into block 5 (9th token)
        out, plan = step(sched)
        assert plan == [("a", 1, True), ("b", 1, True)] and out.preempted == []
    assert ids(sched, "a") == [0, 1, 4] and ids(sched, "b") == [2, 3, 5]
    assert (a.num_tokens, b.num_tokens) == (13, 11)
    assert pool.num_free_blocks == 0
    b_hashes = list(b.block_hashes)
    assert len(b_hashes) == 2
    assert [pool.cached[h].block_id for h in b_hashes] == [2, 3]
    kv.take_events()

    # a needs a 4th block for its 13th token; the pool is empty: b (admitted last) goes.
    out, plan = step(sched)
    assert out.preempted == [b]
    assert plan == [("a", 1, True)]
    assert b.status is RequestStatus.WAITING and b.num_preemptions == 1
    assert b.num_computed_tokens == 0 and b.num_tokens == 11
    assert "b" not in kv.req_blocks
    assert waiting(sched) == ["b", "c"]  # back at the FRONT of the queue
    # b's blocks were freed tail first (5, 3, 2); a took the head, 5, b's unnamed partial
    # block, so nothing was evicted: b's full blocks are still cached.
    assert kv.take_events() == []
    # a reached max_tokens in that step and freed its blocks 5, 4, 1, 0 (tail first).
    assert a.is_finished and a.finish_reason is FinishReason.LENGTH
    assert pool.free_queue.block_ids() == [3, 2, 5, 4, 1, 0]

    # b resumes: its two full blocks are hits, only the 3 tokens after them are computed.
    out, plan = step(sched)
    assert plan == [("b", 3, True), ("c", 4, True)]
    assert ids(sched, "b") == [2, 3, 5]
    assert b.num_computed_tokens == 11 and b.num_tokens == 12
    assert b.num_cached_tokens == 0  # counted only at the first schedule
    assert b.output_token_ids == [1000, 1001, 1002, 1003, 1004, 1005]
    assert ids(sched, "c") == [4]  # evicts a's third block
    events = kv.take_events()
    assert events[0] == BlockRemoved((a.block_hashes[2],))
    assert events[1] == BlockStored((c.block_hashes[0],), None, (4,), BS)
    assert len(events) == 2
    assert running(sched) == ["b", "c"] and waiting(sched) == []
    while sched.has_unfinished():
        step(sched)
    assert b.output_token_ids == [1000 + i for i in range(16)]
    assert kv.stats().num_in_use == 0


def test_preempting_itself_when_it_is_the_last() -> None:
    sched = make(5)
    a = new_req("a", list(range(8)), max_tokens=4)
    b = new_req("b", list(range(100, 108)), max_tokens=4)
    sched.add_request(a)
    sched.add_request(b)
    _, plan = step(sched)
    assert plan == [("a", 8, True), ("b", 8, True)]
    # Both need a third block; only one is free: a gets it, b (last) preempts itself.
    out, plan = step(sched)
    assert plan == [("a", 1, True)]
    assert out.preempted == [b]
    assert ids(sched, "a") == [0, 1, 4]
    assert sched.kv.pool.free_queue.block_ids() == [3, 2]
    assert waiting(sched) == ["b"] and running(sched) == ["a"]
    assert b.num_tokens == 9 and b.num_computed_tokens == 0
    # While a runs, b cannot come back (its 2 hits are the only free blocks, it needs a 3rd).
    step(sched)
    step(sched)
    assert a.is_finished and waiting(sched) == ["b"]
    out, plan = step(sched)
    assert plan == [("b", 1, True)]  # 8 of 9 tokens are hits
    assert ids(sched, "b") == [2, 3, 4]
    assert b.num_computed_tokens == 9
    while sched.has_unfinished():
        step(sched)
    assert b.output_token_ids == [1000, 1001, 1002, 1003]
    assert sched.kv.stats().num_in_use == 0


def test_preemption_frees_victims_until_it_fits() -> None:
    sched = make(6, max_num_seqs=3)
    a = new_req("a", list(range(8)), max_tokens=8)
    b = new_req("b", [50, 51, 52], max_tokens=8)
    c = new_req("c", [60, 61, 62], max_tokens=8)
    for r in (a, b, c):
        sched.add_request(r)
    _, plan = step(sched)
    assert plan == [("a", 8, True), ("b", 3, True), ("c", 3, True)]
    assert [ids(sched, r) for r in "abc"] == [[0, 1], [2], [3]]
    sched.kv.allocate_held("import", 8)  # blocks 4 and 5 go to an import
    # a needs block 3 of its own: c goes first; its freed block is then enough.
    out, plan = step(sched)
    assert out.preempted == [c]
    assert plan == [("a", 1, True), ("b", 1, True)]
    assert ids(sched, "a") == [0, 1, 3]
    assert waiting(sched) == ["c"] and running(sched) == ["a", "b"]
    sched.kv.release_held("import")


def test_finish_on_eos() -> None:
    sched = make()
    r = new_req("r", [1, 2, 3], eos_token_ids=(7, 9))
    sched.add_request(r)
    tokens = iter([5, 9, 4])
    step(sched, lambda _: next(tokens))
    assert not r.is_finished
    step(sched, lambda _: next(tokens))
    assert r.is_finished and r.finish_reason is FinishReason.STOP
    assert r.output_token_ids == [5, 9]  # the eos token is kept
    assert sched.kv.stats().num_in_use == 0


def test_finish_on_stop_token_ids() -> None:
    sched = make()
    r = new_req("r", [1, 2, 3], stop_token_ids=[42], eos_token_ids=(7,))
    sched.add_request(r)
    tokens = iter([41, 42])
    step(sched, lambda _: next(tokens))
    step(sched, lambda _: next(tokens))
    assert r.finish_reason is FinishReason.STOP and r.output_token_ids == [41, 42]


def test_ignore_eos() -> None:
    sched = make()
    r = new_req("r", [1, 2, 3], max_tokens=3, ignore_eos=True, stop_token_ids=(8,), eos_token_ids=(7,))
    sched.add_request(r)
    step(sched, lambda _: 7)
    step(sched, lambda _: 7)
    assert not r.is_finished
    step(sched, lambda _: 7)
    assert r.finish_reason is FinishReason.LENGTH and r.output_token_ids == [7, 7, 7]
    # Stop token ids still stop with ignore_eos.
    s = new_req("s", [1, 2, 3], max_tokens=3, ignore_eos=True, stop_token_ids=(8,), eos_token_ids=(7,))
    sched.add_request(s)
    step(sched, lambda _: 8)
    assert s.finish_reason is FinishReason.STOP and s.output_token_ids == [8]


def test_finish_on_max_tokens() -> None:
    sched = make()
    r = new_req("r", [1, 2, 3], max_tokens=1)
    sched.add_request(r)
    step(sched)
    assert r.finish_reason is FinishReason.LENGTH and r.output_token_ids == [1000]
    assert r.status is RequestStatus.FINISHED


def test_finish_on_max_model_len() -> None:
    sched = make(model_len=12)
    with pytest.raises(ValueError, match="at most 11 prompt tokens"):
        sched.add_request(new_req("long", list(range(12))))
    assert sched.requests == {} and not sched.waiting
    r = new_req("r", list(range(10)), max_tokens=100)
    sched.add_request(r)
    step(sched)
    assert not r.is_finished
    step(sched)
    assert r.is_finished and r.finish_reason is FinishReason.LENGTH
    assert r.num_tokens == 12 and r.num_output_tokens == 2
    # The longest prompt accepted produces exactly one token.
    s = new_req("s", list(range(11)), max_tokens=100)
    sched.add_request(s)
    step(sched)
    assert s.finish_reason is FinishReason.LENGTH and s.num_tokens == 12


def test_abort_waiting_and_running() -> None:
    sched = make(max_num_seqs=1)
    a = new_req("a", list(range(10)))
    b = new_req("b", list(range(20, 30)))
    sched.add_request(a)
    sched.add_request(b)
    step(sched)
    assert running(sched) == ["a"] and waiting(sched) == ["b"]
    # Abort the waiting one: it leaves the queue, holds nothing.
    assert sched.abort("b") is b
    assert b.status is RequestStatus.FINISHED and b.finish_reason is FinishReason.ABORT
    assert waiting(sched) == [] and "b" not in sched.requests
    assert sched.abort("b") is None
    assert sched.abort("nobody") is None
    # Abort the running one: its blocks go back tail first.
    assert ids(sched, "a") == [0, 1, 2]
    assert sched.abort("a") is a
    assert a.finish_reason is FinishReason.ABORT
    assert running(sched) == [] and not sched.has_unfinished()
    assert sched.kv.pool.free_queue.block_ids()[-3:] == [2, 1, 0]
    assert sched.kv.req_blocks == {} and sched.kv.stats().num_in_use == 0
    # An aborted id can be used again.
    sched.add_request(new_req("a", [1]))


def test_abort_preempted_request_in_waiting() -> None:
    sched = make(5)
    a = new_req("a", list(range(8)))
    b = new_req("b", list(range(100, 108)))
    sched.add_request(a)
    sched.add_request(b)
    step(sched)
    out, _ = step(sched)
    assert out.preempted == [b]
    sched.abort("b")
    assert waiting(sched) == [] and b.finish_reason is FinishReason.ABORT
    sched.abort("a")
    assert sched.kv.stats().num_in_use == 0


def test_export_kv_finishes_after_one_token_with_blocks_held() -> None:
    sched = make()
    kv = sched.kv
    e = new_req("e", list(range(10)), max_tokens=50, export_kv=True)
    sched.add_request(e)
    _, plan = step(sched)
    assert plan == [("e", 10, True)]
    assert e.is_finished and e.finish_reason is FinishReason.LENGTH
    assert e.output_token_ids == [1000]
    assert "e" not in kv.req_blocks and "e" not in sched.requests
    assert [b.block_id for b in kv.held["e"]] == [0, 1, 2]
    assert [b.ref_cnt for b in kv.held["e"]] == [1, 1, 1]
    assert kv.stats().num_held == 3 and kv.stats().num_in_use == 3
    # Its full blocks are prefix hits for a follow-up while held.
    f = new_req("f", list(range(10)), max_tokens=1)
    sched.add_request(f)
    _, plan = step(sched)
    assert plan == [("f", 2, True)]
    assert f.num_cached_tokens == 8 and f.is_finished
    assert kv.release_held("e") is True
    assert kv.held == {} and kv.stats().num_in_use == 0


def test_export_kv_with_chunked_prefill_and_abort() -> None:
    sched = make(budget=4)
    e = new_req("e", list(range(10)), export_kv=True)
    sched.add_request(e)
    plans = [step(sched)[1] for _ in range(3)]
    assert plans == [[("e", 4, False)], [("e", 4, False)], [("e", 2, True)]]
    assert [b.block_id for b in sched.kv.held["e"]] == [0, 1, 2]
    sched.kv.release_held("e")
    # An aborted export frees its blocks instead of holding them.
    g = new_req("g", list(range(20, 30)), export_kv=True)
    sched.add_request(g)
    assert step(sched)[1] == [("g", 4, False)]
    sched.abort("g")
    assert sched.kv.held == {} and sched.kv.stats().num_in_use == 0


def test_duplicate_request_id_raises() -> None:
    sched = make()
    sched.add_request(new_req("x", [1, 2]))
    with pytest.raises(ValueError, match="already in use"):
        sched.add_request(new_req("x", [3, 4]))
    with pytest.raises(ValueError, match="already in use"):
        sched.add_running(new_req("x", [3, 4]))
    step(sched)
    with pytest.raises(ValueError, match="already in use"):
        sched.add_request(new_req("x", [3, 4]))
    assert waiting(sched) == [] and running(sched) == ["x"]


def test_too_long_prompt_raises() -> None:
    sched = make(4)  # 16 tokens of pool: at most 15 prompt tokens
    with pytest.raises(ValueError, match="16 tokens"):
        sched.add_request(new_req("x", list(range(16))))
    with pytest.raises(ValueError):
        sched.add_request(new_req("y", list(range(40))))
    sched.add_request(new_req("z", list(range(15))))
    assert waiting(sched) == ["z"]


def test_add_running_decodes_an_attached_import() -> None:
    sched = make()
    kv = sched.kv
    assert kv.allocate_held("h", 6) == [0, 1]
    r = new_req("r", [1, 2, 3, 4, 5, 6], max_tokens=3)
    kv.attach_held("h", r, 6)
    r.token_ids.append(77)  # the first token came with the KV
    sched.add_running(r)
    _, plan = step(sched)
    assert plan == [("r", 1, True)]
    assert r.num_computed_tokens == 7 and r.output_token_ids == [77, 1001]
    _, plan = step(sched)
    assert r.is_finished and r.output_token_ids == [77, 1001, 1002]
    assert kv.stats().num_in_use == 0


def test_reused_export_id_while_held_does_not_leak_blocks() -> None:
    sched = make()
    kv = sched.kv
    first = new_req("x", list(range(10)), export_kv=True)
    sched.add_request(first)
    step(sched)
    first_blocks = list(kv.held["x"])
    assert [b.block_id for b in first_blocks] == [0, 1, 2]
    # The id is free in the scheduler again while the export is still held (the peer has
    # not pulled it yet): a retry of the same prefill with the same id is accepted.
    try:
        sched.add_request(new_req("x", list(range(50, 60)), export_kv=True))
        step(sched)
    except ValueError:
        pass  # refusing the reuse would be a fine fix too
    held_blocks = {id(b) for blocks in kv.held.values() for b in blocks}
    owned = {id(b) for blocks in kv.req_blocks.values() for b in blocks}
    for block in first_blocks:
        assert block.ref_cnt == 0 or id(block) in held_blocks | owned, f"block {block.block_id} leaked"


def test_engine_import_with_duplicate_waiting_id_changes_nothing() -> None:
    from types import SimpleNamespace

    from kvmesh.engine.llm_engine import LLMEngine

    # Only what add_imported_request touches before it fails; no model is loaded.
    engine = LLMEngine.__new__(LLMEngine)
    engine.model_config = SimpleNamespace(vocab_size=1000)
    engine.eos_token_ids = (0,)
    engine.max_model_len = 64
    engine.scheduler = sched = make(16)
    engine.kv_manager = kv = sched.kv
    engine._texts = {}

    waiting_x = new_req("x", list(range(1, 11)))
    sched.add_request(waiting_x)
    assert engine.allocate_import("h", 8) == [0, 1]
    import_prompt = list(range(100, 108))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_imported_request("x", import_prompt, 5, "h")
    # A call that raised should leave the import held (releasable) and "x" without blocks.
    assert [b.block_id for b in kv.held.get("h", [])] == [0, 1], (kv.held, kv.block_ids("x"))
    assert "x" not in kv.req_blocks


def test_a_resumed_request_is_queued_first() -> None:
    sched = make(max_num_seqs=1)
    for rid in ("a", "b"):
        sched.add_request(new_req(rid, [1, 2], max_tokens=2))
    sched.add_request(new_req("resumed", [3, 4], max_tokens=2), first=True)
    assert waiting(sched) == ["resumed", "a", "b"]
    _, plan = step(sched)
    assert plan == [("resumed", 2, True)]
