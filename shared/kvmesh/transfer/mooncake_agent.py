"""One worker's Mooncake transfer engine: its KV pool registered once, blocks pulled from peers.

Protocol tcp with P2P handshake metadata: a peer is addressed as ``"<ip>:<rpc port>"`` and
no metadata server is needed. Reads are one-sided: the peer's process takes no part beyond
its engine serving the bytes. Calls block, so the async wrapper runs them on a thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import random
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from kvmesh.errors import KvmeshError
from kvmesh.transfer.layout import PoolLayout
from kvmesh.transfer.runs import BlockRun, byte_ranges, layout_byte_ranges

logger = logging.getLogger(__name__)


class TransferError(KvmeshError):
    """A KV transfer failed (peer gone, address not registered, engine error)."""


@dataclass(slots=True, frozen=True)
class TransferStats:
    bytes: int
    ranges: int
    seconds: float


# Mooncake 0.3.13 silently ignores a range that reaches past 32767 (and picks from its
# default 15000-17000); measured on this machine.
MAX_TRANSFER_PORT = 32767

# Mooncake picks its two ports at random in the range, probes them, and binds them for good a
# moment later: workers of one host that share a range and start together sometimes pick the
# same one, and the second fails ("Address already in use": 1 in 12 paired starts on 16 ports,
# measured). kvmesh's workers of one host start their engines one at a time (a lock file), and
# a start that still finds a port taken (by another program) is tried again with a fresh engine.
START_ATTEMPTS = 10
START_LOCK = Path(tempfile.gettempdir()) / "kvmesh-mooncake-start.lock"
START_LOCK_WAIT = 30.0  # seconds; then the engine starts without the lock (one warning)
# Mooncake's own variables for its port range (read once, when it is first loaded)
RANGE_ENV = ("MC_MIN_RPC_PORT", "MC_MAX_RPC_PORT")


def parse_port_range(text: str) -> tuple[int, int]:
    """``"20000-20015"`` -> (20000, 20015)."""
    low, sep, high = text.partition("-")
    try:
        first, last = int(low), int(high if sep else low)
    except ValueError:
        raise ValueError(f"a port range is MIN-MAX, got {text!r}") from None
    if not 1024 <= first <= last <= MAX_TRANSFER_PORT:
        raise ValueError(f"a transfer port range is MIN-MAX within 1024..{MAX_TRANSFER_PORT}, got {text!r}")
    return first, last


def mooncake_env_range(environ: Mapping[str, str] | None = None) -> tuple[int, int] | None:
    """The port range Mooncake will take from its own variables, if both are set (so that a
    worker fences the ports it really uses); ValueError when they do not make a range."""
    low, high = ((os.environ if environ is None else environ).get(name) for name in RANGE_ENV)
    if low is None or high is None:
        return None
    try:
        return parse_port_range(f"{low}-{high}")
    except ValueError as exc:
        raise ValueError(f"{' / '.join(RANGE_ENV)}: {exc}") from None


def _lock(handle: int, wait: float) -> bool:
    deadline = time.monotonic() + wait
    while True:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.02)


@contextlib.contextmanager
def one_start_at_a_time(path: Path | None = None, wait: float = START_LOCK_WAIT) -> Iterator[None]:
    """Hold this host's Mooncake start lock (``START_LOCK`` unless ``path``): the engine that
    starts inside it has bound its ports before the next kvmesh process picks any. Waits at
    most ``wait`` seconds, then goes on without it (one warning). Blocks: keep it off an
    event loop."""
    path = START_LOCK if path is None else path
    try:
        handle = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    except OSError as exc:
        logger.warning("Mooncake starts without the start lock (%s)", exc)
        yield
        return
    try:
        locked = _lock(handle, wait)
        if not locked:
            logger.warning("Mooncake starts without the start lock: %s held for %.0f s", path, wait)
        yield
    finally:
        os.close(handle)  # lets go of the lock too


class MooncakeAgent:
    """The transfer engine listens on two TCP ports, unauthenticated. Mooncake 0.3.13 binds
    INADDR_ANY whatever the hostname; in a worker process the bind guard
    (``transfer.bind_guard``, preloaded) moves both onto the advertised address.
    ``port_range`` keeps both in a known range, which the guard and a NetworkPolicy or
    firewall fence (it applies to the first agent of a process: Mooncake reads it once)."""

    def __init__(
        self,
        hostname: str = "127.0.0.1",
        *,
        protocol: str = "tcp",
        metadata: str = "P2PHANDSHAKE",
        port_range: tuple[int, int] | None = None,
    ) -> None:
        if port_range is not None:  # Mooncake reads these once per process, when it is first loaded
            os.environ.update(zip(RANGE_ENV, map(str, port_range)))
        try:
            from mooncake.engine import TransferEngine
        except ImportError as exc:
            raise TransferError(
                "the Mooncake transfer engine is not installed (pip install mooncake-transfer-engine-non-cuda; "
                "it needs the system library libibverbs1)"
            ) from exc
        for attempt in range(1, START_ATTEMPTS + 1):
            engine = TransferEngine()
            try:
                with one_start_at_a_time():
                    status = engine.initialize(hostname, metadata, protocol, "")
            except RuntimeError as exc:  # its RPC port taken: "bind: Address already in use"
                if "Address already in use" not in str(exc):
                    raise
                failure = str(exc)
            else:
                if status == 0:
                    self._engine = engine
                    break
                # its transport port taken (Mooncake logs "Address already in use") or else
                failure = f"initialize({hostname!r}, {metadata!r}, {protocol!r}) returned {status}"
            if attempt == START_ATTEMPTS:
                ports = f", ports {port_range[0]}-{port_range[1]}" if port_range else ""
                raise TransferError(f"Mooncake did not start in {START_ATTEMPTS} tries{ports}: {failure}")
            logger.warning("Mooncake did not start (%s); trying again (%d of %d)", failure, attempt, START_ATTEMPTS)
            del engine  # a failed engine lets go of any port it took before the next one starts
            time.sleep(random.uniform(0.05, 0.3))
        self.endpoint = f"{hostname}:{self._engine.get_rpc_port()}"
        self._lock = threading.Lock()
        self.bytes_read = 0
        self.transfers = 0

    def register(self, address: int, nbytes: int) -> None:
        status = self._engine.register_memory(address, nbytes)
        if status != 0:
            raise TransferError(f"registering {nbytes} bytes at {address:#x} returned {status}")
        logger.info("Mooncake: %.1f MiB registered, serving at %s", nbytes / 2**20, self.endpoint)

    def read_blocks(
        self,
        peer_endpoint: str,
        runs: list[BlockRun],
        *,
        peer_base: int,
        local_base: int,
        block_bytes: int,
    ) -> TransferStats:
        """Pull block runs from a peer's pool into ours, one batched read (both pools
        block-major with blocks of ``block_bytes``)."""
        peer_addrs, local_addrs, lengths = byte_ranges(runs, src_base=peer_base, dst_base=local_base, block_bytes=block_bytes)
        return self._read(peer_endpoint, peer_addrs, local_addrs, lengths)

    def read_layout(self, peer_endpoint: str, runs: list[BlockRun], *, peer: PoolLayout, local: PoolLayout) -> TransferStats:
        """Pull block runs from a peer's pool, laid out as ``peer`` (its published layout),
        into ours, laid out as ``local``: one batched read of every range."""
        try:
            peer_addrs, local_addrs, lengths = layout_byte_ranges(runs, src=peer, dst=local)
        except ValueError as exc:
            raise TransferError(str(exc)) from exc
        return self._read(peer_endpoint, peer_addrs, local_addrs, lengths)

    def _read(self, peer_endpoint: str, peer_addrs: list[int], local_addrs: list[int], lengths: list[int]) -> TransferStats:
        if not lengths:
            return TransferStats(0, 0, 0.0)
        started = time.perf_counter()
        status = self._engine.batch_transfer_sync_read(peer_endpoint, local_addrs, peer_addrs, lengths)
        seconds = time.perf_counter() - started
        if status != 0:
            raise TransferError(f"reading {sum(lengths)} bytes in {len(lengths)} ranges from {peer_endpoint} failed ({status})")
        with self._lock:
            self.bytes_read += sum(lengths)
            self.transfers += 1
        return TransferStats(sum(lengths), len(lengths), seconds)

    async def read_layout_async(
        self, peer_endpoint: str, runs: list[BlockRun], *, peer: PoolLayout, local: PoolLayout
    ) -> TransferStats:
        return await asyncio.to_thread(lambda: self.read_layout(peer_endpoint, runs, peer=peer, local=local))
