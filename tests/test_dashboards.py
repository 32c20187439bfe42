"""The Grafana dashboards and the Prometheus alert rules query only metrics (and labels) that
kvmesh exports: every PromQL expression is parsed (promql-parser, a full PromQL parser), and
every series name and label it uses is checked against tests/metric_names.py."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from tests.metric_names import METRICS, TARGET_LABELS, series_names

ROOT = Path(__file__).resolve().parents[1]
GRAFANA = ROOT / "deploy/grafana"
ALERTS = ROOT / "deploy/prometheus/alerts.yaml"
# Series Prometheus makes itself, with their labels.
BUILTIN = {"up": frozenset(TARGET_LABELS)}
# Grafana's variables, as the values a query runs with.
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$__interval": "15s", "$__range": "1h", "$model": ".*", "$worker": ".*"}


def promql_uses(expr: str) -> list[tuple[str | None, set[str]]]:
    """Each vector selector of ``expr`` as (series name, labels its matchers name), and a
    (None, labels) entry for the labels its aggregations and vector matchings name."""
    import promql_parser as promql

    for name, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(name, value)
    assert "$" not in expr, f"unknown Grafana variable in {expr!r}"
    found: list[tuple[str | None, set[str]]] = []

    def walk(node) -> None:
        if isinstance(node, promql.VectorSelector):
            labels = {m.name for m in node.matchers.matchers} - {"__name__"}
            found.append((node.name, labels))
        elif isinstance(node, promql.MatrixSelector):
            walk(node.vector_selector)
        elif isinstance(node, promql.AggregateExpr):
            if node.modifier is not None:
                found.append((None, set(node.modifier.labels)))
            walk(node.expr)
            if node.param is not None:
                walk(node.param)
        elif isinstance(node, promql.BinaryExpr):
            modifier = node.modifier
            if modifier is not None and modifier.matching is not None:
                found.append((None, set(modifier.matching.labels)))
            walk(node.lhs)
            walk(node.rhs)
        elif isinstance(node, promql.Call):
            for arg in node.args:
                walk(arg)
        elif isinstance(node, promql.ParenExpr | promql.UnaryExpr | promql.SubqueryExpr):
            walk(node.expr)
        else:
            assert isinstance(node, promql.NumberLiteral | promql.StringLiteral), f"unhandled {type(node).__name__} in {expr!r}"

    walk(promql.parse(expr))
    return found


def problems(expr: str) -> list[str]:
    """What in ``expr`` is not exported: unknown series, labels a series does not have."""
    known = series_names()
    out, labels_of_expr = [], set()
    for name, labels in promql_uses(expr):
        if name is None:
            continue
        metric = known.get(name)
        allowed = metric.all_labels if metric else BUILTIN.get(name)
        if allowed is None:
            out.append(f"{name}: not exported")
            continue
        labels_of_expr |= allowed
        out += [f"{name}: no label {label}" for label in sorted(labels - allowed)]
    for name, labels in promql_uses(expr):
        if name is None:
            out += [f"grouping by {label}, which none of its series has" for label in sorted(labels - labels_of_expr)]
    return out


def dashboards() -> dict[str, dict]:
    return {path.name: json.loads(path.read_text()) for path in sorted((GRAFANA / "dashboards").glob("*.json"))}


def all_panels(dashboard: dict) -> list[dict]:
    panels = []
    for panel in dashboard["panels"]:
        panels.append(panel)
        panels += panel.get("panels", [])  # a collapsed row holds its panels
    return panels


def dashboard_queries() -> list[tuple[str, str, str]]:
    """(dashboard, panel title, PromQL) of every query, the variables' too."""
    queries = []
    for file, dashboard in dashboards().items():
        for panel in all_panels(dashboard):
            for target in panel.get("targets", []):
                queries.append((file, panel["title"], target["expr"]))
        for variable in dashboard["templating"]["list"]:
            match = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", variable["query"]["query"])
            assert match, variable
            queries.append((file, f"variable {variable['name']}", f"count by ({match.group(2)}) ({match.group(1)})"))
    return queries


def alert_rules() -> list[dict]:
    return [rule for group in yaml.safe_load(ALERTS.read_text())["groups"] for rule in group["rules"]]


def test_there_are_dashboards_and_alerts():
    assert len(dashboard_queries()) > 30 and len(alert_rules()) >= 5


@pytest.mark.parametrize("where,title,expr", dashboard_queries(), ids=lambda v: v if isinstance(v, str) and len(v) < 60 else "")
def test_every_dashboard_query_names_only_exported_metrics_and_labels(where, title, expr):
    assert problems(expr) == [], (where, title, expr)


@pytest.mark.parametrize("rule", alert_rules(), ids=lambda rule: rule["alert"])
def test_every_alert_names_only_exported_metrics_and_labels(rule):
    assert problems(rule["expr"]) == [], rule["alert"]
    assert rule["labels"]["severity"] in ("critical", "warning", "info") and rule["annotations"]["summary"]
    assert re.fullmatch(r"\d+[smh]", rule["for"])


def test_the_checker_catches_what_is_not_exported():
    assert problems("kvmesh:kv_cache_usage_perc > 0.9") == []
    assert problems("kvmesh:kv_cache_usage > 0.9") == ["kvmesh:kv_cache_usage: not exported"]
    assert problems("rate(kvmesh:prompt_tokens[5m])") == ["kvmesh:prompt_tokens: not exported"]  # a counter's series is _total
    assert problems("kvmesh:num_requests_waiting{tier='device'}") == ["kvmesh:num_requests_waiting: no label tier"]
    assert problems("sum by (worker) (kvmesh:kvindex_blocks)") == ["grouping by worker, which none of its series has"]
    assert problems("histogram_quantile(0.9, sum by (le) (rate(kvmesh:engine_step_seconds_bucket[5m])))") == []
    assert problems('up{job="router"} == 0') == []


def test_the_dashboards_show_what_an_operator_needs():
    """TTFT / ITL / e2e percentiles, throughput, prefix-cache hit rate per worker and
    cluster-wide, KV usage per tier, transfer throughput, queue depth, errors, retries and
    rate-limit rejections."""
    used = {name for _, _, expr in dashboard_queries() for name, _ in promql_uses(expr) if name}
    wanted = {
        "kvmesh:router_time_to_first_token_seconds_bucket", "kvmesh:router_inter_token_latency_seconds_bucket",
        "kvmesh:router_e2e_request_latency_seconds_bucket", "kvmesh:generation_tokens_total", "kvmesh:prompt_tokens_total",
        "kvmesh:prefix_cache_hits_total", "kvmesh:prefix_cache_queries_total", "kvmesh:kv_blocks",
        "kvmesh:kv_cache_usage_perc", "kvmesh:kv_transfer_bytes_total", "kvmesh:num_requests_waiting",
        "kvmesh:router_requests_total", "kvmesh:router_retries_total", "kvmesh:router_rate_limit_rejections_total",
    }  # fmt: skip
    assert wanted <= used, wanted - used
    titles = {panel["title"] for dashboard in dashboards().values() for panel in all_panels(dashboard)}
    assert {"Prefix cache hit rate, per worker", "Prefix cache hit rate, cluster-wide", "KV cache usage, per tier"} <= titles
    # Every contract metric shows up somewhere: a dashboard or an alert.
    alerted = {name for rule in alert_rules() for name, _ in promql_uses(rule["expr"]) if name}
    shown = {series_names()[name].name for name in used | alerted if name in series_names()}
    assert shown == {metric.name for metric in METRICS}, {metric.name for metric in METRICS} - shown


def test_dashboards_are_well_formed_and_use_the_provisioned_datasource():
    datasource = yaml.safe_load((GRAFANA / "provisioning/datasources/prometheus.yaml").read_text())["datasources"][0]
    assert datasource["type"] == "prometheus" and datasource["url"] == "http://prometheus:9090"
    uids = set()
    for file, dashboard in dashboards().items():
        assert dashboard["uid"] not in uids
        uids.add(dashboard["uid"])
        ids = [panel["id"] for panel in all_panels(dashboard)]
        assert len(ids) == len(set(ids)), file
        for panel in all_panels(dashboard):
            if panel["type"] == "row":
                continue
            assert panel["datasource"]["uid"] == datasource["uid"], (file, panel["title"])
            assert panel["targets"] and all(t["datasource"]["uid"] == datasource["uid"] for t in panel["targets"])
            grid = panel["gridPos"]
            assert grid["x"] + grid["w"] <= 24, (file, panel["title"])


def test_compose_provisions_grafana_and_prometheus_from_these_files():
    compose = yaml.safe_load((ROOT / "deploy/compose/compose.yaml").read_text())["services"]
    provider = yaml.safe_load((GRAFANA / "provisioning/dashboards/kvmesh.yaml").read_text())["providers"][0]
    mounts = {
        volume.split(":")[1]: (ROOT / "deploy/compose" / volume.split(":")[0]).resolve()
        for volume in compose["grafana"]["volumes"]
    }
    assert mounts[provider["options"]["path"]] == (GRAFANA / "dashboards").resolve()
    assert mounts["/etc/grafana/provisioning"] == (GRAFANA / "provisioning").resolve()
    prometheus = {
        volume.split(":")[1]: (ROOT / "deploy/compose" / volume.split(":")[0]).resolve()
        for volume in compose["prometheus"]["volumes"]
        if volume.startswith(".")
    }
    config = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yaml").read_text())
    assert prometheus["/etc/prometheus/alerts.yaml"] == ALERTS.resolve()
    assert config["rule_files"] == ["/etc/prometheus/alerts.yaml"]
    assert (
        f"--config.file={next(k for k, v in prometheus.items() if v.name == 'prometheus.yaml')}"
        in compose["prometheus"]["command"]
    )


def test_kv_metadata_panels_are_not_filtered_by_model():
    """kv-metadata's one index spans every model (its series say model_name="all"): a
    model_name matcher on them would show nothing once a model is picked."""
    for where, title, expr in dashboard_queries():
        for name, labels in promql_uses(expr):
            metric = series_names().get(name or "")
            if metric is not None and metric.service == "kv-metadata":
                assert "model_name" not in labels, (where, title, expr)
