"""Fresh credentials for a mesh on one machine (``kvmesh up``, ``LocalMesh``), made at each
start: random passwords, the nats-server config with every user's permissions, the etcd
users and roles, and one credentials file per service identity, all mode 0600 in
``<workdir>/auth/`` (mode 0700). Services get the *path* of their file.

Identities: ``router``, ``kv-metadata`` and each worker by its id (``prefill-1``,
``decode-2``, ...), each the same user name in NATS and etcd; ``admin`` (NATS) and ``root``
(etcd) for tools, tests and the supervisor.

nats-server's config holds bcrypt hashes of the NATS passwords, never the passwords: whoever
reads it (or the Secret it is mounted from) cannot connect as anyone. The passwords are 144
random bits, so the hash's cost only has to make the config useless, not slow a guess: a
low cost keeps each connect's check at a few milliseconds.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from pathlib import Path

import bcrypt

from kvmesh.protocol import Keys, Subjects
from kvmesh.security.credentials import UserPassword, write_credentials, write_private
from kvmesh.security.etcd_roles import Grant, kv_metadata_grants, router_grants, worker_grants
from kvmesh.security.nats_permissions import (
    ADMIN,
    ADMIN_PERMISSIONS,
    DEFAULT_REQUEST_DEADLINE,
    ROUTER,
    NatsUsers,
    kv_metadata_permissions,
    response_window,
    router_permissions,
    worker_permissions,
)


BCRYPT_ROUNDS = 6


def new_password() -> str:
    return secrets.token_urlsafe(24)


def hashed(cred: UserPassword) -> UserPassword:
    """The same user with its password's bcrypt hash (what nats-server's config takes)."""
    return UserPassword(cred.user, bcrypt.hashpw(cred.password.encode(), bcrypt.gensalt(BCRYPT_ROUNDS)).decode())


@dataclass
class MeshCredentials:
    directory: Path
    nats_admin: UserPassword
    etcd_root_password: str = field(repr=False)
    etcd_users: dict[str, tuple[str, tuple[Grant, ...]]] = field(repr=False)
    files: dict[str, Path]  # identity -> its credentials file

    @property
    def nats_config(self) -> Path:
        return self.directory / "nats.conf"

    def file_of(self, identity: str) -> Path:
        try:
            return self.files[identity]
        except KeyError:
            raise KeyError(f"no credentials were made for {identity!r} at the mesh's start") from None

    @classmethod
    def generate(
        cls,
        directory: Path,
        namespace: str,
        workers: dict[str, str],
        kv_metadata_id: str,
        *,
        request_deadline: float = DEFAULT_REQUEST_DEADLINE,
    ) -> MeshCredentials:
        """For the router, kv-metadata ``kv_metadata_id`` and ``workers`` (id -> role). A worker
        may answer a piece of work for the mesh's ``request_deadline`` and a margin."""
        directory.mkdir(parents=True, exist_ok=True)
        directory.chmod(0o700)
        subjects, keys = Subjects(namespace), Keys(namespace)
        nats_users = NatsUsers()
        admin = UserPassword(ADMIN, new_password())
        nats_users.add(hashed(admin), ADMIN_PERMISSIONS)
        identities = {
            ROUTER: (router_permissions(subjects, ROUTER), router_grants(keys)),
            kv_metadata_id: (kv_metadata_permissions(subjects, kv_metadata_id), kv_metadata_grants(keys, kv_metadata_id)),
        }
        for worker_id, role in workers.items():
            identities[worker_id] = (worker_permissions(subjects, role, worker_id, response_window=response_window(request_deadline)), worker_grants(keys, role, worker_id))
        etcd_users: dict[str, tuple[str, tuple[Grant, ...]]] = {}
        files: dict[str, Path] = {}
        for identity, (permissions, grants) in identities.items():
            nats_user, etcd_user = UserPassword(identity, new_password()), UserPassword(identity, new_password())
            nats_users.add(hashed(nats_user), permissions)
            etcd_users[identity] = (etcd_user.password, grants)
            files[identity] = write_credentials(directory / f"{identity}.json", nats=nats_user, etcd=etcd_user)
        credentials = cls(directory, admin, new_password(), etcd_users, files)
        write_private(credentials.nats_config, nats_users.config())
        return credentials
