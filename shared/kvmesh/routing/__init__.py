"""KV-aware routing: score plugins and the weighted scorer that combines them."""

from kvmesh.routing.plugins import (
    PLUGIN_TYPES,
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
from kvmesh.routing.scorer import (
    DEFAULT_SCORER_CONFIG,
    Decision,
    ScorerConfigError,
    WeightedScorer,
    load_scorer_config,
    read_scorer_config,
)

__all__ = [
    "DEFAULT_SCORER_CONFIG",
    "PLUGIN_TYPES",
    "Candidate",
    "Decision",
    "EstimatedTtftPlugin",
    "LoadPlugin",
    "PrefillPlan",
    "PrefixOverlapPlugin",
    "RandomPlugin",
    "RouteRequest",
    "ScorePlugin",
    "ScorerConfigError",
    "SessionAffinityPlugin",
    "WeightedScorer",
    "load_scorer_config",
    "plan_prefill",
    "read_scorer_config",
]
