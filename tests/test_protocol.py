"""What crosses a process: subjects, keys, and payloads that survive a round trip."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from kvmesh.engine.request import SamplingParams
from kvmesh.protocol import (
    STREAM_MESSAGE,
    DecodeAck,
    DecodeRequest,
    Keys,
    KVHandle,
    KVLayoutSpec,
    KVLendReply,
    Progress,
    SamplingSpec,
    Subjects,
    TokenEvent,
)
from kvmesh.transfer.layout import VLLM_CPU_ARRANGEMENT, PoolLayout, block_major


def test_subjects_of_a_namespace():
    s = Subjects("prod")
    assert s.prefill() == "kvmesh.prod.prefill"
    assert s.prefill("w1") == "kvmesh.prod.prefill.w1"
    assert s.decode("w2") == "kvmesh.prod.decode.w2"
    assert s.release("w1") == "kvmesh.prod.release.w1"
    assert (s.cancel, s.load, s.load_from("w1")) == ("kvmesh.prod.cancel", "kvmesh.prod.load.*", "kvmesh.prod.load.w1")
    assert (s.kv_events, s.kv_events_from("w1")) == ("kvmesh.prod.kv.events.*", "kvmesh.prod.kv.events.w1")
    assert s.stream("r1", "k3y", "decode") == "kvmesh.prod.stream.r1.k3y.decode"
    assert s.streams_of("r1") == "kvmesh.prod.stream.r1.>"
    assert s.kv_lend("p1", "p2") == "kvmesh.prod.kv.lend.p1.p2"
    for bad in ("", "a.b", "a b", "*", ">"):
        with pytest.raises(ValueError):
            Subjects(bad)


def test_etcd_keys():
    k = Keys("prod")
    assert k.worker("decode", "w2") == "/kvmesh/prod/workers/decode/w2"
    assert k.workers() == "/kvmesh/prod/workers/"
    assert k.pin("w1", "r9") == "/kvmesh/prod/pins/w1/r9"


def test_sampling_and_layout_round_trip():
    params = SamplingParams(temperature=0.7, top_p=0.9, top_k=5, seed=3, max_tokens=9, stop=("x",), stop_token_ids=(7,), ignore_eos=True)
    assert SamplingSpec.decode(SamplingSpec.from_params(params).encode()).to_params() == params
    layout = block_major(dtype="bfloat16", block_size=16, num_blocks=100, num_layers=30, num_kv_heads=3, head_dim=64, base_address=2**40)
    assert KVLayoutSpec.decode(KVLayoutSpec.from_layout(layout).encode()).to_layout() == layout
    segment = 2 * 128 * 3 * 64 * 4  # vLLM on CPU: 30 layer tensors [blocks, heads, tokens, 2 * dim]
    vllm = PoolLayout(
        engine="vllm", dtype="float32", block_size=128, num_blocks=10, num_layers=30, num_kv_heads=3, head_dim=64,
        layer_stride=10 * segment, block_stride=segment, arrangement=VLLM_CPU_ARRANGEMENT, base_address=4096,
        pool_bytes=300 * segment,
    )  # fmt: skip
    assert KVLayoutSpec.decode(KVLayoutSpec.from_layout(vllm).encode()).to_layout() == vllm



def test_a_layout_with_k_and_v_apart_round_trips_and_a_joint_one_publishes_no_new_fields():
    piece = 16 * 2 * 8 * 4
    planes = (1 << 20, (1 << 20) + 4 * piece, 3 << 20, (3 << 20) + 4 * piece)  # two layers allocated apart
    split = PoolLayout(
        engine="vllm", dtype="float32", block_size=16, num_blocks=4, num_layers=2, num_kv_heads=2, head_dim=8,
        layer_stride=0, block_stride=piece, arrangement="token,head,dim", base_address=1 << 20,
        pool_bytes=(2 << 20) + 8 * piece, kv_split=True, planes=planes,
    )  # fmt: skip
    assert KVLayoutSpec.decode(KVLayoutSpec.from_layout(split).encode()).to_layout() == split
    joint = block_major(dtype="float32", block_size=16, num_blocks=4, num_layers=2, num_kv_heads=2, head_dim=8, base_address=0)
    assert not {"kv_split", "kv_stride", "planes"} & set(json.loads(KVLayoutSpec.from_layout(joint).encode()))  # older readers
    with pytest.raises(ValidationError, match="plane addresses"):
        KVLayoutSpec.model_validate({**KVLayoutSpec.from_layout(split).model_dump(), "planes": planes[:3]})
    with pytest.raises(ValidationError, match="at most 4096"):
        KVLayoutSpec.model_validate({**KVLayoutSpec.from_layout(split).model_dump(), "planes": list(range(5000))})

def test_a_layout_published_before_strides_reads_as_kvmesh_block_major():
    old = KVLayoutSpec.decode(b'{"num_blocks":100,"block_size":16,"num_layers":30,"num_kv_heads":3,"head_dim":64,"dtype":"bfloat16"}')
    assert old.to_layout(default_base=8192) == block_major(
        dtype="bfloat16", block_size=16, num_blocks=100, num_layers=30, num_kv_heads=3, head_dim=64, base_address=8192
    )


def test_a_layout_whose_strides_overlap_or_overrun_its_pool_is_refused():
    fields = dict(num_blocks=4, block_size=16, num_layers=2, num_kv_heads=2, head_dim=8, dtype="float32")  # 2 KiB segments
    with pytest.raises(ValidationError, match="shorter than"):
        KVLayoutSpec(**fields, layer_stride=1024)
    with pytest.raises(ValidationError, match="reaches byte"):
        KVLayoutSpec(**fields, pool_bytes=4 * 2 * 2048 - 1)


def test_a_layout_is_worked_out_once_per_spec():
    """Every prefill answer and decode request carries its producer's spec: the layout behind
    it is worked out once per spec, not per message; a spec that does not hold is refused
    every time."""
    layout = block_major(dtype="float32", block_size=16, num_blocks=64, num_layers=30, num_kv_heads=3, head_dim=64, base_address=2**32)
    spec = KVLayoutSpec.from_layout(layout)
    assert KVLayoutSpec.from_layout(layout) is spec
    arrived = KVLayoutSpec.decode(spec.encode())
    assert arrived is not spec and arrived.to_layout() is spec.to_layout() and spec.to_layout() == layout
    assert spec.to_layout(default_base=4096) == layout  # the spec names its base: the default is not used
    fields = dict(num_blocks=4, block_size=16, num_layers=2, num_kv_heads=2, head_dim=8, dtype="float32")
    for _ in range(2):
        with pytest.raises(ValidationError, match="shorter than"):
            KVLayoutSpec(**fields, layer_stride=1024)


def test_decode_request_round_trip_and_strictness():
    handle = KVHandle(
        prefill_worker_id="p", transfer_endpoint="127.0.0.1:1", kv_base_address=2**40,
        layout=KVLayoutSpec(num_blocks=8, block_size=16, num_layers=2, num_kv_heads=2, head_dim=8, dtype="float32"), block_ids=(3, 4), num_tokens=20, pin_key="/k",
        pin_token="t", producer_started_at=1.5,
    )  # fmt: skip
    request = DecodeRequest(
        request_id="r", prompt_token_ids=[1, 2], sampling=SamplingSpec(), first_token_id=5, kv=handle
    )
    assert DecodeRequest.decode(request.encode()) == request
    with pytest.raises(ValidationError):
        TokenEvent.decode(b'{"request_id": "r", "seq": 0, "surprise": 1}')  # unknown fields are refused


def test_what_arrives_on_a_stream_is_told_apart_by_its_kind():
    for message in (
        DecodeAck(request_id="r", accepted=True),
        Progress(request_id="r", worker_id="w", stage="pull"),
        TokenEvent(request_id="r", seq=0, token_ids=[1]),
    ):
        assert STREAM_MESSAGE.validate_json(message.encode()) == message
    lend = KVLendReply(block_ids=[1], transfer_endpoint="h:1", kv_base_address=0, layout=KVLayoutSpec(num_blocks=8, block_size=16, num_layers=2, num_kv_heads=2, head_dim=8, dtype="float32"))
    with pytest.raises(ValidationError):  # an honest lender's reply sent to a forged reply subject
        STREAM_MESSAGE.validate_json(lend.encode())
