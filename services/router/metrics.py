"""The router's Prometheus metrics, and the tracker that records one request into them (and
the OpenTelemetry ``gen_ai.*`` attributes onto its span).

The contract's names (``kvmesh.metrics.contract.ROUTER``, vLLM's buckets, label
``model_name``): ``kvmesh:router_requests{endpoint,status}``, ``..._requests_in_flight``,
``..._routing_decisions{reason}`` (``worker_choice.ROUTE_REASONS``, one per attempt),
``..._retries{reason}`` (``attempts.RETRY_KINDS``), ``..._rate_limit_rejections{limit}``,
and the TTFT, inter-token and e2e histograms. The ``kvmesh_router_*`` names of before stay
(same meaning, kvmesh's own buckets, no ``model_name``).

Per API key (its name, never the key): ``kvmesh_router_key_requests_total{key,status}`` (requests
that reached the mesh, by outcome), ``kvmesh_router_key_prompt_tokens_total{key}``,
``kvmesh_router_key_generation_tokens_total{key}``, and
``kvmesh_router_rate_limit_rejections_total{key,limit}`` (limit: input_tokens, output_tokens,
concurrent). Without keys the name is ``anonymous``.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from opentelemetry import trace
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kvmesh.metrics import buckets
from kvmesh.protocol import TokenEvent
from kvmesh.services.router.openai_api import Usage

if TYPE_CHECKING:
    from kvmesh.services.router.rate_limit import Admission

__all__ = ["RequestTracker", "RouterMetrics"]

logger = logging.getLogger(__name__)


class RouterMetrics:
    """The router's Prometheus metrics, in a registry of their own."""

    def __init__(self, model_name: str = "") -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        r = self.registry
        model = {"model_name": model_name}
        self.contract_requests = Counter(
            "kvmesh:router_requests", "Generation requests by endpoint and HTTP status", ["model_name", "endpoint", "status"],
            registry=r,
        )  # fmt: skip
        self.contract_in_flight = Gauge(
            "kvmesh:router_requests_in_flight", "Requests being generated", ["model_name"], registry=r
        ).labels(**model)
        routing = Counter(
            "kvmesh:router_routing_decisions", "Attempts routed, by why they went where they did", ["model_name", "reason"],
            registry=r,
        )  # fmt: skip
        from kvmesh.services.router.attempts import RETRY_KINDS
        from kvmesh.services.router.worker_choice import ROUTE_REASONS

        self.routing_decisions = {reason: routing.labels(**model, reason=reason) for reason in ROUTE_REASONS}
        retries = Counter("kvmesh:router_retries", "Attempts retried, by reason", ["model_name", "reason"], registry=r)
        self.retries = {kind: retries.labels(**model, reason=kind) for kind in RETRY_KINDS}
        rejections = Counter(
            "kvmesh:router_rate_limit_rejections", "Requests refused with a 429, by limit", ["model_name", "limit"], registry=r
        )
        self.contract_rejections = {
            limit: rejections.labels(**model, limit=limit) for limit in ("input_tokens", "output_tokens", "concurrent")
        }
        # the router's own copy of the KV index (``--kv-index replica``); 0 while kv-metadata is asked instead
        self.kv_index_blocks = Gauge(
            "kvmesh:router_kv_index_blocks", "Distinct block hashes in this router's copy of the KV index", ["model_name"], registry=r
        ).labels(**model)
        self.contract_ttft = Histogram(
            "kvmesh:router_time_to_first_token_seconds", "From the request reaching the backend to its first token",
            ["model_name"], buckets=buckets.TIME_TO_FIRST_TOKEN, registry=r,
        ).labels(**model)  # fmt: skip
        self.contract_itl = Histogram(
            "kvmesh:router_inter_token_latency_seconds", "Between two consecutive token events of a request",
            ["model_name"], buckets=buckets.INTER_TOKEN_LATENCY, registry=r,
        ).labels(**model)  # fmt: skip
        self.contract_e2e = Histogram(
            "kvmesh:router_e2e_request_latency_seconds", "From the request reaching the backend to its last token, successful requests",
            ["model_name"], buckets=buckets.REQUEST_LATENCY, registry=r,
        ).labels(**model)  # fmt: skip
        self.requests = Counter(
            "kvmesh_router_requests",
            "Generation requests by endpoint and HTTP status",
            ["endpoint", "status"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "kvmesh_router_prompt_tokens", "Prompt tokens sent to the mesh", registry=r
        )
        self.generation_tokens = Counter("kvmesh_router_generation_tokens", "Tokens generated", registry=r)
        self.cached_prompt_tokens = Counter(
            "kvmesh_router_cached_prompt_tokens", "Prompt tokens served from the KV cache", registry=r
        )
        self.time_to_first_token = Histogram(
            "kvmesh_router_time_to_first_token_seconds",
            "From the request reaching the backend to its first token",
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0),
            registry=r,
        )
        self.inter_token_latency = Histogram(
            "kvmesh_router_inter_token_latency_seconds",
            "Between two consecutive token events of a request",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
            registry=r,
        )
        self.e2e_latency = Histogram(
            "kvmesh_router_e2e_request_latency_seconds",
            "From the request reaching the backend to its last token, successful requests",
            buckets=(0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0),
            registry=r,
        )
        self.in_flight = Gauge("kvmesh_router_requests_in_flight", "Requests being generated", registry=r)
        self.key_requests = Counter(
            "kvmesh_router_key_requests", "Requests that reached the mesh, by API key name and HTTP status",
            ["key", "status"], registry=r,
        )  # fmt: skip
        self.key_prompt_tokens = Counter(
            "kvmesh_router_key_prompt_tokens", "Prompt tokens sent to the mesh, by API key name", ["key"], registry=r
        )
        self.key_generation_tokens = Counter(
            "kvmesh_router_key_generation_tokens", "Tokens generated, by API key name", ["key"], registry=r
        )
        self.rate_limit_rejections = Counter(
            "kvmesh_router_rate_limit_rejections",
            "Requests refused with a 429, by API key name and limit (input_tokens, output_tokens, concurrent)",
            ["key", "limit"], registry=r,
        )  # fmt: skip

    def count(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint=endpoint, status=str(status)).inc()
        self.contract_requests.labels(model_name=self.model_name, endpoint=endpoint, status=str(status)).inc()

    def reject(self, key: str, limit: str) -> None:
        self.rate_limit_rejections.labels(key=key, limit=limit).inc()
        counter = self.contract_rejections.get(limit)
        if counter is not None:
            counter.inc()

    def routed(self, reason: str) -> None:
        counter = self.routing_decisions.get(reason)
        if counter is not None:
            counter.inc()

    def retried(self, kind: str) -> None:
        counter = self.retries.get(kind) or self.retries["worker_error"]
        counter.inc()

    def watch(self, backend: object) -> None:
        """Count the routing decisions and retries of a backend that reports them (the mesh's)."""
        if hasattr(backend, "on_route"):
            backend.on_route = self.routed
        if hasattr(backend, "on_retry"):
            backend.on_retry = self.retried
        replica = getattr(backend, "replica", None)
        if replica is not None:
            self.kv_index_blocks.set_function(lambda: replica.index.num_blocks)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestTracker:
    """One request from the backend call to its end: metrics, usage and the log line."""

    def __init__(
        self,
        metrics: RouterMetrics,
        endpoint: str,
        request_id: str,
        prompt_tokens: int,
        *,
        key: str = "anonymous",
        admission: Admission | None = None,
        request: object | None = None,
        max_tokens: int | None = None,
    ) -> None:
        self.metrics = metrics
        self.key = key  # the API key's name
        self.admission = admission  # its rate-limit share: charged output tokens, released at the end
        self.endpoint = endpoint
        self.request_id = request_id
        self.prompt_tokens = prompt_tokens
        self.output_tokens = 0
        self.cached_tokens = 0
        self.finish_reason: str | None = None
        self._start = time.perf_counter()
        self._last_token_at: float | None = None
        self._done = False
        metrics.in_flight.inc()
        metrics.contract_in_flight.inc()
        self.span = trace.get_current_span()  # the request's (the HTTP server span): gen_ai.* go there
        self._span_request(request, max_tokens)

    def _span_request(self, request: object | None, max_tokens: int | None) -> None:
        """The request's side of OpenTelemetry's gen_ai semantic conventions."""
        span = self.span
        if not span.is_recording():
            return
        chat = "chat" in self.endpoint
        span.set_attribute("gen_ai.operation.name", "chat" if chat else "text_completion")
        span.set_attribute("gen_ai.system", "kvmesh")
        span.set_attribute("gen_ai.response.model", self.metrics.model_name)
        span.set_attribute("gen_ai.response.id", ("chatcmpl-" if chat else "cmpl-") + self.request_id)
        if max_tokens is not None:
            span.set_attribute("gen_ai.request.max_tokens", max_tokens)
        for attribute, field in (("model", "model"), ("temperature", "temperature"), ("top_p", "top_p"), ("seed", "seed")):
            value = getattr(request, field, None)
            if value is not None:
                span.set_attribute(f"gen_ai.request.{attribute}", value)

    def on_event(self, event: TokenEvent) -> None:
        if event.token_ids:
            now = time.perf_counter()
            if self._last_token_at is None:
                ttft = now - self._start
                self.metrics.time_to_first_token.observe(ttft)
                self.metrics.contract_ttft.observe(ttft)
                if self.span.is_recording():
                    self.span.set_attribute("gen_ai.response.time_to_first_token", ttft)  # seconds
                    self.span.add_event("gen_ai.first_token", {"gen_ai.response.time_to_first_token": ttft})
            else:
                itl = now - self._last_token_at
                self.metrics.inter_token_latency.observe(itl)
                self.metrics.contract_itl.observe(itl)
            self._last_token_at = now
            self.output_tokens += len(event.token_ids)
            if self.admission is not None:
                self.admission.add_output(len(event.token_ids))
        if event.finished:
            self.finish_reason = event.finish_reason
            self.cached_tokens = event.num_cached_tokens

    def usage(self) -> Usage:
        return Usage(self.prompt_tokens, self.output_tokens, self.cached_tokens)

    def finish(self, status: int) -> None:
        """Record the outcome once (the request counter is the caller's, see ``RouterMetrics.count``)."""
        if self._done:
            return
        self._done = True
        if self.admission is not None:
            self.admission.release()
        seconds = time.perf_counter() - self._start
        m = self.metrics
        m.in_flight.dec()
        m.contract_in_flight.dec()
        m.key_requests.labels(key=self.key, status=str(status)).inc()
        m.key_prompt_tokens.labels(key=self.key).inc(self.prompt_tokens)
        m.key_generation_tokens.labels(key=self.key).inc(self.output_tokens)
        m.prompt_tokens.inc(self.prompt_tokens)
        m.generation_tokens.inc(self.output_tokens)
        m.cached_prompt_tokens.inc(self.cached_tokens)
        if status == 200:
            m.e2e_latency.observe(seconds)
            m.contract_e2e.observe(seconds)
        self._span_usage()
        logger.info(
            "request %s %s key=%s status=%d prompt_tokens=%d cached_tokens=%d output_tokens=%d finish_reason=%s seconds=%.3f",
            self.request_id,
            self.endpoint,
            self.key,
            status,
            self.prompt_tokens,
            self.cached_tokens,
            self.output_tokens,
            self.finish_reason,
            seconds,
        )

    def _span_usage(self) -> None:
        """The response's side of the gen_ai conventions; the choices of one request add up."""
        span = self.span
        if not span.is_recording():
            return
        so_far = getattr(span, "attributes", None) or {}
        span.set_attribute("gen_ai.usage.input_tokens", int(so_far.get("gen_ai.usage.input_tokens", 0)) + self.prompt_tokens)
        span.set_attribute("gen_ai.usage.output_tokens", int(so_far.get("gen_ai.usage.output_tokens", 0)) + self.output_tokens)
        reasons = [*so_far.get("gen_ai.response.finish_reasons", ()), self.finish_reason or "error"]
        span.set_attribute("gen_ai.response.finish_reasons", reasons)
