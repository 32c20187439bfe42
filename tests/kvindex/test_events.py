"""EventSequencer: apply in order, drop the old, report gaps, reset on a new epoch."""

from __future__ import annotations

import pytest

from kvmesh.kvindex import EventSequencer, Gap, Verdict

APPLY, RESET, DROP = Verdict.APPLY, Verdict.RESET, Verdict.DROP


def test_batches_in_order_apply_and_duplicates_drop():
    seq = EventSequencer()
    assert [seq.offer("w0", "e1", n) for n in (0, 1, 2)] == [APPLY, APPLY, APPLY]
    assert [seq.offer("w0", "e1", n) for n in (2, 0, 1)] == [DROP, DROP, DROP]
    assert seq.offer("w0", "e1", 3) == APPLY
    assert seq.expected("w0") == ("e1", 4)


def test_workers_are_sequenced_independently():
    seq = EventSequencer()
    assert seq.offer("w0", "a", 0) == APPLY
    assert seq.offer("w1", "a", 0) == APPLY
    assert seq.offer("w0", "a", 1) == APPLY
    assert seq.expected("w0") == ("a", 2)
    assert seq.expected("w1") == ("a", 1)
    assert seq.expected("w2") is None


def test_a_skipped_batch_is_a_gap_until_the_receiver_resyncs():
    seq = EventSequencer()
    assert seq.offer("w0", "e1", 0) == APPLY
    assert seq.offer("w0", "e1", 3) == Gap("w0", "e1", expected=1, got=3)
    assert seq.offer("w0", "e1", 4) == Gap("w0", "e1", expected=1, got=4)
    # a late batch that fills the hole still applies
    assert seq.offer("w0", "e1", 1) == APPLY
    assert seq.offer("w0", "e1", 5) == Gap("w0", "e1", expected=2, got=5)
    # the snapshot covers every batch before 5
    seq.resynced("w0", "e1", 5)
    assert [seq.offer("w0", "e1", n) for n in (4, 5, 6)] == [DROP, APPLY, APPLY]


def test_a_worker_first_seen_mid_stream_needs_a_resync():
    seq = EventSequencer()
    assert seq.offer("w0", "e1", 7) == Gap("w0", "e1", expected=0, got=7)
    seq.resynced("w0", "e1", 8)
    assert [seq.offer("w0", "e1", n) for n in (7, 8)] == [DROP, APPLY]


def test_a_new_epoch_resets_and_the_old_epoch_is_retired():
    seq = EventSequencer()
    assert [seq.offer("w0", "boot1", n) for n in (0, 1, 2)] == [APPLY, APPLY, APPLY]
    assert seq.offer("w0", "boot2", 0) == RESET  # restarted: drop w0's blocks, then apply
    assert seq.expected("w0") == ("boot2", 1)
    assert seq.offer("w0", "boot1", 3) == DROP  # a late batch from before the restart
    assert seq.offer("w0", "boot2", 1) == APPLY
    # a restart whose first batch was lost
    assert seq.offer("w0", "boot3", 2) == Gap("w0", "boot3", expected=0, got=2)
    assert seq.offer("w0", "boot2", 2) == DROP
    seq.resynced("w0", "boot3", 3)
    assert seq.offer("w0", "boot3", 3) == APPLY


def test_forget_retires_the_epoch_and_a_fresh_start_applies():
    seq = EventSequencer()
    seq.offer("w0", "boot1", 0)
    seq.forget("w0")
    assert seq.expected("w0") is None
    assert seq.offer("w0", "boot1", 1) == DROP
    assert seq.offer("w0", "boot2", 0) == APPLY  # the receiver already dropped w0's blocks
    seq.forget("never-seen")


def test_negative_seq_is_rejected():
    with pytest.raises(ValueError, match="seq must be >= 0"):
        EventSequencer().offer("w0", "e", -1)
