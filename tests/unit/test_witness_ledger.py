"""``bench.witness_ledger``: each full witness run is recorded, and the runs of the same code
are judged together with the pooled bar (auto against each fixed limit >= 0.90 over three
runs, issue 32) where one run's bar is 0.85."""

from __future__ import annotations

import pytest

from bench import witness_ledger as wl
from bench.witness import judge

COMMIT = "a" * 40


def run_good(l8: int) -> dict:
    """Four episodes: auto equal to L16 and the A/A arm everywhere, ``88 / l8`` of L8, well
    above ``off`` on the overload episodes and equal to it on the steady ones."""
    good = {}
    for e in ("T1/0", "T1/1", "T2/0", "T6/0"):
        off = 88 if e.startswith("T1/") else 20
        good[e] = {"auto": 88, "L8": l8, "L16": 88, "aa": 88, "off": off}
    return good


def test_a_run_is_appended_and_read_back(tmp_path):
    path = tmp_path / "results" / "witness-ledger.jsonl"
    assert wl.read(path) == []
    record = wl.append(path, run_good(88), 0, COMMIT, False)
    wl.append(path, run_good(90), 0, COMMIT, True)
    back = wl.read(path)
    assert back[0] == record and back[0]["good"]["T2/0"]["L8"] == 88
    assert [r["dirty"] for r in back] == [False, True]
    path.write_text(path.read_text() + "{not json\n")
    with pytest.raises(ValueError, match=":3: not JSON"):
        wl.read(path)


def test_only_clean_runs_of_the_same_code_whose_aa_held_pool(tmp_path):
    slow = run_good(88)
    for arms in slow.values():  # the A/A arm at 0.75 of L16 everywhere: outside the band
        arms["aa"] = 66
    assert judge(slow)[1] == "unresolved"
    records = [{"commit": COMMIT, "dirty": False, "good": run_good(88)},
               {"commit": COMMIT, "dirty": True, "good": run_good(88)},
               {"commit": COMMIT, "dirty": False, "good": slow},
               {"commit": "b" * 40, "dirty": False, "good": run_good(88)}]  # other code
    assert wl.runs_of(records, COMMIT, tmp_path) == records[:1]


def test_episodes_of_several_runs_keep_their_kind():
    pooled = wl.merged([{"good": run_good(88)}, {"good": run_good(88)}])
    assert len(pooled) == 8 and "T2/0#1" in pooled
    iv, result = judge(pooled)
    assert result == "pass" and iv["auto/off_overload"][1] > 4  # T2, T6 still overload


def test_three_runs_are_judged_by_the_pooled_bar():
    even = [{"good": run_good(88)}] * 3
    assert wl.pooled_line(even).endswith("result=pass")
    assert wl.pooled_line(even).startswith("witness pooled runs=3 aa=[1.00,1.00]")
    # Auto at 0.88 of L8 in every episode: one run's bar (0.85) passes, the pooled (0.90) not.
    short = [{"good": run_good(100)}] * 3
    assert judge(run_good(100))[1] == "pass"
    assert wl.pooled_line(short).endswith("result=fail")
    # Fewer than three runs do not judge the pooled target, unless they fail it already.
    assert wl.pooled_line(even[:2]).endswith("result=unresolved")
    assert wl.pooled_line(short[:1]).endswith("result=fail")
    assert wl.pooled_line([]) == "witness pooled runs=0 result=unresolved"
