"""Credentials files: one JSON file per service identity, readable by its owner only.

    {"nats": {"user": "prefill-1", "password": "..."},
     "etcd": {"user": "prefill-1", "password": "..."}}

Either section may be missing. A service is given the file's *path* (``--nats-credentials``,
``--etcd-credentials``, or ``KVMESH_NATS_CREDENTIALS`` / ``KVMESH_ETCD_CREDENTIALS``; one
file may serve both), never a password on its command line.
"""

from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

from kvmesh.errors import KvmeshError


class CredentialsError(KvmeshError):
    """A credentials file is missing, malformed or readable by others."""


@dataclass(slots=True, frozen=True)
class UserPassword:
    user: str
    password: str = field(repr=False)

    @property
    def inbox_prefix(self) -> str:
        """The NATS reply-subject prefix of this user (its permissions allow ``<prefix>.>``)."""
        return inbox_prefix(self.user)


def inbox_prefix(user: str) -> str:
    return f"_INBOX_{user}"


def write_credentials(path: Path, **sections: UserPassword) -> Path:
    """Write ``{"nats": ..., "etcd": ...}`` to ``path``, created with mode 0600."""
    body = {name: {"user": cred.user, "password": cred.password} for name, cred in sections.items()}
    write_private(path, json.dumps(body, indent=2) + "\n")
    return path


def write_private(path: Path, text: str) -> None:
    """Replace ``path`` with ``text``, the file readable and writable by its owner only."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(path.name + ".tmp")
    temporary.unlink(missing_ok=True)
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(temporary, path)


def load_credentials(path: str | Path, section: str) -> UserPassword:
    """The ``section`` ("nats" or "etcd") of a credentials file; refuses a file others can read."""
    path = Path(path)
    try:
        mode = path.stat().st_mode
        body = json.loads(path.read_text())
        entry = body[section]
        cred = UserPassword(str(entry["user"]), str(entry["password"]))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CredentialsError(f"credentials file {path}: no usable {section!r} section ({exc!r})") from exc
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise CredentialsError(f"credentials file {path} is readable by others (mode {stat.S_IMODE(mode):o}); chmod 600 it")
    if not cred.user or not cred.password:
        raise CredentialsError(f"credentials file {path}: empty {section} user or password")
    return cred
