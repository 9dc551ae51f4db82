"""Autotuner controller: step response, decreases, bounds, stability, the fits (pure logic).

The rules the ablation removed (cooldown, draining hold, burst grace, overload limit, ITL fit,
...) lost their tests with them: ``test_simjudge.py`` checks that the ablation table in
docs/admission.md names each of them with what removing it cost."""

from __future__ import annotations

import dataclasses

import pytest

from serve.admission.controller import Controller, ControllerConfig, Signals
from serve.settings import Settings

#: The server's constants (serve/settings.py) with the values these tests are written for.
DEFAULTS = ControllerConfig.from_settings(Settings(device="cuda"))
CFG = dataclasses.replace(DEFAULTS, min_seqs=2, ceiling=64, ttft_target_s=1.0, itl_target_s=0.1,
                          decrease_factor=0.75)


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


def test_decrease_on_a_full_kv_cache_then_probe_again():
    """A cut keeps ``decrease_factor`` of the limit; the next tick with headroom and a queue
    probes again (no cooldown: the ablation found it earned nothing). A preemption alone cuts
    nothing (rule ``preemption_cut`` went: the KV-cache cut before it earned its gain)."""
    c = Controller(CFG, limit=40)
    d = c.step(busy(0, 40, kv_cache_usage=0.96))
    assert (d.direction, d.reason, d.new_limit) == ("down", "kv_cache", 30)
    d = c.step(busy(2, 30))
    assert (d.direction, d.reason) == ("up", "demand")
    assert Controller(CFG, limit=40).overload_reason(busy(0, 40, preemptions=3)) is None
    # An overload that persists cuts on every tick, multiplicatively.
    c = Controller(CFG, limit=40)
    limits = [c.step(busy(2 * i, c.limit, kv_cache_usage=0.97)).new_limit for i in range(3)]
    assert limits == [30, 22, 16]


def test_full_kv_cache_cuts_only_with_requests_queued():
    """With nothing queued at the gateway the limit holds nothing back: what fills the cache is
    the growth of the requests in flight, which vLLM absorbs by preempting the newest; a cut
    would only refuse the next arrivals (rule ``kv_cache_cut``, its queue condition)."""
    c = Controller(CFG, limit=40)
    d = c.step(busy(0, 40, pending=0, kv_cache_usage=0.99, preemptions=2))
    assert (d.direction, d.reason, d.new_limit) == ("hold", "steady", 40)
    d = c.step(busy(2, 40, pending=1, kv_cache_usage=0.99))
    assert (d.direction, d.reason, d.new_limit) == ("down", "kv_cache", 30)
    # A latency breach still cuts with nothing queued.
    assert c.step(busy(4, 30, pending=0, ttft_p90_s=1.5)).reason == "slo_ttft"


def test_decrease_on_slo_breach_ttft_and_itl_and_kv():
    c = Controller(CFG, limit=32)
    assert c.step(busy(0, 32, ttft_p90_s=1.2)).reason == "slo_ttft"
    assert c.limit == 24
    assert c.step(busy(10, 24, itl_p90_s=0.12)).reason == "slo_itl"
    assert c.limit == 18
    assert c.step(busy(20, 18, kv_cache_usage=0.97)).reason == "kv_cache"
    assert c.limit == 13


def test_bounds_honoured():
    c = Controller(CFG, limit=1000)
    assert c.limit == 64
    d = c.step(busy(0, 64))
    assert d.new_limit == 64 and d.reason == "bound"
    low = Controller(CFG, limit=2)
    for i in range(10):
        low.step(busy(i * 10, low.limit, kv_cache_usage=0.99))
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


def test_idle_engine_gets_its_start_limit_back():
    """After an overload cut, an idle engine takes the next burst at the KV-safe start."""
    c = Controller(dataclasses.replace(DEFAULTS, ceiling=64, ttft_target_s=1.0), limit=32)
    c.step(Signals(t=0.0, in_flight=32, pending=10, ttft_p90_s=5.0))
    assert c.limit < 32
    held = c.step(Signals(t=1.0, in_flight=3, pending=0))
    assert held.reason == "steady" and c.limit < 32  # still busy: not idle
    arriving = c.step(Signals(t=2.0, in_flight=0, pending=0, arrivals=3))
    assert arriving.reason == "steady"  # refusing every arrival is empty, not idle
    back = c.step(Signals(t=60.0, in_flight=0, pending=0))
    assert (back.direction, back.reason, c.limit) == ("up", "idle", 32)
    c.set_start(100)
    assert c.start == c.limit == 64  # clamped to the ceiling


def test_increase_stops_where_the_kv_cache_is_full():
    """A probe never goes past what the KV cache holds at the running requests' mean size up
    to ``kv_probe_ratio`` (0.9), below the KV cut's ``kv_high_ratio`` (0.95): vLLM would
    answer it with preemption, and a probe landing at the cut's threshold would be cut back
    at the next decision."""
    assert CFG.kv_probe_ratio < CFG.kv_high_ratio
    c = Controller(CFG, limit=32)
    # 32 running fill 60 % of the cache: 32 x 0.9 / 0.6 = 48 fit; the step (+8) is inside.
    assert c.step(busy(0, 32, kv_cache_usage=0.6)).new_limit == 40
    # 40 running fill 85 %: 40 x 0.9 / 0.85 = 42 fit; the step (+10) is cut to 42.
    d = c.step(busy(2, 40, kv_cache_usage=0.85))
    assert (d.new_limit, d.direction, d.reason) == (42, "up", "kv_fit")
    # At the fit (42 running fill 92 %: in the band, neither a probe nor a cut), demand holds.
    d = c.step(busy(4, 42, kv_cache_usage=0.92))
    assert (d.new_limit, d.direction, d.reason) == (42, "hold", "kv_fit")


def test_kv_probe_ratio_never_lies_above_the_kv_cut():
    """A probe bound above the cut's threshold would probe into a cut: refused when built
    directly; from the settings, an operator who lowers the cut's ratio under the probe's
    default gets the probe lowered with it, not an error."""
    with pytest.raises(ValueError, match="kv_probe_ratio"):
        dataclasses.replace(CFG, kv_probe_ratio=0.97)
    low = ControllerConfig.from_settings(Settings(device="cuda", autotune_kv_high_ratio=0.8))
    assert low.kv_high_ratio == low.kv_probe_ratio == 0.8
    assert ControllerConfig.from_settings(Settings(
        device="cuda", autotune_kv_probe_ratio=0.7)).kv_probe_ratio == 0.7


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
    # The prefill rate does not bound it (the prefill backlog does, request by request).
    fast_kv = Signals(t=0, mean_request_tokens=1000.0, prefill_tokens_per_s=12_000.0, **idle)
    assert c.idle_limit(fast_kv) == 45
    d = c.step(dataclasses.replace(fast_kv, t=10))
    assert (d.direction, d.reason, c.limit) == ("up", "idle", 45)
    # A limit raised past it under load comes back down to it once idle.
    c.limit = 80
    d = c.step(dataclasses.replace(fast_kv, t=20))
    assert (d.direction, d.reason, c.limit) == ("down", "idle", 45)


def test_burst_budget_is_the_prefill_within_the_ttft_target_in_tokens():
    """A burst may bring what the engine prefills within the TTFT target at its last
    measured rate; nothing before a rate is known or where no capacity was set."""
    c = Controller(CFG, limit=8)
    assert c.burst_budget(10_000.0) is None  # no capacity: a pinned limit, count only
    c.set_capacity(48_000)
    assert c.burst_budget(None) is None
    assert c.burst_budget(12_345.6) == int(12_345.6 * CFG.ttft_target_s)


def test_burst_cap_is_the_idle_limit():
    """The KV size fit caps a burst. Before any
    request finished (no size known) the ceiling caps it, not the start, which assumes the
    largest image in every request: the budget counts the burst's own prompt tokens."""
    c = Controller(CFG, limit=8)
    assert c.burst_cap(None) == c.start == 8  # no capacity set: no budget, the count only
    c.set_capacity(64_000)
    assert c.burst_cap(None) == CFG.ceiling
    assert c.burst_cap(Signals(t=0, prefill_tokens_per_s=5000)) == CFG.ceiling
    s = Signals(t=0, mean_request_tokens=2000, prefill_tokens_per_s=5000)
    assert c.burst_cap(s) == c.idle_limit(s) == int(64_000 * CFG.kv_high_ratio / 2000)


def test_the_probe_room_is_what_the_next_decision_adds_for_a_queue():
    """``probe_no_shed``: the requests the next probe would admit (the limiter queues them
    instead of shedding them for an expected wait measured at today's limit)."""
    c = Controller(CFG, limit=32)
    assert c.probe_room(busy(0, 32)) == 8  # a quarter of the limit, below max_step
    assert c.step(busy(0, 32)).new_limit == 40  # the probe adds just that
    assert c.probe_room(busy(2, 40, kv_cache_usage=0.85)) == 2  # up to the KV fit: 42
    assert c.probe_room(busy(2, 40, ttft_p90_s=0.8)) == 0  # no latency headroom
    assert c.probe_room(busy(2, 40, kv_cache_usage=0.99)) == 0  # overload
    c.set_start(64)
    assert c.probe_room(busy(4, 64)) == 0  # at the ceiling
    off = Controller(dataclasses.replace(CFG, ablate=frozenset({"probe_no_shed"})), limit=32)
    assert off.probe_room(busy(0, 32)) == 0
