"""A decode request's KV handle is checked against itself and its producer's record before
anything is allocated."""

from __future__ import annotations

import pytest

from kvmesh.errors import ErrorCode, MeshError
from kvmesh.protocol import DecodeRequest, KVHandle, KVLayoutSpec, Keys, SamplingSpec, WorkerRecord
from kvmesh.services.decode_worker.handle_check import check_handle
from kvmesh.transfer.layout import PoolLayout, block_major

LAYOUT = block_major(dtype="float32", block_size=16, num_blocks=64, num_layers=2, num_kv_heads=2, head_dim=8, base_address=4096)
SPEC = KVLayoutSpec.from_layout(LAYOUT)
PIN_KEY = Keys("default").pin("prefill-1", "r1")


def record(**overrides) -> WorkerRecord:
    fields = dict(
        worker_id="prefill-1", role="prefill", model="m", max_model_len=1024, subject="kvmesh.default.prefill.prefill-1",
        transfer_endpoint="127.0.0.1:5000", kv_base_address=4096, kv_layout=SPEC, host="127.0.0.1", pid=1, started_at=0.0,
    )  # fmt: skip
    fields.update(overrides)
    return WorkerRecord(**fields)


def request(*, num_prompt: int = 20, first_token: int | None = 7, **kv_overrides) -> DecodeRequest:
    kv = dict(
        prefill_worker_id="prefill-1", transfer_endpoint="127.0.0.1:5000", kv_base_address=4096, layout=SPEC,
        block_ids=(3, 4), num_tokens=num_prompt, pin_key=PIN_KEY, pin_token="t0k3n", producer_started_at=0.0,
    )  # fmt: skip
    kv.update(kv_overrides)
    return DecodeRequest(
        request_id="r1",
        prompt_token_ids=list(range(num_prompt)),
        sampling=SamplingSpec(),
        first_token_id=first_token,
        kv=KVHandle(**kv),
    )


def check(req: DecodeRequest, producer: WorkerRecord | None = None, local: PoolLayout = LAYOUT) -> None:
    check_handle(req, producer if producer is not None else record(), local, vocab_size=100, pin_key=PIN_KEY)


def test_a_consistent_handle_passes():
    check(request())


@pytest.mark.parametrize(
    ("req", "needle"),
    [
        (request(num_tokens=40), "holds 40 tokens for a prompt of 20"),  # tokens disagree with the prompt
        (request(block_ids=(3,)), "need 2 blocks; the handle names 1"),
        (request(block_ids=(3, 4, 5)), "need 2 blocks; the handle names 3"),
        (request(block_ids=(3, 3)), "not distinct"),
        (request(block_ids=(3, 64)), "not distinct blocks of a 64-block pool"),
        (request(block_ids=(-1, 4)), "not distinct blocks"),
        (request(transfer_endpoint="10.9.9.9:1"), "disagrees with prefill-1's registered endpoint"),
        (request(kv_base_address=0), "disagrees"),
        (request(pin_key="/kvmesh/default/pins/prefill-1/other"), "pin key"),
        (request(first_token=100), "not a token id"),
        (request(first_token=None), "not a token id"),
    ],
)
def test_an_inconsistent_handle_is_a_bad_request(req, needle):
    with pytest.raises(MeshError) as err:
        check(req)
    assert err.value.code is ErrorCode.BAD_REQUEST
    assert needle in err.value.message


def test_a_handle_of_an_unregistered_worker_is_lost_kv():
    with pytest.raises(MeshError) as err:
        check_handle(request(), None, LAYOUT, vocab_size=100, pin_key=PIN_KEY)
    assert err.value.code is ErrorCode.KV_LOST
    with pytest.raises(MeshError) as err:
        check(request(), record(role="decode"))
    assert err.value.code is ErrorCode.KV_LOST


def test_a_handle_from_before_its_producer_restarted_in_place_is_lost_kv_not_a_bad_request():
    # Same id, a new process: a new transfer endpoint and pool. The handle's blocks died
    # with the old one; the request is retried elsewhere instead of failing with a 400.
    restarted = record(pid=2, started_at=5.0, transfer_endpoint="127.0.0.1:6000", kv_base_address=8192)
    with pytest.raises(MeshError) as err:
        check(request(), restarted)
    assert err.value.code is ErrorCode.KV_LOST
    assert "restarted since it made the handle" in err.value.message


def test_a_layout_this_worker_cannot_copy_is_refused():
    other = block_major(dtype="bfloat16", block_size=16, num_blocks=64, num_layers=2, num_kv_heads=2, head_dim=8, base_address=0)
    with pytest.raises(MeshError, match="does not match this worker's: dtype float32 vs bfloat16"):
        check(request(), local=other)


def test_a_handle_between_pools_split_differently_across_processes_is_a_bad_request():
    """A tensor-parallel vLLM worker's pool is split across vLLM's processes: a handle
    naming one as its producer, sent to a worker whose pool is not split alike (or the other
    way round), is refused before anything is allocated; between pools split alike it passes."""
    import dataclasses

    split = dataclasses.replace(LAYOUT, ranks=2, rank_stride=LAYOUT.pool_bytes)
    split_spec = KVLayoutSpec.from_layout(split)
    for producer, local, kv in ((record(), split, {}), (record(kv_layout=split_spec), LAYOUT, {"layout": split_spec})):
        with pytest.raises(MeshError, match=r"tensor parallel \d vs \d") as err:
            check(request(**kv), producer, local)
        assert err.value.code is ErrorCode.BAD_REQUEST
    check(request(layout=split_spec), record(kv_layout=split_spec), split)
