"""Each routing plugin on hand-built candidates, with exact scores."""

from __future__ import annotations

import pytest

from kvmesh.routing.plugins import (
    Candidate,
    EstimatedTtftPlugin,
    LoadPlugin,
    PrefillPlan,
    PrefixOverlapPlugin,
    RandomPlugin,
    RouteRequest,
    ScorePlugin,
    SessionAffinityPlugin,
    plan_prefill,
)


def cand(worker_id: str, running: int = 0, waiting: int = 0, free: int = 100, total: int = 100, cached: int = 0, **extra) -> Candidate:
    return Candidate(worker_id, running, waiting, free, total, cached, **extra)


REQUEST = RouteRequest("r1", num_blocks=4, num_tokens=2048)


def test_every_plugin_follows_the_protocol():
    plugins = [PrefixOverlapPlugin(), LoadPlugin(), SessionAffinityPlugin(), RandomPlugin(0), EstimatedTtftPlugin(1000.0, 0.01)]
    assert [p.name for p in plugins] == ["prefix", "load", "session", "random", "ttft"]
    assert all(isinstance(p, ScorePlugin) for p in plugins)


def test_prefix_overlap_is_the_cached_share_of_the_request():
    candidates = [cand("a", cached=0), cand("b", cached=1), cand("c", cached=3), cand("d", cached=4), cand("e", cached=9)]
    assert PrefixOverlapPlugin().score(REQUEST, candidates) == [0.0, 25.0, 75.0, 100.0, 100.0]


def test_prefix_overlap_of_a_request_without_full_blocks_is_zero():
    request = RouteRequest("short", num_blocks=0, num_tokens=100)
    assert PrefixOverlapPlugin().score(request, [cand("a", cached=0), cand("b", cached=2)]) == [0.0, 0.0]


def test_load_prefers_less_queued_work_and_more_free_blocks():
    candidates = [
        cand("busy", running=1, waiting=3, free=50),  # queue (4-4)/4 -> 0, free 50 -> 25
        cand("idle", running=0, waiting=0, free=100),  # queue 100, free 100 -> 100
        cand("half", running=1, waiting=1, free=0),  # queue (4-2)/4 -> 50, free 0 -> 25
        cand("no-pool", running=0, waiting=1, free=0, total=0),  # queue 75, free 0 -> 37.5
    ]
    assert LoadPlugin().score(REQUEST, candidates) == [25.0, 100.0, 25.0, 37.5]


def test_load_with_no_queue_anywhere_rates_by_free_blocks_alone():
    assert LoadPlugin().score(REQUEST, [cand("a", free=20), cand("b", free=80)]) == [60.0, 90.0]


def test_session_affinity_scores_the_worker_that_last_served_the_session():
    plugin = SessionAffinityPlugin()
    candidates = [cand("w0"), cand("w1"), cand("w2")]
    alice = RouteRequest("r1", 4, 2048, session_id="alice")
    assert plugin.score(alice, candidates) == [0.0, 0.0, 0.0]
    plugin.observe(alice, "w2")
    assert plugin.score(alice, candidates) == [0.0, 0.0, 100.0]
    plugin.observe(alice, "w1")
    assert plugin.score(alice, candidates) == [0.0, 100.0, 0.0]
    assert plugin.score(RouteRequest("r2", 4, 2048, session_id="bob"), candidates) == [0.0, 0.0, 0.0]
    anonymous = RouteRequest("r3", 4, 2048)
    plugin.observe(anonymous, "w0")
    assert plugin.score(anonymous, candidates) == [0.0, 0.0, 0.0]
    assert len(plugin) == 1


def test_session_affinity_forgets_the_least_recently_seen_session():
    plugin = SessionAffinityPlugin(max_sessions=2)
    candidates = [cand("w0"), cand("w1")]
    s1, s2, s3 = (RouteRequest(f"r{i}", 1, 512, session_id=f"s{i}") for i in (1, 2, 3))
    plugin.observe(s1, "w0")
    plugin.observe(s2, "w1")
    plugin.observe(s1, "w1")  # s1 is now the most recent
    plugin.observe(s3, "w0")  # evicts s2
    assert len(plugin) == 2
    assert plugin.score(s2, candidates) == [0.0, 0.0]
    assert plugin.score(s1, candidates) == [0.0, 100.0]
    assert plugin.score(s3, candidates) == [100.0, 0.0]
    with pytest.raises(ValueError, match="max_sessions"):
        SessionAffinityPlugin(max_sessions=0)


def test_random_is_seeded_and_in_range():
    candidates = [cand(f"w{i}") for i in range(5)]
    first = RandomPlugin(seed=7).score(REQUEST, candidates)
    assert first == RandomPlugin(seed=7).score(REQUEST, candidates)
    assert first != RandomPlugin(seed=8).score(REQUEST, candidates)
    assert all(0.0 <= s <= 100.0 for s in first)
    assert len(set(first)) == 5


def test_plan_prefill_pulls_while_cheaper_than_recomputing():
    # 450 tokens in 100-token blocks: 4 full blocks and a 50-token one; 1,000 tokens/s.
    # A pull of 0.06 s beats recomputing a full block (0.1 s) but not the short one (0.05 s).
    assert plan_prefill(450, 0, 5, 1000.0, 0.06, 100) == PrefillPlan(pulled_blocks=4, computed_tokens=50, seconds=pytest.approx(0.29))
    assert plan_prefill(450, 0, 5, 1000.0, 0.02, 100) == PrefillPlan(5, 0, pytest.approx(0.1))
    assert plan_prefill(450, 2, 3, 1000.0, 0.06, 100) == PrefillPlan(1, 150, pytest.approx(0.21))
    # dearer than recomputing, or exactly as dear: no pull
    assert plan_prefill(450, 0, 5, 1000.0, 0.1, 100) == PrefillPlan(0, 450, pytest.approx(0.45))
    assert plan_prefill(450, 5, 5, 1000.0, 0.06, 100) == PrefillPlan(0, 0, 0.0)


def test_estimated_ttft_scores_best_over_estimate():
    plugin = EstimatedTtftPlugin(prefill_rate=1000.0, pull_seconds=0.06, block_size=100)
    request = RouteRequest("r", num_blocks=5, num_tokens=450)
    candidates = [
        cand("cold", cached=0, queue_seconds=0.0),  # 0.45 s
        cand("warm-but-busy", cached=4, queue_seconds=1.0),  # 1.0 + 0.05 = 1.05 s
        cand("can-pull", cached=0, queue_seconds=0.2, peer_prefix_blocks=5),  # 0.2 + 4 * 0.06 + 0.05 = 0.49 s
        cand("part-local", cached=2, queue_seconds=0.0, peer_prefix_blocks=3),  # 0.06 + 0.15 = 0.21 s
    ]
    assert [plugin.estimate(request, c) for c in candidates] == pytest.approx([0.45, 1.05, 0.49, 0.21])
    assert plugin.score(request, candidates) == pytest.approx([100 * 0.21 / 0.45, 20.0, 100 * 0.21 / 0.49, 100.0])


def test_estimated_ttft_rejects_bad_parameters():
    with pytest.raises(ValueError, match="prefill_rate"):
        EstimatedTtftPlugin(prefill_rate=0.0, pull_seconds=0.01)
    with pytest.raises(ValueError, match="pull_seconds"):
        EstimatedTtftPlugin(prefill_rate=100.0, pull_seconds=-1.0)
