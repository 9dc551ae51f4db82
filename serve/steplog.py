"""What vLLM reports of each engine step, kept for the benchmarks' engine calibration.

vLLM 0.32 started with ``--enable-logging-iteration-details`` attaches to each engine step's
``SchedulerStats`` a ``SchedulerIterationDetails``: the step's prefill ("context") requests
and tokens, decode ("generation") requests and tokens, the image embeddings it encoded, and
``elapsed_ms``, the engine core's time from the model's submitted batch to its sampled tokens
(``vllm/v1/engine/core.py``, ``capture_iteration_details``). A :class:`StepLog` keeps those
records, stamped with this process's clock when they arrive, for ``GET /admin/bench/steps``
(``--bench-admin`` only; a stat logger of
:func:`serve.admission.engine_stats.stat_logger_factory` feeds it), which ``python -m
bench.calibrate`` reads to fit the simulator's step-time constants. Without vLLM's flag the
stats carry no details and the log stays empty; without ``--bench-admin`` no log is installed
at all (nothing runs per step)."""

from __future__ import annotations

import collections
import time
from collections.abc import Callable

#: Steps kept between two reads (a calibration reads after each ~30-s replay; the CPU engine
#: runs at most ~100 steps/s, so this holds over 8 minutes of steps).
MAX_STEPS = 50_000


class StepLog:
    """The engine steps' details since the last :meth:`drain`, oldest first.

    Args:
        clock: monotonic clock, seconds (the arrival stamp of each record).
        max_steps: bound on the records held; the oldest go first and are counted as dropped.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic,
                 max_steps: int = MAX_STEPS) -> None:
        self._clock = clock
        self._steps: collections.deque[dict] = collections.deque(maxlen=max_steps)
        self.dropped = 0

    def record(self, scheduler_stats, iteration_stats=None) -> None:
        """Keep one step's details (vLLM ``SchedulerStats`` or None; a step without
        details, or a data-parallel dummy step, is skipped). ``iteration_stats`` is not
        read (the stat loggers' signature: :func:`serve.admission.engine_stats.
        stat_logger_factory` feeds this log)."""
        details = getattr(scheduler_stats, "iteration_details", None)
        if details is None or details.is_dummy:
            return
        if len(self._steps) == self._steps.maxlen:
            self.dropped += 1
        self._steps.append({
            "t_s": self._clock(),
            "prefill_requests": details.num_ctx_requests,
            "prefill_tokens": details.num_ctx_tokens,
            "decode_requests": details.num_generation_requests,
            "decode_tokens": details.num_generation_tokens,
            "encoder_tokens": details.num_encoder_output_tokens,
            "elapsed_s": details.elapsed_ms / 1000.0,
            "running": scheduler_stats.num_running_reqs,
            "waiting": scheduler_stats.num_waiting_reqs,
        })

    def drain(self) -> dict:
        """``{"steps": [record, ...], "dropped": n}`` since the last drain; empties the log.
        A record: ``t_s`` (arrival, seconds on this process's monotonic clock), the step's
        ``prefill_requests``/``prefill_tokens``, ``decode_requests``/``decode_tokens``,
        ``encoder_tokens`` (image embeddings encoded), ``elapsed_s`` (vLLM's model time of
        the step, seconds) and the scheduler's ``running``/``waiting`` after it."""
        steps, dropped = list(self._steps), self.dropped
        self._steps.clear()
        self.dropped = 0
        return {"steps": steps, "dropped": dropped}
