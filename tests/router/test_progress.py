"""A request across attempts as the router sees it: min_tokens and a retry's sampling."""

from __future__ import annotations

from kvmesh.engine.tokenizer import Tokenizer
from kvmesh.protocol import SamplingSpec
from kvmesh.services.router.progress import RequestProgress

EOS = (2,)


def test_a_retry_counts_the_tokens_sent_as_generated(tokenizer: Tokenizer) -> None:
    spec = SamplingSpec(max_tokens=10, min_tokens=6, frequency_penalty=0.5)
    progress = RequestProgress("r", tokenizer, spec, EOS, 4)
    assert progress.attempt_sampling() == spec.model_copy(update={"prior_output_tokens": 0})
    progress.add([381, 487, 311])
    retry = progress.attempt_sampling()
    assert (retry.max_tokens, retry.prior_output_tokens, retry.min_tokens) == (7, 3, 6)
    params = retry.to_params()  # valid although min_tokens > max_tokens of this attempt
    assert (params.max_tokens, params.min_tokens, params.prior_output_tokens) == (7, 6, 3)
    assert SamplingSpec.decode(retry.encode()) == retry


def test_stop_strings_wait_for_min_tokens(tokenizer: Tokenizer) -> None:
    river = tokenizer.encode("The river")
    stop = tokenizer.decode(river[-1:]).strip()
    early = RequestProgress("r", tokenizer, SamplingSpec(max_tokens=10, stop=(stop,)), EOS, 4)
    assert early.add(river).finish_reason == "stop"
    held = RequestProgress("r", tokenizer, SamplingSpec(max_tokens=10, stop=(stop,), min_tokens=len(river)), EOS, 4)
    event = held.add(river)
    assert event is not None and not event.finished
