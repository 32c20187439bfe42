"""Turning etcd's auth on with the mesh's users and roles, through etcd's HTTP gateway.

``LocalMesh`` calls it once on a fresh etcd; the deployment files run it as a one-shot job
(``kvmesh etcd-auth --users FILE``) before the services start, every time they are
deployed: on an etcd whose auth is already on it logs in as root and brings every user,
password and grant up to the file (a re-run is harmless). The users file, mode 0600:

    {"root_password": "...",
     "users": {"router": {"password": "...", "grants": [{"key": "/kvmesh/default/workers/",
                                                          "permission": "READ", "prefix": true}]}}}
"""

from __future__ import annotations

import base64
import json
import logging
import ssl
import urllib.error
import urllib.request
from pathlib import Path

from kvmesh.errors import KvmeshError
from kvmesh.security.credentials import write_private
from kvmesh.security.etcd_roles import ROOT, Grant
from kvmesh.settings.files import settings_text

logger = logging.getLogger(__name__)

EtcdUsers = dict[str, tuple[str, tuple[Grant, ...]]]  # user name -> (password, grants)


class EtcdAuthError(KvmeshError):
    """etcd refused to set auth up (or could not be reached)."""


class Gateway:
    """etcd's JSON gateway at ``url`` (``http(s)://host:port``), with a token once logged in."""

    def __init__(self, url: str, *, context: ssl.SSLContext | None = None, timeout: float = 5.0) -> None:
        self.url = url.rstrip("/")
        self.context = context
        self.timeout = timeout
        self.token: str | None = None

    def post(self, path: str, body: dict) -> dict:
        headers = {"Content-Type": "application/json", **({"Authorization": self.token} if self.token else {})}
        request = urllib.request.Request(self.url + path, data=json.dumps(body).encode(), headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout, context=self.context) as response:
                return json.loads(response.read() or b"{}")
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")
            try:
                detail = json.loads(detail).get("message") or detail
            except ValueError:
                pass
            raise EtcdAuthError(f"etcd {path}: {detail}") from None

    def login(self, user: str, password: str) -> None:
        self.token = str(self.post("/v3/auth/authenticate", {"name": user, "password": password})["token"])


def enable_auth(gateway: Gateway, root_password: str, users: EtcdUsers) -> None:
    """``root`` and, per user name, (password, grants): one role per user, named after it.
    On a fresh etcd: everything, then auth on. On one whose auth is on (a second deploy):
    as root, each user's password and grants made what ``users`` says: grants it no longer
    lists revoked, users it no longer names (a worker scaled away) deleted with their role."""
    try:
        gateway.login(ROOT, root_password)
    except EtcdAuthError as exc:
        if "authentication is not enabled" not in str(exc):
            raise
        already = False
    else:
        already = True
    if already:
        _drop_users_not_in(gateway, users)
    for name, (password, grants) in users.items():
        _ensure(gateway, "/v3/auth/user/add", {"name": name, "password": password}, "already exists")
        if already:
            gateway.post("/v3/auth/user/changepw", {"name": name, "password": password})
        _ensure(gateway, "/v3/auth/role/add", {"name": name}, "already exists")
        if already:
            _revoke_grants_not_in(gateway, name, grants)
        for grant in grants:
            perm = {"permType": grant.permission, "key": b64(grant.key)}
            if grant.prefix:
                perm["range_end"] = b64(prefix_end(grant.key))
            gateway.post("/v3/auth/role/grant", {"name": name, "perm": perm})
        gateway.post("/v3/auth/user/grant", {"user": name, "role": name})
    if not already:
        gateway.post("/v3/auth/user/add", {"name": ROOT, "password": root_password})
        gateway.post("/v3/auth/user/grant", {"user": ROOT, "role": "root"})  # etcd's built-in role
        gateway.post("/v3/auth/enable", {})
    logger.info("etcd auth %s with %d users besides root", "brought up to date" if already else "enabled", len(users))


def _drop_users_not_in(gateway: Gateway, users: EtcdUsers) -> None:
    for name in gateway.post("/v3/auth/user/list", {}).get("users") or []:
        if name == ROOT or name in users:
            continue
        gateway.post("/v3/auth/user/delete", {"name": name})
        _ensure(gateway, "/v3/auth/role/delete", {"role": name}, "role name not found")
        logger.info("etcd user %s deleted: the users file no longer names it", name)


def _revoke_grants_not_in(gateway: Gateway, role: str, grants: tuple[Grant, ...]) -> None:
    """Revoke each of ``role``'s permissions that ``grants`` does not list exactly (etcd's
    JSON leaves out the zero values: READ and an empty range end)."""
    wanted = {(b64(g.key), b64(prefix_end(g.key)) if g.prefix else "", g.permission) for g in grants}
    for perm in gateway.post("/v3/auth/role/get", {"role": role}).get("perm") or []:
        held = (perm.get("key", ""), perm.get("range_end", ""), perm.get("permType", "READ"))
        if held not in wanted:
            gateway.post("/v3/auth/role/revoke", {"role": role, "key": held[0], "range_end": held[1]})


def _ensure(gateway: Gateway, path: str, body: dict, exists: str) -> None:
    try:
        gateway.post(path, body)
    except EtcdAuthError as exc:
        if exists not in str(exc):
            raise


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def prefix_end(prefix: str) -> str:
    """The range end that covers every key starting with ``prefix`` (its last byte plus one)."""
    raw = prefix.encode()
    return (raw[:-1] + bytes([raw[-1] + 1])).decode()


# -- the users file ---------------------------------------------------------------------------
def write_users(path: Path, root_password: str, users: EtcdUsers) -> Path:
    body = {
        "root_password": root_password,
        "users": {
            name: {"password": password, "grants": [{"key": g.key, "permission": g.permission, "prefix": g.prefix} for g in grants]}
            for name, (password, grants) in users.items()
        },
    }
    write_private(path, json.dumps(body, indent=2) + "\n")
    return path


def read_users(path: Path) -> tuple[str, EtcdUsers]:
    try:
        text = settings_text(path)
    except OSError as exc:
        raise EtcdAuthError(f"etcd users file {path}: {exc.strerror or exc}") from None
    try:
        body = json.loads(text)
        users = {
            name: (str(entry["password"]), tuple(Grant(g["key"], g["permission"], bool(g.get("prefix"))) for g in entry["grants"]))
            for name, entry in body["users"].items()
        }
        return str(body["root_password"]), users
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise EtcdAuthError(f"etcd users file {path}: {exc!r}") from exc


def run(endpoints: list[str], users_file: Path, *, tls_ca: str | None, wait: float) -> None:
    """``kvmesh etcd-auth``: set auth up on the etcd at ``endpoints[0]`` (``host:port``, or a
    URL), waiting up to ``wait`` seconds for it to answer."""
    import time

    from kvmesh.security.tls import client_context

    root_password, users = read_users(users_file)
    endpoint = endpoints[0]
    url = endpoint if "://" in endpoint else f"{'https' if tls_ca else 'http'}://{endpoint}"
    gateway = Gateway(url, context=client_context(tls_ca) if tls_ca else None)
    deadline = time.monotonic() + wait
    while True:
        try:
            enable_auth(gateway, root_password, users)
            return
        except (EtcdAuthError, OSError) as exc:  # urllib's URLError is an OSError
            if time.monotonic() > deadline or isinstance(exc, EtcdAuthError):
                raise EtcdAuthError(f"etcd at {url}: {exc}") from None
            logger.info("etcd at %s not answering yet (%s); retrying", url, exc)
            time.sleep(1.0)
