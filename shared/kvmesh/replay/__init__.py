"""Trace replay: read Mooncake-format traces and simulate routing policies on them."""

from kvmesh.replay.simulator import (
    DEFAULT_POLICIES,
    POLICIES,
    PolicyResult,
    SimConfig,
    SimWorker,
    oracle_hits,
    percentile,
    simulate,
    simulate_policies,
)
from kvmesh.replay.trace import MOONCAKE_BLOCK_SIZE, TraceError, TraceRequest, load_trace, parse_trace

__all__ = [
    "DEFAULT_POLICIES",
    "MOONCAKE_BLOCK_SIZE",
    "POLICIES",
    "PolicyResult",
    "SimConfig",
    "SimWorker",
    "TraceError",
    "TraceRequest",
    "load_trace",
    "oracle_hits",
    "parse_trace",
    "percentile",
    "simulate",
    "simulate_policies",
]
