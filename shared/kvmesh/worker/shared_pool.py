"""A KV pool split across processes (vLLM's tensor-parallel ranks), shared with the worker's.

vLLM's ranks each keep their share of the pool (their heads) in their own memory, where the
worker's transfer engine cannot reach. Each rank moves its pool, one storage that every
layer's tensor is a view of, onto a memfd (``share_rank_pool``, run in the rank before any
request: the tensors keep their shapes and strides, only their memory changes, so every
reference vLLM holds sees the new one), and the worker's process maps every rank's memfd
one after another, ``stride`` bytes apart (``map_rank_pools``): one address space where the
transfer engine registers, reads and writes each rank's blocks, and where blocks are copied
between steps. A memfd is not a file in /dev/shm: a container's small /dev/shm does not
bound it.

Linux only (memfd, and ``/proc/<pid>/fd`` to open a rank's: the worker may, the ranks being
its children).
"""

from __future__ import annotations

import ctypes
import mmap
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

PAGE = mmap.PAGESIZE
_PROT_NONE, _PROT_RW = 0, mmap.PROT_READ | mmap.PROT_WRITE
_MAP_FIXED = 0x10
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value

_kept: list[int] = []  # a rank's memfds, open while it lives (the worker opens them through /proc)


@dataclass(frozen=True, slots=True)
class RankPool:
    """One rank's pool on its memfd, as the rank tells the worker."""

    pid: int
    fd: int
    nbytes: int
    dtype: str  # torch's name of the tensors' element type ("float32")
    views: tuple[tuple[int, tuple[int, ...], tuple[int, ...]], ...]  # each layer's (storage offset, shape, strides), in elements


def share_rank_pool(caches: Sequence[Any], also: Sequence[Any] = ()) -> RankPool:
    """Move a rank's pool (``caches``: each layer's tensor, all views of one storage) onto a
    memfd, and with it those of ``also`` that are views of that storage too (other views
    of the pool its code holds), and the tensors they are views of, so that nothing keeps
    the old storage (freed then); returns where the worker finds it. The pool's contents
    are not kept: run it before any request."""
    import torch

    storages = {t.untyped_storage().data_ptr() for t in caches}
    if len(storages) != 1:
        raise ValueError(f"the rank's KV tensors are views of {len(storages)} storages, not one")
    old = storages.pop()
    nbytes = caches[0].untyped_storage().nbytes()
    fd = os.memfd_create("kvmesh-kv-pool")
    try:
        os.ftruncate(fd, nbytes)
        shared = torch.from_file(f"/proc/self/fd/{fd}", shared=True, size=nbytes, dtype=torch.uint8).untyped_storage()
    except BaseException:
        os.close(fd)
        raise
    views = [*caches, *(t for t in also if t.untyped_storage().data_ptr() == old)]
    bases = {id(t._base): t._base for t in views if t._base is not None}  # a view keeps its base, and the base its storage
    for t in [*views, *bases.values()]:
        t.set_(shared, t.storage_offset(), t.size(), t.stride())
    _kept.append(fd)
    layers = tuple((t.storage_offset(), tuple(t.size()), tuple(t.stride())) for t in caches)
    return RankPool(os.getpid(), fd, nbytes, str(caches[0].dtype).removeprefix("torch."), layers)


@dataclass(slots=True)
class MappedPools:
    """Every rank's pool mapped in this process: rank ``r``'s storage at
    ``base + r * stride``, and each rank's layer tensors over it. Never unmapped: the
    transfer engine has them registered, and a peer may read them, until the process ends."""

    base: int
    stride: int
    caches: list[list[Any]]  # per rank, each layer's tensor (the rank's shapes and strides)


def map_rank_pools(pools: Sequence[RankPool]) -> MappedPools:
    """Map each rank's memfd here, rank after rank in one reserved range."""
    import torch

    stride = -(-max(p.nbytes for p in pools) // PAGE) * PAGE
    base = _libc.mmap(None, stride * len(pools), _PROT_NONE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
    if base in (None, _MAP_FAILED):
        raise OSError(ctypes.get_errno(), f"reserving {stride * len(pools)} bytes for the ranks' KV pools")
    caches: list[list[Any]] = []
    try:
        for rank, pool in enumerate(pools):
            address = base + rank * stride
            fd = os.open(f"/proc/{pool.pid}/fd/{pool.fd}", os.O_RDWR)
            try:
                got = _libc.mmap(address, pool.nbytes, _PROT_RW, mmap.MAP_SHARED | _MAP_FIXED, fd, 0)
            finally:
                os.close(fd)
            if got != address:
                raise OSError(ctypes.get_errno(), f"mapping rank {rank}'s KV pool")
            flat = torch.frombuffer((ctypes.c_uint8 * pool.nbytes).from_address(address), dtype=torch.uint8)
            typed = flat.view(getattr(torch, pool.dtype))
            caches.append([typed.as_strided(shape, strides, offset) for offset, shape, strides in pool.views])
    except BaseException:
        _libc.munmap(base, stride * len(pools))
        raise
    return MappedPools(base, stride, caches)
