"""Faults through real processes: a prefill worker killed between its prefill and the pull,
a decode worker killed mid-stream. The client never hangs; survivors leak no blocks; the
dead worker's etcd record leaves with its lease."""

from __future__ import annotations

import asyncio
import time

import pytest

from kvmesh.cluster.etcd_store import EtcdStore
from kvmesh.engine.tokenizer import Tokenizer
from kvmesh.infra.local_mesh import LocalMesh
from kvmesh.protocol import Keys
from tests.mesh.client import post, stream, streamed_text, worker_stats
from tests.mesh.meshes import LEASE_TTL, MODEL, assert_pools_at_baseline, make_mesh, wait_for_a_pin

pytestmark = pytest.mark.slow

async def wait_gone(mesh: LocalMesh, role: str, worker_id: str, timeout: float) -> float:
    started = time.monotonic()
    async with EtcdStore([mesh.etcd.endpoint]) as store:
        while time.monotonic() - started < timeout:
            if await store.get(Keys("default").worker(role, worker_id)) is None:
                return time.monotonic() - started
            await asyncio.sleep(0.1)
    raise AssertionError(f"{worker_id} still registered after {timeout}s")


async def test_prefill_killed_before_the_pull_is_retried(tmp_path, default_model_dir):
    mesh = make_mesh(  # the pin's etcd key at once: it is how the test sees the prefill done
        tmp_path, default_model_dir, prefill=2, decode=1, env={"KVMESH_FAULT_PULL_DELAY": "1.5", "KVMESH_PIN_WRITE_DELAY": "0"}
    )
    try:
        body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
        want = (await post(mesh.base_url, "/v1/completions", body)).json()["choices"][0]["text"]

        async with EtcdStore([mesh.etcd.endpoint]) as store:
            request = asyncio.create_task(post(mesh.base_url, "/v1/completions", body))
            victim = await wait_for_a_pin(store, ["prefill-1", "prefill-2"])  # prefill done, pull pending
            assert victim is not None
            mesh.workers[victim].kill()
            response = await asyncio.wait_for(request, 60)
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["text"] == want  # completed on the healthy workers
        assert "retrying" in mesh.router.tail(200)  # the first attempt really failed
        survivor = "prefill-2" if victim == "prefill-1" else "prefill-1"
        await assert_pools_at_baseline(mesh, [survivor, "decode-3"])
        assert await wait_gone(mesh, "prefill", victim, timeout=LEASE_TTL + 5) <= LEASE_TTL + 5
    finally:
        mesh.stop()


# A JSON schema the answer cannot complete within max_tokens (``guided``): the retry's matcher
# is rebuilt over the tokens already sent and goes on from there.
LONG_LIST = {"type": "object", "properties": {"items": {"type": "array", "minItems": 50, "items": {"type": "string"}}}, "required": ["items"]}


@pytest.mark.parametrize("options", ["plain", "penalties", "guided"])
async def test_decode_killed_mid_stream_resumes_on_the_survivor(tmp_path, default_model_dir, options):
    """The stream goes on from the tokens already sent, on the other decode worker: the
    client sees one uninterrupted answer, the same as without the fault. With penalties and
    min_tokens too: the retry counts the tokens sent as generated (an EOS forced by the bias
    comes right after min_tokens, as without the fault), and the logprobs go on from there."""
    mesh = make_mesh(tmp_path, default_model_dir, prefill=1, decode=2)
    try:
        body = {"model": MODEL, "prompt": "Tell me a long story:", "max_tokens": 60, "temperature": 0, "ignore_eos": True}
        finish = "length"
        if options == "penalties":
            [eos] = Tokenizer.from_dir(default_model_dir).eos_token_ids[:1]
            body.update(ignore_eos=False, frequency_penalty=0.8, presence_penalty=0.4, repetition_penalty=1.1)
            body.update(logit_bias={str(eos): 100}, min_tokens=40, logprobs=2)
            finish = "stop"
        if options == "guided":
            body.update(ignore_eos=False, guided_json=LONG_LIST)
        answer = (await post(mesh.base_url, "/v1/completions", body)).json()
        want = answer["choices"][0]["text"]
        assert answer["usage"]["completion_tokens"] == (41 if options == "penalties" else 60)
        if options == "guided":
            assert want.startswith('{"items": ["')
        victim = None

        async def kill_the_streaming_decode_worker(events: list[dict]) -> None:
            nonlocal victim
            if len(events) == 5:
                for worker_id in ("decode-2", "decode-3"):
                    if (await worker_stats(mesh.nats.url, "default", worker_id)).num_in_use > 0:
                        victim = worker_id
                assert victim is not None
                mesh.workers[victim].kill()

        # stream() asserts the stream ends cleanly with [DONE]
        events = await stream(mesh.base_url, "/v1/completions", body, on_event=kill_the_streaming_decode_worker)
        assert victim is not None
        assert "error" not in events[-1], events[-1]
        assert events[-1]["choices"][0]["finish_reason"] == finish
        assert streamed_text(events) == want
        if options == "penalties":  # a logprob per token, across the retry, as without the fault
            streamed = [v for e in events for c in e.get("choices", []) if c.get("logprobs") for v in c["logprobs"]["token_logprobs"]]
            assert streamed == pytest.approx(answer["choices"][0]["logprobs"]["token_logprobs"], abs=2e-3)
            assert len(streamed) == 41 and None not in streamed
        assert "retrying" in mesh.router.tail(200)
        survivor = "decode-3" if victim == "decode-2" else "decode-2"
        await assert_pools_at_baseline(mesh, ["prefill-1", survivor])
        await wait_gone(mesh, "decode", victim, timeout=LEASE_TTL + 5)
    finally:
        mesh.stop()


async def test_no_worker_left_is_a_clean_error_event(tmp_path, default_model_dir):
    """With every decode worker gone mid-stream, the client gets an error event and [DONE]."""
    mesh = make_mesh(tmp_path, default_model_dir, prefill=1, decode=1)
    try:
        body = {"model": MODEL, "prompt": "Tell me a long story:", "max_tokens": 400, "temperature": 0, "ignore_eos": True}

        async def kill_the_decode_worker(events: list[dict]) -> None:
            if len(events) == 3:
                mesh.workers["decode-2"].kill()

        events = await stream(mesh.base_url, "/v1/completions", body, on_event=kill_the_decode_worker)
        assert "error" in events[-1], events[-1]  # and [DONE] came: stream() checks it
        await assert_pools_at_baseline(mesh, ["prefill-1"])
    finally:
        mesh.stop()


async def test_client_leaving_cancels_both_sides_then_drain_and_nats_restart(tmp_path, default_model_dir):
    """One mesh, three stories: a client that goes away mid-stream frees the workers at once;
    NATS restarted under the mesh is survived; a decode worker drained with SIGTERM finishes
    its stream, deregisters and exits cleanly."""
    import signal

    from kvmesh.infra.servers import start_nats

    mesh = make_mesh(tmp_path, default_model_dir, prefill=1, decode=1)
    try:
        body = {"model": MODEL, "prompt": "Count slowly:", "max_tokens": 600, "temperature": 0, "ignore_eos": True}
        await stream(mesh.base_url, "/v1/completions", body, leave_after=3)  # the client goes away
        await assert_pools_at_baseline(mesh, ["prefill-1", "decode-2"])
        decode = await worker_stats(mesh.nats.url, "default", "decode-2")
        assert decode.num_in_use == 0  # aborted, not decoding 600 tokens for nobody

        # NATS restarted on the same port: every process reconnects and resubscribes.
        port = mesh.nats.port
        mesh.nats.stop()
        mesh.nats = start_nats(tmp_path / "nats-again", port=port)
        short = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}
        for _ in range(100):
            response = await post(mesh.base_url, "/v1/completions", short, timeout=30)
            if response.status_code == 200:
                break
            await asyncio.sleep(0.2)
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["text"].startswith(" Paris")

        # Drain: SIGTERM while a stream runs; the stream still completes.
        async def drain_the_decode_worker(events: list[dict]) -> None:
            if len(events) == 5:  # tokens 2.. come from the decode worker: it is streaming
                mesh.workers["decode-2"].signal(signal.SIGTERM)

        events = await stream(mesh.base_url, "/v1/completions", {**body, "max_tokens": 40}, on_event=drain_the_decode_worker)
        assert events[-1]["choices"][0]["finish_reason"] == "length" and "error" not in events[-1]
        assert len(streamed_text(events)) > 0
        assert mesh.workers["decode-2"].popen.wait(30) == 0
        await wait_gone(mesh, "decode", "decode-2", timeout=1)  # revoked at drain, not left to expire
    finally:
        mesh.stop()
