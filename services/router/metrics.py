"""The router's Prometheus metrics, and the tracker that records one request into them.

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

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kvmesh.protocol import TokenEvent
from kvmesh.services.router.openai_api import Usage

if TYPE_CHECKING:
    from kvmesh.services.router.rate_limit import Admission

__all__ = ["RequestTracker", "RouterMetrics"]

logger = logging.getLogger(__name__)


class RouterMetrics:
    """The router's Prometheus metrics, in a registry of their own."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
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

    def reject(self, key: str, limit: str) -> None:
        self.rate_limit_rejections.labels(key=key, limit=limit).inc()

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

    def on_event(self, event: TokenEvent) -> None:
        if event.token_ids:
            now = time.perf_counter()
            if self._last_token_at is None:
                self.metrics.time_to_first_token.observe(now - self._start)
            else:
                self.metrics.inter_token_latency.observe(now - self._last_token_at)
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
        m.key_requests.labels(key=self.key, status=str(status)).inc()
        m.key_prompt_tokens.labels(key=self.key).inc(self.prompt_tokens)
        m.key_generation_tokens.labels(key=self.key).inc(self.output_tokens)
        m.prompt_tokens.inc(self.prompt_tokens)
        m.generation_tokens.inc(self.output_tokens)
        m.cached_prompt_tokens.inc(self.cached_tokens)
        if status == 200:
            m.e2e_latency.observe(seconds)
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
