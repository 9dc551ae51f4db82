"""The simulator's ``cpu`` profile, fitted to this machine's real engine from vLLM's step stats.

``python -m bench.calibrate [--out bench/out] [--update]`` (~4 min, alone on the machine)

One ``python -m serve`` on the tiny model, started with ``--bench-admin`` and vLLM's
``--enable-logging-iteration-details``, admits without a gateway limit (``off``) while the
CPU suite's T5 (chat, image uploads, long answers, a burst in each) and T6 (chat at twice the
capacity: batches at the ceiling) of :data:`SEED` are replayed, T5 once unmeasured before to
warm the engine. ``GET /admin/bench/steps`` then gives every engine
step vLLM reported (:mod:`serve.steplog`): what it scheduled and when its output reached the
API process. The fit (:func:`fit_steps`):

- the step time is the interval between the arrivals of two consecutive steps while the
  engine stayed busy (the first left requests running or waiting, so the engine core started
  the second at once): schedule, model, sampling and the output's trip, the cycle the
  simulator's step stands for. (vLLM's own ``elapsed_ms`` starts after ``execute_model``
  returns; on the CPU's single-process executor the model has already run by then, so it
  times the sampling alone and is kept as a diagnostic, ``elapsed_s``.)
- ``a``, ``b``, ``c``, ``d`` of :class:`bench.sim.EngineConfig`: relative least squares
  (each step weighted by the inverse of its time: a step's noise is a share of it) of the
  step time on ``[1, scheduled requests, prefill tokens, encoded image tokens]``,
  non-negative (a coefficient the fit makes negative is dropped and the rest refitted:
  Lawson & Hanson's active set, 1974), refitted once without the steps whose relative
  residual exceeds :data:`TRIM_MADS` robust standard deviations (1.4826 x the median
  absolute deviation; a step held up by something outside the engine is not its cost);
- ``e`` (context tokens read) is 0: vLLM does not report the context a step reads, and
  ``b`` takes its mean, as in :data:`bench.sim.GPU_LIKE`;
- the KV cache (blocks, block size) is what vLLM sized (``/admin/autotuner``).

The profile is written to ``--out``/``cpu-profile.json`` with the fit's statistics (steps,
R^2, the residuals' spread, the commit); ``--update`` also writes
:data:`bench.sim.CPU_PROFILE_PATH`, the committed profile ``python -m bench.simjudge`` uses by
default. The last line (stdout)::

    calibrate steps=N a_ms=X b_ms=X c_us=X d_us=X r2=X trimmed=N blocks=N
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import statistics
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.sim import CPU_PROFILE_PATH, EngineConfig

#: The calibration traces' seed: not the witness's 0, so the check predicts traffic the fit
#: never saw.
SEED = 100
#: The regressors of vLLM's step time, in :class:`EngineConfig`'s names.
TERMS = ("step_base_s", "step_per_seq_s", "step_per_prefill_token_s", "step_per_image_token_s")


#: Residuals, in robust standard deviations, past which a step is left out of the refit.
TRIM_MADS = 4.0


@dataclass(frozen=True)
class Fit:
    """A fitted step-time model.

    Attributes:
        coef: seconds per unit of each of :data:`TERMS`.
        steps: steps fitted (after the trim).
        trimmed: steps left out of the refit (:data:`TRIM_MADS`).
        r2: coefficient of determination of the refit (unweighted, seconds).
        residual_sd_s: standard deviation of its residuals, seconds.
    """

    coef: dict[str, float]
    steps: int
    trimmed: int
    r2: float
    residual_sd_s: float

    def engine(self, num_gpu_blocks: int, block_size: int) -> EngineConfig:
        """The simulator's :class:`EngineConfig` with these constants and that KV cache
        (``max_num_seqs`` and ``max_num_batched_tokens`` come from the settings:
        :meth:`bench.sim.Setup.from_settings`)."""
        return EngineConfig(**self.coef, step_per_kv_token_s=0.0, block_size=block_size,
                            num_gpu_blocks=num_gpu_blocks)


def _row(step: Mapping) -> list[float]:
    return [1.0, float(step["prefill_requests"] + step["decode_requests"]),
            float(step["prefill_tokens"]), float(step["encoder_tokens"])]


def _predict(coef: Sequence[float], step: Mapping) -> float:
    """The step time the coefficients (in :data:`TERMS`' order) give ``step``, seconds."""
    return sum(c * v for c, v in zip(coef, _row(step), strict=True))


def nnls(rows: Sequence[Sequence[float]], y: Sequence[float]) -> list[float]:
    """Least squares ``rows @ x ~ y`` with ``x >= 0`` by active set: fit, drop the most
    negative coefficient (set it to 0), refit the rest, until none is negative (Lawson &
    Hanson, "Solving Least Squares Problems", 1974, ch. 23, in its simplest form: enough
    for 4 terms). Raises ValueError with no rows."""
    import numpy as np

    if not rows:
        raise ValueError("no steps to fit")
    a, b = np.asarray(rows, dtype=float), np.asarray(y, dtype=float)
    active = list(range(a.shape[1]))
    while True:
        x = np.zeros(a.shape[1])
        if active:
            x[active] = np.linalg.lstsq(a[:, active], b, rcond=None)[0]
        if not active or x.min() >= 0:
            return [float(v) for v in x]
        active.remove(int(np.argmin(x)))


def step_times(steps: Sequence[Mapping]) -> list[tuple[Mapping, float]]:
    """``(step, seconds)`` for each step that followed a step leaving the engine busy
    (running or waiting requests): the interval between their arrivals
    (:class:`serve.steplog.StepLog` records, in order)."""
    return [(cur, cur["t_s"] - prev["t_s"]) for prev, cur in zip(steps[:-1], steps[1:], strict=True)
            if prev["running"] + prev["waiting"] > 0
            and cur["prefill_requests"] + cur["decode_requests"] > 0]


def fit_steps(steps: Sequence[Mapping]) -> Fit:
    """Fit :class:`Fit` to :class:`serve.steplog.StepLog` records (module docstring).

    Raises ValueError when no step followed a busy one."""
    timed = [(s, t) for s, t in step_times(steps) if t > 0]

    def fit(points):
        # Relative least squares (each step weighted by 1 / its time): the noise of a step is
        # a share of it, so a 0.6-s image step must not drown the 5-ms decode steps.
        x = nnls([[v / t for v in _row(s)] for s, t in points], [1.0] * len(points))
        return x, [(t - _predict(x, s)) / t for s, t in points]

    x, rel = fit(timed)
    mad = statistics.median(abs(r) for r in rel) * 1.4826
    kept = [p for p, r in zip(timed, rel, strict=True) if abs(r) <= TRIM_MADS * mad] \
        if mad > 0 else list(timed)
    x, _ = fit(kept)
    res = [t - _predict(x, s) for s, t in kept]
    y = [t for _, t in kept]
    mean = statistics.fmean(y)
    ss_tot = sum((v - mean) ** 2 for v in y)
    ss_res = sum(r * r for r in res)
    return Fit(coef=dict(zip(TERMS, x, strict=True)), steps=len(kept),
               trimmed=len(timed) - len(kept),
               r2=1 - ss_res / ss_tot if ss_tot > 0 else math.nan,
               residual_sd_s=math.sqrt(ss_res / len(kept)))


def profile_record(fit: Fit, engine: EngineConfig, meta: Mapping) -> dict:
    """What ``cpu-profile.json`` holds: the engine constants, the fit and its provenance."""
    return {"engine": asdict(engine), "fit": asdict(fit), **meta,
            "method": "bench/calibrate.py: the interval between consecutive engine steps of a "
                      "busy engine (vLLM's iteration details) by relative non-negative least "
                      "squares "
                      "on [1, requests, prefill tokens, image tokens], refitted once without "
                      f"residuals past {TRIM_MADS:g} robust sd"}


def summary_line(fit: Fit, engine: EngineConfig) -> str:
    """``calibrate steps=N a_ms=... blocks=N``."""
    return (f"calibrate steps={fit.steps} a_ms={engine.step_base_s * 1e3:.2f} "
            f"b_ms={engine.step_per_seq_s * 1e3:.3f} "
            f"c_us={engine.step_per_prefill_token_s * 1e6:.2f} "
            f"d_us={engine.step_per_image_token_s * 1e6:.2f} r2={fit.r2:.3f} "
            f"trimmed={fit.trimmed} blocks={engine.num_gpu_blocks}")


def calibration_traces(seed: int = SEED) -> dict:
    """The traces the fit replays: the CPU suite's T5 and T6 of ``seed``."""
    from bench.trace import cpu_suite

    s = cpu_suite(seed)
    return {"T5": s["T5"], "T6": s["T6"]}


def collect(base_url: str, seed: int = SEED) -> tuple[list[dict], dict]:
    """Replay the calibration traces against a ``--bench-admin`` server (no gateway limit),
    the first once unmeasured; returns the measured replays' steps and the server's
    ``kv_capacity`` (``/admin/autotuner``). Raises RuntimeError when the server reported no
    step (vLLM started without ``--enable-logging-iteration-details``)."""
    import httpx

    from bench.cpu_engine import build_bodies, replay_http
    from bench.witness import drain
    from bench.workloads import served_model

    model = served_model(base_url)
    httpx.post(f"{base_url}/admin/bench/admission", json={"mode": "off"},
               timeout=30).raise_for_status()
    steps: list[dict] = []
    for i, (name, trace) in enumerate(calibration_traces(seed).items()):
        for measured in (False, True)[1 if i else 0:]:  # the first trace warms the engine
            bodies = build_bodies(trace, model, salt=f"calibrate-{name}-{measured}")
            asyncio.run(drain(base_url))
            httpx.get(f"{base_url}/admin/bench/steps", timeout=30)  # start clean
            asyncio.run(replay_http(trace, base_url, bodies, drain_s=30.0))
            got = httpx.get(f"{base_url}/admin/bench/steps", timeout=60).json()
            if measured:
                steps += got["steps"]
            print(f"calibrate: {name} {'measured' if measured else 'warm-up'}: "
                  f"{len(got['steps'])} steps", file=sys.stderr, flush=True)
    if not steps:
        raise RuntimeError("the server reported no engine step: start it with "
                           "--enable-logging-iteration-details")
    kv = httpx.get(f"{base_url}/admin/autotuner", timeout=30).json()["kv_capacity"]
    return steps, kv


#: How far the cpu profile's predictions of the witness's fixed-limit arms may be from the
#: real engine's (issue 32: within 15 %), per arm, of goodput and of the p90 TTFT.
CHECK_TOLERANCE = 0.15
#: The witness's fixed-limit arms the check predicts, and the simulator's mode and limit for
#: each (``off``: no gateway limit, the simulator's ``unlimited``).
CHECK_ARMS: dict[str, tuple[str, int | None]] = {"L8": ("static", 8), "L16": ("static", 16),
                                                 "off": ("unlimited", None)}


@dataclass(frozen=True)
class ArmCheck:
    """One arm, pooled over the episodes: measured and predicted good requests and p90 TTFT
    (seconds, of the requests that got a first token; None: none did)."""

    arm: str
    good: int
    predicted_good: int
    ttft_p90_s: float | None
    predicted_ttft_p90_s: float | None

    def within(self, tolerance: float = CHECK_TOLERANCE) -> bool:
        """Both predictions within ``tolerance`` of the measurement (relative)."""
        def close(pred, meas) -> bool:
            if meas is None or pred is None:
                return meas is None and pred is None
            return abs(pred - meas) <= tolerance * abs(meas) if meas else pred == meas
        return close(self.predicted_good, self.good) and close(self.predicted_ttft_p90_s,
                                                                 self.ttft_p90_s)


def ranks_agree(arms: Sequence[ArmCheck], tolerance: float = CHECK_TOLERANCE) -> bool:
    """The prediction orders the arms by goodput as the measurement does: every pair the
    measurement separates by more than ``tolerance`` (relative to the larger) keeps its order
    in the prediction. Arms measured closer than that are a tie the measurement does not
    rank: requiring the prediction to order them would ask it for more precision than the
    check's own tolerance."""
    def apart(x: int, y: int) -> bool:
        return abs(x - y) > tolerance * max(x, y)
    return all((a.good - b.good) * (a.predicted_good - b.predicted_good) > 0
               for i, a in enumerate(arms) for b in arms[i + 1:] if apart(a.good, b.good))


def check(episodes: Mapping, good: Mapping[str, Mapping[str, int]],
          ttfts: Mapping[str, Mapping[str, Sequence[float]]], engine: EngineConfig,
          slo=None) -> tuple[bool, list[ArmCheck]]:
    """The calibration check (issue 32 point 3): the cpu profile ``engine`` replays every
    witness episode (``{name: bench.trace.Trace}``) on each of :data:`CHECK_ARMS`; its good
    requests and p90 TTFT, pooled over the episodes, must be within
    :data:`CHECK_TOLERANCE` of the real engine's (``good``/``ttfts``: ``{episode: {arm:
    ...}}``, the witness's), and rank the arms as the real engine does. Arms the witness did
    not run are skipped; ``slo`` (:class:`serve.admission.goodput.SloTargets`): the targets
    the witness's server booted with and counted good requests by (default the cpu
    profile's). Returns ``(ok, per-arm rows)``."""
    from bench.autotune import suite_setup, summarize
    from bench.sim import simulate
    from serve.admission.engine_stats import percentile

    # The simulated server boots with the witness's targets: its SLO shedding and engine
    # queue are bounded by the TTFT target, so they shape the TTFTs compared below.
    setup, _ = suite_setup("cpu", engine, slo)
    rows = []
    for arm, (mode, limit) in CHECK_ARMS.items():
        names = [e for e in episodes if arm in good.get(e, {})]
        if not names:
            continue
        pred_good, pred_ttft = 0, []
        for e in names:
            run = simulate(episodes[e], mode, limit, setup)
            pred_good += summarize(arm, run.requests, episodes[e], setup.slo).good
            pred_ttft += [r.ttft_s for r in run.requests if r.ttft_s is not None]
        meas_ttft = [t for e in names for t in ttfts[e][arm]]
        rows.append(ArmCheck(arm, sum(good[e][arm] for e in names), pred_good,
                             percentile(meas_ttft, 90), percentile(pred_ttft, 90)))
    ok = bool(rows) and all(r.within() for r in rows) and ranks_agree(rows)
    return ok, rows


def format_check(ok: bool, rows: Sequence[ArmCheck]) -> str:
    """The check's table and its verdict, ``calib=ok`` or ``calib=off``."""
    def sec(v):
        return "-" if v is None else f"{v:.2f}"
    lines = [f"{'arm':<5} {'good':>5} {'predicted':>9} {'p90 TTFT s':>10} {'predicted':>9}"]
    off = f"  (off by > {CHECK_TOLERANCE:.0%})"
    lines += [f"{r.arm:<5} {r.good:>5} {r.predicted_good:>9} {sec(r.ttft_p90_s):>10} "
              f"{sec(r.predicted_ttft_p90_s):>9}{'' if r.within() else off}" for r in rows]
    lines.append(f"calib={'ok' if ok else 'off'} (within {CHECK_TOLERANCE:.0%} and the same "
                 f"ranking{'' if ranks_agree(rows) else ': the ranking differs'})")
    return "\n".join(lines)


#: The server's flags for a calibration (and the witness's check of it).
SERVER_ARGS = ("--bench-admin", "--enable-logging-iteration-details")


def main(argv: Sequence[str] | None = None) -> int:
    """The CLI (module docstring); 0, or 2 when no step was reported."""
    p = argparse.ArgumentParser(prog="python -m bench.calibrate",
                                description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=Path("bench/out"))
    p.add_argument("--url", help="a server already running with " + " ".join(SERVER_ARGS))
    p.add_argument("--steps", type=Path, help="refit the steps of an earlier run "
                   "(its calibrate-steps.json) instead of running the engine")
    p.add_argument("--update", action="store_true", help=f"also write {CPU_PROFILE_PATH.name}")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    if args.steps is not None:
        run = json.loads(args.steps.read_text())
    else:
        try:
            run = measure(args.url, args.out)
        except RuntimeError as e:
            print(f"calibrate: {e}", file=sys.stderr)
            return 2
        (args.out / "calibrate-steps.json").write_text(json.dumps(run))
    fit = fit_steps(run["steps"])
    engine = fit.engine(run["kv"]["num_gpu_blocks"], run["kv"]["block_size"])
    text = json.dumps(profile_record(fit, engine, run["meta"]), indent=1) + "\n"
    (args.out / "cpu-profile.json").write_text(text)
    if args.update:
        CPU_PROFILE_PATH.write_text(text)
    print(f"({fit.steps} steps fitted in {time.perf_counter() - t0:.0f} s)", file=sys.stderr)
    print(summary_line(fit, engine))
    return 0


def measure(url: str | None, out: Path) -> dict:
    """Run the calibration (:func:`collect`) against ``url``, or a server started here on
    the tiny model (its log in ``out``); ``{"steps", "kv", "meta"}`` (``meta``: commit,
    dirty, date, seed, traces). Raises RuntimeError as :func:`collect`."""
    from bench.autotune import CPU_AUTO_ARGS, CPU_SLO
    from bench.process import ensure_tiny_model, git_state, start_serve, stop_process

    server = None
    if url is None:
        ensure_tiny_model()
        print(f"calibrate: starting python -m serve on the tiny model (log "
              f"{out / 'calibrate-server.log'}) ...", file=sys.stderr, flush=True)
        server = start_serve([*SERVER_ARGS, "--slo-ttft-s", f"{CPU_SLO.ttft_s:g}",
                              "--slo-itl-s", f"{CPU_SLO.itl_s:g}", *CPU_AUTO_ARGS],
                             out / "calibrate-server.log")
        url = server.base_url
    try:
        steps, kv = collect(url)
    finally:
        if server is not None:
            stop_process(server)
    commit, dirty = git_state()
    meta = {"commit": commit, "dirty": dirty, "date": time.strftime("%Y-%m-%d", time.gmtime()),
            "seed": SEED, "traces": list(calibration_traces())}
    return {"steps": steps, "kv": kv, "meta": meta}


if __name__ == "__main__":
    sys.exit(main())
