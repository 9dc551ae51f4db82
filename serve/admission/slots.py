"""The counting half of admission: the live limit, the requests in flight, busy time and the
completion rate (:class:`SlotCounter`), and one admitted request's place (:class:`Slot`).

Synchronous and clock-driven: the server's asyncio FIFO (:class:`serve.admission.limiter.
AdmissionLimiter`) and the simulator's gate (``bench/sim.py``) both queue in front of it
through its public interface only, so the benchmark the autotuner is judged by counts
exactly as the server does. The limit has one writer, the autotuner's loop
(:meth:`SlotCounter.set_limit`); a burst's admission past it is
:mod:`serve.admission.burst`'s, which never writes it.

Standard library only.
"""

from __future__ import annotations

import collections
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from serve.admission.burst import BurstAdmission
from serve.admission.engine_stats import percentile
from serve.admission.rules import check as check_rules


class Slot:
    """One admitted request's place in the engine. Release it exactly once."""

    __slots__ = ("_counter", "_released", "admitted_at", "queue_wait_s", "on_release")

    def __init__(self, counter: "SlotCounter", admitted_at: float, queue_wait_s: float):
        self._counter = counter
        self._released = False
        self.admitted_at = admitted_at
        self.queue_wait_s = queue_wait_s
        #: Called once when the slot is released, before the counter admits the next request
        #: (the fair queue gives the tenant's share back first).
        self.on_release: Callable[[], None] | None = None

    @property
    def released(self) -> bool:
        return self._released

    def release(self, completed: bool = True, first_token_at: float | None = None) -> bool:
        """Give the slot back; True the first time, False on any later call (idempotent).
        ``completed`` feeds the completion-rate estimate; ``first_token_at`` (clock seconds,
        None: no first token seen) the time from admission to a first token
        (:meth:`SlotCounter.first_token_s`)."""
        if self._released:
            return False
        self._released = True
        if self.on_release is not None:
            self.on_release()
        first = None if first_token_at is None else first_token_at - self.admitted_at
        self._counter.release(completed, first)
        return True


#: Answers over which :meth:`SlotCounter.first_token_s` takes its p90: recent enough to
#: follow a change of load within a few dozen answers, enough that one slow answer (a long
#: prompt, an image) moves it little.
FIRST_TOKEN_SAMPLES = 32


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
        engine_queue: requests admitted past the limit while the limit *is* the ceiling: they
            wait inside vLLM, tokenized and preprocessed, and a finished sequence's batch slot
            is refilled at the next engine step, as in raw vLLM. Below the ceiling the limit
            is exact.
        engine_queue_wait_s: the TTFT target, seconds (None: no bound): once the completion
            rate is known the engine queue holds at most ``rate x`` this (:attr:`capacity`);
            the rest wait at the gateway, where SLO shedding sees them.
        on_free: called (no arguments) whenever room may have appeared (a slot released, the
            limit raised, the burst budget changed): the queueing half admits then.
        burst_window_s: seconds a burst's prefill budget applies after its last request
            admitted on arrival (:meth:`admits`, :meth:`slo_wait_s`, :func:`burst_window_s`).

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
        #: Rules switched off (:data:`serve.admission.rules.RULES`; the ablation benchmark).
        self.ablate = check_rules(ablate)
        #: Admission past the limit of a burst at an idle engine (:meth:`admits`).
        self.bursts = BurstAdmission(burst_window_s, clock)
        self.probe_room = 0  #: queued requests the next probe admits (:meth:`set_probe_room`)
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
        #: Seconds from admission to first token of the most recent answers.
        self._first_tokens: collections.deque[float] = collections.deque(
            maxlen=FIRST_TOKEN_SAMPLES)

    @property
    def limit(self) -> int:
        return self._limit

    @property
    def capacity(self) -> int:
        """Requests admitted at most now: the limit, plus at the ceiling the engine queue, at
        most ``completion rate x engine_queue_wait_s`` of it (those that get a batch slot
        within that wait; none before a rate is known: a flood at boot would otherwise put
        twice the ceiling into the engine at once)."""
        if self.ceiling is None or self._limit < self.ceiling or not self.engine_queue:
            return self._limit
        queue = self.engine_queue
        if self.engine_queue_wait_s is not None and "engine_queue_wait" not in self.ablate:
            rate = self.completion_rate()
            queue = 0 if rate is None else min(queue, math.floor(rate * self.engine_queue_wait_s))
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

    def admits(self, tokens: int = 0, arrived_at: float | None = None) -> bool:
        """Whether the next request in FIFO order, of ``tokens`` prompt tokens (image
        tokens included; 0: unknown: by count only), which arrived at ``arrived_at`` (clock
        seconds; None: now), may be admitted now.

        By count (:meth:`has_room`), and during a **burst** that reached an idle counter
        also past the limit, by its prompt tokens (:mod:`serve.admission.burst`): when the
        burst's prompt tokens, its own included, are at most :attr:`burst_budget` (grown by
        :meth:`BurstAdmission.deadline_tokens` for its arrival), with at most
        :attr:`burst_cap` in flight (the ceiling at most). The budget only ever adds to the
        limit the burst arrived at (an idle engine takes a burst up to its capacity at once,
        as plain vLLM does). Once the budget held a request back, a raise of the limit
        during the window admits nothing more of the burst: the rest of it can no longer
        meet its TTFT target, and behind the burst's prefill it would stall every stream.
        """
        burst = self.bursts.current()
        if burst is None or tokens <= 0 or self.bursts.budget is None:
            return self.has_room()
        if self.has_room() and (not burst.held or self._in_flight < burst.limit):
            return True  # by count (once the budget held one back: the limit it arrived at)
        extra = 0 if "burst_deadline" in self.ablate else self.bursts.deadline_tokens(
            burst, self.clock() if arrived_at is None else arrived_at)
        if self.bursts.admits_past(burst, tokens, self._in_flight,
                                   self.ceiling or self._limit, extra):
            return True
        # The caller queues the request: the burst is full, its window no longer runs on
        # (a state change: ask only for the request at the head of the queue).
        burst.waited = True
        return False

    @property
    def burst_budget(self) -> int | None:
        """Prompt tokens a burst may bring to an idle engine past the limit (None: none)."""
        return self.bursts.budget

    @property
    def burst_cap(self) -> int | None:
        """Most requests in flight a burst may reach past the limit (None: the ceiling)."""
        return self.bursts.cap

    @property
    def burst_admitted(self) -> tuple[int, int] | None:
        """The open burst's prompt tokens and requests admitted so far (None: none open)."""
        return self.bursts.admitted

    def set_burst_budget(self, tokens: int | None, cap: int | None = None,
                         rate: float | None = None) -> None:
        """Set the prompt tokens a burst may bring to an idle engine past the limit
        (:meth:`admits`; None: none, by count only), the most requests it may put in flight
        so (None: the ceiling) and the prefill rate the budget came from (tokens/s, None:
        none). A budget changed during a burst applies to its requests still queued."""
        self.bursts.budget = tokens
        self.bursts.cap = cap
        self.bursts.rate = rate if tokens is not None else None
        self._notify()

    def set_probe_room(self, requests: int) -> None:
        """The first ``requests`` places of the queue are not shed (:meth:`slo_wait_s`): the
        autotuner's next probe admits them (:meth:`serve.admission.controller.Controller.
        probe_room`). Its loop writes it at each decision; 0 (a fixed limit): off."""
        self.probe_room = max(0, requests)

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
        One that reaches an idle counter on arrival (not ``queued``) opens a burst; a queued
        one taking the slot the last release freed does not (that would stop SLO shedding).
        A burst's requests are counted even before a budget is known."""
        now = self.clock()
        if self._in_flight == 0 and not queued:
            self.bursts.open(self._limit, self._arrivals)
        self.bursts.count(tokens)
        self._count(+1)
        return Slot(self, now, now - arrived_at)

    def release(self, completed: bool, first_token_s: float | None = None) -> None:
        """A slot is given back (by :meth:`Slot.release`, or by a waiter that left after it
        was granted one); ``first_token_s``: seconds from its admission to its first token
        (None: none seen)."""
        self._count(-1)
        if completed:
            self._completions.append((self.clock(), self.busy_s()))
        if first_token_s is not None and first_token_s >= 0:
            self._first_tokens.append(first_token_s)
        self._notify()

    def forget(self) -> None:
        """Drop what the traffic taught (the completion-rate window, the first-token samples):
        a freshly booted server's drain rate is unknown (the benchmark's reset)."""
        self._completions.clear()
        self._first_tokens.clear()

    def first_token_s(self) -> float | None:
        """Seconds from admission to first token, the 90th percentile over the last
        :data:`FIRST_TOKEN_SAMPLES` answers that had one (None: none yet): a request let in
        at its deadline (:meth:`queue_wait_bound_s`) then gets its first token in time as
        most recent answers did, not half of them; the p90, as the autotuner judges TTFT."""
        return percentile(list(self._first_tokens), 90)

    def queue_wait_bound_s(self, ttft_target_s: float | None) -> float | None:
        """The longest a request queued now may wait for a slot and still meet
        ``ttft_target_s`` (rule ``queue_deadline``): the target less :meth:`first_token_s`,
        at least 0 (the whole target before a first token was seen: a TTFT is at least the
        queue wait). None (no bound but the caller's ``max_queue_wait_s``): no target, the
        rule ablated, or a burst's first wave (:meth:`first_wave`), whose requests wait for
        it as plain vLLM's waiting queue keeps them, until the burst outgrows it
        (:meth:`first_wave_ended`).
        """
        if ttft_target_s is None or "queue_deadline" in self.ablate or self.first_wave():
            return None
        return max(0.0, ttft_target_s - (self.first_token_s() or 0.0))

    def first_wave(self) -> bool:
        """Rule ``burst_no_shed``: a burst at an idle counter is in its first wave
        (:meth:`BurstAdmission.first_wave` at the ceiling, the limit where none is set), which
        plain vLLM would take at once: no queue deadline for it (:meth:`queue_wait_bound_s`)."""
        return "burst_no_shed" not in self.ablate and bool(
            self.bursts.first_wave(self._arrivals, self.ceiling or self._limit))

    def first_wave_ended(self) -> bool | None:
        """True once the open burst outgrew its first wave (:meth:`first_wave`): its requests
        still queued then get :meth:`queue_wait_bound_s` from their arrival (requests past
        their target at the queue's head would hold the later ones past theirs); False while
        it goes on; None when no burst is open (one that never outgrew it keeps its promise:
        its requests get no deadline)."""
        if self.bursts.current() is None:
            return None
        return not self.first_wave()

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
        request in flight; a server just woken from idle does not look slow), over the
        completions of the last ``rate_window_s`` seconds: ``(n - 1)`` completions over the
        busy seconds between the first and the last of the ``n``. None with fewer than two.
        """
        now = self.clock()
        while self._completions and self._completions[0][0] < now - self.rate_window_s:
            self._completions.popleft()
        if len(self._completions) < 2:
            return None
        busy = self._completions[-1][1] - self._completions[0][1]
        return (len(self._completions) - 1) / max(busy, 1e-3)

    def expected_wait_s(self, position: int, ahead: int | None = None) -> float | None:
        """Expected seconds until a request ``position`` places from the head of the gateway
        queue (0 = next) gets a batch slot in the engine: ``(ahead + position + 1) /
        completion_rate`` (Little's law on the drain rate), where ``ahead`` (default
        :meth:`ahead`) counts the admitted requests still waiting for one. 0 when a slot is
        free for the head; None when no rate is known yet."""
        ahead = self.ahead() if ahead is None else ahead
        if position == 0 and not ahead and self.has_room():
            return 0.0
        rate = self.completion_rate()
        if rate is None:
            return None
        return (ahead + position + 1) / rate

    def slo_wait_s(self, position: int, ttft_target_s: float | None,
                   ahead: int | None = None) -> float | None:
        """The expected wait (seconds, :meth:`expected_wait_s`) of a request that would
        queue ``position`` places from the head, when it exceeds ``ttft_target_s`` and the
        request is to be shed (reason ``slo``: it could not meet its TTFT target anyway);
        None: queue it.

        Never while a **burst** that reached an idle counter is open (:meth:`admits`): its
        requests wait for its first wave as plain vLLM's waiting queue would keep them, not
        refused by a drain rate measured on other traffic (the queue deadline still bounds
        them once it outgrew that wave: :meth:`first_wave_ended`). Nor are the first
        :attr:`probe_room` places of the queue, which the next probe admits.
        """
        if ttft_target_s is None or "slo_shed" in self.ablate or \
                position < self.probe_room or (
                self.bursts.current() is not None and "burst_no_shed" not in self.ablate):
            return None
        wait = self.expected_wait_s(position, ahead)
        return wait if wait is not None and wait > ttft_target_s else None

    def arrived(self) -> None:
        """Count a request arriving (whatever then becomes of it): the autotuner tells an
        idle server from one that refuses everything, and an open burst's arrivals
        (:meth:`queue_wait_bound_s`)."""
        self._arrivals += 1

    def snapshot(self, pending: int) -> LimiterSnapshot:
        """What the autotuner reads each tick, with ``pending`` requests in the caller's queue."""
        return LimiterSnapshot(self._limit, self._in_flight, pending, self.completion_rate(),
                               self._arrivals)

    def retry_after_s(self, pending: int) -> int:
        """Suggested ``Retry-After`` in whole seconds (1..60) behind ``pending`` queued
        requests, from the drain rate."""
        wait = self.expected_wait_s(pending)
        return 1 if wait is None else int(min(60, max(1, math.ceil(wait))))
