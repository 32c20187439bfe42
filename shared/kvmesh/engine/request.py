"""A request inside the engine: its tokens, sampling parameters and progress."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from typing import TYPE_CHECKING, Any

from kvmesh.engine.structured import GuidedDecoding
from kvmesh.hashing import BlockHash

if TYPE_CHECKING:
    import torch

# Below this a temperature means greedy (vLLM's ``_SAMPLING_EPS``).
SAMPLING_EPS = 1e-5
PENALTY_RANGE = (-2.0, 2.0)  # presence and frequency penalties, OpenAI's range
LOGIT_BIAS_RANGE = (-100.0, 100.0)  # a bias outside is clamped to it, as OpenAI and vLLM do
MAX_LOGPROBS = 20  # top logprobs per token, OpenAI's limit (vLLM's default max_logprobs)
SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed takes


class FinishReason(str, enum.Enum):
    STOP = "stop"  # eos, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the model's context
    ABORT = "abort"
    ERROR = "error"  # the engine failed this request; ``RequestOutput.error`` says why


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, frozen=True)
class TokenLogprob:
    """A token's log-probability under the model's raw next-token distribution (before any
    logits processing or temperature: vLLM's default ``raw_logprobs``), and the ``top`` most
    likely tokens' (id, logprob), most likely first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


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
    # Logits processing (``kvmesh.engine.logits_processors``); the defaults leave logits as they are.
    presence_penalty: float = 0.0  # OpenAI: minus this for each token already generated
    frequency_penalty: float = 0.0  # OpenAI: minus this times how often it was generated
    repetition_penalty: float = 1.0  # HF / vLLM: prompt and generated tokens' logits / (or *) this
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    min_p: float = 0.0  # drop tokens less likely than min_p x the most likely one
    min_tokens: int = 0  # no EOS or stop token id before this many generated tokens
    # A request resumed on another worker: the prompt's last this-many tokens were generated
    # before, and the penalties and min_tokens count them as generated.
    prior_output_tokens: int = 0
    # Logprobs (``kvmesh.engine.logprobs``): None, none; k, each sampled token's and its top k.
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # the same for every prompt token after the first
    # Structured output: the grammar the output must match (``kvmesh.engine.structured``).
    guided: GuidedDecoding | None = None

    def __post_init__(self) -> None:
        if isinstance(self.guided, dict):  # from the wire (``SamplingSpec.to_params``)
            self.guided = GuidedDecoding(**self.guided)
        self.stop = tuple(self.stop)
        self.stop_token_ids = tuple(self.stop_token_ids)
        low, high = LOGIT_BIAS_RANGE
        self.logit_bias = {int(t): min(max(float(b), low), high) for t, b in self.logit_bias.items()}
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not PENALTY_RANGE[0] <= value <= PENALTY_RANGE[1]:
                raise ValueError(f"{name} must be in [{PENALTY_RANGE[0]:g}, {PENALTY_RANGE[1]:g}], got {value}")
        if not self.repetition_penalty > 0 or self.repetition_penalty == float("inf"):
            raise ValueError(f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty}")
        if any(t < 0 for t in self.logit_bias) or any(b != b for b in self.logit_bias.values()):
            raise ValueError("logit_bias maps token ids >= 0 to numbers")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.prior_output_tokens < 0:
            raise ValueError(f"prior_output_tokens must be >= 0, got {self.prior_output_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}], got {value}")
        if not 0 <= self.min_tokens <= self.max_tokens + self.prior_output_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")
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
        if self.seed is not None and not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]:
            raise ValueError(f"seed must be in [{SEED_RANGE[0]}, {SEED_RANGE[1]}], got {self.seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS or self.top_k == 1

    @property
    def processes_logits(self) -> bool:
        """Whether anything before sampling changes this request's logits (its row is then
        processed; the plain path skips it)."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
            or self.min_tokens
        )


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
    # A retry (its first worker died, or was too busy): queued first. Admitted without the
    # growth reserve holding it back only where its client is mid-answer (``mid_answer``).
    resumed: bool = False
    # With ``sampling.logprobs``: one per output token (None where it came from elsewhere, as
    # an import's first token); with ``sampling.prompt_logprobs``: one per prompt token, the
    # first None. ``TokenLogprob``s of ``kvmesh.engine.logprobs``.
    logprobs: list[TokenLogprob | None] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=list)
    prompt_logprobs_sent: bool = False
    # A guided request's ``kvmesh.engine.structured.GrammarState`` (set by the engine).
    grammar: Any = None

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError("the prompt must have at least one token")
        if self.sampling.prior_output_tokens >= len(self.prompt_token_ids):
            raise ValueError("prior_output_tokens must be fewer than the prompt's tokens")
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)
        if self.sampling.seed is not None:
            import torch  # here, so that the protocol (which imports SamplingParams) does not load it

            self.generator = torch.Generator().manual_seed(self.sampling.seed)

    @property
    def mid_answer(self) -> bool:
        """A retry whose client already has part of its answer (the prompt ends with the
        tokens an earlier attempt sent): it only needs the blocks, never waits for the
        reserve. A retry that had sent nothing yet (a worker too busy) waits like new work."""
        return self.resumed and self.sampling.prior_output_tokens > 0

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
    def generated_token_ids(self) -> list[int]:
        """What the penalties and min_tokens count as generated: the output, after the
        prompt's tail that an earlier attempt generated (``prior_output_tokens``)."""
        return self.token_ids[self.num_prompt_tokens - self.sampling.prior_output_tokens :]

    @property
    def num_generated_tokens(self) -> int:
        return self.num_output_tokens + self.sampling.prior_output_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED
