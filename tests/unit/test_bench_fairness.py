"""``make bench-fairness``'s counting (bench.tenants) and verdict (bench.fairness) on
synthetic runs."""

from __future__ import annotations

import math
import random
import re

import pytest

from bench import fairness
from bench.fairness import AA_BAND, judge, summary_line
from bench.tenants import Outcome, served_in_window, window

N3 = r"\d+\.\d{3}\[\d+\.\d{3},\d+\.\d{3}\]"
LINE = re.compile(rf"fairness runs=\d+ rounds=\d+ capacity=\d+\.\d{{2}} goodput={N3} per_s={N3} "
                  rf"aa={N3} "
                  rf"split={N3} light_non200=\d+ light_ttft_p90_s=\d+\.\d{{2}} "
                  r"result=(pass|fail|inconclusive|unresolved)")


def answer(first_at, done_at, good=True, status=200, tenant="t"):
    return Outcome(tenant, status, ttft_s=0.1, good=good, sent_at=first_at - 0.1,
                   first_at=first_at, done_at=done_at)


def test_an_answer_counts_by_its_share_of_decoding_inside_the_window():
    outcomes = [answer(1, 3),  # wholly inside: 1
                answer(-1, 1),  # half inside: 0.5
                answer(9, 13),  # a quarter inside: 0.25
                answer(11, 12),  # after: 0
                answer(2, 4, good=False),  # inside, not good
                answer(2, 4, status=429)]  # refused: never counted
    assert served_in_window(outcomes, 0, 10) == pytest.approx(2.75)
    assert served_in_window(outcomes, 0, 10, good_only=True) == pytest.approx(1.75)


def test_the_fractional_count_of_back_to_back_answers_is_the_window_over_their_length():
    # One slot serving 2-s answers back to back: a 7-s window holds 3.5 of them wherever it
    # starts, where whole answers ending inside give 3 or 4.
    outcomes = [answer(2 * k, 2 * k + 2) for k in range(20)]
    for lo in (3.0, 3.3, 4.0, 4.9):
        assert served_in_window(outcomes, lo, lo + 7) == pytest.approx(3.5)


def test_the_window_starts_after_the_warm_up_and_ends_at_the_last_arrival():
    outcomes = [Outcome("t", 200, sent_at=100.0, done_at=130.0),
                Outcome("t", 200, sent_at=105.0, done_at=110.0)]
    assert window(outcomes, 15) == (106.0, 115.0)


def rounds(n=6, shared=1.0, aa=1.0, split=3.0, noise=0.01, non200=0, ttft=2.0, seed=0,
           speed=0.0):
    """``n`` synthetic rounds: good answers per engine step of each flood arm with log-noise
    ``noise`` (shared and alone2 at ``shared`` and ``aa`` times alone's), each arm on a core
    whose speed (engine steps per second) has log-noise ``speed``."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        alone = 0.008 * math.exp(rng.gauss(0, noise))
        per_step = {"alone": alone, "alone2": alone * aa * math.exp(rng.gauss(0, noise)),
                    "shared": alone * shared * math.exp(rng.gauss(0, noise))}
        window_s = 19.0
        steps = {arm: 1000 * window_s * math.exp(rng.gauss(0, speed)) for arm in per_step}
        good = {arm: per_step[arm] * steps[arm] for arm in per_step}
        out.append({
            "good": good, "steps": steps,
            "goodput": {arm: good[arm] / window_s for arm in good},
            "split": {"heavy": 30 * split / (split + 1) * math.exp(rng.gauss(0, noise)),
                      "lighter": 30 / (split + 1)},
            "light": {"non200": non200, "ttft_p90_s": ttft, "sent": 20}})
    return out


def test_a_fair_run_passes_and_its_line_parses():
    v = judge(rounds())
    assert v["result"] == "pass", v
    assert v["goodput"]["lo"] <= 1.0 <= v["goodput"]["hi"]
    assert v["split"]["estimate"] == pytest.approx(3.0, rel=0.02)
    assert LINE.fullmatch(summary_line(6, 9.5, v))


def test_a_wide_a_a_control_leaves_the_run_unresolved_whatever_it_shows():
    v = judge(rounds(noise=0.2, shared=0.5))
    assert not v["valid"] and v["result"] == "unresolved", v


def test_a_biased_a_a_control_leaves_the_run_unresolved():
    v = judge(rounds(aa=1.2, noise=0.01))
    assert v["aa"]["lo"] > 1 / AA_BAND and v["result"] == "unresolved", v


def test_a_control_wider_than_the_goodput_margin_but_inside_its_band_still_judges():
    # The run-to-run noise that widens the control widens the goodput interval too: a true
    # ratio at the 0.95 margin seldom passes (a one-sided 5 % error), a clear one always does.
    at_margin = [judge(rounds(noise=0.1, n=12, shared=0.95, seed=k)) for k in range(20)]
    assert sum(v["valid"] and not (0.95 <= v["aa"]["lo"] and v["aa"]["hi"] <= 1 / 0.95)
               for v in at_margin) >= 15
    assert sum(v["checks"]["goodput"] == "pass" for v in at_margin) <= 2
    assert all(judge(rounds(noise=0.1, n=12, shared=1.2, seed=k))["checks"]["goodput"] == "pass"
               for k in range(20))


def test_a_goodput_loss_fails_and_an_uncertain_one_is_inconclusive():
    assert judge(rounds(shared=0.85))["checks"]["goodput"] == "fail"
    assert judge(rounds(shared=0.95, noise=0.02))["checks"]["goodput"] == "inconclusive"


def test_a_split_off_3_to_1_fails_and_a_refused_light_request_fails():
    assert judge(rounds(split=2.0))["checks"]["split"] == "fail"
    assert judge(rounds(split=3.0))["checks"]["split"] == "pass"
    assert judge(rounds(non200=1))["result"] == "fail"
    assert judge(rounds(ttft=11.0))["checks"]["light"] == "fail"


DESIGN = {"flood_s": 25.0, "weighted_s": 20.0}


def write_ledger(path, runs):
    """``runs``: ``[(run, commit, dirty, design, rounds)]`` appended in order."""
    for run, commit, dirty, design, rs in runs:
        for k, r in enumerate(rs):
            fairness.append_record(path, fairness.round_record(run, commit, dirty, design,
                                                               8.0, k, r))


def test_runs_of_one_commit_and_design_pool_and_others_stay_apart(tmp_path):
    ledger = tmp_path / "sub" / "fairness-ledger.jsonl"
    other = {**DESIGN, "flood_s": 40.0}
    write_ledger(ledger, [("r1", "aaaa", False, DESIGN, rounds(n=4, seed=1)),
                          ("r0", "bbbb", False, DESIGN, rounds(n=3, seed=2)),
                          ("rd", "aaaa", True, DESIGN, rounds(n=2, seed=3)),
                          ("ro", "aaaa", False, other, rounds(n=2, seed=4)),
                          ("r2", "aaaa", False, DESIGN, rounds(n=4, seed=5))])
    from bench.verdict import read_ledger
    records = read_ledger(ledger)
    pool = fairness.pooled_rounds(records)
    assert [(r["run"], r["index"]) for r in pool] == [*((("r1", k) for k in range(4))),
                                                        *((("r2", k) for k in range(4)))]
    assert {r["run"] for r in fairness.pooled_rounds(records, commit="bb")} == {"r0"}
    assert len(fairness.same_rounds(ledger, "aaaa", False, DESIGN)) == 8
    assert len(fairness.same_rounds(ledger, "aaaa", True, DESIGN)) == 2
    assert fairness.same_rounds(tmp_path / "none.jsonl", "aaaa", False, DESIGN) == []
    # The pooled verdict judges the 8 rounds as one sample.
    verdict, judged = fairness.judge_ledger(ledger)
    assert judged == pool and verdict == judge(pool)
    line = fairness.pooled_line(verdict, pool)
    assert LINE.fullmatch(line) and line.startswith("fairness runs=2 rounds=8 "), line


def explicit_rounds(log_ratios):
    """Rounds whose shared/alone log-ratios are ``log_ratios``, with a tight A/A control."""
    out = []
    for k, x in enumerate(log_ratios):
        good = {"alone": 160.0, "alone2": 160.0 * math.exp(0.01 * (-1) ** k),
                "shared": 160.0 * math.exp(x)}
        steps = dict.fromkeys(good, 20000.0)
        out.append({"good": good, "steps": steps, "goodput": {a: g / 19 for a, g in good.items()},
                    "split": {"heavy": 22.5, "lighter": 7.5},
                    "light": {"non200": 0, "ttft_p90_s": 2.0, "sent": 20}})
    return out


def test_two_runs_that_each_end_inconclusive_pass_when_pooled(tmp_path):
    # Each run of 3 rounds: mean log-ratio 0.04, t-interval reaching below 0.95; the 6 rounds
    # together narrow it above the margin.
    ledger = tmp_path / "fairness-ledger.jsonl"
    a, b = explicit_rounds([0.10, -0.04, 0.06]), explicit_rounds([0.06, 0.10, -0.04])
    assert judge(a)["checks"]["goodput"] == judge(b)["checks"]["goodput"] == "inconclusive"
    write_ledger(ledger, [("r1", "cccc", False, DESIGN, a), ("r2", "cccc", False, DESIGN, b)])
    verdict, pool = fairness.judge_ledger(ledger)
    assert len(pool) == 6 and verdict["result"] == "pass", verdict["goodput"]


def test_judging_an_empty_ledger_says_so_and_exits_2(tmp_path, capsys):
    assert fairness.main(["--judge", "--ledger", str(tmp_path / "none.jsonl")]) == 2
    assert "none.jsonl" in capsys.readouterr().err


def test_the_core_speed_divides_out_of_goodput_per_step_and_not_out_of_per_second():
    # Each arm on a core whose speed swings by ~20 %: per second, the A/A control and the
    # goodput interval are wide; per engine step, the same rounds judge.
    v = judge(rounds(n=8, speed=0.2, noise=0.01, shared=1.0))
    assert v["result"] == "pass", v
    assert v["aa"]["hi"] / v["aa"]["lo"] < 1.05
    assert v["aa_per_s"]["hi"] / v["aa_per_s"]["lo"] > 1.15, v["aa_per_s"]
    assert v["per_s"]["lo"] < 0.95 < v["goodput"]["lo"]


def test_a_per_step_loss_fails_even_when_the_core_was_faster_for_the_shared_run():
    # Slots left idle (fewer good answers per step) on a shared run that happened to get a
    # faster core: per second it looks no worse; per step it fails.
    rs = rounds(n=6, shared=0.8, noise=0.01)
    for r in rs:
        r["steps"]["shared"] *= 1.25
        r["good"]["shared"] *= 1.25
        r["goodput"]["shared"] *= 1.25
    v = judge(rs)
    assert v["per_s"]["lo"] >= 0.95 and v["checks"]["goodput"] == "fail", v


def test_a_ledger_appended_to_leaves_the_checkout_clean_a_code_change_does_not(tmp_path):
    # The second run of one commit must pool with the first before its rounds are committed.
    import subprocess

    from bench.process import RESULTS, git_state

    def git(*args):
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args],
                       cwd=tmp_path, check=True, capture_output=True)

    ledger = tmp_path / RESULTS / "fairness-ledger.jsonl"
    ledger.parent.mkdir(parents=True)
    ledger.write_text("{}\n")
    (tmp_path / "code.py").write_text("x = 1\n")
    git("init", "-q")
    git("add", ".")
    git("commit", "-qm", "c")
    commit = git_state(tmp_path)[0]
    assert git_state(tmp_path) == (commit, False) and len(commit) == 40
    ledger.write_text("{}\n{}\n")
    assert git_state(tmp_path) == (commit, False)
    (tmp_path / "notes.md").write_text("prose, read by no program\n")
    git("add", "notes.md")
    assert git_state(tmp_path) == (commit, False)
    (tmp_path / "code.py").write_text("x = 2\n")
    assert git_state(tmp_path) == (commit, True)


def test_a_round_flagged_for_other_cpu_work_is_left_out_and_counted():
    rs = rounds(n=6)
    rs[2]["flagged"] = True
    rs[2]["good"]["shared"] *= 0.5  # what another job's CPU did to it
    v = judge(rs)
    assert v["rounds"] == 5 and v["flagged"] == 1 and v["result"] == "pass", v
    assert LINE.fullmatch(summary_line(v["rounds"], 9.0, v))


def test_a_voided_run_leaves_the_pool_and_the_ledger_keeps_it(tmp_path, capsys):
    ledger = tmp_path / "fairness-ledger.jsonl"
    bad = rounds(n=3, shared=0.5, seed=9)
    write_ledger(ledger, [("good", "dddd", False, DESIGN, rounds(n=4, seed=1)),
                          ("bad", "dddd", False, DESIGN, bad)])
    assert len(fairness.judge_ledger(ledger)[1]) == 7
    with pytest.raises(SystemExit):  # a withdrawal needs its reason
        fairness.main(["--ledger", str(ledger), "--void", "bad"])
    capsys.readouterr()
    assert fairness.main(["--ledger", str(ledger), "--void", "bad", "--why",
                          "another job ran beside it"]) == 0
    verdict, pool = fairness.judge_ledger(ledger)
    assert {r["run"] for r in pool} == {"good"} and verdict["result"] == "pass"
    assert len(fairness.same_rounds(ledger, "dddd", False, DESIGN)) == 4
    from bench.verdict import read_ledger
    assert sum(r.get("kind") == fairness.ROUND_KIND for r in read_ledger(ledger)) == 7
