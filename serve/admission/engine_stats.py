"""Engine-side signals for the autotuner, fed in-process by a vLLM stat logger.

vLLM calls every stat logger's ``record(scheduler_stats, iteration_stats)`` after each engine
step, in the API process (``vllm/v1/metrics/loggers.py``). :class:`EngineStatsFeed` keeps what
the controller needs: the scheduler's running/waiting counts and KV-cache usage, preemptions,
and TTFT/ITL samples in a sliding window. No HTTP scrape, no parsing.
"""

from __future__ import annotations

import collections
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile ``q`` (0-100) of ``values``, None when empty (the one
    implementation: the autotuner's window, the simulator and the benchmarks use it)."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(1, math.ceil(q / 100 * len(ordered))) - 1]


class SlidingWindow:
    """Samples of the last ``window_s`` seconds, with percentiles.

    Args:
        window_s: age in seconds after which a sample is dropped.
        clock: monotonic clock, seconds.
        max_samples: memory bound; the oldest samples go first.
    """

    def __init__(self, window_s: float, clock: Callable[[], float] = time.monotonic,
                 max_samples: int = 20_000) -> None:
        self.window_s = window_s
        self._clock = clock
        self._samples: collections.deque[tuple[float, float]] = collections.deque(
            maxlen=max_samples)

    def add(self, value: float) -> None:
        self._samples.append((self._clock(), value))

    def extend(self, values) -> None:
        now = self._clock()
        self._samples.extend((now, v) for v in values)

    def _prune(self) -> None:
        cutoff = self._clock() - self.window_s
        while self._samples and self._samples[0][0] < cutoff:
            self._samples.popleft()

    def __len__(self) -> int:
        self._prune()
        return len(self._samples)

    def percentile(self, q: float) -> float | None:
        """Nearest-rank percentile ``q`` (0-100) of the window, None when empty."""
        self._prune()
        return percentile([v for _, v in self._samples], q)


def stalled_s(now: float, last_step_s: float | None, busy_since_s: float | None) -> float:
    """Seconds the engine has held requests without running a step: since the later of its
    last step and the moment work arrived (0 when it holds none)."""
    if busy_since_s is None:
        return 0.0
    return now - max(busy_since_s, last_step_s or busy_since_s)


@dataclass
class EngineStatsFeed:
    """What the last engine steps reported (written by the stat logger, read by the loop)."""

    window_s: float = 30.0
    clock: Callable[[], float] = time.monotonic
    running: int = 0
    waiting: int = 0
    kv_cache_usage: float = 0.0
    preemptions_total: int = 0
    #: Clock time of the last engine step reported (None: none yet).
    last_step_s: float | None = None
    ttft: SlidingWindow = field(init=False)
    itl: SlidingWindow = field(init=False)

    def __post_init__(self) -> None:
        self.ttft = SlidingWindow(self.window_s, self.clock)
        self.itl = SlidingWindow(self.window_s, self.clock)

    def record(self, scheduler_stats, iteration_stats) -> None:
        """Absorb one engine step (vLLM ``SchedulerStats`` / ``IterationStats`` or None)."""
        self.last_step_s = self.clock()
        if scheduler_stats is not None:
            self.running = scheduler_stats.num_running_reqs
            self.waiting = scheduler_stats.num_waiting_reqs
            self.kv_cache_usage = scheduler_stats.kv_cache_usage
        if iteration_stats is not None:
            self.preemptions_total += iteration_stats.num_preempted_reqs
            self.ttft.extend(iteration_stats.time_to_first_tokens_iter)
            self.itl.extend(iteration_stats.inter_token_latencies_iter)


def stat_logger_factory(feed: EngineStatsFeed):
    """A vLLM ``StatLoggerFactory`` whose loggers write into ``feed``.

    Imports vLLM, so call it only after :func:`serve.engine.apply_engine_env`.
    """
    from vllm.v1.metrics.loggers import StatLoggerBase

    class FeedStatLogger(StatLoggerBase):
        def __init__(self, vllm_config, engine_index: int = 0) -> None:
            self.feed = feed

        def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None,
                   engine_idx: int = 0) -> None:
            self.feed.record(scheduler_stats, iteration_stats)

        def log_engine_initialized(self) -> None:
            pass

    return FeedStatLogger
