"""nats-server restarted, with the same users and TLS, while a stream runs on the only decode
worker of a mesh started as ``kvmesh up`` starts it (auth and TLS on). The worker's rights to
answer its work (``allow_responses``) go with its old connection, so its stream falls
silent; the router tries that worker once more, from the tokens already sent, and the
client gets the whole answer."""

from __future__ import annotations

import asyncio

import pytest

from kvmesh.infra.servers import start_nats
from tests.mesh.client import post, stream, streamed_text
from tests.mesh.meshes import MODEL, assert_pools_at_baseline, make_mesh

pytestmark = pytest.mark.slow


async def test_a_stream_survives_nats_restarting_under_auth_with_one_decode_worker(tmp_path, default_model_dir):
    mesh = make_mesh(tmp_path, default_model_dir, prefill=1, decode=1, tls=True)
    try:
        assert mesh.credentials is not None and mesh.tls is not None and mesh.nats is not None
        body = {"model": MODEL, "prompt": "Count slowly:", "max_tokens": 48, "temperature": 0, "ignore_eos": True}
        want = (await post(mesh.base_url, "/v1/completions", body)).json()["choices"][0]["text"]
        restarted = asyncio.Event()

        async def restart_nats(events: list[dict]) -> None:
            if len(events) == 6 and not restarted.is_set():  # the decode worker is streaming
                restarted.set()
                assert mesh.nats is not None
                port = mesh.nats.port
                mesh.nats.stop()
                mesh.nats = await asyncio.to_thread(
                    start_nats, tmp_path / "nats-again", port=port,
                    config=mesh.credentials.nats_config, admin=mesh.credentials.nats_admin, tls=mesh.tls,
                )  # fmt: skip

        events = await asyncio.wait_for(
            stream(mesh.base_url, "/v1/completions", {**body, "stream": True}, on_event=restart_nats), 90
        )
        assert restarted.is_set()
        assert "error" not in events[-1], events[-1]
        assert streamed_text(events) == want
        await assert_pools_at_baseline(mesh, ["prefill-1", "decode-2"])
    finally:
        mesh.stop()
