"""Autotuner controller: step response, decreases, cooldown, bounds, stability (pure logic)."""

from __future__ import annotations

import dataclasses

from serve.admission.controller import Controller, ControllerConfig, Signals
from serve.settings import Settings

#: The server's constants (serve/settings.py) with the values these tests are written for.
DEFAULTS = ControllerConfig.from_settings(Settings(device="cuda"))
CFG = dataclasses.replace(DEFAULTS, min_seqs=2, ceiling=64, ttft_target_s=1.0, itl_target_s=0.1,
                          cooldown_s=6.0, decrease_factor=0.75)


def busy(t: float, limit: int, **kw) -> Signals:
    """The limit binds, requests queue, latency well under target."""
    base = dict(t=t, pending=10, in_flight=limit, engine_running=limit, ttft_p90_s=0.2,
                itl_p90_s=0.02, kv_cache_usage=0.3)
    base.update(kw)
    return Signals(**base)


def test_step_response_to_load_jump_reaches_ceiling():
    c = Controller(CFG, limit=2)
    idle = c.step(Signals(t=0))
    assert idle.direction == "hold" and idle.reason == "idle"
    limits = []
    for i in range(1, 40):
        c.step(busy(2.0 * i, c.limit))
        limits.append(c.limit)
    assert limits == sorted(limits)  # monotone up under demand with headroom
    assert limits[-1] == 64
    # Additive steps are bounded by max_step and the 25 % ratio.
    steps = [b - a for a, b in zip([2] + limits, limits, strict=False)]
    assert max(steps) <= CFG.max_step
    assert limits.index(64) < 20  # the ceiling is reached in well under 40 s


def test_decrease_on_preemption_then_cooldown():
    c = Controller(CFG, limit=40)
    d = c.step(busy(0, 40, preemptions=3))
    assert (d.direction, d.reason, d.new_limit) == ("down", "preemption", 30)
    d = c.step(busy(2, 30))
    assert (d.direction, d.reason) == ("hold", "cooldown")
    d = c.step(busy(4, 30))
    assert d.reason == "cooldown"
    d = c.step(busy(6.5, 30))
    assert d.direction == "up"


def test_decrease_on_slo_breach_ttft_and_itl_and_kv():
    c = Controller(CFG, limit=32)
    assert c.step(busy(0, 32, ttft_p90_s=1.2)).reason == "slo_ttft"
    assert c.limit == 24
    assert c.step(busy(10, 24, itl_p90_s=0.12)).reason == "slo_itl"
    assert c.limit == 18
    assert c.step(busy(20, 18, kv_cache_usage=0.97)).reason == "kv_cache"
    assert c.limit == 13


def test_a_latency_far_over_target_cuts_deeper():
    """target / measured when that is below decrease_factor (Gradient2), at most by half."""
    c = Controller(CFG, limit=32)
    assert c.step(busy(0, 32, ttft_p90_s=1.5)).new_limit == 21  # x 1.0/1.5
    c = Controller(CFG, limit=32)
    assert c.step(busy(0, 32, itl_p90_s=1.0)).new_limit == 16  # x 0.1, floored at 0.5
    c = Controller(CFG, limit=32)
    assert c.step(busy(0, 32, preemptions=1)).new_limit == 24  # hard signals: x 0.75


def test_during_cooldown_only_hard_signals_cut_again():
    """After a decrease the latency window still holds the old limit's samples: a latency
    breach waits out the cooldown (no windup); a preemption or a full KV cache cuts at once."""
    c = Controller(CFG, limit=32)
    c.step(busy(0, 32, preemptions=1))
    d = c.step(busy(1, 24, ttft_p90_s=3.0))
    assert (d.direction, d.reason, d.new_limit) == ("hold", "cooldown", 24)
    d = c.step(busy(2, 24, preemptions=2))
    assert d.direction == "down" and d.new_limit == 18
    d = c.step(busy(9, 18, ttft_p90_s=1.2))  # the cooldown (6 s) is over
    assert (d.direction, d.reason, d.new_limit) == ("down", "slo_ttft", 13)


def test_bounds_honoured():
    c = Controller(CFG, limit=1000)
    assert c.limit == 64
    d = c.step(busy(0, 64))
    assert d.new_limit == 64 and d.reason == "bound"
    low = Controller(CFG, limit=2)
    for i in range(10):
        low.step(busy(i * 10, low.limit, preemptions=1))
    assert low.limit == 2
    assert low.decisions[-1].reason == "bound"


def test_no_increase_without_queue_or_when_limit_not_binding():
    c = Controller(CFG, limit=16)
    assert c.step(busy(0, 16, pending=0)).reason == "steady"
    assert c.step(busy(2, 8, in_flight=8)).reason == "steady"
    assert c.limit == 16


def test_hysteresis_band_holds():
    c = Controller(CFG, limit=16)
    # TTFT between headroom*target (0.7) and target (1.0): neither up nor down.
    d = c.step(busy(0, 16, ttft_p90_s=0.85))
    assert (d.direction, d.reason) == ("hold", "steady")


def test_gpu_saturation_blocks_increase_but_unknown_does_not():
    c = Controller(CFG, limit=16)
    assert c.step(busy(0, 16, gpu_utilization=0.99)).direction == "hold"
    assert c.step(busy(2, 16, gpu_utilization=None)).direction == "up"


def test_no_oscillation_in_steady_load():
    """A plant whose TTFT grows with the limit: the controller settles and stays."""
    c = Controller(CFG, limit=2)

    def ttft(limit: int) -> float:  # crosses the 1.0 s target at limit 40
        return 0.025 * limit

    for i in range(300):
        c.step(busy(2.0 * i, c.limit, ttft_p90_s=ttft(c.limit)))
    tail = [d.new_limit for d in list(c.decisions)[-30:]]
    assert max(tail) - min(tail) == 0, tail
    assert 0.7 <= ttft(tail[-1]) <= 1.0  # settled inside the hysteresis band


def test_no_windup_while_a_decrease_drains():
    c = Controller(CFG, limit=32)
    assert c.step(busy(0, 32, ttft_p90_s=1.2)).new_limit == 24
    # 32 requests admitted under the old limit still run: their late TTFTs are not news.
    d = c.step(busy(1, 24, in_flight=32, ttft_p90_s=3.0))
    assert (d.direction, d.reason, d.new_limit) == ("hold", "draining", 24)
    # A hard signal (preemption) still cuts while draining.
    d = c.step(busy(2, 24, in_flight=30, preemptions=1))
    assert (d.direction, d.reason) == ("down", "preemption")
    # Drained below the limit, still slow, but inside the cooldown: the samples are old.
    d = c.step(busy(3, 18, in_flight=18, ttft_p90_s=3.0))
    assert (d.direction, d.reason) == ("hold", "cooldown")
    # Past the cooldown and still slow: cut again.
    d = c.step(busy(9, 18, in_flight=18, ttft_p90_s=3.0))
    assert d.direction == "down"


def test_idle_engine_gets_its_start_limit_back():
    """After an overload cut, an idle engine takes the next burst at the KV-safe start."""
    c = Controller(dataclasses.replace(DEFAULTS, ceiling=64, ttft_target_s=1.0), limit=32)
    c.step(Signals(t=0.0, in_flight=32, pending=10, ttft_p90_s=5.0))
    assert c.limit < 32
    held = c.step(Signals(t=1.0, in_flight=3, pending=0))
    assert held.reason == "cooldown" and c.limit < 32  # still inside the cooldown
    back = c.step(Signals(t=60.0, in_flight=0, pending=0))
    assert (back.direction, back.reason, c.limit) == ("up", "idle", 32)
    c.set_start(100)
    assert c.start == c.limit == 64  # clamped to the ceiling


def test_increase_stops_where_the_kv_cache_is_full():
    """A probe never goes past what the KV cache holds at the running requests' mean size:
    vLLM would answer it with preemption."""
    c = Controller(CFG, limit=32)
    # 32 running fill 60 % of the cache: 32 x 0.95 / 0.6 = 50 fit; the step (+8) is inside.
    assert c.step(busy(0, 32, kv_cache_usage=0.6)).new_limit == 40
    # 40 running fill 85 %: 44 fit; the step (+10) is cut to 44.
    d = c.step(busy(2, 40, kv_cache_usage=0.85))
    assert (d.new_limit, d.direction, d.reason) == (44, "up", "kv_fit")
    # At the fit, demand alone holds.
    d = c.step(busy(4, 44, kv_cache_usage=0.94))
    assert (d.new_limit, d.direction, d.reason) == (44, "hold", "kv_fit")


def test_idle_limit_learns_the_traffic():
    """An idle engine takes the next burst with the smaller of the KV fit and the TTFT fit of
    the traffic seen lately; the boot start until requests have finished."""
    c = Controller(dataclasses.replace(DEFAULTS, ceiling=256, ttft_target_s=2.0), limit=15)
    c.set_capacity(48_000)
    idle = dict(in_flight=0, pending=0)
    assert c.idle_limit(Signals(t=0, **idle)) == 15  # nothing observed: the boot figure
    # 1,000-token requests: 48,000 x 0.95 / 1,000 = 45 fit in the KV cache.
    kv_only = Signals(t=0, mean_request_tokens=1000.0, **idle)
    assert c.idle_limit(kv_only) == 45
    # Prefill at 12,000 tokens/s, 800-token prompts: 30 are prefilled within 2 s.
    both = Signals(t=0, mean_request_tokens=1000.0, mean_prompt_tokens=800.0,
                   prefill_tokens_per_s=12_000.0, **idle)
    assert c.idle_limit(both) == 30
    d = c.step(dataclasses.replace(both, t=10))
    assert (d.direction, d.reason, c.limit) == ("up", "idle", 30)
    # A limit raised past it under load comes back down to it once idle.
    c.limit = 80
    d = c.step(dataclasses.replace(both, t=20))
    assert (d.direction, d.reason, c.limit) == ("down", "idle", 30)


def test_full_kv_cache_cuts_once_then_waits_for_it_to_drain():
    """KV usage falls only as requests finish: after one cut, a still-full cache holds (no
    cut per tick down to the floor); a preemption still cuts."""
    c = Controller(CFG, limit=64)
    assert c.step(busy(0, 64, kv_cache_usage=0.96)).new_limit == 48
    d = c.step(busy(2, 48, in_flight=64, kv_cache_usage=0.96))
    assert (d.direction, d.reason) == ("hold", "draining")
    d = c.step(busy(4, 48, kv_cache_usage=0.96))
    assert (d.direction, d.reason) == ("hold", "cooldown")
    d = c.step(busy(5, 48, kv_cache_usage=0.96, preemptions=1))
    assert (d.direction, d.reason) == ("down", "preemption")


def test_a_burst_at_an_idle_engine_is_not_cut_for_its_own_prefill():
    """The first ticks of a burst that reached an idle engine hold the limit on a latency
    breach (the burst's prefill stalls the streams beside it) for ttft_target + cooldown;
    a preemption or a full KV cache still cuts at once, and so does latency afterwards."""
    c = Controller(CFG, limit=32)
    assert c.step(Signals(t=0)).reason == "idle"
    grace = CFG.ttft_target_s + CFG.cooldown_s
    d = c.step(busy(2, 32, itl_p90_s=0.3, arrivals=50))
    assert (d.direction, d.reason, d.new_limit) == ("hold", "burst", 32)
    assert c.step(busy(2 + grace - 0.5, 32, ttft_p90_s=1.5)).reason == "burst"
    d = c.step(busy(2 + grace + 0.5, 32, itl_p90_s=0.3))
    assert d.direction == "down" and d.reason == "slo_itl"
    # Hard signals are never held: a preemption in a burst's first tick cuts.
    c = Controller(CFG, limit=32)
    c.step(Signals(t=0))
    assert c.step(busy(2, 32, preemptions=1, itl_p90_s=0.3)).reason == "preemption"
    # A busy engine (no idle tick before) gets no grace.
    c = Controller(CFG, limit=32)
    c.step(busy(0, 32))
    assert c.step(busy(2, 32, itl_p90_s=0.3)).reason == "slo_itl"


def test_a_burst_admitted_at_the_boot_start_rises_to_what_its_prefill_rate_fits():
    """In the grace, with the rest of the burst queued, the limit rises to the idle limit
    recomputed from the burst's own prefill rate (the boot start assumes the largest image in
    every request); without a queue, or when the fit is lower, it holds: never a cut."""
    c = Controller(dataclasses.replace(DEFAULTS, ceiling=256, ttft_target_s=2.0), limit=15)
    c.set_capacity(48_000)
    assert c.step(Signals(t=0)).reason == "idle" and c.limit == 15
    # 13,000 prompt tokens/s measured on this burst, 800-token prompts: 32 fit the TTFT;
    # 1,000-token requests: 45 fit the KV cache.
    seen = dict(mean_request_tokens=1000.0, mean_prompt_tokens=800.0,
                prefill_tokens_per_s=13_000.0, itl_p90_s=0.5)
    d = c.step(Signals(t=2, in_flight=15, engine_running=15, pending=80, arrivals=100, **seen))
    assert (d.direction, d.reason, d.new_limit) == ("up", "burst", 32)
    # Nothing queued: nothing to admit, hold.
    d = c.step(Signals(t=4, in_flight=30, engine_running=30, pending=0,
                       **{**seen, "prefill_tokens_per_s": 20_000.0}))
    assert (d.direction, d.reason, d.new_limit) == ("hold", "burst", 32)
    # A lower fit (slower prefill) does not cut inside the grace.
    d = c.step(Signals(t=6, in_flight=32, engine_running=32, pending=40,
                       **{**seen, "prefill_tokens_per_s": 6_000.0}))
    assert (d.direction, d.reason, d.new_limit) == ("hold", "burst", 32)


def test_sustained_arrivals_end_the_burst_grace():
    """Requests still arriving two ticks after a burst began are traffic, not a burst: the
    grace ends and a latency breach cuts."""
    c = Controller(CFG, limit=32)
    c.step(Signals(t=0))
    assert c.step(busy(1, 32, itl_p90_s=0.3, arrivals=20)).reason == "burst"
    assert c.step(busy(2, 32, itl_p90_s=0.3, arrivals=20)).reason == "burst"  # its tail
    d = c.step(busy(3, 32, itl_p90_s=0.3, arrivals=20))
    assert (d.direction, d.reason) == ("down", "slo_itl")


def test_idle_limit_remembers_where_a_sustained_overload_settled():
    """A busy period cut on an overload while requests kept arriving ends at the limit the
    engine held under every target: the idle limit is at most that (the fits do not see the
    inter-token target). A burst's drain (cuts with nothing arriving) teaches nothing."""
    cfg = dataclasses.replace(DEFAULTS, ceiling=32, ttft_target_s=2.0)
    c = Controller(cfg, limit=32)
    c.set_capacity(131_072)
    fits = dict(mean_request_tokens=500.0, mean_prompt_tokens=300.0,
                prefill_tokens_per_s=6_000.0)  # KV fit 249, TTFT fit 40: both over 32
    assert c.step(Signals(t=0, **fits)).new_limit == 32
    over = dict(in_flight=32, pending=5, arrivals=12, itl_p90_s=10 * cfg.itl_target_s, **fits)
    assert c.step(Signals(t=10, **over)).reason == "burst"  # from idle: a burst, maybe
    assert c.step(Signals(t=11, **over)).reason == "burst"
    d = c.step(Signals(t=12, **over))  # still arriving: an overload, cut
    assert (d.reason, d.new_limit) == ("slo_itl", 16)
    c.step(Signals(t=15, in_flight=16, engine_running=16, pending=3, arrivals=12, **fits))
    d = c.step(Signals(t=40, **fits))
    assert (d.reason, d.new_limit) == ("idle", 16)
    assert c.burst_cap(Signals(t=40, **fits)) == 16  # a burst's budget is capped there too
    # The next busy period: a burst's drain cut with nothing arriving, then idle: no lesson,
    # the fits again.
    c.step(Signals(t=50, in_flight=16, pending=40, arrivals=56, **fits))
    d = c.step(Signals(t=60, in_flight=16, pending=20, ttft_p90_s=5.0, **fits))
    assert d.direction == "down" and c.limit < 16
    d = c.step(Signals(t=80, **fits))
    assert (d.reason, d.new_limit) == ("idle", 32)


def test_ttft_over_target_with_the_engine_queue_in_use_is_not_an_overload():
    """At the ceiling, vLLM counts the wait for a batch slot of the engine-queued requests in
    their TTFT: a lower limit would only move that wait to the gateway. The inter-token
    latency, a preemption or a full KV cache still cut there; below the ceiling a TTFT
    breach cuts as before."""
    c = Controller(CFG, limit=64)
    d = c.step(busy(0, 64, ttft_p90_s=3.0, engine_queued=20))
    assert (d.direction, d.new_limit) == ("hold", 64) and not d.is_cut
    assert c.step(busy(2, 64, ttft_p90_s=3.0, itl_p90_s=0.3, engine_queued=20)).reason \
        == "slo_itl"
    c = Controller(CFG, limit=64)
    assert c.step(busy(0, 64, ttft_p90_s=3.0, preemptions=1, engine_queued=20)).reason \
        == "preemption"
    c = Controller(CFG, limit=64)
    d = c.step(busy(0, 64, ttft_p90_s=3.0))
    assert d.is_cut and d.reason == "slo_ttft"


def test_burst_budget_is_the_ttft_fit_in_tokens():
    """A burst may bring what the engine prefills within the TTFT target at its last
    measured rate; nothing before a rate is known or where no capacity was set."""
    c = Controller(CFG, limit=8)
    assert c.burst_budget(10_000.0) is None  # no capacity: a pinned limit, count only
    c.set_capacity(48_000)
    assert c.burst_budget(None) is None
    assert c.burst_budget(12_345.6) == int(12_345.6 * CFG.ttft_target_s)
    c.adopt(1000)
    assert c.limit == CFG.ceiling  # adopted within the bounds


def test_burst_cap_is_the_idle_limit_without_its_ttft_fit():
    """The budget replaces the TTFT fit; the KV fit (and the overload limit:
    test_idle_limit_remembers_where_a_sustained_overload_settled) still caps a burst."""
    c = Controller(CFG, limit=8)
    c.set_capacity(64_000)
    assert c.burst_cap(None) == c.start
    s = Signals(t=0, mean_request_tokens=2000, mean_prompt_tokens=1000,
                prefill_tokens_per_s=5000)
    assert c.idle_limit(s) == 5  # 5,000 tokens/s x 1 s / 1,000 tokens
    assert c.burst_cap(s) == int(64_000 * CFG.kv_high_ratio / 2000)  # the KV fit only


def test_the_itl_fit_bounds_probes_and_the_idle_limit():
    """Where each running request slows every stream (the CPU engine at saturation: 4 ms +
    2 ms per request) and the slower requests lie 1.25x above that line, the limit stops at
    the batch where nine in ten keep the 100-ms target: (100 / 1.25 - 4) / 2 = 38."""
    from serve.admission.engine_stats import ItlLine

    c = Controller(CFG, limit=34)
    line = ItlLine(0.004, 0.002, 1.25)
    assert c.itl_fit(busy(0, 34, itl_line=line)) == 38
    d = c.step(busy(0, 34, itl_line=line))  # the step (+9) is cut to the fit
    assert (d.new_limit, d.direction, d.reason) == (38, "up", "itl_fit")
    d = c.step(busy(2, 38, itl_line=line))
    assert (d.new_limit, d.direction, d.reason) == (38, "hold", "itl_fit")
    # An idle engine takes the next burst at most at the fit, under its KV fit (60).
    c.set_capacity(64_000)
    idle = Signals(t=10, mean_request_tokens=1000.0, itl_line=line)
    assert c.idle_limit(idle) == 38 and c.burst_cap(idle) == 38
    assert c.idle_limit(dataclasses.replace(idle, itl_line=None)) == 60
    # No bound where the batch does not slow the streams (a memory-bound GPU), or where even
    # the intercept misses the target (fewer requests would not help).
    assert c.itl_fit(busy(0, 30, itl_line=ItlLine(0.02, -0.0001, 1.2))) is None
    assert c.itl_fit(busy(0, 30, itl_line=ItlLine(0.09, 0.001, 1.2))) is None
    assert c.itl_fit(busy(0, 30, itl_line=ItlLine(0.0, 0.5, 1.0))) == CFG.min_seqs


def test_after_a_cut_the_next_probe_waits_for_a_ttft_at_the_new_limit():
    """A cut starts the latency windows afresh: a probe on the empty windows would raise the
    limit on no evidence of the new one. The first TTFT measured since ends the wait; an
    empty TPOT window alone (long answers, nothing finished yet) does not block."""
    c = Controller(CFG, limit=32)
    d = c.step(busy(0, 32, ttft_p90_s=1.5))  # over the 1-s target: cut
    assert d.is_cut and c.limit == 21
    blind = busy(10, 21, ttft_p90_s=None, itl_p90_s=None)  # cooldown over, windows empty
    assert c.step(blind).direction == "hold"
    assert c.step(dataclasses.replace(blind, t=11)).direction == "hold"
    d = c.step(busy(12, 21, ttft_p90_s=0.2, itl_p90_s=None))
    assert (d.direction, d.reason) == ("up", "demand")
    # Once measured, empty windows do not block a probe again.
    assert c.step(busy(14, d.new_limit, ttft_p90_s=None, itl_p90_s=None)).direction == "up"


def test_after_an_itl_cut_the_next_probe_waits_for_a_tpot_at_the_new_limit():
    """After a cut on the inter-token target a TTFT at the new limit (which comes first)
    does not end the wait: only a finished request's TPOT measured since says whether the
    streams now keep the target."""
    c = Controller(CFG, limit=32)
    d = c.step(busy(0, 32, itl_p90_s=0.15))  # over the 100-ms target: cut
    assert (d.reason, d.is_cut) == ("slo_itl", True)
    cut = c.limit
    d = c.step(busy(10, cut, ttft_p90_s=0.2, itl_p90_s=None))  # cooldown over, a TTFT only
    assert d.direction == "hold"
    d = c.step(busy(11, cut, ttft_p90_s=0.2, itl_p90_s=0.03))
    assert (d.direction, d.reason) == ("up", "demand")


def test_an_itl_cut_goes_to_the_fit_not_the_ratio():
    """A TPOT p90 twice the target at 40 (stalls of prefills and encodes in it) would cut to
    half by the ratio; with the line known (4 ms + 2 ms per request, spread 1.25: the fit is
    38) the cut keeps ``decrease_factor`` (30), and goes deeper only to a fit below that,
    never past MIN_CUT_FACTOR. Without a line, the ratio as before."""
    from serve.admission.controller import MIN_CUT_FACTOR
    from serve.admission.engine_stats import ItlLine

    over = dict(itl_p90_s=2 * CFG.itl_target_s)
    c = Controller(CFG, limit=40)
    d = c.step(busy(0, 40, itl_line=ItlLine(0.004, 0.002, 1.25), **over))
    assert (d.reason, d.new_limit) == ("slo_itl", 30)  # fit 38 > 40 x 0.75
    c = Controller(CFG, limit=40)
    d = c.step(busy(0, 40, itl_line=ItlLine(0.004, 0.003, 1.25), **over))
    assert (d.reason, d.new_limit) == ("slo_itl", 25)  # the fit: (80 - 4) / 3
    c = Controller(CFG, limit=40)
    d = c.step(busy(0, 40, itl_line=ItlLine(0.004, 0.02, 1.25), **over))
    assert (d.reason, d.new_limit) == ("slo_itl", int(40 * MIN_CUT_FACTOR))  # fit 3
    c = Controller(CFG, limit=40)
    d = c.step(busy(0, 40, **over))
    assert (d.reason, d.new_limit) == ("slo_itl", 20)  # no line: target / measured
