"""``make bench``'s statistics (bench.stats) and verdict (bench.verdict) on synthetic ledgers."""

from __future__ import annotations

import itertools
import json
import math
import random
import re
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from bench import stats, verdict

ROOT = Path(__file__).resolve().parents[2]
ARMS = ("ours", "raw", "raw2")
N3 = r"(-?\d+\.\d{3}\[-?\d+\.\d{3},-?\d+\.\d{3}\]|nan\[nan,nan\])"
N2 = r"(-?\d+\.\d{2}\[-?\d+\.\d{2},-?\d+\.\d{2}\]|nan\[nan,nan\])"
LINE = re.compile(
    rf"verdict valid=(yes|no) throughput={N3} ttft16={N3} ttft64={N3} added_ms4={N2} "
    rf"photo={N3} history={N3} cpu_ms={N2} burst_non200=\d+ rss=(\d+\.\d{{3}}|nan) "
    r"result=(pass|fail|inconclusive|unresolved)")


def ledger(n_blocks=9, speed=0.99, raw2=1.0, noise=0.005, run="r1", commit="a" * 40,
           seed=1, non200=0, rss_ours=3900.0, dirty=False):
    """A synthetic run's records: every cell, every arm, in every block.

    ``speed`` (a number, or a function of the block's index): ours' throughput over raw's
    (ours' latencies are raw's / speed); ``raw2`` (the same): the A/A arm's over raw's. Each
    block has its own machine speed (shared by the arms, as in a blocked design) and each
    segment its own multiplicative noise. Ours is ahead on history (0.6x) and photo (0.9x),
    adds 0.5 ms in front of the engine and 0.1 ms API CPU per request.
    """
    rng = random.Random(seed)
    out = []
    for b in range(n_blocks):
        machine = 1 + 0.2 * rng.random()
        s = speed(b) if callable(speed) else speed
        for arm in ARMS:
            f = {"ours": s, "raw": 1.0, "raw2": raw2(b) if callable(raw2) else raw2}[arm]

            def jit(x, f=f):
                return x * f * (1 + noise * rng.gauss(0, 1))

            def lat(x, f=f, m=machine, ahead=1.0):
                return x * m * ahead * (1 + noise * rng.gauss(0, 1)) / f

            ours = arm == "ours"
            cells = {c: {"rps": jit(10 / machine), "tok_s": jit(1280 / machine),
                         "ttft_p50_ms": lat(100), "ttft_mean_ms": lat(120),
                         "api_cpu_ms": 2.0 + (0.1 if ours else 0) + 0.01 * rng.random(),
                         "engine_cpu_ms": None, "completed": 64, "failed": 0}
                     for c in verdict.THROUGHPUT_CELLS}
            for c in cells.values():  # engine-side TTFT: the client's less what the API adds
                c["engine_ttft_mean_ms"] = c["ttft_mean_ms"] - (3.5 if ours else 3.0)
            cells["photo"] = {"ttft_ms": lat(600, ahead=0.9 if ours else 1)}
            late = lat(800, ahead=0.6 if ours else 1)
            cells["history"] = {"ttft_late_ms": late, "ttft_turns_ms": [500, 600, late, late]}
            cells["burst"] = {"makespan_s": lat(10), "non200": non200 if ours else 0, "n": 32}
            for pos, (cell, metrics) in enumerate(cells.items()):
                out.append({"schema": 1, "run": run, "commit": commit, "dirty": dirty, "half": 0,
                            "block": b, "cell": cell, "arm": arm, "position": pos, "rerun": 0,
                            "flagged": False, "metrics": metrics,
                            "machine": {"steal": 0.0, "foreign_cpu": 0.01}, "t": 1e9 + b})
    out.append({"schema": 1, "kind": "run", "run": run, "commit": commit, "dirty": dirty,
                "blocks": n_blocks, "reruns": 0,
                "rss_peak_mib": {"ours": rss_ours, "raw": 4000, "raw2": 3990},
                "reported": {}, "t": 1e9 + n_blocks})
    return out


def test_t_quantile_and_interval_match_textbook_values():
    # Closed forms: df=1 is Cauchy, df=2 has t = (2p-1)/sqrt(2p(1-p)); t table: t_{.95,9}.
    assert stats.t_quantile(0.95, 1) == pytest.approx(math.tan(math.pi * 0.45), rel=1e-9)
    assert stats.t_quantile(0.95, 2) == pytest.approx(0.9 / math.sqrt(0.095), rel=1e-9)
    assert stats.t_quantile(0.95, 9) == pytest.approx(1.833, abs=5e-4)
    assert stats.t_quantile(0.975, 30) == pytest.approx(2.042, abs=5e-4)
    assert stats.t_quantile(0.05, 9) == pytest.approx(-1.833, abs=5e-4)
    sample = [9.8, 10.4, 10.1, 9.6, 10.9, 10.2, 9.9, 10.5, 10.0, 10.3]
    mean = sum(sample) / 10
    half = 1.833 * statistics.stdev(sample) / math.sqrt(10)
    est, lo, hi = stats.t_interval(sample, 0.90)
    assert est == pytest.approx(10.17)
    assert lo == pytest.approx(mean - half, rel=1e-4) and hi == pytest.approx(mean + half, rel=1e-4)
    with pytest.raises(ValueError, match="at least 2 values"):
        stats.t_interval([1.0])


def test_bootstrap_is_deterministic_and_brackets_the_mean():
    sample = [0.01 * i for i in range(20)]
    a = stats.bootstrap_interval(sample, 0.90, 2000, seed=0)
    assert a == stats.bootstrap_interval(sample, 0.90, 2000, seed=0)
    assert a != stats.bootstrap_interval(sample, 0.90, 2000, seed=1)
    t = stats.t_interval(sample, 0.90)
    assert a[1] < a[0] < a[2] and a[0] == pytest.approx(t[0])
    assert a[1] == pytest.approx(t[1], abs=0.01) and a[2] == pytest.approx(t[2], abs=0.01)
    assert stats.bootstrap_interval([2.0, 2.0, 2.0]) == (2.0, 2.0, 2.0)
    with pytest.raises(ValueError, match="at least 2"):
        stats.bootstrap_interval([])


def test_paired_values_skip_missing_and_non_positive():
    blocks = {("r", 0): {"c": {"ours": {"x": 2.0}, "raw": {"x": 4.0}}},
              ("r", 1): {"c": {"ours": {"x": None}, "raw": {"x": 4.0}}},
              ("r", 2): {"c": {"ours": {"x": 0.0}, "raw": {"x": 4.0}}},
              ("r", 3): {"c": {"raw": {"x": 4.0}}},
              ("r", 4): {"d": {"ours": {"x": 1.0}, "raw": {"x": 1.0}}}}
    assert stats.paired_log_ratios(blocks, "c", "x", "ours") == [math.log(0.5)]
    assert stats.paired_differences(blocks, "c", "x", "ours") == [-2.0, -4.0]
    assert stats.exp_interval((math.log(0.5), 0.0, math.log(2))) == pytest.approx((0.5, 1, 2))


def test_balanced_orders_cover_every_permutation_once_per_cycle():
    arms = ("ours", "raw", "raw2")
    orders = stats.balanced_orders(20, arms, random.Random(7))
    assert len(orders) == 20
    cycles = [orders[i:i + 6] for i in range(0, 18, 6)]
    for cycle in cycles:
        assert sorted(cycle) == sorted(itertools.permutations(arms))
    assert len({tuple(c) for c in cycles}) > 1  # shuffled per cycle, not one fixed sequence
    assert orders == stats.balanced_orders(20, arms, random.Random(7))
    assert orders[18:] == stats.balanced_orders(24, arms, random.Random(7))[18:20]
    with pytest.raises(ValueError):
        stats.balanced_orders(3, ("a", "a"), random.Random(0))


def test_one_percent_slower_passes_with_its_real_cost():
    v = verdict.judge(ledger(speed=0.99))
    assert v.valid and v.result == "pass", verdict.summary_lines(v) + v.notes
    t = v.targets["throughput"]
    assert t.estimate == pytest.approx(0.99, abs=0.005) and t.lo >= 0.97 and t.hi < 1
    assert t.blocks == 9 and v.blocks == 9 and v.runs == ["r1"]
    assert t.note.startswith("real cost of 1.") and "(CI " in t.note
    assert v.targets["history"].verdict == "pass" and v.targets["photo"].verdict == "pass"
    assert v.targets["added_ms4"].estimate == pytest.approx(0.5)
    assert v.targets["cpu_ms"].hi < verdict.CPU_MS_MAX
    assert v.rss == pytest.approx(0.975)


def test_ten_percent_slower_fails_on_throughput():
    v = verdict.judge(ledger(speed=0.90))
    assert v.valid and v.result == "fail"
    assert v.targets["throughput"].verdict == "fail" and v.targets["throughput"].hi < 0.97
    assert all(v.targets[f"rps_{c}"].verdict == "fail" for c in verdict.THROUGHPUT_CELLS)
    assert v.targets["ttft16"].verdict == "fail"  # 1/0.90 = 1.11 > 1.08


def test_burst_errors_and_memory_fail():
    v = verdict.judge(ledger(non200=1))
    assert v.burst_non200 == 9 and v.targets["burst_non200"].verdict == "fail"
    assert v.result == "fail"
    v = verdict.judge(ledger(rss_ours=5000.0))
    assert v.targets["rss"].verdict == "fail" and v.result == "fail"


def test_aa_control_off_by_ten_percent_is_unresolved():
    v = verdict.judge(ledger(raw2=0.90))
    assert not v.valid and v.result == "unresolved"
    outside = [c.name for c in v.validity if not c.inside]
    assert "raw2/raw pooled rps" in outside and "raw2/raw text16 rps" in outside
    assert any(n.startswith("A/A interval outside its band: raw2/raw text16 rps") for n in v.notes)
    assert " valid=no " in verdict.verdict_line(v)


def test_a_noisy_a_a_control_asks_for_more_blocks_a_biased_one_does_not():
    # raw2 at 1 +- 8 % block to block: unbiased, but after 9 blocks its intervals reach past
    # the bands. More blocks narrow them; a control 10 % off stays outside however many run.
    noisy = verdict.judge(ledger(raw2=lambda b: 1.08 if b % 2 else 1 / 1.08))
    assert noisy.result == "unresolved"
    wide = [c for c in noisy.validity if not c.inside]
    assert wide and all(c.straddles for c in wide) and noisy.wants_more_blocks
    biased = verdict.judge(ledger(raw2=0.90))
    assert biased.result == "unresolved" and not biased.wants_more_blocks
    assert any(not c.inside and not c.straddles for c in biased.validity)
    assert not verdict.judge(ledger(speed=0.99)).wants_more_blocks  # a pass is settled
    # The same control over 17 blocks (9 and the two extensions of 4): inside every band.
    settled = verdict.judge(ledger(n_blocks=17, raw2=lambda b: 1.08 if b % 2 else 1 / 1.08))
    assert settled.valid and settled.result == "pass", [c for c in settled.validity
                                                        if not c.inside]


def test_straddling_the_margin_is_inconclusive():
    # Ours at 0.97 +- 0.02 block to block: the pooled interval straddles its 0.97 margin.
    v = verdict.judge(ledger(speed=lambda b: 0.97 + (0.02 if b % 2 else -0.02), noise=0.002))
    t = v.targets["throughput"]
    assert v.valid and t.lo < verdict.POOLED_THROUGHPUT_MIN < t.hi
    assert t.verdict == "inconclusive" and v.result == "inconclusive"
    assert v.wants_more_blocks
    assert "fail" not in {x.verdict for x in v.targets.values()}


def test_bootstrap_disagreement_is_a_note_not_a_verdict():
    # 3 blocks: the t-interval (t_{.95,2} = 2.92) straddles 0.97, the bootstrap's clears it.
    v = verdict.judge(ledger(n_blocks=3, speed=lambda b: (0.975, 0.985, 0.995)[b], noise=0.0))
    t = v.targets["throughput"]
    assert t.verdict == "inconclusive" and t.boot_verdict == "pass" and v.result == "inconclusive"
    assert any(n.startswith("throughput: the bootstrap interval [") and "says pass" in n
               for n in v.notes), v.notes


def test_rerun_records_replace_earlier_ones():
    good = ledger(speed=0.99)
    bad = json.loads(json.dumps(next(r for r in good if r.get("cell") == "text16"
                                     and r["arm"] == "ours" and r["block"] == 4)))
    bad["metrics"]["rps"] /= 10  # a stalled segment, flagged
    bad["flagged"] = True
    rerun = [r for r in good if r.get("kind") != "run"]
    i = rerun.index(next(r for r in rerun if r["block"] == 4 and r["cell"] == "text16"))
    with_rerun = [*rerun[:i], bad, *rerun[i:], good[-1]]  # the good record comes after
    v, base = verdict.judge(with_rerun), verdict.judge(good)
    assert v.reruns == 1 and v.flagged == 0
    assert v.targets["rps_text16"] == base.targets["rps_text16"] and v.result == "pass"
    # Last wins: the stalled record last would sink the cell.
    stalled = verdict.judge([*good[:-1], bad, good[-1]])
    assert stalled.flagged == 1 and stalled.targets["rps_text16"].verdict != "pass"


def test_verdict_line_format():
    v = verdict.judge(ledger())
    line = verdict.verdict_line(v)
    assert LINE.fullmatch(line), line
    assert line.endswith("burst_non200=0 rss=0.975 result=pass")
    few = verdict.judge(ledger(n_blocks=1))
    line = verdict.verdict_line(few)
    assert LINE.fullmatch(line), line
    assert "throughput=nan[nan,nan]" in line and few.targets["ttft16"].verdict == "inconclusive"


def test_pooling_two_runs_of_one_commit():
    r1 = ledger(n_blocks=3, run="r1", seed=1)
    r2 = ledger(n_blocks=3, run="r2", seed=2)
    other = ledger(n_blocks=3, run="r0", seed=3, commit="b" * 40)
    dirty = ledger(n_blocks=3, run="rd", seed=4, dirty=True)
    records = [*other, *dirty, *r1, *r2]
    pool = verdict.select_pool(records)
    v = verdict.judge(pool)
    assert v.runs == ["r1", "r2"] and v.blocks == 6
    assert v.commits == ["a" * 12]
    assert verdict.judge(dirty).commits == ["a" * 12 + "-dirty"]
    assert v.targets["throughput"].blocks == 6
    assert verdict.judge(r1).targets["throughput"].blocks == 3
    assert {r["run"] for r in verdict.select_pool(records, commit="bbbb")} == {"r0"}
    assert {r["run"] for r in verdict.select_pool([*r1, *dirty])} == {"rd"}


def test_pooling_spans_commits_of_the_same_code():
    """Runs of a commit that only added results pool with those of the commit before it;
    another code, and a dirty checkout, stay apart."""
    code, ledger_commit, other = "a" * 40, "c" * 40, "b" * 40
    before = ledger(n_blocks=2, run="r1", seed=1, commit=code)
    after = ledger(n_blocks=2, run="r2", seed=2, commit=ledger_commit)
    elsewhere = ledger(n_blocks=2, run="r0", seed=3, commit=other)
    dirty = ledger(n_blocks=2, run="rd", seed=4, commit=code, dirty=True)
    records = [*elsewhere, *before, *dirty, *after]
    asked = []

    def same(a: str, b: str) -> bool:
        asked.append((a, b))
        return {a, b} == {code, ledger_commit}

    assert {r["run"] for r in verdict.select_pool(records, same_code=same)} == {"r1", "r2"}
    assert len(asked) == len(set(asked)) == 2  # once per other commit, not per record
    assert {r["run"] for r in verdict.select_pool(records)} == {"r2"}  # no predicate: exact
    assert {r["run"] for r in verdict.select_pool([*before, *dirty], same_code=same)} == {"rd"}


def test_same_code_ignores_results_and_prose(tmp_path):
    """``bench.process.same_code`` on a real repository: a commit touching only
    ``bench/results``, Markdown prose (at the top or in a folder), the tests or the UI holds
    the same code; one touching code does not; an unknown commit is not the same."""
    from bench.process import same_code

    def git(*args: str) -> str:
        return subprocess.run(["git", "-c", "user.email=t@t", "-c", "user.name=t", *args],
                              cwd=tmp_path, check=True, capture_output=True,
                              text=True).stdout.strip()

    git("init", "-q")
    (tmp_path / "bench" / "results").mkdir(parents=True)
    (tmp_path / "code.py").write_text("x = 1\n")
    (tmp_path / "bench" / "results" / "ledger.jsonl").write_text("{}\n")
    git("add", "-A"), git("commit", "-qm", "code")
    first = git("rev-parse", "HEAD")
    (tmp_path / "bench" / "results" / "ledger.jsonl").write_text("{}\n{}\n")
    git("commit", "-qam", "ledger")
    ledger_only = git("rev-parse", "HEAD")
    (tmp_path / "README.md").write_text("# manual\n")
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "guide.md").write_text("a chapter\n")
    git("add", "-A"), git("commit", "-qm", "prose")
    prose = git("rev-parse", "HEAD")
    for folder in ("tests/unit", "ui"):
        (tmp_path / folder).mkdir(parents=True)
        (tmp_path / folder / "thing.py").write_text("y = 1\n")
    git("add", "-A"), git("commit", "-qm", "tests and ui")
    tests_and_ui = git("rev-parse", "HEAD")
    (tmp_path / "code.py").write_text("x = 2\n")
    git("commit", "-qam", "change")
    changed = git("rev-parse", "HEAD")
    assert same_code(first, ledger_only, tmp_path)
    assert same_code(first, prose, tmp_path)
    assert same_code(first, tests_and_ui, tmp_path)
    assert not same_code(first, changed, tmp_path)
    assert not same_code(first, "f" * 40, tmp_path)


def test_cli_prints_the_verdict_last_and_writes_markdown(tmp_path):
    path, md = tmp_path / "ledger.jsonl", tmp_path / "bench.md"
    records = [*ledger(n_blocks=4, run="r1"), *ledger(n_blocks=4, run="r2", seed=5)]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    done = subprocess.run([sys.executable, "-m", "bench.verdict", "--ledger", str(path),
                           "--md", str(md)], cwd=ROOT, capture_output=True, text=True,
                          timeout=60, check=True)
    lines = done.stdout.strip().splitlines()
    assert lines[-1].startswith("verdict ") and LINE.fullmatch(lines[-1]), done.stdout
    assert lines[0].startswith(f"commit {'a' * 12}: pooled 2 run(s) (r1, r2), 8 blocks")
    assert f"Commit {'a' * 12}." in md.read_text()
    text = md.read_text()
    assert "## text16 (8 blocks)" in text and "| rps |" in text and lines[-1] in text
