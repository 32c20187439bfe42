"""Every service's /metrics, read from a live mesh as Prometheus would: each name of the
contract (``kvmesh.metrics.contract``, the one list dashboards and docs/metrics.md are held
to) is exported with its labels, token counters move while a long request runs, and the KV
bytes of a pull are counted the same on both sides. (vLLM workers' names and counts: in
``tests/mesh/test_vllm.py``, on its mesh.)"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvmesh.cluster.etcd_store import EtcdStore
from kvmesh.infra.local_mesh import LocalMesh
from kvmesh.metrics.contract import BY_SERVICE, KV_METADATA, ROUTER, WORKER, WORKER_LABELS, MetricName
from kvmesh.protocol import Keys, WorkerRecord
from tests.mesh.client import post, stream
from tests.mesh.meshes import MODEL

pytestmark = pytest.mark.slow

DOC = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"
Samples = dict[str, list[tuple[str, dict[str, str], float]]]  # family -> (sample name, labels, value)


async def scrape(url: str) -> Samples:
    async with httpx.AsyncClient(timeout=10) as client:
        response = await client.get(url)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain")
    return {
        family.name: [(s.name, dict(s.labels), s.value) for s in family.samples]
        for family in text_string_to_metric_families(response.text)
    }


def value(samples: Samples, name: str, suffix: str = "", **labels: str) -> float:
    """The sum of the family's samples named ``name + suffix`` whose labels include ``labels``."""
    return sum(
        v for sample, have, v in samples.get(name, []) if sample == name + suffix and labels.items() <= have.items()
    )


async def metrics_urls(mesh: LocalMesh) -> dict[str, str]:
    """Each service's /metrics: the workers' from their etcd records, kv-metadata's from the
    line its health server logs, the router's on its own port."""
    assert mesh.etcd is not None and mesh.kv_metadata is not None
    async with EtcdStore([mesh.etcd.endpoint]) as store:
        items, _ = await store.get_prefix(Keys("default").workers())
    urls = {"router": f"{mesh.base_url}/metrics"}
    for item in items:
        record = WorkerRecord.decode(item.value)
        if record.health_url:
            urls[record.role] = f"{record.health_url}/metrics"
    found = re.search(r"health checks on (http://\S+)/health/live", mesh.kv_metadata.log_path.read_text())
    assert found, "kv-metadata logged no health server"
    urls["kv-metadata"] = f"{found.group(1)}/metrics"
    assert set(urls) == {"router", "prefill", "decode", "kv-metadata"}, urls
    return urls


@pytest.fixture
async def urls(mesh) -> dict[str, str]:
    return await metrics_urls(mesh)


def completion(prompt: str, max_tokens: int) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}


def test_the_doc_describes_exactly_the_contract():
    """docs/metrics.md has one row per contract name, with its kind."""
    rows = dict(re.findall(r"^\| `(kvmesh:[a-z0-9_]+)`[^|]*\| (counter|gauge|histogram) \|", DOC.read_text(), re.M))
    want = {m.name: m.kind for names in BY_SERVICE.values() for m in names}
    assert rows == want


async def test_every_contract_name_is_exported_with_its_labels(mesh, urls):
    prompt = "The capital of France is Paris, and the capital of Italy is Rome. The capital of Spain is"
    response = await post(mesh.base_url, "/v1/completions", completion(prompt, 4))
    assert response.status_code == 200, response.text
    for _ in range(50):  # the prefill's blocks reach the index with the worker's next event batch
        if value(await scrape(urls["kv-metadata"]), "kvmesh:kvindex_blocks") > 0:
            break
        await asyncio.sleep(0.1)
    services: list[tuple[str, tuple[MetricName, ...], tuple[str, ...]]] = [
        ("prefill", WORKER, WORKER_LABELS),
        ("decode", WORKER, WORKER_LABELS),
        ("kv-metadata", KV_METADATA, ("model_name",)),
        ("router", ROUTER, ("model_name",)),
    ]
    for service, names, labels in services:
        samples = await scrape(urls[service])
        missing = [m.name for m in names if m.name not in samples]
        assert not missing, f"{service} does not export {missing}"
        for m in names:
            for sample, have, _ in samples[m.name]:
                assert set(labels) | set(m.labels) <= set(have), (service, sample, have)
                if service in ("prefill", "decode"):
                    assert have["role"] == service and have["model_name"] == MODEL, have
                    assert have["worker"].startswith(service), have
            assert samples[m.name], f"{service}: {m.name} has no series"
        if service == "kv-metadata":
            assert value(samples, "kvmesh:kvindex_blocks") > 0
            assert value(samples, "kvmesh:kvindex_workers") >= 1
            assert value(samples, "kvmesh:kvindex_events", "_total") > 0
            # no query: the router routes by its own copy of the index (``--kv-index replica``)
    router = await scrape(urls["router"])
    ok = value(router, "kvmesh:router_requests", "_total", model_name=MODEL, endpoint="/v1/completions", status="200")
    assert ok >= 1
    assert value(router, "kvmesh:router_routing_decisions", "_total", model_name=MODEL) >= 1
    assert value(router, "kvmesh:router_time_to_first_token_seconds", "_count") >= 1
    assert value(router, "kvmesh:router_kv_index_blocks", model_name=MODEL) > 0  # its copy follows the workers
    assert "kvmesh_router_requests" in router  # the names of before are still there


async def test_token_counters_move_while_a_long_request_runs(mesh, urls):
    new_tokens = 200
    before = {role: await scrape(urls[role]) for role in ("prefill", "decode")}
    during: list[Samples] = []

    async def sample(events: list[dict]) -> None:
        if len(events) in (20, 120):  # twice while it runs
            during.append(await scrape(urls["decode"]))

    body = {**completion("Once upon a time, a small robot", new_tokens), "stream_options": {"include_usage": True}}
    events = await stream(mesh.base_url, "/v1/completions", body, on_event=sample)
    assert len(during) == 2
    gen = "kvmesh:generation_tokens"
    base = value(before["decode"], gen, "_total")
    first, second = (value(s, gen, "_total") - base for s in during)
    assert 0 < first < second < new_tokens - 1, (first, second)  # counted as made, not at the end
    for s in during:
        assert value(s, "kvmesh:num_requests_running") == 1
    after = {role: await scrape(urls[role]) for role in ("prefill", "decode")}
    # The prefill worker made the first token, the decode worker the rest.
    assert value(after["prefill"], gen, "_total") - value(before["prefill"], gen, "_total") == 1
    assert value(after["decode"], gen, "_total") - base == new_tokens - 1
    prompt = value(after["prefill"], "kvmesh:prompt_tokens", "_total") - value(before["prefill"], "kvmesh:prompt_tokens", "_total")
    assert prompt == events[-1]["usage"]["prompt_tokens"] > 0
    queries = "kvmesh:prefix_cache_queries"
    assert value(after["prefill"], queries, "_total") - value(before["prefill"], queries, "_total") == prompt
    assert value(after["decode"], "kvmesh:prompt_tokens", "_total") == value(before["decode"], "kvmesh:prompt_tokens", "_total")
    for name in ("kvmesh:e2e_request_latency_seconds", "kvmesh:time_to_first_token_seconds", "kvmesh:request_decode_time_seconds"):
        assert value(after["decode"], name, "_count") - value(before["decode"], name, "_count") == 1, name
    itl = value(after["decode"], "kvmesh:inter_token_latency_seconds", "_count") - value(
        before["decode"], "kvmesh:inter_token_latency_seconds", "_count"
    )
    assert itl == new_tokens - 1  # one per step after the first (imported) token: a gap between each two tokens
    assert value(after["decode"], "kvmesh:engine_step_seconds", "_count") > value(before["decode"], "kvmesh:engine_step_seconds", "_count")
    assert value(after["decode"], "kvmesh:num_requests_running") == 0
    assert 0 < value(after["decode"], "kvmesh:kv_cache_usage_perc") < 1 or value(after["decode"], "kvmesh:kv_blocks", state="free") > 0


async def test_transfer_bytes_are_the_same_on_both_sides_of_a_pull(mesh, urls):
    def transfer(samples: Samples, direction: str) -> tuple[float, float]:
        return (
            value(samples, "kvmesh:kv_transfer_bytes", "_total", direction=direction),
            value(samples, "kvmesh:kv_transfer_seconds", "_count", direction=direction),
        )

    before_in = transfer(await scrape(urls["decode"]), "in")
    before_out = transfer(await scrape(urls["prefill"]), "out")
    prompt = "Here is a list of three fruits: apples, pears and plums. Here are three more fruits:"
    response = await post(mesh.base_url, "/v1/completions", completion(prompt, 4))
    assert response.status_code == 200, response.text
    for _ in range(50):  # the lender counts its side when the puller's release arrives
        pulled = transfer(await scrape(urls["decode"]), "in")
        served = transfer(await scrape(urls["prefill"]), "out")
        if served[1] > before_out[1]:
            break
        await asyncio.sleep(0.1)
    nbytes = pulled[0] - before_in[0]
    assert nbytes > 0
    assert served[0] - before_out[0] == nbytes
    assert (pulled[1] - before_in[1], served[1] - before_out[1]) == (1, 1)
    # Nothing moves the other way: the prefill worker pulled nothing, the decode worker lent nothing.
    assert transfer(await scrape(urls["decode"]), "out") == (0, 0)
