"""The engine simulator and the autotuner benchmark (pure Python, no engine, a few seconds)."""

from __future__ import annotations

from dataclasses import astuple, replace

import pytest

from bench.autotune import gpu_setup, sim_report, static_limits
from bench.sim import GPU_LIKE, Setup, Simulation, h200_profile, simulate
from bench.trace import SUITE, Capacity, Phase, build_trace, phase_trace, suite

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

    #: Most requests admitted at once so far.
    peak_in_flight = 0

    def _admit(self, result, slot):
        # admitted only into a free slot (the limit, plus the engine queue at the ceiling), or
        # past it within a burst's prefill budget (grown for the request's arrival in the
        # burst: rule burst_deadline), up to its cap and the ceiling
        slots = self.gate.slots
        burst = slots.burst_admitted
        open_burst = slots.bursts.current()
        assert self.gate.in_flight <= slots.capacity or (
            burst is not None and slots.burst_budget is not None
            and self.gate.in_flight <= min(slots.ceiling, slots.burst_cap or slots.ceiling)
            and burst[0] <= slots.burst_budget + slots.bursts.deadline_tokens(
                open_burst, result.arrival_s))
        self.peak_in_flight = max(self.peak_in_flight, self.gate.in_flight)
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
        if self.mode == "static" and self.gate.limit < eng.max_num_seqs:
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


def test_engine_queue_at_the_ceiling_as_on_the_server(short_trace):
    """At the ceiling the simulator's gate admits past the limit into the engine's waiting
    queue, as the server's limiter does (``engine_queue``), never more than the engine
    serves within the TTFT target at the measured rate; the engine still runs at most its
    ``max_num_seqs``."""
    small = replace(SETUP, engine=replace(GPU_LIKE, max_num_seqs=8), engine_queue=8)
    sim = CheckedSimulation(short_trace, "static", 8, small, on_step=CheckedSimulation.check)
    sim.run()
    assert 8 < sim.peak_in_flight <= 16
    none = replace(small, engine_queue=0)
    sim = CheckedSimulation(short_trace, "static", 8, none, on_step=CheckedSimulation.check)
    sim.run()
    assert sim.peak_in_flight == 8


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


def test_a_full_kv_cache_makes_the_auto_limit_go_down():
    """Past what the cache holds, the limit comes down: by the KV cut where the limit binds
    and requests queue at the gateway (a start under the cache's capacity), by the TTFT cut
    where it never bound (a start far over it: the cut waits for a queue, vLLM's preemption
    absorbs the growth until the first tokens come late)."""
    trace = long_trace(rate=4.0, seconds=60.0)
    for start, reason in ((16, "kv_cache"), (64, "slo_ttft")):
        tight = replace(SETUP, engine=replace(GPU_LIKE, num_gpu_blocks=500), start_limit=start)
        run = simulate(trace, "auto", None, tight)
        assert reason in {d.reason for d in run.decisions if d.direction == "down"}
        assert min(limit for _, limit in run.limits) < start


def test_auto_goodput_at_least_best_static_on_phase_trace():
    """The benchmark's claim (``python -m bench.autotune``), seed 0."""
    report = sim_report(phase_trace(seed=0), gpu_setup())
    assert report.vs_best_static >= 1.0, [astuple(s)[:3] for s in report.rows]
    assert report.vs_oracle >= 0.9
    best_by_phase = set(report.oracle_limits.values())
    assert len(best_by_phase) == 3, report.oracle_limits  # the phases really differ


#: A capacity like the GPU-like profile's (``measure_capacity``), fixed so the tests are quick.
CAPACITY = Capacity(chat_rps=4.8, vision_rps=2.7, long_rps=1.0, ceiling=256)


@pytest.fixture(scope="module")
def short_suite():
    return suite(CAPACITY, seed=0, scale=0.15)


def test_suite_traces_are_what_they_say():
    """Rates, sizes and shapes of the six traces (full length), from the stated statistics."""
    traces = suite(CAPACITY, seed=0)
    assert tuple(traces) == SUITE
    for name, trace in traces.items():
        assert 120 <= trace.duration_s <= 540, name  # 2-9 simulated minutes
    rate = {n: len(t.requests) / t.duration_s for n, t in traces.items()}
    assert rate["T1"] == pytest.approx(0.6 * CAPACITY.chat_rps, rel=0.1)
    assert rate["T3"] == pytest.approx(1.2 * CAPACITY.vision_rps, rel=0.1)
    assert rate["T4"] == pytest.approx(1.0 * CAPACITY.long_rps, rel=0.15)
    assert rate["T6"] == pytest.approx(2.0 * CAPACITY.chat_rps, rel=0.1)
    assert traces["T5"] == phase_trace(0)
    t3 = [r.image_tokens for r in traces["T3"].requests]
    assert min(t3) == 1921 and max(t3) == 2509  # one num_crops=16 image each
    assert all(1000 <= r.output_tokens <= 2000 for r in traces["T4"].requests)
    chat = traces["T1"].requests
    assert 0.25 <= sum(r.images for r in chat) / len(chat) <= 0.35  # 30 % carry an image
    # T2: idle, then 2 x max_num_seqs at once (within 1 s), three times.
    arrivals = sorted(r.arrival_s for r in traces["T2"].requests)
    assert len(arrivals) == 3 * 2 * CAPACITY.ceiling
    for k in range(3):
        burst = arrivals[k * 512:(k + 1) * 512]
        assert burst[-1] - burst[0] <= 1.0
        if k:
            assert burst[0] - arrivals[k * 512 - 1] >= 30  # idle in between


@pytest.mark.parametrize("name", SUITE)
@pytest.mark.parametrize("mode,limit", [("auto", None), ("static", 32), ("unlimited", None)])
def test_suite_invariants(short_suite, name, mode, limit):
    """On every trace: the KV cache never over capacity, every request ends finished or
    refused (CheckedSimulation checks the first after every step)."""
    run = checked_run(short_suite[name], mode, limit)
    for r in run.requests:
        assert (r.finish_s is None) != (r.dropped is None), r
    if mode == "unlimited":  # plain vLLM: no gateway limit, queue or refusal
        assert all(r.dropped is None and r.admitted_s == r.arrival_s for r in run.requests)


def test_static_limits_are_the_powers_of_two_to_the_ceiling():
    assert static_limits(256) == (1, 2, 4, 8, 16, 32, 64, 128, 256)
    assert static_limits(32) == (1, 2, 4, 8, 16, 32)
    assert static_limits(48) == (1, 2, 4, 8, 16, 32, 48)


def test_h200_profile_from_first_principles():
    """The H200 numbers stated in ``bench/sim.py`` (per step: 4.5 ms + 20 us per sequence +
    15.4 us per prefill token + 4.9 us per image token + 0.10 us per KV token read), and
    the planner's KV blocks for 141 GB at 0.9 utilisation."""
    e = h200_profile()
    assert e.step_base_s == pytest.approx(0.0045, abs=1e-4)
    assert e.step_per_prefill_token_s == pytest.approx(15.4e-6, rel=0.01)
    assert e.step_per_image_token_s == pytest.approx(4.9e-6, rel=0.02)
    assert e.step_per_kv_token_s == pytest.approx(0.10e-6, rel=0.03)
    assert e.block_size == 16 and 17_000 < e.num_gpu_blocks < 20_000


def test_cpu_suite_refuses_an_aa_limit_it_does_not_run_before_starting(tmp_path):
    """``--cpu-aa L`` compares L's second run with its first: an L outside the suite's fixed
    limits is refused before the ~20-min run starts, not after it."""
    from bench.autotune import cpu_suite_benchmark

    with pytest.raises(ValueError, match="aa_limit 4"):
        cpu_suite_benchmark(tmp_path, limits=(8, 16, 32), aa_limit=4)
    assert not any(tmp_path.iterdir())  # nothing measured, nothing written
