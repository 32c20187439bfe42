"""A pool split across processes, shared with the worker's (``kvmesh.worker.shared_pool``):
each "rank" (a child process here, as vLLM's ranks are the worker's children) moves its
layer views onto a memfd; the worker maps every rank's, rank after rank, and each side sees
what the other writes, through the views the rank's code already holds; the rank's old
storage is freed."""

from __future__ import annotations

import gc
import multiprocessing

import pytest
import torch

from torch.multiprocessing.reductions import StorageWeakRef

from kvmesh.transfer.layout import VLLM_CPU_ARRANGEMENT
from kvmesh.worker.kv_tensors import pool_layout_of
from kvmesh.worker.shared_pool import map_rank_pools, share_rank_pool

BLOCKS, HEADS, TOKENS, CONTENT, LAYERS = 6, 1, 32, 16, 3


def _rank(rank: int, conn) -> None:
    """A rank: a vLLM-on-CPU pool (one buffer, a [blocks, heads, tokens, 2 * dim] view per
    layer), shared; then it writes its mark into block 2 of layer 1 and answers what the
    worker wrote into block 4 of layer 0."""
    buffer = torch.zeros(LAYERS * BLOCKS * HEADS * TOKENS * CONTENT, dtype=torch.float32)
    views = [buffer.view(LAYERS, BLOCKS, HEADS, TOKENS, CONTENT)[layer] for layer in range(LAYERS)]
    bound = [v.view(BLOCKS, HEADS, TOKENS, CONTENT) for v in views]  # other views of it, as vLLM's layers hold
    old = StorageWeakRef(buffer.untyped_storage())
    conn.send(share_rank_pool(views, also=[*bound, torch.zeros(1)]))
    del buffer
    gc.collect()
    conn.send(old.expired() and len({t.untyped_storage().data_ptr() for t in [*views, *bound]}) == 1)
    conn.recv()
    bound[0][0].fill_(0.5)  # through a view given as ``also``: the worker sees it too
    views[1][2].fill_(10.0 + rank)
    conn.send("written")
    conn.recv()
    conn.send(float(views[0][4].sum()))


def _recv(conn):
    """The rank's next message, or a failure (never a wait without end for a rank that died)."""
    assert conn.poll(120), "a rank process sent nothing in 120 s"
    return conn.recv()


def test_each_ranks_pool_is_shared_with_the_worker_rank_after_rank():
    ctx = multiprocessing.get_context("spawn")  # as vLLM starts its ranks: a fork of pytest's threads may abort
    pipes = [ctx.Pipe() for _ in range(2)]
    ranks = [ctx.Process(target=_rank, args=(r, child)) for r, (_, child) in enumerate(pipes)]
    for p in ranks:
        p.start()
    try:
        pools = [_recv(parent) for parent, _ in pipes]
        assert [_recv(parent) for parent, _ in pipes] == [True, True]  # the old storage freed, every view moved
        mapped = map_rank_pools(pools)
        assert mapped.stride >= pools[0].nbytes and mapped.stride % 4096 == 0
        layouts = [pool_layout_of(caches, dtype="float32", block_size=TOKENS) for caches in mapped.caches]
        assert layouts[0].arrangement == VLLM_CPU_ARRANGEMENT
        assert layouts[1].base_address == layouts[0].base_address + mapped.stride  # rank after rank
        for parent, _ in pipes:
            parent.send("go")
        assert [_recv(parent) for parent, _ in pipes] == ["written", "written"]
        for rank, caches in enumerate(mapped.caches):
            assert bool((caches[1][2] == 10.0 + rank).all()) and float(caches[1][3].sum()) == 0.0
            assert bool((caches[0][0] == 0.5).all())
            caches[0][4].fill_(1.0 + rank)
        for parent, _ in pipes:
            parent.send("read")
        per_block = HEADS * TOKENS * CONTENT
        assert [_recv(parent) for parent, _ in pipes] == [1.0 * per_block, 2.0 * per_block]
    finally:
        for p in ranks:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert [p.exitcode for p in ranks] == [0, 0]


def test_views_of_more_than_one_storage_are_refused():
    with pytest.raises(ValueError, match="2 storages"):
        share_rank_pool([torch.zeros(4), torch.zeros(4)])
