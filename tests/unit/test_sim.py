"""The engine simulator and the autotuner benchmark (pure Python, no engine, a few seconds)."""

from __future__ import annotations

from dataclasses import astuple, replace

import pytest

from bench.autotune import gpu_setup, sim_report
from bench.sim import GPU_LIKE, Setup, Simulation, simulate
from bench.trace import Phase, build_trace, phase_trace

SETUP = Setup.default()


def outcome(run) -> list[tuple]:
    """Everything observable about a run, for equality."""
    return [(r.admitted_s, r.first_token_s, r.finish_s, r.tokens, r.preemptions, r.dropped)
            for r in run.requests] + [tuple(run.limits), run.preemptions, run.steps]


@pytest.fixture(scope="module")
def short_trace():
    return phase_trace(seed=3, phase_s=30)


def test_same_seed_same_results(short_trace):
    again = phase_trace(seed=3, phase_s=30)
    assert again == short_trace
    assert phase_trace(seed=4, phase_s=30) != short_trace
    assert outcome(simulate(short_trace, "auto")) == outcome(simulate(again, "auto"))
    assert outcome(simulate(short_trace, "static", 16)) == outcome(simulate(again, "static", 16))


@pytest.mark.parametrize("mode,limit", [("auto", None), ("static", 4), ("static", 256)])
def test_every_request_finishes_or_is_dropped(short_trace, mode, limit):
    run = simulate(short_trace, mode, limit)
    assert len(run.requests) == len(short_trace.requests)
    for r in run.requests:
        assert (r.finish_s is None) != (r.dropped is None), r
        if r.dropped is None:
            assert r.tokens == r.request.output_tokens
            assert r.arrival_s <= r.admitted_s <= r.first_token_s <= r.finish_s
        else:
            assert r.dropped in ("queue_full", "queue_timeout", "slo")
            assert r.first_token_s is None and r.tokens == 0


class CheckedSimulation(Simulation):
    """Asserts the engine's and the gate's invariants after every step and admission."""

    def _admit(self, result, slot):
        assert self.gate.in_flight <= self.gate.limit  # admitted only into a free slot
        super()._admit(result, slot)

    def check(self) -> None:
        eng = self.engine
        assert 0 <= self.free_blocks <= eng.num_gpu_blocks
        assert sum(s.blocks for s in self.running) == eng.num_gpu_blocks - self.free_blocks
        assert all(s.blocks == 0 and s.computed == 0 for s in self.waiting)
        for s in self.running:  # blocks cover exactly the computed tokens
            assert s.blocks == -(-s.computed // eng.block_size)
        assert len(self.running) <= eng.max_num_seqs
        assert self.gate.in_flight == len(self.running) + len(self.waiting)
        if self.mode == "static":
            assert self.gate.in_flight <= self.gate.limit


def checked_run(trace, mode, limit, setup=SETUP):
    sim = CheckedSimulation(trace, mode, limit, setup, on_step=CheckedSimulation.check)
    return sim.run()


def long_trace(rate: float = 3.0, seconds: float = 40.0):
    return build_trace([Phase("long", seconds, rate, "long", bursts=0)], seed=1)


@pytest.mark.parametrize("mode,limit", [("auto", None), ("static", 64)])
def test_kv_and_limit_invariants(short_trace, mode, limit):
    tight = replace(SETUP, engine=replace(GPU_LIKE, num_gpu_blocks=600))
    checked_run(short_trace, mode, limit, tight)


def test_preemption_when_kv_is_tight():
    trace = long_trace()
    tight = replace(SETUP, engine=replace(GPU_LIKE, num_gpu_blocks=500))  # 8k tokens
    run = checked_run(trace, "static", 64, tight)
    assert run.preemptions > 0
    preempted = [r for r in run.requests if r.preemptions]
    assert preempted and all(r.tokens == r.request.output_tokens for r in preempted)
    roomy = replace(SETUP, engine=replace(GPU_LIKE, num_gpu_blocks=100_000))
    assert simulate(trace, "static", 64, roomy).preemptions == 0


def test_request_larger_than_the_kv_cache_is_refused():
    tiny = replace(SETUP, engine=replace(GPU_LIKE, num_gpu_blocks=10))  # 160 tokens
    with pytest.raises(ValueError, match="does not fit"):
        Simulation(long_trace(), "static", 4, tiny)


def test_preemption_makes_the_auto_limit_go_down():
    trace = long_trace(rate=4.0, seconds=60.0)
    tight = replace(SETUP, engine=replace(GPU_LIKE, num_gpu_blocks=500), start_limit=64)
    run = simulate(trace, "auto", None, tight)
    reasons = {d.reason for d in run.decisions if d.direction == "down"}
    assert reasons & {"preemption", "kv_cache"}
    assert min(limit for _, limit in run.limits) < 64


def test_auto_goodput_at_least_best_static_on_phase_trace():
    """The benchmark's claim (``python -m bench.autotune``), seed 0."""
    report = sim_report(phase_trace(seed=0), gpu_setup())
    assert report.vs_best_static >= 1.0, [astuple(s)[:3] for s in report.rows]
    assert report.vs_oracle >= 0.9
    best_by_phase = set(report.oracle_limits.values())
    assert len(best_by_phase) == 3, report.oracle_limits  # the phases really differ
