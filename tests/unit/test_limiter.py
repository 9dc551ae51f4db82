"""Admission limiter: FIFO, bounds, release-exactly-once, no leaks (pure asyncio, no engine)."""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from serve.admission.limiter import QUEUE_FULL, QUEUE_TIMEOUT, SLO, AdmissionLimiter, Rejected
from serve.admission.slots import SlotCounter


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


async def serve_one_by_one(lim: AdmissionLimiter, clock: FakeClock, n: int,
                           seconds: float) -> None:
    """``n`` requests served one after another, ``seconds`` each: a drain rate of
    ``1 / seconds`` requests per second of busy time."""
    for _ in range(n):
        slot = await lim.acquire()
        clock.t += seconds
        slot.release()


async def test_fifo_order():
    lim = AdmissionLimiter(limit=1, max_queue=10, max_queue_wait_s=5)
    first = await lim.acquire()
    order: list[int] = []

    async def worker(i: int):
        slot = await lim.acquire()
        order.append(i)
        await asyncio.sleep(0)
        slot.release()

    tasks = []
    for i in range(5):
        tasks.append(asyncio.create_task(worker(i)))
        await asyncio.sleep(0)  # enqueue in a known order
    assert lim.pending == 5
    first.release()
    await asyncio.gather(*tasks)
    assert order == [0, 1, 2, 3, 4]
    assert lim.in_flight == 0 and lim.pending == 0


async def test_queue_full_is_rejected_with_retry_after():
    lim = AdmissionLimiter(limit=1, max_queue=2, max_queue_wait_s=5)
    held = await lim.acquire()
    waiters = [asyncio.create_task(lim.acquire()) for _ in range(2)]
    await asyncio.sleep(0)
    with pytest.raises(Rejected) as exc:
        await lim.acquire()
    assert exc.value.reason == QUEUE_FULL
    assert exc.value.retry_after_s >= 1
    held.release()
    for w in waiters:
        (await w).release()
    assert lim.in_flight == 0


async def test_queue_timeout():
    lim = AdmissionLimiter(limit=1, max_queue=5, max_queue_wait_s=0.05)
    held = await lim.acquire()
    with pytest.raises(Rejected) as exc:
        await lim.acquire()
    assert exc.value.reason == QUEUE_TIMEOUT
    assert exc.value.queue_wait_s >= 0.04
    assert lim.pending == 0
    held.release()
    assert lim.in_flight == 0


async def answered(lim: AdmissionLimiter, clock: FakeClock, first_tokens_s) -> None:
    """One answer after another, 10 ms each (a fast drain: nothing is shed on the expected
    wait), whose first tokens came ``first_tokens_s`` after admission."""
    for first in first_tokens_s:
        slot = await lim.acquire()
        clock.t += 0.01
        slot.release(first_token_at=slot.admitted_at + first)


async def test_a_queued_request_is_refused_once_the_ttft_target_left_cannot_cover_a_first_token():
    clock = FakeClock()
    lim = AdmissionLimiter(limit=1, max_queue=5, max_queue_wait_s=30, clock=clock,
                           burst_window_s=0.0)
    # No first token seen yet: the whole target (a TTFT is at least the queue wait).
    assert lim.slots.queue_wait_bound_s(0.35) == pytest.approx(0.35)
    await answered(lim, clock, [0.1] * 8 + [0.25, 0.3])  # p90: the 9th of 10
    assert lim.slots.first_token_s() == pytest.approx(0.25)
    assert lim.slots.queue_wait_bound_s(0.35) == pytest.approx(0.1)
    assert lim.slots.queue_wait_bound_s(0.2) == 0.0  # the engine alone takes longer
    assert lim.slots.queue_wait_bound_s(None) is None
    held = await lim.acquire()
    clock.t += 0.001  # past the window of the burst it opened at the idle counter
    started = time.monotonic()
    with pytest.raises(Rejected) as exc:
        await lim.acquire(ttft_target_s=0.35)
    waited = time.monotonic() - started
    assert exc.value.reason == SLO and "leaves before the engine's first token" in str(exc.value)
    assert 0.09 <= waited < 5, waited  # the 0.1 s the target left, not max_queue_wait_s
    assert lim.pending == 0
    # Without a TTFT target only max_queue_wait_s bounds the wait.
    waiter = asyncio.create_task(lim.acquire())
    await asyncio.sleep(0.2)
    assert not waiter.done()
    held.release()
    (await waiter).release()
    assert lim.in_flight == 0


def test_the_queue_deadline_waits_out_a_burst_and_can_be_switched_off():
    clock = FakeClock()
    for ablate, bound in ((frozenset(), 0.5), (frozenset({"queue_deadline"}), None)):
        counter = SlotCounter(4, clock=clock, ablate=ablate)
        counter.arrived()
        slot = counter.take(clock.t)  # reaches the idle counter: a burst opens
        slot.release(first_token_at=slot.admitted_at + 0.5)
        assert counter.queue_wait_bound_s(1.0) is None  # the burst's requests wait for it
        clock.t += 10  # its window (2 s) has ended
        assert counter.queue_wait_bound_s(1.0) == bound


def test_a_burst_past_the_ceiling_gets_the_queue_deadline():
    """A burst's first max_num_seqs arrivals wait for its first wave (plain vLLM would keep
    them); once it brings more, the bound is the queue deadline again: what the target
    leaves past the recent first tokens, the whole target without one seen."""
    clock = FakeClock()
    # burst_no_shed off: no burst waits, the recent first tokens (0.5 s) set the bound.
    for ablate, within in ((frozenset(), None), (frozenset({"burst_no_shed"}), 0.5)):
        counter = SlotCounter(2, clock=clock, ceiling=4, ablate=ablate)
        counter.arrived()
        slot = counter.take(clock.t)  # opens a burst
        slot.release(first_token_at=slot.admitted_at + 0.5)
        clock.t += 0.1
        counter.arrived()
        held = counter.take(clock.t)  # opens the next burst at the idle counter
        for _ in range(3):
            counter.arrived()  # 4 arrivals: the ceiling
        assert counter.queue_wait_bound_s(1.0) == within
        assert counter.first_wave_ended() is (False if not ablate else True)
        counter.arrived()  # the 5th is past any burst plain vLLM takes at once
        assert counter.queue_wait_bound_s(1.0) == pytest.approx(0.5)
        assert counter.first_wave_ended() is True
        held.release()
    fresh = SlotCounter(2, clock=clock, ceiling=4)
    clock.t += 10
    assert fresh.first_wave_ended() is None  # no burst open
    assert fresh.queue_wait_bound_s(1.5) == pytest.approx(1.5)  # no first token seen yet


async def test_a_first_wave_waits_until_its_burst_outgrows_the_ceiling():
    """The first wave's queued requests get no deadline while the burst stays within the
    ceiling; the arrival that takes it past gives them the queue deadline from their own
    arrival (a queue of requests that can no longer meet their target would hold the
    burst's later ones past theirs), and one already past it is refused (reason slo)."""
    clock = FakeClock()
    lim = AdmissionLimiter(limit=1, max_queue=100, max_queue_wait_s=60, clock=clock,
                           ceiling=3, burst_window_s=5.0)
    first = await lim.acquire(ttft_target_s=0.05)  # opens a burst
    second = asyncio.create_task(lim.acquire(ttft_target_s=0.05))  # arrivals 2, 3: its
    third = asyncio.create_task(lim.acquire(ttft_target_s=0.05))   # first wave, queued
    await asyncio.sleep(0.15)  # three times the target: no deadline
    assert not second.done() and not third.done() and lim.pending == 2
    clock.t += 0.02  # the 4th arrival: past the ceiling
    fourth = asyncio.create_task(lim.acquire(ttft_target_s=0.05))
    for task in (second, third, fourth):
        with pytest.raises(Rejected) as exc:
            await asyncio.wait_for(task, 1)
        assert exc.value.reason == SLO
    assert lim.pending == 0 and lim.in_flight == 1
    first.release()
    assert lim.in_flight == 0


async def test_the_queue_deadline_refuses_the_tenant_over_its_share_not_the_one_within_it():
    clock = FakeClock()
    lim = AdmissionLimiter(limit=2, max_queue=5, max_queue_wait_s=30, clock=clock,
                           burst_window_s=0.0)
    await answered(lim, clock, (0.25,) * 3)
    flood = [await lim.acquire(tenant="flood"), await lim.acquire(tenant="flood")]
    clock.t += 0.001
    light = asyncio.create_task(lim.acquire(ttft_target_s=0.35, tenant="light"))
    with pytest.raises(Rejected) as exc:  # flood holds both slots, over its half
        await lim.acquire(ttft_target_s=0.35, tenant="flood")
    assert exc.value.reason == SLO
    await asyncio.sleep(0.2)  # past the deadline: light holds none, below its half
    assert not light.done()
    flood.pop().release()
    (await light).release()
    flood.pop().release()
    assert lim.in_flight == 0


async def test_slo_shedding_uses_completion_rate():
    clock = FakeClock()
    lim = AdmissionLimiter(limit=1, max_queue=100, max_queue_wait_s=60, clock=clock)
    await serve_one_by_one(lim, clock, 4, 1.0)  # a drain rate of 1 request/s
    assert lim.completion_rate() == pytest.approx(1.0, rel=0.01)
    clock.t += 20.0  # idle time does not dilute the service rate of a busy server
    assert lim.completion_rate() == pytest.approx(1.0, rel=0.01)
    held = await lim.acquire()
    clock.t += 2.5  # busy past the window of the burst it opened: sustained traffic
    queued = [asyncio.create_task(lim.acquire()) for _ in range(3)]
    await asyncio.sleep(0)
    # 4th in line: expected wait (3+1)/1 = 4 s > 2 s target -> shed.
    with pytest.raises(Rejected) as exc:
        await lim.acquire(ttft_target_s=2.0)
    assert exc.value.reason == SLO
    assert exc.value.retry_after_s == 4
    # A lenient target is queued instead.
    lenient = asyncio.create_task(lim.acquire(ttft_target_s=100.0))
    await asyncio.sleep(0)
    assert lim.pending == 4
    held.release()
    for t in [*queued, lenient]:
        (await t).release()
    assert lim.in_flight == 0


async def test_the_benchmark_switch_forgets_the_drain_rate_the_arm_before_measured():
    """``AutotuneLoop.set_mode`` starts each arm of the witness from a booted server's state:
    the limiter forgets its completion-rate window and first-token samples, so a burst of
    the next arm queues (as in the simulator, which replays each arm from boot) instead of
    being shed by the rate the previous arm's traffic showed."""
    from serve.admission.controller import Controller, ControllerConfig
    from serve.admission.engine_stats import EngineStatsFeed
    from serve.admission.loop import AutotuneLoop
    from serve.settings import Settings

    clock = FakeClock()
    lim = AdmissionLimiter(limit=1, max_queue=100, max_queue_wait_s=60, clock=clock)
    loop = AutotuneLoop(Controller(ControllerConfig.from_settings(Settings(device="cuda")), 1),
                        lim, EngineStatsFeed(clock=clock), mode="static", interval_s=1.0,
                        clock=clock)

    async def burst() -> tuple[object, list[asyncio.Task]]:
        held = await lim.acquire()
        clock.t += 2.5  # past the window of the burst it opened
        queued = [asyncio.create_task(lim.acquire()) for _ in range(3)]
        await asyncio.sleep(0)
        return held, queued

    async def drain(held, queued) -> None:
        held.release()
        for t in queued:
            (await t).release()

    for first in (0.5, 0.5, 0.5, 0.5):  # the last arm's traffic: 1 request/s
        slot = await lim.acquire()
        clock.t += 1.0
        slot.release(first_token_at=slot.admitted_at + first)
    assert lim.completion_rate() == pytest.approx(1.0, rel=0.01)
    held, queued = await burst()
    with pytest.raises(Rejected) as exc:  # 4th in line: (3 + 1) / 1 s > 2 s
        await lim.acquire(ttft_target_s=2.0)
    assert exc.value.reason == SLO
    await drain(held, queued)

    loop.set_mode("static", 1)
    assert lim.completion_rate() is None and lim.slots.first_token_s() is None
    held, queued = await burst()
    fourth = asyncio.create_task(lim.acquire(ttft_target_s=2.0))
    await asyncio.sleep(0)
    assert not fourth.done() and lim.pending == 4  # queued, not shed
    await drain(held, [*queued, fourth])
    assert lim.in_flight == 0


async def test_cancel_while_queued_frees_place():
    lim = AdmissionLimiter(limit=1, max_queue=5, max_queue_wait_s=5)
    held = await lim.acquire()
    waiter = asyncio.create_task(lim.acquire())
    await asyncio.sleep(0)
    assert lim.pending == 1
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert lim.pending == 0
    held.release()
    assert lim.in_flight == 0
    (await lim.acquire()).release()


async def test_cancel_after_grant_returns_slot():
    """A waiter granted a slot in the same tick it is cancelled must not leak it."""
    lim = AdmissionLimiter(limit=1, max_queue=5, max_queue_wait_s=5)
    held = await lim.acquire()
    waiter = asyncio.create_task(lim.acquire())
    await asyncio.sleep(0)
    held.release()  # grants the waiter's future...
    waiter.cancel()  # ...and the client leaves before it runs
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert lim.in_flight == 0


async def test_release_exactly_once():
    lim = AdmissionLimiter(limit=2, max_queue=5, max_queue_wait_s=5)
    slot = await lim.acquire()
    assert slot.release() is True
    assert slot.release() is False
    assert lim.in_flight == 0


async def test_raise_limit_admits_at_once_and_lower_drains():
    lim = AdmissionLimiter(limit=1, max_queue=10, max_queue_wait_s=5)
    a = await lim.acquire()
    waiters = [asyncio.create_task(lim.acquire()) for _ in range(3)]
    await asyncio.sleep(0)
    lim.set_limit(4)
    await asyncio.sleep(0)
    slots = [await w for w in waiters]
    assert lim.in_flight == 4 and lim.pending == 0
    lim.set_limit(2)  # lowering aborts nobody
    assert lim.in_flight == 4
    late = asyncio.create_task(lim.acquire())
    await asyncio.sleep(0)
    a.release()
    slots[0].release()
    await asyncio.sleep(0)
    assert not late.done()  # still 2 in flight == limit
    slots[1].release()
    (await late).release()
    slots[2].release()
    assert lim.in_flight == 0


async def test_no_slot_leak_after_200_mixed_requests():
    rng = random.Random(7)
    lim = AdmissionLimiter(limit=4, max_queue=20, max_queue_wait_s=0.05)
    peak = 0
    outcomes = {"ok": 0, "error": 0, "rejected": 0, "cancelled": 0}

    async def request(i: int):
        nonlocal peak
        kind = rng.choice(["ok", "error", "cancel_running", "slow"])
        try:
            slot = await lim.acquire()
        except Rejected:
            outcomes["rejected"] += 1
            return
        peak = max(peak, lim.in_flight)
        try:
            await asyncio.sleep(rng.uniform(0, 0.01) + (0.08 if kind == "slow" else 0))
            if kind == "error":
                raise RuntimeError("engine error")
            if kind == "cancel_running":
                raise asyncio.CancelledError
            outcomes["ok"] += 1
        except RuntimeError:
            outcomes["error"] += 1
        except asyncio.CancelledError:
            outcomes["cancelled"] += 1
        finally:
            slot.release(completed=kind == "ok")

    tasks = []
    for i in range(200):
        tasks.append(asyncio.create_task(request(i)))
        if i % 10 == 0:
            await asyncio.sleep(0.005)
        if i % 17 == 0:  # clients that leave while queued
            tasks[-1].cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    assert lim.in_flight == 0 and lim.pending == 0
    assert peak <= 4
    assert outcomes["ok"] > 0 and outcomes["rejected"] > 0


async def test_engine_queue_only_at_the_ceiling():
    """At the ceiling a few more requests go in to wait inside vLLM (preprocessed); below it
    the live limit is exact."""
    lim = AdmissionLimiter(limit=4, max_queue=10, max_queue_wait_s=5, ceiling=4, engine_queue=2)
    slots = [await asyncio.wait_for(lim.acquire(), 1) for _ in range(6)]
    assert lim.in_flight == 6 and lim.pending == 0 and lim.capacity == 6
    waiting = asyncio.create_task(lim.acquire())
    await asyncio.sleep(0)
    assert lim.pending == 1
    lim.set_limit(3)  # below the ceiling: exact, nothing new until in-flight < 3
    assert lim.capacity == 3
    for s in slots[:3]:
        s.release()
    await asyncio.sleep(0)
    assert not waiting.done() and lim.in_flight == 3
    slots[3].release()
    slot = await asyncio.wait_for(waiting, 1)
    assert lim.in_flight == 3
    for s in [*slots[4:], slot]:
        s.release()
    assert lim.in_flight == 0


async def test_engine_queue_holds_what_meets_the_ttft_target():
    """At the ceiling the engine queue takes only the requests that get a batch slot within
    the TTFT target at the measured drain rate; the rest wait at the gateway, where SLO
    shedding counts the engine-queued ones ahead of them."""
    clock = FakeClock()
    lim = AdmissionLimiter(limit=4, max_queue=100, max_queue_wait_s=60, clock=clock,
                           ceiling=4, engine_queue=32, engine_queue_wait_s=1.5,
                           burst_window_s=0.1)
    # No rate yet: how long the engine queue takes is unknown, so it holds none (a flood at
    # boot would otherwise put ceiling + engine_queue into the engine at once).
    assert lim.capacity == 4
    await serve_one_by_one(lim, clock, 3, 0.5)  # a drain rate of 2 requests/s of busy time
    assert lim.completion_rate() == pytest.approx(2.0, rel=0.01)
    assert lim.capacity == 4 + 3  # floor(2/s x 1.5 s) engine-queued
    slots = [await asyncio.wait_for(lim.acquire(), 1) for _ in range(7)]
    assert lim.in_flight == 7 and lim.slots.ahead() == 3
    clock.t += 0.2  # busy past the window of the burst they opened: sustained traffic
    # The next one queues at the gateway; its batch slot comes after the 3 engine-queued:
    # (3 + 0 + 1) / 2 = 2 s.
    assert lim.expected_wait_s(0) == pytest.approx(2.0, rel=0.01)
    with pytest.raises(Rejected) as exc:
        await lim.acquire(ttft_target_s=1.5)
    assert exc.value.reason == SLO
    queued = asyncio.create_task(lim.acquire(ttft_target_s=10.0))
    await asyncio.sleep(0)
    assert lim.pending == 1
    slots[0].release()  # a batch slot frees: the engine queue has room again
    slot = await asyncio.wait_for(queued, 1)
    for s in [*slots[1:], slot]:
        s.release()
    assert lim.in_flight == 0 and lim.pending == 0


async def test_expected_wait_counts_a_draining_limit():
    """After the limit was lowered below the requests in flight, a queued request waits for
    the excess to finish too."""
    clock = FakeClock()
    lim = AdmissionLimiter(limit=4, max_queue=100, max_queue_wait_s=60, clock=clock)
    await serve_one_by_one(lim, clock, 3, 1.0)
    slots = [await lim.acquire() for _ in range(4)]
    lim.set_limit(2)
    assert lim.slots.ahead() == 2
    assert lim.expected_wait_s(0) == pytest.approx((2 + 1) / 1.0, rel=0.01)
    for s in slots:
        s.release()


async def test_a_burst_goes_past_the_limit_while_its_prompts_fit_the_budget():
    """Requests reaching an idle limiter while a burst budget is set go in past the limit,
    in arrival order, while the burst's prompt tokens fit the budget; the rest waits for the
    limit; after the window, by count only."""
    clock = FakeClock()
    lim = AdmissionLimiter(limit=2, max_queue=100, max_queue_wait_s=60, clock=clock,
                           ceiling=8, burst_window_s=2.0)
    lim.set_burst_budget(1000)
    slots = [await asyncio.wait_for(lim.acquire(tokens=300), 1) for _ in range(3)]
    assert lim.in_flight == 3 > lim.limit and lim.slots.burst_admitted == (900, 3)
    fourth = asyncio.create_task(lim.acquire(tokens=300))  # 1,200 > 1,000: waits
    fifth = asyncio.create_task(lim.acquire(tokens=50))  # FIFO: behind it
    await asyncio.sleep(0)
    assert lim.pending == 2
    lim.set_burst_budget(1200)  # the rate measured on the burst itself is higher
    await asyncio.wait_for(fourth, 1)
    assert not fifth.done() and lim.in_flight == 4
    clock.t += 2.5  # the window ends: by count again (4 in flight, limit 2)
    assert lim.slots.burst_admitted is None and not lim.slots.admits(50)
    for s in [*slots, fourth.result()][:3]:
        s.release()
    last = await asyncio.wait_for(fifth, 1)  # 1 in flight < 2
    fourth.result().release()
    last.release()
    assert lim.in_flight == 0


async def test_a_later_arrival_in_a_burst_may_bring_what_the_engine_prefills_meanwhile():
    """Rule ``burst_deadline``: a request that arrives s seconds after its burst opened meets
    its TTFT target s seconds later, so the budget grows by the prefill rate x s for it. A
    queued request is judged by its arrival, not by when a release wakes it; with the rule
    switched off the budget stays flat."""
    clock = FakeClock()
    lim = AdmissionLimiter(limit=1, max_queue=100, max_queue_wait_s=60, clock=clock,
                           ceiling=8, burst_window_s=2.0)
    lim.set_burst_budget(600, rate=300.0)  # 600 tokens = 300 tokens/s x a 2 s target
    first = await lim.acquire(tokens=300)
    second = await asyncio.wait_for(lim.acquire(tokens=300), 1)  # 600: the budget
    assert not lim.slots.admits(200)  # at once: 800 > 600
    clock.t += 0.5
    assert lim.slots.admits(150)  # 750 <= 600 + 300 x 0.5
    assert not lim.slots.admits(151)
    third = await asyncio.wait_for(lim.acquire(tokens=150), 1)
    held = asyncio.create_task(lim.acquire(tokens=200))  # at 0.5 s: 950 > 750, held
    await asyncio.sleep(0)
    clock.t += 1.0  # a wake at 1.5 s judges it by its arrival at 0.5 s: still held
    lim.set_burst_budget(600, rate=300.0 + 1e-9)
    await asyncio.sleep(0)
    assert not held.done() and lim.in_flight == 3
    held.cancel()
    for s in (first, second, third):
        s.release()
    flat = SlotCounter(1, clock=clock, ceiling=8, ablate=frozenset({"burst_deadline"}))
    flat.set_burst_budget(600, rate=300.0)
    flat.take(clock(), 600)
    clock.t += 1.0
    assert not flat.admits(150)  # the rule off: no growth


async def test_a_raise_during_a_held_back_burst_admits_nothing_late():
    """Once the budget held a request back, the rest of the burst is late: a raise of the
    limit in the window admits none of it. When the window ends the limit is still the one
    the autotuner set: the limiter never writes it."""
    clock = FakeClock()
    lim = AdmissionLimiter(limit=2, max_queue=100, max_queue_wait_s=60, clock=clock,
                           ceiling=8, burst_window_s=2.0)
    lim.set_burst_budget(600)
    a, b = await lim.acquire(tokens=300), await lim.acquire(tokens=300)
    late = asyncio.create_task(lim.acquire(tokens=300))  # 900 > 600: held back
    await asyncio.sleep(0)
    lim.set_limit(5)  # the autotuner's demand probe
    await asyncio.sleep(0)
    assert not late.done() and lim.in_flight == 2
    clock.t += 2.5
    assert lim.slots.burst_admitted is None and lim.limit == 5
    a.release()  # by count again
    slot = await asyncio.wait_for(late, 1)
    for s in (b, slot):
        s.release()


async def test_the_budget_never_holds_back_what_the_limit_admits():
    """An idle engine takes a burst up to its limit at once, whatever its prompts."""
    lim = AdmissionLimiter(limit=4, max_queue=100, max_queue_wait_s=60, ceiling=8)
    lim.set_burst_budget(100)
    slots = [await asyncio.wait_for(lim.acquire(tokens=5000), 1) for _ in range(4)]
    assert lim.in_flight == 4 and not lim.slots.admits(1)  # the limit, and the budget spent
    for s in slots:
        s.release()


async def test_a_burst_goes_past_the_limit_only_up_to_its_cap():
    """Past the limit up to the cap the controller gives (the KV fit, what the engine held
    under the inter-token target), the ceiling at most."""
    lim = AdmissionLimiter(limit=2, max_queue=100, max_queue_wait_s=60, ceiling=8)
    lim.set_burst_budget(10_000, cap=3)
    slots = [await asyncio.wait_for(lim.acquire(tokens=100), 1) for _ in range(3)]
    assert not lim.slots.admits(100)  # the cap, not the budget
    for s in slots:
        s.release()
    lim.set_burst_budget(10_000)  # no cap: the ceiling
    slots = [await asyncio.wait_for(lim.acquire(tokens=100), 1) for _ in range(8)]
    assert lim.in_flight == 8 and not lim.slots.admits(100)
    for s in slots:
        s.release()


async def test_without_a_budget_or_a_size_admission_is_by_count():
    lim = AdmissionLimiter(limit=2, max_queue=100, max_queue_wait_s=60, ceiling=8)
    held = [await lim.acquire(tokens=100) for _ in range(2)]
    assert not lim.slots.admits(100)  # no budget: the limit binds
    for s in held:
        s.release()
    lim.set_burst_budget(10_000)
    held = [await lim.acquire(tokens=0), await lim.acquire(tokens=0)]
    assert not lim.slots.admits(0)  # size unknown: by count, even in a burst
    assert lim.slots.admits(100)  # a known size fits the burst's budget
    for s in held:
        s.release()


async def test_a_burst_at_an_idle_server_is_queued_not_shed():
    """The requests of a burst that reaches an idle limiter and that the limit holds back
    wait for its first wave (as plain vLLM's waiting queue keeps them), whatever the drain
    rate measured before says; once the counter has been busy past the burst's window,
    the same expected wait sheds (reason ``slo``)."""
    clock = FakeClock()
    lim = AdmissionLimiter(limit=2, max_queue=100, max_queue_wait_s=60, clock=clock,
                           ceiling=8, burst_window_s=2.0)
    await serve_one_by_one(lim, clock, 4, 1.0)  # a drain rate of 1 request/s
    clock.t += 10.0  # idle
    first = [await asyncio.wait_for(lim.acquire(ttft_target_s=0.5), 1) for _ in range(2)]
    assert lim.expected_wait_s(0) == pytest.approx(1.0, rel=0.01)  # > the 0.5-s target
    clock.t += 1.0  # still within the burst's 2-s window
    rest = [asyncio.create_task(lim.acquire(ttft_target_s=0.5)) for _ in range(3)]
    await asyncio.sleep(0)
    assert lim.pending == 3 and not any(t.done() for t in rest)
    clock.t += 1.5  # the window is over: the counter is busy with sustained traffic
    with pytest.raises(Rejected) as exc:
        await lim.acquire(ttft_target_s=0.5)
    assert exc.value.reason == SLO
    first[0].release()
    first[1].release()
    slots = [await asyncio.wait_for(t, 1) for t in rest[:2]]
    slots[0].release()
    slots.append(await asyncio.wait_for(rest[2], 1))
    for s in slots[1:]:
        s.release()
    assert lim.in_flight == 0 and lim.pending == 0


async def test_a_burst_spread_out_by_its_intake_stays_one_burst():
    """A burst's requests that reach the gateway one by one, each within the window of the
    one before (its intake spreads them out), go in past the limit by the budget however
    long they take in all; a request of unknown size does not extend the window, and once
    the budget held one back the window runs out from the last one it admitted."""
    clock = FakeClock()
    lim = AdmissionLimiter(limit=1, max_queue=100, max_queue_wait_s=60, clock=clock,
                           ceiling=8, burst_window_s=0.5)
    lim.set_burst_budget(200)
    slots = [await asyncio.wait_for(lim.acquire(tokens=40), 1)]
    for _ in range(3):  # 0.4 s apart: 1.2 s in all, past a window from the first
        clock.t += 0.4
        slots.append(await asyncio.wait_for(lim.acquire(tokens=40), 1))
    assert lim.in_flight == 4 and lim.slots.burst_admitted == (160, 4)
    late = asyncio.create_task(lim.acquire(tokens=60))  # 220 > 200: held back, queued
    await asyncio.sleep(0)
    assert lim.pending == 1
    clock.t += 0.4
    assert lim.slots.burst_admitted == (160, 4)  # the window runs from the last admitted
    clock.t += 0.2
    assert lim.slots.burst_admitted is None and lim.limit == 1
    for s in slots:
        s.release()
    (await asyncio.wait_for(late, 1)).release()
    # Unknown sizes (0) are admitted by count and do not keep a burst open.
    lim.set_limit(2)
    first = await lim.acquire(tokens=40)
    clock.t += 0.4
    unknown = await asyncio.wait_for(lim.acquire(), 1)  # by count: 2 in flight
    clock.t += 0.2
    assert lim.slots.burst_admitted is None  # 0.6 s after the last sized one
    first.release()
    unknown.release()
    assert lim.in_flight == 0


async def test_a_burst_that_fills_the_engine_stops_running_on():
    """Held back by the ceiling (not the budget), a burst request waits and the burst's
    window no longer runs on: sustained traffic at the ceiling, whose requests are admitted
    from the queue one by one, is shed again once the window from the last arrival admitted
    on its own ends."""
    clock = FakeClock()
    lim = AdmissionLimiter(limit=2, max_queue=100, max_queue_wait_s=60, clock=clock,
                           ceiling=2, burst_window_s=0.5)
    await serve_one_by_one(lim, clock, 4, 1.0)  # a drain rate of 1 request/s
    clock.t += 10.0
    lim.set_burst_budget(1000)
    a, b = await lim.acquire(tokens=40), await lim.acquire(tokens=40)
    clock.t += 0.4
    c = asyncio.create_task(lim.acquire(ttft_target_s=0.5, tokens=40))  # the ceiling: waits
    await asyncio.sleep(0)
    assert lim.pending == 1  # queued, not shed: the burst is open
    a.release()
    c_slot = await asyncio.wait_for(c, 1)  # admitted from the queue: no run-on
    clock.t += 0.2  # 0.6 s after the last request admitted on arrival
    assert lim.slots.burst_admitted is None
    with pytest.raises(Rejected) as exc:
        await lim.acquire(ttft_target_s=0.5, tokens=40)
    assert exc.value.reason == SLO
    b.release()
    c_slot.release()
    assert lim.in_flight == 0


async def test_a_queued_request_taking_the_last_freed_slot_opens_no_burst():
    """At limit 1 every completion leaves the counter empty for an instant; the queued head
    that takes the slot did not reach an idle server, so it opens no burst: sustained
    overload stays shed, and the queue does not go in past the limit by a budget."""
    clock = FakeClock()
    lim = AdmissionLimiter(limit=1, max_queue=100, max_queue_wait_s=600, clock=clock,
                           ceiling=8, burst_window_s=2.0)
    await serve_one_by_one(lim, clock, 4, 1.0)  # a drain rate of 1 request/s
    lim.set_burst_budget(1000)
    held = await lim.acquire(tokens=40)
    clock.t += 2.5  # busy past the window of the burst it opened
    queued = [asyncio.create_task(lim.acquire(tokens=40)) for _ in range(3)]
    await asyncio.sleep(0)
    for _ in range(3):  # each completion hands the slot to the head of the queue
        clock.t += 1.0
        held.release()
        assert lim.in_flight == 1 and lim.slots.burst_admitted is None
        for _ in range(3):  # the granted waiter returns from acquire()
            await asyncio.sleep(0)
        held = next(t for t in queued if t.done()).result()
        queued = [t for t in queued if not t.done()]
        queued.append(asyncio.create_task(lim.acquire(tokens=40)))
        await asyncio.sleep(0)
    assert lim.pending == 3
    with pytest.raises(Rejected) as exc:  # 4th in line: (3 + 1) / 1 s > 2 s
        await lim.acquire(ttft_target_s=2.0, tokens=40)
    assert exc.value.reason == SLO
    held.release()
    for t in queued:
        (await asyncio.wait_for(t, 1)).release()
    assert lim.in_flight == 0


async def test_the_requests_the_next_probe_admits_are_queued_not_shed():
    """The expected wait is Little's law at the limit now; the autotuner's next probe raises
    it (``probe_no_shed``): the first ``probe_room`` places of the queue wait for it, the
    rest are shed as before, and a fixed limit (room 0) sheds them all."""
    clock = FakeClock()
    lim = AdmissionLimiter(limit=1, max_queue=100, max_queue_wait_s=60, clock=clock)
    await serve_one_by_one(lim, clock, 4, 1.0)  # a drain rate of 1 request/s
    held = await lim.acquire()
    clock.t += 2.5  # past the burst window: sustained traffic
    lim.slots.set_probe_room(3)
    queued = [asyncio.create_task(lim.acquire(ttft_target_s=0.5)) for _ in range(3)]
    await asyncio.sleep(0)
    assert lim.pending == 3  # expected waits 1, 2 and 3 s > 0.5 s, within the room
    with pytest.raises(Rejected) as exc:
        await lim.acquire(ttft_target_s=0.5)  # 4th in line: past the room
    assert exc.value.reason == SLO
    lim.slots.set_probe_room(0)
    with pytest.raises(Rejected):
        await lim.acquire(ttft_target_s=0.5)
    lim.set_limit(4)  # the probe
    for t in queued:
        (await t).release()
    held.release()
    assert lim.in_flight == 0 and lim.pending == 0
