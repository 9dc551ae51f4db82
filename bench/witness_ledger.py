"""The witness's ledger: the good requests of each ``make bench-autotune`` run, per episode and
arm, appended to ``bench/results/witness-ledger.jsonl`` (committed history like ``make
bench``'s ledger), and the witness pooled over every run of the same code.

Issue 32 asks auto against each fixed limit for a lower 90 % bound >= 0.85 on one run and
>= 0.90 pooled over three runs. Pooled, each episode of each run is one pair of the same
paired bootstrap as one run's (:func:`bench.witness.judge`): the runs' days differ, and the
pairs' spread carries that. Runs pool when their commits hold the same code
(:func:`bench.process.same_code`: results, Markdown prose, tests and UI aside); a dirty
checkout's run, and a run whose A/A control left its band, is recorded and never pooled.

Standard library only (with the bench package).
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from bench.process import RESULTS, ROOT, same_code
from bench.witness import intervals_text, judge

#: Where ``make bench-autotune`` appends its runs.
LEDGER = ROOT / RESULTS / "witness-ledger.jsonl"
#: Runs the pooled target needs (issue 32).
POOLED_RUNS = 3
#: The pooled lower bound of auto against each fixed limit (issue 32).
MIN_VS_FIXED_POOLED = 0.90


def append(path: Path, good: Mapping[str, Mapping[str, int]], seed: int, commit: str,
           dirty: bool, chat_rps: float | None = None) -> dict:
    """Append one run (``good``: ``{episode: {arm: good requests}}``; ``chat_rps``: the
    server's speed its episodes were sized by, :func:`bench.witness.sized`, None for the
    reference capacity) and return its record."""
    record = {"schema": 1, "commit": commit, "dirty": dirty,
              "date": time.strftime("%Y-%m-%d", time.gmtime()), "seed": seed, "good": good,
              "chat_rps": chat_rps}
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(record, sort_keys=True) + "\n")
    return record


def read(path: Path) -> list[dict]:
    """The ledger's records in file order ([] when there is none). Raises ValueError naming
    a line that is not a schema 1 record (:func:`bench.verdict.read_ledger`)."""
    from bench.verdict import read_ledger

    return read_ledger(path) if path.exists() else []


def runs_of(records: Sequence[Mapping], commit: str, root: Path = ROOT) -> list[Mapping]:
    """The clean runs of the code at ``commit`` (:func:`bench.process.same_code`) whose own
    A/A control held (:func:`bench.witness.judge` is not ``unresolved``): a run whose two
    identical arms disagree beyond the band measured a machine that did not hold still (a
    slow spell that began after the speed probe sized its traffic, which then overloads
    every arm), and its pairs would widen or bias the pool as they do not judge on their
    own."""
    return [r for r in records if not r["dirty"] and same_code(r["commit"], commit, root)
            and judge(r["good"])[1] != "unresolved"]


def merged(runs: Sequence[Mapping]) -> dict[str, Mapping[str, int]]:
    """The runs' episodes as one ``good`` mapping, each named ``EPISODE#RUN`` (the episode's
    prefix, which :func:`bench.witness.judge` sorts by, kept)."""
    return {f"{e}#{i}": arms for i, r in enumerate(runs) for e, arms in r["good"].items()}


def pooled_line(runs: Sequence[Mapping]) -> str:
    """``witness pooled runs=N aa=[lo,hi] auto/L8=[lo,hi] ... result=R``: the witness over
    ``runs``, auto against each fixed limit judged by :data:`MIN_VS_FIXED_POOLED`.
    ``unresolved`` with fewer than :data:`POOLED_RUNS` runs unless it fails already."""
    if not runs:
        return "witness pooled runs=0 result=unresolved"
    iv, result = judge(merged(runs), MIN_VS_FIXED_POOLED)
    if len(runs) < POOLED_RUNS and result != "fail":
        result = "unresolved"
    return f"witness pooled runs={len(runs)} {intervals_text(iv)} result={result}"

