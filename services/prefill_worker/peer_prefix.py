"""Cross-worker prefix reuse: pull the leading blocks of a prompt that a peer already
computed, when the pull is estimated cheaper than recomputing them, and cache them here;
the prefill that follows finds them as prefix hits.

The lender's reply is a pull plan like a KV handle: it is used only if it agrees with the
lender's etcd record (transfer endpoint, pool address, layout) and names blocks of that
pool, so a forged reply cannot point this worker's transfer engine anywhere else."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from kvmesh.hashing import hash_to_hex
from kvmesh.protocol import KVLendReply, KVLendRequest, PeerPrefix, ReleaseRequest, WorkerRecord
from kvmesh.transfer.mooncake_agent import TransferError
from kvmesh.transfer.runs import coalesce
from kvmesh.worker.pin_release import CONFIRM_RELEASE_AFTER, release_confirmed
from kvmesh.worker.runtime import WorkerRuntime

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class CostModel:
    """Measured rates, smoothed: prompt tokens computed per second, KV bytes pulled per second."""

    prefill_tokens_per_s: float = 1000.0
    pull_bytes_per_s: float = 1e9
    pull_overhead_s: float = 0.003  # a lend round trip and a transfer set-up
    smoothing: float = 0.3

    def worth_pulling(self, tokens: int, nbytes: int) -> tuple[bool, float, float]:
        pull = nbytes / self.pull_bytes_per_s + self.pull_overhead_s
        compute = tokens / self.prefill_tokens_per_s
        return pull < compute, pull, compute

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        if tokens >= 16 and seconds > 0:
            self.prefill_tokens_per_s += self.smoothing * (tokens / seconds - self.prefill_tokens_per_s)

    def observe_pull(self, nbytes: int, seconds: float) -> None:
        if nbytes > 0 and seconds > 0:
            self.pull_bytes_per_s += self.smoothing * (nbytes / seconds - self.pull_bytes_per_s)


async def borrow_prefix(rt: WorkerRuntime, cost: CostModel, request_id: str, prompt: list[int], peer: PeerPrefix, span) -> int:
    """Pull what the peer holds beyond our own cached prefix; returns blocks pulled."""
    engine = rt.engine
    layout = engine.kv_layout
    block_size = layout.block_size
    block_bytes = layout.moved_block_bytes  # every rank's share, as the pulls it learns its rate from
    hashes = engine.block_hashes(prompt)
    usable = min(peer.num_blocks, (len(prompt) - 1) // block_size, len(hashes))
    local = await engine.cached_prefix_length(hashes[:usable])
    missing = usable - local
    span.set_attribute("kvmesh.peer", peer.worker_id)
    span.set_attribute("kvmesh.peer_blocks", peer.num_blocks)
    span.set_attribute("kvmesh.local_blocks", local)
    if missing <= 0:
        return 0
    worth, pull_s, compute_s = cost.worth_pulling(missing * block_size, missing * block_bytes)
    span.set_attribute("kvmesh.pull_estimate_s", pull_s)
    span.set_attribute("kvmesh.compute_estimate_s", compute_s)
    if not worth:
        return 0
    handle = borrow_handle(request_id)
    wanted = hashes[local:usable]
    asked = time.monotonic()  # the loan's pin is made after this
    try:
        reply_msg = await rt.nc.request(
            rt.subjects.kv_lend(peer.worker_id, rt.worker_id),
            KVLendRequest(handle=request_id, block_hashes=[hash_to_hex(h) for h in wanted]).encode(),
            timeout=min(2.0, rt.timeout),
        )
        reply = KVLendReply.decode(reply_msg.data)
    except Exception as exc:  # noqa: BLE001 - no peer, no pull: compute instead
        logger.info("peer %s did not lend (%s); computing the prefix", peer.worker_id, exc)
        return 0
    if reply.error is not None or not reply.block_ids:
        if reply.error is not None:
            logger.info("peer %s refused to lend (%s); computing the prefix", peer.worker_id, reply.error.message)
        return 0
    ok, confirmed, pulled_bytes, pulled_seconds = False, False, 0, 0.0
    try:
        problem = lend_reply_problem(reply, rt.directory.workers.get(peer.worker_id) if rt.directory else None, len(wanted))
        if problem is not None:
            logger.warning("not pulling from %s: %s", peer.worker_id, problem)
            return 0
        peer_layout = reply.layout.to_layout(default_base=reply.kv_base_address)  # as the lender published it
        if not peer_layout.compatible_with(layout):
            return 0
        local_ids = await engine.allocate_import(handle, len(reply.block_ids) * block_size)
        if local_ids is None:
            return 0
        if rt.settings.fault_pull_delay:  # tests: a pull that ends after the loan's pin may have expired
            await asyncio.sleep(rt.settings.fault_pull_delay)
        started = time.perf_counter()
        try:
            stats = await rt.agent.read_layout_async(
                reply.transfer_endpoint, coalesce(reply.block_ids, local_ids), peer=peer_layout, local=layout
            )
        except TransferError as exc:
            await engine.release_import(handle)
            logger.warning("pulling the prefix from %s failed: %s", peer.worker_id, exc)
            return 0
        pull_seconds = time.perf_counter() - started
        got = len(reply.block_ids)
        if time.monotonic() - asked >= CONFIRM_RELEASE_AFTER:
            # Late: the loan's pin may have run out while the blocks were read, and the lender
            # given them to another request. Cached here they would be wrong for every prompt
            # that starts this way, so they are used only if the lender says the pin held.
            confirmed = True
            release = ReleaseRequest(
                request_id=reply.loan_id, pin_token=reply.pin_token, bytes_pulled=stats.bytes, seconds_pulled=stats.seconds
            )
            held, why = await release_confirmed(rt.nc, rt.subjects.release(peer.worker_id), release, min(2.0, rt.timeout))
            if not held:
                await engine.release_import(handle)
                logger.warning("not using the prefix pulled from %s for %s (%s); computing it", peer.worker_id, request_id, why)
                return 0
        await engine.cache_imported_blocks(handle, wanted[:got], hashes[local - 1] if local else None)
        cost.observe_pull(stats.bytes, pull_seconds)
        ok, pulled_bytes, pulled_seconds = True, stats.bytes, stats.seconds
        rt.transferred("in", stats.bytes, stats.seconds)
        span.set_attribute("kvmesh.pulled_blocks", got)
        span.set_attribute("kvmesh.pulled_bytes", stats.bytes)
        span.set_attribute("kvmesh.pull_seconds", stats.seconds)
        return got
    finally:
        if not confirmed:
            release = ReleaseRequest(
                request_id=reply.loan_id,
                pin_token=reply.pin_token,
                bytes_pulled=pulled_bytes,
                seconds_pulled=pulled_seconds,
                ok=ok,
            )
            await rt.nc.publish(rt.subjects.release(peer.worker_id), release.encode())


def borrow_handle(request_id: str) -> str:
    """The import handle a request's prefix is pulled under. An engine that holds the pulled
    blocks until the prefill takes them (vLLM's) frees them on ``release_import`` of it if the
    prefill never came; for one that caches them at once (kvmesh's) that is a no-op."""
    return f"borrow-{request_id}"


def lend_reply_problem(reply: KVLendReply, lender: WorkerRecord | None, asked: int) -> str | None:
    """Why a lend reply may not be pulled (None: it may): it must agree with the lender's
    etcd record and name at most the blocks asked for, distinct, inside the lender's pool."""
    if lender is None or lender.role != "prefill":
        return "the lender is not a registered prefill worker"
    if (lender.transfer_endpoint, lender.kv_base_address, lender.kv_layout) != (
        reply.transfer_endpoint,
        reply.kv_base_address,
        reply.layout,
    ):
        return "the reply disagrees with the lender's registered endpoint, pool address or layout"
    ids = reply.block_ids
    if len(ids) > asked or len(set(ids)) != len(ids) or any(not 0 <= b < reply.layout.num_blocks for b in ids):
        return f"the reply's block ids are not at most {asked} distinct blocks of the lender's pool"
    return None
