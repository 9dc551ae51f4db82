"""The real engine as the autotuner's witness: paired episodes on one warm server.

``python -m bench.witness [--seed 0] [--episodes T2/0,T6/0,...] [--arms auto,L8,L16,off,aa]
[--sim bench/out/simjudge.json] [--profile FILE] [--from witness.json] [--no-plain]
[--fixed-capacity]`` (~14 min for all 10 episodes and 5 arms here, then ~1 min for the sanity
arm)

One ``python -m serve`` on the tiny model (``--bench-admin``, vLLM's
``--enable-logging-iteration-details``, the CPU suite's SLO and time constants) stays up for
the whole run. A server of its own measures the host's chat throughput first (:func:`probe`),
and the episodes (:func:`sized`) and the SLO's targets (:func:`sized_slo`) are sized by it, so
that their loads are the suite's fractions of this host's capacity and its targets as hard,
whatever the host's speed that day; after the replays the simulator's cpu
profile is fitted to the engine steps it logged and checked against the fixed-limit arms
(:func:`calibration`). The CPU suite
(:func:`bench.trace.cpu_suite`) is cut into short independent **episodes** (:func:`episodes`):
each of T2's bursts, each of T5's phases, 10-s windows of T6 (chat at 2x capacity) and of T1
(60 %). Before each arm of an episode the switch (``POST /admin/bench/admission``) sets the
arm's admission mode and resets the autotuner and the limiter's drain rate to their boot
state, and the engine is drained (nothing in flight or queued). Arms: ``auto``, ``L8`` and
``L16`` (fixed limits), ``off`` (no gateway limit: what plain vLLM admits) and ``aa`` (L16
again: the A/A control). Every arm replays the same seeded arrivals, shapes, words and photo
crops (common random numbers); a salt word at the start of each text and a salt pixel in each
crop make each arm's content its own, so no arm hits another's prefix or image cache while
every arm does the same decode and prefill work. Episodes run in a random order, the arms in a
fresh random permutation per episode.
Then the **sanity arm**: plain vLLM's own OpenAI server, started with the same engine
arguments, replays the T1 windows once (:data:`PLAIN_EPISODES`), and a line compares its good
requests with the ``off`` arm's (reported, not gated; :func:`sanity_line`).

Goodput is DistServe's, counted client-side: good requests (TTFT, queue wait included, and
mean ITL within the targets) per episode. The statistic is the paired log-ratio per episode
(``log((auto + 0.5) / (L + 0.5))``: half a request keeps an episode where both got none),
its mean and a 90 % percentile bootstrap over episodes (Efron & Tibshirani 1993; the
episodes are the independent blocks, as in Kalibera & Jones 2013). Targets (issue 32): the
A/A interval inside [0.85, 1.18] (else the run is ``unresolved``); auto against each fixed L
lower bound >= 0.85; auto against off lower bound >= 1.2 on the overload episodes (T2's
bursts, T6) and >= 0.95 on T1. A progress bar on stderr counts the (episode, arm) replays done,
with an ETA; stdout gets one line per episode and ends with (one line, wrapped here)::

    witness episodes=N aa=[lo,hi] auto/L8=[lo,hi] auto/L16=[lo,hi]
        auto/off_overload=[lo,hi] auto/off_steady=[lo,hi]
        result=pass|fail|inconclusive|unresolved
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import math
import random
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, replace
from pathlib import Path

from bench import calibrate
from bench.sim import EngineConfig, cpu_profile
from bench.stats import bootstrap_interval
from bench.trace import CPU_CAPACITY, Capacity, Trace, backlog_trace, chat_phase, cpu_suite
from serve.admission.goodput import SloTargets

#: Arm name -> ``/admin/bench/admission`` body.
ARMS: dict[str, dict] = {
    "auto": {"mode": "auto"},
    "L8": {"mode": "static", "limit": 8},
    "L16": {"mode": "static", "limit": 16},
    "off": {"mode": "off"},
    "aa": {"mode": "static", "limit": 16},
}
#: Episodes replayed once more against plain vLLM (``python -m vllm.entrypoints.openai.
#: api_server``, the same engine arguments), after the arms: the sanity arm. The steady
#: windows (T1 at 60 % of capacity), where most requests are good, so that the ``off`` arm
#: (no gateway limit: what plain vLLM admits) and plain vLLM are compared on many of them
#: (on the overload windows both get almost none).
PLAIN_EPISODES = ("T1/0", "T1/1")
#: Episodes whose traffic overloads the engine (T2's bursts, T6), and the steady ones (T1).
OVERLOAD_PREFIXES = ("T2/", "T6/")
STEADY_PREFIXES = ("T1/",)
#: The A/A band and the margins of the targets (ratios of goodput).
AA_BAND = (0.85, 1.18)
MIN_VS_FIXED = 0.85
MIN_VS_OFF_OVERLOAD = 1.2
MIN_VS_OFF_STEADY = 0.95
#: Seconds of silence an episode starts with (the engine is idle and drained before).
LEAD_S = 0.2


def window(trace: Trace, t0: float, t1: float, name: str) -> Trace:
    """The requests of ``trace`` arriving in ``[t0, t1)``, as a trace of their own that
    starts :data:`LEAD_S` before the first of them (ids and arrival times renumbered)."""
    reqs = [r for r in trace.requests if t0 <= r.arrival_s < t1]
    if not reqs:
        return Trace((replace(trace.phases[0], name=name, duration_s=t1 - t0),), (), trace.seed)
    shift = reqs[0].arrival_s - LEAD_S
    own = tuple(replace(r, id=i, arrival_s=r.arrival_s - shift, phase=name)
                for i, r in enumerate(reqs))
    return Trace((replace(trace.phases[0], name=name, duration_s=t1 - shift),), own,
                 trace.seed)


def episodes(seed: int = 0, capacity: Capacity = CPU_CAPACITY,
             phase_s: float = 10.0) -> dict[str, Trace]:
    """The CPU suite cut into independent episodes, ``{name: trace}``: ``T2/0..2`` (one burst
    each), ``T5/0..2`` (its phases), ``T6/0..1`` and ``T1/0..1`` (10-s windows)."""
    s = cpu_suite(seed, capacity, phase_s)
    out: dict[str, Trace] = {}
    t2 = s["T2"]
    period = t2.duration_s / 3
    for c in range(3):
        out[f"T2/{c}"] = window(t2, c * period, (c + 1) * period, f"T2/{c}")
    t = 0.0
    for i, phase in enumerate(s["T5"].phases):
        out[f"T5/{i}"] = window(s["T5"], t, t + phase.duration_s, f"T5/{i}")
        t += phase.duration_s
    for name in ("T6", "T1"):
        half = s[name].duration_s / 2
        for i in range(2):
            out[f"{name}/{i}"] = window(s[name], i * half, (i + 1) * half, f"{name}/{i}")
    return out


def log_ratios(good: Mapping[str, Mapping[str, int]], arm: str, base: str,
               names: Iterable[str] | None = None) -> list[float]:
    """``log((good[e][arm] + 0.5) / (good[e][base] + 0.5))`` for each episode ``e`` (of
    ``names`` when given) that ran both arms, in the episodes' sorted order: the bootstrap
    resamples by position, so a run judged from its replay order and from its ledger record
    (sorted keys) gets the same interval."""
    keys = sorted(e for e in (names if names is not None else good) if e in good)
    return [math.log((good[e][arm] + 0.5) / (good[e][base] + 0.5)) for e in keys
            if arm in good[e] and base in good[e]]


def interval(values: Sequence[float], level: float = 0.90) -> tuple[float, float, float]:
    """The geometric mean ratio and its bootstrap interval (``exp`` of the log scale);
    ``nan`` everywhere with fewer than 2 episodes."""
    if len(values) < 2:
        return (math.nan, math.nan, math.nan)
    mean, lo, hi = bootstrap_interval(values, level)
    return math.exp(mean), math.exp(lo), math.exp(hi)


def judge(good: Mapping[str, Mapping[str, int]], min_vs_fixed: float = MIN_VS_FIXED
          ) -> tuple[dict[str, tuple], str]:
    """The intervals of the last line and the result (module docstring); ``min_vs_fixed``:
    the lower bound auto's interval against each fixed limit must reach (0.90 pooled over
    runs, :mod:`bench.witness_ledger`)."""
    over = [e for e in good if e.startswith(OVERLOAD_PREFIXES)]
    steady = [e for e in good if e.startswith(STEADY_PREFIXES)]
    iv = {
        "aa": interval(log_ratios(good, "aa", "L16")),
        "auto/L8": interval(log_ratios(good, "auto", "L8")),
        "auto/L16": interval(log_ratios(good, "auto", "L16")),
        "auto/off_overload": interval(log_ratios(good, "auto", "off", over)),
        "auto/off_steady": interval(log_ratios(good, "auto", "off", steady)),
    }
    margins = {"auto/L8": min_vs_fixed, "auto/L16": min_vs_fixed,
               "auto/off_overload": MIN_VS_OFF_OVERLOAD, "auto/off_steady": MIN_VS_OFF_STEADY}
    aa = iv["aa"]
    if not (aa[1] >= AA_BAND[0] and aa[2] <= AA_BAND[1]):
        return iv, "unresolved"
    verdicts = []
    for name, margin in margins.items():
        _, lo, hi = iv[name]
        verdicts.append("inconclusive" if math.isnan(lo) else "pass" if lo >= margin
                        else "fail" if hi < margin else "inconclusive")
    result = "fail" if "fail" in verdicts else "inconclusive" if "inconclusive" in verdicts \
        else "pass"
    return iv, result


def intervals_text(iv: Mapping[str, tuple[float, float, float]]) -> str:
    """``aa=[lo,hi] auto/L8=[lo,hi] ...``: :func:`judge`'s intervals as the lines print them."""
    return " ".join(f"{k}=[{lo:.2f},{hi:.2f}]" for k, (_, lo, hi) in iv.items())


def verdict_line(good: Mapping[str, Mapping[str, int]]) -> str:
    """``witness episodes=N aa=[lo,hi] ... result=R``."""
    iv, result = judge(good)
    return f"witness episodes={len(good)} {intervals_text(iv)} result={result}"


def combined_line(sim: Mapping, good: Mapping[str, Mapping[str, int]],
                  calibrated: bool = False) -> str:
    """The line of ``make bench-autotune`` (issue 32): the simulator's part and verdict
    (``sim``: ``bench/out/simjudge.json``'s ``head`` and ``passed``), the calibration check
    (:func:`bench.calibrate.check`: ``calibrated`` -> ``calib=ok``, else ``calib=off``: the
    simulator's cpu profile does not predict this engine, so the simulator does not judge)
    and the witness.

    ``result``: ``fail`` when the simulator or the witness fails; else ``unresolved`` when
    the witness's A/A control is out of its band or the calibration is off; else the
    witness's (``inconclusive`` or ``pass``)."""
    iv, cpu = judge(good)
    if not sim["passed"] or cpu == "fail":
        result = "fail"
    elif cpu == "unresolved" or not calibrated:
        result = "unresolved"
    else:
        result = cpu
    return (f"{sim['head']} | calib={'ok' if calibrated else 'off'} | cpu {intervals_text(iv)} "
            f"result={result}")


def salt(arm: str, seed: int) -> str:
    """The arm's salt word for :func:`bench.cpu_engine.build_bodies`: the same length for
    every arm (the same tokens), its own content."""
    return hashlib.sha256(f"{seed}-{arm}".encode()).hexdigest()[:8]


async def drain(base_url: str, timeout_s: float = 120.0) -> None:
    """Wait until nothing is in flight or queued at the gateway of the server at ``base_url``
    (``/admin/autotuner``). Raises TimeoutError after ``timeout_s`` seconds."""
    import httpx

    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(base_url=base_url, timeout=30) as client:
        while time.monotonic() < deadline:
            state = (await client.get("/admin/autotuner")).json()
            if state["in_flight"] == 0 and state["pending"] == 0:
                return
            await asyncio.sleep(0.25)
    raise TimeoutError("the engine did not drain")


def warm_up(base_url: str, trace: Trace, model: str, body_salt: str, drain_s: float) -> None:
    """Replay ``trace`` once, unscored, with its own ``body_salt``: a fresh engine is slow on
    its first batches (kernels warm up per shape), which no scored replay must draw. The
    caller waits for the server to be idle after it."""
    from bench.cpu_engine import build_bodies, replay_http

    bodies = build_bodies(trace, model, salt=body_salt)
    asyncio.run(replay_http(trace, base_url, bodies, drain_s=drain_s))


def measure_chat_rps(base_url: str, seed: int, capacity: Capacity = CPU_CAPACITY,
                     n: int | None = None, drain_s: float = 600.0) -> float:
    """The server's saturated chat throughput now, finished requests/s: ``n`` chat requests
    (default ``4 x capacity.ceiling``, the backlog :data:`bench.trace.CPU_CAPACITY` was
    measured on, :func:`bench.autotune.cpu_capacity_benchmark`) arrive at once with no
    gateway limit (the ``off`` arm: vLLM's own ``max_num_seqs`` batches them); throughput =
    finished / the last finish time, after an unscored replay of ``capacity.ceiling`` of
    them (the engine's warm-up). Its own salt: no arm meets its prompts in a cache.
    Raises RuntimeError when no request finished."""
    import httpx

    from bench.cpu_engine import build_bodies, replay_http
    from bench.workloads import served_model

    model = served_model(base_url)
    with httpx.Client(base_url=base_url, timeout=30) as c:
        c.post("/admin/bench/admission", json=ARMS["off"]).raise_for_status()
    phase = chat_phase("chat", 1.0, 1.0, capacity)
    warm_up(base_url, backlog_trace(phase, capacity.ceiling, seed + 1), model,
            salt("speed-warm-up", seed), drain_s)
    asyncio.run(drain(base_url))
    trace = backlog_trace(phase, n or 4 * capacity.ceiling, seed)
    replay = asyncio.run(replay_http(trace, base_url, build_bodies(trace, model,
                                                                   salt=salt("speed", seed)),
                                     drain_s=drain_s))
    asyncio.run(drain(base_url))
    done = [r.finish_s for r in replay.results if r.finish_s is not None]
    if not done:
        raise RuntimeError("no request of the speed probe finished")
    return len(done) / max(done)


def probe(out: Path, seed: int) -> float:
    """:func:`measure_chat_rps` on a ``python -m serve`` of its own (the witness's arguments,
    log ``out/witness-probe.log``), stopped after it: the witness's server then starts with
    the targets sized by it (:func:`sized_slo`), which it reads only at boot."""
    from bench.autotune import CPU_AUTO_ARGS
    from bench.process import ensure_tiny_model, start_serve, stop_process

    ensure_tiny_model()
    print(f"witness: measuring the server's chat throughput (the episodes' size; log "
          f"{out / 'witness-probe.log'}) ...", file=sys.stderr, flush=True)
    server = start_serve([*calibrate.SERVER_ARGS, *CPU_AUTO_ARGS], out / "witness-probe.log")
    try:
        return measure_chat_rps(server.base_url, seed)
    finally:
        stop_process(server)


def sized(chat_rps: float, capacity: Capacity = CPU_CAPACITY) -> Capacity:
    """``capacity`` at the speed the server showed (``chat_rps``, :func:`measure_chat_rps`):
    every mix's rate scaled by ``chat_rps / capacity.chat_rps``. The suite's rates are
    fractions of capacity (T1 at 60 %, T6 at 2x), and this machine's speed moves by up to
    ~1.5x from day to day, more between hosts: the episodes load the engine the same on a
    slow day as on a fast one, as :func:`bench.trace.cpu_suite` documents.
    Raises ValueError unless ``chat_rps`` > 0."""
    scale = speed(chat_rps, capacity)
    return replace(capacity, chat_rps=chat_rps, vision_rps=capacity.vision_rps * scale,
                   long_rps=capacity.long_rps * scale)


def sized_slo(chat_rps: float, slo: SloTargets, capacity: Capacity = CPU_CAPACITY
              ) -> SloTargets:
    """``slo`` at the speed the server showed: both targets divided by ``chat_rps /
    capacity.chat_rps``. The CPU suite's targets are stated for the reference speed (a 2-s
    TTFT is ~7 image encodes there, :data:`bench.autotune.CPU_SLO_TTFT_S`); on a host at
    half that speed every fixed limit would miss them by the host, not by its admission,
    and the few good requests left make every ratio noise. Raises ValueError unless
    ``chat_rps`` > 0."""
    scale = speed(chat_rps, capacity)
    return SloTargets(slo.ttft_s / scale, slo.itl_s / scale)


def speed(chat_rps: float, capacity: Capacity = CPU_CAPACITY) -> float:
    """``chat_rps / capacity.chat_rps``: the host's speed against the reference, the one
    factor :func:`sized` and :func:`sized_slo` scale by. Raises ValueError unless
    ``chat_rps`` > 0."""
    if not chat_rps > 0:
        raise ValueError(f"chat_rps must be > 0, got {chat_rps!r}")
    return chat_rps / capacity.chat_rps


def sizing(chat_rps: float | None, slo: SloTargets) -> tuple[Capacity, SloTargets]:
    """The capacity and the targets a run replays and counts by: sized by ``chat_rps``
    (:func:`sized`, :func:`sized_slo`), or the reference ones (:data:`CPU_CAPACITY`,
    ``slo``) when it is None (``--fixed-capacity``, ``--url``, or a run recorded before the
    probe)."""
    if chat_rps is None:
        return CPU_CAPACITY, slo
    return sized(chat_rps), sized_slo(chat_rps, slo)


def run(base_url: str, eps: Mapping[str, Trace], arms: Sequence[str], seed: int,
        slo, drain_s: float = 30.0) -> tuple[dict[str, dict[str, int]],
                                             dict[str, dict[str, list[float]]], list[dict],
                                             dict[str, dict[str, dict]]]:
    """Replay every episode on every arm against the server at ``base_url``; returns
    ``({episode: {arm: good requests}}, {episode: {arm: TTFTs}}, steps, {episode: {arm:``
    :func:`kind_summary```}})`` (TTFT: seconds, client side, of the requests that got a
    first token; steps: the engine steps the server logged, :mod:`serve.steplog`, empty
    without vLLM's ``--enable-logging-iteration-details``).
    Replays the first episode once, unscored, before the others (the engine's warm-up).
    Prints one line per episode (stdout) and counts the (episode, arm) replays on a progress
    bar (stderr)."""
    import httpx

    from bench.autotune import summarize
    from bench.cpu_engine import build_bodies, replay_http
    from bench.progress import bar as progress_bar
    from bench.progress import say
    from bench.workloads import served_model

    rng = random.Random(seed)
    order = list(eps)
    rng.shuffle(order)
    model = served_model(base_url)
    good: dict[str, dict[str, int]] = {}
    ttfts: dict[str, dict[str, list[float]]] = {}
    steps: list[dict] = []
    kinds: dict[str, dict[str, dict]] = {}
    with httpx.Client(base_url=base_url, timeout=30) as c:
        c.post("/admin/bench/admission", json=ARMS["off"]).raise_for_status()
    warm_up(base_url, eps[order[0]], model, salt("warm-up", seed), drain_s)
    asyncio.run(drain(base_url))
    httpx.get(f"{base_url}/admin/bench/steps", timeout=30)  # only the replays' steps
    with progress_bar(len(order) * len(arms), "witness", "replay") as bar:
        for k, name in enumerate(order):
            bar.set_description(f"witness episode {k + 1}/{len(order)}")
            trace = eps[name]
            perm = list(arms)
            rng.shuffle(perm)
            good[name], ttfts[name], kinds[name] = {}, {}, {}
            for arm in perm:
                bar.set_postfix_str(f"{name} {arm}")
                bodies = build_bodies(trace, model, salt=salt(arm, seed))
                with httpx.Client(base_url=base_url, timeout=30) as c:
                    r = c.post("/admin/bench/admission", json=ARMS[arm])
                    r.raise_for_status()
                replay = asyncio.run(replay_http(trace, base_url, bodies, drain_s=drain_s))
                s = summarize(arm, replay.results, trace, slo)
                good[name][arm] = s.good
                ttfts[name][arm] = [r.ttft_s for r in replay.results if r.ttft_s is not None]
                kinds[name][arm] = kind_summary(replay.results, slo)
                asyncio.run(drain(base_url))
                steps += httpx.get(f"{base_url}/admin/bench/steps", timeout=60).json()["steps"]
                bar.update()
            say(f"{name:6} {len(trace.requests):4} requests  " + "  ".join(
                f"{a} {good[name][a]}" for a in arms))
    return good, ttfts, steps, kinds


async def vllm_idle(base_url: str, timeout_s: float = 120.0) -> None:
    """Wait until plain vLLM at ``base_url`` runs and queues no request (its ``/metrics``:
    ``vllm:num_requests_running`` and ``vllm:num_requests_waiting`` at 0). Raises
    TimeoutError after ``timeout_s`` seconds."""
    import httpx

    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(base_url=base_url, timeout=30) as client:
        while time.monotonic() < deadline:
            text = (await client.get("/metrics")).text
            busy = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                    if line.startswith(("vllm:num_requests_running", "vllm:num_requests_waiting"))]
            if busy and not any(busy):
                return
            await asyncio.sleep(0.25)
    raise TimeoutError("plain vLLM did not drain")


def run_plain(base_url: str, eps: Mapping[str, Trace], seed: int, slo,
              drain_s: float = 30.0) -> tuple[dict[str, int], dict[str, dict]]:
    """The sanity arm: replay ``eps`` once against plain vLLM at ``base_url`` (its own
    salt, so that no earlier arm's prefix or image cache helps it), after one unscored
    replay of the first episode that warms the fresh engine up; returns ``({episode: good
    requests}, {episode:`` :func:`kind_summary```})``, counted as for the arms
    (:func:`run`)."""
    from bench.autotune import summarize
    from bench.cpu_engine import build_bodies, replay_http
    from bench.progress import say
    from bench.workloads import served_model

    model = served_model(base_url)
    warm_up(base_url, next(iter(eps.values())), model, salt("plain-warm-up", seed), drain_s)
    asyncio.run(vllm_idle(base_url))
    good: dict[str, int] = {}
    kinds: dict[str, dict] = {}
    for name, trace in eps.items():
        bodies = build_bodies(trace, model, salt=salt("plain", seed))
        replay = asyncio.run(replay_http(trace, base_url, bodies, drain_s=drain_s))
        good[name] = summarize("plain", replay.results, trace, slo).good
        kinds[name] = kind_summary(replay.results, slo)
        asyncio.run(vllm_idle(base_url))
        say(f"{name:6} plain vLLM {good[name]}")
    return good, kinds


KINDS = ("text", "image")
"""The request kinds :func:`kind_summary` splits an episode's requests into."""


def kind_summary(results, slo) -> dict[str, dict]:
    """An episode's requests split by kind (``text``, ``image``: with at least one image):
    ``{kind: {"n", "good", "ttft_p50_s", "itl_p50_s"}}``; the TTFT (client side, queue
    included) and mean ITL medians in seconds over the requests that had one (None: none).
    Where plain vLLM and the ``off`` arm differ, this says on which requests and how."""
    from serve.admission.engine_stats import percentile

    out = {}
    for kind in KINDS:
        rs = [r for r in results if (r.request.images > 0) == (kind == "image")]
        out[kind] = {
            "n": len(rs), "good": sum(r.good(slo) for r in rs),
            "ttft_p50_s": percentile([r.ttft_s for r in rs if r.ttft_s is not None], 50),
            "itl_p50_s": percentile([r.mean_itl_s for r in rs if r.mean_itl_s is not None], 50)}
    return out


def pooled_kinds(per_episode: Iterable[Mapping[str, Mapping]]) -> str:
    """:func:`kind_summary` results pooled over episodes, as text: per kind, good/total and
    the largest of the episodes' TTFT and ITL medians (seconds, milliseconds)."""
    episodes = list(per_episode)
    parts = []
    for kind in KINDS:
        rows = [e[kind] for e in episodes]
        n, good = sum(r["n"] for r in rows), sum(r["good"] for r in rows)
        ttft = max((r["ttft_p50_s"] for r in rows if r["ttft_p50_s"] is not None), default=None)
        itl = max((r["itl_p50_s"] for r in rows if r["itl_p50_s"] is not None), default=None)
        parts.append(f"{kind} {good}/{n} TTFT p50 "
                     + ("-" if ttft is None else f"{ttft:.2f} s") + " ITL p50 "
                     + ("-" if itl is None else f"{1000 * itl:.0f} ms"))
    return ", ".join(parts)


def sanity_line(good: Mapping[str, Mapping[str, int]], plain: Mapping[str, int],
                kinds: Mapping[str, Mapping[str, Mapping]] | None = None,
                plain_kinds: Mapping[str, Mapping] | None = None) -> str:
    """One line comparing plain vLLM with the ``off`` arm on the episodes both ran: each
    episode's good requests and the pooled ratio ``sum(plain) / sum(off)`` (reported, not
    gated: ``off`` admits what plain vLLM admits, so the two should read alike within the
    run's noise, which the A/A interval states). With ``kinds`` (``{episode: {arm:``
    :func:`kind_summary```}}``) and ``plain_kinds`` (``{episode:`` :func:`kind_summary```}``),
    two more lines split both by request kind (:func:`pooled_kinds`)."""
    names = [e for e in plain if "off" in good.get(e, {})]
    if not names:
        return "sanity plain vLLM: not run"
    off = sum(good[e]["off"] for e in names)
    pooled = sum(plain[e] for e in names) / off if off else float("nan")
    line = ("sanity plain vLLM vs off: " + "  ".join(
        f"{e} {plain[e]}/{good[e]['off']}" for e in names) + f"  pooled {pooled:.2f}")
    if kinds and plain_kinds and all(e in plain_kinds and "off" in kinds.get(e, {})
                                     for e in names):
        line += ("\n  plain vLLM: " + pooled_kinds(plain_kinds[e] for e in names)
                 + "\n  off:        " + pooled_kinds(kinds[e]["off"] for e in names))
    return line


def run_profile(steps: Sequence[dict], kv: Mapping | None, profile: Path | None,
                meta: Mapping) -> tuple[EngineConfig, str, dict | None]:
    """The cpu profile a run checks: ``profile`` when given, else one fitted
    (:func:`bench.calibrate.fit_steps`) to the run's own engine steps (``steps``, ``kv``:
    the server's KV cache), else the committed one. Returns ``(engine, where it came from,
    the cpu-profile.json record when fitted here else None)``."""
    if profile is not None:
        return cpu_profile(profile), str(profile), None
    if steps and kv:
        fit = calibrate.fit_steps(steps)
        engine = fit.engine(kv["num_gpu_blocks"], kv["block_size"])
        return (engine, "fitted to this run's engine steps: "
                + calibrate.summary_line(fit, engine),
                calibrate.profile_record(fit, engine, meta))
    return cpu_profile(), "the committed bench/cpu-profile.json", None


def calibration(eps: Mapping[str, Trace], good, ttfts, engine: EngineConfig,
                source: str, slo: SloTargets | None = None) -> dict:
    """The check of ``engine`` (:func:`bench.calibrate.check`) against the run's fixed-limit
    arms, good requests counted by ``slo`` (default the cpu profile's): ``{"ok", "table",
    "source", "engine"}`` (``engine``: its fields, so that ``--from`` can judge again)."""
    ok, rows = calibrate.check(eps, good, ttfts, engine, slo)
    return {"ok": ok, "table": calibrate.format_check(ok, rows), "source": source,
            "engine": asdict(engine)}


def main(argv: Sequence[str] | None = None) -> int:
    """The CLI (module docstring). Writes ``witness.json`` (and, fitted from the run,
    ``cpu-profile.json``) to ``--out``; 0 unless no episode ran."""
    import httpx

    from bench import witness_ledger
    from bench.autotune import CPU_AUTO_ARGS, CPU_SLO
    from bench.process import ensure_tiny_model, git_state, start_serve, stop_process

    p = argparse.ArgumentParser(prog="python -m bench.witness", description=__doc__.split("\n")[0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--episodes", default="", help="comma-separated names (default: all)")
    p.add_argument("--arms", default=",".join(ARMS))
    p.add_argument("--url", help="a server already running with "
                   + " ".join(calibrate.SERVER_ARGS))
    p.add_argument("--sim", type=Path, help="bench.simjudge's JSON: end with make "
                   "bench-autotune's combined line")
    p.add_argument("--profile", type=Path, help="check this cpu profile instead of fitting "
                   "one to the run's engine steps")
    p.add_argument("--from", dest="source", type=Path, help="an earlier run's witness.json: "
                   "print its verdicts (with --sim, the combined line) without replaying")
    p.add_argument("--no-plain", action="store_true", help="skip the sanity arm (plain "
                   "vLLM on " + ", ".join(PLAIN_EPISODES) + ")")
    p.add_argument("--fixed-capacity", action="store_true", help="size the episodes and the "
                   "SLO by the reference CPU_CAPACITY instead of the speed of a server "
                   "measured first (implied by --url)")
    p.add_argument("--out", type=Path, default=Path("bench/out"))
    p.add_argument("--ledger", type=Path, default=witness_ledger.LEDGER,
                   help="where a full run (every episode and arm, its own server) is appended "
                   "and pooled with the runs of the same code")
    args = p.parse_args(argv)
    if args.source is not None:
        done = json.loads(args.source.read_text())
        capacity, slo = sizing(done.get("chat_rps"), CPU_SLO)
        eps = {e: t for e, t in episodes(done["seed"], capacity).items()
               if e in done["good"]}
        calib = calibration(eps, done["good"], done["ttfts"],
                            EngineConfig(**done["calibration"]["engine"]),
                            done["calibration"]["source"], slo)
        report(done["good"], calib, args.sim, done.get("plain"), done.get("kinds"),
               done.get("plain_kinds"))
        return 0
    arms = [a for a in args.arms.split(",") if a]
    unknown = sorted(set(arms) - ARMS.keys())
    if unknown:
        p.error(f"unknown arm(s) {', '.join(unknown)}; known: {', '.join(ARMS)}")
    names = list(episodes(args.seed))
    wanted = [e for e in args.episodes.split(",") if e] or names
    missing = sorted(set(wanted) - set(names))
    if missing:
        p.error(f"unknown episode(s) {', '.join(missing)}; known: {', '.join(names)}")
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    server = None
    url = args.url
    chat_rps = None
    if url is None and not args.fixed_capacity:
        chat_rps = probe(args.out, args.seed)
    capacity, slo = sizing(chat_rps, CPU_SLO)
    print(f"witness: episodes sized for {capacity.chat_rps:.2f} chat requests/s "
          f"({speed(capacity.chat_rps):.2f} x the reference "
          f"{CPU_CAPACITY.chat_rps:g}/s), SLO TTFT {slo.ttft_s:.2f} s, mean ITL "
          f"{1000 * slo.itl_s:.0f} ms", flush=True)
    every = episodes(args.seed, capacity)
    eps = {e: every[e] for e in wanted}
    if url is None:
        ensure_tiny_model()
        print(f"witness: starting python -m serve on the tiny model (log "
              f"{args.out / 'witness-server.log'}) ...", file=sys.stderr, flush=True)
        server = start_serve([*calibrate.SERVER_ARGS, "--slo-ttft-s", f"{slo.ttft_s:g}",
                              "--slo-itl-s", f"{slo.itl_s:g}", *CPU_AUTO_ARGS],
                             args.out / "witness-server.log")
        url = server.base_url
    try:
        good, ttfts, steps, kinds = run(url, eps, arms, args.seed, slo)
        kv = httpx.get(f"{url}/admin/autotuner", timeout=30).json()["kv_capacity"]
    finally:
        if server is not None:
            stop_process(server)
    plain = plain_kinds = None
    plain_eps = {e: eps[e] for e in PLAIN_EPISODES if e in eps}
    if plain_eps and "off" in arms and not args.no_plain and args.url is None:
        from bench.compare import start_arm

        print("witness: starting plain vLLM (the sanity arm) ...", file=sys.stderr, flush=True)
        vllm = start_arm("raw", args.out, ensure_tiny_model())
        try:
            plain, plain_kinds = run_plain(vllm.base_url, plain_eps, args.seed, slo)
        finally:
            stop_process(vllm)
    print(f"({len(good)} episodes x {len(arms)} arms in {time.perf_counter() - t0:.0f} s)")
    commit, dirty = git_state()
    engine, source, record = run_profile(steps, kv, args.profile, {
        "commit": commit, "dirty": dirty, "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "seed": args.seed, "traces": "the witness's episodes, every arm"})
    if record is not None:
        (args.out / "cpu-profile.json").write_text(json.dumps(record, indent=1) + "\n")
    calib = calibration(eps, good, ttfts, engine, source, slo)
    (args.out / "witness.json").write_text(json.dumps(
        {"seed": args.seed, "chat_rps": chat_rps, "good": good, "ttfts": ttfts,
         "calibration": calib,
         "plain": plain, "kinds": kinds, "plain_kinds": plain_kinds}, indent=1))
    if args.url is None and not args.episodes and set(arms) == ARMS.keys():
        witness_ledger.append(args.ledger, good, args.seed, commit, dirty, chat_rps)
    report(good, calib, args.sim, plain, kinds, plain_kinds, pooled(args.ledger, commit))
    return 0 if good else 2


def pooled(ledger: Path, commit: str) -> str:
    """:func:`bench.witness_ledger.pooled_line` over the ledger's runs of the code of
    ``commit`` (the checkout's HEAD, :func:`bench.process.git_state`)."""
    from bench import witness_ledger

    return witness_ledger.pooled_line(
        witness_ledger.runs_of(witness_ledger.read(ledger), commit))


def report(good: Mapping[str, Mapping[str, int]], calib: Mapping, sim: Path | None,
           plain: Mapping[str, int] | None = None, kinds: Mapping | None = None,
           plain_kinds: Mapping | None = None, pooled_line: str | None = None) -> None:
    """Print the sanity arm (``plain``, ``plain_kinds``: :func:`run_plain`'s, None when not
    run; ``kinds``: :func:`run`'s), the calibration check, the witness's line, the witness
    pooled over the ledger's runs (``pooled_line``) and, with ``sim`` (bench.simjudge's
    JSON), the combined line last."""
    print(sanity_line(good, plain or {}, kinds, plain_kinds))
    print(f"cpu profile: {calib['source']}")
    print(calib["table"])
    print(verdict_line(good))
    if pooled_line is not None:
        print(pooled_line)
    if sim is not None:
        print(combined_line(json.loads(sim.read_text()), good, calib["ok"]))


if __name__ == "__main__":
    sys.exit(main())
