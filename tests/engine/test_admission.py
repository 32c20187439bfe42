"""Admission that keeps KV blocks back for the running requests' growth
(``kvmesh.engine.admission``), driven through the scheduler without a model."""

from __future__ import annotations

from kvmesh.engine.admission import BOOST_STEPS, CLIP_TOKENS, INITIAL_USAGE, Growth, GrowthReserve
from kvmesh.engine.request import FinishReason

from tests.engine.test_scheduler import BS, make, new_req, running, step, waiting


def run_all(sched, reqs) -> int:
    """Add ``reqs``, step until all are done; the preemptions it took."""
    for r in reqs:
        sched.add_request(r)
    steps = 0
    while sched.has_unfinished():
        step(sched)
        steps += 1
        assert steps < 1000
    return sum(r.num_preemptions for r in reqs)


def three_requests() -> list:
    # each: 8 prompt tokens and 8 forced new ones, 4 blocks in all; the pool has 10
    return [new_req(n, [10 * i + t for t in range(8)], max_tokens=8, ignore_eos=True) for i, n in enumerate("abc")]


def test_a_request_is_admitted_only_where_the_running_ones_can_grow() -> None:
    sched = make(10, reserve_growth=True)
    sched.reserve.usages.append(1.0)  # requests here use their whole allowance
    a, b, c = three_requests()
    for r in (a, b, c):
        sched.add_request(r)
    _, plan = step(sched)
    # a and b: 2 blocks each now, 2 more each later (8 of 10); c's 4 would not fit beside
    assert plan == [("a", 8, True), ("b", 8, True)]
    assert waiting(sched) == ["c"]
    assert sched.reserved_blocks == 4 and sched.kv.pool.num_free_blocks == 6  # what c waits for (the gauge)
    while not a.is_finished:
        out, _ = step(sched)
        assert out.preempted == []
    _, plan = step(sched)
    assert ("c", 8, True) in plan
    while sched.has_unfinished():
        out, _ = step(sched)
        assert out.preempted == []
    assert [r.output_token_ids for r in (a, b, c)] == [[1000 + i for i in range(8)]] * 3
    assert sched.kv.stats().num_in_use == 0 and sched.reserved_blocks == 0  # nobody waits: nothing kept back


def a_retry_arrives(prior_output_tokens: int):
    """a and b running, d waiting for the reserve, then c queued as a retry (``first``) whose
    prompt ends with ``prior_output_tokens`` tokens an earlier attempt sent: the scheduler and
    the four requests."""
    sched = make(10, reserve_growth=True)
    sched.reserve.usages.append(1.0)
    a, b, _ = three_requests()
    c = new_req("c", [20 + t for t in range(8)], max_tokens=8, ignore_eos=True, prior_output_tokens=prior_output_tokens)
    d = new_req("d", [40 + t for t in range(8)], max_tokens=8, ignore_eos=True)
    for r in (a, b, d):
        sched.add_request(r)
    step(sched)
    assert running(sched) == ["a", "b"] and waiting(sched) == ["d"]
    sched.add_request(c, first=True)
    return sched, (a, b, c, d)


def test_a_resumed_stream_is_not_held_back() -> None:
    # a stream whose worker died is mid-answer: it goes first and is admitted where its
    # prompt fits now, even where the reserve would keep a new request waiting
    sched, reqs = a_retry_arrives(prior_output_tokens=2)
    assert reqs[2].mid_answer
    _, plan = step(sched)
    assert ("c", 8, True) in plan and waiting(sched) == ["d"]
    assert sched.reserved_blocks > 0  # d still waits for the reserve
    run_all(sched, [])
    assert [r.output_token_ids for r in reqs] == [[1000 + i for i in range(8)]] * 4
    assert sched.kv.stats().num_in_use == 0


def test_a_retry_that_sent_nothing_goes_first_but_waits_for_the_reserve() -> None:
    # a retry of a request whose worker was too busy (``--prefill 0``: no token sent yet) is
    # queued ahead of new work but admitted by the same rule: else overloaded retries would
    # fill the pool past what the running requests need to grow, and preempt each other
    sched, reqs = a_retry_arrives(prior_output_tokens=0)
    assert not reqs[2].mid_answer and waiting(sched) == ["c", "d"]
    _, plan = step(sched)
    assert all(rid != "c" for rid, _, _ in plan) and waiting(sched) == ["c", "d"]
    run_all(sched, [])
    assert sum(r.num_preemptions for r in reqs) == 0
    assert [r.output_token_ids for r in reqs] == [[1000 + i for i in range(8)]] * 4
    assert sched.kv.stats().num_in_use == 0


def test_without_the_reserve_the_same_requests_preempt() -> None:
    assert run_all(make(10, reserve_growth=False), three_requests()) > 0
    sched = make(10, reserve_growth=True)
    sched.reserve.usages.append(1.0)
    assert run_all(sched, three_requests()) == 0


def test_the_first_request_runs_whatever_it_may_need() -> None:
    # alone, a request is admitted even where its allowance is more than the pool
    sched = make(4, reserve_growth=True, model_len=64)
    sched.reserve.usages.append(1.0)
    a = new_req("a", list(range(8)), max_tokens=50)
    sched.add_request(a)
    _, plan = step(sched)
    assert plan == [("a", 8, True)] and running(sched) == ["a"]


def test_the_ratio_learns_from_finished_requests() -> None:
    growth = GrowthReserve(max_model_len=1000, block_size=BS)
    assert growth.ratio == INITIAL_USAGE
    for used in (10, 30):
        r = new_req(f"r{used}", [1, 2, 3], max_tokens=100)
        r.token_ids += [5] * used
        r.finish_reason = FinishReason.STOP
        growth.finished(r)
    assert growth.ratio == 0.2  # 10 and 30 of 100
    aborted = new_req("x", [1, 2], max_tokens=100)
    aborted.finish_reason = FinishReason.ABORT
    growth.finished(aborted)  # an abort says nothing of how long answers are
    assert growth.ratio == 0.2
    growth.preempted()
    assert growth.ratio == 1.0
    for _ in range(BOOST_STEPS // 2):
        growth.stepped()
    assert abs(growth.ratio - 0.5) < 0.01
    for _ in range(BOOST_STEPS):
        growth.stepped()
    assert growth.ratio == 0.2


def test_what_a_request_may_still_need() -> None:
    growth = GrowthReserve(max_model_len=10_000, block_size=BS)
    r = new_req("r", list(range(10)), max_tokens=20)
    assert growth.allowance(r) == 20
    assert growth.growth(r, 0, 1.0) == Growth(20, 10, 0)
    assert growth.peak_blocks([growth.growth(r, 0, 1.0)]) == 8  # 30 tokens
    assert growth.peak_blocks([growth.growth(r, 3, 0.5)]) == 2  # 20 tokens, 3 blocks held
    r.token_ids += [7] * 5
    assert growth.allowance(r) == 15
    assert growth.allowance(new_req("long", [1], max_tokens=100_000)) == CLIP_TOKENS
    assert GrowthReserve(max_model_len=20, block_size=BS).allowance(r) == 5  # the model's length: 20 - 15 tokens
    assert growth.allowance(new_req("p", [1, 2, 3], max_tokens=20, export_kv=True)) == 0


def test_a_preemption_makes_admission_careful_again() -> None:
    sched = make(10, reserve_growth=True)
    sched.reserve.usages.append(0.0)  # as if every answer so far stopped at once: no reserve
    assert run_all(sched, three_requests()) > 0
    assert sched.reserve.boost > 0.9  # boosted by the preemptions, barely decayed


def test_blocks_a_finished_request_gives_back_count_for_the_others() -> None:
    growth = GrowthReserve(max_model_len=1000, block_size=BS)
    # a: 14 tokens in 4 blocks, 2 to go (it ends in the blocks it has); b and c: 8 tokens, 8 to go
    a, b, c = Growth(2, 14, 4), Growth(8, 8, 2), Growth(8, 8, 0)
    # two steps ahead b and c need 1 and 3 more; at the end 2 and 4, when a has given back 4
    assert growth.peak_blocks([a, b, c]) == 4
    # kept apart (every request at its whole length at once) they would need 0 + 2 + 4 = 6
    assert sum(growth.peak_blocks([g]) for g in (a, b, c)) == 6
    assert growth.peak_blocks([]) == 0


def test_requests_at_different_stages_share_the_pool() -> None:
    # a is 2 tokens from its end when b and c arrive: c fits beside a and b only because a
    # gives its blocks back before b and c need them, and nothing is preempted
    sched = make(10, reserve_growth=True)
    sched.reserve.usages.append(1.0)
    a = new_req("a", list(range(8)), max_tokens=8, ignore_eos=True)
    sched.add_request(a)
    for _ in range(6):  # a: 8 prompt tokens and 6 new
        step(sched)
    b = new_req("b", list(range(20, 28)), max_tokens=8, ignore_eos=True)
    c = new_req("c", list(range(40, 48)), max_tokens=8, ignore_eos=True)
    sched.add_request(b)
    sched.add_request(c)
    _, plan = step(sched)
    assert plan == [("a", 1, True), ("b", 8, True), ("c", 8, True)]
    while sched.has_unfinished():
        out, _ = step(sched)
        assert out.preempted == []
    assert [r.output_token_ids for r in (a, b, c)] == [[1000 + i for i in range(8)]] * 3
    assert sched.kv.stats().num_in_use == 0


def imported(sched, rid: str, prompt: list[int], max_tokens: int = 8):
    """What ``LLMEngine.add_imported_request`` does with the blocks of ``take_import(rid)``:
    the prompt's KV in them and the first token, made where the prompt was."""
    req = new_req(rid, prompt, max_tokens=max_tokens, ignore_eos=True)
    sched.kv.attach_held(rid, req, len(prompt))
    req.token_ids.append(1000)
    sched.add_running(req)
    return req


def test_an_import_takes_blocks_only_where_the_running_ones_can_grow() -> None:
    # a decode worker: a and b run from imported KV (8 prompt tokens, 8 to make: 4 blocks
    # each in the end); c's import would leave a free block for each of them to grow into,
    # but they need 2 more each and c 4 in all: it waits for a's end
    sched = make(10, reserve_growth=True)
    sched.reserve.usages.append(1.0)
    prompts = {n: [10 * i + t for t in range(8)] for i, n in enumerate("abc")}
    a, b = [imported(sched, n, prompts[n]) for n in "ab" if sched.take_import(n, 8, 8) is not None]
    step(sched)
    free = sched.kv.pool.num_free_blocks
    assert free - 2 >= len(sched.running)  # the decode worker's own check lets c in
    assert sched.take_import("c", 8, 8) is None and sched.kv.pool.num_free_blocks == free
    while not a.is_finished:
        out, _ = step(sched)
        assert out.preempted == []
    assert sched.take_import("c", 8, 8) is not None
    c = imported(sched, "c", prompts["c"])
    while sched.has_unfinished():
        out, _ = step(sched)
        assert out.preempted == []
    assert [r.output_token_ids for r in (a, b, c)] == [[1000 + i for i in range(8)]] * 3
    assert sched.kv.stats().num_in_use == 0 and sched.importing == {}


def test_imports_on_their_way_count_and_stop_counting_when_given_back() -> None:
    sched = make(10, reserve_growth=True)
    sched.reserve.usages.append(1.0)
    assert sched.take_import("x", 8, 8) == [0, 1]  # nothing running: taken
    assert sched.take_import("y", 8, 8) is not None  # x will need 2 more blocks, y 4: 6 of 8
    assert sched.take_import("z", 8, 8) is None  # 2 + 2 + 4 more than the 6 free
    assert sched.take_import("resumed", 8, 8, resumed=True) is not None  # mid-answer: only the blocks
    assert "resumed" in sched.importing  # its growth counts for the others
    assert sched.take_import("prefix", 8, None) is not None and "prefix" not in sched.importing  # a borrowed prefix
    sched.kv.release_held("prefix")
    sched.kv.release_held("resumed")
    sched.kv.release_held("x")  # its pull failed
    assert sched.take_import("z", 8, 8) is not None and set(sched.importing) == {"y", "z"}
    sched.kv.release_held("y")
    sched.kv.release_held("z")
    assert sched.kv.stats().num_in_use == 0


def test_an_import_waits_behind_the_waiting_requests() -> None:
    # a preempted request (or the decode worker's own prefill) waits: an import does not
    # take the blocks it waits for
    sched = make(10, reserve_growth=True)
    sched.reserve.usages.append(1.0)
    a, b, c = three_requests()
    for r in (a, b, c):
        sched.add_request(r)
    step(sched)
    assert waiting(sched) == ["c"] and sched.kv.pool.num_free_blocks >= 2
    assert sched.take_import("d", 4, 1) is None
    while sched.has_unfinished():
        step(sched)
    assert sched.take_import("d", 4, 1) is not None


def test_without_the_reserve_an_import_takes_what_fits() -> None:
    sched = make(4, reserve_growth=False)
    assert sched.take_import("x", 8, 100) == [0, 1] and sched.take_import("y", 8, 100) == [2, 3]
    assert set(sched.importing) == {"x", "y"} and sched.take_import("z", 4, 1) is None


def test_an_import_needs_a_seat_in_the_batch() -> None:
    # max_num_seqs 2: a and b run from imports; c's blocks would fit, but the batch is full
    # (imports on their way hold their seat too) until one of them ends; a resumed stream,
    # mid-answer, is not held back
    sched = make(32, max_num_seqs=2)
    prompts = {n: [10 * i + t for t in range(8)] for i, n in enumerate("abc")}
    assert sched.take_import("a", 8, 8) is not None
    a = imported(sched, "a", prompts["a"])
    assert sched.take_import("b", 8, 8) is not None  # on its way: its seat is taken
    assert sched.take_import("c", 8, 8) is None
    assert sched.take_import("resumed", 8, 8, resumed=True) is not None
    sched.kv.release_held("resumed")
    b = imported(sched, "b", prompts["b"])
    assert sched.take_import("c", 8, 8) is None
    while not a.is_finished:
        out, _ = step(sched)
        assert len(sched.running) <= 2
    assert sched.take_import("c", 8, 8) is not None
    c = imported(sched, "c", prompts["c"])
    while sched.has_unfinished():
        step(sched)
        assert len(sched.running) <= 2
    assert [r.output_token_ids for r in (a, b, c)] == [[1000 + i for i in range(8)]] * 3
    assert sched.kv.stats().num_in_use == 0 and sched.importing == {}
