"""vLLM's own statistics in kvmesh's worker metrics (``--engine vllm``).

vLLM's ``LLMEngine`` computes, at every step it runs with ``log_stats`` on, a
``SchedulerStats`` and an ``IterationStats`` (``vllm.v1.metrics.stats``) and hands them to
its stat loggers (``vllm.v1.metrics.loggers.StatLoggerManager.record``). kvmesh passes it
one logger of its own, ``KvmeshStatLogger`` (``stat_logger_class``), and drops vLLM's
default ones (its log lines and its Prometheus registry, which nothing here serves). What
kvmesh's own engine tells its step observer and vLLM's outputs do not, this takes from those
stats (``VllmStats.record``, on the engine thread, inside ``LLMEngine.step``):

- preemptions: ``IterationStats.num_preempted_reqs``, summed into ``num_preemptions``, the
  engine's total that ``AsyncEngine`` hands to the observer after each step;
- queue, prefill and decode time: each ``FinishedRequestStats`` (``queued_time``,
  ``prefill_time``, ``decode_time``: vLLM's engine-core timestamps of the request's QUEUED,
  first SCHEDULED, first and last token), given to the observer's ``engine_phases`` when
  vLLM finishes the request, as vLLM observes its own ``vllm:request_*_time_seconds``.
  A request vLLM failed (``ERROR``) is left out, as kvmesh's engine leaves it out.

The rest of the worker's metrics come from vLLM's outputs and pool as with kvmesh's engine
(docs/metrics.md says which and why).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

logger = logging.getLogger(__name__)

ERROR = 3  # vllm.v1.engine.FinishReason.ERROR (an IntEnum)


@dataclass(slots=True, frozen=True)
class RequestPhases:
    """A finished request's phases as vLLM timed them, in seconds."""

    queue_seconds: float  # QUEUED to the first SCHEDULED
    prefill_seconds: float  # first SCHEDULED to the first token
    decode_seconds: float  # first token to the last


@runtime_checkable
class PhaseObserver(Protocol):
    """A step observer that takes request phases from the engine (``WorkerMetrics``)."""

    def phases_from_engine(self) -> None:
        """From now on the engine reports queue / prefill / decode times (``engine_phases``):
        the observer stops timing them itself."""
        ...

    def engine_phases(self, phases: RequestPhases) -> None: ...


def phases_of(finished: Any) -> RequestPhases | None:
    """kvmesh's phases of a ``FinishedRequestStats``; None for a request vLLM failed."""
    if int(finished.finish_reason) == ERROR:
        return None
    return RequestPhases(
        max(0.0, float(finished.queued_time)), max(0.0, float(finished.prefill_time)), max(0.0, float(finished.decode_time))
    )


class VllmStats:
    """What vLLM's stats add to a worker's metrics, kept on the engine thread."""

    def __init__(self) -> None:
        self.num_preemptions = 0  # vLLM's total, as kvmesh's engine counts its own
        self.observer: PhaseObserver | None = None
        self.enabled = False  # the engine records into this (``keep_only_ours``)

    def observe(self, observer: object) -> None:
        """Hand request phases to ``observer`` from now on (if it takes them and vLLM
        keeps stats)."""
        if self.enabled and isinstance(observer, PhaseObserver):
            observer.phases_from_engine()
            self.observer = observer

    def record(self, scheduler_stats: Any, iteration_stats: Any) -> None:
        """One step's stats (``StatLoggerBase.record``'s arguments)."""
        if iteration_stats is None:
            return
        self.num_preemptions += int(iteration_stats.num_preempted_reqs)
        observer = self.observer
        if observer is None:
            return
        for finished in iteration_stats.finished_requests:
            phases = phases_of(finished)
            if phases is not None:
                observer.engine_phases(phases)

    def stat_logger_class(self) -> type:
        """A vLLM stat logger (an ``AggregateStatLoggerBase``, made once per ``LLMEngine``)
        that records into this object; for ``LLMEngine.from_engine_args(stat_loggers=[...])``."""
        from vllm.v1.metrics.loggers import AggregateStatLoggerBase  # type: ignore[import-not-found]

        stats = self

        class KvmeshStatLogger(AggregateStatLoggerBase):  # type: ignore[misc]
            def __init__(self, vllm_config: Any, engine_indexes: list[int] | None = None) -> None:
                self.stats = stats

            def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None, engine_idx: int = 0) -> None:
                try:
                    stats.record(scheduler_stats, iteration_stats)
                except Exception:  # noqa: BLE001 - metrics never stop the engine
                    logger.exception("recording vLLM's stats failed")

            def log_engine_initialized(self) -> None:
                pass

        return KvmeshStatLogger

    def keep_only_ours(self, engine: Any) -> bool:
        """Drop the engine's stat loggers but ours (vLLM's log lines every few seconds and
        its Prometheus registry, served by nobody here); False when the engine keeps no
        stats (``disable_log_stats`` in ``--engine-args``)."""
        manager = getattr(engine, "logger_manager", None)
        if manager is None:
            logger.warning(
                "vLLM's stats are off (disable_log_stats): preemptions and queue / prefill / decode times are not reported"
            )
            return False
        ours = [s for s in manager.stat_loggers if getattr(s, "stats", None) is self]
        if not ours:  # another vLLM's manager: its own loggers stay, the worker times phases itself
            logger.warning(
                "vLLM's stat loggers do not include kvmesh's: preemptions and queue / prefill / decode times are not reported"
            )
            return False
        manager.stat_loggers = ours
        self.enabled = True
        return True
