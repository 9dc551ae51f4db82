"""Engine-side signals for the autotuner, fed in-process by a vLLM stat logger.

vLLM calls every stat logger's ``record(scheduler_stats, iteration_stats)`` after each engine
step, in the API process (``vllm/v1/metrics/loggers.py``). :class:`EngineStatsFeed` keeps what
the controller needs: the scheduler's running/waiting counts and KV-cache usage, preemptions,
TTFT/TPOT samples in a sliding window, the recent requests' mean size, the prefill rate a
burst showed and the first tokens of each step (for the prefill backlog). No HTTP scrape, no
parsing.
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
        self._total = 0.0

    def add(self, value: float) -> None:
        self.extend((value,))

    def extend(self, values) -> None:
        batch = tuple(values)
        if not batch:
            return
        self._batches.append((self._clock(), batch))
        self._count += len(batch)
        self._total += sum(batch)
        while self._count > self.max_samples and len(self._batches) > 1:
            self._drop_oldest()

    def clear(self) -> None:
        """Drop every sample."""
        self._batches.clear()
        self._count, self._total = 0, 0.0

    def _drop_oldest(self) -> None:
        batch = self._batches.popleft()[1]
        self._count -= len(batch)
        self._total -= sum(batch)
        if not self._batches:  # no float drift left over once empty
            self._total = 0.0

    def _prune(self) -> None:
        cutoff = self._clock() - self.window_s
        while self._batches and self._batches[0][0] < cutoff:
            self._drop_oldest()

    def sum(self) -> float:
        """Sum of the samples in the window (0 when empty), kept as a running total: O(1)
        amortised, for a check on the request path."""
        self._prune()
        return self._total

    def mean(self) -> float | None:
        """Mean of the samples in the window (the running total over the count: O(1)
        amortised), None when empty."""
        self._prune()
        return self._total / self._count if self._count else None

    def __len__(self) -> int:
        self._prune()
        return self._count

    def percentile(self, q: float) -> float | None:
        """Nearest-rank percentile ``q`` (0-100) of the window, None when empty."""
        self._prune()
        return percentile([v for _, batch in self._batches for v in batch], q)


#: Seconds of finished requests the batch/TPOT line is fitted over: several busy periods (the
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
    #: Called with the new rate each time a burst measures the prefill rate (the autotune
    #: loop sets the limiter's burst budget from it, within the burst that measured it).
    on_prefill_rate: Callable[[float], None] | None = None
    #: Called with the number of first tokens each engine step that produced any (the
    #: limiter's prefill backlog, ``serve.admission.prefill``).
    on_first_tokens: Callable[[int], None] | None = None
    #: Prompt tokens of one engine step (vLLM's ``max_num_batched_tokens``; 0: unknown): a
    #: burst whose prompts do not fill one step may raise the measured prefill rate but not
    #: lower it (:meth:`_burst_prefill`).
    step_tokens: int = 0
    #: The TTFT target, seconds (inf: none): a burst that did not fill one step but took at
    #: least this long to prefill was held up by its work (image encodes), not by a step's
    #: fixed cost, so its rate may be the first measurement (:meth:`_burst_prefill`).
    ttft_target_s: float = math.inf
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

    def forget(self) -> None:
        """Drop what the traffic taught (latency windows, recent sizes, the prefill rate): the
        state of a freshly booted server (the benchmark's reset,
        :meth:`serve.admission.loop.AutotuneLoop.set_mode`). Engine counts stay."""
        self.__post_init__()
        self._prefill_rate, self._prefill_rate_s = None, 0.0
        self._burst_start_s, self._burst_tokens, self._burst_open = None, 0, False
        self._burst_count = 0

    @property
    def mean_request_tokens(self) -> float | None:
        """Mean tokens (prompt + generated) of the last :data:`REQUEST_TOKENS_SAMPLES`
        finished requests: what one request of the current traffic holds in the KV cache at
        its end. None before the first request finishes."""
        if not self.request_tokens:
            return None
        return sum(self.request_tokens) / len(self.request_tokens)

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
        together (within :data:`BURST_ARRIVAL_S` of the first, its *members*) are prefilled
        back to back (vLLM schedules FCFS), so the members' prompt tokens completed divided
        by the time since the first of them arrived at the engine is the engine's prefill
        rate, image encoding included. The measurement stops after the first step that also
        completes a later arrival (from then on those compete); that step's tokens count
        for the members by their share of its requests (a step reports only its sum). It is
        kept once it covers at least :data:`BURST_MIN_REQUESTS` members. A burst sent at once
        reaches the engine spread over its intake (up to a second on a loaded machine), so
        its first members are often completed in the same step as later ones.

        A burst whose prompts do not fill one engine step (:attr:`step_tokens`) is prefilled
        in a step or two whose fixed cost, not the prefill throughput, sets its TTFT: its
        rate is a lower bound, taken only where it is higher than the one known, and not as
        the first measurement unless it took at least :attr:`ttft_target_s` (then its work
        held it up, not a step's fixed cost): where the vision encoder costs far more per
        token than the text prefill (a CPU engine), a few text prompts' rate would let the
        next image burst in past the limit by its tokens. (The engine
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
        members = sum(a - self._burst_start_s <= BURST_ARRIVAL_S for a in arrivals)
        if members < len(arrivals):
            self._burst_open = False  # later arrivals compete from here on
        if not members:
            return
        self._burst_tokens += iteration_stats.num_prompt_tokens * members // len(arrivals)
        self._burst_count += members
        elapsed = now - self._burst_start_s
        if self._burst_count >= BURST_MIN_REQUESTS and elapsed > 0:
            rate = self._burst_tokens / elapsed
            known = self.prefill_tokens_per_s
            if self._burst_tokens < self.step_tokens and elapsed < self.ttft_target_s and (
                    known is None or rate < known):
                return  # fast and too small to show the throughput: a lower bound
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
            firsts = iteration_stats.time_to_first_tokens_iter
            self.ttft.extend(firsts)
            if firsts and self.on_first_tokens is not None:
                self.on_first_tokens(len(firsts))
            tpots = []
            for done in iteration_stats.finished_requests:
                self.request_tokens.append(done.num_prompt_tokens + done.num_generation_tokens)
                if done.num_generation_tokens > 1:
                    tpots.append(done.mean_time_per_output_token)
            self.tpot.extend(tpots)  # one stamp per step (an empty batch adds nothing)


def stat_logger_factory(sink):
    """A vLLM ``StatLoggerFactory`` whose loggers pass each engine step's stats to
    ``sink.record(scheduler_stats, iteration_stats)`` (an :class:`EngineStatsFeed`, or the
    benchmarks' :class:`serve.steplog.StepLog`).

    Imports vLLM, so call it only after :func:`serve.engine.apply_engine_env`.
    """
    from vllm.v1.metrics.loggers import StatLoggerBase

    class SinkStatLogger(StatLoggerBase):
        def __init__(self, vllm_config, engine_index: int = 0) -> None:
            self.sink = sink

        def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None,
                   engine_idx: int = 0) -> None:
            self.sink.record(scheduler_stats, iteration_stats)

        def log_engine_initialized(self) -> None:
            pass

    return SinkStatLogger
