"""KVIndex: events in, owners and prefix matches out, on tiny hand-built chains."""

from __future__ import annotations

import random

from kvmesh.hashing import hash_token_blocks
from kvmesh.kvindex import KVIndex

# A 6-block chain of real block hashes (block size 2) and a 2-block branch off its 3rd block.
TOKENS = list(range(12))
CHAIN = hash_token_blocks(TOKENS, 2, ("m",))
BRANCH = hash_token_blocks(TOKENS[:6] + [90, 91, 92, 93], 2, ("m",))
A, B, C, D, E, F = CHAIN
X, Y = BRANCH[3:]


def three_workers() -> KVIndex:
    index = KVIndex()
    index.stored("w0", CHAIN)  # the whole chain
    index.stored("w1", [A, B, D, E])  # a prefix with a hole at C
    index.stored("w2", [A, B, C, X, Y])  # the branch
    return index


def test_chain_hashes_are_distinct():
    assert len(set(CHAIN + BRANCH)) == 8 and BRANCH[:3] == CHAIN[:3]


def test_stored_counts_only_new_pairs():
    index = KVIndex()
    assert index.stored("w0", [A, B, C]) == 3
    assert index.stored("w0", [B, C, D]) == 1
    assert index.stored("w0", [A, A]) == 0
    assert index.stored("w1", [A]) == 1
    assert (index.num_blocks, index.num_entries) == (4, 5)
    assert (index.blocks_of("w0"), index.blocks_of("w1"), index.blocks_of("nobody")) == (4, 1, 0)
    assert index.workers() == ["w0", "w1"]


def test_removed_counts_only_held_pairs():
    index = three_workers()
    assert (index.num_blocks, index.num_entries) == (8, 15)
    assert index.removed("w1", [A, C, D, D]) == 2  # C was never there, D only once
    assert index.removed("nobody", [A]) == 0
    assert index.owners(A) == {"w0": "device", "w2": "device"}
    assert index.owners(D) == {"w0": "device"}
    assert index.removed("w0", [D]) == 1
    assert index.owners(D) == {}
    assert (index.num_blocks, index.num_entries) == (7, 12)
    assert index.workers() == ["w0", "w1", "w2"]  # a worker with blocks removed stays known


def test_prefix_match_stops_each_worker_at_its_first_missing_block():
    index = three_workers()
    assert index.prefix_match(CHAIN) == {"w0": 6, "w1": 2, "w2": 3}
    assert index.prefix_match(BRANCH) == {"w0": 3, "w1": 2, "w2": 5}
    assert index.prefix_match(CHAIN[:2]) == {"w0": 2, "w1": 2, "w2": 2}
    assert index.prefix_match([D, E, F]) == {"w0": 3, "w1": 2}  # a chain may start anywhere
    assert index.prefix_match([X, Y]) == {"w2": 2}


def test_prefix_match_needs_the_first_block():
    index = three_workers()
    assert index.prefix_match([]) == {}
    assert index.prefix_match([12345, A, B]) == {}
    assert index.prefix_match([C, D]) == {"w0": 2, "w2": 1}


def test_remove_worker_drops_every_block_at_once_and_frees_its_slot():
    index = three_workers()
    assert index.remove_worker("w0") == 6
    assert index.remove_worker("w0") == 0
    assert index.workers() == ["w1", "w2"]
    assert (index.num_blocks, index.num_entries) == (7, 9)
    assert index.owners(F) == {}
    assert index.prefix_match(CHAIN) == {"w1": 2, "w2": 3}
    # a new worker reuses the freed slot and inherits none of w0's blocks
    assert index.stored("w3", [A]) == 1
    assert index.prefix_match(CHAIN) == {"w1": 2, "w2": 3, "w3": 1}
    assert index.owners(A) == {"w1": "device", "w2": "device", "w3": "device"}
    assert index.blocks_of("w3") == 1


def test_tiers_are_kept_per_worker_and_filter_the_match():
    index = KVIndex()
    index.stored("w0", [A, B, C])
    index.stored("w1", [A, B], tier="host")
    index.stored("w1", [C])
    assert index.owners(A) == {"w0": "device", "w1": "host"}
    assert index.owners(C) == {"w0": "device", "w1": "device"}
    assert index.prefix_match([A, B, C]) == {"w0": 3, "w1": 3}
    assert index.prefix_match([A, B, C], tiers=["device"]) == {"w0": 3}
    assert index.prefix_match([A, B, C], tiers=["host"]) == {"w1": 2}
    assert index.prefix_match([A, B, C], tiers=["host", "device"]) == {"w0": 3, "w1": 3}
    assert index.prefix_match([A, B, C], tiers=["disk"]) == {}
    # storing in another tier moves the block and adds nothing
    assert index.stored("w0", [B], tier="host") == 0
    assert index.owners(B) == {"w0": "host", "w1": "host"}
    assert index.prefix_match([A, B, C], tiers=["device"]) == {"w0": 1}
    # a removal for one tier leaves a block recorded in another
    assert index.removed("w1", [A, B, C], tier="device") == 1
    assert index.removed("w1", [A], tier="disk") == 0
    assert index.owners(A) == {"w0": "device", "w1": "host"}
    assert index.owners(C) == {"w0": "device"}


def test_two_indexes_are_independent():
    first, second = KVIndex(), KVIndex()
    first.stored("w0", [A, B])
    second.stored("w9", [B])
    assert first.prefix_match([A, B]) == {"w0": 2}
    assert second.prefix_match([A, B]) == {}
    assert second.prefix_match([B]) == {"w9": 1}


class NaiveIndex:
    """The reference: owners as sets, a per-worker walk."""

    def __init__(self) -> None:
        self.held: dict[str, dict[int, str]] = {}

    def stored(self, worker: str, hashes: list[int], tier: str) -> int:
        blocks = self.held.setdefault(worker, {})
        added = sum(1 for h in set(hashes) if h not in blocks)
        blocks.update((h, tier) for h in hashes)
        return added

    def removed(self, worker: str, hashes: list[int], tier: str | None) -> int:
        blocks = self.held.get(worker, {})
        dropped = 0
        for h in hashes:
            if h in blocks and (tier is None or blocks[h] == tier):
                del blocks[h]
                dropped += 1
        return dropped

    def remove_worker(self, worker: str) -> int:
        return len(self.held.pop(worker, {}))

    def prefix_match(self, chain: list[int], tiers: set[str] | None) -> dict[str, int]:
        counts = {}
        for worker, blocks in self.held.items():
            n = 0
            while n < len(chain) and chain[n] in blocks and (tiers is None or blocks[chain[n]] in tiers):
                n += 1
            if n:
                counts[worker] = n
        return counts


def test_prefix_match_agrees_with_a_naive_reference_over_random_operations():
    rng = random.Random(7)
    roots = [[rng.getrandbits(128) for _ in range(12)] for _ in range(5)]
    workers = [f"w{i}" for i in range(9)]
    index, naive = KVIndex(), NaiveIndex()

    def random_chain() -> list[int]:
        root = rng.choice(roots)
        return root[: rng.randint(0, 12)] + [rng.getrandbits(128) for _ in range(rng.randint(0, 4))]

    chains = [random_chain() for _ in range(40)]
    counts = {"stored": 0, "removed": 0, "remove_worker": 0, "match": 0, "split": 0}
    for _ in range(3000):
        op = rng.random()
        worker = rng.choice(workers)
        chain = rng.choice(chains)
        if op < 0.35:
            start, stop = sorted(rng.sample(range(len(chain) + 1), 2)) if len(chain) > 1 else (0, len(chain))
            tier = rng.choice(["device", "device", "host"])
            assert index.stored(worker, chain[start:stop], tier) == naive.stored(worker, chain[start:stop], tier)
            counts["stored"] += 1
        elif op < 0.5:
            picked = rng.sample(chain, min(len(chain), rng.randint(1, 3)))
            tier = rng.choice([None, None, "device", "host"])
            assert index.removed(worker, picked, tier) == naive.removed(worker, picked, tier)
            counts["removed"] += 1
        elif op < 0.53:
            assert index.remove_worker(worker) == naive.remove_worker(worker)
            counts["remove_worker"] += 1
        else:
            tiers = rng.choice([None, None, None, {"device"}, {"host"}])
            got = index.prefix_match(chain, tiers)
            assert got == naive.prefix_match(chain, tiers)
            counts["match"] += 1
            counts["split"] += len(set(got.values())) > 1  # workers stopped at different blocks
        assert index.num_entries == sum(len(b) for b in naive.held.values())
    assert index.num_blocks == len({h for b in naive.held.values() for h in b})
    # every kind of operation ran often enough to matter (the run is seeded, so these are fixed)
    assert counts == {"stored": 1051, "removed": 447, "remove_worker": 95, "match": 1407, "split": 580}
