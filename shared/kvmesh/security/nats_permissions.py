"""NATS users of one mesh and what each may publish and subscribe, as nats-server config.

One user per worker (named after its id), one for the routers, one for kv-metadata and an
``admin`` for tools and tests. What nats-server enforces:

- A worker publishes KV events and load reports only on its own subjects
  (``kv.events.<id>``, ``load.<id>``); only routers publish work and cancels, and only
  routers read token streams.
- **Streams are responses.** A router publishes each piece of work with a reply subject of
  its own, ``stream.<router>.<random key>.<phase>``, and the worker answers there: the ack,
  its progress, its token events or its prefill response. No worker has a publish
  permission on ``stream.>`` (nor on anything a router subscribes to); it may publish on a
  stream subject only under ``allow_responses`` (any number of messages, for
  ``response_window`` seconds after it received the work: the request's deadline and a
  margin), i.e. only into the streams it was handed. The random key is belt and braces
  (attempt ids travel in cancels every worker reads).
- **A worker never receives a message whose reply subject another worker chose**: it may
  not publish on any subject it subscribes to (``release.<own id>``, ``kv.lend.<own id>.*``
  are denied), else it could send itself a message with a victim's stream as the reply and
  answer into it. An honest peer answering a lend with a forged reply subject puts a
  ``KVLendReply`` into that stream, which routers drop (``STREAM_KINDS``).
- **Lends name their borrower**: a prefill worker asks a peer on ``kv.lend.<peer>.<own
  id>`` only; the lender caps the blocks it holds for each borrower.
- Replies to plain requests go to ``_INBOX_<user>.>`` (each user's own inbox prefix).

Not enforceable here, and fenced by the services instead: ``release.<prefill>`` is open to
every worker, so a release carries the pin's random token from the KV handle and the
prefill worker checks it (constant time); a pull plan (the KV handle) is checked by the
decode worker against the producer's etcd record. A worker credential still lets its holder
answer the work it is handed as it likes (wrong tokens for its own requests).
"""


from __future__ import annotations

import json
from dataclasses import dataclass, field

from kvmesh.protocol import QUEUE_GROUP, Subjects, rate_limit_bucket
from kvmesh.security.credentials import UserPassword, inbox_prefix

ADMIN = "admin"
ROUTER = "router"
KV_METADATA = "kv-metadata"


DEFAULT_REQUEST_DEADLINE = 1800.0  # MeshSettings.request_deadline's default
RESPONSE_MARGIN = 60.0  # seconds a worker may still answer after the router's deadline


def response_window(request_deadline: float) -> float:
    """Seconds a worker may answer a piece of work: the mesh's request deadline and a margin
    (past it the router has given up anyway; a shorter window would cut long streams)."""
    return request_deadline + RESPONSE_MARGIN


DEFAULT_RESPONSE_WINDOW = response_window(DEFAULT_REQUEST_DEADLINE)


@dataclass(slots=True, frozen=True)
class Responses:
    """``allow_responses``: publishing to the reply subject of a message received, at most
    ``max_messages`` times (-1: any number) within ``expires`` seconds of receiving it."""

    max_messages: int = 1
    expires: float = 120.0

    def config(self) -> dict:
        return {"max": self.max_messages, "expires": f"{int(self.expires)}s"}


@dataclass(slots=True, frozen=True)
class NatsPermissions:
    publish: tuple[str, ...]
    subscribe: tuple[str, ...]
    responses: Responses | None = None  # may answer messages it received
    deny_publish: tuple[str, ...] = ()

    def config(self) -> dict:
        publish: dict = {"allow": list(self.publish)}
        if self.deny_publish:
            publish["deny"] = list(self.deny_publish)
        body: dict = {"publish": publish, "subscribe": {"allow": list(self.subscribe)}}
        if self.responses is not None:
            body["allow_responses"] = self.responses.config()
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
        # kv.events and kv.snapshot: the router's own copy of the KV index (``kvmesh.kvindex.replica``)
        publish=(s.prefill(), s.prefill("*"), s.decode(), s.decode("*"), s.cancel, s.kv_query, s.kv_snapshot("*"), *jetstream),
        subscribe=(s.load, s.kv_events, f"{s.root}.stream.>", f"{inbox_prefix(user)}.>"),
    )


def worker_permissions(
    s: Subjects, role: str, worker_id: str, *, response_window: float = DEFAULT_RESPONSE_WINDOW
) -> NatsPermissions:
    """``response_window``: seconds a worker may answer a piece of work (its streams), at
    least the mesh's request deadline."""
    publish = [s.kv_events_from(worker_id), s.load_from(worker_id), s.release("*")]
    subscribe = [s.cancel, s.stats(worker_id), s.kv_snapshot(worker_id), f"{inbox_prefix(worker_id)}.>"]
    deny: list[str] = []
    if role == "prefill":
        publish.append(s.kv_lend("*", worker_id))
        subscribe += [s.prefill(worker_id), f"{s.prefill()} {QUEUE_GROUP['prefill']}", s.release(worker_id), s.kv_lend(worker_id, "*")]
        deny += [s.release(worker_id), s.kv_lend(worker_id, "*")]  # nothing it receives itself
    elif role == "decode":
        subscribe += [s.decode(worker_id), f"{s.decode()} {QUEUE_GROUP['decode']}"]
    else:
        raise ValueError(f"not a worker role: {role!r}")
    responses = Responses(max_messages=-1, expires=response_window)
    return NatsPermissions(tuple(publish), tuple(subscribe), responses, tuple(deny))


def kv_metadata_permissions(s: Subjects, user: str = KV_METADATA) -> NatsPermissions:
    return NatsPermissions(
        publish=(s.kv_snapshot("*"),),
        subscribe=(s.kv_events, s.kv_query, s.kv_stats, f"{inbox_prefix(user)}.>"),
        responses=Responses(),
    )


ADMIN_PERMISSIONS = NatsPermissions(publish=(">",), subscribe=(">",), responses=Responses())


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
