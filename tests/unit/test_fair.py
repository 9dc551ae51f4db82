"""Weighted fair sharing of the admission slots between tenants (serve.admission.fair), in the
server's limiter and on the simulator's two-tenant trace (H200 profile)."""

from __future__ import annotations

import asyncio
import functools
from dataclasses import replace

import pytest

from serve.admission.fair import FairQueue
from serve.admission.limiter import QUEUE_FULL, AdmissionLimiter, Rejected


def test_one_tenant_is_a_fifo():
    q: FairQueue[int] = FairQueue()
    for i in range(5):
        q.push("default", i)
    out = []
    while (head := q.head()) is not None:
        out.append(q.pop(head[0]))
    assert out == [0, 1, 2, 3, 4] and q.in_flight("default") == 5
    assert q.position("default") == 0 and not q.below_share("default")


def test_the_next_slot_goes_to_the_tenant_furthest_below_its_weighted_share():
    q: FairQueue[str] = FairQueue()
    for _ in range(6):
        q.started("a")  # a holds 6 slots
    q.push("a", "a1", weight=3.0)
    q.push("b", "b1", weight=1.0)
    q.push("b", "b2", weight=1.0)
    # a: 6/3 = 2 > b: 0/1 -> b, then b again (1/1 < 2), then b has 2/1 = 2 == a's 2: the
    # earlier arrival (a1) wins the tie.
    order = []
    while (head := q.head()) is not None:
        order.append(q.pop(head[0]))
    assert order == ["b1", "b2", "a1"]
    # 9 slots in use, weights 3:1: a holds 7 (over its 6.75), b 2 (under its 2.25).
    assert q.below_share("b") and not q.below_share("a")
    q.finished("a")
    assert q.in_flight("a") == 6


def test_a_slot_past_a_whole_split_goes_to_the_heavier_tenant():
    """Weights 3:1 holding 12:4 (their exact shares of 16): the 17th slot goes to the heavier
    tenant (13:4 is nearer 12.75:4.25 than 12:5), and a slot that frees goes back to whose
    it was. Slots held / weight alone (Adams' method) ties 4 = 4 here and gives the slot to
    the earlier arrival, the lighter tenant's, at every such step."""
    q: FairQueue[str] = FairQueue()
    for _ in range(12):
        q.started("a")
    for _ in range(4):
        q.started("b")
    q.push("b", "b1", weight=1.0)  # b's request waited longer
    q.push("a", "a1", weight=3.0)
    assert q.head() == ("a", "a1")
    assert q.pop("a") == "a1"
    q.push("a", "a2", weight=3.0)
    q.finished("b")  # 13:3 -> b is furthest below its share
    assert q.head() == ("b", "b1")


def test_share_and_position_scale_with_the_active_tenants():
    q: FairQueue[str] = FairQueue()
    q.push("a", "x", weight=3.0)
    q.started("b")
    assert q.share("a") == pytest.approx(0.75) and q.share("b") == pytest.approx(0.25)
    # b holds the only slot: 1 - 0.25 over its share; a holds none: below its share.
    assert q.below_share("a") and not q.below_share("b")
    assert q.position("a") == 2 and q.position("b") == 3
    assert q.ahead("a", 10) == 0 and q.ahead("b", 10) == 10
    assert FairQueue(frozenset({"fair_below_share"})).ahead("a", 10) == 10


async def test_a_flooding_tenant_does_not_delay_another_in_the_limiter():
    lim = AdmissionLimiter(limit=2, max_queue=3, max_queue_wait_s=5)
    held = [await lim.acquire(tenant="flood") for _ in range(2)]
    flood = [asyncio.ensure_future(lim.acquire(tenant="flood")) for _ in range(3)]
    await asyncio.sleep(0)
    # The flooding tenant's queue is full: its next request is refused, naming it.
    with pytest.raises(Rejected) as rej:
        await lim.acquire(tenant="flood")
    assert rej.value.reason == QUEUE_FULL and "tenant 'flood'" in str(rej.value)
    light = asyncio.ensure_future(lim.acquire(tenant="light"))
    await asyncio.sleep(0)
    held.pop(0).release()  # the first free slot goes to the light tenant, not the FIFO head
    slot = await asyncio.wait_for(light, 1)
    assert not any(f.done() for f in flood)
    slot.release()
    held.pop().release()
    for f in flood:
        (await asyncio.wait_for(f, 1)).release()
    assert lim.in_flight == 0 and lim.queue.in_flight("flood") == 0


async def test_weights_split_the_slots_under_joint_overload():
    lim = AdmissionLimiter(limit=4, max_queue=100, max_queue_wait_s=5)
    first = [await lim.acquire(tenant=t, weight=w) for t, w in (("a", 3.0),) * 4]
    waiting = {t: [asyncio.ensure_future(lim.acquire(tenant=t, weight=w)) for _ in range(40)]
               for t, w in (("a", 3.0), ("b", 1.0))}
    await asyncio.sleep(0)
    admitted = {"a": 0, "b": 0}
    running = list(first)
    for _ in range(40):  # one slot frees at a time; count who gets it
        running.pop(0).release()
        await asyncio.sleep(0)
        for tenant, futs in waiting.items():
            for f in [f for f in futs if f.done()]:
                futs.remove(f)
                admitted[tenant] += 1
                running.append(f.result())
    assert admitted["a"] / admitted["b"] == pytest.approx(3.0, rel=0.1)
    for futs in waiting.values():
        for f in futs:
            f.cancel()


# --- the simulator's two-tenant trace, H200 profile --------------------------------------
@functools.lru_cache(maxsize=None)
def _h200():
    from bench.autotune import measure_capacity, suite_setup

    setup, num_crops = suite_setup("h200")
    return setup, measure_capacity(setup, num_crops, 0)


def _run(rates, weights=None, ablate=frozenset()):
    from bench.sim import simulate
    from bench.trace import tenants_trace

    setup, capacity = _h200()
    setup = replace(setup, controller=replace(setup.controller, ablate=ablate))
    trace = tenants_trace(capacity, rates, seed=0, duration_s=240, weights=weights)
    return setup, trace, simulate(trace, "auto", None, setup)


def _p90(values):
    values = sorted(values)
    return values[int(0.9 * (len(values) - 1))]


def test_sim_a_tenant_flooding_at_4x_leaves_a_light_one_its_slo():
    setup, trace, run = _run({"flood": 4.0, "light": 0.2})
    light = [r for r in run.requests if r.request.tenant == "light"]
    assert light and all(r.dropped is None and r.finished for r in light)
    assert _p90(r.ttft_s for r in light) <= setup.slo.ttft_s
    from bench.sim import simulate

    # The flood uses the rest: goodput at least that of the same load from one tenant.
    alone = replace(trace, requests=tuple(replace(r, tenant="default") for r in trace.requests))
    good = sum(r.good(setup.slo) for r in run.requests)
    good_alone = sum(r.good(setup.slo) for r in simulate(alone, "auto", None, setup).requests)
    assert good >= 0.95 * good_alone


def test_sim_without_fair_below_share_a_light_tenant_is_refused_for_a_4x_flood():
    """Without the rule the light tenant is refused for the engine queue the flood filled."""
    def refused(run):
        return sum(bool(r.dropped) for r in run.requests if r.request.tenant == "light")

    with_rule = refused(_run({"flood": 4.0, "light": 0.2})[2])
    ablated = refused(_run({"flood": 4.0, "light": 0.2},
                           ablate=frozenset({"fair_below_share"}))[2])
    assert ablated >= 3 * with_rule + 5, (ablated, with_rule)


def test_sim_weights_3_to_1_split_the_completed_requests_3_to_1():
    _, _, run = _run({"a": 2.0, "b": 2.0}, weights={"a": 3.0, "b": 1.0})
    done = {t: sum(r.finished for r in run.requests if r.request.tenant == t) for t in "ab"}
    assert done["a"] / done["b"] == pytest.approx(3.0, rel=0.15)


def test_a_trusted_front_ends_slots_are_shared_among_its_users():
    q: FairQueue[str] = FairQueue()
    for _ in range(3):
        q.started("ui", "alice")  # alice holds 3 of the UI's slots
    for i in range(3):
        q.push("ui", f"alice{i}", user="alice")
    q.push("ui", "bob0", user="bob")
    q.push("ui", "bob1", user="bob")
    order = []
    while (head := q.head()) is not None:
        assert q.pop(head[0]) == head[1]
        order.append(head[1])
    # bob (0 slots) twice, then alice and bob alternate by slots held, alice's earliest first
    assert order[:3] == ["bob0", "bob1", "alice0"]
    assert q.in_flight("ui") == 8 and q.in_flight("ui", "bob") == 2
    q.finished("ui", "bob")
    assert q.in_flight("ui", "bob") == 1 and q.in_flight("ui") == 7


def test_the_queues_of_users_and_tenants_that_left_are_forgotten():
    # Behind a front end with many users, each user's FIFO goes once it is empty, so every
    # pass over the queues stays as long as what waits, not as every user ever seen.
    fq = FairQueue()
    for k in range(1000):
        served, left = f"r{k}", f"x{k}"  # remove() finds an item by identity
        fq.push("ui", served, user=f"user{k}")
        fq.push("ui", left, user=f"gone{k}")
        assert fq.pop("ui") is served and fq.remove("ui", left)
        fq.finished("ui", f"user{k}")
    assert len(fq) == 0 and fq.head() is None
    assert fq._queues == {}  # no FIFO kept for the 2000 users who left
    fq.push("ui", "again", user="user7")
    assert fq.head() == ("ui", "again") and fq.pending("ui") == 1


def test_one_users_flood_is_judged_as_that_users_not_the_whole_front_ends():
    # A trusted front end "ui" alone on the server: mallory holds its 3 slots and queues 100
    # more; alice's one request is 2 places from the head in the tenant's turns (equal
    # shares), and she is within her share, so the queue deadline leaves her alone.
    q: FairQueue[str] = FairQueue()
    for _ in range(3):
        q.started("ui", "mallory")
    for i in range(100):
        q.push("ui", f"m{i}", user="mallory")
    q.push("ui", "a0", user="alice")
    assert q.position("ui", "alice") == 2
    assert q.position("ui", "mallory") == q.position("ui") == 101
    assert q.over_share("ui") and q.over_share("ui", "mallory")
    assert not q.over_share("ui", "alice")
    assert q.queued("ui", "alice") == 1 and q.queued("ui", "mallory") == 100
    # A user alone in the tenant is judged as the tenant.
    solo: FairQueue[str] = FairQueue()
    solo.started("ui", "bob")
    solo.push("ui", "b0", user="bob")
    assert solo.position("ui", "bob") == solo.position("ui") and solo.over_share("ui", "bob")


async def test_one_users_full_queue_refuses_that_user_only():
    lim = AdmissionLimiter(limit=2, max_queue=3, max_queue_wait_s=5)
    held = [await lim.acquire(tenant="ui", user="mallory") for _ in range(2)]
    flood = [asyncio.ensure_future(lim.acquire(tenant="ui", user="mallory")) for _ in range(3)]
    await asyncio.sleep(0)
    with pytest.raises(Rejected) as rej:
        await lim.acquire(tenant="ui", user="mallory")
    assert rej.value.reason == QUEUE_FULL
    alice = asyncio.ensure_future(lim.acquire(tenant="ui", user="alice"))
    await asyncio.sleep(0)
    assert not alice.done()  # queued, not refused
    held.pop().release()  # the tenant's next slot goes to the user holding fewest: alice
    slot = await asyncio.wait_for(alice, 1)
    assert not any(f.done() for f in flood)
    slot.release()
    held.pop().release()
    for f in flood:
        (await asyncio.wait_for(f, 1)).release()
