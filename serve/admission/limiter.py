"""Admission limiter: at most ``limit`` requests inside the engine, a bounded FIFO queue before it.

The live ``limit`` *is* the stack's effective ``max_num_seqs``: vLLM's scheduler copies
``max_num_seqs`` once at start (worker buffers are sized from it), so the engine's value is the
ceiling and this limiter is the safe actuator in front of it. Lowering the limit never aborts a
running request; it only admits nothing new until the in-flight count drains below it.

Enforcement is split from the algorithm as in Netflix concurrency-limits (``Limiter`` vs
``Limit``): the autotuner (``serve.admission.controller``) computes the limit, this class only
enforces it. Every :meth:`AdmissionLimiter.acquire` that returns a :class:`Slot` must end in
exactly one :meth:`Slot.release` (later calls are ignored), whatever happens to the request.

Counting is split from queueing: :class:`SlotCounter` (synchronous: limit, in-flight count,
busy time, completion rate) is shared by :class:`AdmissionLimiter` (the server's asyncio FIFO)
and the simulator's gate (``bench/sim.py``), which uses only its public interface, so the
benchmark the autotuner is judged by counts exactly as the server does.

Pure Python (standard library): no engine, no HTTP, so it is testable in isolation.
"""

from __future__ import annotations

import asyncio
import collections
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from serve.admission.rules import check as check_rules

#: Reasons a request is rejected (the ``reason`` label of ``phi3v_rejected_requests_total``).
QUEUE_FULL = "queue_full"
QUEUE_TIMEOUT = "queue_timeout"
SLO = "slo"
REJECT_REASONS = (QUEUE_FULL, QUEUE_TIMEOUT, SLO)
#: Reason of the queued requests refused when the server drains or loses its engine (HTTP 503,
#: not 429).
UNAVAILABLE = "unavailable"


class Rejected(Exception):
    """Raised by :meth:`AdmissionLimiter.acquire` when a request is not admitted.

    Attributes:
        reason: one of :data:`REJECT_REASONS`.
        retry_after_s: suggested wait before retrying, whole seconds >= 1 (HTTP ``Retry-After``).
        queue_wait_s: seconds the request spent queued before the rejection.
    """

    def __init__(self, reason: str, retry_after_s: int, message: str,
                 queue_wait_s: float = 0.0) -> None:
        super().__init__(message)
        self.reason = reason
        self.retry_after_s = retry_after_s
        self.queue_wait_s = queue_wait_s


class Slot:
    """One admitted request's place in the engine. Release it exactly once."""

    __slots__ = ("_counter", "_released", "admitted_at", "queue_wait_s")

    def __init__(self, counter: "SlotCounter", admitted_at: float, queue_wait_s: float):
        self._counter = counter
        self._released = False
        self.admitted_at = admitted_at
        self.queue_wait_s = queue_wait_s

    @property
    def released(self) -> bool:
        return self._released

    def release(self, completed: bool = True) -> bool:
        """Give the slot back. ``completed`` feeds the completion-rate estimate.

        Returns:
            True the first time, False on any later call (idempotent).
        """
        if self._released:
            return False
        self._released = True
        self._counter.release(completed)
        return True


@dataclass
class _Burst:
    """Requests that reached an idle counter together (:meth:`SlotCounter.admits`)."""

    #: Clock time the first of them was admitted, seconds.
    opened_s: float
    #: The limit when it opened.
    limit: int
    #: Clock time of its last admission of known size, while a budget was set, before one
    #: of it had to wait, seconds: the window runs from there (:meth:`SlotCounter.admits`).
    last_s: float = float("-inf")
    #: One of its requests had to wait (the limit, the cap or the budget held it back).
    waited: bool = False
    #: Prompt tokens and requests of known size admitted so far.
    tokens: int = 0
    requests: int = 0
    #: The budget held a request back (the rest of the burst is late).
    held: bool = False


def burst_window_s(ttft_target_s: float, interval_s: float) -> float:
    """Seconds a burst's window lasts (:class:`SlotCounter` ``burst_window_s``): the TTFT
    target (its prefill budget is what the engine prefills within it), or the autotuner's
    tick when that is longer (the controller's burst is what arrives within one tick,
    :meth:`~serve.admission.controller.Controller.step`)."""
    return max(ttft_target_s, interval_s)


@dataclass(frozen=True)
class LimiterSnapshot:
    """What the autotuner reads from the limiter each tick."""

    limit: int
    in_flight: int
    pending: int
    completion_rate: float | None
    #: Requests that arrived so far (admitted, queued or refused), a running count.
    arrivals: int = 0


class SlotCounter:
    """The counting half of admission, synchronous and clock-driven: the live limit, the
    requests in flight, busy time and the completion-rate window. The queueing half is the
    caller's: :class:`AdmissionLimiter` (an asyncio FIFO) in the server, the simulator's
    deque in ``bench/sim.py``; both use only this public interface.

    Args:
        limit: initial number of requests allowed in the engine at once (>= 1).
        rate_window_s: seconds of completions used to estimate the completion rate.
        clock: monotonic clock in seconds (injectable for tests and the simulator).
        ceiling: the engine's ``max_num_seqs`` (None: no engine queue, see ``engine_queue``).
        engine_queue: requests admitted past the limit while the limit *is* the ceiling. The
            engine runs at most ``ceiling`` sequences whatever we admit, so these wait inside
            vLLM, already tokenized and preprocessed, and a finished sequence's batch slot is
            refilled at the next engine step (as raw vLLM's own waiting queue does) instead of
            after a request crossed the gateway. Below the ceiling the limit is exact.
        engine_queue_wait_s: the longest expected wait for a batch slot (seconds) of a
            request admitted into the engine queue (the TTFT target; None: no bound). Once
            the completion rate is known, the engine queue holds at most ``rate x
            engine_queue_wait_s`` requests (:attr:`capacity`): the rest wait at the gateway,
            where SLO shedding sees them, instead of inside vLLM past their TTFT target (on
            the CPU suite's T6, chat at 2x capacity, 32 engine-queued requests waited ~5 s
            for a slot against a 2-s target).
        on_free: called (no arguments) whenever room may have appeared: a slot released,
            the limit raised or the burst budget changed (the queueing half admits its next
            waiters then).
        burst_window_s: seconds a burst's prefill budget applies after its last request
            admitted on arrival, and in which its requests are not shed (:meth:`admits`,
            :meth:`slo_wait_s`; :func:`burst_window_s`).

    Raises:
        ValueError: ``limit`` < 1.
    """

    def __init__(self, limit: int, rate_window_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic,
                 ceiling: int | None = None, engine_queue: int = 0,
                 on_free: Callable[[], None] | None = None,
                 engine_queue_wait_s: float | None = None,
                 burst_window_s: float = 2.0, ablate: frozenset[str] = frozenset()) -> None:
        if limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")
        self.burst_window_s = burst_window_s
        #: Rules switched off (:data:`serve.admission.rules.RULES`; the ablation benchmark).
        self.ablate = check_rules(ablate)
        #: Prompt tokens a burst may bring to an idle engine (None: no budget, count only).
        self.burst_budget: int | None = None
        #: Most requests in flight a burst may reach past the limit by its budget (None: the
        #: ceiling).
        self.burst_cap: int | None = None
        #: The open burst (None: none).
        self._burst: _Burst | None = None
        self.ceiling = ceiling
        self.engine_queue = engine_queue
        self.engine_queue_wait_s = engine_queue_wait_s
        self.rate_window_s = rate_window_s
        self.clock = clock
        self.on_free = on_free
        self._limit = limit
        self._in_flight = 0
        self._arrivals = 0
        #: (time, busy seconds so far) of each completion in the window.
        self._completions: collections.deque[tuple[float, float]] = collections.deque()
        self._busy_total_s = 0.0
        self._busy_since: float | None = None

    @property
    def limit(self) -> int:
        return self._limit

    @property
    def capacity(self) -> int:
        """Requests admitted at most now: the limit, plus at the ceiling the engine queue
        (``engine_queue``, at most ``completion rate x engine_queue_wait_s`` of it once the
        rate is known: the requests that get a batch slot within that wait)."""
        if self.ceiling is None or self._limit < self.ceiling or not self.engine_queue:
            return self._limit
        queue = self.engine_queue
        if self.engine_queue_wait_s is not None and "engine_queue_wait" not in self.ablate:
            rate = self.completion_rate()
            if rate is not None:
                queue = min(queue, math.floor(rate * self.engine_queue_wait_s))
        return self._limit + queue

    def ahead(self) -> int:
        """Admitted requests that still wait for a batch slot: those past the ceiling (in
        the engine queue) or past a lowered limit (draining). A queued request waits for
        these to be served before its own turn."""
        batch = self._limit if self.ceiling is None else min(self._limit, self.ceiling)
        return max(0, self._in_flight - batch)

    @property
    def in_flight(self) -> int:
        """Requests admitted and not yet released."""
        return self._in_flight

    def has_room(self) -> bool:
        """Whether one more request may be admitted now by count (the limit, or the
        capacity at the ceiling)."""
        return self._in_flight < self.capacity

    def admits(self, tokens: int = 0) -> bool:
        """Whether the next request in FIFO order, of ``tokens`` prompt tokens (image
        tokens included; 0: unknown), may be admitted now.

        By count (:meth:`has_room`), and during a **burst** also past the limit: requests
        that reach an idle counter while a :attr:`burst_budget` is set, each within
        :attr:`burst_window_s` of the last one of known size admitted before it (until one
        of it has to wait, held back by the limit, the cap or the budget, the window runs
        on from the last of them; without a budget, or for a request of unknown size, from
        the first: sustained traffic, which queues, never keeps a burst open, nor does
        traffic of unknown sizes; a burst sent at once reaches
        the gateway spread out by its intake, over more than a second on a loaded CI
        machine, where its first answers had finished before its last requests came). In
        the burst, a request the limit would queue is
        admitted when the burst's prompt tokens, its own included, are at most the budget
        (what the engine prefills within the TTFT target at its measured rate,
        :meth:`~serve.admission.controller.Controller.burst_budget`), with at most
        :attr:`burst_cap` in flight (the ceiling at most). A request of unknown size (0) is
        admitted by count only. The budget only ever adds to the limit the burst arrived at:
        what that limit admits at once is never held back (an idle engine takes a burst up
        to its capacity; on the CPU engine a burst of 32 image chats takes ~10 s to prefill,
        past any TTFT target, and in two waves it would end later than plain vLLM's one).
        Once the budget held a request back, a raise of the limit during the window admits
        nothing until the window ends, and then the limit becomes what the burst admitted
        (when lower): the rest of the burst can no longer meet its TTFT target, and
        admitted behind the burst's prefill it would stall every stream the burst started
        (the simulator's T2, gpu-like: a demand probe 1.8 s into a burst admitted 7 more,
        whose prefill pushed two of the first 32 past the 2-s target).

        Why: the limit an idle engine takes a burst with is fitted to the traffic's mean
        prompt (:meth:`~serve.admission.controller.Controller.idle_limit`), and a burst's own
        requests differ in size (one image at ``num_crops=16`` is ~2,300 tokens, a text chat
        ~250): a burst of smaller prompts than the mean fits more than the count (the
        simulator's T2, gpu-like: the fit said 26 and 29 where 32 fit and got all 32 in
        within the target). Only the gateway knows each request's size before the engine.
        """
        burst = self._open_burst()
        ok = self._admits(burst, tokens)
        if not ok and burst is not None:
            # The caller queues the request: the burst is full, its window no longer runs
            # on (a state change: ask only for the request at the head of the queue).
            burst.waited = True
        return ok

    def _admits(self, burst: "_Burst | None", tokens: int) -> bool:
        """:meth:`admits` for the open ``burst`` (None: none)."""
        if burst is None or tokens <= 0 or self.burst_budget is None:
            return self.has_room()
        if self.has_room() and (not burst.held or self._in_flight < burst.limit):
            return True  # by count (once the budget held one back: the limit it arrived at)
        most = self.ceiling or self._limit
        if self.burst_cap is not None:
            most = min(most, self.burst_cap)
        if self._in_flight >= most:
            return False
        if burst.tokens + tokens > self.burst_budget:
            burst.held = True  # the rest of the burst is late
            return False
        return True

    @property
    def burst_admitted(self) -> tuple[int, int] | None:
        """The open burst's prompt tokens and requests admitted so far (None: none open)."""
        burst = self._open_burst()
        return None if burst is None else (burst.tokens, burst.requests)

    def _open_burst(self) -> "_Burst | None":
        """The open burst, after closing one whose window has ended (and, if its budget
        held a request back, lowering a limit raised meanwhile to what it admitted)."""
        burst = self._burst
        if burst is not None and self.clock() - max(burst.opened_s, burst.last_s) > \
                self.burst_window_s:
            self._burst = None
            if burst.held and "burst_held_lower" not in self.ablate:
                self._limit = min(self._limit, max(burst.limit, burst.requests))
            return None
        return burst

    def set_burst_budget(self, tokens: int | None, cap: int | None = None) -> None:
        """Set the prompt tokens a burst may bring to an idle engine past the limit
        (:meth:`admits`; None: none, admission by count only), and the most requests it may
        put in flight so (None: the ceiling). A budget that changes during a burst (the
        rate measured on the burst itself) applies to its requests still queued."""
        self.burst_budget = tokens
        self.burst_cap = cap
        self._notify()

    def set_limit(self, limit: int) -> None:
        """Change the limit now. Raising it makes room at once; lowering it admits nothing
        until in-flight requests drain below it (none is aborted).

        Raises:
            ValueError: ``limit`` < 1.
        """
        if limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")
        self._limit = limit
        self._notify()

    def take(self, arrived_at: float, tokens: int = 0, queued: bool = False) -> Slot:
        """Admit one request of ``tokens`` prompt tokens that arrived at ``arrived_at``
        (clock seconds); the caller checked :meth:`admits` (or the limit was lowered
        meanwhile: the slot is counted anyway). ``queued``: it waited in the caller's queue.
        A request that reaches an idle counter on arrival (not ``queued``) opens a burst; a
        queued one that takes the slot the last release freed does not (at limit 1 each
        completion leaves the counter empty for an instant, and a new burst there would
        stop SLO shedding and let the queue in past the limit). A burst's requests are
        counted even before a budget is known, for one measured on the burst itself."""
        now = self.clock()
        if self._in_flight == 0 and not queued:
            self._burst = _Burst(now, self._limit)
        burst = self._open_burst()
        if burst is not None and tokens > 0:
            burst.tokens += tokens
            burst.requests += 1
        if burst is not None and not burst.waited and tokens > 0 \
                and self.burst_budget is not None:
            burst.last_s = now  # its budget counts it: the window runs on
        self._count(+1)
        return Slot(self, now, now - arrived_at)

    def release(self, completed: bool) -> None:
        """A slot is given back (by :meth:`Slot.release`, or by a waiter that left after it
        was granted one)."""
        self._count(-1)
        if completed:
            self._completions.append((self.clock(), self.busy_s()))
        self._notify()

    def _notify(self) -> None:
        if self.on_free is not None:
            self.on_free()

    @property
    def busy_since(self) -> float | None:
        """Clock time since which requests have been in flight without a break (None: idle)."""
        return self._busy_since

    def busy_s(self) -> float:
        """Seconds so far during which at least one request was in flight."""
        if self._busy_since is None:
            return self._busy_total_s
        return self._busy_total_s + self.clock() - self._busy_since

    def _count(self, delta: int) -> None:
        """Change the in-flight count by ``delta``, keeping the busy-time account."""
        before = self._in_flight
        self._in_flight += delta
        if before == 0 and self._in_flight > 0:
            self._busy_since = self.clock()
        elif before > 0 and self._in_flight == 0 and self._busy_since is not None:
            self._busy_total_s += self.clock() - self._busy_since
            self._busy_since = None

    def completion_rate(self) -> float | None:
        """The service rate: requests completed per second *of busy time* (at least one
        request in flight), over the completions of the last ``rate_window_s`` seconds.

        Idle time is left out, so a server that just woke up from idle does not look slow
        (the rate of a busy server is what a queued request will see). Estimate: ``(n - 1)``
        completions over the busy seconds between the first and the last of the ``n``.
        None with fewer than two completions in the window.
        """
        now = self.clock()
        while self._completions and self._completions[0][0] < now - self.rate_window_s:
            self._completions.popleft()
        if len(self._completions) < 2:
            return None
        busy = self._completions[-1][1] - self._completions[0][1]
        return (len(self._completions) - 1) / max(busy, 1e-3)

    def expected_wait_s(self, position: int) -> float | None:
        """Expected seconds until a request ``position`` places from the head of the gateway
        queue (0 = next) gets a batch slot in the engine: ``(ahead + position + 1) /
        completion_rate`` (Little's law on the drain rate), where ``ahead`` (:meth:`ahead`)
        counts the admitted requests still waiting for one. 0 when a slot is free for the
        head; None when no rate is known yet."""
        ahead = self.ahead()
        if position == 0 and not ahead and self.has_room():
            return 0.0
        rate = self.completion_rate()
        if rate is None:
            return None
        return (ahead + position + 1) / rate

    def slo_wait_s(self, position: int, ttft_target_s: float | None) -> float | None:
        """The expected wait (seconds, :meth:`expected_wait_s`) of a request that would
        queue ``position`` places from the head, when it exceeds ``ttft_target_s`` and the
        request is to be shed (reason ``slo``: it could not meet its TTFT target anyway);
        None: queue it.

        Never while a **burst** that reached an idle counter is open (:meth:`admits`;
        at most :attr:`burst_window_s` after one of it had to wait): the
        requests of a burst the limit or its prefill budget holds back wait for its first
        wave, as plain vLLM's waiting queue would keep them, instead of being refused by a
        drain rate measured on other traffic while the engine is busy with the burst itself
        (on a loaded CI machine a burst of 8 short chats at an idle server lost 3 to
        ``slo``, and ``make bench``'s W4 one of 96, while plain vLLM served all). Sustained
        traffic, which keeps the counter busy, is shed as before.
        """
        if ttft_target_s is None or (self._open_burst() is not None
                                     and "burst_no_shed" not in self.ablate):
            return None
        wait = self.expected_wait_s(position)
        return wait if wait is not None and wait > ttft_target_s else None

    def arrived(self) -> None:
        """Count a request arriving (whatever then becomes of it): the autotuner tells an
        idle server from one that refuses everything."""
        self._arrivals += 1

    def snapshot(self, pending: int) -> LimiterSnapshot:
        """What the autotuner reads each tick, with ``pending`` requests in the caller's
        queue."""
        return LimiterSnapshot(self._limit, self._in_flight, pending, self.completion_rate(),
                               self._arrivals)

    def retry_after_s(self, pending: int) -> int:
        """Suggested ``Retry-After`` in whole seconds (1..60) behind ``pending`` queued
        requests, from the drain rate."""
        wait = self.expected_wait_s(pending)
        if wait is None:
            return 1
        return int(min(60, max(1, math.ceil(wait))))


class AdmissionLimiter:
    """FIFO admission gate with a live limit: the queueing half (asyncio futures, a bounded
    queue with a wait deadline, SLO shedding) over a :class:`SlotCounter`.

    Args:
        limit: initial number of requests allowed in the engine at once (>= 1).
        max_queue: most requests waiting for a slot; one more is rejected ``queue_full``.
        max_queue_wait_s: a queued request not admitted within this many seconds is rejected
            ``queue_timeout``.
        rate_window_s, clock, ceiling, engine_queue, engine_queue_wait_s, burst_window_s:
            as :class:`SlotCounter`.
    """

    def __init__(self, limit: int, max_queue: int, max_queue_wait_s: float,
                 rate_window_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic,
                 ceiling: int | None = None, engine_queue: int = 0,
                 engine_queue_wait_s: float | None = None,
                 burst_window_s: float = 2.0) -> None:
        self.slots = SlotCounter(limit, rate_window_s, clock, ceiling, engine_queue,
                                 on_free=self._wake, engine_queue_wait_s=engine_queue_wait_s,
                                 burst_window_s=burst_window_s)
        self.max_queue = max_queue
        self.max_queue_wait_s = max_queue_wait_s
        self._clock = clock
        #: Queued requests in FIFO order: (future of the slot, prompt tokens).
        self._waiters: collections.deque[tuple[asyncio.Future, int]] = collections.deque()
        self._closed = False  # draining or engine lost: queue no one
        self._closed_message = ""

    # --- state (the counter's, and the queue's) ---------------------------------------------
    @property
    def limit(self) -> int:
        return self.slots.limit

    @property
    def capacity(self) -> int:
        """Requests admitted at most now (:attr:`SlotCounter.capacity`)."""
        return self.slots.capacity

    @property
    def ceiling(self) -> int | None:
        return self.slots.ceiling

    @property
    def engine_queue(self) -> int:
        return self.slots.engine_queue

    @property
    def in_flight(self) -> int:
        """Requests admitted and not yet released."""
        return self.slots.in_flight

    @property
    def pending(self) -> int:
        """Requests waiting in the queue."""
        return sum(1 for w, _ in self._waiters if not w.done())

    def snapshot(self) -> LimiterSnapshot:
        return self.slots.snapshot(self.pending)

    def set_limit(self, limit: int) -> None:
        """Change the limit now (:meth:`SlotCounter.set_limit`); raising it admits queued
        requests at once."""
        self.slots.set_limit(limit)

    def set_burst_budget(self, tokens: int | None, cap: int | None = None) -> None:
        """:meth:`SlotCounter.set_burst_budget` (queued requests it now fits are admitted)."""
        self.slots.set_burst_budget(tokens, cap)

    def completion_rate(self) -> float | None:
        """:meth:`SlotCounter.completion_rate`."""
        return self.slots.completion_rate()

    def expected_wait_s(self, position: int) -> float | None:
        """:meth:`SlotCounter.expected_wait_s`."""
        return self.slots.expected_wait_s(position)

    def retry_after_s(self) -> int:
        """Suggested ``Retry-After`` in whole seconds (1..60) from queue length and drain rate."""
        return self.slots.retry_after_s(self.pending)

    # --- admission ----------------------------------------------------------------------
    async def acquire(self, ttft_target_s: float | None = None, tokens: int = 0) -> Slot:
        """Wait for a slot, FIFO.

        Args:
            ttft_target_s: if given, a request whose expected queue wait already exceeds it is
                shed at once (reason ``slo``; not during a burst at an idle engine:
                :meth:`SlotCounter.slo_wait_s`).
            tokens: the request's prompt tokens, image tokens included (0: unknown), for a
                burst's prefill budget (:meth:`SlotCounter.admits`).

        Returns:
            the request's :class:`Slot`.

        Raises:
            Rejected: queue full, wait over ``max_queue_wait_s``, or SLO shedding.
            asyncio.CancelledError: the caller was cancelled (client left); the request has
                left the queue and holds no slot.
        """
        start = self._clock()
        self.slots.arrived()
        if self._closed:
            raise Rejected(UNAVAILABLE, 1, self._closed_message)
        if not self.pending and self.slots.admits(tokens):
            return self.slots.take(start, tokens)
        if self.pending >= self.max_queue:
            raise Rejected(QUEUE_FULL, self.retry_after_s(),
                           f"Server busy: {self.pending} requests already queued "
                           f"(max_queue={self.max_queue}).")
        wait = self.slots.slo_wait_s(self.pending, ttft_target_s)
        if wait is not None:
            raise Rejected(SLO, self.retry_after_s(),
                           f"Server busy: expected queue wait {wait:.1f}s exceeds the "
                           f"TTFT target {ttft_target_s:.1f}s.")
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        self._waiters.append((fut, tokens))
        try:
            slot = await asyncio.wait_for(asyncio.shield(fut), self.max_queue_wait_s)
        except asyncio.TimeoutError:
            self._abandon(fut)
            raise Rejected(QUEUE_TIMEOUT, self.retry_after_s(),
                           f"Server busy: not admitted within max_queue_wait_s="
                           f"{self.max_queue_wait_s:g}s.",
                           queue_wait_s=self._clock() - start) from None
        except BaseException:
            self._abandon(fut)
            raise
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            # Granted in the same tick the client left: wait_for swallowed the cancellation.
            self._abandon(fut)
            raise asyncio.CancelledError
        slot.queue_wait_s = slot.admitted_at - start
        return slot

    def reject_waiting(self, retry_after_s: int, message: str) -> int:
        """Refuse every queued request (reason ``unavailable``, ``message``) and queue no one
        after: the server is shutting down or lost its engine. Returns how many were refused."""
        self._closed = True
        self._closed_message = message
        refused = 0
        while self._waiters:
            fut, _ = self._waiters.popleft()
            if not fut.done():
                fut.set_exception(Rejected(UNAVAILABLE, retry_after_s, message))
                refused += 1
        return refused

    def _abandon(self, fut: asyncio.Future) -> None:
        """A waiter leaves (timeout, cancel). If it had been granted a slot meanwhile, hand the
        slot back, so no slot leaks."""
        if fut.done() and not fut.cancelled() and fut.exception() is None:
            fut.result().release(completed=False)
        else:
            fut.cancel()
            for waiter in self._waiters:
                if waiter[0] is fut:
                    self._waiters.remove(waiter)
                    break

    def _wake(self) -> None:
        waiters = self._waiters
        while waiters:
            fut, tokens = waiters[0]
            if fut.done():
                waiters.popleft()
                continue
            if not self.slots.admits(tokens):
                break
            waiters.popleft()
            fut.set_result(self.slots.take(self._clock(), tokens, queued=True))
