"""Engine-side signals for the autotuner, fed in-process by a vLLM stat logger.

vLLM calls every stat logger's ``record(scheduler_stats, iteration_stats)`` after each engine
step, in the API process (``vllm/v1/metrics/loggers.py``). :class:`EngineStatsFeed` keeps what
the controller needs: the scheduler's running/waiting counts and KV-cache usage, preemptions,
and TTFT/TPOT samples in a sliding window, and the finished requests' TPOT against the batch
they decoded in (:class:`BatchTpotFit`). No HTTP scrape, no parsing.
"""

from __future__ import annotations

import bisect
import collections
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple


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


#: Seconds of finished requests the batch/TPOT line is fitted over: several busy periods (the
#: CPU suite's phases are 10-20 s), so that it sees more than one batch size, and short enough
#: that a change of traffic (text to images) shows within a couple of minutes.
BATCH_TPOT_HORIZON_S = 120.0
#: Fewest finished requests a line needs.
BATCH_TPOT_MIN_REQUESTS = 20
#: Smallest variance of the requests' mean batch (requests^2) a line needs: requests that all
#: ran beside the same batch say nothing about the slope.
BATCH_TPOT_MIN_VARIANCE = 1.0
#: Most spacing of the marks of the running-batch integral, seconds (a mark is also set
#: where the batch changes: at most one a step); marks are kept for
#: :data:`BATCH_MARKS_KEEP_S` (a request decoding for longer is averaged over what is kept;
#: ~30k marks at 100 steps/s).
BATCH_MARK_S = 0.1
BATCH_MARKS_KEEP_S = 300.0


class ItlLine(NamedTuple):
    """The finished requests' TPOT against the mean batch they decoded in.

    ``tpot(n) = intercept_s + slope_s x n`` seconds (``n`` in requests), and ``p90_ratio``:
    the 90th percentile of each request's TPOT over the line's value at its own batch (how
    far the slower requests lie above the line; >= 1)."""

    intercept_s: float
    slope_s: float
    p90_ratio: float


class BatchTpotFit:
    """Each finished request's TPOT (its mean inter-token latency, what the goodput rule
    judges it by) against the mean batch it decoded in, and the least-squares line through
    them over the last :data:`BATCH_TPOT_HORIZON_S` seconds (:meth:`line`).

    The mean batch comes from the integral of the running batch over time, advanced at every
    engine step (:meth:`advance`): over the request's decode time (first to last token) it
    is what the request's tokens were computed beside. On a compute-bound engine (this CPU,
    at saturation) the throughput of tokens is fixed and each stream's TPOT grows with the
    batch; on a memory-bound GPU the slope is small. The autotuner reads the line as the
    largest batch whose requests keep the inter-token target
    (:meth:`serve.admission.controller.Controller.itl_fit`).

    Args:
        horizon_s: age in seconds after which a finished request leaves the line.
        clock: monotonic clock, seconds.
    """

    def __init__(self, horizon_s: float = BATCH_TPOT_HORIZON_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.horizon_s = horizon_s
        self._clock = clock
        self._area = 0.0  # integral of the running batch, request-seconds
        self._last_step_s: float | None = None
        self._batch = 0  # the batch of the last step
        #: (time, integral): piecewise linear between marks.
        self._marks: collections.deque[tuple[float, float]] = collections.deque()
        #: (finish time, mean batch, TPOT seconds) of the finished requests.
        self._points: collections.deque[tuple[float, float, float]] = collections.deque()

    def advance(self, batch: int) -> None:
        """An engine step ended now; ``batch`` requests ran in it (since the previous step).

        The integral is marked where the batch changes, after a long step or an idle gap,
        and every :data:`BATCH_MARK_S` seconds, so that the batch is constant between two
        marks and the integral linear."""
        now = self._clock()
        last, marks = self._last_step_s, self._marks
        if last is not None:
            if (batch != self._batch or now - last > BATCH_MARK_S) and marks[-1][0] != last:
                marks.append((last, self._area))
            self._area += batch * (now - last)
        self._batch, self._last_step_s = batch, now
        if not marks or now - marks[-1][0] >= BATCH_MARK_S:
            marks.append((now, self._area))
            while now - marks[0][0] > BATCH_MARKS_KEEP_S:
                marks.popleft()

    def _area_at(self, t: float) -> float:
        """The integral at time ``t``: between the marks, or between the last mark and the
        last step (the integral now), linearly."""
        marks = self._marks
        i = bisect.bisect_left(marks, (t, -math.inf))
        if i == 0:
            return marks[0][1]
        t0, a0 = marks[i - 1]
        t1, a1 = marks[i] if i < len(marks) else (self._last_step_s, self._area)
        return a0 + (a1 - a0) * (t - t0) / (t1 - t0) if t1 > t0 else a1

    def add(self, decode_s: float, tpot_s: float) -> None:
        """A request finished now after ``decode_s`` seconds from its first to its last token,
        at ``tpot_s`` seconds per token."""
        if decode_s <= 0 or not self._marks or self._last_step_s is None:
            return
        now = self._clock()
        since = max(now - decode_s, self._marks[0][0])
        if now - since <= 0:
            return
        batch = (self._area_at(now) - self._area_at(since)) / (now - since)
        self._points.append((now, batch, tpot_s))
        while now - self._points[0][0] > self.horizon_s:
            self._points.popleft()

    def line(self) -> ItlLine | None:
        """The least-squares line and its spread (:class:`ItlLine`), or None with fewer than
        :data:`BATCH_TPOT_MIN_REQUESTS` requests or mean batches whose variance is under
        :data:`BATCH_TPOT_MIN_VARIANCE`."""
        now = self._clock()
        points = [(n, y) for t, n, y in self._points if now - t <= self.horizon_s]
        if len(points) < BATCH_TPOT_MIN_REQUESTS:
            return None
        k = len(points)
        mean_n = sum(n for n, _ in points) / k
        mean_y = sum(y for _, y in points) / k
        var_n = sum((n - mean_n) ** 2 for n, _ in points) / k
        if var_n < BATCH_TPOT_MIN_VARIANCE:
            return None
        slope = sum((n - mean_n) * (y - mean_y) for n, y in points) / k / var_n
        intercept = mean_y - slope * mean_n
        ratios = [y / fit for n, y in points if (fit := intercept + slope * n) > 0]
        spread = max(1.0, percentile(ratios, 90) or 1.0)
        return ItlLine(intercept, slope, spread)


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
    #: Requests waiting in vLLM as its ``vllm:num_requests_waiting`` counts them: those
    #: waiting for capacity (:attr:`waiting`) plus those deferred (LoRA budget, KV transfer),
    #: the sum vLLM 0.32's Prometheus logger sets from the same scheduler stats.
    engine_queue: int = 0
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
    #: Finished requests' TPOT against their mean batch (:class:`BatchTpotFit`).
    batch_tpot: BatchTpotFit = field(init=False)
    #: Called with the new rate each time a burst measures the prefill rate (the autotune
    #: loop sets the limiter's burst budget from it, within the burst that measured it).
    on_prefill_rate: Callable[[float], None] | None = None
    #: Prompt tokens of one engine step (vLLM's ``max_num_batched_tokens``; 0: unknown): a
    #: burst whose prompts do not fill one step may raise the measured prefill rate but not
    #: lower it (:meth:`_burst_prefill`).
    step_tokens: int = 0
    _prefill_rate: float | None = field(default=None, init=False)
    _prefill_rate_s: float = field(default=0.0, init=False)
    _burst_start_s: float | None = field(default=None, init=False)
    _burst_tokens: int = field(default=0, init=False)
    _burst_open: bool = field(default=False, init=False)
    _burst_count: int = field(default=0, init=False)
    #: Clock time from which requests count in the latency windows, by their arrival at the
    #: engine (:meth:`restart_latency_windows`; -inf: every request).
    _measure_from: float = field(default=float("-inf"), init=False)

    def __post_init__(self) -> None:
        self.ttft = SlidingWindow(self.window_s, self.clock)
        self.tpot = SlidingWindow(self.window_s, self.clock)
        self.request_tokens = collections.deque(maxlen=REQUEST_TOKENS_SAMPLES)
        self.prompt_tokens = collections.deque(maxlen=REQUEST_TOKENS_SAMPLES)
        self.batch_tpot = BatchTpotFit(clock=self.clock)

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

    def restart_latency_windows(self) -> None:
        """Empty the TTFT and TPOT windows, and from now on fill them only with requests
        that reach the engine from now (the autotuner's cut: what follows must be measured
        at the new limit).

        A request's arrival at the engine is ``now - its TTFT`` (vLLM counts both from it)
        and ``now - its e2e latency`` when it finishes. Requests admitted before the cut
        that reach their first token or finish after it were admitted at the old limit: on
        the CPU suite's T5 the image requests queued inside the engine at a limit of 21 gave
        TTFTs of 3-5 s after a cut to 12, which cut again to 6 and to 3, and the long answers
        that came next queued behind the limit.
        """
        self.ttft.clear()
        self.tpot.clear()
        self._measure_from = self.clock()

    def _burst_prefill(self, now: float, idle_before: bool, iteration_stats) -> None:
        """Measure the prefill throughput on a burst: requests that reach an idle engine
        together (within :data:`BURST_ARRIVAL_S`) are prefilled back to back, so the prompt
        tokens completed divided by the latest of their TTFTs (counted from their arrival
        at the engine) is the engine's prefill rate, image encoding included. The
        measurement stops at the first completion of a request that arrived later; it is
        kept when it covered at least :data:`BURST_MIN_REQUESTS` requests.

        A burst whose prompts do not fill one engine step (:attr:`step_tokens`) is prefilled
        in a step or two whose fixed cost, not the prefill throughput, sets its TTFT: its
        rate is a lower bound, taken only where it is higher than the one known. (The engine
        test of the burst budget, on an idle machine: 8 chats of 60 tokens measured 7,452
        tokens/s after 8 prompts of 4,000 had measured 17,068, and the budget fell from
        4,267 to 1,863 tokens while that burst arrived. On a loaded machine those TTFTs are
        longer and the fall deeper; a budget below the burst's own tokens holds the rest of
        it back, and what arrives after its window is shed: the likely cause of that test's
        failures on a slow CI machine, inferred, not traced there.)
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
            rate = self._burst_tokens / elapsed
            known = self.prefill_tokens_per_s
            if self._burst_tokens < self.step_tokens and known is not None and rate < known:
                return  # too small to show the throughput: a lower bound below the known
            self._prefill_rate, self._prefill_rate_s = rate, now
            if self.on_prefill_rate is not None:
                self.on_prefill_rate(self._prefill_rate)

    def record(self, scheduler_stats, iteration_stats) -> None:
        """Absorb one engine step (vLLM ``SchedulerStats`` / ``IterationStats`` or None)."""
        now = self.last_step_s = self.clock()
        idle_before = self.running == 0 and self.waiting == 0
        if scheduler_stats is not None:
            self.running = scheduler_stats.num_running_reqs
            self.waiting = scheduler_stats.num_waiting_reqs
            # (The simulator's records, bench/sim.py, defer nothing and carry no such count.)
            self.engine_queue = self.waiting + getattr(scheduler_stats,
                                                       "num_skipped_waiting_reqs", 0)
            self.kv_cache_usage = scheduler_stats.kv_cache_usage
        if iteration_stats is not None:
            self._burst_prefill(now, idle_before, iteration_stats)
            self.preemptions_total += iteration_stats.num_preempted_reqs
            since = now - self._measure_from  # the oldest age that counts, seconds
            self.ttft.extend(t for t in iteration_stats.time_to_first_tokens_iter
                             if t <= since)
            finished = iteration_stats.finished_requests
            if scheduler_stats is not None:
                # The step's batch: what runs after it, plus what it finished.
                self.batch_tpot.advance(scheduler_stats.num_running_reqs + len(finished))
            tpots = []
            for done in finished:
                self.request_tokens.append(done.num_prompt_tokens + done.num_generation_tokens)
                self.prompt_tokens.append(done.num_prompt_tokens)
                if done.num_generation_tokens > 1:
                    if done.e2e_latency <= since:
                        tpots.append(done.mean_time_per_output_token)
                    self.batch_tpot.add(done.decode_time, done.mean_time_per_output_token)
            self.tpot.extend(tpots)  # one stamp per step (an empty batch adds nothing)


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
