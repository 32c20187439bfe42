"""kvmesh's sampling parameters as vLLM's (``VllmCore.sampling``), in a process of the vLLM
virtualenv, without a model: a prefill for export generates one token, so a request's
``min_tokens`` above 1 must be capped there (vLLM refuses ``min_tokens > max_tokens``; every
forced-length request failed at a vLLM prefill worker before), and the decode side counts
the token the export made."""

from __future__ import annotations

import json

import pytest

from tests.worker.vllm_venv import run_in_vllm_venv

pytestmark = pytest.mark.vllm

SCRIPT = """
import json, types
from vllm.sampling_params import RequestOutputKind
from kvmesh.engine.request import SamplingParams
from kvmesh.worker.vllm_core import VllmCore

core = types.SimpleNamespace(_delta=RequestOutputKind.DELTA)
p = SamplingParams(max_tokens=16, min_tokens=16, ignore_eos=True)
export = VllmCore.sampling(core, p, max_tokens=1, transfer={"export": "r"})
imported = VllmCore.sampling(core, p, max_tokens=p.max_tokens - 1, generated=1)
plain = VllmCore.sampling(core, SamplingParams(max_tokens=8, min_tokens=3))
print(json.dumps({k: [s.max_tokens, s.min_tokens] for k, s in (("export", export), ("import", imported), ("plain", plain))}))
"""


def test_min_tokens_is_capped_for_the_one_token_of_an_export():
    done = run_in_vllm_venv(["-c", SCRIPT])
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got == {"export": [1, 1], "import": [15, 15], "plain": [8, 3]}


# -- vLLM's logprobs as kvmesh's (``kvmesh.worker.vllm_outputs``), without vLLM ------------------
class _Logprob:
    """vLLM's ``Logprob``: the fields the conversion reads."""

    def __init__(self, logprob: float, rank: int | None) -> None:
        self.logprob, self.rank = logprob, rank


def _entry(sampled: tuple[int, float, int], tops: list[tuple[int, float]]) -> dict:
    """vLLM's dict for one position, built as ``append_logprobs_for_next_position`` does: the
    sampled token first with its rank, then the top k by place (a repeat overwrites)."""
    token, value, rank = sampled
    entry = {token: _Logprob(value, rank)}
    for place, (t, v) in enumerate(tops, start=1):
        entry[t] = _Logprob(v, place)
    return entry


def test_a_sampled_token_outside_the_top_k_keeps_the_top_k_in_rank_order() -> None:
    from kvmesh.engine.request import TokenLogprob
    from kvmesh.worker.vllm_outputs import token_logprob

    entry = _entry((7, -3.5, 9), [(1, -0.1), (2, -0.5), (3, -1.25)])
    assert token_logprob(entry, 7, 3) == TokenLogprob(7, -3.5, ((1, -0.1), (2, -0.5), (3, -1.25)))
    assert token_logprob(entry, 7, 0) == TokenLogprob(7, -3.5, ())


def test_a_sampled_token_among_the_top_k_takes_its_place_there() -> None:
    from kvmesh.engine.request import TokenLogprob
    from kvmesh.worker.vllm_outputs import token_logprob

    entry = _entry((2, -0.5, 2), [(1, -0.1), (2, -0.5), (3, -1.25)])  # inserted first, ranked second
    assert list(entry) == [2, 1, 3]
    assert token_logprob(entry, 2, 3) == TokenLogprob(2, -0.5, ((1, -0.1), (2, -0.5), (3, -1.25)))
    greedy = _entry((1, -0.1, 1), [(1, -0.1), (2, -0.5)])
    assert token_logprob(greedy, 1, 2) == TokenLogprob(1, -0.1, ((1, -0.1), (2, -0.5)))


def test_minus_infinity_crosses_json_as_the_floor_and_counts_must_match() -> None:
    from kvmesh.engine.logprobs import LOGPROB_FLOOR
    from kvmesh.worker.vllm_outputs import logprobs_of, prompt_logprobs_of

    masked = _entry((5, 0.0, 1), [(5, 0.0), (0, float("-inf"))])  # a grammar left one token
    (got,) = logprobs_of([masked], [5], 2)
    assert got is not None and got.top == ((5, 0.0), (0, LOGPROB_FLOOR))
    with pytest.raises(ValueError, match="2 tokens"):
        logprobs_of([masked], [5, 6], 2)
    prompt = prompt_logprobs_of([None, _entry((9, -2.0, 4), [(3, -0.2)])], [1, 9], 1)
    assert prompt[0] is None and prompt[1] is not None and (prompt[1].token_id, prompt[1].logprob, prompt[1].top) == (9, -2.0, ((3, -0.2),))
    with pytest.raises(ValueError, match="3 prompt tokens"):
        prompt_logprobs_of([None], [1, 2, 3], 1)
