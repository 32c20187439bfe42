"""How a vLLM worker with tensor parallel binds its rank processes: each to its share of the
worker's cores, as ``VLLM_CPU_OMP_THREADS_BIND`` takes them (ranks apart by ``|``)."""

from __future__ import annotations

import pytest

from kvmesh.worker.vllm_engine import rank_cores


@pytest.mark.parametrize(
    "cores, ranks, bind",
    [
        ([0, 1], 1, "0,1"),
        ([0, 1], 2, "0|1"),
        ([0, 1, 2], 2, "0,1|2"),  # no core left idle: the first rank takes the one over
        ([4, 5, 6, 7], 2, "4,5|6,7"),
        ([0], 2, "0|0"),  # fewer cores than ranks: they share
        ([0, 1], 3, "0|1|0"),
    ],
)
def test_each_rank_gets_its_share_of_the_cores(cores: list[int], ranks: int, bind: str) -> None:
    assert rank_cores(cores, ranks) == bind
