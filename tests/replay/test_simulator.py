"""The replay simulator on tiny traces whose figures are worked out by hand.

Blocks are 512 tokens and workers prefill 512 tokens/s, so a block costs 1 s to compute;
a pull costs 0.25 s unless a test says otherwise.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvmesh.replay.simulator import POLICIES, SimConfig, SimWorker, oracle_hits, percentile, simulate, simulate_policies
from kvmesh.replay.trace import TraceRequest


def trace(*requests: tuple[float, list[int]] | tuple[float, list[int], int]) -> list[TraceRequest]:
    """(arrival s, hash ids[, input tokens]); tokens default to full 512-token blocks."""
    out = []
    for index, (arrival, hashes, *tokens) in enumerate(requests):
        out.append(TraceRequest(index, float(arrival), tokens[0] if tokens else 512 * len(hashes), 1, tuple(hashes)))
    return out


def config(workers: int = 3, cache_blocks: int = 4, pull_seconds: float = 0.25, seed: int = 0) -> SimConfig:
    return SimConfig(workers=workers, cache_blocks=cache_blocks, prefill_rate=512.0, pull_seconds=pull_seconds, seed=seed)


# Three workers, 4 blocks of cache each, six requests: three cold prompts at t=0, then
# three that extend the first two at t=4 and t=4.5.
SHARED = trace(
    (0, [1, 2, 3]),
    (0, [10, 11, 12]),
    (0, [20, 21]),
    (4, [1, 2, 3, 4]),
    (4, [10, 11, 12, 13]),
    (4.5, [1, 2, 3, 5]),
)


def test_lru_touches_a_request_tail_first_and_evicts_the_least_recent():
    worker = SimWorker(0, capacity=4)
    worker.store([1, 2], local=0, pulled=0, pulled_ready=0.0, finish=2.0)
    assert list(worker.cache.items()) == [(2, 2.0), (1, 2.0)]
    worker.store([1, 2, 3], local=2, pulled=0, pulled_ready=2.0, finish=2.5)
    assert list(worker.cache.items()) == [(3, 2.5), (2, 2.0), (1, 2.0)]  # hits keep their ready time
    worker.store([4, 5], local=0, pulled=0, pulled_ready=10.0, finish=12.0)
    assert list(worker.cache) == [2, 1, 5, 4]  # 3, the oldest tail, went first
    worker.store([6, 7, 8], local=0, pulled=2, pulled_ready=12.5, finish=13.0)
    assert list(worker.cache.items()) == [(4, 12.0), (8, 13.0), (7, 12.5), (6, 12.5)]
    assert worker.prefix_ready([6, 7, 8, 9]) == [12.5, 12.5, 13.0]
    assert worker.prefix_ready([7]) == [12.5]
    assert worker.prefix_ready([1, 6]) == []


def test_the_head_of_an_evicted_prompt_survives_its_tail():
    # [1, 2] then [3, 4, 5] overflow a 4-block cache by one: block 2 (a tail) goes, block 1
    # stays, so [1, 2] later hits one block and computes one: TTFT 1 s.
    result = simulate(trace((0, [1, 2]), (10, [3, 4, 5]), (20, [1, 2])), config(workers=1), "least-load")
    assert result.ttfts == [2.0, 3.0, 1.0]
    assert result.local_hit_blocks == 1


def test_queueing_arithmetic_on_one_worker():
    requests = trace(
        (0, [1, 2]),  # starts at 0, 2 blocks: TTFT 2
        (1, [1, 2, 3], 1280),  # waits 1 s, hits 2 blocks, computes 256 tokens (0.5 s): TTFT 1.5
        (1.5, [7]),  # waits 1 s (until 2.5), computes 1 block: TTFT 2
        (10, [1, 2, 3], 1280),  # idle worker, all 3 blocks cached: TTFT 0
    )
    result = simulate(requests, config(workers=1), "round-robin")
    assert result.ttfts == [2.0, 1.5, 2.0, 0.0]
    assert (result.blocks, result.local_hit_blocks, result.pulled_blocks) == (9, 5, 0)
    assert result.computed_tokens == 1024 + 256 + 512
    assert result.hit_rate == 5 / 9
    assert result.ttft_mean == 5.5 / 4
    assert (result.ttft_p50, result.ttft_p90, result.ttft_p99) == (1.5, 2.0, 2.0)
    assert result.max_utilization == 3.5 / 10  # busy 3.5 s over 0 .. 10
    assert result.imbalance == 1.0


def test_oracle_counts_blocks_any_earlier_request_had():
    requests = trace((0, [1, 2]), (1, [1, 2, 3]), (2, [4]), (3, [1, 5]), (4, [4, 6]))
    assert oracle_hits(requests) == 2 + 1 + 1
    result = simulate(requests, config(workers=2), "round-robin")
    assert result.oracle_hit_rate == 4 / 10
    # round-robin: w0 gets [1,2], [4], [4,6]; w1 gets [1,2,3], [1,5]
    assert (result.local_hit_blocks, result.hit_rate, result.hit_pct_of_oracle) == (2, 0.2, 50.0)


def test_least_load_throws_the_cache_away():
    result = simulate(SHARED, config(), "least-load")
    # t=0: w0, w1, w2 (ties to the lowest index); t=4: w2 is free first, then w0;
    # t=4.5: w1. Nobody lands where its prefix is: every block is computed.
    assert result.choices == [0, 1, 2, 2, 0, 1]
    assert result.ttfts == [3.0, 3.0, 2.0, 4.0, 4.0, 4.0]
    assert result.ttft_mean == 20 / 6
    assert (result.hit_rate, result.oracle_hit_rate) == (0.0, 9 / 20)
    assert result.max_utilization == 7 / 8.5
    assert result.imbalance == 7 / (20 / 3)


def test_kv_aware_beats_least_load_on_shared_prefixes():
    result = simulate(SHARED, config(), "kv-aware")
    # t=4: w0 holds [1,2,3] -> 1 s; an idle peer would pull 3 blocks (0.75 s) + 1 s.
    # t=4.5: w0 (free at 5) -> 0.5 + 1 = 1.5 s beats w2's 0.75 + 1 = 1.75 s.
    assert result.choices == [0, 1, 2, 0, 1, 0]
    assert result.ttfts == [3.0, 3.0, 2.0, 1.0, 1.0, 1.5]
    assert result.ttft_mean == 11.5 / 6
    assert (result.ttft_p50, result.ttft_p90) == (1.5, 3.0)
    assert (result.hit_rate, result.hit_pct_of_oracle, result.pulled_blocks) == (9 / 20, 100.0, 0)
    least_load = simulate(SHARED, config(), "least-load")
    assert result.ttft_mean < 0.6 * least_load.ttft_mean


def test_other_policies_on_the_shared_trace():
    assert simulate(SHARED, config(), "round-robin").choices == [0, 1, 2, 0, 1, 2]
    prefix_only = simulate(SHARED, config(), "prefix-only")
    assert prefix_only.choices == [0, 1, 2, 0, 1, 0]
    assert prefix_only.ttfts == [3.0, 3.0, 2.0, 1.0, 1.0, 1.5]
    weighted = simulate(SHARED, config(), "weighted")  # default config: prefix x2, load x1, session x1
    assert weighted.choices[3:] == [0, 1, 0]


# w0 (8 blocks of cache) computes [1, 2] (done at t=2), then [1, 2] + 6 blocks (busy until 8);
# [1, 2, 3] arrives at t=3 and w1 is idle.
PULL = trace((0, [1, 2]), (2, [1, 2, 7, 8, 9, 10, 11, 12]), (3, [1, 2, 3]))


def test_kv_aware_pulls_from_a_peer_when_cheaper():
    result = simulate(PULL, config(workers=2, cache_blocks=8, pull_seconds=0.25), "kv-aware")
    assert result.choices == [0, 0, 1]
    assert result.ttfts == [2.0, 6.0, 0.5 + 1.0]
    assert (result.pulled_blocks, result.local_hit_blocks, result.hit_rate) == (2, 2, 4 / 13)


@pytest.mark.parametrize("pull_seconds", [1.0, 1.5])
def test_kv_aware_recomputes_when_pulling_is_not_cheaper(pull_seconds):
    result = simulate(PULL, config(workers=2, cache_blocks=8, pull_seconds=pull_seconds), "kv-aware")
    assert result.choices == [0, 0, 1]
    assert result.ttfts == [2.0, 6.0, 3.0]
    assert result.pulled_blocks == 0


def test_only_kv_aware_pulls():
    assert simulate(PULL, config(workers=2, cache_blocks=8), "kv-aware-local").pulled_blocks == 0
    assert simulate(PULL, config(workers=2, cache_blocks=8), "least-load").pulled_blocks == 0


def test_a_peer_block_still_being_computed_cannot_be_pulled():
    # [1, 2] is on w0 until t=2; at t=1 an idle w2 could not pull it before then, so
    # waiting 1 s on w0 (TTFT 2) beats computing all three blocks on w2 (TTFT 3).
    requests = trace((0, [1, 2]), (0, [7, 8, 9, 10, 11, 12]), (1, [1, 2, 3]))
    result = simulate(requests, config(workers=3), "kv-aware")
    assert result.choices == [0, 1, 0]
    assert result.ttfts == [2.0, 6.0, 2.0]
    assert result.pulled_blocks == 0


def test_kv_aware_spreads_equal_estimates_over_idle_workers():
    # Three cold one-block prompts, each arriving to idle workers: equal estimates go to the
    # worker free the longest, not always to w0.
    result = simulate(trace((0, [1]), (10, [2]), (20, [3])), config(), "kv-aware")
    assert result.choices == [0, 1, 2]
    assert result.imbalance == 1.0


def test_random_is_deterministic_with_a_seed():
    requests = trace(*[(i, [i]) for i in range(30)])
    first = simulate(requests, config(seed=5), "random").choices
    assert simulate(requests, config(seed=5), "random").choices == first
    assert simulate(requests, config(seed=6), "random").choices != first
    assert set(first) == {0, 1, 2}


def test_every_policy_runs_and_unknown_ones_are_refused():
    results = simulate_policies(SHARED, config(), POLICIES)
    assert [r.policy for r in results] == list(POLICIES)
    assert all(r.requests == 6 and r.blocks == 20 for r in results)
    with pytest.raises(ValueError, match="unknown policies least-loaded"):
        simulate_policies(SHARED, config(), ["least-loaded"])
    with pytest.raises(ValueError, match="workers must be >= 1"):
        config(workers=0)


def test_percentile_is_nearest_rank():
    values = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0]
    assert (percentile(values, 50), percentile(values, 90), percentile(values, 99), percentile([], 90)) == (5.0, 9.0, 10.0, 0.0)


def kvmesh_replay(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvmesh.cli", "replay", *args], capture_output=True, text=True, timeout=120)


@pytest.fixture
def shared_trace_file(tmp_path):
    path = tmp_path / "trace.jsonl"
    lines = [
        json.dumps({"timestamp": r.arrival * 1000, "input_length": r.input_length, "output_length": 1, "hash_ids": list(r.hash_ids)})
        for r in SHARED
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_cli_prints_the_figures_as_json(shared_trace_file):
    done = kvmesh_replay(
        "--trace", str(shared_trace_file), "--simulate", "--workers", "3", "--cache-blocks", "4",
        "--prefill-rate", "512", "--pull-ms", "250", "--policies", "least-load,kv-aware", "--json",
    )
    assert done.returncode == 0, done.stderr
    figures = json.loads(done.stdout)
    assert figures["trace"]["requests"] == 6 and figures["trace"]["oracle_hit_rate"] == 9 / 20
    assert list(figures["policies"]) == ["least-load", "kv-aware"]
    assert figures["policies"]["least-load"]["ttft_mean"] == pytest.approx(20 / 6)
    assert figures["policies"]["kv-aware"]["ttft_mean"] == pytest.approx(11.5 / 6)
    assert figures["policies"]["kv-aware"]["hit_pct_of_oracle"] == 100.0


def test_cli_prints_a_table(shared_trace_file):
    done = kvmesh_replay("--trace", str(shared_trace_file), "--simulate", "--workers", "3", "--policies", "random,kv-aware")
    assert done.returncode == 0, done.stderr
    rows = [row.split()[0] for row in done.stdout.splitlines() if row.startswith(("random", "kv-aware"))]
    assert rows == ["random", "kv-aware"]


def test_cli_without_simulate_needs_a_mesh_url(shared_trace_file):
    done = kvmesh_replay("--trace", str(shared_trace_file))
    assert done.returncode != 0
    assert "give --url of a running mesh" in done.stderr and "Traceback" not in done.stderr


def test_cli_refuses_an_unknown_policy(shared_trace_file):
    done = kvmesh_replay("--trace", str(shared_trace_file), "--simulate", "--policies", "fastest")
    assert done.returncode != 0
    assert "unknown policies fastest" in done.stderr and "Traceback" not in done.stderr


def test_cli_weighted_policy_reads_a_scorer_config(shared_trace_file, tmp_path):
    good = tmp_path / "scorer.json"
    good.write_text(json.dumps({"plugins": [{"name": "prefix", "weight": 1}]}))
    done = kvmesh_replay("--trace", str(shared_trace_file), "--simulate", "--workers", "3", "--policies", "weighted",
                         "--scorer-config", str(good), "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["policies"]["weighted"]["requests"] == 6
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"plugins": [{"name": "prefix", "weight": -1}]}))
    done = kvmesh_replay("--trace", str(shared_trace_file), "--simulate", "--policies", "weighted", "--scorer-config", str(bad))
    assert done.returncode != 0
    assert "weight must be a positive finite number, got -1" in done.stderr and "Traceback" not in done.stderr
