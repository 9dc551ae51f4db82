"""Admission limiter: at most ``limit`` requests inside the engine, a bounded queue per tenant
before it, served by weighted fair sharing of the slots (:mod:`serve.admission.fair`).

The live ``limit`` *is* the stack's effective ``max_num_seqs``: vLLM's scheduler copies
``max_num_seqs`` once at start (worker buffers are sized from it), so the engine's value is the
ceiling and this limiter is the safe actuator in front of it. Lowering the limit never aborts a
running request; it only admits nothing new until the in-flight count drains below it.

Enforcement is split from the algorithm as in Netflix concurrency-limits (``Limiter`` vs
``Limit``): the autotuner (``serve.admission.controller``) computes the limit, this class only
enforces it. Every :meth:`AdmissionLimiter.acquire` that returns a :class:`Slot` must end in
exactly one :meth:`Slot.release` (later calls are ignored), whatever happens to the request.

Counting is split from queueing: :class:`~serve.admission.slots.SlotCounter` (synchronous:
limit, in-flight count, busy time, completion rate; :mod:`serve.admission.slots`) is shared
by :class:`AdmissionLimiter` (the server's asyncio FIFO, here) and the simulator's gate
(``bench/sim.py``), so the benchmark the autotuner is judged by counts exactly as the
server does. Pure Python (standard library): no engine, no HTTP, testable in isolation.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from serve.admission.burst import burst_window_s
from serve.admission.fair import DEFAULT_TENANT, FairQueue
from serve.admission.prefill import PrefillBacklog
from serve.admission.slots import LimiterSnapshot, Slot, SlotCounter

__all__ = ["AdmissionLimiter", "Rejected", "Slot", "SlotCounter", "LimiterSnapshot",
           "burst_window_s", "QUEUE_FULL", "QUEUE_TIMEOUT", "SLO", "REJECT_REASONS",
           "UNAVAILABLE", "queue_wait_limit"]

#: Reasons a request is rejected (the ``reason`` label of ``phi3v_rejected_requests_total``).
QUEUE_FULL = "queue_full"
QUEUE_TIMEOUT = "queue_timeout"
SLO = "slo"
REJECT_REASONS = (QUEUE_FULL, QUEUE_TIMEOUT, SLO)
#: Reason of the queued requests refused on a drain or a lost engine (HTTP 503, not 429).
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


def queue_wait_limit(slots: SlotCounter, queue: FairQueue, tenant: str,
                     ttft_target_s: float | None, max_queue_wait_s: float,
                     user: str | None = None) -> tuple[float, bool]:
    """Seconds a request of ``tenant`` (``user``) queued now may wait for a slot, and whether
    the queue deadline (:meth:`SlotCounter.queue_wait_bound_s`, for a tenant alone or over its
    share: :meth:`FairQueue.over_share`) rather than ``max_queue_wait_s`` sets it. The
    limiter's and the simulator's gate's one rule."""
    bound = (slots.queue_wait_bound_s(ttft_target_s) if queue.over_share(tenant, user)
             else None)
    if bound is not None and bound < max_queue_wait_s:
        return bound, True
    return max_queue_wait_s, False


def _who(tenant: str) -> str:
    """The refusal message's prefix naming ``tenant`` (none for the default tenant)."""
    return "" if tenant == DEFAULT_TENANT else f"tenant '{tenant}': "


class AdmissionLimiter:
    """Admission gate with a live limit: the queueing half (asyncio futures, a bounded queue
    per tenant with a wait deadline, SLO shedding, weighted fair sharing between tenants:
    :class:`~serve.admission.fair.FairQueue`) over a :class:`SlotCounter`. With one tenant
    it is a FIFO.

    Args:
        limit: initial number of requests allowed in the engine at once (>= 1).
        max_queue: most requests of one tenant waiting for a slot; one more is rejected
            ``queue_full``.
        max_queue_wait_s: a queued request not admitted within this many seconds is rejected
            ``queue_timeout``.
        rate_window_s, clock, ceiling, engine_queue, engine_queue_wait_s, burst_window_s:
            as :class:`SlotCounter`.
        ttft_target_s, step_tokens, itl_target_s: as :class:`PrefillBacklog`
            (:attr:`backlog`: inactive until its costs are measured).
    """

    def __init__(self, limit: int, max_queue: int, max_queue_wait_s: float,
                 rate_window_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic,
                 ceiling: int | None = None, engine_queue: int = 0,
                 engine_queue_wait_s: float | None = None,
                 burst_window_s: float = 2.0, ttft_target_s: float | None = None,
                 step_tokens: int = 0, itl_target_s: float | None = None) -> None:
        self.slots = SlotCounter(limit, rate_window_s, clock, ceiling, engine_queue,
                                 on_free=self._wake, engine_queue_wait_s=engine_queue_wait_s,
                                 burst_window_s=burst_window_s)
        self.backlog = PrefillBacklog(ttft_target_s, step_tokens, itl_target_s=itl_target_s,
                                      clock=clock)
        self.max_queue = max_queue
        self.max_queue_wait_s = max_queue_wait_s
        self._clock = clock
        #: Queued requests, a FIFO per tenant (and user): (future of the slot, prompt tokens,
        #: user, arrival clock time, predicted prefill seconds).
        self.queue: FairQueue[tuple[asyncio.Future, int, str | None, float, float]] = FairQueue()
        #: Queued requests of a burst's first wave, which got no deadline
        #: (:meth:`SlotCounter.first_wave_ended`): (tenant, waiter, TTFT target).
        self._first_wave: list[tuple[str, tuple, float]] = []
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
        """Requests waiting in the queue (every tenant's)."""
        return len(self.queue)

    def snapshot(self) -> LimiterSnapshot:
        return self.slots.snapshot(self.pending)

    def set_limit(self, limit: int) -> None:
        """Change the limit now (:meth:`SlotCounter.set_limit`); raising it admits queued
        requests at once."""
        self.slots.set_limit(limit)

    def set_burst_budget(self, tokens: int | None, cap: int | None = None,
                         rate: float | None = None) -> None:
        """:meth:`SlotCounter.set_burst_budget` (queued requests it now fits are admitted)."""
        self.slots.set_burst_budget(tokens, cap, rate)

    def completion_rate(self) -> float | None:
        """:meth:`SlotCounter.completion_rate`."""
        return self.slots.completion_rate()

    def expected_wait_s(self, position: int) -> float | None:
        """:meth:`SlotCounter.expected_wait_s`."""
        return self.slots.expected_wait_s(position)

    def retry_after_s(self, tenant: str | None = None) -> int:
        """Suggested ``Retry-After`` in whole seconds (1..60) from the queue ahead (of
        ``tenant``'s next request: :meth:`FairQueue.position`) and the drain rate."""
        return self.slots.retry_after_s(
            self.pending if tenant is None else self.queue.position(tenant))

    # --- admission ----------------------------------------------------------------------
    def try_acquire(self, tokens: int = 0, tenant: str = DEFAULT_TENANT,
                    user: str | None = None, image_tokens: int = 0) -> Slot | None:
        """A slot at once, when :meth:`acquire` would grant one without waiting (nobody
        queued, :meth:`SlotCounter.admits`, the prefill backlog admits it, not closed): a
        plain call for the common case. None: nothing happened (the arrival is not
        counted); call :meth:`acquire`."""
        cost = self.backlog.cost(tokens, image_tokens)
        if self._closed or self.queue or not self.backlog.admits_at(cost, self.slots) or \
                not self.slots.admits(tokens):
            return None
        start = self._clock()
        self.slots.arrived()
        self.queue.started(tenant, user)
        return self._granted(self.slots.take(start, tokens), tenant, user, cost, tokens)

    async def acquire(self, ttft_target_s: float | None = None, tokens: int = 0,
                      tenant: str = DEFAULT_TENANT, weight: float = 1.0,
                      user: str | None = None, image_tokens: int = 0) -> Slot:
        """Wait for a slot: FIFO within ``tenant``, weighted fair between tenants.

        Args:
            ttft_target_s: if given, a request whose expected queue wait already exceeds it is
                shed at once (reason ``slo``; not during a burst at an idle engine:
                :meth:`SlotCounter.slo_wait_s`). The wait is the tenant's
                (:meth:`FairQueue.position`). A queued one is refused (reason ``slo``) once
                it has waited the part of the target that the engine's recent time to a
                first token leaves (:meth:`SlotCounter.queue_wait_bound_s`), when that is
                shorter than ``max_queue_wait_s`` and its tenant is alone or over its share
                (:meth:`FairQueue.over_share`).
            tokens: the request's prompt tokens, image tokens included (0: unknown), for a
                burst's prefill budget (:meth:`SlotCounter.admits`) and, with ``image_tokens``,
                the prefill backlog: it enters only while :meth:`PrefillBacklog.admits` it and
                is refused (``slo``) once :meth:`PrefillBacklog.hopeless`.
            tenant: who sends it (the API key's tenant); ``weight`` (> 0) its share weight;
                ``user``: the end user a trusted front end named (shares the tenant's slots).

        Returns:
            the request's :class:`Slot`.

        Raises:
            Rejected: queue full, wait over ``max_queue_wait_s``, or SLO shedding.
            asyncio.CancelledError: the caller was cancelled (client left); the request has
                left the queue and holds no slot.
        """
        start = self._clock()
        self.slots.arrived()
        if self._first_wave:
            self._end_first_wave()
        if self._closed:
            raise Rejected(UNAVAILABLE, 1, self._closed_message)
        cost = self.backlog.cost(tokens, image_tokens)
        if not self.pending and self.backlog.admits_at(cost, self.slots) and \
                self.slots.admits(tokens):
            self.queue.started(tenant, user)
            return self._granted(self.slots.take(start, tokens), tenant, user, cost, tokens)
        who = _who(tenant)
        # A trusted front end's user: the bound is the user's (one user's flood must not
        # fill it for the others), and so is the position the SLO is judged on.
        if (queued := self.queue.queued(tenant, user)) >= self.max_queue:
            raise Rejected(QUEUE_FULL, self.retry_after_s(tenant),
                           f"Server busy: {who}{queued} requests already queued "
                           f"(max_queue={self.max_queue}).")
        wait = self.slots.slo_wait_s(self.queue.position(tenant, user), ttft_target_s,
                                     self.queue.ahead(tenant, self.slots.ahead()))
        if wait is not None:
            raise Rejected(SLO, self.retry_after_s(tenant),
                           f"Server busy: {who}expected queue wait {wait:.1f}s exceeds the "
                           f"TTFT target {ttft_target_s:.1f}s.")
        if self._hopeless(tenant, 0.0, cost, tokens, self.queue.position(tenant, user)):
            raise self._too_late(tenant, start)
        timeout, deadline = queue_wait_limit(self.slots, self.queue, tenant, ttft_target_s,
                                             self.max_queue_wait_s, user)
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        waiter = (fut, tokens, user, start, cost)
        self.queue.push(tenant, waiter, weight, user)
        if ttft_target_s is not None and not deadline and self.slots.first_wave() and \
                self.queue.over_share(tenant, user):
            self._first_wave.append((tenant, waiter, ttft_target_s))
        self._wake()  # it may be the next one already (another tenant's head is held back)
        try:
            slot = await asyncio.wait_for(asyncio.shield(fut), timeout)
        except asyncio.TimeoutError:
            self._abandon(tenant, waiter)
            if deadline:
                raise self._deadline_passed(tenant, timeout, ttft_target_s, start) from None
            raise Rejected(QUEUE_TIMEOUT, self.retry_after_s(tenant),
                           f"Server busy: {who}not admitted within max_queue_wait_s="
                           f"{self.max_queue_wait_s:g}s.",
                           queue_wait_s=self._clock() - start) from None
        except BaseException:
            self._abandon(tenant, waiter)
            raise
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            # Granted in the same tick the client left: wait_for swallowed the cancellation.
            self._abandon(tenant, waiter)
            raise asyncio.CancelledError
        slot.queue_wait_s = slot.admitted_at - start
        return slot

    def _deadline_passed(self, tenant: str, bound_s: float, ttft_target_s: float,
                         start: float) -> Rejected:
        """The refusal (reason ``slo``) of a request of ``tenant`` that arrived at ``start``
        and was not admitted within ``bound_s`` (:meth:`SlotCounter.queue_wait_bound_s`)."""
        who = _who(tenant)
        first = self.slots.first_token_s()
        recently = "" if first is None else f" (recently {first:.1f}s)"
        return Rejected(SLO, self.retry_after_s(tenant),
                        f"Server busy: {who}not admitted within {bound_s:.1f}s, what the TTFT "
                        f"target {ttft_target_s:.1f}s leaves before the engine's first "
                        f"token{recently}.", queue_wait_s=self._clock() - start)

    def _hopeless(self, tenant: str, waited_s: float, cost: float, tokens: int,
                  position: float) -> bool:
        """:meth:`PrefillBacklog.hopeless_behind` this queue, while ``tenant`` is the only one
        active (:meth:`FairQueue.share`); in a burst too (it predicts the burst's own)."""
        return self.queue.share(tenant) >= 1.0 and self.backlog.hopeless_behind(
            waited_s, cost, tokens, position, ((w[4], w[1]) for w in self.queue.items()))

    def _too_late(self, tenant: str, start: float) -> Rejected:
        """The refusal (``slo``) of ``tenant``'s request (arrived at ``start``): hopeless."""
        return Rejected(SLO, self.retry_after_s(tenant),
                        f"Server busy: {_who(tenant)}the prefill already admitted "
                        f"({self.backlog.backlog_s:.1f}s) leaves no time for a first token "
                        f"within the TTFT target {self.backlog.ttft_target_s:.1f}s.",
                        queue_wait_s=self._clock() - start)

    def first_tokens(self, n: int) -> None:
        """``n`` first tokens (the feed's ``on_first_tokens``): the prefill backlog drains."""
        if self.backlog.first_tokens(n):
            self._wake()

    def _end_first_wave(self) -> None:
        """An arrival came: once the open burst outgrew its first wave
        (:meth:`SlotCounter.first_wave_ended`), the first wave's requests still queued get
        the queue deadline from their arrival (refused when it passes); when no burst is
        open they keep none."""
        ended = self.slots.first_wave_ended()
        if ended is False:
            return
        waiting, self._first_wave = self._first_wave, []
        if ended is None:
            return
        now = self._clock()
        bounds: dict[float, float | None] = {}  # one p90 of the first tokens per target
        for tenant, waiter, ttft_target_s in waiting:
            if ttft_target_s not in bounds:
                bounds[ttft_target_s] = self.slots.queue_wait_bound_s(ttft_target_s)
            bound = bounds[ttft_target_s]
            if bound is not None and not waiter[0].done():
                asyncio.get_running_loop().call_later(
                    max(0.0, waiter[3] + bound - now), self._expire, tenant, waiter, bound,
                    ttft_target_s)

    def _expire(self, tenant: str, waiter: tuple, bound_s: float, ttft_target_s: float) -> None:
        """Refuse ``waiter`` at its deadline if it is still queued (:meth:`_end_first_wave`)."""
        fut = waiter[0]
        if not fut.done() and self.queue.remove(tenant, waiter):
            fut.set_exception(self._deadline_passed(tenant, bound_s, ttft_target_s, waiter[3]))
            self._wake()  # the next in line may fit what the one refused did not

    def reject_waiting(self, retry_after_s: int, message: str) -> int:
        """Refuse every queued request (reason ``unavailable``, ``message``) and queue no one
        after: the server is shutting down or lost its engine. Returns how many were refused."""
        self._closed = True
        self._closed_message = message
        refused = 0
        for fut, *_ in self.queue.drain():
            if not fut.done():
                fut.set_exception(Rejected(UNAVAILABLE, retry_after_s, message))
                refused += 1
        return refused

    def _granted(self, slot: Slot, tenant: str, user: str | None, cost: float = 0.0,
                 tokens: int = 0) -> Slot:
        """``slot`` is ``tenant``'s (``user``'s), its request predicted to prefill in
        ``cost`` seconds (``tokens`` prompt tokens): it joins the prefill backlog, and
        releasing it gives their share back (and leaves the backlog, if still in)."""
        backlog = self.backlog
        if not backlog.on:
            slot.on_release = lambda: self.queue.finished(tenant, user)
            return slot
        key = object()  # the backlog's key; not the slot, which would make a reference cycle
        backlog.add(key, cost, tokens)

        def released() -> None:
            self.queue.finished(tenant, user)
            backlog.discard(key)
        slot.on_release = released
        return slot

    def _abandon(self, tenant: str,
                 waiter: tuple[asyncio.Future, int, str | None, float, float]) -> None:
        """A waiter leaves (timeout, cancel). If it had been granted a slot meanwhile, hand the
        slot back, so no slot leaks."""
        fut = waiter[0]
        if fut.done() and not fut.cancelled() and fut.exception() is None:
            fut.result().release(completed=False)
        else:
            fut.cancel()
            self.queue.remove(tenant, waiter)

    def _wake(self) -> None:
        """Admit waiting requests while the counter has room, each to the tenant furthest
        below its share (:meth:`FairQueue.head`)."""
        while (head := self.queue.head()) is not None:
            tenant, waiter = head
            fut, tokens, user, arrived_at, cost = waiter
            if fut.done():  # cancelled, not yet removed
                self.queue.remove(tenant, waiter)
                continue
            if self._hopeless(tenant, self._clock() - arrived_at, cost, tokens, 0):
                self.queue.pop(tenant)
                fut.set_exception(self._too_late(tenant, arrived_at))
                continue
            if not self.backlog.admits_at(cost, self.slots) or \
                    not self.slots.admits(tokens, arrived_at):
                break
            self.queue.pop(tenant)
            fut.set_result(self._granted(
                self.slots.take(self._clock(), tokens, queued=True), tenant, user, cost,
                tokens))
