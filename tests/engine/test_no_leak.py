"""Randomized Scheduler + KVCacheManager runs: no block is leaked, no cached block lies.

No model: each step writes the scheduled tokens into a shadow copy of the KV blocks (one
token id per slot) and samples made-up tokens. After every step the pool's bookkeeping is
checked against the requests and held sets, and every token a request counts as computed,
and every cached block, must hold the right tokens (so a prefix hit on a stale or reused
block is caught). At the end everything is finished and released, and the pool must be
back to all-free.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field

import pytest

from kvmesh.engine.block_pool import BlockPool
from kvmesh.engine.kv_cache_manager import KVCacheManager
from kvmesh.engine.request import Request, RequestStatus, SamplingParams
from kvmesh.engine.scheduler import Scheduler, SchedulerConfig

BS = 4
NUM_BLOCKS = 24
MAX_MODEL_LEN = 64
EOS = 0
VOCAB = 40
NUM_REQUESTS = 40


@dataclass
class Counts:
    preemptions: int = 0
    hits_first: int = 0  # requests whose first admission found prefix hits
    hits_resume: int = 0  # preempted requests that came back with hits
    exports: int = 0
    imports_attached: int = 0
    imports_released: int = 0
    aborts: int = 0
    finished: Counter = field(default_factory=Counter)


def check_pool(kv: KVCacheManager, shadow: dict[int, list[int | None]], requests: dict[str, Request],
               hash_tokens: dict[int, tuple[int, ...]]) -> None:
    pool = kv.pool
    # Reference counts are exactly the references held by requests and held sets.
    refs: Counter[int] = Counter()
    for blocks in (*kv.req_blocks.values(), *kv.held.values()):
        refs.update(b.block_id for b in blocks)
    assert {b.block_id: b.ref_cnt for b in pool.blocks} == {i: refs[i] for i in range(pool.num_blocks)}
    # The free list holds exactly the unreferenced blocks, once each.
    free = pool.free_queue.block_ids()
    assert len(free) == len(set(free)) == len(pool.free_queue)
    assert set(free) == {b.block_id for b in pool.blocks if b.ref_cnt == 0}
    # The hash index and the blocks' names agree.
    assert all(block.block_hash == h for h, block in pool.cached.items())
    assert {b.block_hash for b in pool.blocks if b.block_hash is not None} == set(pool.cached)
    # Every cached block holds the tokens its hash names.
    for h, block in pool.cached.items():
        assert tuple(shadow[block.block_id]) == hash_tokens[h], f"cached block {block.block_id} is stale"
    # Every token a request counts as computed is in its blocks.
    for rid, blocks in kv.req_blocks.items():
        req = requests[rid]
        assert len(blocks) * BS >= req.num_computed_tokens
        for pos in range(req.num_computed_tokens):
            assert shadow[blocks[pos // BS].block_id][pos % BS] == req.token_ids[pos], (rid, pos)


def remember_hashes(req: Request, hash_tokens: dict[int, tuple[int, ...]]) -> None:
    for i, h in enumerate(req.block_hashes):
        hash_tokens[h] = tuple(req.token_ids[i * BS : (i + 1) * BS])


def simulate(seed: int, budget: int = 24, max_num_seqs: int = 6, num_blocks: int = NUM_BLOCKS, reserve_growth: bool = False) -> Counts:
    assert num_blocks * BS >= MAX_MODEL_LEN  # a lone request always fits
    rng = random.Random(seed)
    kv = KVCacheManager(BlockPool(num_blocks, block_size=BS), extra_keys=("sim",))
    # admission by what fits now by default: it preempts more, which is what these runs are for
    sched = Scheduler(kv, SchedulerConfig(max_num_seqs, budget, MAX_MODEL_LEN, reserve_growth))
    shadow: dict[int, list[int | None]] = {i: [None] * BS for i in range(num_blocks)}
    hash_tokens: dict[int, tuple[int, ...]] = {}
    all_reqs: dict[str, Request] = {}
    prefixes = [[rng.randrange(1, VOCAB) for _ in range(n)] for n in (8, 12, 5, 16)]
    releases: list[tuple[int, str]] = []  # (step, handle) of held blocks to release
    counts = Counts()
    made = 0

    def new_prompt() -> list[int]:
        prefix = rng.choice(prefixes) if rng.random() < 0.7 else []
        return prefix + [rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 20))]

    def sample(req: Request) -> int:
        return EOS if rng.random() < 0.03 else rng.randrange(1, VOCAB)

    step_no = 0
    while made < NUM_REQUESTS or sched.has_unfinished() or kv.held:
        step_no += 1
        assert step_no < 3000, "the simulation does not make progress"

        # Arrivals.
        while made < NUM_REQUESTS and rng.random() < 0.5:
            rid = f"r{made}"
            made += 1
            if rng.random() < 0.1:
                # A disaggregated import: a peer writes a prompt's KV into held blocks.
                prompt = new_prompt()
                handle = f"imp-{rid}"
                block_ids = kv.allocate_held(handle, len(prompt))
                if block_ids is None:
                    continue
                for pos, token in enumerate(prompt):
                    shadow[block_ids[pos // BS]][pos % BS] = token
                if rng.random() < 0.7:
                    req = Request(rid, prompt, SamplingParams(max_tokens=rng.randint(1, 12)), (EOS,))
                    kv.attach_held(handle, req, len(prompt))
                    req.token_ids.append(rng.randrange(1, VOCAB))
                    remember_hashes(req, hash_tokens)
                    all_reqs[rid] = req
                    sched.add_running(req)
                    counts.imports_attached += 1
                else:
                    releases.append((step_no + rng.randint(0, 5), handle))
                    counts.imports_released += 1
                continue
            params = SamplingParams(
                max_tokens=rng.randint(1, 24),
                ignore_eos=rng.random() < 0.1,
                stop_token_ids=(rng.randrange(1, VOCAB),) if rng.random() < 0.2 else (),
            )
            req = Request(rid, new_prompt(), params, (EOS,), export_kv=rng.random() < 0.15)
            all_reqs[rid] = req
            sched.add_request(req)

        # Random aborts, of waiting and running requests alike.
        if sched.requests and rng.random() < 0.05:
            rid = rng.choice(sorted(sched.requests))
            assert sched.abort(rid) is all_reqs[rid]
            counts.aborts += 1
            counts.finished["abort"] += 1

        # Released exports and imports.
        for entry in [e for e in releases if e[0] <= step_no]:
            releases.remove(entry)
            assert kv.release_held(entry[1]) is True

        # One step.
        was_waiting = {r.request_id for r in sched.waiting}
        out = sched.schedule()
        counts.preemptions += len(out.preempted)
        for item in out.scheduled:
            req = item.request
            if req.request_id in was_waiting and req.num_computed_tokens > 0:
                if req.num_preemptions:
                    counts.hits_resume += 1
                else:
                    counts.hits_first += 1
            blocks = kv.req_blocks[req.request_id]
            for pos in range(req.num_computed_tokens, req.num_computed_tokens + item.num_new_tokens):
                shadow[blocks[pos // BS].block_id][pos % BS] = req.token_ids[pos]
            remember_hashes(req, hash_tokens)
        sampled = [sample(item.request) for item in out.scheduled if item.samples]
        sched.update_from_output(out, sampled)
        for item in out.scheduled:
            req = item.request
            if req.is_finished:
                counts.finished[req.finish_reason] += 1
                if req.request_id in kv.held:
                    counts.exports += 1
                    releases.append((step_no + rng.randint(0, 8), req.request_id))
        check_pool(kv, shadow, sched.requests, hash_tokens)

    # Everything finished and released: the pool is whole again.
    assert not sched.has_unfinished() and sched.requests == {}
    assert all(r.status is RequestStatus.FINISHED for r in all_reqs.values())
    pool = kv.pool
    assert [b.ref_cnt for b in pool.blocks] == [0] * num_blocks
    assert sorted(pool.free_queue.block_ids()) == list(range(num_blocks))
    assert len(pool.free_queue) == num_blocks
    assert all(block.block_hash == h for h, block in pool.cached.items())
    assert kv.req_blocks == {} and kv.held == {} and kv._num_named == {}
    stats = kv.stats()
    assert stats.num_in_use == 0 and stats.num_held == 0 and stats.num_free == num_blocks
    assert releases == []
    return counts


@pytest.mark.parametrize("seed", range(20))
def test_no_leak_randomized(seed: int) -> None:
    counts = simulate(seed)
    # Each run must exercise the interesting paths, or the test would pass vacuously.
    assert counts.preemptions > 0, counts
    assert counts.hits_first > 0, counts
    assert counts.hits_resume > 0, counts
    assert counts.exports > 0, counts
    assert sum(counts.finished.values()) > NUM_REQUESTS // 2, counts


@pytest.mark.parametrize("seed", range(200, 210))
def test_no_leak_randomized_with_the_growth_reserve(seed: int) -> None:
    # the engine's default admission: the same paths, the pool whole again afterwards
    counts = simulate(seed, reserve_growth=True)
    assert counts.exports > 0 and sum(counts.finished.values()) > NUM_REQUESTS // 2, counts


@pytest.mark.parametrize("seed", range(100, 110))
def test_no_leak_randomized_small_budget(seed: int) -> None:
    # A budget of 6 tokens: long chunked prefills, running requests starved of budget.
    counts = simulate(seed, budget=6, max_num_seqs=4, num_blocks=16)
    assert counts.preemptions > 0 and counts.hits_first > 0, counts


def test_randomized_runs_cover_all_paths() -> None:
    totals = Counts()
    for seed in range(20):
        c = simulate(seed)
        totals.preemptions += c.preemptions
        totals.hits_first += c.hits_first
        totals.hits_resume += c.hits_resume
        totals.exports += c.exports
        totals.imports_attached += c.imports_attached
        totals.imports_released += c.imports_released
        totals.aborts += c.aborts
        totals.finished.update(c.finished)
    assert totals.hits_resume > 0, totals
    assert totals.exports > 0 and totals.imports_attached > 0 and totals.imports_released > 0, totals
    assert totals.aborts > 0, totals
    assert set(totals.finished) == {"stop", "length", "abort"}, totals
