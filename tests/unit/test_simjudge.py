"""The simulator judge over seeds and the rule ablation: the verdict arithmetic on known
cells, the switches really switching, and one real (deterministic) simulation of a trace."""

from __future__ import annotations

import dataclasses

import pytest

from bench import ablate, simjudge
from bench.simjudge import Cell
from serve.admission.controller import Controller, ControllerConfig, Signals
from serve.admission.limiter import SlotCounter
from serve.admission.rules import RULES
from serve.settings import Settings


def cells(trace: str, autos: list[float], statics: dict[int, float], unlimited: float = 1.0):
    return [Cell("p", trace, seed, a, int(100 * a), dict(statics), unlimited)
            for seed, a in enumerate(autos)]


def test_auto_within_5_percent_of_every_fixed_limit_on_9_of_10_seeds_passes():
    v, = simjudge.judge(cells("T1", [1.0] * 9 + [0.9], {8: 1.0, 16: 0.98}))
    assert v.share_l == 0.9 and v.passed
    assert v.worst_l == (0.9, 8, 9)


def test_two_bad_seeds_fail_and_so_does_losing_to_unlimited():
    v, = simjudge.judge(cells("T1", [1.0] * 8 + [0.9, 0.94], {8: 1.0}))
    assert v.share_l == 0.8 and not v.passed
    v, = simjudge.judge(cells("T1", [1.0] * 10, {8: 1.0}, unlimited=1.01))
    assert v.share_unlimited == 0.0 and not v.passed


def test_overload_traces_need_the_median_at_every_fixed_limit():
    # 0.97 of L=8 on every seed: inside the 0.95 margin, but an overload trace's median
    # must reach each fixed limit.
    steady, = simjudge.judge(cells("T1", [0.97] * 10, {8: 1.0}, unlimited=0.5))
    over, = simjudge.judge(cells("T6", [0.97] * 10, {8: 1.0}, unlimited=0.5))
    assert steady.passed and not over.passed and over.median_l[8] == pytest.approx(0.97)
    line = simjudge.summary_line([steady, over], 10)
    assert line == "simjudge seeds=10 worst auto/L=0.970 auto/unlimited=1.940 result=fail"


def test_judge_refuses_cells_without_fixed_limits():
    with pytest.raises(ValueError, match="no fixed-L arms"):
        simjudge.judge([Cell("p", "T1", 0, 1.0, 10)])


def test_a_rule_earns_its_place_only_by_a_2_percent_loss_somewhere():
    base = [("", Cell("p", t, s, 1.0, 100)) for t in ("T1", "T2") for s in range(4)]
    rows = base + [("cooldown", Cell("p", "T2", s, 1.0, 97)) for s in range(4)] + \
        [("cooldown", Cell("p", "T1", s, 1.0, 100)) for s in range(4)] + \
        [("draining_hold", Cell("p", t, s, 1.0, 99 if s else 103)) for t in ("T1", "T2")
         for s in range(4)]
    found = {c.rule: c for c in ablate.costs(rows)}
    assert found["cooldown"].earns and found["cooldown"].where == "p/T2"
    assert found["cooldown"].cost == pytest.approx(0.03) and found["cooldown"].seeds_lost == 4
    assert not found["draining_hold"].earns and found["draining_hold"].cost == 0.0
    table = ablate.table(found.values())
    assert "| `cooldown` |" in table and "| keep |" in table and "**remove**" in table
    with pytest.raises(ValueError, match="no baseline"):
        ablate.costs([("cooldown", Cell("p", "T9", 0, 1.0, 1))])


def test_unknown_rule_names_are_refused():
    cfg = ControllerConfig.from_settings(Settings(device="cuda"))
    with pytest.raises(ValueError, match="unknown rule"):
        dataclasses.replace(cfg, ablate=frozenset({"coldown"}))
    with pytest.raises(ValueError, match="unknown rule"):
        SlotCounter(4, ablate=frozenset({"x"}))
    assert set(RULES) >= {"cooldown", "burst_budget", "burst_no_shed"}


def test_switching_a_rule_off_changes_the_decision():
    cfg = dataclasses.replace(ControllerConfig.from_settings(Settings(device="cuda")),
                              min_seqs=2, ceiling=64, ttft_target_s=1.0, cooldown_s=6.0)
    busy = dict(pending=10, engine_running=30, ttft_p90_s=0.2, itl_p90_s=0.01,
                kv_cache_usage=0.3)
    for ablated, expect in ((frozenset(), "cooldown"), (frozenset({"cooldown"}), "demand")):
        c = Controller(dataclasses.replace(cfg, ablate=ablated), limit=40)
        assert c.step(Signals(t=0, in_flight=40, preemptions=1, **busy)).reason == "preemption"
        assert c.step(Signals(t=2, in_flight=c.limit, **busy)).reason == expect


def test_one_trace_simulated_twice_gives_the_same_cells():
    """Deterministic: the judge's seeds are samples of traffic, not of noise."""
    a = simjudge.run_cells("gpu-like", 1, traces=("T1",))
    b = simjudge.run_cells("gpu-like", 1, traces=("T1",))
    assert a == b and a[0].statics and a[0].unlimited and a[0].good > 0
    off = simjudge.run_cells("gpu-like", 1, frozenset({"idle_restore"}), arms=False,
                             traces=("T1",))
    assert off[0].statics == {} and off[0].unlimited is None
