"""KVIndex (bitmask owners) vs a naive index (set owners, per-worker walk), same run, same data.

Workload (seeded): 16 workers, chains of 64 block hashes (random 128-bit ints, as
``kvmesh.hashing`` makes them) with realistic sharing. Each chain starts with a prefix it
shares with others, then continues with blocks of its own:

- 60 %: the first 0..48 blocks of one of 256 "system prompt / document" roots, picked with
  Zipf-like weights (a few roots are very popular);
- 30 %: the first 16..60 blocks of an earlier chain (a later turn of a conversation);
- 10 %: nothing shared.

A chain is stored by one worker (its root's "home" worker 70 % of the time, any worker
otherwise), and 20 % of chains also by a second worker (a copy pulled from a peer). Chains
are generated until 1,000,000 distinct blocks exist. Every event batch carries a whole
chain (64 hashes; the index counts what is new).

Measured, per repetition, for both indexes:

(a) ingestion through ``stored``, in hashes/s: from Python ints (the index alone), and from
    JSON event batches (``{"worker_id", "epoch", "seq", "block_hashes": [32-char hex]}`` as
    bytes, what will come over NATS: ``json.loads``, the ``EventSequencer`` check and
    ``int(h, 16)`` included);
(b) ``prefix_match`` latency on 64-block chains: hits (a stored chain), partial (a popular
    root's prefix plus a new tail), misses (64 unknown hashes);
(c) remove_worker time for one of the 16 workers.

Memory (tracemalloc, once, outside the timed runs): bytes still allocated after building
each index from the JSON batches, so the hash ints the index keeps are counted.

Run::

    .venv/bin/python benchmarks/kvindex_bench.py --markdown docs/benchmarks-kvindex.md

Smoke test (seconds)::

    .venv/bin/python benchmarks/kvindex_bench.py --blocks 20000 --queries 500 --reps 1
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import random
import statistics
import sys
import time
import tracemalloc
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from kvmesh.kvindex import EventSequencer, KVIndex, Verdict

CHAIN_LEN = 64


class Index(Protocol):
    def stored(self, worker_id: str, block_hashes: Sequence[int]) -> int: ...
    def prefix_match(self, chain: Sequence[int]) -> dict[str, int]: ...
    def remove_worker(self, worker_id: str) -> int: ...


class NaiveIndex:
    """The baseline: ``dict[hash] -> set[worker]``, a per-worker set, a per-worker walk."""

    def __init__(self) -> None:
        self.owners: dict[int, set[str]] = {}
        self.blocks: dict[str, set[int]] = {}

    def stored(self, worker_id: str, block_hashes: Sequence[int]) -> int:
        mine = self.blocks.setdefault(worker_id, set())
        added = 0
        for h in block_hashes:
            if h not in mine:
                mine.add(h)
                owners = self.owners.get(h)
                if owners is None:
                    self.owners[h] = {worker_id}
                else:
                    owners.add(worker_id)
                added += 1
        return added

    def prefix_match(self, chain: Sequence[int]) -> dict[str, int]:
        first = self.owners.get(chain[0]) if chain else None
        if not first:
            return {}
        counts = {}
        for worker in first:
            n = 0
            for h in chain:
                owners = self.owners.get(h)
                if owners is None or worker not in owners:
                    break
                n += 1
            counts[worker] = n
        return counts

    def remove_worker(self, worker_id: str) -> int:
        mine = self.blocks.pop(worker_id, set())
        for h in mine:
            owners = self.owners[h]
            owners.discard(worker_id)
            if not owners:
                del self.owners[h]
        return len(mine)


# ----------------------------------------------------------------------------- workload
@dataclass(slots=True)
class Workload:
    workers: list[str]
    events: list[tuple[str, list[int]]]  # (worker, chain), in ingestion order
    payloads: list[bytes]  # the same events as JSON
    hits: list[list[int]]
    partial: list[list[int]]
    misses: list[list[int]]
    distinct_blocks: int
    sharing: dict[str, float] = field(default_factory=dict)


def make_workload(target_blocks: int, num_workers: int, num_queries: int, seed: int) -> Workload:
    rng = random.Random(seed)
    fresh = lambda n: [rng.getrandbits(128) for _ in range(n)]  # noqa: E731
    workers = [f"worker-{i:02d}" for i in range(num_workers)]
    roots = [fresh(48) for _ in range(256)]
    root_weights = [1.0 / (i + 1) for i in range(len(roots))]
    chains: list[list[int]] = []
    homes: list[int] = []
    seen: set[int] = set()
    shared_lengths: list[int] = []
    while len(seen) < target_blocks:
        pick = rng.random()
        if pick < 0.6:
            root_index = rng.choices(range(len(roots)), root_weights)[0]
            prefix = roots[root_index][: rng.randint(0, 48)]
            home = root_index % num_workers
        elif pick < 0.9 and chains:
            parent_index = rng.randrange(len(chains))
            prefix = chains[parent_index][: rng.randint(16, 60)]
            home = homes[parent_index]
        else:
            prefix, home = [], rng.randrange(num_workers)
        chain = prefix + fresh(CHAIN_LEN - len(prefix))
        shared_lengths.append(len(prefix))
        chains.append(chain)
        homes.append(home)
        seen.update(chain)
    events: list[tuple[str, list[int]]] = []
    for chain, home in zip(chains, homes):
        worker = home if rng.random() < 0.7 else rng.randrange(num_workers)
        events.append((workers[worker], chain))
        if rng.random() < 0.2:
            events.append((workers[(worker + rng.randrange(1, num_workers)) % num_workers], chain))
    seqs: dict[str, int] = {}
    payloads = []
    for worker, chain in events:
        seq = seqs.get(worker, 0)
        seqs[worker] = seq + 1
        body = {"worker_id": worker, "epoch": "boot-1", "seq": seq, "block_hashes": [f"{h:032x}" for h in chain]}
        payloads.append(json.dumps(body).encode())
    popular = roots[:8]
    return Workload(
        workers=workers,
        events=events,
        payloads=payloads,
        hits=[rng.choice(chains) for _ in range(num_queries)],
        partial=[(p := rng.choice(popular)[: rng.randint(8, 48)]) + fresh(CHAIN_LEN - len(p)) for _ in range(num_queries)],
        misses=[fresh(CHAIN_LEN) for _ in range(num_queries)],
        distinct_blocks=len(seen),
        sharing={"chains": len(chains), "mean_shared_prefix": statistics.fmean(shared_lengths)},
    )


# ----------------------------------------------------------------------------- measurements
def ingest_ints(index: Index, events: list[tuple[str, list[int]]]) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process) to store every event."""
    started, cpu_started = time.perf_counter(), time.process_time()
    for worker, chain in events:
        index.stored(worker, chain)
    return time.perf_counter() - started, time.process_time() - cpu_started


def ingest_json(index: Index, payloads: list[bytes]) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process) to decode, sequence and store every batch."""
    sequencer = EventSequencer()
    started, cpu_started = time.perf_counter(), time.process_time()
    for payload in payloads:
        batch = json.loads(payload)
        if sequencer.offer(batch["worker_id"], batch["epoch"], batch["seq"]) is not Verdict.APPLY:
            raise AssertionError("the benchmark's batches are in order")
        index.stored(batch["worker_id"], [int(h, 16) for h in batch["block_hashes"]])
    return time.perf_counter() - started, time.process_time() - cpu_started


def latencies_us(match: Callable[[Sequence[int]], dict[str, int]], chains: list[list[int]]) -> dict[str, float]:
    samples = []
    clock = time.perf_counter_ns
    for chain in chains:
        started = clock()
        match(chain)
        samples.append(clock() - started)
    samples.sort()
    return {
        "p50": samples[len(samples) // 2] / 1000,
        "p99": samples[min(len(samples) - 1, int(len(samples) * 0.99))] / 1000,
        "mean": statistics.fmean(samples) / 1000,
    }


def one_rep(workload: Workload, make: Callable[[], Index]) -> dict[str, Any]:
    hashes = len(workload.events) * CHAIN_LEN
    index = make()
    seconds, cpu_seconds = ingest_ints(index, workload.events)
    json_index = make()
    json_seconds, json_cpu_seconds = ingest_json(json_index, workload.payloads)
    del json_index
    gc.collect()
    out: dict[str, Any] = {
        "ingest_hashes_per_s": hashes / seconds,
        "ingest_hashes_per_cpu_s": hashes / cpu_seconds,
        "ingest_json_hashes_per_s": hashes / json_seconds,
        "ingest_json_hashes_per_cpu_s": hashes / json_cpu_seconds,
    }
    for kind in ("hits", "partial", "misses"):
        out[kind] = latencies_us(index.prefix_match, getattr(workload, kind))
    started = time.perf_counter()
    out["remove_worker_blocks"] = index.remove_worker(workload.workers[0])
    out["remove_worker_ms"] = (time.perf_counter() - started) * 1000
    return out


def memory_mib(workload: Workload, make: Callable[[], Index]) -> float:
    gc.collect()
    tracemalloc.start()
    index = make()
    ingest_json(index, workload.payloads)
    gc.collect()
    current, _peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    del index
    gc.collect()
    return current / 2**20


def check_same_answers(workload: Workload) -> dict[str, Any]:
    """Both indexes agree on every query; returns a few facts about the data set."""
    fast, naive = KVIndex(), NaiveIndex()
    ingest_ints(fast, workload.events)
    ingest_ints(naive, workload.events)
    for kind in ("hits", "partial", "misses"):
        for chain in getattr(workload, kind)[:2000]:
            assert fast.prefix_match(chain) == naive.prefix_match(chain), kind
    hit_owners = [len(fast.prefix_match(c)) for c in workload.hits[:2000]]
    partial_owners = [len(fast.prefix_match(c)) for c in workload.partial[:2000]]
    return {
        "num_blocks": fast.num_blocks,
        "num_entries": fast.num_entries,
        "hit_mean_workers_matched": statistics.fmean(hit_owners),
        "partial_mean_workers_matched": statistics.fmean(partial_owners),
    }


# ----------------------------------------------------------------------------- report
def machine() -> dict[str, Any]:
    model = "unknown"
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return {"cpu": model, "nproc": os.cpu_count(), "python": platform.python_version()}


def median_of(reps: list[dict[str, Any]], *path: str) -> float:
    values = []
    for rep in reps:
        value: Any = rep
        for key in path:
            value = value[key]
        values.append(value)
    return statistics.median(values)


def markdown(args: argparse.Namespace, workload: Workload, facts: dict, results: dict, memory: dict, meta: dict) -> str:
    fast, naive = results["kvindex"], results["naive"]
    hashes = len(workload.events) * CHAIN_LEN

    def row(label: str, *path: str, fmt: str = "{:,.0f}", target: str = "", lower_is_better: bool = True) -> str:
        """KVIndex's figure, the naive one, and how many times better KVIndex is."""
        a, b = median_of(fast, *path), median_of(naive, *path)
        better = b / a if lower_is_better else a / b
        return f"| {label} | {fmt.format(a)} | {fmt.format(b)} | {better:.1f}x | {target} |"

    lines = [
        f"## Run of {meta['date']}",
        "",
        f"- **Command**: `{meta['command']}`",
        f"- **Machine**: `{meta['machine']['cpu']}` (/proc/cpuinfo), `nproc` = {meta['machine']['nproc']}, "
        f"Python {meta['machine']['python']}; load average (1/5/15 min) "
        f"{'/'.join(f'{x:.2f}' for x in meta['load_start'])} at start, "
        f"{'/'.join(f'{x:.2f}' for x in meta['load_end'])} at end.",
        f"- **Data**: {workload.distinct_blocks:,} distinct blocks from {workload.sharing['chains']:,} chains "
        f"of {CHAIN_LEN} (mean shared prefix {workload.sharing['mean_shared_prefix']:.1f} blocks), "
        f"{len(workload.workers)} workers, {len(workload.events):,} event batches = {hashes:,} hashes, "
        f"{facts['num_entries']:,} (hash, worker) entries ({facts['num_entries'] / hashes:.0%} of the hashes ingested "
        f"were new pairs). A hit query matches "
        f"{facts['hit_mean_workers_matched']:.1f} workers on average, a partial one "
        f"{facts['partial_mean_workers_matched']:.1f}. Both indexes gave identical answers on "
        f"the checked queries.",
        f"- **Repetitions**: {args.reps}, median reported; {args.queries:,} queries of each kind per "
        f"repetition; latencies are per call (`perf_counter_ns`), GC on. Rates per CPU second use "
        f"`time.process_time()` and show what the wall-clock rates lose to other work on the machine.",
        "",
        "| metric | KVIndex | naive | KVIndex better by | target |",
        "|---|---:|---:|---:|---|",
        row("(a) ingest, Python ints (hashes/s)", "ingest_hashes_per_s", target=">= 50,000", lower_is_better=False),
        row(
            "(a) ingest, JSON batches of 64 hex hashes (hashes/s)",
            "ingest_json_hashes_per_s",
            target=">= 50,000",
            lower_is_better=False,
        ),
        row("(a) ingest, Python ints (hashes per CPU s)", "ingest_hashes_per_cpu_s", lower_is_better=False),
        row("(a) ingest, JSON (hashes per CPU s)", "ingest_json_hashes_per_cpu_s", lower_is_better=False),
    ]
    for kind in ("hits", "partial", "misses"):
        for stat in ("p50", "p99"):
            target = "< 1,000" if stat == "p99" else ""
            lines.append(row(f"(b) prefix_match {kind}, {stat} (us)", kind, stat, fmt="{:,.1f}", target=target))
    lines += [
        row(f"remove_worker ({median_of(fast, 'remove_worker_blocks'):,.0f} blocks) (ms)", "remove_worker_ms", fmt="{:,.1f}"),
        f"| (c) memory after building from JSON (MiB, tracemalloc) | {memory['kvindex']:,.1f} | "
        f"{memory['naive']:,.1f} | {memory['naive'] / memory['kvindex']:.1f}x | |",
        "",
        "Per repetition (KVIndex / naive): ingest ints "
        + ", ".join(f"{f['ingest_hashes_per_s']:,.0f} / {n['ingest_hashes_per_s']:,.0f}" for f, n in zip(fast, naive))
        + "; ingest JSON "
        + ", ".join(f"{f['ingest_json_hashes_per_s']:,.0f} / {n['ingest_json_hashes_per_s']:,.0f}" for f, n in zip(fast, naive))
        + "; hits p99 us "
        + ", ".join(f"{f['hits']['p99']:.1f} / {n['hits']['p99']:.1f}" for f, n in zip(fast, naive))
        + ".",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--blocks", type=int, default=1_000_000)
    parser.add_argument("--workers", type=int, default=16)
    parser.add_argument("--queries", type=int, default=20_000)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--markdown", type=Path, help="append the results to this file")
    args = parser.parse_args()

    meta: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "command": " ".join([".venv/bin/python", *sys.argv]),
        "machine": machine(),
        "load_start": os.getloadavg(),
    }
    started = time.perf_counter()
    workload = make_workload(args.blocks, args.workers, args.queries, args.seed)
    print(f"workload: {workload.distinct_blocks:,} blocks, {len(workload.events):,} batches "
          f"({time.perf_counter() - started:.1f} s)", flush=True)
    facts = check_same_answers(workload)
    print(f"facts: {facts}", flush=True)
    makers: dict[str, Callable[[], Index]] = {"kvindex": KVIndex, "naive": NaiveIndex}
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in makers}
    for rep in range(args.reps):
        order = list(makers) if rep % 2 == 0 else list(makers)[::-1]
        for name in order:
            gc.collect()
            results[name].append(one_rep(workload, makers[name]))
            r = results[name][-1]
            print(f"rep {rep} {name}: ingest {r['ingest_hashes_per_s']:,.0f}/s, json {r['ingest_json_hashes_per_s']:,.0f}/s, "
                  f"hits p50/p99 {r['hits']['p50']:.1f}/{r['hits']['p99']:.1f} us, "
                  f"partial {r['partial']['p50']:.1f}/{r['partial']['p99']:.1f} us, "
                  f"misses {r['misses']['p50']:.1f}/{r['misses']['p99']:.1f} us, "
                  f"remove_worker {r['remove_worker_ms']:.1f} ms", flush=True)
    memory = {name: memory_mib(workload, make) for name, make in makers.items()}
    print(f"memory MiB: {memory}", flush=True)
    meta["load_end"] = os.getloadavg()
    text = markdown(args, workload, facts, results, memory, meta)
    print(text)
    if args.markdown:
        if not args.markdown.exists():
            args.markdown.write_text(HEADER)
        with args.markdown.open("a") as out:
            out.write("\n" + text)


HEADER = """# KVIndex benchmark: the in-memory index of the cluster KV cache

`benchmarks/kvindex_bench.py` (its docstring describes the workload in full) indexes about
1,000,000 distinct 128-bit block hashes held by 16 workers, in chains of 64 blocks that share
prefixes (popular system prompts, later turns of conversations), and compares
`kvmesh.kvindex.KVIndex` (worker ids interned to bit positions, owners of a hash as one int
bitmask, a chain walk that `&`s the masks until none is left) with a naive index in the same
process on the same data (`dict[hash] -> set[worker]`, a walk per worker). Targets: ingestion
>= 50,000 blocks/s through `stored`, `prefix_match` p99 < 1 ms on 64-block chains.

Ingestion rates count every hash in every batch (each batch is a whole chain of 64, its
shared prefix often already known to the index), so they are hashes processed per second.
"""


if __name__ == "__main__":
    main()
