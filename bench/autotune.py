"""Goodput of the live ``max_num_seqs`` autotuner against static limits.

``python -m bench.autotune [--out DIR] [--seed N] [--cpu-engine [URL]] [--skip-sim]``

**Simulator part** (always). The phase-changing trace of :func:`bench.trace.phase_trace`
(3 x 180 s) runs through :mod:`bench.sim` once with the autotuner (``auto``: the real
:class:`~serve.admission.controller.Controller` and
:class:`~serve.admission.loop.AutotuneLoop`) and once per static limit L in
:data:`STATIC_LIMITS`. Controller, gateway and SLO constants are those a GPU server with
today's ``serve.settings`` runs (``PHI3V_*`` environment variables apply, as for
``python -m serve``). Goodput is DistServe's
(as ``serve.admission.middleware`` counts it): finished requests whose client-side TTFT (queue
wait included) and mean ITL meet the SLO, per second of trace. The *per-phase oracle* takes,
for each phase, the best static L's good requests among those that arrived in that phase (a
hindsight limit switched exactly at the phase boundaries). The part ends with one line::

    goodput auto/best_static=X.XX auto/oracle=Y.YY

and writes ``limit.png`` (auto's L over time, needs matplotlib) and ``results.json`` to
``--out``.

**CPU engine part** (``--cpu-engine``, ~12 min). The same comparison on the real tiny engine
(``models/phi-3-vision-tiny``, built if missing) on this machine's CPU: for ``auto`` and each
static L in :data:`CPU_STATIC_LIMITS` (1..32: the CPU ceiling ``max_num_seqs`` is 32, so the
simulator's 64..256 would be L=32 again), start a fresh ``python -m serve`` with the benchmark's
SLO (:data:`CPU_SLO_TTFT_S`, :data:`CPU_SLO_ITL_S`), wait for ``/ready``, replay the seeded
:func:`bench.trace.cpu_trace` (3 x 25 s: short text at a high rate, then image uploads, then
long answers, a burst in each; images are crops of the real photos in ``../shared/images``,
sent as ``data:`` URLs) with streamed requests (:mod:`bench.cpu_engine`), stop the server,
next. Goodput is counted client-side, as above. ``auto`` runs with :data:`CPU_AUTO_ARGS`. Each
run first waits (up to ``--cpu-quiet-wait-s``) for other processes to leave the cores and
reports how many cores they used during the replay: the runs are sequential, so a neighbour's
job during one run skews the comparison. The part prints the table, auto's limit over time,
and ends with::

    cpu-engine goodput auto/best_static=X.XX

and writes ``cpu-results.json`` (every request's outcome) and the server logs to ``--out``.
``--cpu-engine URL`` (repeatable) replays the trace against servers already running instead
(their own flags and SLO; one row per server, labelled by the mode and limit each reports on
``/admin/autotuner``).

Progress goes to stderr (:mod:`bench.progress`): simulations, traces or servers done of the
total, with an ETA; stdout keeps the tables and the final lines.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from bench.progress import bar as progress_bar
from bench.progress import say
from bench.sim import PROFILES, EngineConfig, RequestResult, RunResult, Setup, simulate
from bench.trace import (
    CPU_CAPACITY,
    SUITE,
    SUITE_DESCRIPTIONS,
    Capacity,
    Trace,
    backlog_trace,
    chat_phase,
    concat_traces,
    cpu_suite,
    cpu_trace,
    long_phase,
    phase_trace,
    suite,
    vision_phase,
)
from serve.admission.engine_stats import percentile
from serve.admission.goodput import SloTargets
from serve.settings import Settings

#: Static limits compared with ``auto`` (requests): powers of two up to the GPU ceiling.
STATIC_LIMITS = (1, 2, 4, 8, 16, 32, 64, 128, 256)

# The autotuner's time constants (its latency window, decrease factor and KV probe ratio) are
# chosen on this benchmark's simulator over seeds (bench.simjudge): a window longer than the
# decrease takes to show keeps cutting on stale p90s (windup), and a deep decrease sheds the
# requests that a cut limit's draining in-flight requests hold back.


def gpu_setup() -> Setup:
    """What a GPU server with the current ``serve.settings`` runs."""
    return Setup.from_settings(Settings(device="cuda"))


@dataclass
class Summary:
    """Goodput and latency of one run (a simulation or an HTTP replay).

    Attributes:
        label: ``auto`` or ``L=<n>``.
        goodput_per_s: good requests per second of trace.
        good: requests that met both targets.
        total: requests in the trace.
        dropped: requests refused (HTTP 429 or another error).
        ttft_p90_s: p90 client-side TTFT of the requests that got a first token, seconds.
        itl_p90_s: p90 over finished requests of their mean ITL, seconds.
        preemptions: engine preemptions (None where unknown, e.g. over HTTP).
        good_by_phase: good requests by phase of arrival.
    """

    label: str
    goodput_per_s: float
    good: int
    total: int
    dropped: int
    ttft_p90_s: float | None
    itl_p90_s: float | None
    preemptions: int | None
    good_by_phase: dict[str, int] = field(default_factory=dict)


def summarize(label: str, results: list[RequestResult], trace: Trace, slo: SloTargets,
              preemptions: int | None = None) -> Summary:
    """Summary of per-request outcomes against ``slo`` over ``trace``'s duration."""
    good_by_phase = {p.name: 0 for p in trace.phases}
    for r in results:
        if r.good(slo):
            good_by_phase[r.request.phase] += 1
    good = sum(good_by_phase.values())
    return Summary(
        label=label, goodput_per_s=good / trace.duration_s, good=good, total=len(results),
        dropped=sum(r.dropped is not None for r in results),
        ttft_p90_s=percentile([r.ttft_s for r in results if r.ttft_s is not None], 90),
        itl_p90_s=percentile([r.mean_itl_s for r in results if r.mean_itl_s is not None], 90),
        preemptions=preemptions, good_by_phase=good_by_phase)


def oracle(statics: list[Summary], trace: Trace) -> tuple[float, dict[str, str]]:
    """Per-phase oracle: goodput (req/s) of the best static limit in each phase, and which."""
    best = {p.name: max(statics, key=lambda s: s.good_by_phase[p.name]) for p in trace.phases}
    good = sum(best[name].good_by_phase[name] for name in best)
    return good / trace.duration_s, {name: s.label for name, s in best.items()}


def format_table(rows: list[Summary]) -> str:
    """The benchmark table: one line per configuration."""
    def sec(v: float | None) -> str:
        return "-" if v is None else f"{v:.2f}"

    phases = list(rows[0].good_by_phase)
    lines = [f"{'L':>6} {'goodput/s':>9} {'good/total':>11} {'p90 TTFT s':>10} "
             f"{'p90 ITL s':>9} {'preempt':>7} {'dropped':>7}  good by phase: "
             + " ".join(f"{p:>9}" for p in phases)]
    for s in rows:
        lines.append(
            f"{s.label.removeprefix('L='):>6} {s.goodput_per_s:9.2f} {f'{s.good}/{s.total}':>11} "
            f"{sec(s.ttft_p90_s):>10} {sec(s.itl_p90_s):>9} "
            f"{'-' if s.preemptions is None else s.preemptions:>7} {s.dropped:>7}  "
            + " " * 15 + " ".join(f"{s.good_by_phase[p]:>9}" for p in phases))
    lines.append("(p90 TTFT: client-side, queue wait included, of requests that got a token; "
                 "p90 ITL: of each finished request's mean ITL; dropped: 429s)")
    return "\n".join(lines)


# --- simulator backend --------------------------------------------------------------------
def run_sim(trace: Trace, setup: Setup, limits: tuple[int, ...] = STATIC_LIMITS,
            progress: bool = False) -> tuple[RunResult, list[RunResult]]:
    """Simulate ``auto`` and every static limit on ``trace``: ``(auto, statics)``.
    ``progress``: a bar on stderr of the simulations done."""
    runs: list[RunResult] = []
    with progress_bar(1 + len(limits), "simulator", "run", disable=not progress) as bar:
        for mode, limit in [("auto", None), *(("static", L) for L in limits)]:
            bar.set_postfix_str(mode if limit is None else f"L={limit}")
            runs.append(simulate(trace, mode, limit, setup))
            bar.update()
    return runs[0], runs[1:]


@dataclass
class SimReport:
    """The simulator part's numbers (see the module docstring)."""

    rows: list[Summary]
    best_static: Summary
    oracle_goodput_per_s: float
    oracle_limits: dict[str, str]
    auto: RunResult

    @property
    def vs_best_static(self) -> float:
        return self.rows[0].goodput_per_s / self.best_static.goodput_per_s

    @property
    def vs_oracle(self) -> float:
        return self.rows[0].goodput_per_s / self.oracle_goodput_per_s


def sim_report(trace: Trace, setup: Setup, progress: bool = False) -> SimReport:
    """Run the simulator part on ``trace`` and compare ``auto`` with the statics
    (``progress``: :func:`run_sim`'s bar)."""
    auto, statics = run_sim(trace, setup, progress=progress)
    rows = [summarize(r.label, r.requests, trace, setup.slo, r.preemptions)
            for r in [auto, *statics]]
    oracle_goodput, oracle_limits = oracle(rows[1:], trace)
    return SimReport(rows, max(rows[1:], key=lambda s: s.goodput_per_s), oracle_goodput,
                     oracle_limits, auto)


def plot_limit(run: RunResult, trace: Trace, path: Path, oracle_limits: dict[str, str]) -> bool:
    """PNG of auto's limit over time, phases shaded, each phase's best static L dashed.

    Returns False (and writes nothing) where matplotlib is not installed.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(10, 4))
    t, limits = zip(*run.limits, strict=False)
    ax.step(t, limits, where="post", label="auto: limit L")
    start = 0.0
    for i, phase in enumerate(trace.phases):
        end = start + phase.duration_s
        ax.axvspan(start, end, alpha=0.06 * (1 + i % 2), color="grey")
        ax.hlines(int(oracle_limits[phase.name].removeprefix("L=")), start, end,
                  linestyles="dashed", colors="C1",
                  label="best static L of the phase" if i == 0 else None)
        ax.text(start + 3, 0.97, phase.name, transform=ax.get_xaxis_transform(), va="top")
        start = end
    ax.set_yscale("log", base=2)
    ax.set_xlabel("time, s")
    ax.set_ylabel("admission limit L (requests)")
    ax.set_title("Autotuned max_num_seqs on the simulated phase trace")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def sim_benchmark(out: Path, seed: int = 0) -> SimReport:
    """The simulator part: prints the table and the final line, writes the plot and JSON."""
    trace, setup = phase_trace(seed), gpu_setup()
    t0 = time.perf_counter()
    report = sim_report(trace, setup, progress=True)
    elapsed = time.perf_counter() - t0
    c = setup.controller
    print(f"simulator: {len(trace.requests)} requests over {trace.duration_s:.0f} s (seed "
          f"{seed}; {', '.join(f'{p.name} {p.rate_per_s:g}/s' for p in trace.phases)}, bursts "
          f"2-4x); SLO TTFT {setup.slo.ttft_s:g} s, ITL {setup.slo.itl_s:g} s; controller "
          f"settings: start {setup.start_limit}, window "
          f"{setup.window_s:g} s, interval {setup.interval_s:g} s, decrease "
          f"{c.decrease_factor:g}, headroom {c.headroom:g}; "
          f"{len(report.rows)} runs in {elapsed:.1f} s")
    print(format_table(report.rows))
    print(f"best static: {report.best_static.label} ({report.best_static.goodput_per_s:.2f}/s);"
          f" per-phase oracle {report.oracle_goodput_per_s:.2f}/s with "
          + ", ".join(f"{k} {v}" for k, v in report.oracle_limits.items()))
    out.mkdir(parents=True, exist_ok=True)
    if plot_limit(report.auto, trace, out / "limit.png", report.oracle_limits):
        print(f"plot: {out / 'limit.png'}")
    else:
        print("plot: skipped (matplotlib is not installed: pip install matplotlib==3.11.2)")
    (out / "results.json").write_text(json.dumps({
        "seed": seed, "duration_s": trace.duration_s, "setup": asdict(setup),
        "runs": [asdict(s) for s in report.rows],
        "oracle": {"goodput_per_s": report.oracle_goodput_per_s,
                   "limits": report.oracle_limits},
        "auto_limits": report.auto.limits}, indent=1))
    print(f"goodput auto/best_static={report.vs_best_static:.2f} "
          f"auto/oracle={report.vs_oracle:.2f}")
    return report


# --- the trace suite on the simulator (issue 12) ---------------------------------------------
def static_limits(ceiling: int) -> tuple[int, ...]:
    """Every power of two from 1 up to ``ceiling`` (and ``ceiling`` itself), requests."""
    out = [1 << i for i in range(ceiling.bit_length()) if 1 << i <= ceiling]
    return tuple(out if out[-1] == ceiling else [*out, ceiling])


def measure_capacity(setup: Setup, num_crops: int, seed: int = 0,
                     shapes: Capacity | None = None) -> Capacity:
    """The engine's saturated throughput per request mix (:class:`bench.trace.Capacity`).

    For each mix, ``4 x max_num_seqs`` requests arrive at once and the engine serves them
    with the best of two fixed limits, its own ``max_num_seqs`` and the KV-safe capacity (so
    that preemption thrash is not counted as capacity); throughput = finished / makespan.
    ``shapes``: the mixes' request shapes (``chat_output_tokens``; default the suite's);
    its rates are ignored.
    """
    ceiling = setup.engine.max_num_seqs
    base = Capacity(1.0, 1.0, 1.0, ceiling, num_crops=(num_crops, num_crops))
    if shapes is not None:
        base = replace(shapes, chat_rps=1.0, vision_rps=1.0, long_rps=1.0, ceiling=ceiling,
                       num_crops=(num_crops, num_crops))
    n = 4 * ceiling
    backlog = replace(setup, max_queue=n, max_queue_wait_s=1e9, slo_shedding=False)

    def rps(phase) -> float:
        trace = backlog_trace(phase, n, seed)
        runs = [simulate(trace, "static", limit, backlog)
                for limit in sorted({setup.start_limit, ceiling})]
        return max(sum(r.finished for r in run.requests) / run.end_s for run in runs)

    return replace(base, chat_rps=rps(chat_phase("chat", 1, 1, base)),
                   vision_rps=rps(vision_phase("vision", 1, 1, base)),
                   long_rps=rps(long_phase("long", 1, 1)))


@dataclass
class TraceRow:
    """One trace of the suite: ``auto``, every fixed limit and ``unlimited``."""

    name: str
    trace: Trace
    auto: Summary
    statics: list[Summary]
    unlimited: Summary
    auto_run: RunResult | None = None

    @property
    def best_static(self) -> Summary:
        return max(self.statics, key=lambda s: s.goodput_per_s)

    @staticmethod
    def _ratio(a: Summary, b: Summary) -> float:
        return a.goodput_per_s / b.goodput_per_s if b.goodput_per_s else float("inf")

    @property
    def vs_best_static(self) -> float:
        return self._ratio(self.auto, self.best_static)

    @property
    def vs_unlimited(self) -> float:
        return self._ratio(self.auto, self.unlimited)


def run_trace(name: str, trace: Trace, setup: Setup, limits: tuple[int, ...]) -> TraceRow:
    """Simulate ``auto``, each fixed limit and ``unlimited`` on one trace."""
    runs = [simulate(trace, "auto", None, setup),
            *(simulate(trace, "static", limit, setup) for limit in limits),
            simulate(trace, "unlimited", None, setup)]
    rows = [summarize(r.label, r.requests, trace, setup.slo, r.preemptions) for r in runs]
    return TraceRow(name, trace, rows[0], rows[1:-1], rows[-1], runs[0])


@dataclass
class SuiteReport:
    """The suite on one engine profile."""

    profile: str
    capacity: Capacity
    rows: list[TraceRow]

    @property
    def min_vs_best_static(self) -> float:
        return min(r.vs_best_static for r in self.rows)

    @property
    def min_vs_unlimited(self) -> float:
        return min(r.vs_unlimited for r in self.rows)

    def single_best_static(self) -> tuple[str, float]:
        """The one fixed limit an operator would pick for every trace (the best worst case
        of goodput / that trace's best fixed limit) and that worst ratio: the regret the
        autotuner removes."""
        labels = [s.label for s in self.rows[0].statics]

        def worst(label: str) -> float:
            return min(TraceRow._ratio(next(s for s in r.statics if s.label == label),
                                       r.best_static) for r in self.rows)

        best = max(labels, key=worst)
        return best, worst(best)


def suite_setup(profile: str, engine: EngineConfig | None = None,
                slo: SloTargets | None = None) -> tuple[Setup, int]:
    """The setup a server with today's settings runs on ``profile``, and its num_crops: a GPU
    server's defaults on ``gpu-like`` and ``h200``; on ``cpu`` a CPU server's defaults with
    the CPU benchmarks' SLO and autotuner time constants (:data:`CPU_SLO`,
    :data:`CPU_AUTO_ARGS`: what the real-engine witness's server runs).
    ``engine``: the profile's constants (default :data:`bench.sim.PROFILES`'s); ``slo``: the
    targets the server boots with (default the profile's above), which its controller, SLO
    shedding and engine queue use as well as the goodput count."""
    if profile == "cpu":
        slo = slo or CPU_SLO
        settings = Settings(device="cpu", slo_ttft_s=slo.ttft_s, slo_itl_s=slo.itl_s,
                            autotune_interval_s=CPU_AUTO_INTERVAL_S,
                            autotune_window_s=CPU_AUTO_WINDOW_S)
    else:
        targets = {} if slo is None else {"slo_ttft_s": slo.ttft_s, "slo_itl_s": slo.itl_s}
        settings = Settings(device="cuda", **targets)
    setup = Setup.from_settings(settings, engine if engine is not None else PROFILES[profile]())
    return setup, settings.resolved().num_crops


def suite_report(profile: str, seed: int = 0, scale: float = 1.0,
                 names: tuple[str, ...] = SUITE, bar=None) -> SuiteReport:
    """Run the trace suite on one simulator profile (:data:`bench.sim.PROFILES`). ``bar``
    (optional, :func:`bench.progress.bar`) counts the capacity measurement and each trace."""
    def step(what: str) -> None:
        if bar is not None:
            bar.set_postfix_str(f"{profile} {what}")

    def done() -> None:
        if bar is not None:
            bar.update()

    setup, num_crops = suite_setup(profile)
    step("capacity")
    capacity = measure_capacity(setup, num_crops, seed)
    done()
    limits = static_limits(setup.engine.max_num_seqs)
    traces = suite(capacity, seed, scale, names)
    rows = []
    for n, t in traces.items():
        step(n)
        rows.append(run_trace(n, t, setup, limits))
        done()
    return SuiteReport(profile, capacity, rows)


def format_suite(report: SuiteReport) -> str:
    """One row per trace: auto, the best fixed L and its goodput, unlimited, the ratios."""
    lines = [f"{'trace':<5} {'req':>5} {'auto/s':>7} {'best L':>7} {'its /s':>7} "
             f"{'unlim/s':>7} {'auto/best':>9} {'auto/unl':>8}  {'auto p90 TTFT/ITL s':>19} "
             f"{'preempt a/u':>11} {'429 a/u':>9}  what"]
    for r in report.rows:
        a, u = r.auto, r.unlimited
        lines.append(
            f"{r.name:<5} {len(r.trace.requests):>5} {a.goodput_per_s:7.2f} "
            f"{r.best_static.label.removeprefix('L='):>7} {r.best_static.goodput_per_s:7.2f} "
            f"{u.goodput_per_s:7.2f} {r.vs_best_static:9.2f} {r.vs_unlimited:8.2f}  "
            f"{a.ttft_p90_s or 0:9.2f}/{a.itl_p90_s or 0:<9.3f} "
            f"{f'{a.preemptions}/{u.preemptions}':>11} {f'{a.dropped}/{u.dropped}':>9}  "
            f"{SUITE_DESCRIPTIONS.get(r.name, '')}")
    return "\n".join(lines)


def suite_benchmark(out: Path, seed: int = 0,
                    profiles: tuple[str, ...] = tuple(PROFILES)) -> list[SuiteReport]:
    """The simulator part: the suite on each profile; prints the tables and the final line,
    writes ``suite.json`` to ``out``."""
    reports = []
    # Per profile: the capacity measurement, then each trace of the suite.
    bar = progress_bar(len(profiles) * (1 + len(SUITE)), "simulator suite", "step")
    for profile in profiles:
        t0 = time.perf_counter()
        report = suite_report(profile, seed, bar=bar)
        c = report.capacity
        setup, _ = suite_setup(profile)
        e = setup.engine
        say(f"simulator, profile {profile}: {e.num_gpu_blocks} KV blocks "
              f"({e.kv_capacity_tokens} tokens), max_num_seqs {e.max_num_seqs}, auto starts at "
              f"{setup.start_limit}; capacity (saturated) chat {c.chat_rps:.1f}/s, images "
              f"{c.vision_rps:.1f}/s, long answers {c.long_rps:.2f}/s; SLO TTFT "
              f"{setup.slo.ttft_s:g} s, ITL {setup.slo.itl_s:g} s; "
              f"{time.perf_counter() - t0:.0f} s")
        say(format_suite(report))
        label, worst = report.single_best_static()
        say(f"  single best fixed limit over the suite: {label} (worst trace at "
            f"{worst:.2f} of that trace's best fixed L); auto's worst: "
            f"{report.min_vs_best_static:.2f}")
        reports.append(report)
    bar.close()
    out.mkdir(parents=True, exist_ok=True)
    (out / "suite.json").write_text(json.dumps([{
        "profile": r.profile, "capacity": asdict(r.capacity),
        "traces": [{"name": t.name, "requests": len(t.trace.requests),
                    "duration_s": t.trace.duration_s, "auto": asdict(t.auto),
                    "unlimited": asdict(t.unlimited), "statics": [asdict(s) for s in t.statics],
                    "auto_limits": t.auto_run.limits} for t in r.rows]}
        for r in reports], indent=1))
    n = sum(len(r.rows) for r in reports)
    print(f"autotune traces={n} min auto/best_static="
          f"{min(r.min_vs_best_static for r in reports):.2f} min auto/unlimited="
          f"{min(r.min_vs_unlimited for r in reports):.2f}")
    return reports


# --- CPU engine part (the real tiny engine behind the real gateway) -------------------------
#: Static limits on the CPU engine: its ``max_num_seqs`` ceiling is 32, so ``--admission-limit``
#: 64..256 resolve to 32 (``Settings.resolved`` clamps the limit to the ceiling).
CPU_STATIC_LIMITS = (1, 2, 4, 8, 16, 32)
#: Server flags of every CPU run. The SLO targets are the benchmark's, not the CPU server's
#: defaults (TTFT 10 s / ITL 0.5 s: on this engine nothing but a queue would ever miss them),
#: chosen so that the phases differ: a 2 s TTFT is ~7 image encodes, so a burst of uploads
#: admitted at once misses it; a 50 ms mean ITL is ~10x an undisturbed decode step
#: (3.5 ms + 0.27 ms per sequence), so what misses it is a request whose decode is stalled by
#: other requests' image encodes (~0.3 s each, in the same engine step).
CPU_SLO_TTFT_S = 2.0
CPU_SLO_ITL_S = 0.05
CPU_SLO = SloTargets(CPU_SLO_TTFT_S, CPU_SLO_ITL_S)
#: ``auto``'s extra flags: the shipped controller with its time constants halved (sample
#: every 1 s instead of 2, latency window 5 s instead of 10: the same ratio), because the CPU
#: trace's phases last 25 s where the simulator's last 180 s.
CPU_AUTO_INTERVAL_S = 1.0
CPU_AUTO_WINDOW_S = 5.0
CPU_AUTO_ARGS = ("--autotune-interval-s", f"{CPU_AUTO_INTERVAL_S:g}",
                 "--autotune-window-s", f"{CPU_AUTO_WINDOW_S:g}")


#: Cores of other processes' CPU time during a replay above which a CPU run is "noisy". On
#: 2 cores a neighbour is no small error: beside another test suite using 0.5 / 0.9 / 0.75
#: cores, L=16 / 8 / 32 kept 384 / 46 / 125 requests good, against 441 / 391 / 482 on a quiet
#: machine.
NOISY_CORES = 0.25


def cpu_settings(limits: tuple[int, ...], auto_args: tuple[str, ...] = CPU_AUTO_ARGS):
    """The CPU runs, ``auto`` first: its flags, then ``--autotune static --admission-limit L``."""
    from bench.cpu_engine import Setting

    return [Setting("auto", ["--autotune", "auto", *auto_args]),
            *(Setting(f"L={n}", ["--autotune", "static", "--admission-limit", str(n)])
              for n in limits)]


def limit_timeline(limits: list[tuple[float, int]], trace: Trace, step_s: float = 2.5) -> str:
    """Auto's polled limit as text: one line per phase, the limit every ``step_s``."""
    lines, start = [], 0.0
    for phase in trace.phases:
        end = start + phase.duration_s
        ticks, t = [], start
        while t < end:
            seen = [limit for s, limit in limits if s <= t]
            ticks.append(str(seen[-1]) if seen else ".")
            t += step_s
        inside = [limit for s, limit in limits if start <= s < end]
        mean = f"{sum(inside) / len(inside):.1f}" if inside else "-"
        lines.append(f"  {phase.name:>9} (t={start:3.0f}-{end:3.0f} s, mean {mean:>4}): "
                     + " ".join(f"{x:>2}" for x in ticks))
        start = end
    return "\n".join(lines)


def _outcome(r: RequestResult) -> list:
    """One request of a CPU run for ``cpu-results.json``: ``[id, phase, arrival_s, ttft_s,
    mean_itl_s, tokens, dropped]`` (seconds, None where there is none)."""
    def rnd(v: float | None) -> float | None:
        return None if v is None else round(v, 4)

    return [r.request.id, r.request.phase, rnd(r.arrival_s), rnd(r.ttft_s), rnd(r.mean_itl_s),
            r.tokens, r.dropped]


@dataclass
class CpuReport:
    """The CPU engine part's numbers."""

    rows: list[Summary]
    replays: list
    best_static: Summary | None
    oracle_goodput_per_s: float | None
    oracle_limits: dict[str, str]

    @property
    def auto(self) -> Summary | None:
        return next((r for r in self.rows if r.label == "auto"), None)

    @property
    def vs_best_static(self) -> float | None:
        if self.auto is None or self.best_static is None or not self.best_static.goodput_per_s:
            return None
        return self.auto.goodput_per_s / self.best_static.goodput_per_s


def run_settings(settings: list, trace: Trace, bodies: list[bytes], common: list[str],
                 log_dir: Path, drain_s: float, slo: SloTargets, quiet_wait_s: float,
                 retries: int, desc: str = "cpu engine") -> tuple[list, list[dict]]:
    """Replay ``trace`` against a fresh server per setting, one after the other; a run during
    which other processes used more than :data:`NOISY_CORES` runs again, up to ``retries``
    times (the quietest attempt counts). Returns the replays and, per setting, how it ran.
    A progress bar on stderr, ``desc``, counts the server runs (a run again adds one)."""
    from bench import cpu_engine as ce

    replays, extra = [], []
    bar = progress_bar(len(settings), desc, "server")
    for setting in settings:
        attempts = []
        for attempt in range(1 + retries):
            bar.set_postfix_str(setting.label + (f" (attempt {attempt + 1})" if attempt else ""))
            waited = ce.wait_quiet(quiet_wait_s) if quiet_wait_s > 0 else 0.0
            t0 = time.monotonic()
            replay, ready_s, foreign = ce.run_setting(setting, trace, bodies, common,
                                                      log_dir, drain_s, attempt + 1)
            noisy = foreign is not None and foreign > NOISY_CORES
            attempts.append((noisy, foreign or 0.0, replay, {
                "args": setting.args, "ready_s": ready_s, "foreign_cores": foreign,
                "quiet_wait_s": waited, "attempt": attempt + 1}))
            good = sum(r.good(slo) for r in replay.results)
            lims = [limit for _, limit in replay.limits]
            say(f"  {setting.label:>5}: ready in {ready_s:.0f} s, replay "
                f"{replay.end_s:.0f} s (run {time.monotonic() - t0:.0f} s, waited "
                f"{waited:.0f} s for a quiet machine), good {good}/"
                f"{len(replay.results)}, limit {min(lims, default='?')}.."
                f"{max(lims, default='?')}, other processes "
                + ("?" if foreign is None else f"{foreign:.2f} cores")
                + (" NOISY: they shared the cores with this run"
                   + (", running it again" if attempt < retries else "")
                   if noisy else ""))
            if noisy and attempt < retries:
                bar.total += 1
            bar.update()
            if not noisy:
                break
        _, _, replay, info = min(attempts, key=lambda a: a[:2])  # the quietest attempt
        replays.append(replay)
        extra.append(info)
    bar.close()
    return replays, extra


def cpu_engine_benchmark(out: Path, seed: int = 0, urls: list[str] | None = None,
                         phase_s: float = 25.0, slo_ttft_s: float = CPU_SLO_TTFT_S,
                         slo_itl_s: float = CPU_SLO_ITL_S,
                         limits: tuple[int, ...] = CPU_STATIC_LIMITS,
                         quiet_wait_s: float = 30.0, retries: int = 1) -> CpuReport:
    """The CPU engine part: the same seeded :func:`bench.trace.cpu_trace` replayed against
    ``auto`` and every static L, each on a fresh ``python -m serve`` (the tiny model), one
    after the other; or, with ``urls``, against servers already running (their own flags,
    SLO and mode; one row each). A run during which other processes used more than
    :data:`NOISY_CORES` is run again, up to ``retries`` times (the quietest attempt counts).
    Prints the table and the final line, writes ``cpu-results.json`` and the server logs to
    ``out``."""
    from bench import cpu_engine as ce
    from bench import process

    t_start = time.monotonic()
    trace = cpu_trace(seed, phase_s)
    if urls:  # the servers' own targets (the first server's), as goodput must use
        import httpx

        config = httpx.get(f"{urls[0]}/admin/autotuner", timeout=10).json()["config"]
        slo = SloTargets(config["ttft_target_s"], config["itl_target_s"])
    else:
        slo = SloTargets(slo_ttft_s, slo_itl_s)
    # A request arriving at the end can still be good until TTFT + its whole answer at the
    # ITL target: stop waiting then (what is still open is cancelled and not good).
    drain_s = slo.ttft_s + slo.itl_s * max(r.output_tokens for r in trace.requests)
    log_dir = out / "cpu-engine"
    print(f"cpu engine: {len(trace.requests)} requests over {trace.duration_s:.0f} s (seed "
          f"{seed}; " + ", ".join(f"{p.name} {p.rate_per_s:g}/s" for p in trace.phases)
          + f", one 2-4x burst each; images: seeded crops of the real photos in "
          f"{ce.IMAGES_DIR}); drain {drain_s:.0f} s", flush=True)
    replays, extra = [], []
    if urls:
        with progress_bar(len(urls), "cpu engine", "server") as bar:
            for url in urls:
                say(f"  replaying against {url} ...")
                bar.set_postfix_str(url)
                replay = asyncio.run(ce.replay_http(trace, url, drain_s=drain_s))
                replays.append(replay)
                extra.append({"url": url})
                bar.update()
    else:
        process.ensure_tiny_model()
        bodies = ce.build_bodies(trace, process.TINY_MODEL.name)
        common = ["--slo-ttft-s", f"{slo.ttft_s:g}", "--slo-itl-s", f"{slo.itl_s:g}"]
        settings = cpu_settings(limits)
        print(f"  {len(settings)} servers, one at a time: python -m serve --model "
              f"{process.TINY_MODEL.relative_to(process.ROOT)} {' '.join(common)} plus "
              f"'{' '.join(settings[0].args)}' (auto) or '--autotune static "
              f"--admission-limit L'; CPU ceiling max_num_seqs 32, so L=64..256 are L=32",
              flush=True)
        replays, extra = run_settings(settings, trace, bodies, common, log_dir, drain_s, slo,
                                      quiet_wait_s, retries)
    rows = [summarize(r.label, r.results, trace, slo, r.preemptions) for r in replays]
    statics = [row for row in rows if row.label != "auto"]
    report = CpuReport(rows, replays, max(statics, key=lambda s: s.goodput_per_s, default=None),
                       *(oracle(statics, trace) if statics else (None, {})))
    noisy = [r.label for r, info in zip(replays, extra, strict=False)
             if (info.get("foreign_cores") or 0.0) > NOISY_CORES]
    print(f"cpu engine: SLO TTFT {slo.ttft_s:g} s, ITL {slo.itl_s:g} s")
    print(format_table(rows))
    for replay in replays:
        if replay.mode == "auto":
            print("auto's limit every 2.5 s (polled /admin/autotuner), by phase:")
            print(limit_timeline(replay.limits, trace))
    if report.best_static is not None:
        print(f"best static: {report.best_static.label} "
              f"({report.best_static.goodput_per_s:.2f}/s); per-phase oracle "
              f"{report.oracle_goodput_per_s:.2f}/s with "
              + ", ".join(f"{k} {v}" for k, v in report.oracle_limits.items()))
    out.mkdir(parents=True, exist_ok=True)
    (out / "cpu-results.json").write_text(json.dumps({
        "seed": seed, "duration_s": trace.duration_s, "drain_s": drain_s,
        "slo": asdict(slo), "phases": [asdict(p) for p in trace.phases],
        "runs": [{**asdict(row), **info, "limits": replay.limits, "cut_off": replay.cut_off,
                  "config": replay.config, "requests": [_outcome(r) for r in replay.results]}
                 for row, replay, info in zip(rows, replays, extra, strict=False)],
        "oracle": {"goodput_per_s": report.oracle_goodput_per_s,
                   "limits": report.oracle_limits}}, indent=1))
    print(f"cpu engine: {time.monotonic() - t_start:.0f} s in all; results: "
          f"{out / 'cpu-results.json'}, server logs: {log_dir}")
    if noisy:
        print(f"WARNING: other processes shared the cores during {', '.join(noisy)} (over "
              f"{NOISY_CORES:g} cores, see above): those rows, and the ratio below, measure the "
              "neighbours as much as the limit. Run again on a quiet machine.")
    if report.vs_best_static is not None:
        print(f"cpu-engine goodput auto/best_static={report.vs_best_static:.2f}")
    return report


#: Fixed limits of the CPU suite (requests). 1, 2 and 4 are left out: on the simulator they
#: are the best fixed limit of no trace, and each costs another ~2.5 minutes of the CPU run.
CPU_SUITE_LIMITS = (8, 16, 32)
#: Seconds of silence after each CPU suite trace, for the engine to finish what it left.
CPU_SUITE_GAP_S = 8.0


def cpu_suite_benchmark(out: Path, seed: int = 0, limits: tuple[int, ...] = CPU_SUITE_LIMITS,
                        slo: SloTargets = CPU_SLO,
                        quiet_wait_s: float = 30.0, retries: int = 1,
                        capacity: Capacity | None = None,
                        aa_limit: int | None = None) -> list[TraceRow]:
    """The suite on the real tiny engine (:func:`bench.trace.cpu_suite`: T1, T2, T5, T6 at CPU
    scale, played back to back with :data:`CPU_SUITE_GAP_S` between them), against ``auto``,
    each fixed limit and ``unlimited`` (plain vLLM's OpenAI server on the same engine), each
    a fresh server. The traces' rates are fractions of ``capacity``: by default measured
    first, in the same run (:func:`cpu_capacity_benchmark`, ~3 min), because this machine's
    speed moves from day to day. Prints one row per trace and the final line; writes
    ``cpu-suite.json``.

    ``aa_limit``: run that fixed limit a second time, last (label ``L=<n>b``, in no baseline),
    and print each trace's goodput ratio of the two runs (an A/A control: how far the same
    setting moves between two servers of one run, ~3.3 min more)."""
    from bench import cpu_engine as ce
    from bench import process

    if aa_limit is not None and aa_limit not in limits:
        # Checked before the ~20-min run: the A/A ratio needs the limit's first run.
        raise ValueError(f"aa_limit {aa_limit} is not one of the fixed limits {limits}")
    t_start = time.monotonic()
    if capacity is None:
        print("cpu engine suite: measuring this machine's capacity first", flush=True)
        capacity = cpu_capacity_benchmark(out, seed)
    parts = cpu_suite(seed, capacity)
    trace, by_name = concat_traces(parts, CPU_SUITE_GAP_S)
    drain_s = slo.ttft_s + slo.itl_s * max(r.output_tokens for r in trace.requests)
    process.ensure_tiny_model()
    bodies = ce.build_bodies(trace, process.TINY_MODEL.name)
    common = ["--slo-ttft-s", f"{slo.ttft_s:g}", "--slo-itl-s", f"{slo.itl_s:g}"]
    settings = [*cpu_settings(limits), ce.Setting("unlimited", raw=True)]
    if aa_limit is not None:
        settings.append(ce.Setting(f"L={aa_limit}b", ["--autotune", "static",
                                                      "--admission-limit", str(aa_limit)]))
    sizes = ", ".join(f"{n} {len(t.requests)} req/{t.duration_s:.0f} s"
                      for n, t in by_name.items())
    print(f"cpu engine suite: {sizes} (seed {seed}); {len(settings)} servers one at a time (auto: "
          f"'{' '.join(settings[0].args)}'; L={', '.join(map(str, limits))}; unlimited: "
          f"plain vLLM); SLO TTFT {slo.ttft_s:g} s, ITL {slo.itl_s:g} s", flush=True)
    replays, extra = run_settings(settings, trace, bodies, common, out / "cpu-suite", drain_s,
                                  slo, quiet_wait_s, retries)
    rows, aa = [], []
    for name, part in by_name.items():
        ids = {r.id for r in part.requests}
        sums = [summarize(setting.label, [r for r in rep.results if r.request.id in ids],
                          part, slo, None) for setting, rep in zip(settings, replays, strict=True)]
        rows.append(TraceRow(name, part, sums[0], sums[1:1 + len(limits)],
                             sums[1 + len(limits)]))
        if aa_limit is not None:
            first = next(x for x in sums if x.label == f"L={aa_limit}")
            aa.append(f"{name}={TraceRow._ratio(sums[-1], first):.2f}")
    print(format_suite(SuiteReport("cpu", capacity, rows)))
    out.mkdir(parents=True, exist_ok=True)
    (out / "cpu-suite.json").write_text(json.dumps({
        "seed": seed, "slo": asdict(slo), "capacity": asdict(capacity),
        "runs": [{"label": setting.label, **info, "limits": rep.limits, "fits": rep.fits,
                  "requests": [_outcome(r) for r in rep.results]}
                 for setting, rep, info in zip(settings, replays, extra, strict=True)],
        "traces": [{"name": t.name, "auto": asdict(t.auto), "unlimited": asdict(t.unlimited),
                    "statics": [asdict(x) for x in t.statics]} for t in rows]}, indent=1))
    for rep in replays:
        if rep.mode == "auto":
            print("auto's limit every 2.5 s (polled /admin/autotuner), by phase:")
            print(limit_timeline(rep.limits, trace))
    noisy = [setting.label for setting, info in zip(settings, extra, strict=True)
             if (info.get("foreign_cores") or 0.0) > NOISY_CORES]
    if noisy:
        print(f"WARNING: other processes shared the cores during {', '.join(noisy)}: run "
              "again on a quiet machine.")
    if aa:
        print(f"cpu-engine A/A goodput L={aa_limit}b/L={aa_limit} (the same fixed limit, two "
              f"servers of this run) {' '.join(aa)}")
    print(f"cpu engine suite: {time.monotonic() - t_start:.0f} s in all")
    print(f"cpu-engine min auto/best_static={min(r.vs_best_static for r in rows):.2f} "
          f"min auto/unlimited={min(r.vs_unlimited for r in rows):.2f}")
    return rows


def cpu_capacity_benchmark(out: Path, seed: int = 0) -> Capacity:
    """Measure :data:`bench.trace.CPU_CAPACITY` on this machine: for each mix, ``4 x
    max_num_seqs`` requests at once against a fresh server at the ceiling (no shedding, no
    queue limit); throughput = finished / the last finish time."""
    from bench import cpu_engine as ce
    from bench import process

    process.ensure_tiny_model()
    base = CPU_CAPACITY
    n = 4 * base.ceiling
    phases = {"chat_rps": chat_phase("chat", 1, 1, base),
              "vision_rps": vision_phase("vision", 1, 1, base),
              "long_rps": replace(long_phase("long", 1, 1), output_tokens=(200, 400))}
    setting = ce.Setting("L=32", ["--autotune", "static", "--admission-limit", "32",
                                  "--max-queue", str(n), "--max-queue-wait-s", "3600"])
    common = ["--slo-ttft-s", "3600", "--slo-itl-s", "3600"]
    found = {}
    for key, phase in phases.items():
        trace = backlog_trace(phase, n, seed)
        bodies = ce.build_bodies(trace, process.TINY_MODEL.name)
        # A run that shared the cores with other work runs once more (the quietest counts).
        (replay,), _ = run_settings([setting], trace, bodies, common, out / "cpu-capacity",
                                    600, SloTargets(3600, 3600), quiet_wait_s=0, retries=1,
                                    desc=f"capacity {len(found) + 1}/{len(phases)} {key}")
        done = [r.finish_s for r in replay.results if r.finish_s is not None]
        found[key] = len(done) / max(done)
        say(f"  {key}: {len(done)}/{n} finished in {max(done):.1f} s = {found[key]:.2f}/s")
    return replace(base, **found)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.autotune", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("bench/out"),
                        help="directory for the plots and JSON results (default: bench/out)")
    parser.add_argument("--seed", type=int, default=0, help="trace seed (default 0)")
    parser.add_argument("--cpu-engine", metavar="URL", nargs="?", const="", action="append",
                        help="also run the CPU engine part: with no URL, the CPU suite (T1, "
                        "T2, T5, T6) against auto, fixed limits and plain vLLM, one fresh "
                        "server each (~15 min); with URLs (repeatable), replay the CPU phase "
                        "trace against those servers")
    parser.add_argument("--cpu-limits", type=int, nargs="+", default=list(CPU_SUITE_LIMITS),
                        help="fixed limits of the CPU suite (default: "
                        f"{' '.join(map(str, CPU_SUITE_LIMITS))})")
    parser.add_argument("--cpu-capacity", action="store_true",
                        help="measure the tiny engine's saturated throughput per mix (what "
                        "the CPU suite measures first) and exit")
    parser.add_argument("--cpu-fixed-capacity", action="store_true",
                        help="CPU suite: load the engine at fractions of the reference "
                        "CPU_CAPACITY instead of measuring this machine first (~3 min less)")
    parser.add_argument("--cpu-phase-s", type=float, default=25.0,
                        help="length of each phase of the CPU phase trace replayed against "
                        "URLs, seconds (default 25)")
    parser.add_argument("--cpu-slo-ttft-s", type=float, default=CPU_SLO_TTFT_S,
                        help=f"TTFT target of the CPU servers (default {CPU_SLO_TTFT_S:g})")
    parser.add_argument("--cpu-slo-itl-s", type=float, default=CPU_SLO_ITL_S,
                        help=f"ITL target of the CPU servers (default {CPU_SLO_ITL_S:g})")
    parser.add_argument("--cpu-quiet-wait-s", type=float, default=30.0,
                        help="before each CPU run, wait up to this long for other processes "
                        "to leave the cores (default 30; 0: do not wait)")
    parser.add_argument("--cpu-retries", type=int, default=1,
                        help="run a CPU setting again when other processes used over "
                        f"{NOISY_CORES:g} cores during it, up to this many times (default 1)")
    parser.add_argument("--cpu-aa", type=int, default=None, metavar="L",
                        help="CPU suite: run fixed limit L (one of --cpu-limits) a second "
                        "time, last, and print each trace's goodput ratio of its two runs (an "
                        "A/A noise control, ~3.3 min more)")
    parser.add_argument("--profiles", nargs="+", default=list(PROFILES), choices=PROFILES,
                        help="simulator profiles of the suite (default: all)")
    parser.add_argument("--skip-sim", action="store_true",
                        help="skip the simulator part")
    args = parser.parse_args(argv)
    if args.cpu_capacity:
        print(cpu_capacity_benchmark(args.out, args.seed))
        return 0
    if not args.skip_sim:
        sim_benchmark(args.out, args.seed)
        suite_benchmark(args.out, args.seed, tuple(args.profiles))
    slo = SloTargets(args.cpu_slo_ttft_s, args.cpu_slo_itl_s)
    if args.cpu_engine and any(args.cpu_engine):
        cpu_engine_benchmark(args.out, args.seed, urls=[u for u in args.cpu_engine if u],
                             phase_s=args.cpu_phase_s, slo_ttft_s=slo.ttft_s,
                             slo_itl_s=slo.itl_s, quiet_wait_s=args.cpu_quiet_wait_s,
                             retries=args.cpu_retries)
    elif args.cpu_engine:
        cpu_suite_benchmark(args.out, args.seed, tuple(args.cpu_limits), slo,
                            args.cpu_quiet_wait_s, args.cpu_retries,
                            CPU_CAPACITY if args.cpu_fixed_capacity else None,
                            args.cpu_aa)
    return 0


if __name__ == "__main__":
    sys.exit(main())
