"""A lend reply is a pull plan: it is pulled only if it agrees with the lender's etcd record
and names at most the blocks asked for, distinct, inside the lender's pool (issue #8: a
forged transfer_endpoint made a worker connect to an arbitrary listener)."""

from __future__ import annotations

import pytest

from kvmesh.protocol import KVLayoutSpec, KVLendReply, WorkerRecord
from kvmesh.services.prefill_worker.peer_prefix import lend_reply_problem

SPEC = KVLayoutSpec(num_blocks=64, block_size=16, num_layers=2, num_kv_heads=2, head_dim=8, dtype="float32")
LENDER = WorkerRecord(
    worker_id="prefill-2", role="prefill", model="m", max_model_len=1024, subject="kvmesh.default.prefill.prefill-2",
    transfer_endpoint="127.0.0.1:5000", kv_base_address=4096, kv_layout=SPEC, host="127.0.0.1", pid=1, started_at=0.0,
)  # fmt: skip


def reply(**overrides) -> KVLendReply:
    fields = dict(block_ids=[3, 4], transfer_endpoint="127.0.0.1:5000", kv_base_address=4096, layout=SPEC, loan_id="l", pin_token="t")
    fields.update(overrides)
    return KVLendReply(**fields)  # type: ignore[arg-type]


def test_a_reply_that_agrees_with_the_lenders_record_may_be_pulled():
    assert lend_reply_problem(reply(), LENDER, asked=2) is None


@pytest.mark.parametrize(
    ("forged", "lender", "needle"),
    [
        (reply(transfer_endpoint="10.6.6.6:1"), LENDER, "disagrees with the lender's registered endpoint"),
        (reply(kv_base_address=0), LENDER, "disagrees"),
        (reply(block_ids=[3, 64]), LENDER, "at most 2 distinct blocks of the lender's pool"),  # 64 blocks: 0-63
        (reply(block_ids=[3, 3]), LENDER, "at most 2 distinct blocks"),
        (reply(block_ids=[1, 2, 3]), LENDER, "at most 2 distinct blocks"),
        (reply(), None, "not a registered prefill worker"),
        (reply(), LENDER.model_copy(update={"role": "decode"}), "not a registered prefill worker"),
    ],
)
def test_a_forged_reply_is_not_pulled(forged, lender, needle):
    problem = lend_reply_problem(forged, lender, asked=2)
    assert problem is not None and needle in problem, problem
