"""``make bench``'s ledger and verdict: is the run valid, and is ours no worse than raw vLLM?

``python -m bench.verdict [--ledger bench/results/ledger.jsonl] [--commit SHA] [--md FILE]``

The **ledger** (JSON lines, appended by :mod:`bench.compare`) holds one record per measured
segment (``{"schema": 1, "run", "commit", "dirty", "half", "block", "cell", "arm", "position",
"rerun", "flagged", "metrics": {...}, "machine": {...}, "t"}``, no ``kind`` or
``"kind": "segment"``) and one per run end (``"kind": "run"``, with ``rss_peak_mib`` per arm).
A block is ``(run, block)``; when a flagged segment was rerun, the **last** record of each
``(run, block, cell, arm)`` in file order counts (:func:`blocks_of`).

:func:`judge` scores the targets of issue 31 (constants below) on the blocks it is given,
with paired per-block values and intervals over blocks (:mod:`bench.stats`; Kalibera & Jones,
ISMM 2013): a target **passes** when its whole 90 % t-interval is on the right side of its
margin, **fails** when the whole interval is on the wrong side, and is **inconclusive** when
it straddles the margin (or has fewer than 2 blocks). The run is **valid** only when every
A/A interval (``raw2/raw``, two identical raw servers) lies inside its band; otherwise the
result is ``unresolved``: the run does not count, and the notes say which interval fell
outside. The CLI pools every run of the newest run's ``(commit, dirty)``, and of the commits
that hold the same code (:func:`select_pool`), and prints the summary, the notes, and
:func:`verdict_line` last.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from bench import process, stats

#: Confidence level of every interval (two-sided), issue 31.
LEVEL = 0.90
#: The bootstrap cross-check's resamples and seed (deterministic), issue 31.
BOOTSTRAP_RESAMPLES, BOOTSTRAP_SEED = 2000, 0
#: W1 cells whose requests/s (``rps``) make the throughput endpoints, issue 31.
THROUGHPUT_CELLS = ("text4", "text16", "text64", "image16")
#: Validity, issue 31: the A/A (raw2/raw) pooled throughput interval must lie inside this band.
AA_POOLED_BAND = (0.96, 1.04)
#: Validity, issue 31: each throughput cell's A/A ``rps`` interval must lie inside this band.
AA_THROUGHPUT_BAND = (0.93, 1.07)
#: Validity, issue 31: each TTFT cell's A/A interval must lie inside this band.
AA_TTFT_BAND = (0.90, 1.10)
#: The TTFT cells of the A/A check, issue 31: (cell, metric in ms).
AA_TTFT_CELLS = (("text16", "ttft_p50_ms"), ("text64", "ttft_p50_ms"), ("photo", "ttft_ms"),
                 ("history", "ttft_late_ms"))
#: No worse than raw, issue 31: each throughput cell's ours/raw ``rps`` lower bound >= this.
CELL_THROUGHPUT_MIN = 0.95
#: No worse than raw, issue 31: the pooled throughput ours/raw lower bound >= this.
POOLED_THROUGHPUT_MIN = 0.97
#: No worse than raw, issue 31: ours/raw ``ttft_p50_ms`` upper bound <= this at text16, text64.
TTFT_P50_MAX = 1.08
#: No worse than raw, issue 31: what ours adds in front of the engine at text4 (ms), upper
#: bound <= this: per block ``(ttft_mean_ms - engine_ttft_mean_ms)`` ours minus raw.
ADDED_MS4_MAX = 2.0
#: No worse than raw, issue 31: burst (W4) makespan ours/raw upper bound <= this.
BURST_MAKESPAN_MAX = 1.10
#: No worse than raw, issue 31: ours/raw peak RSS (max over runs, point value) <= this.
RSS_MAX = 1.20
#: Ahead of raw, issue 31: 4-turn chat (W3) late-turn TTFT ours/raw upper bound <= this.
HISTORY_MAX = 0.80
#: Ahead of raw, issue 31: one 12 MP photo (W2) TTFT ours/raw upper bound <= this.
PHOTO_MAX = 1.05
#: Issue 31: API-process CPU per request, ours minus raw (ms), mean over text16 and text64,
#: upper bound <= this.
CPU_MS_MAX = 0.5
#: Ahead on a GPU host, issue 31 point 11 (``bench/gpu.sh``; reported when the run has the
#: ``raw4`` arm, raw vLLM at ``--api-server-count 4``, not part of the verdict): photo
#: requests/s (the ``photos`` cell) ours/raw and ours/raw4 lower bounds >= these ...
GPU_PHOTO_VS_RAW_MIN, GPU_PHOTO_VS_RAW4_MIN = 1.5, 1.1
#: ... and ours' own image16 requests/s and text64 output tokens/s lower bounds >= these.
GPU_IMAGE16_RPS_MIN, GPU_TEXT64_TOK_S_MIN = 9.0, 12000.0

NAN = float("nan")
BlockKey = tuple[str, int]
#: ``{(run, block): {cell: {arm: metrics}}}`` (see :data:`bench.stats.Blocks`).
BlockMap = dict[BlockKey, dict[str, dict[str, Mapping[str, Any]]]]


@dataclass(frozen=True)
class Target:
    """One target's score. ``kind``: ``ratio`` (ours/raw), ``ms`` (ours minus raw, ms) or
    ``count``/``point`` (no interval: ``lo == hi == estimate``). ``side``: ``min`` (the lower
    bound must reach ``margin``) or ``max`` (the upper bound must stay at or under it)."""

    name: str
    kind: str
    side: str
    margin: float
    estimate: float
    lo: float
    hi: float
    blocks: int
    verdict: str
    boot_lo: float = NAN
    boot_hi: float = NAN
    boot_verdict: str = ""
    note: str = ""
    cells: tuple[str, ...] = ()


@dataclass(frozen=True)
class Check:
    """One A/A (raw2/raw) validity interval and the band it must lie inside."""

    name: str
    estimate: float
    lo: float
    hi: float
    band: tuple[float, float]
    blocks: int

    @property
    def inside(self) -> bool:
        """Whether the whole interval lies inside the band (False without an interval)."""
        return self.band[0] <= self.lo and self.hi <= self.band[1]

    @property
    def straddles(self) -> bool:
        """Whether the interval is not inside the band but its estimate is: more blocks
        narrow it and may bring it inside, where an estimate outside the band (two servers
        that really differ) stays outside however many blocks run."""
        return not self.inside and self.band[0] <= self.estimate <= self.band[1]


@dataclass
class Verdict:
    """What :func:`judge` found: ``result`` is pass, fail, inconclusive or unresolved."""

    valid: bool
    result: str
    targets: dict[str, Target]
    validity: list[Check]
    notes: list[str] = field(default_factory=list)
    runs: list[str] = field(default_factory=list)
    blocks: int = 0
    reruns: int = 0
    flagged: int = 0
    burst_non200: int = 0
    rss: float = NAN
    commits: list[str] = field(default_factory=list)

    @property
    def wants_more_blocks(self) -> bool:
        """Whether more blocks could settle this verdict: it is inconclusive (a target's
        interval straddles its margin), or unresolved only by A/A intervals that straddle
        their bands (:attr:`Check.straddles`). :mod:`bench.compare` then adds blocks."""
        if self.result == "inconclusive":
            return True
        return self.result == "unresolved" and all(c.inside or c.straddles
                                                   for c in self.validity)


def read_ledger(path: Path | str) -> list[dict]:
    """The ledger's records in file order. Raises ValueError naming a bad line or schema."""
    records = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not JSON ({e})") from e
        if not isinstance(record, dict) or record.get("schema") != 1:
            raise ValueError(f"{path}:{n}: not a schema 1 ledger record")
        records.append(record)
    return records


def is_segment(record: Mapping) -> bool:
    """Whether a ledger record is a measured segment (no ``kind``, or ``kind: segment``)."""
    return record.get("kind", "segment") == "segment"


def blocks_of(records: Iterable[Mapping]) -> tuple[BlockMap, int, int]:
    """``({(run, block): {cell: {arm: metrics}}}`` sorted by key, superseded, flagged).

    The last record of each ``(run, block, cell, arm)`` wins (a rerun replaces its flagged
    segment); ``superseded`` counts the records so replaced, ``flagged`` the kept records
    still flagged.
    """
    last: dict[tuple, Mapping] = {}
    seen = 0
    for r in records:
        if is_segment(r):
            seen += 1
            last[(r["run"], int(r["block"]), r["cell"], r["arm"])] = r
    blocks: BlockMap = {}
    for (run, block, cell, arm), r in sorted(last.items(), key=lambda kv: kv[0]):
        blocks.setdefault((run, block), {}).setdefault(cell, {})[arm] = r.get("metrics") or {}
    return blocks, seen - len(last), sum(bool(r.get("flagged")) for r in last.values())


def _pooled_log_rps(blocks: BlockMap, arm: str) -> list[float]:
    """Per block, the mean over :data:`THROUGHPUT_CELLS` of ``log(arm/raw rps)`` (all 4 needed)."""
    out = []
    for cells in blocks.values():
        one = {"_": cells}  # this block alone, as stats.Blocks
        logs = [stats.paired_log_ratios(one, c, "rps", arm) for c in THROUGHPUT_CELLS]
        if all(logs):
            out.append(statistics.fmean(v[0] for v in logs))
    return out


def _added_ms(m: Mapping[str, Any]) -> float | None:
    """Client mean TTFT minus the engine-side mean TTFT of one segment (ms)."""
    a, b = stats.metric_value(m, "ttft_mean_ms"), stats.metric_value(m, "engine_ttft_mean_ms")
    return None if a is None or b is None else a - b


def _cpu_ms(blocks: BlockMap) -> list[float]:
    """Per block, the mean over text16 and text64 of ours minus raw ``api_cpu_ms`` (both needed)."""
    out = []
    for cells in blocks.values():
        one = {"_": cells}  # this block alone, as stats.Blocks
        diffs = [stats.paired_differences(one, c, "api_cpu_ms", "ours")
                 for c in ("text16", "text64")]
        if all(diffs):
            out.append(statistics.fmean(v[0] for v in diffs))
    return out


def _intervals(values: Sequence[float], level: float, log: bool) -> tuple[tuple, tuple]:
    """(t-interval, bootstrap interval) of per-block values, exp'd when ``log``; NaN if n < 2."""
    if len(values) < 2:
        return (NAN, NAN, NAN), (NAN, NAN, NAN)
    t = stats.t_interval(values, level)
    b = stats.bootstrap_interval(values, level, BOOTSTRAP_RESAMPLES, BOOTSTRAP_SEED)
    return (stats.exp_interval(t), stats.exp_interval(b)) if log else (t, b)


def decide(side: str, margin: float, lo: float, hi: float) -> str:
    """pass / fail / inconclusive of an interval against a margin (see :class:`Target`)."""
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return "inconclusive"
    good, bad = (lo >= margin, hi < margin) if side == "min" else (hi <= margin, lo > margin)
    return "pass" if good else "fail" if bad else "inconclusive"


def _cost(t: Target) -> str:
    """``real cost of x % (CI lo-hi %)``: a no-worse ratio wholly on the bad side of 1."""
    if t.side == "min" and t.hi < 1:
        x, a, b = 1 - t.estimate, 1 - t.hi, 1 - t.lo
    elif t.side == "max" and t.lo > 1:
        x, a, b = t.estimate - 1, t.lo - 1, t.hi - 1
    else:
        return ""
    return f"real cost of {100 * x:.1f} % (CI {100 * a:.1f}-{100 * b:.1f} %)"


def _target(name: str, kind: str, side: str, margin: float, values: Sequence[float],
            level: float, cells: tuple[str, ...], no_worse: bool) -> Target:
    """A target scored from its per-block values (log ratios when ``kind == 'ratio'``)."""
    (est, lo, hi), (_, blo, bhi) = _intervals(values, level, kind == "ratio")
    t = Target(name, kind, side, margin, est, lo, hi, len(values), decide(side, margin, lo, hi),
               blo, bhi, decide(side, margin, blo, bhi), cells=cells)
    if no_worse and kind == "ratio" and t.verdict == "pass":
        t = replace(t, note=_cost(t))
    return t


#: The interval targets of issue 31: name -> (kind, side, margin, per-block values of the
#: blocks, cells, no-worse target (real-cost note)).
_SPECS: dict[str, tuple[str, str, float, Callable[[BlockMap], list[float]], tuple, bool]] = {
    "throughput": ("ratio", "min", POOLED_THROUGHPUT_MIN, lambda b: _pooled_log_rps(b, "ours"),
                   THROUGHPUT_CELLS, True),
    **{f"rps_{c}": ("ratio", "min", CELL_THROUGHPUT_MIN,
                    lambda b, c=c: stats.paired_log_ratios(b, c, "rps", "ours"), (c,), True)
       for c in THROUGHPUT_CELLS},
    "ttft16": ("ratio", "max", TTFT_P50_MAX,
               lambda b: stats.paired_log_ratios(b, "text16", "ttft_p50_ms", "ours"),
               ("text16",), True),
    "ttft64": ("ratio", "max", TTFT_P50_MAX,
               lambda b: stats.paired_log_ratios(b, "text64", "ttft_p50_ms", "ours"),
               ("text64",), True),
    "added_ms4": ("ms", "max", ADDED_MS4_MAX,
                  lambda b: stats.paired_differences(b, "text4", _added_ms, "ours"),
                  ("text4",), True),
    "burst_makespan": ("ratio", "max", BURST_MAKESPAN_MAX,
                       lambda b: stats.paired_log_ratios(b, "burst", "makespan_s", "ours"),
                       ("burst",), True),
    "photo": ("ratio", "max", PHOTO_MAX,
              lambda b: stats.paired_log_ratios(b, "photo", "ttft_ms", "ours"), ("photo",), False),
    "history": ("ratio", "max", HISTORY_MAX,
                lambda b: stats.paired_log_ratios(b, "history", "ttft_late_ms", "ours"),
                ("history",), False),
    "cpu_ms": ("ms", "max", CPU_MS_MAX, _cpu_ms, ("text16", "text64"), False),
}


def _validity(blocks: BlockMap, level: float) -> list[Check]:
    """The A/A (raw2/raw) intervals of issue 31 with their bands."""
    series = [("raw2/raw pooled rps", AA_POOLED_BAND, _pooled_log_rps(blocks, "raw2"))]
    series += [(f"raw2/raw {c} rps", AA_THROUGHPUT_BAND,
                stats.paired_log_ratios(blocks, c, "rps", "raw2")) for c in THROUGHPUT_CELLS]
    series += [(f"raw2/raw {c} {m}", AA_TTFT_BAND, stats.paired_log_ratios(blocks, c, m, "raw2"))
               for c, m in AA_TTFT_CELLS]
    return [Check(name, *_intervals(v, level, True)[0], band, len(v)) for name, band, v in series]


def _fmt(t: Target | Check, kind: str = "ratio") -> str:
    """``X[lo,hi]``: 3 decimals for ratios, 2 for ms; ``nan[nan,nan]`` without an interval;
    a count as an integer, a point value as ``X``."""
    if kind == "count":
        return f"{t.estimate:.0f}"
    if kind == "point":
        return f"{t.estimate:.3f}"
    d = 3 if kind == "ratio" else 2
    if not math.isfinite(t.lo):
        return "nan[nan,nan]"
    return f"{t.estimate:.{d}f}[{t.lo:.{d}f},{t.hi:.{d}f}]"


def judge(records: Iterable[Mapping], level: float = LEVEL) -> Verdict:
    """Score the targets of issue 31 on the ledger ``records`` given (all of them pooled).

    The caller picks the records (one run, or :func:`select_pool`'s). Segment records build the
    blocks (:func:`blocks_of`); run records give the peak RSS (max over runs, per arm).
    """
    records = list(records)
    blocks, superseded, flagged = blocks_of(records)
    targets = {name: _target(name, kind, side, margin, fn(blocks), level, cells, no_worse)
               for name, (kind, side, margin, fn, cells, no_worse) in _SPECS.items()}
    bursts = [cells["burst"]["ours"] for cells in blocks.values()
              if "ours" in cells.get("burst", {})]
    non200 = int(sum(stats.metric_value(m, "non200") or 0 for m in bursts))
    targets["burst_non200"] = Target(
        "burst_non200", "count", "max", 0, non200, non200, non200, len(bursts),
        "fail" if non200 else "pass" if bursts else "inconclusive", cells=("burst",))
    peaks: dict[str, float] = {}
    for r in records:
        if r.get("kind") == "run":
            for arm, mib in (r.get("rss_peak_mib") or {}).items():
                if mib is not None:
                    peaks[arm] = max(peaks.get(arm, 0.0), float(mib))
    rss = peaks["ours"] / peaks["raw"] if peaks.get("ours") and peaks.get("raw") else NAN
    targets["rss"] = Target("rss", "point", "max", RSS_MAX, rss, rss, rss, 0,
                            decide("max", RSS_MAX, rss, rss))
    validity = _validity(blocks, level)
    valid = all(c.inside for c in validity)
    notes = [f"A/A interval outside its band: {c.name} {_fmt(c)} outside "
             f"[{c.band[0]:.2f},{c.band[1]:.2f}] ({c.blocks} blocks)"
             for c in validity if not c.inside]
    for t in targets.values():
        if t.note:
            notes.append(f"{t.name}: {t.note}")
        if t.kind in ("ratio", "ms") and t.blocks < 2:
            notes.append(f"{t.name}: too few blocks ({t.blocks}), inconclusive")
        elif t.boot_verdict and t.boot_verdict != t.verdict:
            d = 3 if t.kind == "ratio" else 2
            notes.append(f"{t.name}: the bootstrap interval [{t.boot_lo:.{d}f},{t.boot_hi:.{d}f}]"
                         f" says {t.boot_verdict}, the t-interval {t.verdict} (verdict kept)")
    if not bursts:
        notes.append("burst: no blocks, burst_non200 inconclusive")
    if not math.isfinite(rss):
        notes.append("rss: no run record with both ours and raw peaks, inconclusive")
    verdicts = {t.verdict for t in targets.values()}
    result = ("unresolved" if not valid else "fail" if "fail" in verdicts
              else "inconclusive" if "inconclusive" in verdicts else "pass")
    runs = sorted({str(r["run"]) for r in records if "run" in r})
    commits = list(dict.fromkeys(
        f"{str(r.get('commit', '?'))[:12]}{'-dirty' if r.get('dirty') else ''}"
        for r in records if "run" in r))
    return Verdict(valid, result, targets, validity, notes, runs, len(blocks), superseded,
                   flagged, non200, rss, commits)


def _ours_values(blocks: BlockMap, cell: str, metric: str) -> list[float]:
    """Ours' ``metric`` in ``cell``, one value per block that has it."""
    values = [stats.metric_value(cells.get(cell, {}).get("ours"), metric)
              for cells in blocks.values()]
    return [x for x in values if x is not None]


def gpu_targets(records: Iterable[Mapping], level: float = LEVEL) -> dict[str, Target]:
    """The GPU report's targets (the ``GPU_*`` constants) on ``records``: ratios as the
    verdict's (paired per block, log t-interval), absolute values with a t-interval over
    blocks (kind ``abs``)."""
    blocks, _, _ = blocks_of(records)
    specs = {
        "gpu_photo_rps": ("ratio", GPU_PHOTO_VS_RAW_MIN, ("photos",),
                          stats.paired_log_ratios(blocks, "photos", "rps", "ours")),
        "gpu_photo_rps_raw4": ("ratio", GPU_PHOTO_VS_RAW4_MIN, ("photos",),
                               stats.paired_log_ratios(blocks, "photos", "rps", "ours", "raw4")),
        "gpu_image16_rps": ("abs", GPU_IMAGE16_RPS_MIN, ("image16",),
                            _ours_values(blocks, "image16", "rps")),
        "gpu_text64_tok_s": ("abs", GPU_TEXT64_TOK_S_MIN, ("text64",),
                             _ours_values(blocks, "text64", "tok_s")),
    }
    return {name: _target(name, kind, "min", margin, values, level, cells, False)
            for name, (kind, margin, cells, values) in specs.items()}


def has_arm(records: Iterable[Mapping], arm: str) -> bool:
    """Whether any segment of ``records`` was measured on ``arm``."""
    return any(is_segment(r) and r.get("arm") == arm for r in records)


def gpu_lines(records: Iterable[Mapping], level: float = LEVEL) -> list[str]:
    """The GPU report, one line per target (``gpu target NAME: X[lo,hi] margin >= M blocks
    N: verdict``), or [] when no segment ran on the ``raw4`` arm (not a ``bench/gpu.sh`` run)."""
    records = list(records)
    if not has_arm(records, "raw4"):
        return []
    return [f"gpu target {t.name}: {_fmt(t, t.kind)} margin {_margin(t)} blocks {t.blocks}: "
            f"{t.verdict}" for t in gpu_targets(records, level).values()]


def verdict_line(v: Verdict) -> str:
    """The one-line verdict (the last line ``make bench`` prints); format of issue 31."""
    t = v.targets
    parts = [f"{name}={_fmt(t[name], t[name].kind)}" for name in
             ("throughput", "ttft16", "ttft64", "added_ms4", "photo", "history", "cpu_ms")]
    return (f"verdict valid={'yes' if v.valid else 'no'} {' '.join(parts)} "
            f"burst_non200={v.burst_non200} rss={v.rss:.3f} result={v.result}")


def _margin(t: Target) -> str:
    return f"{'≥' if t.side == 'min' else '≤'} {t.margin:g}"


def summary_lines(v: Verdict) -> list[str]:
    """What was pooled, each target and each A/A interval, one line each."""
    lines = [f"commit {', '.join(v.commits) or '?'}: pooled {len(v.runs)} run(s) "
             f"({', '.join(v.runs)}), {v.blocks} blocks, "
             f"{v.reruns} rerun segment(s), {v.flagged} flagged segment(s) kept"]
    for t in v.targets.values():
        d = 3 if t.kind == "ratio" else 2
        boot = (f" bootstrap [{t.boot_lo:.{d}f},{t.boot_hi:.{d}f}]"
                if t.kind in ("ratio", "ms") else "")
        lines.append(f"target {t.name}: {_fmt(t, t.kind)}{boot} margin {_margin(t)} "
                     f"blocks {t.blocks}: {t.verdict}")
    for c in v.validity:
        lines.append(f"A/A {c.name}: {_fmt(c)} band [{c.band[0]:g},{c.band[1]:g}] blocks "
                     f"{c.blocks}: {'inside' if c.inside else 'OUTSIDE'}")
    return lines


def _num(x: Any) -> str:
    """A median for the table: lists element-wise, big numbers with one decimal."""
    if isinstance(x, list):
        return "[" + ", ".join(_num(e) for e in x) + "]"
    if x is None or not math.isfinite(x):
        return "n/a"
    return f"{x:,.1f}" if abs(x) >= 100 else f"{x:.3g}"


def _median(values: list) -> Any:
    """Median of numbers, or element-wise median of equal-length lists of numbers."""
    nums = [float(x) for x in values if isinstance(x, (int, float)) and not isinstance(x, bool)]
    if nums:
        return statistics.median(nums)
    lists = [x for x in values if isinstance(x, list) and x]
    if lists and len({len(x) for x in lists}) == 1:
        cols = [[e for e in col if isinstance(e, (int, float))] for col in zip(*lists, strict=True)]
        return [statistics.median(c) if c else None for c in cols]
    return None


def _ratio_cell(blocks: BlockMap, cell: str, metric: str, arm: str, level: float) -> str:
    vals = stats.paired_log_ratios(blocks, cell, metric, arm)
    est, lo, hi = _intervals(vals, level, True)[0]
    return "n/a" if not math.isfinite(lo) else f"{est:.3f} [{lo:.3f}, {hi:.3f}]"


def markdown_table(v: Verdict, records: Iterable[Mapping], level: float = LEVEL) -> str:
    """The report in Markdown: the verdict, targets, A/A validity, and one table per cell
    (each arm's median of each metric over blocks, ours/raw and raw2/raw with intervals)."""
    blocks, _, _ = blocks_of(records)
    pct = f"{100 * level:g} %"
    out = ["# make bench: verdict", "", f"`{verdict_line(v)}`", "",
           f"Commit {', '.join(v.commits) or '?'}. Pooled {len(v.runs)} run(s): "
           f"{', '.join(v.runs) or 'none'}; {v.blocks} blocks; "
           f"{v.reruns} rerun segment(s); {v.flagged} flagged segment(s) kept.", ""]
    out += [f"## Targets ({pct} intervals over blocks; ratios ours/raw, ms ours minus raw)", "",
            "| target | estimate | t-interval | bootstrap | margin | verdict | blocks | note |",
            "|---|---|---|---|---|---|---|---|"]
    for t in v.targets.values():
        d = {"ratio": 3, "ms": 2, "point": 3}.get(t.kind, 0)
        ivs = [f"[{lo:.{d}f}, {hi:.{d}f}]" if t.kind in ("ratio", "ms") else ""
               for lo, hi in ((t.lo, t.hi), (t.boot_lo, t.boot_hi))]
        out.append(f"| {t.name} | {t.estimate:.{d}f} | {ivs[0]} | {ivs[1]} | {_margin(t)} | "
                   f"{t.verdict} | {t.blocks} | {t.note} |")
    out += ["", f"## Validity: A/A raw2/raw ({pct} t-intervals inside their bands)", "",
            "| interval | t-interval | band | inside | blocks |", "|---|---|---|---|---|"]
    out += [f"| {c.name} | {_fmt(c)} | [{c.band[0]:g}, {c.band[1]:g}] | "
            f"{'yes' if c.inside else '**no**'} | {c.blocks} |" for c in v.validity]
    cells = list(dict.fromkeys([*THROUGHPUT_CELLS, "photo", "history", "burst",
                                *(c for b in blocks.values() for c in b)]))
    for cell in cells:
        segs = [b[cell] for b in blocks.values() if cell in b]
        if not segs:
            continue
        arms = list(dict.fromkeys(["ours", "raw", "raw2", *sorted({a for s in segs for a in s})]))
        arms = [a for a in arms if any(a in s for s in segs)]
        metrics = list(dict.fromkeys(k for s in segs for m in s.values() for k in m))
        out += ["", f"## {cell} ({len(segs)} blocks)", "",
                f"| metric | {' | '.join(arms)} | ours/raw | raw2/raw |",
                "|---|" + "---|" * (len(arms) + 2)]
        for metric in metrics:
            meds = [_num(_median([s[a].get(metric) for s in segs if a in s])) for a in arms]
            out.append(f"| {metric} | {' | '.join(meds)} | "
                       f"{_ratio_cell(blocks, cell, metric, 'ours', level)} | "
                       f"{_ratio_cell(blocks, cell, metric, 'raw2', level)} |")
        mine = [t for t in v.targets.values() if cell in t.cells]
        if mine:
            out += ["", "Targets: " + "; ".join(f"{t.name} {_fmt(t, t.kind)} {_margin(t)}: "
                                               f"**{t.verdict}**" for t in mine) + "."]
    return "\n".join(out) + "\n"


def select_pool(records: Sequence[Mapping], commit: str | None = None,
                same_code: Callable[[str, str], bool] | None = None) -> list[Mapping]:
    """The records of every run sharing the ``(commit, dirty)`` of the newest run; with
    ``same_code`` (a predicate on two commits, :func:`bench.process.same_code`), also the
    clean runs of every commit it finds to hold the same code (a commit that only added
    results to the ledger does not split the evidence). Runs of a dirty checkout pool only
    with their own commit's dirty runs: their code is not in git.

    The newest run is the one of the last record in file order (with ``commit``: the last
    record whose commit starts with it). Raises ValueError when no record matches.
    """
    newest = [r for r in records if "run" in r and (commit is None
                                                   or str(r.get("commit", "")).startswith(commit))]
    if not newest:
        raise ValueError(f"no ledger record{f' of commit {commit}' if commit else ''}")
    key_commit, key_dirty = newest[-1].get("commit"), bool(newest[-1].get("dirty"))
    verdicts: dict[str, bool] = {}

    def pooled(r: Mapping) -> bool:
        c = r.get("commit")
        if bool(r.get("dirty")) != key_dirty:
            return False
        if c == key_commit:
            return True
        if key_dirty or same_code is None or not c or not key_commit:
            return False
        if c not in verdicts:
            verdicts[c] = same_code(str(c), str(key_commit))
        return verdicts[c]

    return [r for r in records if pooled(r)]


def main(argv: Sequence[str] | None = None) -> int:
    """The CLI (module docstring): summary, notes, and the verdict line last. 2 on no data."""
    p = argparse.ArgumentParser(prog="python -m bench.verdict", description=__doc__.split("\n")[0])
    p.add_argument("--ledger", type=Path, default=Path("bench/results/ledger.jsonl"))
    p.add_argument("--commit", help="pool the runs of this commit (prefix) instead of the "
                   "newest, with those of its code's other commits")
    p.add_argument("--md", type=Path, help="write the Markdown report here")
    args = p.parse_args(argv)
    try:
        pool = select_pool(read_ledger(args.ledger), args.commit, process.same_code)
    except (OSError, ValueError) as e:
        print(f"bench.verdict: {e}", file=sys.stderr)
        return 2
    v = judge(pool)
    for line in summary_lines(v):
        print(line)
    for note in v.notes:
        print(f"note: {note}")
    for line in gpu_lines(pool):
        print(line)
    if args.md:
        args.md.write_text(markdown_table(v, pool))
    print(verdict_line(v))
    return 0


if __name__ == "__main__":
    sys.exit(main())
