"""Admission by predicted prefill time: the costs from probes, the backlog, the limiter's use
of it, and the simulator's verdict that it earns its place (pure, no engine)."""

from __future__ import annotations

import asyncio

import pytest

from serve.admission.limiter import SLO, AdmissionLimiter, Rejected
from serve.admission.prefill import PrefillBacklog, PrefillCosts


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


async def settle() -> None:
    """Let granted waiters resume (a grant passes a future, a shield and a wait_for)."""
    for _ in range(5):
        await asyncio.sleep(0)


# --- costs ---------------------------------------------------------------------------------
def test_three_probes_give_back_the_costs_that_made_them():
    step, tok, img = 0.02, 0.0003, 0.0008

    def t(n, m=0):
        return step + tok * n + img * m

    costs = PrefillCosts.from_probes((16, t(16)), (1024, t(1024)), (773, 757, t(773, 757)))
    assert costs.step_s == pytest.approx(step)
    assert costs.token_s == pytest.approx(tok)
    assert costs.image_token_s == pytest.approx(img)
    assert costs.prefill_s(100, 50) == pytest.approx(100 * tok + 50 * img)


def test_timing_noise_never_makes_a_cost_negative():
    # The long probe faster than the short one (noise): no negative per-token cost.
    costs = PrefillCosts.from_probes((16, 0.05), (1024, 0.04), (773, 757, 0.01))
    assert costs.token_s == 0.0 and costs.image_token_s == 0.0 and costs.step_s == 0.05


def test_probes_that_cannot_be_told_apart_are_refused():
    with pytest.raises(ValueError, match="longer"):
        PrefillCosts.from_probes((16, 0.1), (16, 0.1), (773, 757, 0.5))
    with pytest.raises(ValueError, match="image tokens"):
        PrefillCosts.from_probes((16, 0.1), (512, 0.2), (773, 0, 0.5))


# --- the backlog ---------------------------------------------------------------------------
def backlog(target=2.0, **kw) -> PrefillBacklog:
    b = PrefillBacklog(target, step_tokens=1000, margin=1.0, **kw)
    b.costs = PrefillCosts(step_s=0.01, token_s=0.001, image_token_s=0.001)
    return b


def test_inactive_without_costs_or_outside_auto():
    b = PrefillBacklog(2.0)
    assert not b.on and b.cost(10_000) == 0.0
    b.add("x", 5.0, 5000)
    assert b.admits(5.0) and not b.hopeless(0.0, 1.0, 1000, ahead_s=5.0)
    b = backlog()
    b.active = False
    b.add("x", 5.0, 5000)
    assert b.admits(5.0)


def test_the_bound_admits_while_the_prefill_fits_the_target():
    b = backlog()
    assert b.admits(10.0)  # an empty backlog admits anything (the request alone)
    b.add("a", 1.5, 1500)
    assert b.admits(0.5) and not b.admits(0.6)
    b.add("b", 0.4, 400)
    assert b.backlog_s == pytest.approx(1.9) and b.backlog_tokens == 1900
    assert b.first_tokens(1)  # the oldest, "a", got its first token
    assert b.backlog_s == pytest.approx(0.4) and len(b) == 1
    b.discard("b")  # ended; discarding twice, or an unknown key, changes nothing
    b.discard("b")
    assert b.backlog_s == 0.0 and not b.first_tokens(3)


def test_hopeless_only_behind_work_and_only_if_alone_it_would_be_in_time():
    b = backlog()
    assert not b.hopeless(0.0, 1.5, 1500)  # nothing ahead
    b.add("a", 1.0, 1000)
    # 1.0 s ahead + 1.5 s own > 2 s: late behind the backlog, in time alone.
    assert b.hopeless(0.0, 1.5, 1500)
    assert not b.hopeless(0.0, 0.5, 500)
    # The time it already waited counts.
    assert b.hopeless(0.6, 0.5, 500)
    # A request too large to meet the target even alone is never refused for it.
    assert not b.hopeless(0.0, 2.5, 2500)
    # The queue ahead counts: position 3 of 4 queued at 0.2 s each adds 0.6 s.
    assert b.hopeless_behind(0.0, 0.5, 500, 3, [(0.2, 200)] * 4)
    assert not b.hopeless_behind(0.0, 0.5, 500, 0, [(0.2, 200)] * 4)


def test_each_rule_can_be_switched_off():
    b = backlog(ablate=frozenset({"prefill_backlog"}))
    b.add("a", 1.9, 1900)
    assert b.admits(1.0) and b.hopeless(0.0, 1.0, 1000)
    b = backlog(ablate=frozenset({"prefill_shed"}))
    b.add("a", 1.9, 1900)
    assert not b.admits(1.0) and not b.hopeless(0.0, 1.0, 1000)


def test_while_streams_decode_prefill_keeps_to_the_share_the_itl_target_leaves():
    """A stream gets a token per step; the steps that prefill take the rest of the time, so
    the prefill admitted over the window stays within 1 - step / ITL target of it."""
    clock = FakeClock()
    b = backlog(itl_target_s=0.05, clock=clock)  # step 10 ms: a share of 0.8
    assert b.duty_ratio() == pytest.approx(0.8) and b.duty_window_s == 4.0
    assert b.admits(5.0, streams=True)  # an empty window admits anything
    b.add("a", 1.5, 1500)
    b.first_tokens(1)
    clock.t += 1.0
    b.add("b", 1.5, 1500)
    b.first_tokens(1)  # the backlog is empty; 3.0 s admitted in the window of 3.2 s
    assert b.admits(0.2, streams=True) and not b.admits(0.3, streams=True)
    assert b.admits(0.3)  # no stream decoding: only the backlog bound
    clock.t += 3.5  # "a" left the window
    assert b.admitted_s == pytest.approx(1.5) and b.admits(1.7, streams=True)
    assert not b.admits(1.8, streams=True)
    assert b.state()["duty_ratio"] == pytest.approx(0.8)
    b.forget_share()  # the benchmark's reset between arms (AutotuneLoop.set_mode)
    assert b.admitted_s == 0.0 and b.admits(3.2, streams=True)


def test_the_prefill_share_is_off_without_an_itl_target_or_when_ablated():
    for b in (backlog(), backlog(itl_target_s=0.05, ablate=frozenset({"prefill_duty"}))):
        b.add("a", 1.9, 1900)
        b.first_tokens(1)
        assert b.admits(1.9, streams=True) and b.state()["duty_ratio"] is None
    b = PrefillBacklog(2.0, itl_target_s=0.05)  # costs unknown: the share is the whole time
    assert b.duty_ratio() == 1.0


# --- the limiter ---------------------------------------------------------------------------
def limiter(clock) -> AdmissionLimiter:
    lim = AdmissionLimiter(limit=64, max_queue=100, max_queue_wait_s=30, clock=clock,
                           ttft_target_s=2.0, step_tokens=4096)
    lim.backlog.costs = PrefillCosts(step_s=0.0, token_s=0.001, image_token_s=0.002)
    lim.backlog.margin = 1.0
    return lim


async def test_a_request_too_large_for_the_target_waits_for_an_empty_backlog():
    clock = FakeClock()
    lim = limiter(clock)
    # Photos of 300 image tokens (and 16 of text): 0.316 + 0.6 = 0.916 s of prefill each.
    first = lim.try_acquire(316, image_tokens=300)
    second = lim.try_acquire(316, image_tokens=300)
    assert first is not None and second is not None
    assert lim.backlog.backlog_s == pytest.approx(1.832)
    # A photo of 3.0 s cannot meet the 2-s target even alone: not refused, but it waits
    # until the prefill ahead is done, although slots are free.
    big = asyncio.ensure_future(lim.acquire(2.0, 1016, image_tokens=1000))
    await settle()
    assert not big.done() and lim.pending == 1 and lim.in_flight == 2
    lim.first_tokens(1)  # the engine's first token for the oldest
    await settle()
    assert not big.done()
    lim.first_tokens(1)
    await settle()
    assert big.done() and lim.in_flight == 3
    assert lim.backlog.backlog_s == pytest.approx(3.016)
    for slot in (first, second, big.result()):
        slot.release()
    assert lim.backlog.backlog_s == 0.0 and len(lim.backlog) == 0


async def test_a_request_the_backlog_makes_late_is_refused_at_once_with_the_reason():
    clock = FakeClock()
    lim = limiter(clock)
    held = [lim.try_acquire(316, image_tokens=300) for _ in range(2)]
    with pytest.raises(Rejected) as exc:
        await lim.acquire(2.0, 1000)  # 1.832 s ahead + 1.0 s own > 2 s; alone 1.0 s
    assert exc.value.reason == SLO and "prefill already admitted" in str(exc.value)
    # A short text still fits behind them.
    short = await lim.acquire(2.0, 100)
    assert lim.in_flight == 3
    for slot in [*held, short]:
        slot.release()


async def test_a_queued_request_is_refused_at_the_head_once_its_wait_made_it_late():
    clock = FakeClock()
    lim = limiter(clock)
    chat = lim.try_acquire(10)
    photos = [lim.try_acquire(316, image_tokens=300) for _ in range(2)]  # 1.832 s
    lim.first_tokens(1)  # the chat's first token: it leaves the backlog, keeps its slot
    lim.set_limit(3)
    waiter = asyncio.ensure_future(lim.acquire(2.0, 150))  # 1.832 + 0.15 <= 2: in time
    await settle()
    assert not waiter.done() and lim.pending == 1  # queued for a slot
    clock.t += 0.1  # 0.1 waited + 1.832 + 0.15 > 2: late now, though alone it is not
    chat.release()
    await settle()
    assert isinstance(waiter.exception(), Rejected) and waiter.exception().reason == SLO
    assert lim.pending == 0 and lim.in_flight == 2
    for slot in photos:
        slot.release()


async def test_with_another_tenant_active_the_backlog_orders_but_refuses_nothing():
    """The refusal is the engine's verdict on one tenant's own load; with several tenants
    active, the fair queue decides who goes next and the backlog only holds."""
    clock = FakeClock()
    lim = limiter(clock)
    held = [lim.try_acquire(316, "a", image_tokens=300) for _ in range(2)]  # 1.832 s
    late = asyncio.ensure_future(lim.acquire(2.0, 1000, tenant="b"))  # alone: refused
    await settle()
    assert not late.done() and lim.pending == 1
    lim.first_tokens(2)
    await settle()
    assert late.done() and late.exception() is None
    for slot in [*held, late.result()]:
        slot.release()


async def test_outside_auto_the_backlog_neither_holds_nor_refuses():
    clock = FakeClock()
    lim = limiter(clock)
    lim.backlog.active = False
    slots = [lim.try_acquire(316, image_tokens=300) for _ in range(5)]
    assert all(s is not None for s in slots) and len(lim.backlog) == 0
    for slot in slots:
        slot.release()


def test_the_limiter_counts_the_prefill_share_only_past_a_burst_and_while_streams_decode():
    clock = FakeClock()
    lim = AdmissionLimiter(limit=64, max_queue=100, max_queue_wait_s=30, clock=clock,
                           ttft_target_s=2.0, step_tokens=4096, itl_target_s=0.05)
    lim.backlog.costs = PrefillCosts(step_s=0.01, token_s=0.001, image_token_s=0.0)
    lim.backlog.margin = 1.0  # a share of 0.8 of 4 s: 3.2 s of prefill
    slots = []
    for _ in range(2):  # a burst at an idle engine: its own streams are not protected
        slots.append(lim.try_acquire(900))
        lim.first_tokens(1)
    assert lim.slots.bursts.current() is not None and all(slots)
    clock.t += 2.5  # the burst closed; two streams decode
    slots.append(lim.try_acquire(900))  # 2.7 s of prefill in the window
    lim.first_tokens(1)
    assert slots[-1] is not None and lim.try_acquire(900) is None  # 3.6 s: over the share
    for slot in slots:
        slot.release()
    assert lim.try_acquire(900) is not None  # no stream decoding: the backlog bound only


# --- the simulator's verdict ---------------------------------------------------------------
def _cpu_goods(ablate: frozenset[str], trace: str = "T2") -> int:
    """Good requests of auto on the cpu profile's ``trace`` (T2: bursts of photos and chats;
    T6: the chat mix, photos among it, at twice the capacity), seeds 0-2, with the rules
    ``ablate`` off."""
    from bench.simjudge import run_cells

    return sum(cell.good for seed in (0, 1, 2)
               for cell in run_cells("cpu", seed, ablate, arms=False, traces=[trace]))


def test_on_the_cpu_profile_the_backlog_serves_more_of_the_bursts_in_time():
    with_rules = _cpu_goods(frozenset())
    without = _cpu_goods(frozenset({"prefill_backlog", "prefill_shed"}))
    assert with_rules >= 1.2 * without, (with_rules, without)


def test_on_the_cpu_profile_the_prefill_share_keeps_more_answers_within_the_itl_target():
    with_rule = _cpu_goods(frozenset(), "T6")
    without = _cpu_goods(frozenset({"prefill_duty"}), "T6")
    assert with_rule >= 1.05 * without, (with_rule, without)
