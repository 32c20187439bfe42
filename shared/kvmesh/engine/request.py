"""A request inside the engine: its tokens, sampling parameters and progress."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from typing import TYPE_CHECKING

from kvmesh.hashing import BlockHash

if TYPE_CHECKING:
    import torch

# Below this a temperature means greedy (vLLM's ``_SAMPLING_EPS``).
SAMPLING_EPS = 1e-5


class FinishReason(str, enum.Enum):
    STOP = "stop"  # eos, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the model's context
    ABORT = "abort"
    ERROR = "error"  # the engine failed this request; ``RequestOutput.error`` says why


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0  # 0: no top-k
    top_p: float = 1.0
    seed: int | None = None
    max_tokens: int = 16
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        self.stop = tuple(self.stop)
        self.stop_token_ids = tuple(self.stop_token_ids)
        if not self.temperature >= 0:  # NaN too
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must not be empty")

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS or self.top_k == 1


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    # Every token so far: the prompt, then what was generated.
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at first schedule
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    block_hashes: list[BlockHash] = field(default_factory=list)
    generator: torch.Generator | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    first_scheduled_time: float | None = None
    num_preemptions: int = 0
    # Disaggregation: keep the blocks after the first token instead of decoding on.
    export_kv: bool = False

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError("the prompt must have at least one token")
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)
        if self.sampling.seed is not None:
            import torch  # here, so that the protocol (which imports SamplingParams) does not load it

            self.generator = torch.Generator().manual_seed(self.sampling.seed)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED
