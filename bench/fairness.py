"""Fair admission between tenants on the real tiny engine, judged with intervals: ``make
bench-fairness``.

``python -m bench.fairness [--rounds 6] [--flood-s 25] [--weighted-s 20] [--capacity R]
[--out bench/out] [--ledger bench/results/fairness-ledger.jsonl]``;
``python -m bench.fairness --judge [--commit SHA]`` judges the ledger without a run;
``--void RUN --why TEXT`` withdraws a run's rounds (a record appended, the rounds kept).

One server (``python -m serve`` on the tiny model, a keys file of five tenants, the flags of
:func:`bench.tenants.server_args`); its capacity (completed requests per second with a full
backlog) is measured first, unless ``--capacity`` gives it (then two servers, or two
settings, get the same arrivals). Then ``--rounds`` rounds, each of four open-loop runs
(:func:`bench.tenants.open_loop`, Poisson arrivals, every request the same 96-token chat):

- **shared**: tenant ``flood`` at 4x capacity and tenant ``light`` at 0.2x (``--flood-s``);
- **alone** and **alone2**: the same arrivals (same seed), all from tenant ``alone``: the
  single-tenant reference and its A/A control;
- **weighted**: ``heavy`` (weight 3) at 2x capacity and ``lighter`` (weight 1) at 1x
  (``--weighted-s``), both far over their share, so both queues stay loaded.

The first three run in an order balanced over rounds (every permutation equally often,
:func:`bench.stats.balanced_orders`), so drift and the autotuner's state carried from one run
to the next hit them alike. Each run's counts are taken in its loaded window (from
:data:`bench.tenants.WARM_S` to the last arrival) by each answer's share of decoding inside it
(:func:`bench.tenants.served_in_window`), which removes the edge noise of whole-answer counts.

**Goodput per engine step.** A flood keeps every slot busy, so its good answers per second
follow the speed of the machine's core: on a shared VM that speed swings by up to 2x over
tens of seconds with no steal time to show for it, with the same batch, the same answers and
nothing else running, which is as large as the effect judged. The engine's step count (vLLM's
``vllm:iteration_tokens_total`` histogram, one observation per step) is read at the window's
edges (:func:`flood_arm`), and goodput is judged as good answers per engine step: what
admission decides (how full the batch is kept, which answers meet the SLOs, how much prefill
the admitted requests cost) with the core's speed divided out. Good answers per second are
reported beside it (``per_s``); so is the gateway's own CPU cost in ``make bench``, which a
per-step count would not see.

Per round: goodput ratio shared/alone (good answers, both SLOs met, per engine step), the A/A
ratio alone2/alone (the same), the weighted split heavy/lighter of answers served, the light
tenant's refusals and TTFT p90. Across rounds (Kalibera & Jones, ISMM 2013, as ``make
bench``): the mean of the per-round log-ratios with a 90 % Student-t interval, cross-checked
by a bootstrap over rounds, ``exp`` of each. Verdicts (issue targets: total goodput >= 0.95
of a single-tenant run; a 3:1 split +-15 %; the light tenant never refused, its TTFT p90
within the SLO):

- **unresolved**: the A/A interval is not inside [0.90, 1/0.90] (:data:`AA_BAND`): two
  identical runs differ more than the instrument may, so the run judges nothing;
- goodput: **pass** when the interval's lower end is >= 0.95, **fail** when its upper end is
  below, else **inconclusive**;
- split: **pass** when the interval lies inside [2.55, 3.45], **fail** when it lies wholly
  outside, else **inconclusive**;
- light: **pass** when no light request got a non-200 and every round's TTFT p90 is within
  the SLO, else **fail**.

**The ledger.** Every round is appended to ``--ledger`` as it ends (:func:`round_record`),
and the verdict pools every round of the newest run's ``(commit, dirty)`` and design
(``flood_s``, ``weighted_s``, the goodput measure) over all runs (:func:`pooled_rounds`): the
rounds are independent (each a paired comparison on one server), so a second run of the same
code adds its rounds to the first's instead of replacing its verdict. Each run measures its own
capacity: the rates are multiples of it, so a round's ratios compare the same design whatever
its server's speed. A run's rounds continue the seeds where the pooled rounds end, so no two
rounds of a pool replay the same arrivals.

Writes ``fairness.json`` (this run's rounds, its own verdict and the pooled one) to ``--out``,
one line per round, this run's verdict, and ends with exactly one line, the pooled verdict::

    fairness runs=K rounds=N capacity=R goodput=X[lo,hi] per_s=X[lo,hi] aa=X[lo,hi]
        split=X[lo,hi]
        light_non200=N light_ttft_p90_s=S result=pass|fail|inconclusive|unresolved

(``capacity``: the newest run's.)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import random
import secrets
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx

from bench import stats
from bench.process import ROOT
from bench.tenants import (
    SLO_TTFT_S,
    WARM_S,
    Outcome,
    capacity_rps,
    flood_load,
    open_loop,
    p90,
    served_by_tenant,
    served_in_window,
    server_args,
    weighted_load,
    write_keys,
)

LEVEL = 0.90
#: Goodput of the shared run over the single-tenant run: the lower end must reach it.
GOODPUT_MIN = 0.95
#: The A/A interval must lie inside [AA_BAND, 1 / AA_BAND]: the band of ``make bench``'s
#: TTFT cells (``bench/README.md``), which like this goodput are latency-bound measures of a
#: loaded server. It asks that two identical runs not differ beyond it, not that the control
#: be as tight as the goodput margin: that margin is judged by the goodput interval itself,
#: which the same run-to-run noise widens alike, so a noisy run ends inconclusive, never pass.
AA_BAND = 0.90
#: Weights 3:1 and the issue's tolerance of +-15 %.
SPLIT_TARGET, SPLIT_TOLERANCE = 3.0, 0.15
FLOOD_ARMS = ("shared", "alone", "alone2")
BOOTSTRAP_RESAMPLES, BOOTSTRAP_SEED = 2000, 0
#: Where rounds are appended (committed history, as ``make bench``'s ledger).
DEFAULT_LEDGER = ROOT / "bench" / "results" / "fairness-ledger.jsonl"
#: ``kind`` of a round's ledger record, and of a record withdrawing a run
#: (:func:`counted_rounds`).
ROUND_KIND, VOID_KIND = "fairness-round", "fairness-void"


def interval(log_values: Sequence[float]) -> dict:
    """``{"estimate", "lo", "hi", "boot_lo", "boot_hi"}`` of a ratio from its per-round
    log-ratios (t-interval, and the bootstrap cross-check), NaN with fewer than 2 rounds."""
    if len(log_values) < 2:
        return dict.fromkeys(("estimate", "lo", "hi", "boot_lo", "boot_hi"), math.nan)
    t = stats.exp_interval(stats.t_interval(log_values, LEVEL))
    b = stats.exp_interval(stats.bootstrap_interval(log_values, LEVEL, BOOTSTRAP_RESAMPLES,
                                                    BOOTSTRAP_SEED))
    return {"estimate": t[0], "lo": t[1], "hi": t[2], "boot_lo": b[1], "boot_hi": b[2]}


def per_step(round_: Mapping, arm: str) -> float:
    """Good answers of ``arm`` per engine step in its window (the judged goodput)."""
    steps = round_["steps"][arm]
    return round_["good"][arm] / steps if steps > 0 else 0.0


def per_second(round_: Mapping, arm: str) -> float:
    """Good answers of ``arm`` per second in its window (reported)."""
    return round_["goodput"][arm]


def judge(rounds: list[dict]) -> dict:
    """The verdict of the rounds (module docstring): the intervals, each target's
    pass/fail/inconclusive and the ``result``. Pure: a round is a dict with, per flood arm,
    ``good`` (good answers in the window), ``steps`` (engine steps in it) and ``goodput``
    (good answers per second), ``split`` (``{"heavy", "lighter"}`` answers served) and
    ``light`` (``{"non200", "ttft_p90_s"}``). Goodput and its A/A control are judged per
    engine step (:func:`per_step`); per second they are reported (``per_s``, ``aa_per_s``).
    A round ``flagged`` (another job took the CPU: :data:`bench.compare.MAX_FOREIGN_CPU`,
    steal over :data:`bench.compare.MAX_STEAL`) is left out and counted (``flagged``)."""
    flagged = sum(bool(r.get("flagged")) for r in rounds)
    rounds = [r for r in rounds if not r.get("flagged")]

    def logs(num: str, den: str, of) -> list[float]:
        return [math.log(of(r, num) / of(r, den)) for r in rounds
                if of(r, num) > 0 and of(r, den) > 0]

    goodput = interval(logs("shared", "alone", per_step))
    aa = interval(logs("alone2", "alone", per_step))
    per_s = interval(logs("shared", "alone", per_second))
    aa_per_s = interval(logs("alone2", "alone", per_second))
    split = interval([math.log(r["split"]["heavy"] / r["split"]["lighter"]) for r in rounds
                      if r["split"]["heavy"] > 0 and r["split"]["lighter"] > 0])
    valid = AA_BAND <= aa["lo"] and aa["hi"] <= 1 / AA_BAND
    lo_split = SPLIT_TARGET * (1 - SPLIT_TOLERANCE)
    hi_split = SPLIT_TARGET * (1 + SPLIT_TOLERANCE)
    non200 = sum(r["light"]["non200"] for r in rounds)
    ttft = max((r["light"]["ttft_p90_s"] for r in rounds), default=math.nan)
    checks = {
        "goodput": ("pass" if goodput["lo"] >= GOODPUT_MIN else
                    "fail" if goodput["hi"] < GOODPUT_MIN else "inconclusive"),
        "split": ("pass" if lo_split <= split["lo"] and split["hi"] <= hi_split else
                  "fail" if split["hi"] < lo_split or split["lo"] > hi_split else
                  "inconclusive"),
        "light": "pass" if non200 == 0 and ttft <= SLO_TTFT_S else "fail",
    }
    if not valid:
        result = "unresolved"
    elif "fail" in checks.values():
        result = "fail"
    elif "inconclusive" in checks.values():
        result = "inconclusive"
    else:
        result = "pass"
    return {"goodput": goodput, "aa": aa, "per_s": per_s, "aa_per_s": aa_per_s,
            "rounds": len(rounds), "flagged": flagged,
            "split": split, "valid": valid, "checks": checks,
            "light_non200": non200, "light_ttft_p90_s": ttft, "result": result}


def _fmt(i: dict) -> str:
    return f"{i['estimate']:.3f}[{i['lo']:.3f},{i['hi']:.3f}]"


def round_record(run: str, commit: str, dirty: bool, design: Mapping[str, float],
                 capacity: float, index: int, round_: Mapping) -> dict:
    """The ledger record of one round: ``{"schema": 1, "kind": "fairness-round", "run",
    "commit", "dirty", "design", "capacity_rps", "index", **round_, "t"}`` (``round_`` as
    :func:`run_round` returns it; ``design``: ``{"flood_s", "weighted_s"}`` in seconds)."""
    return {"schema": 1, "kind": ROUND_KIND, "run": run, "commit": commit, "dirty": dirty,
            "design": dict(design), "capacity_rps": capacity, "index": index, **round_,
            "t": time.time()}


def append_record(ledger: Path, record: Mapping) -> None:
    """Append one JSON line to ``ledger`` (its folder made if missing)."""
    ledger.parent.mkdir(parents=True, exist_ok=True)
    with open(ledger, "a") as f:
        f.write(json.dumps(record) + "\n")


def pooled_rounds(records: Sequence[Mapping], commit: str | None = None) -> list[dict]:
    """The rounds the verdict pools: every round record of the newest round's ``(commit,
    dirty)`` (with ``commit``: of the newest round whose commit starts with it) and design, in
    ledger order. Raises ValueError when the ledger holds no such round."""
    from bench.verdict import select_pool

    pool = select_pool(counted_rounds(records), commit)
    design = pool[-1].get("design")
    return [r for r in pool if r.get("design") == design]


def summary_line(rounds: int, capacity: float, v: dict, runs: int = 1) -> str:
    """The last line (module docstring)."""
    return (f"fairness runs={runs} rounds={rounds} capacity={capacity:.2f} "
            f"goodput={_fmt(v['goodput'])} per_s={_fmt(v['per_s'])} "
            f"aa={_fmt(v['aa'])} split={_fmt(v['split'])} light_non200={v['light_non200']} "
            f"light_ttft_p90_s={v['light_ttft_p90_s']:.2f} result={v['result']}")


async def engine_steps(client: httpx.AsyncClient) -> float:
    """Engine steps so far: the count of vLLM's ``vllm:iteration_tokens_total`` histogram
    (one observation per engine step) on the server's ``/metrics``."""
    from bench.workloads import histogram_totals

    return histogram_totals((await client.get("/metrics")).text,
                            "vllm:iteration_tokens_total")[1]


async def flood_arm(base_url: str, model: str, senders: dict[str, tuple[str, float]],
                    flood_s: float, seed: int) -> tuple[list[Outcome], float, float, float]:
    """One open-loop flood run, the engine's step count read at the loaded window's edges
    (:data:`WARM_S` and ``flood_s`` after the start, :func:`bench.tenants.window`):
    ``(outcomes, lo, hi, steps)``, ``lo``/``hi`` the monotonic times of the two readings."""
    start = time.monotonic()
    run = asyncio.create_task(open_loop(base_url, model, senders, flood_s, seed=seed))
    marks = []
    async with httpx.AsyncClient(base_url=base_url, timeout=30) as client:
        for at in (WARM_S, flood_s):
            await asyncio.sleep(max(0.0, start + at - time.monotonic()))
            steps = await engine_steps(client)
            marks.append((time.monotonic(), steps))
    outcomes = await run
    (lo, s0), (hi, s1) = marks
    return outcomes, lo, hi, s1 - s0


async def run_round(base_url: str, model: str, tokens: dict[str, str], capacity: float,
                    order: Sequence[str], seed: int, flood_s: float, weighted_s: float,
                    meter: Callable[[], Any] = contextlib.nullcontext) -> dict:
    """One round (module docstring): the flood arms in ``order``, then the weighted run.
    ``meter()`` is a context manager around each flood arm; when it has ``steal`` and
    ``foreign`` shares and ``flagged`` (:class:`bench.compare.Meter`), they go in the round's
    ``machine``, and a flagged arm flags the round (:func:`judge` leaves it out)."""
    good, steps, goodput, light, machine = {}, {}, {}, {}, {}
    for arm in order:
        with meter() as m:
            outcomes, lo, hi, steps[arm] = await flood_arm(
                base_url, model, flood_load(tokens, capacity, alone=arm != "shared"), flood_s,
                seed)
        if m is not None:
            machine[arm] = {"steal": round(m.steal, 4), "foreign": round(m.foreign, 4),
                            "flagged": m.flagged}
        good[arm] = served_in_window(outcomes, lo, hi, good_only=True)
        goodput[arm] = good[arm] / (hi - lo)
        if arm == "shared":
            mine = [o for o in outcomes if o.tenant == "light"]
            ttfts = [o.ttft_s for o in mine if o.ttft_s is not None]
            light = {"sent": len(mine), "non200": sum(o.status != 200 for o in mine),
                     "ttft_p90_s": p90(ttfts) if ttfts else math.inf,
                     "reasons": sorted({o.reason for o in mine if o.reason})}
    outcomes = await open_loop(base_url, model, weighted_load(tokens, capacity), weighted_s,
                               seed=1000 + seed)
    split = served_by_tenant(outcomes, weighted_s, ("heavy", "lighter"))
    return {"seed": seed, "order": list(order), "good": good, "steps": steps,
            "goodput": goodput, "light": light, "split": split, "machine": machine,
            "flagged": any(v["flagged"] for v in machine.values())}


def _say_verdict(what: str, v: dict) -> None:
    from bench.progress import say

    say(f"{what}: per second (reported): goodput {_fmt(v['per_s'])}, A/A "
        f"{_fmt(v['aa_per_s'])}; goodput bootstrap [{v['goodput']['boot_lo']:.3f},"
        f"{v['goodput']['boot_hi']:.3f}], A/A [{v['aa']['boot_lo']:.3f},"
        f"{v['aa']['boot_hi']:.3f}], split [{v['split']['boot_lo']:.3f},"
        f"{v['split']['boot_hi']:.3f}]; checks {v['checks']}")


def judge_ledger(ledger: Path, commit: str | None = None) -> tuple[dict, list[dict]]:
    """``(verdict, pooled round records)`` of the ledger (:func:`pooled_rounds`,
    :func:`judge`). Raises OSError or ValueError (no such round, a bad line)."""
    from bench.verdict import read_ledger

    pool = pooled_rounds(read_ledger(ledger), commit)
    return judge(pool), pool


def same_rounds(ledger: Path, commit: str, dirty: bool, design: Mapping) -> list[dict]:
    """The ledger's rounds of ``(commit, dirty, design)``: those a run of them is pooled
    with (none when the ledger does not exist). Raises ValueError on a bad line."""
    from bench.verdict import read_ledger

    if not ledger.exists():
        return []
    return [r for r in counted_rounds(read_ledger(ledger))
            if (r.get("commit"), bool(r.get("dirty")), r.get("design"))
            == (commit, dirty, dict(design))]


def counted_rounds(records: Sequence[Mapping]) -> list[Mapping]:
    """The round records of runs no ``fairness-void`` record withdrew (``--void RUN --why
    TEXT``: the ledger stays append-only; the verdict no longer counts their rounds)."""
    void = {r["run"] for r in records if r.get("kind") == VOID_KIND}
    return [r for r in records if r.get("kind") == ROUND_KIND and r.get("run") not in void]


def pooled_line(verdict: dict, pool: Sequence[Mapping]) -> str:
    """:func:`summary_line` of a pool: its runs, its rounds judged, the newest run's
    capacity."""
    return summary_line(verdict["rounds"], pool[-1]["capacity_rps"], verdict,
                        runs=len({r["run"] for r in pool}))


def main(argv: Sequence[str] | None = None) -> int:
    """The CLI (module docstring). 0 unless the server could not start; 2 when ``--judge``
    finds no round to judge."""
    from bench.compare import Meter
    from bench.process import ensure_tiny_model, git_state, start_serve, stop_process
    from bench.progress import bar, say

    p = argparse.ArgumentParser(prog="python -m bench.fairness",
                                description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=6, help="rounds (6: each order of the three "
                   "flood arms once)")
    p.add_argument("--flood-s", type=float, default=25.0, help="arrival seconds of a flood arm")
    p.add_argument("--weighted-s", type=float, default=20.0,
                   help="arrival seconds of the weighted run")
    p.add_argument("--capacity", type=float, help="requests/s the rates are multiples of "
                   "(default: measured first); fixed, two servers get the same arrivals")
    p.add_argument("--seed", type=int, default=0, help="added to every round's seed")
    p.add_argument("--out", type=Path, default=Path("bench/out"))
    p.add_argument("--ledger", type=Path, default=DEFAULT_LEDGER,
                   help="where rounds are appended and pooled from")
    p.add_argument("--judge", action="store_true",
                   help="no run: print the pooled verdict of the ledger")
    p.add_argument("--commit", help="with --judge: pool the rounds of this commit (prefix)")
    p.add_argument("--void", metavar="RUN", help="no run: withdraw run RUN's rounds from the "
                   "verdict (a record in the ledger, with --why)")
    p.add_argument("--why", help="with --void: the reason, kept in the ledger")
    args = p.parse_args(argv)
    if args.void:
        if not args.why:
            p.error("--void needs --why")
        append_record(args.ledger, {"schema": 1, "kind": VOID_KIND, "run": args.void,
                                    "why": args.why, "t": time.time()})
        print(f"run {args.void} withdrawn from {args.ledger}: {args.why}")
        return 0
    if args.judge:
        try:
            verdict, pool = judge_ledger(args.ledger, args.commit)
        except (OSError, ValueError) as e:
            print(f"bench.fairness: {e}", file=sys.stderr)
            return 2
        _say_verdict(f"{len(pool)} rounds pooled", verdict)
        print(pooled_line(verdict, pool), flush=True)
        return 0
    if args.rounds < 2:
        p.error("--rounds must be >= 2 (an interval needs two)")
    args.out.mkdir(parents=True, exist_ok=True)
    commit, dirty = git_state()
    design = {"flood_s": args.flood_s, "weighted_s": args.weighted_s, "goodput": "per_step"}
    run_id = f"{datetime.now(timezone.utc):%Y%m%dT%H%M%SZ}-{secrets.token_hex(2)}"
    earlier = same_rounds(args.ledger, commit, dirty, design)
    # Continue the seeds of the rounds this run will be pooled with.
    first_seed = args.seed + len(earlier)
    tokens = write_keys(args.out / "fairness-keys.json")
    model_dir = ensure_tiny_model()
    log = args.out / "fairness-server.log"
    print(f"fairness: run {run_id} on {commit[:12]}{' (uncommitted changes)' if dirty else ''}"
          f", {len(earlier)} earlier rounds of it in {args.ledger}; starting python -m serve on "
          f"the tiny model (log {log}) ...", file=sys.stderr, flush=True)
    server = start_serve([*server_args(), "--keys-file", str(args.out / "fairness-keys.json")],
                         log, model_dir=model_dir)
    t0 = time.perf_counter()
    rounds: list[dict] = []
    try:
        model = httpx.get(f"{server.base_url}/v1/models", timeout=10, headers={
            "Authorization": f"Bearer {tokens['alone']}"}).json()["data"][0]["id"]
        capacity = args.capacity or asyncio.run(capacity_rps(server.base_url, model,
                                                             tokens["alone"]))
        say(f"capacity {capacity:.2f} requests/s ({'given' if args.capacity else 'measured'})")
        orders = stats.balanced_orders(args.rounds, FLOOD_ARMS, random.Random(first_seed))
        with bar(args.rounds, "fairness rounds", "round") as progress:
            for k, order in enumerate(orders):
                r = asyncio.run(run_round(server.base_url, model, tokens, capacity, order,
                                          first_seed + k, args.flood_s, args.weighted_s,
                                          lambda: Meter({"serve": server}, "serve")))
                rounds.append(r)
                append_record(args.ledger, round_record(run_id, commit, dirty, design,
                                                        capacity, len(earlier) + k, r))
                g = r["goodput"]
                say(f"round {k + 1} ({','.join(order)}): good/s shared {g['shared']:.2f} "
                    f"alone {g['alone']:.2f} alone2 {g['alone2']:.2f}; good per 1000 "
                    f"steps shared {1000 * per_step(r, 'shared'):.2f} alone "
                    f"{1000 * per_step(r, 'alone'):.2f} alone2 "
                    f"{1000 * per_step(r, 'alone2'):.2f}; split heavy "
                    f"{r['split']['heavy']:.1f} lighter {r['split']['lighter']:.1f}; light "
                    f"{r['light']['non200']} non-200 of {r['light']['sent']}, TTFT p90 "
                    f"{r['light']['ttft_p90_s']:.2f} s"
                    + ("; FLAGGED (other CPU work), left out" if r["flagged"] else ""))
                progress.update()
    finally:
        stop_process(server)
    verdict = judge(rounds)
    pooled, pool = judge_ledger(args.ledger) if rounds else (verdict, [])
    (args.out / "fairness.json").write_text(json.dumps(
        {"run": run_id, "commit": commit, "dirty": dirty, "capacity_rps": capacity,
         "rounds": rounds, "verdict": verdict, "pooled": {"rounds": len(pool), "verdict": pooled},
         "elapsed_s": time.perf_counter() - t0,
         "args": {k: str(v) for k, v in vars(args).items()}}, indent=1))
    _say_verdict("this run", verdict)
    say(f"this run: {summary_line(verdict['rounds'], capacity, verdict)}; "
        f"{statistics.fmean(r['goodput']['alone'] for r in rounds):.2f} good answers/s alone")
    _say_verdict(f"pooled over {len(pool)} rounds", pooled)
    print(pooled_line(pooled, pool), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
