"""The simulator as the autotuner's judge: every trace, every profile, seeds 0-9.

``python -m bench.simjudge [--seeds 10] [--profiles gpu-like,h200,cpu] [--workers 2]
[--cpu-profile FILE]``

For each engine profile (:data:`bench.sim.PROFILES`) and seed, the suite's traces
(:func:`bench.trace.suite`, seeded; the capacity they are fractions of measured on that
profile with the same seed; on ``cpu``, the CPU suite the real-engine witness replays,
:func:`bench.trace.cpu_suite`, with the CPU benchmarks' SLO and autotuner time constants,
the SLO's targets sized by the profile's chat capacity over the committed profile's as the
witness sizes them by the host's, :func:`bench.witness.sized_slo`)
run through :mod:`bench.sim` once with the autotuner (``auto``), once per fixed limit L
(every power of two up to the ceiling) and once ``unlimited`` (no gateway limit: plain
vLLM's admission). Goodput is DistServe's: requests meeting both the
TTFT and the ITL target, per second of trace. The simulator is deterministic, so there is no
noise to average: each (profile, trace, seed) is one exact comparison, and the seeds vary the
arrivals and sizes the autotuner meets.

Auto is judged against each fixed L **separately**: ``auto / L`` per seed (no limit chosen in
hindsight over seeds), so "auto >= 0.95 of each fixed L" on a seed is ``auto / best L of that
seed >= 0.95``. The targets (issue 32), per profile and trace:

- on at least 9 of 10 seeds: ``auto >= 0.95 x`` every fixed L and ``auto >= 1.0 x`` unlimited;
- on the overload traces (:data:`OVERLOAD`): the median over seeds of ``auto / L`` >= 1.0 for
  each fixed L.

The runs are spread over ``--workers`` processes (each (profile, seed) is independent); a
progress bar on stderr counts the (profile, seed) jobs done, with an ETA. The last two lines
(stdout)::

    simjudge seeds=N worst auto/L=X auto/unlimited=Y result=pass|fail
    autotune sim seeds=N worst auto/L=X auto/unlimited=Y | calib=off | cpu aa=n/a ... result=R

The second is the simulator's half of the whole autotuner benchmark's line (issue 32), for a
run of the simulator alone: ``calib=off`` and ``n/a`` (the calibration check and the paired
episodes are :mod:`bench.witness`'s, which prints the whole line), and ``result`` is ``fail``
when the simulator fails and ``unresolved`` otherwise.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from bench.sim import PROFILES, EngineConfig, cpu_profile, simulate
from bench.trace import CPU_CAPACITY, cpu_suite, suite
from bench.witness import sized_slo

#: Traces that overload the engine (T2's bursts, T3 at 120 % of capacity, T6 at 2x), where
#: the median over seeds must reach every fixed limit.
OVERLOAD = ("T2", "T3", "T6")
#: Fraction of each fixed L's goodput auto must keep on a seed, and the seeds that must.
MARGIN_L = 0.95
MARGIN_UNLIMITED = 1.0
MIN_SEED_SHARE = 0.9


@dataclass
class Cell:
    """One (profile, trace, seed): good requests per second of trace of each arm.

    Attributes:
        auto: the autotuner's goodput, requests/s.
        statics: ``{L: goodput}`` of each fixed limit, requests/s (empty: auto only).
        unlimited: goodput with no gateway limit, requests/s (None: not run).
        good: good requests of auto (for pooling ablations over seeds).
    """

    profile: str
    trace: str
    seed: int
    auto: float
    good: int
    statics: dict[int, float] = field(default_factory=dict)
    unlimited: float | None = None

    def ratio(self, other: float | None) -> float:
        """``auto / other`` (1.0 when both are 0; inf when only ``other`` is)."""
        if other is None:
            return float("nan")
        if other == 0:
            return 1.0 if self.auto == 0 else float("inf")
        return self.auto / other


@functools.lru_cache(maxsize=None)
def _capacity(profile: str, seed: int, engine: EngineConfig | None = None):
    from bench.autotune import measure_capacity, suite_setup

    setup, num_crops = suite_setup(profile, engine)
    # On cpu, the CPU suite's shapes: the backlog CPU_CAPACITY was measured on.
    shapes = CPU_CAPACITY if profile == "cpu" else None
    return measure_capacity(setup, num_crops, seed, shapes=shapes)


@functools.lru_cache(maxsize=None)
def _setup_and_traces(profile: str, seed: int, engine: EngineConfig | None = None):
    from bench.autotune import CPU_SLO, static_limits, suite_setup

    capacity = _capacity(profile, seed, engine)
    if profile == "cpu":
        # The CPU suite (T1, T2, T5, T6 at CPU scale, with the CPU mixes' shapes): the traffic
        # the real-engine witness replays, which checks this profile. Its targets are sized
        # as the witness sizes them (bench.witness.sized_slo), by this profile's chat
        # capacity over the committed profile's: a profile fitted on a slower host is judged
        # as hard as the committed one, not failed by its host's speed.
        slo = sized_slo(capacity.chat_rps, CPU_SLO, _capacity("cpu", seed))
        setup, _ = suite_setup(profile, engine, slo)
        traces = cpu_suite(seed, capacity)
    else:
        setup, _ = suite_setup(profile, engine)
        traces = suite(capacity, seed)
    return setup, static_limits(setup.engine.max_num_seqs), traces


def run_cells(profile: str, seed: int, ablate: frozenset[str] = frozenset(),
              arms: bool = True, traces: Sequence[str] | None = None,
              engine: EngineConfig | None = None) -> list[Cell]:
    """Simulate the suite on ``profile`` with ``seed``: auto with the rules ``ablate`` off
    (:data:`serve.admission.rules.RULES`) and, when ``arms``, every fixed L and unlimited.
    ``traces``: the names to run (default every trace of the profile's suite: the CPU suite
    on ``cpu``); ``engine``: the profile's constants (default :data:`bench.sim.PROFILES`'s).
    Returns one :class:`Cell` per trace."""
    from bench.autotune import summarize

    setup, limits, all_traces = _setup_and_traces(profile, seed, engine)
    auto_setup = replace(setup, controller=replace(setup.controller, ablate=ablate))
    cells = []
    for name in traces if traces is not None else list(all_traces):
        trace = all_traces[name]

        def goodput(run, trace=trace) -> tuple[float, int]:
            s = summarize(run.label, run.requests, trace, setup.slo, run.preemptions)
            return s.goodput_per_s, s.good

        auto, good = goodput(simulate(trace, "auto", None, auto_setup))
        cell = Cell(profile, name, seed, auto, good)
        if arms:
            cell.statics = {L: goodput(simulate(trace, "static", L, setup))[0] for L in limits}
            cell.unlimited = goodput(simulate(trace, "unlimited", None, setup))[0]
        cells.append(cell)
    return cells


def _run(job: tuple) -> list[Cell]:
    return run_cells(*job)


def run_jobs(fn, jobs: Sequence[tuple], workers: int, desc: str | None = None,
             label=None) -> list:
    """``[fn(job) for job in jobs]``, in ``workers`` processes (1: in this one), in job order.
    With ``desc``, a progress bar on stderr (:func:`bench.progress.bar`) counts the jobs done,
    each named by ``label(job)`` when it ends."""
    bar = None
    if desc is not None:
        from bench.progress import bar as progress_bar

        bar = progress_bar(len(jobs), desc, "job")

    def done(job: tuple) -> None:
        if bar is not None:
            if label is not None:
                bar.set_postfix_str(f"{label(job)} done", refresh=False)
            bar.update()

    try:
        if workers <= 1:
            out = []
            for job in jobs:
                out.append(fn(job))
                done(job)
            return out
        with ProcessPoolExecutor(workers) as pool:
            futures = {pool.submit(fn, job): i for i, job in enumerate(jobs)}
            results: list = [None] * len(jobs)
            for future in as_completed(futures):
                i = futures[future]
                results[i] = future.result()
                done(jobs[i])
            return results
    finally:
        if bar is not None:
            bar.close()


def run_grid(jobs: Iterable[tuple], workers: int = 2, progress: bool = False) -> list[Cell]:
    """Run :func:`run_cells` for each ``(profile, seed, ablate, arms, traces, engine)`` job, in
    ``workers`` processes (1: in this one); the cells of every job, in job order.
    ``progress``: a bar on stderr of the (profile, seed) jobs done, with an ETA."""
    jobs = list(jobs)
    parts = run_jobs(_run, jobs, workers, "simjudge" if progress else None,
                     lambda job: f"{job[0]} seed {job[1]}")
    return [c for cells in parts for c in cells]


@dataclass(frozen=True)
class TraceVerdict:
    """Auto on one (profile, trace) over the seeds.

    Attributes:
        worst_l: the smallest ``auto / L`` over seeds and fixed limits, and its L and seed.
        median_l: per fixed L, the median over seeds of ``auto / L``.
        share_l: share of seeds where auto >= :data:`MARGIN_L` x every fixed L.
        worst_unlimited, share_unlimited: the same against unlimited
            (:data:`MARGIN_UNLIMITED`).
        passed: the targets of the module docstring hold.
        fixed_passing: the arms that, judged in auto's place on the same seeds, meet the
            same targets: each fixed L (``"16"``) and ``"unlimited"``. Empty: no fixed limit
            chosen in hindsight for this trace meets them, so a FAIL there asks more than
            any fixed limit gives.
    """

    profile: str
    trace: str
    seeds: int
    worst_l: tuple[float, int, int]
    median_l: dict[int, float]
    share_l: float
    worst_unlimited: float
    share_unlimited: float
    passed: bool
    fixed_passing: tuple[str, ...] = ()


def _targets(group: Sequence[Cell]) -> tuple[tuple[float, int, int], dict[int, float], float,
                                              float, float, bool]:
    """The targets of the module docstring on one (profile, trace)'s cells: ``(worst_l,
    median_l, share_l, worst_unlimited, share_unlimited, passed)`` (:class:`TraceVerdict`)."""
    trace = group[0].trace
    per_l = {L: [c.ratio(c.statics[L]) for c in group] for L in group[0].statics}
    worst = min((r, L, c.seed) for L, rs in per_l.items()
                for r, c in zip(rs, group, strict=True))
    share_l = sum(all(c.ratio(g) >= MARGIN_L for g in c.statics.values())
                  for c in group) / len(group)
    unl = [c.ratio(c.unlimited) for c in group]
    share_u = sum(r >= MARGIN_UNLIMITED for r in unl) / len(group)
    medians = {L: statistics.median(rs) for L, rs in per_l.items()}
    passed = share_l >= MIN_SEED_SHARE and share_u >= MIN_SEED_SHARE and (
        trace not in OVERLOAD or all(m >= 1.0 for m in medians.values()))
    return worst, medians, share_l, min(unl), share_u, passed


def fixed_passing(group: Sequence[Cell]) -> tuple[str, ...]:
    """The arms of one (profile, trace)'s cells that meet auto's targets when judged in its
    place on the same seeds (:attr:`TraceVerdict.fixed_passing`): each fixed L, then
    ``"unlimited"``. Costs no simulation: the arms' goodputs are in the cells."""
    arms: list[tuple[str, list[Cell]]] = [
        (str(L), [replace(c, auto=c.statics[L]) for c in group]) for L in group[0].statics]
    arms.append(("unlimited", [replace(c, auto=c.unlimited) for c in group]))
    return tuple(name for name, cells in arms if _targets(cells)[-1])


def judge(cells: Sequence[Cell]) -> list[TraceVerdict]:
    """One :class:`TraceVerdict` per (profile, trace) of ``cells`` (which must have arms).
    Raises ValueError for a cell without fixed-L arms."""
    groups: dict[tuple[str, str], list[Cell]] = {}
    for c in cells:
        if not c.statics or c.unlimited is None:
            raise ValueError(f"cell {c.profile}/{c.trace}/seed {c.seed} has no fixed-L arms")
        groups.setdefault((c.profile, c.trace), []).append(c)
    return [TraceVerdict(profile, trace, len(group), *_targets(group),
                         fixed_passing=fixed_passing(group))
            for (profile, trace), group in groups.items()]


def format_verdicts(verdicts: Sequence[TraceVerdict]) -> str:
    """A table: per (profile, trace) the worst and the median-of-the-worst-L ratios, the
    seed shares, pass/fail, and the fixed limits that would pass in auto's place."""
    lines = [f"{'profile':<9} {'trace':<5} {'seeds':>5} {'worst auto/L':>18} "
             f"{'min median auto/L':>18} {'seeds ok L':>10} {'worst auto/unl':>14} "
             f"{'seeds ok unl':>12}  verdict  fixed L that pass"]
    for v in verdicts:
        r, lim, seed = v.worst_l
        med = min(v.median_l, key=v.median_l.get)
        lines.append(f"{v.profile:<9} {v.trace:<5} {v.seeds:>5} "
                     f"{f'{r:.3f} (L={lim}, s{seed})':>18} "
                     f"{f'{v.median_l[med]:.3f} (L={med})':>18} {v.share_l:>10.0%} "
                     f"{v.worst_unlimited:>14.3f} {v.share_unlimited:>12.0%}  "
                     f"{'pass' if v.passed else 'FAIL':<7}  "
                     f"{','.join(v.fixed_passing) or 'none'}")
    return "\n".join(lines)


def summary_line(verdicts: Sequence[TraceVerdict], seeds: int) -> str:
    """``simjudge seeds=N worst auto/L=X auto/unlimited=Y result=pass|fail``."""
    worst_l = min(v.worst_l[0] for v in verdicts)
    worst_u = min(v.worst_unlimited for v in verdicts)
    result = "pass" if all(v.passed for v in verdicts) else "fail"
    return (f"simjudge seeds={seeds} worst auto/L={worst_l:.3f} "
            f"auto/unlimited={worst_u:.3f} result={result}")


def sim_head(verdicts: Sequence[TraceVerdict], seeds: int) -> str:
    """The simulator's part of the benchmark's line of issue 32:
    ``autotune sim seeds=N worst auto/L=X auto/unlimited=Y`` (the witness completes it)."""
    worst_l = min(v.worst_l[0] for v in verdicts)
    worst_u = min(v.worst_unlimited for v in verdicts)
    return f"autotune sim seeds={seeds} worst auto/L={worst_l:.3f} auto/unlimited={worst_u:.3f}"


def autotune_line(verdicts: Sequence[TraceVerdict], seeds: int) -> str:
    """The benchmark's line of issue 32 with the simulator half filled in (module docstring)."""
    result = "unresolved" if all(v.passed for v in verdicts) else "fail"
    cpu = " ".join(f"{k}=n/a" for k in ("aa", "auto/L8", "auto/L16", "auto/off_overload",
                                         "auto/off_steady"))
    return f"{sim_head(verdicts, seeds)} | calib=off | cpu {cpu} result={result}"


def main(argv: Sequence[str] | None = None) -> int:
    """The CLI (module docstring). Writes ``simjudge.json`` to ``--out``; 0 (the verdict is
    in the last lines, as ``make bench``'s)."""
    p = argparse.ArgumentParser(prog="python -m bench.simjudge", description=__doc__.split("\n")[0])
    p.add_argument("--seeds", type=int, default=10)
    p.add_argument("--profiles", default=",".join(PROFILES))
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--cpu-profile", type=Path, help="the cpu profile's file (default: the "
                   "committed bench/cpu-profile.json; make bench-autotune passes its fresh "
                   "calibration)")
    p.add_argument("--out", type=Path, default=Path("bench/out"))
    args = p.parse_args(argv)
    profiles = [x for x in args.profiles.split(",") if x]
    t0 = time.perf_counter()
    engines = {"cpu": cpu_profile(args.cpu_profile)} if args.cpu_profile else {}
    cells = run_grid(((pr, seed, frozenset(), True, None, engines.get(pr)) for pr in profiles
                      for seed in range(args.seeds)), args.workers, progress=True)
    verdicts = judge(cells)
    print(format_verdicts(verdicts))
    print(f"({len(cells)} cells in {time.perf_counter() - t0:.0f} s)")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "simjudge.json").write_text(json.dumps(
        {"head": sim_head(verdicts, args.seeds), "passed": all(v.passed for v in verdicts),
         "cells": [asdict(c) for c in cells], "verdicts": [asdict(v) for v in verdicts]},
        indent=1))
    line = summary_line(verdicts, args.seeds)
    print(line)
    print(autotune_line(verdicts, args.seeds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
