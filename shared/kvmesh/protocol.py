"""What crosses a process: NATS subjects and payloads, etcd keys and values.

Every payload is a pydantic model, encoded as JSON; the engine's dataclasses are converted
at the edge by the ``from_*`` / ``to_*`` helpers here, and nowhere else.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re

from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, TypeAdapter, model_validator

from kvmesh.errors import ErrorCode, as_error_code
from kvmesh.engine.request import MAX_LOGPROBS, PENALTY_RANGE, SamplingParams, TokenLogprob
from kvmesh.engine.structured import GUIDED_KINDS, MAX_GRAMMAR_CHARS
from kvmesh.transfer.layout import KVMESH_ARRANGEMENT, PoolLayout, block_major

Role = Literal["prefill", "decode", "router", "kv-metadata"]
Stage = Literal["prefill", "pull", "decode"]  # where a request is on a worker (``Progress``)
StreamPhase = Literal["prefill", "decode"]  # which worker of an attempt a stream subject is for


# --------------------------------------------------------------------------- subjects
class Subjects:
    """All NATS subjects of one namespace, ``kvmesh.<namespace>.*``."""

    def __init__(self, namespace: str) -> None:
        if not namespace or any(c in namespace for c in ". *>"):
            raise ValueError(f"bad namespace {namespace!r}: one NATS token, no dots or wildcards")
        self.namespace = namespace
        self.root = f"kvmesh.{namespace}"

    def prefill(self, worker_id: str | None = None) -> str:
        """A chosen prefill worker's own subject, or the queue subject for unrouted work."""
        return f"{self.root}.prefill" + (f".{worker_id}" if worker_id else "")

    def decode(self, worker_id: str | None = None) -> str:
        return f"{self.root}.decode" + (f".{worker_id}" if worker_id else "")

    def release(self, prefill_worker_id: str) -> str:
        """Decode -> prefill: the pinned blocks of a request were pulled (or given up); the
        release carries the pin's token from the handle, so only a holder of the handle
        may release it."""
        return f"{self.root}.release.{prefill_worker_id}"

    @property
    def cancel(self) -> str:
        """Router -> all workers: stop a request."""
        return f"{self.root}.cancel"

    def load_from(self, worker_id: str) -> str:
        """Worker -> routers: its periodic load reports, on a subject of its own."""
        return f"{self.root}.load.{worker_id}"

    @property
    def load(self) -> str:
        """What routers subscribe to: every worker's load reports."""
        return self.load_from("*")

    def stats(self, worker_id: str) -> str:
        """Request/reply: a worker's pool and transfer counters."""
        return f"{self.root}.stats.{worker_id}"

    def kv_events_from(self, worker_id: str) -> str:
        """Worker -> kv-metadata: its batches of KV cache events, on a subject of its own (the
        subject's last token must equal ``KVEventBatch.worker_id``)."""
        return f"{self.root}.kv.events.{worker_id}"

    @property
    def kv_events(self) -> str:
        """What kv-metadata subscribes to: every worker's KV event batches."""
        return self.kv_events_from("*")

    @staticmethod
    def sender(subject: str) -> str:
        """The worker id a per-worker subject (``load``, ``kv.events``) was published on."""
        return subject.rsplit(".", 1)[-1]

    def kv_snapshot(self, worker_id: str) -> str:
        """Request/reply: every block a worker holds now, to resync after a gap."""
        return f"{self.root}.kv.snapshot.{worker_id}"

    def kv_lend(self, lender_id: str, borrower_id: str) -> str:
        """Request/reply: a peer's cached blocks, held for a pull (released on ``release``).
        The borrower is named by the subject's last token, which NATS lets a worker set
        only to its own id; the lender caps what it holds for each borrower."""
        return f"{self.root}.kv.lend.{lender_id}.{borrower_id}"

    @property
    def kv_query(self) -> str:
        """Request/reply to kv-metadata: how many leading blocks of a chain each worker holds."""
        return f"{self.root}.kv.query"

    @property
    def kv_stats(self) -> str:
        return f"{self.root}.kv.stats"

    def stream(self, router_id: str, attempt_key: str, phase: StreamPhase) -> str:
        """Worker -> router: everything about one attempt's phase (``StreamMessage``s). It
        is the NATS reply subject of the work request, so a worker may publish there only
        as a response to the request it was handed (``allow_responses``); ``attempt_key``
        is random besides."""
        return f"{self.root}.stream.{router_id}.{attempt_key}.{phase}"

    def streams_of(self, router_id: str) -> str:
        """What a router subscribes to: every stream of its own attempts."""
        return f"{self.root}.stream.{router_id}.>"


def rate_limit_bucket(namespace: str) -> str:
    """The JetStream KV bucket where routers count their shared rate-limit budgets."""
    return f"kvmesh_{re.sub(r'[^A-Za-z0-9_-]', '_', namespace)}_ratelimits"


QUEUE_GROUP = {"prefill": "prefill-workers", "decode": "decode-workers"}


# --------------------------------------------------------------------------- etcd keys
class Keys:
    """etcd keys of one namespace, ``/kvmesh/<namespace>/*``."""

    def __init__(self, namespace: str) -> None:
        self.root = f"/kvmesh/{namespace}/"

    def workers(self, role: str | None = None) -> str:
        return self.root + "workers/" + (f"{role}/" if role else "")

    def worker(self, role: str, worker_id: str) -> str:
        return self.workers(role) + worker_id

    def blocks(self, worker_id: str | None = None) -> str:
        """Block ownership mirrored by kv-metadata, under each owner's lease."""
        return self.root + "blocks/" + (f"{worker_id}/" if worker_id else "")

    def pins(self, prefill_worker_id: str) -> str:
        return f"{self.root}pins/{prefill_worker_id}/"

    def pin(self, prefill_worker_id: str, request_id: str) -> str:
        return self.pins(prefill_worker_id) + request_id

    def slot(self, role: str, identity: str) -> str:
        """The claim of the one live replica that runs as ``identity`` (``kvmesh.cluster.identity_slots``)."""
        return f"{self.root}slots/{role}/{identity}"


# --------------------------------------------------------------------------- payloads
class Message(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    def encode(self) -> bytes:
        return self.model_dump_json().encode()

    @classmethod
    def decode(cls, data: bytes):  # -> Self
        return cls.model_validate_json(data)


MAX_REQUEST_ID_CHARS = 256


def request_id_of(data: bytes) -> str:
    """The ``request_id`` a message that failed validation names, else "". The refusal of a
    malformed request (a router of another version, say) carries it, so the attempt waiting
    for that answer takes it and fails at once, not after its silence timeout."""
    try:
        value = json.loads(data)
    except (ValueError, RecursionError):  # RecursionError: nested past the interpreter's limit
        return ""
    request_id = value.get("request_id") if isinstance(value, dict) else None
    return request_id if isinstance(request_id, str) and len(request_id) <= MAX_REQUEST_ID_CHARS else ""


class ErrorInfo(Message):
    # What it means, its HTTP status and whether to retry: ``kvmesh.errors``. A code this
    # version does not know (a newer peer's) is ``internal``, never a dropped message.
    code: Annotated[ErrorCode, BeforeValidator(as_error_code)]
    message: str


def _is_zero(value: object) -> bool:
    return not value


def _is_one(value: object) -> bool:
    return value == 1


def _is_none(value: object) -> bool:
    return value is None


class LogprobSpec(Message):
    """A ``TokenLogprob`` on the wire: ``[token id, logprob, [[id, logprob], ...]]`` is what
    it costs per token, so it is kept to three short fields."""

    t: int  # the token id
    lp: float  # its logprob
    top: list[tuple[int, float]] = Field(default_factory=list, exclude_if=_is_zero)

    def to_logprob(self) -> TokenLogprob:
        return TokenLogprob(self.t, self.lp, tuple(self.top))

    @classmethod
    def from_logprob(cls, value: TokenLogprob) -> LogprobSpec:
        return cls(t=value.token_id, lp=value.logprob, top=list(value.top))

    @classmethod
    def many(cls, values: list[TokenLogprob | None] | None) -> list[LogprobSpec | None] | None:
        return None if values is None else [None if v is None else cls.from_logprob(v) for v in values]
class GuidedSpec(Message):
    """``kvmesh.engine.structured.GuidedDecoding`` on the wire: what the output must match."""

    kind: Literal["json_schema", "json_object", "regex", "choice"]
    value: str = Field(default="", max_length=MAX_GRAMMAR_CHARS)


assert set(GUIDED_KINDS) == {"json_schema", "json_object", "regex", "choice"}


class SamplingSpec(Message):
    """``SamplingParams`` on the wire. The logits-processing fields are left out of the JSON
    at their defaults (which change nothing): a plain request reads as it did before them, to
    an older worker too, and an older router's payload means what it meant."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int = 16
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = Field(default=0.0, ge=PENALTY_RANGE[0], le=PENALTY_RANGE[1], exclude_if=_is_zero)
    frequency_penalty: float = Field(default=0.0, ge=PENALTY_RANGE[0], le=PENALTY_RANGE[1], exclude_if=_is_zero)
    repetition_penalty: float = Field(default=1.0, gt=0.0, allow_inf_nan=False, exclude_if=lambda v: v == 1.0)
    logit_bias: dict[Annotated[int, Field(ge=0)], Annotated[float, Field(allow_inf_nan=False)]] = Field(
        default_factory=dict, exclude_if=_is_zero
    )
    min_p: float = Field(default=0.0, ge=0.0, le=1.0, exclude_if=_is_zero)
    min_tokens: int = Field(default=0, ge=0, exclude_if=_is_zero)
    prior_output_tokens: int = Field(default=0, ge=0, exclude_if=_is_zero)  # a resumed request's (SamplingParams)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS, exclude_if=_is_none)
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS, exclude_if=_is_none)
    guided: GuidedSpec | None = Field(default=None, exclude_if=_is_zero)  # structured output

    def to_params(self) -> SamplingParams:
        return SamplingParams(**self.model_dump())

    @classmethod
    def from_params(cls, params: SamplingParams) -> SamplingSpec:
        return cls(**dataclasses.asdict(params))


MAX_PLANES = 4096  # plane addresses a published layout may list (K and V of 2,048 layers)


class KVLayoutSpec(Message):
    """A worker's KV pool layout (``kvmesh.transfer.layout.PoolLayout``). The fields after
    ``dtype`` came with the engine interface; a record without them describes kvmesh's
    block-major pool, whose base is the record's (or handle's) ``kv_base_address``."""

    num_blocks: int
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    engine: str = "kvmesh"
    arrangement: str = KVMESH_ARRANGEMENT
    layer_stride: int | None = None  # None: block-major (one segment)
    block_stride: int | None = None  # None: block-major (a segment per layer)
    base_address: int | None = None  # None: the enclosing record's kv_base_address
    pool_bytes: int | None = None  # None: the blocks' bytes
    # K and V apart (FlashAttention's and vllm-ascend's pools); absent where they lie together
    kv_split: bool = Field(default=False, exclude_if=_is_zero)
    kv_stride: int = Field(default=0, ge=0, exclude_if=_is_zero)
    planes: tuple[int, ...] = Field(default=(), max_length=MAX_PLANES, exclude_if=_is_zero)  # separately allocated layers
    ranks: int = Field(default=1, ge=1, exclude_if=_is_one)  # tensor parallel: rank 0's pool of ranks
    rank_stride: int = Field(default=0, ge=0, exclude_if=_is_zero)  # tensor parallel: from one rank's pool to the next's

    @model_validator(mode="after")
    def _a_layout(self) -> KVLayoutSpec:
        self.to_layout()  # strides that overlap segments or reach past the pool are refused here
        return self

    def to_layout(self, default_base: int = 0) -> PoolLayout:
        """The layout; ``default_base`` is the pool address when the spec names none. Worked
        out once per spec and base (``_pool_layout``): every prefill answer and decode request
        carries its producer's spec, and checking one costs more than the rest of the message."""
        return _pool_layout(self, default_base)

    @classmethod
    def from_layout(cls, layout: PoolLayout) -> KVLayoutSpec:
        return _layout_spec(cls, layout)


# A mesh has a layout or two a worker, and a spec is immutable. At most 256 are kept (a spec of
# the most plane addresses allowed holds ~160 KiB of Python ints: ~40 MiB at worst).
@functools.lru_cache(maxsize=256)
def _pool_layout(spec: KVLayoutSpec, default_base: int) -> PoolLayout:
    base = spec.base_address if spec.base_address is not None else default_base
    kvmesh = block_major(
        dtype=spec.dtype,
        block_size=spec.block_size,
        num_blocks=spec.num_blocks,
        num_layers=spec.num_layers,
        num_kv_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        base_address=base,
        engine=spec.engine,
    )
    return dataclasses.replace(
        kvmesh,
        arrangement=spec.arrangement,
        layer_stride=spec.layer_stride if spec.layer_stride is not None else kvmesh.layer_stride,
        block_stride=spec.block_stride if spec.block_stride is not None else kvmesh.block_stride,
        pool_bytes=spec.pool_bytes if spec.pool_bytes is not None else kvmesh.pool_bytes,
        kv_split=spec.kv_split,
        kv_stride=spec.kv_stride,
        planes=spec.planes,
        ranks=spec.ranks,
        rank_stride=spec.rank_stride,
    )


@functools.lru_cache(maxsize=64)  # a worker's own layout, on every prefill answer it sends
def _layout_spec(cls: type[KVLayoutSpec], layout: PoolLayout) -> KVLayoutSpec:
    return cls(**dataclasses.asdict(layout))


class WorkerRecord(Message):
    """``workers/<role>/<id>`` in etcd, under the worker's lease."""

    worker_id: str
    role: Role
    model: str
    max_model_len: int
    subject: str
    transfer_endpoint: str | None = None
    kv_base_address: int | None = None
    kv_layout: KVLayoutSpec | None = None
    host: str
    pid: int
    started_at: float
    health_url: str | None = None  # the worker's liveness / readiness endpoint (``/health/...``)


class KVHandle(Message):
    """Where a prefill's KV waits: the blocks, their pool, and the pin that holds them."""

    prefill_worker_id: str
    transfer_endpoint: str
    kv_base_address: int
    layout: KVLayoutSpec
    block_ids: tuple[int, ...]
    num_tokens: int
    pin_key: str
    pin_token: str  # a secret of the pin, made with it: a release must carry it
    producer_started_at: float  # the producer's incarnation (``WorkerRecord.started_at``)
    # seconds the producer holds the blocks for the pull (its ``--pin-ttl``): a decode worker's
    # wait for room ends before it; None (a producer before this field): the decode worker's own
    pin_ttl: float | None = Field(default=None, gt=0)


class PeerPrefix(Message):
    """A peer prefill worker that holds more of the prompt's leading blocks than the chosen one."""

    worker_id: str
    num_blocks: int


class PrefillRequest(Message):
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingSpec
    peer: PeerPrefix | None = None  # pull the prefix from this peer when cheaper than recomputing
    resumed: bool = False  # a retry (its first worker died): queued before new requests
    # Answered on the message's NATS reply subject: ``Progress`` while working, then one
    # ``PrefillResponse``.


class KVLendRequest(Message):
    """Prefill -> peer: hold the leading cached blocks of this chain for me to read."""

    handle: str  # the borrower's name for the loan (the lender prefixes it with the borrower)
    block_hashes: list[str]


class KVLendReply(Message):
    block_ids: list[int]  # the leading blocks found (may be fewer than asked)
    transfer_endpoint: str
    kv_base_address: int
    layout: KVLayoutSpec
    loan_id: str = ""  # what to release (``ReleaseRequest.request_id``)
    pin_token: str = ""  # and with what secret
    error: ErrorInfo | None = None  # refused (e.g. this borrower holds its cap already)


class PrefillResponse(Message):
    kind: Literal["prefill"] = "prefill"
    request_id: str
    first_token_id: int | None = None
    num_cached_tokens: int = 0
    kv: KVHandle | None = None
    finished: bool = False  # the first token already ends the request (eos, max_tokens=1)
    finish_reason: str | None = None
    error: ErrorInfo | None = None
    first_logprob: LogprobSpec | None = Field(default=None, exclude_if=_is_none)  # with sampling.logprobs
    prompt_logprobs: list[LogprobSpec | None] | None = Field(default=None, exclude_if=_is_none)


class DecodeRequest(Message):
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingSpec
    first_token_id: int | None = None  # with kv: the token the prefill sampled
    kv: KVHandle | None = None  # None: the decode worker prefills itself
    prefill_cached_tokens: int = 0  # with kv: prompt tokens the prefill found in its cache
    resumed: bool = False  # a retry (its first worker died): admitted before new requests
    # Answered on the message's NATS reply subject: a ``DecodeAck``, ``Progress`` while
    # working, and the ``TokenEvent``s.


class DecodeAck(Message):
    kind: Literal["ack"] = "ack"
    request_id: str
    accepted: bool
    error: ErrorInfo | None = None


class TokenEvent(Message):
    """One step of a request's output, to the router's reply subject, numbered from 0."""

    kind: Literal["token"] = "token"
    request_id: str
    seq: int
    token_ids: list[int] = Field(default_factory=list)
    text: str = ""
    finished: bool = False
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    error: ErrorInfo | None = None
    # With sampling.logprobs: one per token of token_ids (None: computed elsewhere, as an
    # import's first token); with sampling.prompt_logprobs, once: the prompt's (first None).
    logprobs: list[LogprobSpec | None] | None = Field(default=None, exclude_if=_is_none)
    prompt_logprobs: list[LogprobSpec | None] | None = Field(default=None, exclude_if=_is_none)


class Progress(Message):
    """A worker still holds a request and its engine is stepping; sent every heartbeat
    interval while the request is queued, prefilled, pulled or decoded there."""

    kind: Literal["progress"] = "progress"
    request_id: str
    worker_id: str
    stage: Stage


class ReleaseRequest(Message):
    request_id: str
    pin_token: str  # the pin's secret, from the handle (or the lend reply)
    bytes_pulled: int = 0
    seconds_pulled: float = 0.0  # how long the read took the puller (the lender's transfer metrics)
    ok: bool = True


StreamMessage = Annotated[PrefillResponse | DecodeAck | Progress | TokenEvent, Field(discriminator="kind")]
STREAM_MESSAGE: TypeAdapter[PrefillResponse | DecodeAck | Progress | TokenEvent] = TypeAdapter(StreamMessage)
# What may arrive on a stream subject of each phase (anything else there is dropped).
STREAM_KINDS: dict[str, tuple[type[Message], ...]] = {"prefill": (PrefillResponse, Progress), "decode": (DecodeAck, Progress, TokenEvent)}


class ReleaseReply(Message):
    """Prefill -> releaser, to a release sent as a request: whether it freed the pin (held
    until then: its blocks untouched) or found none (expired, released, a wrong token)."""

    released: bool


class CancelRequest(Message):
    request_id: str


class LoadReport(Message):
    worker_id: str
    role: Role
    running: int
    waiting: int  # in the engine's queue and before it (a decode worker's pulls waiting for room)
    free_blocks: int
    total_blocks: int
    draining: bool = False
    ready: bool = True  # engine stepping, NATS and etcd connected (the readiness check)
    timestamp: float


class KVEventSpec(Message):
    """One KV cache event; hashes are 32 hex digits, parent first to child."""

    kind: Literal["stored", "removed", "cleared"]
    block_hashes: list[str] = Field(default_factory=list)
    parent_block_hash: str | None = None


class KVEventBatch(Message):
    """A worker's KV events since its previous batch. ``seq`` counts batches from 0 within
    an ``epoch`` (a new epoch when the worker restarts); a gap means: ask for a snapshot."""

    worker_id: str
    epoch: str
    seq: int
    tier: str = "device"
    block_size: int
    events: list[KVEventSpec]


class KVSnapshot(Message):
    """Every block a worker holds, as of batch ``seq`` of ``epoch`` (later batches apply on top)."""

    worker_id: str
    epoch: str
    seq: int
    tier: str = "device"
    block_hashes: list[str]


class KVQuery(Message):
    block_hashes: list[str]  # a chain, parent first


class KVQueryReply(Message):
    matches: dict[str, int]  # worker id -> leading blocks of the chain it holds (absent: none)


class KVIndexStats(Message):
    num_blocks: int
    num_entries: int
    workers: dict[str, int]  # worker id -> blocks held
    events_per_second: float
    blocks_ingested: int
    queries: int
    query_p50_ms: float
    query_p99_ms: float
    resyncs: int


class WorkerStats(Message):
    worker_id: str
    num_blocks: int
    num_free: int
    num_cached: int
    num_in_use: int
    num_held: int
    pins: int
    bytes_pulled: int
    bytes_served: int
    transfers: int
