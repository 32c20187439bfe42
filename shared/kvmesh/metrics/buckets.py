"""Histogram buckets: vLLM's (``vllm/v1/metrics/buckets.py``, vLLM 0.1x), so dashboards made
for vLLM read kvmesh's histograms unchanged; and kvmesh's own for what vLLM has no
histogram of (engine steps, KV transfers, index queries)."""

from __future__ import annotations

# vLLM's REQUEST_LATENCY_BUCKETS: e2e, queue, prefill and decode time.
REQUEST_LATENCY = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
# vLLM's TIME_TO_FIRST_TOKEN_BUCKETS.
TIME_TO_FIRST_TOKEN = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
# vLLM's INTER_TOKEN_LATENCY_BUCKETS.
INTER_TOKEN_LATENCY = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)  # fmt: skip
# kvmesh's: one engine step (a batch's forward and sampling), 1 ms to 10 s.
ENGINE_STEP = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
# kvmesh's: one KV pull (a batched read of a request's blocks), 100 us to 30 s.
KV_TRANSFER = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
# kvmesh's: one kv-metadata prefix query, 10 us to 1 s.
INDEX_QUERY = (0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 1.0)
