"""The small mesh most end-to-end modules share: one prefill and one decode worker, their
Mooncake listeners pinned to a port range (as the deployment files do)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvmesh.infra.local_mesh import LocalMesh
from kvmesh.testing.otlp_sink import OTLPSink
from tests.mesh.meshes import free_port_range, make_mesh

TRANSFER_PORTS = 16


@pytest.fixture(scope="module")
def transfer_ports() -> tuple[int, int]:
    return free_port_range(TRANSFER_PORTS)


@pytest.fixture(scope="module")
def sink() -> Iterator[OTLPSink]:
    """An OTLP/HTTP receiver the module's mesh exports its spans to."""
    receiver = OTLPSink()
    yield receiver
    receiver.close()


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
