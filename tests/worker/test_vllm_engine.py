"""The vLLM engine behind the interface, in a process of the vLLM virtualenv: export,
import and release through kvmesh's KV connector give a plain run's greedy tokens and
leave the pool as it was (``vllm_engine_story.py``)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from tests.worker.vllm_venv import run_in_vllm_venv

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_export_import_and_release_through_the_connector(default_model_dir):
    done = run_in_vllm_venv([str(Path(__file__).with_name("vllm_engine_story.py")), str(default_model_dir)], timeout=600)
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["export"] == {"first": seen["plain"][:1], "blocks": 3, "tokens": 70}
    assert seen["released"] == [True, False]  # a second release of one export is a no-op
    assert seen["imported"] == seen["plain"]  # the first token from the export, the rest from the imported KV
    assert seen["blocks_copied"] == 1  # the two whole blocks used where they were pulled, the part block copied
    assert seen["release_unused"] == [True, True, False]
    # an import of a prompt vLLM had wholly cached: the blocks taken for it go back
    assert seen["fully_cached_import"] == {"same_tokens": True, "free_back": True}
    # lent: referenced in vLLM's pool, kept as they were under other work and a cache reset,
    # released once; borrowed into a prefill through the connector: the plain run's first token
    assert seen["lend_and_borrow"] == {
        "cached": 2, "lent": {"blocks": 2, "in_use": 2, "held": 2}, "reset_refused": True, "unchanged": True,
        "released": [True, False], "cached_after_eviction": 0,
        "borrowed_prefill": {"first": True, "cached_tokens": 64, "copied": 0}, "taken": True,  # used where pulled
        "again": {"same": True, "cached_tokens": 64},  # vLLM cached the borrowed blocks as its own
        "unused_given_back": True, "free_back": True,
    }  # fmt: skip
    # a borrowed prefix after vLLM's own first block: used in place after it, nothing copied
    assert seen["borrow_after_own_prefix"] == {
        "own_blocks": 1, "first": True, "cached_tokens": 96, "copied": 0, "taken": True, "free_back": True,
    }  # fmt: skip
    none_left = {"exports": 0, "to_release": 0, "vllm_requests": 0}
    # an export aborted mid-prefill (a cancel) gives its blocks back
    assert seen["abort_mid_prefill"] == {"computed": 32, "reason": "abort", "free_back": True, "leftovers": none_left}
    # A finished before B, a step of B's saw it; B released, then A with no other traffic:
    # both free their blocks and the engine thread goes idle
    assert seen["release_idle"] == {
        "finished": ["A", "B"], "released": [True, True], "free_back": True, "steps_while_idle": 0, "leftovers": none_left,
        "steps_after_a_gone_release": 0,  # dropped, rather than stepped for forever
    }  # fmt: skip
    guided = seen["guided"]
    assert re.fullmatch(r"[a-z]{3}-[0-9]{4}", guided["text"]), guided
    assert {k: guided[k] for k in ("logprobs", "imported", "import_logprobs", "resumed", "free_back")} == {
        "logprobs": True, "imported": True, "import_logprobs": [[None], True], "resumed": True, "free_back": True,
    }  # fmt: skip
    # a first token the grammar does not allow: the import fails by name, after that token alone
    assert guided["refused"] == {"reason": "error", "code": "request_failed", "tokens": [guided["digit"]]}
    # cores lent as kvmesh's engine lends them, between steps: every core while the other
    # engine on the board is idle, one thread while it is busy (a machine of one core: one)
    cores = len(os.sched_getaffinity(0))
    assert seen["lending"] == {
        "borrowed_so_far": cores > 1, "threads_while_other_busy": 1, "threads_while_other_idle": cores, "same_tokens": True,
    }  # fmt: skip
    assert (seen["free_at_end"], seen["in_use_at_end"]) == (seen["free_at_start"], 0)
