"""``make bench``: what our layers cost, measured against raw vLLM on the same engine, in one run.

``python -m bench.compare [--out bench/results] [--seed 0] [--no-readme] [--control]``

Four servers (three with ``--control``, below) start one after another on the tiny
Phi-3-vision (``models/phi-3-vision-tiny``) with the engine arguments of one
:class:`~serve.settings.Settings` (``PHI3V_*`` variables apply):

- **ours**: ``python -m serve`` with default settings;
- **raw**: vLLM's own OpenAI server, ``python -m vllm.entrypoints.openai.api_server`` with
  :func:`serve.engine.vllm_cli_args` (derived from the same settings) and the same
  environment (:meth:`Settings.engine_env`: offline, in-process engine core, OMP threads);
- **sequential**: ours pinned at admission limit 1 (``--autotune static --admission-limit 1``);
- **raw2**: a second raw vLLM, identical to the first: the **A/A control**. It runs the W1
  text cell at c=16 (8 segment pairs) beside the other two, so the run also prints how far two
  identical servers differ here (``raw2/raw``, ideally 1.00): the noise floor against which
  our cost is read.

All stay up (an idle server uses ~0.02 cores) and the workloads of
:mod:`bench.workloads` alternate between them, swapping the order each time, so a slow spell of
the machine hits both sides alike. Each side gets byte-identical requests; images are
distinct within a server run, so no cache helps except where the workload re-sends them (W3).

Output: ``OUT/bench.json`` (every number), ``OUT/bench.md`` (the table), ``OUT/bench.png``
(ratios against their targets), the table copied into the README between its
``make-bench`` markers, and one last line::

    ratios ours/raw ttft_p50=X throughput=X photo_ttft=X multiturn_ttft=X burst_makespan=X \
itl_p99=X rss_peak=X burst_non200=N ours/sequential throughput@16=X

Each ours/raw ratio is the worst over W1's concurrencies where several apply (the highest for
latencies, the lowest for throughput); a W1 cell's ratio is the median of the ratios of its
back-to-back segment pairs (:func:`paired_ratio`), since this machine's speed drifts by up
to ~15 % between identical runs a minute apart (measured A/A: single pairs of identical
servers differ by up to 7 %, up to 30 % on a slow spell). The text cells, where our
per-request and per-token cost shows most, run the most and the longest segments
(:data:`W1_PLAN`). The line before the last one
gives the A/A control::

    noise A/A raw2/raw throughput=X ttft_p50=X (W1 text c=16)

``--control`` (``make bench-control``) extends that control to the whole run: a second raw
vLLM takes ours' place in every workload (output in ``bench/out/control``, the README left
alone), so the last line gives, for each target, what two identical servers score on this
machine that day. That run has no separate A/A line (every cell is an A/A cell); its
artefacts and the line before its last say it is a control run (:data:`CONTROL_NOTE`).

The line before the A/A line gives what ours adds to the TTFT in front of vLLM's engine per
W1 cell (:func:`added_ttft_ms`: client mean TTFT minus vLLM's engine-side mean from each server's
``/metrics``, ours minus raw, ms), the part of the TTFT ratio that the machine's drift between
segments does not move::

    ttft added ours-raw in front of vLLM's engine (client - engine-side mean, ms) text:c=1=+X ...

and before that one W1's goodput (:func:`goodput_line`; not a target): both sides scored by
vLLM's own benchmark (``--goodput``) under the SLO targets our autotuner serves
(:func:`server_slo`), ours/raw per cell::

    goodput ours/raw (W1 requests/s with TTFT <= 10 s and TPOT <= 0.5 s; not a target) ...
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from bench import workloads as w
from bench.cpu_engine import IMAGES_DIR, real_photos
from bench.process import (
    ROOT,
    ManagedServer,
    ensure_tiny_model,
    free_port,
    start_process,
    start_serve,
    stop_process,
)
from serve.admission.engine_stats import percentile
from serve.admission.goodput import SloTargets

#: W1's plan by kind and concurrency: (prompts per segment, segments per side), the order of
#: the sides alternating (A B B A ...). Text segments last ~3-6 s each (at least 2 waves of
#: ``c`` requests: a shorter one is mostly ramp-up and tail), image ones 3-30 s (an image is
#: ~0.3-0.7 s of CLIP on this CPU): ~9.5 min in all on this CPU, most of the run's 15.
W1_PLAN = {"text": {1: (12, 4), 4: (32, 4), 16: (64, 8), 64: (128, 4)},
           "image": {1: (6, 4), 4: (8, 4), 16: (12, 4), 64: (64, 2)}}
W1_CONCURRENCIES = (1, 4, 16, 64)
#: Prompts of each of the sequential baseline's two segments in a c=16 cell (it runs the
#: cell's first and last segment): at limit 1 it serves only ~3 requests/s.
SEQUENTIAL_PROMPTS = 32
#: W1 cells the A/A control (``raw2``) joins: the cell with the most segment pairs.
AA_CELLS = (("text", 16),)
#: W4 repeats (distinct images each; the order of ours and raw alternating).
W4_REPEATS = 3
#: Photos per workload: W2 (one at a time), W3 (conversations x turns), W5 (per repeat),
#: memory (4 in flight).
W2_PHOTOS, W3_CONVERSATIONS, W3_TURNS, W5_PHOTOS, MEM_PHOTOS = 6, 2, 4, 3, 8
#: W5 repeats (each with its own photos; ours and raw back to back, order alternating).
W5_REPEATS = 4
#: Targets of issue 9 on this CPU: (ratio name, limit, True when higher is better).
TARGETS = {"ttft_p50": (1.05, False), "throughput": (0.97, True), "photo_ttft": (1.10, False),
           "multiturn_ttft": (1.05, False), "burst_makespan": (1.10, False),
           "itl_p99": (1.15, False), "rss_peak": (1.20, False),
           "ours/sequential throughput@16": (7.0, True)}
README_BEGIN, README_END = "<!-- make-bench:begin -->", "<!-- make-bench:end -->"


@dataclass
class Side:
    """One server of the comparison."""

    name: str
    server: ManagedServer


def model_dir() -> Path:
    """The model every server of the run serves: ``Settings().model`` (``PHI3V_MODEL``), the
    tiny model by default (built if missing)."""
    from serve.settings import DEFAULT_TINY_MODEL_DIR, Settings

    model = Settings().model
    if model == DEFAULT_TINY_MODEL_DIR:
        return ensure_tiny_model()
    return (ROOT / model).resolve()


def start_raw(name: str, out: Path, model: Path) -> Side:
    """Raw vLLM's own OpenAI server on the engine of ``Settings`` (:func:`vllm_cli_args`,
    :meth:`Settings.engine_env`), log in ``out/logs/NAME.log``."""
    from serve.engine import vllm_cli_args
    from serve.settings import Settings

    port = free_port()
    settings = Settings(model=str(model), port=port)
    return Side(name, start_process(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", *vllm_cli_args(settings)],
        port, out / "logs" / f"{name}.log", "/v1/models", env=settings.engine_env()))


def start_sides(out: Path, sides: dict[str, Side], control: bool = False) -> None:
    """Start ours, raw vLLM, the sequential baseline and the A/A control (a second raw vLLM),
    one after another, into ``sides`` (filled as they come up, so the caller can stop what
    started if a later one fails). ``PHI3V_*`` variables reach all of them (raw vLLM through
    :func:`vllm_cli_args`).

    ``control``: the whole-run A/A control (``--control``): the ``ours`` side is a second raw
    vLLM (named ``control`` in the logs) and there is no separate ``raw2`` (every cell is then
    an A/A cell): what two identical servers score on every ratio and target of the run."""
    model = model_dir()
    sides["ours"] = start_raw("control", out, model) if control else Side(
        "ours", start_serve([], out / "logs" / "ours.log", model_dir=model))
    sides["raw"] = start_raw("raw", out, model)
    sides["sequential"] = Side("sequential", start_serve(
        ["--autotune", "static", "--admission-limit", "1"], out / "logs" / "sequential.log",
        model_dir=model))
    if not control:
        sides["raw2"] = start_raw("raw2", out, model)


def halves(items: list) -> tuple[list, list]:
    """First and second half (the order of the sides swaps between them)."""
    return items[: len(items) // 2], items[len(items) // 2:]


def run(coro):
    return asyncio.run(coro)


def measure(sides: dict[str, Side], model: str, seed: int, log) -> dict:
    """Every workload, alternating ours and raw. Returns the raw measurements."""
    ours, raw = sides["ours"].server.base_url, sides["raw"].server.base_url
    pair = {"ours": ours, "raw": raw}
    sources = real_photos(IMAGES_DIR)
    t0 = time.monotonic()
    photos = w.photo_urls(sources, W2_PHOTOS + W3_CONVERSATIONS * W3_TURNS
                          + W5_REPEATS * W5_PHOTOS
                          + MEM_PHOTOS, seed * 1000)
    print(f"inputs: {len(photos)} distinct {w.PHOTO_SIZE[0]}x{w.PHOTO_SIZE[1]} JPEGs, mean "
          f"{statistics.mean(len(p) * 3 // 4 for p in photos) / 1e6:.2f} MB "
          f"({time.monotonic() - t0:.0f} s)", flush=True)
    w2, rest = photos[:W2_PHOTOS], photos[W2_PHOTOS:]
    w3 = [rest[i * W3_TURNS:(i + 1) * W3_TURNS] for i in range(W3_CONVERSATIONS)]
    rest = rest[W3_CONVERSATIONS * W3_TURNS:]
    w5 = [rest[k * W5_PHOTOS:(k + 1) * W5_PHOTOS] for k in range(W5_REPEATS)]
    mem = rest[W5_REPEATS * W5_PHOTOS:]
    out: dict = {name: {} for name in pair}
    tokenizer_dir = model_dir()
    slo = server_slo()
    for name in out:
        out[name]["w1_slo"] = {"ttft_s": slo.ttft_s, "itl_s": slo.itl_s}

    # Warm-up: the first request of a process pays one-off costs on both sides.
    warm = w.small_image_urls(sources, 1, seed + 500)
    for url in pair.values():
        run(w.burst(url, model, warm))

    # W4 first, while both servers are idle: a burst as large as the engine ceiling,
    # W4_REPEATS times (ours, raw, then raw, ours, ...) with distinct images; the ratio is the
    # median of the back-to-back pairs' (as W1's cells).
    ceiling = engine_ceiling()
    for name in pair:
        out[name]["w4"] = {"n": ceiling, "makespans_s": [], "non200": 0}
    for k in range(W4_REPEATS):
        images = w.small_image_urls(sources, ceiling, seed + 100 + k * ceiling)
        for name in (("ours", "raw") if k % 2 == 0 else ("raw", "ours")):
            results, makespan = run(w.burst(pair[name], model, images))
            out[name]["w4"]["makespans_s"].append(makespan)
            out[name]["w4"]["non200"] += sum(1 for r in results if not r.ok)
    for name in pair:
        out[name]["w4"]["makespan_s"] = statistics.median(out[name]["w4"]["makespans_s"])
    print(f"W4 burst of {ceiling} (x{W4_REPEATS}): " + ", ".join(
        f"{n} {out[n]['w4']['makespan_s']:.2f} s non-200 {out[n]['w4']['non200']}"
        for n in pair), flush=True)

    # W1: vLLM's serving benchmark per kind and concurrency, in segments of distinct prompts
    # whose order of sides alternates (A B B A ...); sequential joins the c=16 cells (first
    # and last segment), the A/A control the AA_CELLS.
    out["sequential"], out["raw2"] = {}, {}
    for kind, cells in W1_PLAN.items():
        for c in W1_CONCURRENCIES:
            prompts, segments = cells[c]
            names = ["ours", "raw", *(["raw2"] if (kind, c) in AA_CELLS and "raw2" in sides
                                      else []),
                     *(["sequential"] if c == 16 else [])]
            runs: dict[str, list[dict]] = {n: [] for n in names}
            started = time.monotonic()
            for k in range(segments):
                segment_seed = seed * 100_000 + c * 100 + k * 10 + (5 if kind == "image" else 0)
                for name in (names if k % 2 == 0 else names[::-1]):
                    n = prompts
                    if name == "sequential":
                        if k not in (0, segments - 1):
                            continue
                        n = min(prompts, SEQUENTIAL_PROMPTS)
                    runs[name].append(segment(sides[name].server.base_url, tokenizer_dir,
                                              model, kind, c, n, segment_seed, log, slo))
            for name in names:
                pooled = w.pool_runs(runs[name])
                pooled["segments"] = [w.pool_runs([one]) for one in runs[name]]
                out[name].setdefault("w1", {}).setdefault(kind, {})[str(c)] = pooled
            print(f"W1 {kind} c={c}: " + ", ".join(
                f"{n} {out[n]['w1'][kind][str(c)]['request_throughput']:.2f} req/s TTFT p50 "
                f"{out[n]['w1'][kind][str(c)]['median_ttft_ms']:.0f} ms" for n in names)
                + f" ({time.monotonic() - started:.0f} s)", flush=True)

    # W2: distinct phone photos, one at a time.
    for part, order in zip(halves(w2), (("ours", "raw"), ("raw", "ours")), strict=False):
        for name in order:
            res = run(w.photo_ttft(pair[name], model, part))
            out[name].setdefault("w2_ttft_s", []).extend(_ttfts(res))
    print("W2 photo TTFT p50: " + ", ".join(
        f"{n} {statistics.median(out[n]['w2_ttft_s']):.3f} s" for n in pair), flush=True)

    # Memory: peak RSS of each server's process tree, photos 4 at a time.
    for name in ("raw", "ours"):
        side = sides[name].server
        with w.RssSampler(side.proc.pid) as sampler:
            idle = sampler.peak_bytes
            res = run(w.photos_concurrently(pair[name], model, mem))
        out[name]["memory"] = {"idle_bytes": idle, "peak_bytes": sampler.peak_bytes,
                               "ok": sum(r.ok for r in res)}
    print("memory peak RSS: " + ", ".join(
        f"{n} {out[n]['memory']['peak_bytes'] / 2**20:.0f} MiB" for n in pair), flush=True)

    # W3: multi-turn conversations re-sending every earlier image.
    for part, order in zip(halves(w3), (("ours", "raw"), ("raw", "ours")), strict=False):
        for name in order:
            for turns in run(w.multiturn(pair[name], model, part)):
                out[name].setdefault("w3_ttft_s", []).append(_ttfts(turns))
    print("W3 multi-turn TTFT p50 by turn: " + ", ".join(
        f"{n} " + "/".join(f"{statistics.median(t):.2f}" for t in _by_turn(out[n]["w3_ttft_s"]))
        for n in pair), flush=True)

    # W5: ITL of 4 running text streams while photos arrive, repeated with fresh photos.
    for k, photos_k in enumerate(w5):
        for name in (("ours", "raw") if k % 2 == 0 else ("raw", "ours")):
            texts, shots = run(w.itl_under_photos(pair[name], model, photos_k))
            itls = [i for r in texts for i in r.itls_s]
            out[name].setdefault("w5_itls_s", []).extend(itls)
            out[name].setdefault("w5_p99_by_repeat_s", []).append(percentile(itls, 99))
            out[name].setdefault("w5_failed", 0)
            out[name]["w5_failed"] += sum(not r.ok for r in [*texts, *shots])
    print("W5 ITL p99 under photos: " + ", ".join(
        f"{n} {percentile(out[n]['w5_itls_s'], 99) * 1000:.0f} ms" for n in pair), flush=True)
    return out


def engine_ceiling() -> int:
    """The engine's ``max_num_seqs`` (``Settings``, resolved for this machine): W4's burst
    size. The same figure ours' autotuner has as its ceiling (``/admin/autotuner``), read
    from the settings so that a run whose ``ours`` side is raw vLLM (``--control``) has it."""
    from serve.settings import Settings

    return Settings().resolved().max_num_seqs


def server_slo() -> SloTargets:
    """The latency targets every server of the run is judged by in W1's goodput: those our
    server's autotuner serves (``Settings``' ``slo_ttft_s`` and ``slo_itl_s`` after the
    hardware defaults; ``PHI3V_SLO_*`` variables apply), so the goodput column scores both
    sides by what ours optimises."""
    from serve.settings import Settings

    s = Settings().resolved()
    return SloTargets(s.slo_ttft_s, s.slo_itl_s)


def segment(url: str, tokenizer_dir: Path, model: str, kind: str, concurrency: int,
            prompts: int, seed: int, log, slo: SloTargets | None = None) -> dict:
    """One W1 segment (:func:`bench.workloads.serving_benchmark`, goodput judged by ``slo``),
    with vLLM's engine-side mean TTFT over it (``engine_mean_ttft_ms``, from the server's
    ``/metrics`` before and after): the client's TTFT minus it is what the HTTP path in front
    of the engine adds."""
    before = w.engine_ttft_totals(url)
    result = w.serving_benchmark(url, tokenizer_dir, model, kind, concurrency, prompts, seed,
                                 log, slo)
    after = w.engine_ttft_totals(url)
    if after[1] > before[1]:
        result["engine_mean_ttft_ms"] = (after[0] - before[0]) / (after[1] - before[1]) * 1000
    return result


def added_ttft_ms(ours: dict, raw: dict) -> float | None:
    """What ours adds to the TTFT in front of vLLM's engine against raw vLLM in one W1 cell,
    ms: the median over its segment pairs of ``(client mean TTFT - vLLM's engine-side mean
    TTFT)`` of ours minus that of raw. Engine-side time (the part that the machine's drift
    between two segments moves most) cancels out. None where not measured."""
    pairs = [(a, b) for a, b in zip(ours.get("segments", []), raw.get("segments", []),
                                    strict=False)
             if "engine_mean_ttft_ms" in a and "engine_mean_ttft_ms" in b]
    if not pairs:
        return None
    return statistics.median((a["mean_ttft_ms"] - a["engine_mean_ttft_ms"])
                             - (b["mean_ttft_ms"] - b["engine_mean_ttft_ms"]) for a, b in pairs)


def goodput_ratio(ours: dict, raw: dict) -> float | None:
    """ours/raw goodput of one W1 cell (:func:`bench.workloads.pool_runs`'
    ``request_goodput``: requests per second meeting both SLO targets, pooled over the
    cell's segments; pooled, not paired, since a segment of a saturated cell may have no good
    request at all). None where either side was not measured or raw vLLM had none."""
    a, b = ours.get("request_goodput"), raw.get("request_goodput")
    return None if a is None or not b else a / b


def goodput_line(m: dict, summary: dict) -> str | None:
    """Per W1 cell, ours/raw goodput under the SLO the run judged it by (not a target of
    ``make bench``; what the admission limit trades the median TTFT for where it holds
    requests back). None where not measured."""
    cells = {k: v for k, v in summary.get("goodput_by_cell", {}).items() if v is not None}
    slo = m["ours"].get("w1_slo")
    if not cells or slo is None:
        return None
    return (f"goodput ours/raw (W1 requests/s with TTFT <= {slo['ttft_s']:g} s and TPOT <= "
            f"{slo['itl_s']:g} s; not a target) "
            + " ".join(f"{cell.replace(' c=', ':c=')}={x:.2f}" for cell, x in cells.items()))


def added_line(summary: dict) -> str | None:
    """The line of :func:`added_ttft_ms` per W1 cell (printed before the A/A control's)."""
    added = {k: v for k, v in summary.get("added_ttft_ms", {}).items() if v is not None}
    if not added:
        return None
    return ("ttft added ours-raw in front of vLLM's engine (client - engine-side mean, ms) "
            + " ".join(f"{k.replace(' ', ':')}={v:+.1f}" for k, v in added.items()))


def run_json(url: str) -> dict:
    import httpx

    return httpx.get(url, timeout=10).json()


def _ttfts(results: list[w.StreamResult]) -> list[float]:
    bad = [r for r in results if not r.ok]
    if bad:
        raise RuntimeError(f"{len(bad)} request(s) failed: {bad[0].status} {bad[0].error}")
    return [r.ttft_s for r in results]


def summarize(m: dict) -> dict:
    """The ratios of the last line, and the ours/raw ratio of each W1 cell
    (:func:`paired_ratio`)."""
    o, r = m["ours"], m["raw"]
    cells = [(kind, str(c)) for kind in W1_PLAN for c in W1_CONCURRENCIES]

    def cell_ratio(side: dict, key: str, cells: list) -> dict[str, float]:
        return {f"{k} c={c}": paired_ratio(side[k][c], r["w1"][k][c], key) for k, c in cells}

    ttft = cell_ratio(o["w1"], "median_ttft_ms", cells)
    thr = cell_ratio(o["w1"], "request_throughput", cells)
    aa = m.get("raw2", {}).get("w1", {})
    aa_cells = [(k, str(c)) for k, c in AA_CELLS if str(c) in aa.get(k, {})]
    aa_thr = cell_ratio(aa, "request_throughput", aa_cells)
    aa_ttft = cell_ratio(aa, "median_ttft_ms", aa_cells)
    med = statistics.median
    ratios = {
        "ttft_p50": max(ttft.values()),
        "throughput": min(thr.values()),
        "photo_ttft": med(o["w2_ttft_s"]) / med(r["w2_ttft_s"]),
        "multiturn_ttft": med(_flat(o["w3_ttft_s"])) / med(_flat(r["w3_ttft_s"])),
        "burst_makespan": statistics.median(
            a / b for a, b in zip(o["w4"]["makespans_s"], r["w4"]["makespans_s"], strict=False)),
        # The p99 of all repeats' token gaps, pooled (the repeats alternate the order of the
        # sides, so both sample the same spells of the machine). One repeat's p99 is its few
        # largest gaps, the stalls of its 3 photos' encodes: per-repeat p99s of 191/20/91/92 ms
        # (ours) against 65/119/92/23 (raw) made a median of paired ratios of 1.96 where the
        # pooled p99s were 92 and 92 ms (2026-12-02).
        "itl_p99": percentile(o["w5_itls_s"], 99) / percentile(r["w5_itls_s"], 99),
        "rss_peak": o["memory"]["peak_bytes"] / r["memory"]["peak_bytes"],
        "burst_non200": o["w4"]["non200"],
        "ours/sequential throughput@16": (o["w1"]["text"]["16"]["request_throughput"]
                                          / m["sequential"]["w1"]["text"]["16"]
                                          ["request_throughput"]),
    }
    noise = {"throughput": min(aa_thr.values()), "ttft_p50": max(aa_ttft.values())} \
        if aa_cells else None
    added = {f"{k} c={c}": added_ttft_ms(o["w1"][k][c], r["w1"][k][c]) for k, c in cells}
    good = {f"{k} c={c}": goodput_ratio(o["w1"][k][c], r["w1"][k][c]) for k, c in cells}
    return {"ratios": ratios, "ttft_by_cell": ttft, "throughput_by_cell": thr,
            "added_ttft_ms": added, "goodput_by_cell": good,
            "aa_throughput_by_cell": aa_thr, "aa_ttft_by_cell": aa_ttft, "noise": noise}


def paired_ratio(ours: dict, raw: dict, key: str) -> float:
    """ours/raw of one W1 cell: the median over its segments of the ratio of the two sides'
    runs of the same prompts, back to back (a slow spell of the machine then skews one pair,
    not the cell); the pooled ratio where segments are not recorded."""
    pairs = list(zip(ours.get("segments", []), raw.get("segments", []), strict=False))
    if not pairs:
        return ours[key] / raw[key]
    return statistics.median(a[key] / b[key] for a, b in pairs)


def _by_turn(conversations: list[list[float]]) -> list[tuple[float, ...]]:
    """Per-conversation TTFTs regrouped by turn (turn 1 of every conversation, then turn 2...);
    as many turns as the shortest conversation has."""
    return list(zip(*conversations, strict=False))


def _flat(conversations: list[list[float]]) -> list[float]:
    return [t for turns in conversations for t in turns]


def met(ratios: dict) -> dict[str, bool]:
    """Whether each target holds (``burst_non200`` must be 0)."""
    ok = {k: (ratios[k] >= lim if higher else ratios[k] <= lim)
          for k, (lim, higher) in TARGETS.items()}
    ok["burst_non200"] = ratios["burst_non200"] == 0
    return ok


def last_line(ratios: dict) -> str:
    """The one line ``make bench`` ends with."""
    r = ratios
    return ("ratios ours/raw " + " ".join(
        f"{k}={r[k]:.2f}" for k in ("ttft_p50", "throughput", "photo_ttft", "multiturn_ttft",
                                    "burst_makespan", "itl_p99", "rss_peak"))
        + f" burst_non200={r['burst_non200']} ours/sequential "
        f"throughput@16={r['ours/sequential throughput@16']:.2f}")


def noise_line(summary: dict) -> str | None:
    """The A/A control's line (printed just before :func:`last_line`): the worst raw2/raw
    ratios over :data:`AA_CELLS`, on the same rule as ours/raw. None without the control."""
    noise = summary.get("noise")
    if not noise:
        return None
    cells = ", ".join(f"c={c}" for _, c in AA_CELLS)
    return (f"noise A/A raw2/raw throughput={noise['throughput']:.2f} "
            f"ttft_p50={noise['ttft_p50']:.2f} (W1 text {cells})")


def table(m: dict, s: dict) -> str:
    """The markdown table of the run (also the README's benchmark table)."""
    o, r, q = m["ours"], m["raw"], s["ratios"]
    ok = met(q)
    med = statistics.median
    rows = []
    for kind in W1_PLAN:
        for c in W1_CONCURRENCIES:
            a, b, cell = o["w1"][kind][str(c)], r["w1"][kind][str(c)], f"{kind} c={c}"
            rows += [
                (f"W1 {cell}: requests/s", f"{b['request_throughput']:.2f}",
                 f"{a['request_throughput']:.2f}", s["throughput_by_cell"][cell]),
                (f"W1 {cell}: output tokens/s", f"{b['output_throughput']:.0f}",
                 f"{a['output_throughput']:.0f}",
                 a["output_throughput"] / b["output_throughput"]),
                (f"W1 {cell}: TTFT p50 / p99 (ms)",
                 f"{b['median_ttft_ms']:.0f} / {b['p99_ttft_ms']:.0f}",
                 f"{a['median_ttft_ms']:.0f} / {a['p99_ttft_ms']:.0f}", s["ttft_by_cell"][cell]),
                (f"W1 {cell}: ITL p50 / p99 (ms)",
                 f"{b['median_itl_ms']:.1f} / {b['p99_itl_ms']:.1f}",
                 f"{a['median_itl_ms']:.1f} / {a['p99_itl_ms']:.1f}",
                 a["p99_itl_ms"] / b["p99_itl_ms"])]
            good = s.get("goodput_by_cell", {}).get(cell)
            if "request_goodput" in a and "request_goodput" in b:
                rows.append((f"W1 {cell}: goodput, requests/s within the SLO (not a target)",
                             f"{b['request_goodput']:.2f}", f"{a['request_goodput']:.2f}",
                             good if good is not None else float("nan")))
    rows += [
        *[(f"A/A control, W1 {cell}: requests/s and TTFT p50 (ms), raw2 (a 2nd raw vLLM) "
           "in the ours column", f"{r['w1'][k][c]['request_throughput']:.2f}, "
           f"{r['w1'][k][c]['median_ttft_ms']:.0f}",
           f"{m['raw2']['w1'][k][c]['request_throughput']:.2f}, "
           f"{m['raw2']['w1'][k][c]['median_ttft_ms']:.0f}",
           s["aa_throughput_by_cell"][cell])
          for cell in s.get("aa_throughput_by_cell", {})
          for k, c in (cell.split(" c="),)],
        ("W2 12 MP photo: TTFT p50 (s)", f"{med(r['w2_ttft_s']):.3f}",
         f"{med(o['w2_ttft_s']):.3f}", q["photo_ttft"]),
        *[(f"W3 multi-turn, turn {k + 1} ({k + 1} photos): TTFT p50 (s)", f"{med(b):.3f}",
           f"{med(a):.3f}", med(a) / med(b))
          for k, (a, b) in enumerate(zip(_by_turn(o["w3_ttft_s"]), _by_turn(r["w3_ttft_s"]),
                                         strict=False))],
        ("W3 all turns: TTFT p50 (s)", f"{med(_flat(r['w3_ttft_s'])):.3f}",
         f"{med(_flat(o['w3_ttft_s'])):.3f}", q["multiturn_ttft"]),
        (f"W4 burst of {o['w4']['n']} at idle, {len(o['w4']['makespans_s'])} repeats: "
         "makespan (s, median), non-200",
         f"{r['w4']['makespan_s']:.2f}, {r['w4']['non200']}",
         f"{o['w4']['makespan_s']:.2f}, {o['w4']['non200']}", q["burst_makespan"]),
        (f"W5 ITL p99 of 4 streams while photos arrive, {W5_REPEATS} repeats pooled (ms)",
         f"{percentile(r['w5_itls_s'], 99) * 1000:.0f}",
         f"{percentile(o['w5_itls_s'], 99) * 1000:.0f}", q["itl_p99"]),
        ("W5 longest stall of those streams, max ITL (ms; not a target)",
         f"{max(r['w5_itls_s']) * 1000:.0f}", f"{max(o['w5_itls_s']) * 1000:.0f}",
         max(o["w5_itls_s"]) / max(r["w5_itls_s"])),
        ("Peak RSS of the server tree, photos 4 at a time (MiB)",
         f"{r['memory']['peak_bytes'] / 2**20:.0f}", f"{o['memory']['peak_bytes'] / 2**20:.0f}",
         q["rss_peak"]),
        *[(f"W1 {kind} c=16 requests/s: sequential (ours at limit 1) vs ours",
           f"{m['sequential']['w1'][kind]['16']['request_throughput']:.2f} (sequential)",
           f"{o['w1'][kind]['16']['request_throughput']:.2f}",
           o["w1"][kind]["16"]["request_throughput"]
           / m["sequential"]["w1"][kind]["16"]["request_throughput"]) for kind in W1_PLAN],
        # The engine's own batching gain on this machine, for reading the ours/sequential target.
        ("W1 text c=16 requests/s: sequential vs raw vLLM (not a target)",
         f"{r['w1']['text']['16']['request_throughput']:.2f}",
         f"{m['sequential']['w1']['text']['16']['request_throughput']:.2f} (sequential)",
         r["w1"]["text"]["16"]["request_throughput"]
         / m["sequential"]["w1"]["text"]["16"]["request_throughput"]),
    ]
    lines = ["| workload | raw vLLM | ours | ratio |", "|---|---|---|---|"]
    lines += [f"| {name} | {b} | {a} | {x:.2f} |" for name, b, a, x in rows]
    verdict = ", ".join(f"{k} {'met' if v else 'MISSED'}" for k, v in ok.items())
    noise = noise_line(s)
    footer = f"\n\nTargets: {verdict}.\n"
    if noise:
        footer += (f"\nA/A control (two identical raw vLLM servers, same rule as ours/raw): "
                   f"`{noise}`.\n")
    good = goodput_line(m, s)
    if good:
        footer += (f"\nGoodput (DistServe; vLLM's `--goodput`) under the targets our "
                   f"autotuner serves, the same for both sides: `{good}`.\n")
    added = added_line(s)
    if added:
        footer += (f"\nWhat ours adds in front of the engine (the TTFT ratio above also holds "
                   f"the engine's drift between segments; this difference does not): "
                   f"`{added}`.\n")
    return "\n".join(lines) + footer


#: What a ``--control`` run's artefacts say first: its ``ours`` side is not our stack.
CONTROL_NOTE = ("Control run (`make bench-control`): the 'ours' side is a second raw vLLM "
                "server, so every ratio is what two identical servers score.")


def plot(ratios: dict, path: Path, control: bool = False) -> bool:
    """``bench.png``: each ratio as a bar, its target as a tick (``control``: titled as the
    control run). False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    names = [k for k in TARGETS if k != "ours/sequential throughput@16"]
    ok = met(ratios)
    fig, ax = plt.subplots(figsize=(9, 4))
    ax.bar(names, [ratios[k] for k in names],
           color=["tab:green" if ok[k] else "tab:red" for k in names])
    ax.scatter(names, [TARGETS[k][0] for k in names], marker="_", s=900, color="black",
               label="target (throughput: at least; others: at most)", zorder=3)
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_ylabel("ours / raw vLLM")
    what = "control, raw vLLM against raw vLLM" if control else "our stack against raw vLLM"
    ax.set_title(f"make bench: {what} (ours/sequential at c=16: "
                 f"{ratios['ours/sequential throughput@16']:.1f}x)")
    ax.legend(loc="upper right")
    plt.setp(ax.get_xticklabels(), rotation=20, ha="right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def update_readme(md: str, readme: Path = ROOT / "README.md") -> bool:
    """Replace the README's table between the ``make-bench`` markers. False if absent."""
    text = readme.read_text()
    if README_BEGIN not in text or README_END not in text:
        return False
    head, rest = text.split(README_BEGIN, 1)
    _, tail = rest.split(README_END, 1)
    readme.write_text(f"{head}{README_BEGIN}\n{md}{README_END}{tail}")
    return True


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line of ``python -m bench.compare`` (module docstring); ``--control``
    implies ``--no-readme`` and, unless ``--out`` is given, ``bench/out/control``."""
    parser = argparse.ArgumentParser(prog="python -m bench.compare", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None,
                        help="where results go (default bench/results, with --control "
                        "bench/out/control)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-readme", action="store_true",
                        help="do not copy the table into README.md")
    parser.add_argument("--control", action="store_true",
                        help="whole-run A/A control: a second raw vLLM in ours' place, every "
                        "workload as in a normal run; its ratios are this machine's noise "
                        "floor for each target")
    args = parser.parse_args(argv)
    if args.out is None:
        args.out = ROOT / "bench" / ("out/control" if args.control else "results")
    args.no_readme = args.no_readme or args.control
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from serve.engine import apply_engine_env
    from serve.settings import Settings

    apply_engine_env(Settings())  # the benchmark client imports vLLM too
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    sides: dict[str, Side] = {}
    try:
        start_sides(args.out, sides, control=args.control)
        print("servers ready: " + ", ".join(
            f"{s.name} {s.server.ready_s:.0f} s" for s in sides.values()), flush=True)
        model = run_json(sides["ours"].server.base_url + "/v1/models")["data"][0]["id"]
        with open(args.out / "logs" / "vllm-bench.log", "w") as log:
            measurements = measure(sides, model, args.seed, log)
    finally:
        for side in sides.values():
            stop_process(side.server)
    summary = summarize(measurements)
    md = table(measurements, summary)
    if args.control:
        md = f"{CONTROL_NOTE}\n\n{md}"
    (args.out / "bench.json").write_text(json.dumps(
        {"control": args.control, "measurements": measurements, "summary": summary,
         "met": met(summary["ratios"]), "seconds": time.monotonic() - t0}, indent=1,
        default=str))
    (args.out / "bench.md").write_text(md)
    plotted = plot(summary["ratios"], args.out / "bench.png", control=args.control)
    print()
    print(md)
    if not args.no_readme and update_readme(md):
        print("README.md: benchmark table updated")
    print(f"wrote {args.out}/bench.json, bench.md" + (", bench.png" if plotted else "")
          + f" in {time.monotonic() - t0:.0f} s")
    good = goodput_line(measurements, summary)
    if good:
        print(good)
    added = added_line(summary)
    if added:
        print(added)
    noise = noise_line(summary)
    if noise:
        print(noise)
    if args.control:
        print(CONTROL_NOTE)
    print(last_line(summary["ratios"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
