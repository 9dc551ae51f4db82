"""Engine-side signals for the autotuner, fed in-process by a vLLM stat logger.

vLLM calls every stat logger's ``record(scheduler_stats, iteration_stats)`` after each engine
step, in the API process (``vllm/v1/metrics/loggers.py``). :class:`EngineStatsFeed` keeps what
the controller needs: the scheduler's running/waiting counts and KV-cache usage, preemptions,
and TTFT/TPOT samples in a sliding window, and the steps' inter-token latency against their
batch size (:class:`BatchItlFit`). No HTTP scrape, no parsing.
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

    Samples are kept per batch (one engine step's TTFTs or ITLs, stamped once), so absorbing
    a step costs one append whatever the batch size: it runs after every engine step, on the
    event loop that also streams the answers.

    Args:
        window_s: age in seconds after which a sample is dropped.
        clock: monotonic clock, seconds.
        max_samples: memory bound; the oldest batches go first.
    """

    def __init__(self, window_s: float, clock: Callable[[], float] = time.monotonic,
                 max_samples: int = 20_000) -> None:
        self.window_s = window_s
        self._clock = clock
        self.max_samples = max_samples
        self._batches: collections.deque[tuple[float, tuple[float, ...]]] = collections.deque()
        self._count = 0

    def add(self, value: float) -> None:
        self.extend((value,))

    def extend(self, values) -> None:
        batch = tuple(values)
        if not batch:
            return
        self._batches.append((self._clock(), batch))
        self._count += len(batch)
        while self._count > self.max_samples and len(self._batches) > 1:
            self._count -= len(self._batches.popleft()[1])

    def clear(self) -> None:
        """Drop every sample (the autotuner's cut: what follows must be measured afresh)."""
        self._batches.clear()
        self._count = 0

    def _prune(self) -> None:
        cutoff = self._clock() - self.window_s
        while self._batches and self._batches[0][0] < cutoff:
            self._count -= len(self._batches.popleft()[1])

    def __len__(self) -> int:
        self._prune()
        return self._count

    def percentile(self, q: float) -> float | None:
        """Nearest-rank percentile ``q`` (0-100) of the window, None when empty."""
        self._prune()
        return percentile([v for _, batch in self._batches for v in batch], q)


#: Seconds of engine steps the batch/ITL line is fitted over: several busy periods (the CPU
#: suite's phases are 10-20 s), so that it sees more than one batch size, and short enough
#: that a change of traffic (text to images) shows within a couple of minutes.
BATCH_ITL_HORIZON_S = 120.0
#: Width of the time slots steps are aggregated in, seconds (per slot, one sum per batch
#: size: the fit reads a few hundred aggregates, never every step).
BATCH_ITL_SLOT_S = 1.0
#: Fewest inter-token samples (tokens) a fit needs.
BATCH_ITL_MIN_TOKENS = 200
#: Smallest weighted variance of the batch size (requests^2) a fit needs: batches that all
#: had one size say nothing about the slope.
BATCH_ITL_MIN_VARIANCE = 1.0


class BatchItlFit:
    """Mean inter-token latency of the engine's steps against their batch size: the least
    squares line ``itl(n) = intercept + slope x n`` (seconds; ``n`` in requests) over the
    last :data:`BATCH_ITL_HORIZON_S` seconds, each token's gap weighted once.

    On a compute-bound engine (the CPU: decode cost grows with every sequence) the slope is
    what a batch costs each stream; the intercept holds the fixed step cost and the prefill
    chunks of the current traffic mixed into the steps. On a memory-bound GPU the slope is
    small and the line allows large batches. The autotuner reads it as the largest batch
    whose streams keep the inter-token target
    (:meth:`serve.admission.controller.Controller.itl_fit`).

    Args:
        horizon_s: age in seconds after which steps are dropped.
        slot_s: aggregation slot, seconds.
        clock: monotonic clock, seconds.
    """

    def __init__(self, horizon_s: float = BATCH_ITL_HORIZON_S, slot_s: float = BATCH_ITL_SLOT_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.horizon_s = horizon_s
        self.slot_s = slot_s
        self._clock = clock
        #: (slot start, {batch size: [sum of gaps in seconds, gaps]}), oldest first.
        self._slots: collections.deque[tuple[float, dict[int, list]]] = collections.deque()

    def add(self, batch: int, itls) -> None:
        """One engine step: ``batch`` requests ran, and ``itls`` are the gaps (seconds) of
        those that produced a token after their first."""
        if batch <= 0 or not itls:
            return
        now = self._clock()
        if not self._slots or now - self._slots[-1][0] >= self.slot_s:
            self._slots.append((now, {}))
            while now - self._slots[0][0] > self.horizon_s:
                self._slots.popleft()
        agg = self._slots[-1][1].setdefault(batch, [0.0, 0])
        agg[0] += sum(itls)
        agg[1] += len(itls)

    def clear(self) -> None:
        self._slots.clear()

    def line(self) -> tuple[float, float] | None:
        """``(intercept_s, slope_s)`` of the weighted least-squares line, or None with fewer
        than :data:`BATCH_ITL_MIN_TOKENS` gaps or batch sizes whose weighted variance is
        under :data:`BATCH_ITL_MIN_VARIANCE`."""
        now = self._clock()
        w = sn = sy = snn = sny = 0.0
        for start, batches in self._slots:
            if now - start > self.horizon_s:
                continue
            for n, (total, count) in batches.items():
                w += count
                sn += count * n
                sy += total
                snn += count * n * n
                sny += total * n
        if w < BATCH_ITL_MIN_TOKENS:
            return None
        mean_n = sn / w
        var_n = snn / w - mean_n * mean_n
        if var_n < BATCH_ITL_MIN_VARIANCE:
            return None
        slope = (sny / w - mean_n * sy / w) / var_n
        return sy / w - slope * mean_n, slope


def stalled_s(now: float, last_step_s: float | None, busy_since_s: float | None) -> float:
    """Seconds the engine has held requests without running a step: since the later of its
    last step and the moment work arrived (0 when it holds none)."""
    if busy_since_s is None:
        return 0.0
    return now - max(busy_since_s, last_step_s or busy_since_s)


#: Finished requests whose size the feed averages (requests): enough for a stable mean of a
#: mixed workload, few enough that a change of traffic shows within a couple of bursts.
REQUEST_TOKENS_SAMPLES = 128


#: Seconds within which requests count as one burst (arrived together at an idle engine).
BURST_ARRIVAL_S = 0.25
#: Fewest requests of a burst whose prefill makes a throughput measurement.
BURST_MIN_REQUESTS = 4
#: Seconds a prefill-rate measurement stays valid: a low one (which would keep bursts below
#: BURST_MIN_REQUESTS) must not pin the idle limit forever.
PREFILL_RATE_TTL_S = 600.0


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
    #: Per-request mean inter-token latency (TPOT, vLLM's ``mean_time_per_output_token``)
    #: of the requests that finished with at least two tokens. The goodput rule
    #: (``serve.admission.goodput``, DistServe's) judges a request by this mean, not by its
    #: single token gaps: on the CPU engine every image encode (~0.3 s) stalls every stream
    #: once, which put the p90 of the gaps over a 50-ms target at 16-32 requests while the
    #: requests' own means stayed within it.
    tpot: SlidingWindow = field(init=False)
    #: KV footprint (prompt + generated tokens) of the last finished requests.
    request_tokens: collections.deque = field(init=False)
    #: Prompt tokens of the last finished requests.
    prompt_tokens: collections.deque = field(init=False)
    #: Mean inter-token latency against the batch size (:class:`BatchItlFit`).
    batch_itl: BatchItlFit = field(init=False)
    #: Called with the new rate each time a burst measures the prefill rate (the autotune
    #: loop sets the limiter's burst budget from it, within the burst that measured it).
    on_prefill_rate: Callable[[float], None] | None = None
    _prefill_rate: float | None = field(default=None, init=False)
    _prefill_rate_s: float = field(default=0.0, init=False)
    _burst_start_s: float | None = field(default=None, init=False)
    _burst_tokens: int = field(default=0, init=False)
    _burst_open: bool = field(default=False, init=False)
    _burst_count: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        self.ttft = SlidingWindow(self.window_s, self.clock)
        self.tpot = SlidingWindow(self.window_s, self.clock)
        self.request_tokens = collections.deque(maxlen=REQUEST_TOKENS_SAMPLES)
        self.prompt_tokens = collections.deque(maxlen=REQUEST_TOKENS_SAMPLES)
        self.batch_itl = BatchItlFit(clock=self.clock)

    @property
    def mean_request_tokens(self) -> float | None:
        """Mean tokens (prompt + generated) of the last :data:`REQUEST_TOKENS_SAMPLES`
        finished requests: what one request of the current traffic holds in the KV cache at
        its end. None before the first request finishes."""
        if not self.request_tokens:
            return None
        return sum(self.request_tokens) / len(self.request_tokens)

    @property
    def mean_prompt_tokens(self) -> float | None:
        """Mean prompt tokens (image tokens included) of the last finished requests."""
        if not self.prompt_tokens:
            return None
        return sum(self.prompt_tokens) / len(self.prompt_tokens)

    @property
    def prefill_tokens_per_s(self) -> float | None:
        """Prompt tokens/s the engine prefilled in the last burst (:meth:`_burst_prefill`),
        None before one or when older than :data:`PREFILL_RATE_TTL_S`."""
        if self._prefill_rate is None or self.clock() - self._prefill_rate_s > \
                PREFILL_RATE_TTL_S:
            return None
        return self._prefill_rate

    def _burst_prefill(self, now: float, idle_before: bool, iteration_stats) -> None:
        """Measure the prefill throughput on a burst: requests that reach an idle engine
        together (within :data:`BURST_ARRIVAL_S`) are prefilled back to back, so the prompt
        tokens completed divided by the latest of their TTFTs (counted from their arrival
        at the engine) is the engine's prefill rate, image encoding included. The
        measurement stops at the first completion of a request that arrived later; it is
        kept when it covered at least :data:`BURST_MIN_REQUESTS` requests.
        """
        if idle_before:
            self._burst_start_s, self._burst_tokens, self._burst_open = None, 0, True
            self._burst_count = 0
        ttfts = iteration_stats.time_to_first_tokens_iter
        if not self._burst_open or not ttfts:
            return
        arrivals = [now - t for t in ttfts]
        if self._burst_start_s is None:
            self._burst_start_s = min(arrivals)
        if max(arrivals) - self._burst_start_s > BURST_ARRIVAL_S:
            self._burst_open = False
            return
        self._burst_tokens += iteration_stats.num_prompt_tokens
        self._burst_count += len(ttfts)
        # The latest arrival's TTFT: the time the engine took for the whole group once the
        # last of it was there (the arrivals' own spread is not prefill time).
        elapsed = min(ttfts)
        if self._burst_count >= BURST_MIN_REQUESTS and elapsed > 0:
            self._prefill_rate, self._prefill_rate_s = self._burst_tokens / elapsed, now
            if self.on_prefill_rate is not None:
                self.on_prefill_rate(self._prefill_rate)

    def record(self, scheduler_stats, iteration_stats) -> None:
        """Absorb one engine step (vLLM ``SchedulerStats`` / ``IterationStats`` or None)."""
        now = self.last_step_s = self.clock()
        idle_before = self.running == 0 and self.waiting == 0
        if scheduler_stats is not None:
            self.running = scheduler_stats.num_running_reqs
            self.waiting = scheduler_stats.num_waiting_reqs
            self.kv_cache_usage = scheduler_stats.kv_cache_usage
        if iteration_stats is not None:
            self._burst_prefill(now, idle_before, iteration_stats)
            self.preemptions_total += iteration_stats.num_preempted_reqs
            self.ttft.extend(iteration_stats.time_to_first_tokens_iter)
            finished = iteration_stats.finished_requests
            if scheduler_stats is not None:
                # The step's batch: what runs after it, plus what it finished.
                self.batch_itl.add(scheduler_stats.num_running_reqs + len(finished),
                                   iteration_stats.inter_token_latencies_iter)
            if finished:
                self.tpot.extend(done.mean_time_per_output_token for done in finished
                                 if done.num_generation_tokens > 1)
            for done in finished:
                self.request_tokens.append(done.num_prompt_tokens + done.num_generation_tokens)
                self.prompt_tokens.append(done.num_prompt_tokens)


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
