"""The weighted scorer and its config file."""

from __future__ import annotations

import json

import pytest

from kvmesh.routing.plugins import Candidate, LoadPlugin, PrefixOverlapPlugin, RandomPlugin, RouteRequest, SessionAffinityPlugin
from kvmesh.routing.scorer import DEFAULT_SCORER_CONFIG, Decision, ScorerConfigError, WeightedScorer, load_scorer_config

REQUEST = RouteRequest("r1", num_blocks=4, num_tokens=2048, session_id="alice")
CANDIDATES = [
    Candidate("w0", running=0, waiting=0, free_blocks=100, total_blocks=100, cached_prefix_blocks=0),  # prefix 0, load 100
    Candidate("w1", running=1, waiting=3, free_blocks=50, total_blocks=100, cached_prefix_blocks=4),  # prefix 100, load 25
    Candidate("w2", running=1, waiting=1, free_blocks=100, total_blocks=100, cached_prefix_blocks=2),  # prefix 50, load 75
]


def test_choose_adds_weighted_scores_and_reports_each_plugin():
    scorer = WeightedScorer([(PrefixOverlapPlugin(), 2.0), (LoadPlugin(), 1.0)])
    decision = scorer.choose(REQUEST, CANDIDATES)
    # totals: w0 = 0 + 100, w1 = 200 + 25, w2 = 100 + 75
    assert decision == Decision(
        worker_id="w1",
        total=225.0,
        per_plugin_scores={
            "prefix": {"w0": 0.0, "w1": 100.0, "w2": 50.0},
            "load": {"w0": 100.0, "w1": 25.0, "w2": 75.0},
        },
    )
    assert WeightedScorer([(PrefixOverlapPlugin(), 1.0), (LoadPlugin(), 4.0)]).choose(REQUEST, CANDIDATES).worker_id == "w0"


def test_ties_go_to_the_first_candidate():
    twins = [Candidate(f"w{i}", 0, 0, 10, 10, 1) for i in (3, 1, 2)]
    assert WeightedScorer([(PrefixOverlapPlugin(), 1.0)]).choose(REQUEST, twins).worker_id == "w3"


def test_a_random_plugin_breaks_ties_reproducibly():
    twins = [Candidate(f"w{i}", 0, 0, 10, 10, 1) for i in range(4)]

    def picks(seed: int) -> list[str]:
        scorer = WeightedScorer([(PrefixOverlapPlugin(), 100.0), (RandomPlugin(seed), 0.01)])
        return [scorer.choose(REQUEST, twins).worker_id for _ in range(12)]

    assert picks(1) == picks(1)
    assert len(set(picks(1))) > 1


def test_observe_teaches_session_affinity():
    scorer = WeightedScorer([(SessionAffinityPlugin(), 3.0), (LoadPlugin(), 1.0)])
    assert scorer.choose(REQUEST, CANDIDATES).worker_id == "w0"
    scorer.observe(REQUEST, "w2")
    decision = scorer.choose(REQUEST, CANDIDATES)
    assert (decision.worker_id, decision.total) == ("w2", 375.0)


def test_span_attributes_flatten_the_decision():
    decision = Decision("w1", 225.0, {"prefix": {"w0": 0.0, "w1": 100.0}})
    assert decision.span_attributes() == {
        "kvmesh.route.worker": "w1",
        "kvmesh.route.score": 225.0,
        "kvmesh.route.scores.prefix.w0": 0.0,
        "kvmesh.route.scores.prefix.w1": 100.0,
    }


def test_no_candidates_is_an_error():
    with pytest.raises(ValueError, match="no candidate workers for request r1"):
        WeightedScorer([(LoadPlugin(), 1.0)]).choose(REQUEST, [])


def test_config_from_a_dict_with_args():
    scorer = load_scorer_config(
        {"plugins": [{"name": "prefix", "weight": 2}, {"name": "session", "weight": 0.5, "args": {"max_sessions": 3}}]}
    )
    assert [(type(p), w) for p, w in scorer.plugins] == [(PrefixOverlapPlugin, 2.0), (SessionAffinityPlugin, 0.5)]
    assert scorer.plugins[1][0].max_sessions == 3


def test_default_config():
    scorer = load_scorer_config(None)
    assert [(p.name, w) for p, w in scorer.plugins] == [("prefix", 2.0), ("load", 1.0), ("session", 1.0)]
    assert DEFAULT_SCORER_CONFIG["plugins"][0] == {"name": "prefix", "weight": 2}


def test_config_from_json_and_yaml_files(tmp_path):
    config = {"plugins": [{"name": "prefix", "weight": 2}, {"name": "load", "weight": 1}]}
    (tmp_path / "scorer.json").write_text(json.dumps(config))
    (tmp_path / "scorer.yaml").write_text("plugins:\n  - name: prefix\n    weight: 2\n  - name: load\n    weight: 1\n")
    for name in ("scorer.json", "scorer.yaml"):
        scorer = load_scorer_config(tmp_path / name)
        assert [(p.name, w) for p, w in scorer.plugins] == [("prefix", 2.0), ("load", 1.0)]


@pytest.mark.parametrize(
    "config, message",
    [
        ({"plugins": [{"name": "prefx", "weight": 1}]}, "plugins[0]: unknown plugin 'prefx'; known plugins: load, prefix, random, session, ttft"),
        ({"plugins": [{"name": "load", "weight": -1}]}, "plugins[0] (load): weight must be a positive finite number, got -1"),
        ({"plugins": [{"name": "load", "weight": 0}]}, "weight must be a positive finite number, got 0"),
        ({"plugins": [{"name": "load", "weight": "2"}]}, "weight must be a positive finite number, got '2'"),
        ({"plugins": [{"name": "load", "weight": True}]}, "weight must be a positive finite number, got True"),
        ({"plugins": [{"name": "load", "weight": float("nan")}]}, "weight must be a positive finite number, got nan"),
        ({"plugins": [{"name": "load"}]}, "plugins[0] (load): missing weight"),
        ({"plugins": [{"name": "load", "weight": 1, "wieght": 2}]}, "plugins[0]: unknown keys ['wieght']"),
        ({"plugins": [{"name": "load", "weight": 1}, {"name": "load", "weight": 2}]}, "each plugin may appear once"),
        ({"plugins": [{"name": "random", "weight": 1, "args": {"sed": 3}}]}, "plugins[0] (random): bad args {'sed': 3}"),
        ({"plugins": [{"name": "session", "weight": 1, "args": {"max_sessions": 0}}]}, "max_sessions must be a positive integer"),
        ({"plugins": []}, '"plugins" must be a non-empty list'),
        ({"plugin": []}, 'one key, "plugins"'),
        ({"plugins": ["prefix"]}, "plugins[0]: expected a mapping"),
    ],
)
def test_bad_configs_get_clear_errors(config, message):
    with pytest.raises(ScorerConfigError) as error:
        load_scorer_config(config)
    assert message in str(error.value)


def test_bad_config_files_get_clear_errors(tmp_path):
    with pytest.raises(ScorerConfigError, match="cannot read scorer config"):
        load_scorer_config(tmp_path / "missing.json")
    (tmp_path / "broken.json").write_text("{plugins")
    with pytest.raises(ScorerConfigError, match="broken.json: not valid JSON"):
        load_scorer_config(tmp_path / "broken.json")
    (tmp_path / "scorer.toml").write_text("")
    with pytest.raises(ScorerConfigError, match="a .json, .yaml or .yml file"):
        load_scorer_config(tmp_path / "scorer.toml")
