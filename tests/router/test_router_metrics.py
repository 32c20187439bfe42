"""The router's contract metrics: every series there from the start (labelled with the
served model), routing decisions and retries counted by a bounded reason, and rejections by
limit, beside the names of before."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from kvmesh.metrics.contract import ROUTER
from kvmesh.services.router.attempts import RETRY_KINDS
from kvmesh.services.router.metrics import RouterMetrics
from kvmesh.services.router.worker_choice import ROUTE_REASONS, Choice, route_reason


def samples(metrics: RouterMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(metrics.render().decode())
        for s in family.samples
    }


class Backend:
    model_name = "m"
    on_route = on_retry = None


def test_decisions_retries_and_rejections_by_reason():
    metrics = RouterMetrics("m")
    backend = Backend()
    metrics.watch(backend)
    backend.on_route("prefix_cache")
    backend.on_route("prefix_cache")
    backend.on_retry("silent")
    backend.on_retry("something new")  # an unknown kind counts as a worker error, never a new series
    metrics.reject("alice", "concurrent")
    metrics.count("/v1/completions", 429)
    got = samples(metrics)
    assert got[("kvmesh:router_routing_decisions_total", (("model_name", "m"), ("reason", "prefix_cache")))] == 2
    assert got[("kvmesh:router_retries_total", (("model_name", "m"), ("reason", "silent")))] == 1
    assert got[("kvmesh:router_retries_total", (("model_name", "m"), ("reason", "worker_error")))] == 1
    assert got[("kvmesh:router_rate_limit_rejections_total", (("limit", "concurrent"), ("model_name", "m")))] == 1
    assert got[("kvmesh_router_rate_limit_rejections_total", (("key", "alice"), ("limit", "concurrent")))] == 1
    assert got[("kvmesh:router_requests_total", (("endpoint", "/v1/completions"), ("model_name", "m"), ("status", "429")))] == 1
    reasons = {dict(labels)["reason"] for name, labels in got if name == "kvmesh:router_retries_total"}
    assert reasons == set(RETRY_KINDS)
    families = {family.name for family in text_string_to_metric_families(metrics.render().decode())}
    assert {m.name for m in ROUTER} <= families


def test_route_reasons():
    class Record:
        worker_id = "prefill-1"

    cached = Choice(Record(), "x", cached_blocks=3)  # type: ignore[arg-type]
    cold = Choice(Record(), "x")  # type: ignore[arg-type]
    assert [route_reason(None, None), route_reason(cached, None), route_reason(cold, None), route_reason(cold, object())] == [
        "local_prefill", "prefix_cache", "load", "peer_prefix",
    ]  # fmt: skip
    assert route_reason(None, None, decode_prefix=True) == "decode_prefix"
    assert set(ROUTE_REASONS) == {"local_prefill", "prefix_cache", "load", "peer_prefix", "decode_prefix"}
