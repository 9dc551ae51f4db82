"""The engine feed: what the autotuner learns from vLLM's stat records (pure logic)."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from serve.admission.engine_stats import BURST_MIN_REQUESTS, EngineStatsFeed


@dataclass
class Sched:
    num_running_reqs: int
    num_waiting_reqs: int
    kv_cache_usage: float = 0.1


@dataclass
class Done:
    num_prompt_tokens: int
    num_generation_tokens: int
    mean_time_per_output_token: float = 0.0
    decode_time: float = 0.0
    e2e_latency: float = 0.0


@dataclass
class Iter:
    num_prompt_tokens: int = 0
    time_to_first_tokens_iter: list = field(default_factory=list)
    inter_token_latencies_iter: list = field(default_factory=list)
    finished_requests: list = field(default_factory=list)
    num_preempted_reqs: int = 0


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_mean_sizes_of_finished_requests():
    feed = EngineStatsFeed(clock=Clock())
    assert feed.mean_request_tokens is None
    feed.record(Sched(0, 0), Iter(finished_requests=[Done(900, 100), Done(300, 700)]))
    assert feed.mean_request_tokens == 1000


def test_prefill_rate_measured_on_a_burst():
    """Eight 1,000-token prompts reach an idle engine together; the fourth to eighth first
    tokens come 0.5 s and 1 s after they arrived: 8,000 tokens in 1 s."""
    clock = Clock()
    feed = EngineStatsFeed(clock=clock)
    feed.record(Sched(0, 0), None)  # idle
    clock.t = 100.5
    feed.record(Sched(8, 4), Iter(4000, [0.5, 0.5, 0.5, 0.5]))
    assert feed.prefill_tokens_per_s == 4000 / 0.5
    clock.t = 101.0
    feed.record(Sched(8, 0), Iter(4000, [1.0] * 4))
    assert feed.prefill_tokens_per_s == 8000 / 1.0
    # A request that arrived later ends the measurement: its prefill ran beside decodes.
    clock.t = 103.0
    feed.record(Sched(9, 0), Iter(5000, [0.2]))
    assert feed.prefill_tokens_per_s == 8000.0


def test_small_burst_is_not_measured():
    clock = Clock()
    feed = EngineStatsFeed(clock=clock)
    feed.record(Sched(0, 0), None)
    clock.t = 100.2
    feed.record(Sched(2, 0), Iter(600, [0.2] * (BURST_MIN_REQUESTS - 1)))
    assert feed.prefill_tokens_per_s is None


def test_a_burst_smaller_than_one_step_only_raises_the_prefill_rate():
    """Eight 60-token chats reach an idle engine after a burst of 4,000-token prompts
    measured 8,000 tokens/s: their 480 tokens take one 4,096-token step, whose fixed cost
    sets their TTFT (0.2 s: 2,400 tokens/s), so they do not lower the rate; a small burst
    that comes faster raises it, and one that fills a step lowers it."""
    clock = Clock()
    feed = EngineStatsFeed(clock=clock, step_tokens=4096)
    seen = []
    feed.on_prefill_rate = seen.append

    def burst(tokens_per_request: int, n: int, ttft_s: float) -> None:
        feed.record(Sched(0, 0), None)  # idle
        clock.t += ttft_s
        feed.record(Sched(n, 0), Iter(tokens_per_request * n, [ttft_s] * n))
        feed.record(Sched(0, 0), Iter(finished_requests=[Done(tokens_per_request, 2)] * n))
        clock.t += 5

    burst(4000, 8, 4.0)
    assert feed.prefill_tokens_per_s == 8000 and seen == [8000]
    burst(60, 8, 0.2)
    assert feed.prefill_tokens_per_s == 8000 and seen == [8000]
    burst(60, 8, 0.04)  # 12,000 tokens/s: a lower bound above the known rate
    assert feed.prefill_tokens_per_s == pytest.approx(12000)
    assert seen == [8000, pytest.approx(12000)]
    burst(1000, 8, 2.0)  # 8,000 tokens fill a step: the engine's throughput, lower
    assert feed.prefill_tokens_per_s == pytest.approx(4000)
    assert seen == [8000, pytest.approx(12000), pytest.approx(4000)]


def test_a_burst_smaller_than_one_step_is_not_the_first_measurement():
    """Eight 60-token chats at an idle engine that has no rate yet fill no step: their
    one-step TTFT says what the step's fixed cost is, not what an image burst of the same
    tokens would take, so no rate is set (nor a budget given) until a burst fills a step."""
    clock = Clock()
    feed = EngineStatsFeed(clock=clock, step_tokens=4096)
    seen = []
    feed.on_prefill_rate = seen.append
    feed.record(Sched(0, 0), None)
    clock.t = 100.04
    feed.record(Sched(8, 0), Iter(480, [0.04] * 8))
    assert feed.prefill_tokens_per_s is None and seen == []
    feed.record(Sched(0, 0), Iter(finished_requests=[Done(60, 2)] * 8))
    clock.t += 5
    feed.record(Sched(0, 0), None)
    clock.t += 1.0
    feed.record(Sched(8, 0), Iter(8000, [1.0] * 8))
    assert feed.prefill_tokens_per_s == 8000 and seen == [8000]


def test_a_spread_burst_is_measured_on_its_first_members():
    """A burst that reaches the engine spread over its intake: four 500-token prompts within
    0.2 s of the first, then four more 0.3-0.4 s after it, all completed in one step at
    t0 + 2 s. The first four are the burst; the step's tokens count for them by their share
    (4 of 8) over the 2 s since the first arrived: 1,000 tokens/s. Later steps do not count."""
    clock = Clock()
    feed = EngineStatsFeed(clock=clock)
    feed.record(Sched(0, 0), None)  # idle
    clock.t = 102.0
    feed.record(Sched(8, 0), Iter(4000, [2.0, 1.9, 1.85, 1.8, 1.7, 1.65, 1.62, 1.6]))
    assert feed.prefill_tokens_per_s == 2000 / 2.0
    clock.t = 103.0
    feed.record(Sched(8, 0), Iter(4000, [3.0] * 4))
    assert feed.prefill_tokens_per_s == 1000


def test_a_slow_burst_smaller_than_one_step_is_the_first_measurement():
    """Four image requests of 400 tokens (1,600: less than a 4,096-token step) that took 3 s
    to their first tokens, past the 2-s TTFT target: the encoder's work held them up, not a
    step's fixed cost, so their rate (533 tokens/s) is the first measurement."""
    clock = Clock()
    feed = EngineStatsFeed(clock=clock, step_tokens=4096, ttft_target_s=2.0)
    feed.record(Sched(0, 0), None)
    clock.t = 103.0
    feed.record(Sched(4, 0), Iter(1600, [3.0] * 4))
    assert feed.prefill_tokens_per_s == 1600 / 3.0


def test_prefill_rate_expires():
    from serve.admission.engine_stats import PREFILL_RATE_TTL_S

    clock = Clock()
    feed = EngineStatsFeed(clock=clock)
    feed.record(Sched(0, 0), None)
    clock.t = 100.5
    feed.record(Sched(8, 0), Iter(4000, [0.5] * 4))
    assert feed.prefill_tokens_per_s == 8000
    clock.t += PREFILL_RATE_TTL_S + 1
    assert feed.prefill_tokens_per_s is None


def test_sliding_window_keeps_steps_whole_and_bounded():
    from serve.admission.engine_stats import SlidingWindow

    clock = Clock()
    window = SlidingWindow(10.0, clock, max_samples=6)
    window.extend([0.1, 0.2, 0.3])  # one engine step's samples, one stamp
    clock.t += 5
    window.extend([0.4, 0.5])
    window.extend([])  # a step without samples adds nothing
    assert len(window) == 5 and window.percentile(100) == 0.5 and window.percentile(1) == 0.1
    assert window.sum() == pytest.approx(1.5)
    window.add(0.9)
    window.add(1.0)  # 7 > max_samples: the oldest step goes, whole
    assert len(window) == 4 and window.percentile(1) == 0.4
    assert window.sum() == pytest.approx(2.8) and window.mean() == pytest.approx(0.7)
    clock.t += 5.5  # the step stamped at t=105 is still inside 10 s, none older is left
    assert len(window) == 4
    clock.t += 10
    assert len(window) == 0 and window.percentile(90) is None and window.sum() == 0.0
    window.extend([0.25, 0.5])
    window.clear()
    assert len(window) == 0 and window.sum() == 0.0 and window.mean() is None


def test_tpot_window_holds_finished_requests_mean_itl():
    """The ITL signal is the requests' own mean inter-token latency (what the goodput rule
    judges), from vLLM's finished-request stats; one-token answers have none, and single
    token gaps do not enter it."""
    feed = EngineStatsFeed(clock=Clock())
    feed.record(Sched(2, 0), Iter(inter_token_latencies_iter=[0.3] * 8))  # a stall's gaps
    assert feed.tpot.percentile(90) is None
    feed.record(Sched(0, 0), Iter(finished_requests=[
        Done(100, 50, 0.02), Done(100, 1, 0.0), Done(100, 20, 0.04)]))
    assert len(feed.tpot) == 2 and feed.tpot.percentile(90) == 0.04


def test_the_loop_gives_a_burst_the_prefill_budget_its_rate_fits():
    """In mode auto the rate a burst measures becomes the limiter's burst budget at once
    (rate x TTFT target); a pinned limit (no capacity set) and mode static get none."""
    import dataclasses

    from serve.admission.controller import Controller, ControllerConfig
    from serve.admission.limiter import AdmissionLimiter
    from serve.admission.loop import AutotuneLoop
    from serve.settings import Settings

    cfg = dataclasses.replace(ControllerConfig.from_settings(Settings(device="cuda")),
                              ceiling=32, ttft_target_s=2.0)
    for mode, capacity, expected in (("auto", 100_000, 16_000), ("auto", None, None),
                                     ("static", 100_000, None)):
        clock = Clock()
        limiter = AdmissionLimiter(8, max_queue=100, max_queue_wait_s=60, clock=clock,
                                   ceiling=32)
        feed = EngineStatsFeed(clock=clock)
        controller = Controller(cfg, 8)
        controller.set_capacity(capacity)
        AutotuneLoop(controller, limiter, feed, mode=mode, interval_s=1.0, clock=clock)
        feed.record(Sched(0, 0), None)  # idle
        clock.t += 0.5
        feed.record(Sched(8, 4), Iter(4000, [0.5] * 4))  # 8,000 prompt tokens/s
        assert limiter.slots.burst_budget == expected, mode
        # ... and a cap: the idle limit without its TTFT fit (the ceiling before any
        # request finished: the budget counts the burst's own sizes).
        assert limiter.slots.burst_cap == (32 if expected else None), mode


async def test_the_loop_tells_the_limiter_what_its_next_probe_admits():
    """Each decision in mode auto writes the probe room (``probe_no_shed``) into the
    limiter: the requests the next probe would add while the limit binds with latency
    headroom; switching to a fixed limit clears it."""
    import asyncio
    import dataclasses

    from serve.admission.controller import Controller, ControllerConfig
    from serve.admission.limiter import AdmissionLimiter
    from serve.admission.loop import AutotuneLoop
    from serve.settings import Settings

    cfg = dataclasses.replace(ControllerConfig.from_settings(Settings(device="cuda")),
                              ceiling=32, min_seqs=1)
    clock = Clock()
    limiter = AdmissionLimiter(8, max_queue=100, max_queue_wait_s=60, clock=clock, ceiling=32)
    loop = AutotuneLoop(Controller(cfg, 8), limiter, EngineStatsFeed(clock=clock),
                        mode="auto", interval_s=1.0, clock=clock)
    held = [await limiter.acquire() for _ in range(8)]
    waiting = asyncio.create_task(limiter.acquire())
    await asyncio.sleep(0)
    clock.t += 1.0
    decision = loop.tick()
    assert (decision.reason, decision.new_limit) == ("demand", 10)  # 8 + a quarter
    assert limiter.slots.probe_room == 3  # the next probe: a quarter of 10
    loop.set_mode("static", 8)
    assert limiter.slots.probe_room == 0
    (await waiting).release()
    for slot in held:
        slot.release()
