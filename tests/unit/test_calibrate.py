"""The cpu profile's calibration: the step log the server keeps under ``--bench-admin``, the fit
of the simulator's step constants from it, and the check of the fitted profile against the
witness's fixed-limit arms (``bench.calibrate``)."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
from vllm.v1.metrics.stats import SchedulerIterationDetails, SchedulerStats

from bench import calibrate
from bench.sim import CPU_PROFILE_PATH, EngineConfig, cpu_profile, simulate
from bench.witness import episodes
from serve.admission.goodput import SloTargets
from serve.steplog import StepLog

TRUE = EngineConfig(step_base_s=0.004, step_per_seq_s=0.0005, step_per_prefill_token_s=25e-6,
                    step_per_image_token_s=0.002, num_gpu_blocks=1024, block_size=128)


def stats(ctx_reqs: int, ctx_tokens: int, gen: int, enc: int = 0, running: int = 1,
          elapsed_ms: float = 1.0, dummy: bool = False) -> SchedulerStats:
    return SchedulerStats(num_running_reqs=running, iteration_details=SchedulerIterationDetails(
        iteration_index=0, num_ctx_requests=ctx_reqs, num_ctx_tokens=ctx_tokens,
        num_generation_requests=gen, num_generation_tokens=gen, elapsed_ms=elapsed_ms,
        num_encoder_inputs=1 if enc else 0, num_encoder_output_tokens=enc, is_dummy=dummy))


def test_the_step_log_keeps_vllms_details_and_a_read_drains_it():
    now = [10.0]
    log = StepLog(clock=lambda: now[0], max_steps=2)
    log.record(SchedulerStats())  # no details: vLLM ran without the flag
    log.record(None)
    log.record(stats(0, 0, 0, dummy=True))
    assert log.drain() == {"steps": [], "dropped": 0}
    log.record(stats(1, 300, 2, enc=144, running=3, elapsed_ms=12.5))
    now[0] = 10.5
    log.record(stats(0, 0, 3, running=3))
    log.record(stats(0, 0, 3, running=0))  # the bound: the oldest goes, counted
    got = log.drain()
    assert got["dropped"] == 1 and len(got["steps"]) == 2
    assert got["steps"][0] == {"t_s": 10.5, "prefill_requests": 0, "prefill_tokens": 0,
                               "decode_requests": 3, "decode_tokens": 3, "encoder_tokens": 0,
                               "elapsed_s": 0.001, "running": 3, "waiting": 0}
    assert log.drain() == {"steps": [], "dropped": 0}


def synthetic_steps(engine: EngineConfig, n: int = 600, seed: int = 0,
                    outliers: int = 0, noise: float = 0.05) -> list[dict]:
    """Steps of a busy engine whose cycle follows ``engine``'s model with ``noise`` (a
    share); the ``outliers`` steps wait 1 s longer (an image still being decoded in front)."""
    rng = random.Random(seed)
    t, steps = 0.0, []
    for i in range(n):
        batch = rng.randint(1, 32)
        prefill_reqs = rng.choice([0, 0, 0, 1, 2])
        tokens = sum(rng.randint(50, 800) for _ in range(prefill_reqs))
        enc = 313 * (prefill_reqs and rng.random() < 0.3)
        dt = (engine.step_base_s + engine.step_per_seq_s * batch
              + engine.step_per_prefill_token_s * tokens + engine.step_per_image_token_s * enc)
        t += dt * rng.uniform(1 - noise, 1 + noise) + (1.0 if i < outliers else 0.0)
        decode = batch - prefill_reqs
        steps.append({"t_s": t, "prefill_requests": prefill_reqs, "prefill_tokens": tokens,
                      "decode_requests": decode, "decode_tokens": decode,
                      "encoder_tokens": enc, "elapsed_s": 0.001, "running": batch, "waiting": 0})
    return steps


def test_the_fit_recovers_the_step_constants_and_leaves_out_the_stalled_steps():
    fit = calibrate.fit_steps(synthetic_steps(TRUE, outliers=20))
    assert fit.trimmed >= 19 and fit.r2 > 0.95  # the 1-s stalls are not the engine's
    engine = fit.engine(1024, 128)
    for name in calibrate.TERMS:
        assert getattr(engine, name) == pytest.approx(getattr(TRUE, name), rel=0.15), name
    assert (engine.num_gpu_blocks, engine.block_size, engine.step_per_kv_token_s) == (1024, 128, 0)
    assert calibrate.summary_line(fit, engine).startswith("calibrate steps=")


def test_only_a_step_that_followed_a_busy_engine_is_timed():
    steps = synthetic_steps(TRUE, n=4)
    steps[1] = {**steps[1], "running": 0}  # the engine went idle: the next gap is idle time
    timed = calibrate.step_times(steps)
    assert [s for s, _ in timed] == [steps[1], steps[3]]
    assert timed[0][1] == steps[1]["t_s"] - steps[0]["t_s"]


def test_a_negative_coefficient_is_dropped_and_the_rest_refitted():
    # y = 2 + 3 x1 exactly, with x2 anti-correlated noise that plain least squares would use
    rows = [[1.0, x, (x * 7) % 5] for x in range(10)]
    x = calibrate.nnls(rows, [2 + 3 * r[1] - 0.1 * r[2] for r in rows])
    assert min(x) >= 0 and x[2] == 0
    with pytest.raises(ValueError):
        calibrate.nnls([], [])


def measured(eps, engine: EngineConfig, scale: float = 1.0, slo: SloTargets | None = None):
    """The witness's tables as an engine of ``engine`` would produce them (good x ``scale``)
    behind a server booted with ``slo`` (default the cpu profile's targets)."""
    from bench.autotune import suite_setup, summarize

    setup, _ = suite_setup("cpu", engine, slo)
    good, ttfts = {}, {}
    for name, trace in eps.items():
        good[name], ttfts[name] = {}, {}
        for arm, (mode, limit) in calibrate.CHECK_ARMS.items():
            run = simulate(trace, mode, limit, setup)
            good[name][arm] = round(summarize(arm, run.requests, trace, setup.slo).good * scale)
            ttfts[name][arm] = [r.ttft_s for r in run.requests if r.ttft_s is not None]
    return good, ttfts


def test_the_check_passes_a_profile_that_predicts_the_engine_and_fails_one_that_does_not():
    eps = {k: v for k, v in episodes(0).items() if k in ("T1/0", "T6/0", "T2/0")}
    good, ttfts = measured(eps, TRUE)
    ok, rows = calibrate.check(eps, good, ttfts, TRUE)
    assert ok and [r.arm for r in rows] == ["L8", "L16", "off"]
    assert "calib=ok" in calibrate.format_check(ok, rows)
    # An engine half as fast per step: the profile no longer predicts it.
    slow = replace(TRUE, step_base_s=2 * TRUE.step_base_s, step_per_seq_s=2 * TRUE.step_per_seq_s,
                   step_per_image_token_s=2 * TRUE.step_per_image_token_s)
    good, ttfts = measured(eps, slow)
    ok, rows = calibrate.check(eps, good, ttfts, TRUE)
    assert not ok and "calib=off" in calibrate.format_check(ok, rows)


def test_the_check_simulates_a_server_booted_with_the_witness_targets():
    """On a slow host the witness's server boots with targets sized by its speed, and its SLO
    shedding and engine queue are bounded by the TTFT target: a simulated server with the
    reference targets sheds what the real one queued and predicts shorter TTFTs, so the
    check simulates the server with the targets it is given."""
    from bench.autotune import CPU_SLO

    eps = {k: v for k, v in episodes(0).items() if k in ("T1/0", "T6/0", "T2/0")}
    slow = replace(TRUE, **{k: 2.4 * getattr(TRUE, k) for k in calibrate.TERMS})
    wide = SloTargets(2.4 * CPU_SLO.ttft_s, 2.4 * CPU_SLO.itl_s)
    good, ttfts = measured(eps, slow, slo=wide)
    ok, rows = calibrate.check(eps, good, ttfts, slow, wide)
    assert ok, calibrate.format_check(ok, rows)


def test_the_ranking_must_agree():
    row = calibrate.ArmCheck
    assert calibrate.ranks_agree([row("L8", 10, 11, 1.0, 1.0), row("off", 5, 4, 2.0, 2.0)])
    # measured 20 % apart: the prediction must keep the order (a tie does not either)
    assert not calibrate.ranks_agree([row("L8", 10, 9, 1.0, 1.0), row("off", 8, 10, 2.0, 2.0)])
    assert not calibrate.ranks_agree([row("L8", 10, 9, 1.0, 1.0), row("off", 8, 9, 2.0, 2.0)])
    # measured within the tolerance (268 vs 281): a tie the measurement does not rank
    assert calibrate.ranks_agree([row("L8", 268, 290, 1.0, 1.0), row("L16", 281, 280, 1.0, 1.0)])


def test_the_committed_profile_loads():
    engine = cpu_profile(CPU_PROFILE_PATH)
    assert engine.step_base_s > 0 and engine.num_gpu_blocks > 0
