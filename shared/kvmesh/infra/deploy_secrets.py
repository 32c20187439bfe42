"""``kvmesh credentials --out DIR``: the secrets the compose and Kubernetes files mount.

Everything is made fresh: a CA and certificates for nats-server and etcd (their service
names in compose and Kubernetes, and loopback), the NATS users with their permissions and a
TLS-only, handshake-first server config, the etcd users and roles (applied by the
``etcd-auth`` job), one credentials file per identity: ``router``, ``kv-metadata`` and
the workers' (``prefill-worker-0``, ..., ``decode-worker-0``, ...: a StatefulSet pod's name,
or in compose an identity slot a replica claims, ``kvmesh.cluster.identity_slots``), and the
router's API key file. Files are mode 0600 in a 0700 folder; ``secrets.yaml`` holds the same
as Kubernetes Secret objects, one per consumer, so each pod mounts only its own.

Every file is mounted at ``MOUNT`` in the containers; the configs name it there.
"""

from __future__ import annotations

import base64
import json
import secrets as random_secrets
from pathlib import Path

import yaml

from kvmesh.infra.credentials import MeshCredentials
from kvmesh.security.nats_permissions import DEFAULT_REQUEST_DEADLINE
from kvmesh.infra.etcd_auth import write_users
from kvmesh.security.credentials import write_private
from kvmesh.security.tls import MeshTLS

MOUNT = "/run/secrets/kvmesh"  # where every container finds its secret files
KV_METADATA_ID = "kv-metadata"
CA = "ca.crt"
NATS_SERVER_CONF, NATS_USERS_CONF = "nats-server.conf", "nats-users.conf"
ETCD_USERS = "etcd-users.json"
API_KEYS = "api-keys"  # the router's API key file (``--api-key-file``): one key, named default


def service_hosts(service: str, namespace: str) -> list[str]:
    """The names a server is reached by: compose and Kubernetes service names, loopback."""
    return [service, f"{service}.{namespace}", f"{service}.{namespace}.svc", f"{service}.{namespace}.svc.cluster.local", "localhost", "127.0.0.1"]


def worker_ids(prefill: int, decode: int) -> dict[str, str]:
    """Worker id -> role: the StatefulSets' pod names and the compose replicas' identity slots."""
    ids = {f"prefill-worker-{i}": "prefill" for i in range(prefill)}
    ids.update({f"decode-worker-{i}": "decode" for i in range(decode)})
    return ids


def generate(
    out: Path,
    *,
    prefill: int,
    decode: int,
    mesh_namespace: str = "default",
    k8s_namespace: str = "kvmesh",
    request_deadline: float = DEFAULT_REQUEST_DEADLINE,
) -> dict[str, list[str]]:
    """Write every secret file into ``out``; returns the Kubernetes Secrets' files by Secret name."""
    out.mkdir(parents=True, exist_ok=True)
    out.chmod(0o700)
    workers = worker_ids(prefill, decode)
    credentials = MeshCredentials.generate(out, mesh_namespace, workers, KV_METADATA_ID, request_deadline=request_deadline)
    credentials.nats_config.rename(out / NATS_USERS_CONF)
    MeshTLS.generate(out, {"nats": service_hosts("nats", k8s_namespace), "etcd": [*service_hosts("etcd", k8s_namespace), "etcd-0.etcd"]})
    nats_conf = "\n".join([
        "# nats-server: the mesh's users and their permissions, TLS only, handshake first.",
        f'include "{NATS_USERS_CONF}"',
        "tls {",
        f'  cert_file: "{MOUNT}/nats.crt"',
        f'  key_file: "{MOUNT}/nats.key"',
        "  handshake_first: true",
        "  timeout: 2",
        "}",
    ])  # fmt: skip
    write_private(out / NATS_SERVER_CONF, nats_conf + "\n")
    write_users(out / ETCD_USERS, credentials.etcd_root_password, credentials.etcd_users)
    write_private(
        out / API_KEYS,
        "# the router's API keys, one name:key a line (services/router/api_keys.py); clients send the key as a Bearer token\n"
        f"default:sk-kvmesh-{random_secrets.token_urlsafe(32)}\n",
    )
    (out / CA).chmod(0o600)
    for name in ("nats.crt", "etcd.crt"):
        (out / name).chmod(0o600)
    secrets = {
        "kvmesh-nats-server": [NATS_SERVER_CONF, NATS_USERS_CONF, "nats.crt", "nats.key"],
        "kvmesh-etcd-server": ["etcd.crt", "etcd.key"],
        "kvmesh-etcd-auth": [ETCD_USERS, CA],
        "kvmesh-router": ["router.json", API_KEYS, CA],
        "kvmesh-kv-metadata": [f"{KV_METADATA_ID}.json", CA],
        "kvmesh-prefill-worker": [*(f"{w}.json" for w, role in workers.items() if role == "prefill"), CA],
        "kvmesh-decode-worker": [*(f"{w}.json" for w, role in workers.items() if role == "decode"), CA],
    }
    namespace = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": k8s_namespace}}  # so the Secrets can go first
    docs = [namespace] + [
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": name, "namespace": k8s_namespace, "labels": {"app.kubernetes.io/part-of": "kvmesh"}},
            "type": "Opaque",
            "data": {file: base64.b64encode((out / file).read_bytes()).decode() for file in files},
        }
        for name, files in secrets.items()
    ]
    write_private(out / "secrets.yaml", yaml.safe_dump_all(docs, sort_keys=False))
    write_private(out / "README", _readme(out, workers) + "\n")
    return secrets


def _readme(out: Path, workers: dict[str, str]) -> str:
    return "\n".join([
        f"Secrets of one kvmesh deployment, made by `kvmesh credentials --out {out}`.",
        "Compose: docker compose -f deploy/compose/compose.yaml up (KVMESH_SECRETS=<this folder> if not deploy/compose/secrets);",
        f"  the kvmesh containers run as uid 1000: chown 1000 *.json ca.crt {API_KEYS} first; each worker replica claims",
        "  one identity of its role (--scale decode-worker=N up to the decode identities here).",
        "Kubernetes: kubectl apply -f secrets.yaml && kubectl apply -k deploy/k8s/overlays/cpu (or cuda, ascend);",
        f"  the router asks for the API key in {API_KEYS} (the part after 'default:') as a Bearer token.",
        f"Workers: {json.dumps(workers)}",
    ])  # fmt: skip
