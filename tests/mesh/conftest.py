"""The small mesh most end-to-end modules share: one prefill and one decode worker, their
Mooncake listeners pinned to a port range (as the deployment files do)."""

from __future__ import annotations

import random
import socket
from collections.abc import Iterator

import pytest

from kvmesh.infra.local_mesh import LocalMesh
from tests.mesh.meshes import make_mesh

TRANSFER_PORTS = 16


def free_port_range(count: int) -> tuple[int, int]:
    """``count`` ports, all free now, below Mooncake's limit of 32767."""

    def free(port: int) -> bool:
        with socket.socket() as probe:
            try:
                probe.bind(("0.0.0.0", port))
            except OSError:
                return False
        return True

    for base in random.sample(range(20000, 32700, count), 100):
        if all(free(port) for port in range(base, base + count)):
            return base, base + count - 1
    raise RuntimeError("no free port range")


@pytest.fixture(scope="module")
def transfer_ports() -> tuple[int, int]:
    return free_port_range(TRANSFER_PORTS)


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory, default_model_dir, transfer_ports) -> Iterator[LocalMesh]:
    low, high = transfer_ports
    mesh = make_mesh(
        tmp_path_factory.mktemp("mesh"), default_model_dir, prefill=1, decode=1, env={"KVMESH_TRANSFER_PORTS": f"{low}-{high}"}
    )
    try:
        yield mesh
    finally:
        mesh.stop()
