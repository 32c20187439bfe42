"""The pull-or-recompute decision of cross-worker prefix reuse, from measured rates."""

from __future__ import annotations

from kvmesh.services.prefill_worker.peer_prefix import CostModel


def test_pull_when_cheaper_compute_when_not():
    cost = CostModel(prefill_tokens_per_s=1000.0, pull_bytes_per_s=1e9, pull_overhead_s=0.003)
    worth, pull, compute = cost.worth_pulling(tokens=2048, nbytes=47_000_000)
    assert worth and round(pull, 3) == 0.050 and compute == 2.048
    fast = CostModel(prefill_tokens_per_s=10_000.0, pull_bytes_per_s=1e9, pull_overhead_s=0.003)
    worth, pull, compute = fast.worth_pulling(tokens=16, nbytes=737_280)  # one block: the set-up dominates
    assert not worth and compute == 0.0016 and round(pull, 4) == 0.0037


def test_rates_follow_measurements():
    cost = CostModel(prefill_tokens_per_s=1000.0, pull_bytes_per_s=1e9, smoothing=0.5)
    cost.observe_prefill(tokens=3000, seconds=1.0)
    assert cost.prefill_tokens_per_s == 2000.0
    cost.observe_prefill(tokens=8, seconds=1.0)  # too small to say anything: ignored
    assert cost.prefill_tokens_per_s == 2000.0
    cost.observe_pull(nbytes=2_000_000_000, seconds=2.0)
    assert cost.pull_bytes_per_s == 1e9
    cost.observe_pull(nbytes=3_000_000_000, seconds=1.0)
    assert cost.pull_bytes_per_s == 2e9
