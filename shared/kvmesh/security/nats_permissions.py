"""NATS users of one mesh and what each may publish and subscribe, as nats-server config.

One user per worker (named after its id), one for the routers, one for kv-metadata and an
``admin`` for tools and tests. A worker publishes KV events and load reports only on its
own subjects; only routers publish work and cancels, and only routers read token streams.
Replies go to ``_INBOX_<user>.>`` (each user's own inbox prefix) and a responder may
publish only to the reply subject of a request it received (``allow_responses``).

Not enforceable here: token events and progress go to subjects the router names in the
request payload (``stream.<router>.<request>``), so a worker may publish to any router's
stream subjects; and workers may publish ``release`` / ``kv.lend`` to any peer.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from kvmesh.protocol import QUEUE_GROUP, Subjects, rate_limit_bucket
from kvmesh.security.credentials import UserPassword, inbox_prefix

ADMIN = "admin"
ROUTER = "router"
KV_METADATA = "kv-metadata"


@dataclass(slots=True, frozen=True)
class NatsPermissions:
    publish: tuple[str, ...]
    subscribe: tuple[str, ...]
    responds: bool = False  # may answer requests it received (once each)

    def config(self) -> dict:
        body: dict = {"publish": {"allow": list(self.publish)}, "subscribe": {"allow": list(self.subscribe)}}
        if self.responds:
            body["allow_responses"] = True
        return body


def router_permissions(s: Subjects, user: str = ROUTER) -> NatsPermissions:
    # The shared rate-limit budget: JetStream's API for that one KV bucket, and its keys.
    stream = f"KV_{rate_limit_bucket(s.namespace)}"
    jetstream = (
        f"$JS.API.STREAM.INFO.{stream}",
        f"$JS.API.STREAM.CREATE.{stream}",
        f"$JS.API.STREAM.MSG.GET.{stream}",
        f"$JS.API.DIRECT.GET.{stream}.>",
        f"$KV.{rate_limit_bucket(s.namespace)}.>",
    )
    return NatsPermissions(
        publish=(s.prefill(), s.prefill("*"), s.decode(), s.decode("*"), s.cancel, s.kv_query, *jetstream),
        subscribe=(s.load, f"{s.root}.stream.>", f"{s.root}.progress.>", f"{inbox_prefix(user)}.>"),
    )


def worker_permissions(s: Subjects, role: str, worker_id: str) -> NatsPermissions:
    publish = [s.kv_events_from(worker_id), s.load_from(worker_id), f"{s.root}.progress.>", s.release("*")]
    subscribe = [s.cancel, s.stats(worker_id), s.kv_snapshot(worker_id), f"{inbox_prefix(worker_id)}.>"]
    if role == "prefill":
        publish.append(s.kv_lend("*"))
        subscribe += [s.prefill(worker_id), f"{s.prefill()} {QUEUE_GROUP['prefill']}", s.release(worker_id), s.kv_lend(worker_id)]
    elif role == "decode":
        publish.append(f"{s.root}.stream.>")
        subscribe += [s.decode(worker_id), f"{s.decode()} {QUEUE_GROUP['decode']}"]
    else:
        raise ValueError(f"not a worker role: {role!r}")
    return NatsPermissions(tuple(publish), tuple(subscribe), responds=True)


def kv_metadata_permissions(s: Subjects, user: str = KV_METADATA) -> NatsPermissions:
    return NatsPermissions(
        publish=(s.kv_snapshot("*"),),
        subscribe=(s.kv_events, s.kv_query, s.kv_stats, f"{inbox_prefix(user)}.>"),
        responds=True,
    )


ADMIN_PERMISSIONS = NatsPermissions(publish=(">",), subscribe=(">",), responds=True)


@dataclass(slots=True)
class NatsUsers:
    """The users of one nats-server, rendered as its ``authorization`` block."""

    users: dict[str, tuple[UserPassword, NatsPermissions]] = field(default_factory=dict)

    def add(self, cred: UserPassword, permissions: NatsPermissions) -> None:
        if cred.user in self.users:
            raise ValueError(f"NATS user {cred.user!r} defined twice")
        self.users[cred.user] = (cred, permissions)

    def config(self) -> str:
        """nats-server config text (its syntax is a superset of JSON)."""
        users = [
            {"user": cred.user, "password": cred.password, "permissions": permissions.config()}
            for cred, permissions in self.users.values()
        ]
        return "authorization {\n  users = " + json.dumps(users, indent=2) + "\n}\n"
