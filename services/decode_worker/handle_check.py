"""Checking a decode request's KV handle before anything is allocated for it.

The handle must agree with itself (one block per ``block_size`` tokens of the prompt, block
ids inside the producer's pool, no block twice, the producer's pin key for this request)
and with the producer's own etcd record (the incarnation that made it, the transfer
endpoint, pool address and layout it registered), and its layout must be one this worker
can copy segment for segment; the pull's byte ranges come from the producer's published
layout (``producer_layout``). Anything else is refused with a clear error: a bad handle never
allocates blocks, never reaches the transfer engine.

A handle from an earlier incarnation of its producer (restarted in place under the same id:
another ``started_at``) is ``kv_lost`` and retried: its blocks went with that process. A
handle that disagrees with the producer's current record otherwise is forged or broken:
``bad_request``. Whether the pin exists is the producer's to say (the release carries the
pin's token): its etcd key is written beside the reply, so it may not be there yet.
"""

from __future__ import annotations

from kvmesh.errors import ErrorCode, MeshError
from kvmesh.protocol import DecodeRequest, WorkerRecord
from kvmesh.transfer.layout import PoolLayout


def check_handle(
    request: DecodeRequest,
    producer: WorkerRecord | None,
    local_layout: PoolLayout,
    *,
    vocab_size: int,
    pin_key: str,
) -> None:
    """Raise ``MeshError`` unless ``request.kv`` can be pulled. ``producer`` is the etcd
    record of the worker the handle names (None: it is not registered); ``pin_key`` is the
    key that worker would have pinned the blocks under."""
    kv = request.kv
    assert kv is not None
    if request.first_token_id is None or not 0 <= request.first_token_id < vocab_size:
        raise MeshError(ErrorCode.BAD_REQUEST, f"the handle's first token {request.first_token_id} is not a token id")
    if producer is None or producer.role != "prefill":
        # Gone already (its blocks with it), or never a prefill worker: retry elsewhere.
        raise MeshError(ErrorCode.KV_LOST, f"prefill worker {kv.prefill_worker_id} is not registered")
    if producer.started_at != kv.producer_started_at:
        raise MeshError(ErrorCode.KV_LOST, f"prefill worker {kv.prefill_worker_id} restarted since it made the handle")
    if (producer.transfer_endpoint, producer.kv_base_address, producer.kv_layout) != (
        kv.transfer_endpoint,
        kv.kv_base_address,
        kv.layout,
    ):
        raise MeshError(
            ErrorCode.BAD_REQUEST,
            f"the KV handle disagrees with {kv.prefill_worker_id}'s registered endpoint, pool address or layout",
        )
    layout = producer_layout(producer)
    mismatch = layout.mismatch(local_layout)
    if mismatch is not None:
        raise MeshError(ErrorCode.BAD_REQUEST, f"KV layout of {kv.prefill_worker_id} does not match this worker's: {mismatch}")
    if kv.num_tokens != len(request.prompt_token_ids):
        raise MeshError(
            ErrorCode.BAD_REQUEST,
            f"the handle holds {kv.num_tokens} tokens for a prompt of {len(request.prompt_token_ids)}",
        )
    needed = -(-kv.num_tokens // layout.block_size)
    if len(kv.block_ids) != needed:
        raise MeshError(
            ErrorCode.BAD_REQUEST, f"{kv.num_tokens} tokens need {needed} blocks; the handle names {len(kv.block_ids)}"
        )
    if any(not 0 <= b < layout.num_blocks for b in kv.block_ids) or len(set(kv.block_ids)) != len(kv.block_ids):
        raise MeshError(ErrorCode.BAD_REQUEST, f"the handle's block ids are not distinct blocks of a {layout.num_blocks}-block pool")
    if kv.pin_key != pin_key:
        raise MeshError(ErrorCode.BAD_REQUEST, "the handle's pin key is not the producer's pin of this request")


def producer_layout(producer: WorkerRecord | None) -> PoolLayout:
    """The pool layout a prefill worker published: what its blocks' byte ranges are read from."""
    if producer is None or producer.kv_layout is None or producer.kv_base_address is None:
        raise MeshError(ErrorCode.KV_LOST, "the prefill worker has published no KV pool")
    return producer.kv_layout.to_layout(default_base=producer.kv_base_address)
