"""The bind guard: Mooncake's transfer listeners on the advertised address only.

Mooncake 0.3.13 binds both of its listeners (the handshake RPC, ``AF_INET``, and the TCP
transport, a dual-stack ``AF_INET6`` socket) to the unspecified address whatever hostname
it is given, with no option to do otherwise. ``bind_guard.c``, loaded with ``LD_PRELOAD``,
makes a bind to the unspecified address on a port of the worker's transfer range a bind to
the advertised IPv4 address (``::ffff:<host>`` for a dual-stack socket; a v6-only one is
refused). It is compiled at first use with the system's C compiler into the kvmesh cache
(keyed on its source), and a worker process re-executes itself once, same PID, with it
preloaded (``enforce``). Without a compiler the worker says in one warning line that its
transfer ports listen on every interface, and runs as before (the port range and a
NetworkPolicy still fence them).
"""

from __future__ import annotations

import ctypes
import hashlib
import ipaddress
import logging
import os
import shutil
import sys
from pathlib import Path
from typing import Literal

from kvmesh.native_build import build_shared_library

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("bind_guard.c")
HOST_ENV = "KVMESH_TRANSFER_BIND"  # the IPv4 address the guarded binds go to
PORTS_ENV = "KVMESH_TRANSFER_BIND_PORTS"  # "MIN-MAX": only binds to these ports are guarded
EXEC_MARK = "KVMESH_BIND_GUARD_EXEC"  # set across the one re-exec, so that it happens once
# Mooncake's own range when MC_MIN_RPC_PORT / MC_MAX_RPC_PORT are not set (both listeners
# are picked from it; measured on 0.3.13).
MOONCAKE_DEFAULT_PORTS = (15000, 17000)

State = Literal["loaded", "off", "available"]
last_failure = ""  # why ``library`` last returned None, one line


def guard_host(host: str) -> str | None:
    """``host`` as the guard takes it: a specific IPv4 address, else None."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return None
    if address.version != 4 or address.is_unspecified:
        return None
    return str(address)


def loaded() -> bool:
    """Is the guard in this process (preloaded)?"""
    try:
        ctypes.CDLL(None).kvmesh_bind_guard  # noqa: B018 - the lookup is the test
    except AttributeError:
        return False
    return True


def compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def library(cache: Path | None = None) -> Path | None:
    """The compiled guard, built now if needed (atomically, keyed on the source's hash);
    None without a C compiler or when it fails to build (why: ``last_failure``)."""
    global last_failure
    from kvmesh.engine.loader.default_model import cache_dir

    source = SOURCE.read_bytes()
    path = (cache or cache_dir()) / f"bind_guard-{hashlib.sha256(source).hexdigest()[:16]}.so"
    if path.exists():
        return path
    cc = compiler()
    if cc is None:
        last_failure = "no C compiler (cc)"
        return None
    last_failure = build_shared_library(
        path, lambda output: [cc, "-shared", "-fPIC", "-O2", "-o", output, str(SOURCE), "-ldl"], timeout=60, mode=0o755
    )
    if last_failure:
        return None
    return path


def guard_env(host: str, ports: tuple[int, int]) -> dict[str, str]:
    return {HOST_ENV: host, PORTS_ENV: f"{ports[0]}-{ports[1]}"}


def preload_env(path: Path, env: dict[str, str]) -> dict[str, str]:
    """``env`` with the guard first in ``LD_PRELOAD``."""
    others = [p for p in env.get("LD_PRELOAD", "").replace(":", " ").split() if p != str(path)]
    return {**env, "LD_PRELOAD": " ".join([str(path), *others])}


def enforce(host: str, port_range: tuple[int, int] | None, *, reexec: bool = True) -> State:
    """Make this worker's transfer listeners bind ``host`` only: call before the transfer
    engine starts. Sets the guard's environment, then: the guard is already in the process
    (``"loaded"``); or, when ``reexec``, this process is executed again with the guard
    preloaded (does not return); or one warning line and ``"off"``, the listeners on every
    interface (no specific IPv4 host, no compiler, a preload that did not load);
    ``"available"`` when not ``reexec`` and the guard could be preloaded."""
    ports = port_range or MOONCAKE_DEFAULT_PORTS
    address = guard_host(host)
    unguarded = f"the transfer ports {ports[0]}-{ports[1]} listen on every interface, not only on {host}"
    if address is None:
        logger.warning("%s: the bind guard takes a specific IPv4 address as the advertised host", unguarded)
        return "off"
    os.environ.update(guard_env(address, ports))
    retried = os.environ.pop(EXEC_MARK, None)
    if loaded():
        return "loaded"
    if retried:
        logger.warning("%s: the bind guard %s did not load (LD_PRELOAD=%s)", unguarded, retried, os.environ.get("LD_PRELOAD"))
        return "off"
    path = library()
    if path is None:
        logger.warning("%s: the bind guard was not built (%s; it needs a C compiler: apt-get install gcc libc6-dev)", unguarded, last_failure)
        return "off"
    if not reexec:
        return "available"
    os.environ.update(preload_env(path, dict(os.environ)))
    os.environ[EXEC_MARK] = str(path)
    logger.info("bind guard: executing again with %s preloaded (transfer listeners on %s only)", path, address)
    for handler in logging.getLogger().handlers:
        handler.flush()
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])


if __name__ == "__main__":  # `python -m kvmesh.transfer.bind_guard`: build it now (make install, images)
    built = library()
    print(built or "kvmesh bind guard: not built (no C compiler?)")
    sys.exit(0)
