"""Ablation of the autotuner's and the limiter's rules on the simulator, over seeds.

``python -m bench.ablate [--seeds 10] [--profiles gpu-like,h200,cpu] [--rules a,b] [--workers 2]``

For each rule of :data:`serve.admission.rules.RULES` (or those given), the suite
(:mod:`bench.simjudge`: every trace, each profile, seeds ``0..N-1``) runs with auto and that
one rule switched off, next to auto with every rule. A rule's cost on one (profile, trace) is
``1 - good(without) / good(with)``, the good requests summed over the seeds (the simulator is
deterministic, so the seeds are the sample of arrivals and sizes, not of noise); its cost is
the largest over profiles and traces. A rule **earns its place** when that cost is at least
:data:`EARN` (2 %); one that costs less is removed from the code (rule 2 of the project: a
rule stays only if removing it costs goodput on the deterministic simulator). A negative
cost means the suite does better without the rule.

A progress bar on stderr counts the (profile, seed) jobs done, with an ETA. Prints a Markdown
table (rule, what it does, cost, where, seeds that lost >= 2 %) and ends with (stdout)::

    ablate seeds=N rules=R kept=K remove=a,b|none
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.sim import PROFILES
from bench.simjudge import Cell, run_cells, run_jobs
from serve.admission.rules import RULES, check

#: Smallest goodput loss (fraction) on some trace and profile for a rule to stay.
EARN = 0.02


def _job(job: tuple[str, int, tuple[str, ...]]) -> list[tuple[str, Cell]]:
    """Auto with every rule, then with each of ``rules`` off (``a+b``: both at once), on one
    (profile, seed)."""
    profile, seed, rules = job
    out = [("", c) for c in run_cells(profile, seed, frozenset(), arms=False)]
    for rule in rules:
        off = frozenset(rule.split("+"))
        out += [(rule, c) for c in run_cells(profile, seed, off, arms=False)]
    return out


@dataclass(frozen=True)
class RuleCost:
    """What switching one rule off did to auto's goodput.

    Attributes:
        rule: the rule's name.
        cost: the largest loss over (profile, trace), fraction (negative: a gain).
        where: the (profile, trace) of that loss ("nowhere" when no trace lost anything).
        gain: the largest gain over (profile, trace), fraction (>= 0).
        seeds_lost: seeds of ``where`` on which it lost >= :data:`EARN`.
        seeds: seeds run.
    """

    rule: str
    cost: float
    where: str
    gain: float
    seeds_lost: int
    seeds: int

    @property
    def earns(self) -> bool:
        return self.cost >= EARN


def costs(rows: Sequence[tuple[str, Cell]]) -> list[RuleCost]:
    """One :class:`RuleCost` per ablated rule of ``rows`` (``("", cell)`` is the baseline).
    Raises ValueError when a rule's cell has no baseline."""
    base = {(c.profile, c.trace, c.seed): c.good for rule, c in rows if not rule}
    by_rule: dict[str, dict[tuple[str, str], list[tuple[int, int]]]] = {}
    for rule, c in rows:
        if rule:
            key = (c.profile, c.trace, c.seed)
            if key not in base:
                raise ValueError(f"no baseline for {key}")
            by_rule.setdefault(rule, {}).setdefault((c.profile, c.trace), []).append(
                (c.good, base[key]))
    out = []
    for rule, groups in by_rule.items():
        losses = {k: 1 - sum(g for g, _ in v) / max(1, sum(b for _, b in v))
                  for k, v in groups.items()}
        where = max(losses, key=losses.get)
        lost = sum(g < (1 - EARN) * b for g, b in groups[where])
        out.append(RuleCost(rule, losses[where],
                            "/".join(where) if losses[where] > 0 else "nowhere",
                            max(0.0, -min(losses.values())), lost, len(groups[where])))
    return out


def table(rule_costs: Sequence[RuleCost]) -> str:
    """The ablation table in Markdown, in :data:`RULES` order."""
    lines = ["| rule | what it does | removing it costs | where | best gain without | "
             "seeds lost >= 2 % | verdict |", "|---|---|---|---|---|---|---|"]
    order = list(RULES)
    for r in sorted(rule_costs, key=lambda r: (order.index(r.rule.split("+")[0]), r.rule)):
        what = RULES.get(r.rule, "these rules together")
        lines.append(f"| `{r.rule}` | {what} | {100 * r.cost:+.1f} % | {r.where} | "
                     f"{100 * r.gain:.1f} % | {r.seeds_lost}/{r.seeds} | "
                     f"{'keep' if r.earns else '**remove**'} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """The CLI (module docstring); writes ``ablate.json`` to ``--out``. Always 0."""
    p = argparse.ArgumentParser(prog="python -m bench.ablate", description=__doc__.split("\n")[0])
    p.add_argument("--seeds", type=int, default=10)
    p.add_argument("--profiles", default=",".join(PROFILES))
    p.add_argument("--rules", default=",".join(RULES),
                   help="comma-separated rule names; a+b switches a and b off together")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--out", type=Path, default=Path("bench/out"))
    args = p.parse_args(argv)
    rules = tuple(dict.fromkeys(r for r in args.rules.split(",") if r))
    for r in rules:
        check(set(r.split("+")))
    jobs = [(pr, seed, rules) for pr in args.profiles.split(",") if pr
            for seed in range(args.seeds)]
    t0 = time.perf_counter()
    parts = run_jobs(_job, jobs, args.workers, "ablate",
                     lambda job: f"{job[0]} seed {job[1]}")
    rows = [row for part in parts for row in part]
    found = costs(rows)
    print(table(found))
    print(f"({len(rows)} simulations of auto in {time.perf_counter() - t0:.0f} s)")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "ablate.json").write_text(json.dumps(
        {"rows": [[r, asdict(c)] for r, c in rows], "costs": [asdict(c) for c in found]},
        indent=1))
    remove = [r.rule for r in found if not r.earns]
    print(f"ablate seeds={args.seeds} rules={len(found)} kept={len(found) - len(remove)} "
          f"remove={','.join(remove) or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
