"""``make bench-fairness``'s counting (bench.tenants) and verdict (bench.fairness) on
synthetic runs."""

from __future__ import annotations

import math
import random
import re

import pytest

from bench.fairness import AA_BAND, judge, summary_line
from bench.tenants import Outcome, served_in_window, window

N3 = r"\d+\.\d{3}\[\d+\.\d{3},\d+\.\d{3}\]"
LINE = re.compile(rf"fairness rounds=\d+ capacity=\d+\.\d{{2}} goodput={N3} aa={N3} "
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


def rounds(n=6, shared=1.0, aa=1.0, split=3.0, noise=0.01, non200=0, ttft=2.0, seed=0):
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        alone = 8.0 * math.exp(rng.gauss(0, noise))
        out.append({
            "goodput": {"alone": alone, "alone2": alone * aa * math.exp(rng.gauss(0, noise)),
                        "shared": alone * shared * math.exp(rng.gauss(0, noise))},
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
    # ratio at the 0.95 margin cannot pass, a clear one does.
    v = judge(rounds(noise=0.1, n=12, shared=0.95))
    assert v["valid"] and not (0.95 <= v["aa"]["lo"] and v["aa"]["hi"] <= 1 / 0.95), v["aa"]
    assert v["checks"]["goodput"] == "inconclusive", v["goodput"]
    assert judge(rounds(noise=0.1, n=12, shared=1.2))["checks"]["goodput"] == "pass"


def test_a_goodput_loss_fails_and_an_uncertain_one_is_inconclusive():
    assert judge(rounds(shared=0.85))["checks"]["goodput"] == "fail"
    assert judge(rounds(shared=0.95, noise=0.02))["checks"]["goodput"] == "inconclusive"


def test_a_split_off_3_to_1_fails_and_a_refused_light_request_fails():
    assert judge(rounds(split=2.0))["checks"]["split"] == "fail"
    assert judge(rounds(split=3.0))["checks"]["split"] == "pass"
    assert judge(rounds(non200=1))["result"] == "fail"
    assert judge(rounds(ttft=11.0))["checks"]["light"] == "fail"
