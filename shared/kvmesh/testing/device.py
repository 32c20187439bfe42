"""Where the engine's device-aware tests run the engine and their reference
(``KVMESH_TEST_DEVICE``: ``cpu`` unless set; ``cuda`` runs them on a GPU)."""

from __future__ import annotations

from kvmesh.settings import env


def device_under_test() -> str:
    return env.TEST_DEVICE.read(str, "cpu")
