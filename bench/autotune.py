"""Goodput of the live ``max_num_seqs`` autotuner against static limits.

``python -m bench.autotune [--out DIR] [--cpu-engine URL ...]``

**Simulator part** (always). The phase-changing trace of :func:`bench.trace.phase_trace`
(3 x 180 s) runs through :mod:`bench.sim` once with the autotuner (``auto``: the real
:class:`~serve.admission.controller.Controller` and
:class:`~serve.admission.autotuner.Autotuner`) and once per static limit L in
:data:`STATIC_LIMITS`. Controller, gateway and SLO constants are those a GPU server with
today's ``serve.settings`` runs (``PHI3V_*`` environment variables apply, as for
``python -m serve``). Goodput is DistServe's
(as ``serve.admission.middleware`` counts it): finished requests whose client-side TTFT (queue
wait included) and mean ITL meet the SLO, per second of trace. The *per-phase oracle* takes,
for each phase, the best static L's good requests among those that arrived in that phase (a
hindsight limit switched exactly at the phase boundaries). The part ends with one line::

    goodput auto/best_static=X.XX auto/oracle=Y.YY

and writes ``limit.png`` (auto's L over time, needs matplotlib) and ``results.json`` to
``--out``.

**CPU engine part** (``--cpu-engine URL``, repeatable). Replays the small
:func:`bench.trace.cpu_trace` (~2.5 min) against each running OpenAI-compatible server, with
streamed requests (:func:`replay_http`), and prints the same table, one row per server,
labelled by the mode and limit that server reports on ``/admin/autotuner``. Comparing ``auto``
with a static L means one server per configuration, e.g. ``python -m serve --port 8001`` and
``python -m serve --port 8002 --autotune static --admission-limit 8``, replayed one after the
other (they share the CPU cores).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from serve.admission.middleware import SloTargets
from serve.settings import Settings

from bench.sim import RequestResult, RunResult, Setup, simulate
from bench.trace import Trace, TraceRequest, cpu_trace, phase_trace

#: Static limits compared with ``auto`` (requests): powers of two up to the GPU ceiling.
STATIC_LIMITS = (1, 2, 4, 8, 16, 32, 64, 128, 256)

# The shipped autotuner defaults (10 s latency window, 0.85 decrease, auto starting at
# ceiling // 8) came out of this benchmark: with a 20 s window, overload samples outlived the
# decrease they caused and the controller kept cutting on stale p90s (windup down to L=1); with
# a 0.75 decrease and a start at 8 the first ramp shed requests. On the phase trace, seeds 0-5:
# auto/best static 0.95-1.02 (mean 0.99) -> 1.01-1.06 (mean 1.04); auto/oracle 0.90-0.95 ->
# 0.97-0.99.


def gpu_setup() -> Setup:
    """What a GPU server with the current ``serve.settings`` runs."""
    return Setup.from_settings(Settings(device="cuda"))


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile ``q`` (0-100) of ``values``, None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(1, math.ceil(q / 100 * len(ordered))) - 1]


@dataclass
class Summary:
    """Goodput and latency of one run (a simulation or an HTTP replay).

    Attributes:
        label: ``auto`` or ``L=<n>``.
        goodput_per_s: good requests per second of trace.
        good: requests that met both targets.
        total: requests in the trace.
        dropped: requests refused (HTTP 429 or another error).
        ttft_p90_s: p90 client-side TTFT of the requests that got a first token, seconds.
        itl_p90_s: p90 over finished requests of their mean ITL, seconds.
        preemptions: engine preemptions (None where unknown, e.g. over HTTP).
        good_by_phase: good requests by phase of arrival.
    """

    label: str
    goodput_per_s: float
    good: int
    total: int
    dropped: int
    ttft_p90_s: float | None
    itl_p90_s: float | None
    preemptions: int | None
    good_by_phase: dict[str, int] = field(default_factory=dict)


def summarize(label: str, results: list[RequestResult], trace: Trace, slo: SloTargets,
              preemptions: int | None = None) -> Summary:
    """Summary of per-request outcomes against ``slo`` over ``trace``'s duration."""
    good_by_phase = {p.name: 0 for p in trace.phases}
    for r in results:
        if r.good(slo):
            good_by_phase[r.request.phase] += 1
    good = sum(good_by_phase.values())
    return Summary(
        label=label, goodput_per_s=good / trace.duration_s, good=good, total=len(results),
        dropped=sum(r.dropped is not None for r in results),
        ttft_p90_s=percentile([r.ttft_s for r in results if r.ttft_s is not None], 90),
        itl_p90_s=percentile([r.mean_itl_s for r in results if r.mean_itl_s is not None], 90),
        preemptions=preemptions, good_by_phase=good_by_phase)


def oracle(statics: list[Summary], trace: Trace) -> tuple[float, dict[str, str]]:
    """Per-phase oracle: goodput (req/s) of the best static limit in each phase, and which."""
    best = {p.name: max(statics, key=lambda s: s.good_by_phase[p.name]) for p in trace.phases}
    good = sum(best[name].good_by_phase[name] for name in best)
    return good / trace.duration_s, {name: s.label for name, s in best.items()}


def format_table(rows: list[Summary]) -> str:
    """The benchmark table: one line per configuration."""
    def sec(v: float | None) -> str:
        return "-" if v is None else f"{v:.2f}"

    phases = list(rows[0].good_by_phase)
    lines = [f"{'L':>6} {'goodput/s':>9} {'good/total':>11} {'p90 TTFT s':>10} "
             f"{'p90 ITL s':>9} {'preempt':>7} {'dropped':>7}  good by phase: "
             + " ".join(f"{p:>9}" for p in phases)]
    for s in rows:
        lines.append(
            f"{s.label.removeprefix('L='):>6} {s.goodput_per_s:9.2f} {f'{s.good}/{s.total}':>11} "
            f"{sec(s.ttft_p90_s):>10} {sec(s.itl_p90_s):>9} "
            f"{'-' if s.preemptions is None else s.preemptions:>7} {s.dropped:>7}  "
            + " " * 15 + " ".join(f"{s.good_by_phase[p]:>9}" for p in phases))
    lines.append("(p90 TTFT: client-side, queue wait included, of requests that got a token; "
                 "p90 ITL: of each finished request's mean ITL; dropped: 429s)")
    return "\n".join(lines)


# --- simulator backend --------------------------------------------------------------------
def run_sim(trace: Trace, setup: Setup,
            limits: tuple[int, ...] = STATIC_LIMITS) -> tuple[RunResult, list[RunResult]]:
    """Simulate ``auto`` and every static limit on ``trace``: ``(auto, statics)``."""
    auto = simulate(trace, "auto", None, setup)
    return auto, [simulate(trace, "static", limit, setup) for limit in limits]


@dataclass
class SimReport:
    """The simulator part's numbers (see the module docstring)."""

    rows: list[Summary]
    best_static: Summary
    oracle_goodput_per_s: float
    oracle_limits: dict[str, str]
    auto: RunResult

    @property
    def vs_best_static(self) -> float:
        return self.rows[0].goodput_per_s / self.best_static.goodput_per_s

    @property
    def vs_oracle(self) -> float:
        return self.rows[0].goodput_per_s / self.oracle_goodput_per_s


def sim_report(trace: Trace, setup: Setup) -> SimReport:
    """Run the simulator part on ``trace`` and compare ``auto`` with the statics."""
    auto, statics = run_sim(trace, setup)
    rows = [summarize(r.label, r.requests, trace, setup.slo, r.preemptions)
            for r in [auto, *statics]]
    oracle_goodput, oracle_limits = oracle(rows[1:], trace)
    return SimReport(rows, max(rows[1:], key=lambda s: s.goodput_per_s), oracle_goodput,
                     oracle_limits, auto)


def plot_limit(run: RunResult, trace: Trace, path: Path, oracle_limits: dict[str, str]) -> bool:
    """PNG of auto's limit over time, phases shaded, each phase's best static L dashed.

    Returns False (and writes nothing) where matplotlib is not installed.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(10, 4))
    t, limits = zip(*run.limits)
    ax.step(t, limits, where="post", label="auto: limit L")
    start = 0.0
    for i, phase in enumerate(trace.phases):
        end = start + phase.duration_s
        ax.axvspan(start, end, alpha=0.06 * (1 + i % 2), color="grey")
        ax.hlines(int(oracle_limits[phase.name].removeprefix("L=")), start, end,
                  linestyles="dashed", colors="C1",
                  label="best static L of the phase" if i == 0 else None)
        ax.text(start + 3, 0.97, phase.name, transform=ax.get_xaxis_transform(), va="top")
        start = end
    ax.set_yscale("log", base=2)
    ax.set_xlabel("time, s")
    ax.set_ylabel("admission limit L (requests)")
    ax.set_title("Autotuned max_num_seqs on the simulated phase trace")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def sim_benchmark(out: Path, seed: int = 0) -> SimReport:
    """The simulator part: prints the table and the final line, writes the plot and JSON."""
    trace, setup = phase_trace(seed), gpu_setup()
    t0 = time.perf_counter()
    report = sim_report(trace, setup)
    elapsed = time.perf_counter() - t0
    c = setup.controller
    print(f"simulator: {len(trace.requests)} requests over {trace.duration_s:.0f} s (seed "
          f"{seed}; {', '.join(f'{p.name} {p.rate_per_s:g}/s' for p in trace.phases)}, bursts "
          f"2-4x); SLO TTFT {setup.slo.ttft_s:g} s, ITL {setup.slo.itl_s:g} s; controller "
          f"settings: start {setup.start_limit}, window "
          f"{setup.window_s:g} s, interval {setup.interval_s:g} s, decrease "
          f"{c.decrease_factor:g}, headroom {c.headroom:g}, cooldown {c.cooldown_s:g} s; "
          f"{len(report.rows)} runs in {elapsed:.1f} s")
    print(format_table(report.rows))
    print(f"best static: {report.best_static.label} ({report.best_static.goodput_per_s:.2f}/s);"
          f" per-phase oracle {report.oracle_goodput_per_s:.2f}/s with "
          + ", ".join(f"{k} {v}" for k, v in report.oracle_limits.items()))
    out.mkdir(parents=True, exist_ok=True)
    if plot_limit(report.auto, trace, out / "limit.png", report.oracle_limits):
        print(f"plot: {out / 'limit.png'}")
    else:
        print("plot: skipped (matplotlib is not installed: pip install matplotlib==3.11.2)")
    (out / "results.json").write_text(json.dumps({
        "seed": seed, "duration_s": trace.duration_s, "setup": asdict(setup),
        "runs": [asdict(s) for s in report.rows],
        "oracle": {"goodput_per_s": report.oracle_goodput_per_s,
                   "limits": report.oracle_limits},
        "auto_limits": report.auto.limits}, indent=1))
    print(f"goodput auto/best_static={report.vs_best_static:.2f} "
          f"auto/oracle={report.vs_oracle:.2f}")
    return report


# --- HTTP backend (a real engine behind the real gateway) ---------------------------------
def _png(size: int = 336) -> bytes:
    """A plain ``size`` x ``size`` PNG (one 336-px crop: 313 image tokens at num_crops 1)."""
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (size, size), (120, 160, 200)).save(buf, format="PNG")
    return buf.getvalue()


def chat_body(req: TraceRequest, model: str, image_url: str) -> dict:
    """A streamed chat request for ``req``: its images, ~its text tokens, exactly its output
    length (``ignore_eos``, vLLM's extension)."""
    text_tokens = max(1, req.prompt_tokens - req.image_tokens)
    content = [{"type": "image_url", "image_url": {"url": image_url}}
               for _ in range(req.images)]
    content.append({"type": "text", "text": " ".join(["word"] * text_tokens)})
    return {"model": model, "stream": True, "stream_options": {"include_usage": True},
            "max_tokens": req.output_tokens, "ignore_eos": True,
            "messages": [{"role": "user", "content": content}]}


async def _replay_one(client, req: TraceRequest, model: str, image_url: str,
                      start: float) -> RequestResult:
    await asyncio.sleep(max(0.0, start + req.arrival_s - time.monotonic()))
    result = RequestResult(req)
    try:
        async with client.stream("POST", "/v1/chat/completions",
                                 json=chat_body(req, model, image_url)) as resp:
            if resp.status_code != 200:
                result.dropped = resp.headers.get("X-Phi3v-Reject-Reason",
                                                  f"http_{resp.status_code}")
                result.dropped_s = time.monotonic() - start
                return result
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                choices = chunk.get("choices") or []
                content = choices[0].get("delta", {}).get("content") if choices else None
                if content is not None:  # the first one is the role chunk, sent with token 1
                    now = time.monotonic() - start
                    if result.first_token_s is None:
                        result.first_token_s = now
                    result.tokens += bool(content)
                    result.finish_s = now
                if chunk.get("usage"):
                    result.tokens = chunk["usage"]["completion_tokens"]
    except Exception as exc:  # noqa: BLE001 - any transport failure is a lost request
        result.dropped = f"error:{type(exc).__name__}"
        result.dropped_s = time.monotonic() - start
        result.finish_s = None
    return result


async def replay_http(trace: Trace, base_url: str, model: str | None = None,
                      poll_s: float = 1.0, timeout_s: float = 600.0
                      ) -> tuple[str, list[RequestResult], list[tuple[float, int]], SloTargets]:
    """Replay ``trace`` in real time against an OpenAI-compatible streaming server.

    Each request is sent at its arrival time (``httpx``, one connection per request) with
    ``max_tokens`` = its output length and ``ignore_eos``. TTFT and mean ITL come from the
    times of the first and last streamed chunks (one per engine step, as the middleware
    measures them), the token count from ``usage``. ``/admin/autotuner`` is polled every
    ``poll_s``.

    Returns:
        ``(label, results, limits, slo)``: ``auto`` or ``L=<n>`` from the server's mode;
        per-request outcomes on the trace clock (seconds; no admission time over HTTP); the
        server's limit over time; the server's SLO targets (for goodput).
    """
    import httpx

    limits_http = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout_s,
                                 limits=limits_http) as client:
        state = (await client.get("/admin/autotuner")).json()
        if model is None:
            model = (await client.get("/v1/models")).json()["data"][0]["id"]
        config = state["config"]
        slo = SloTargets(config["ttft_target_s"], config["itl_target_s"])
        label = "auto" if state["mode"] == "auto" else f"L={state['limit']}"
        image_url = "data:image/png;base64," + base64.b64encode(_png()).decode()
        start = time.monotonic()
        limits: list[tuple[float, int]] = []

        async def poll() -> None:
            while True:
                try:
                    limit = (await client.get("/admin/autotuner")).json()["limit"]
                    limits.append((time.monotonic() - start, limit))
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(poll_s)

        poller = asyncio.create_task(poll())
        try:
            results = await asyncio.gather(*(_replay_one(client, r, model, image_url, start)
                                              for r in trace.requests))
        finally:
            poller.cancel()
    return label, list(results), limits, slo


def cpu_engine_benchmark(urls: list[str], seed: int = 0) -> list[Summary]:
    """The CPU engine part: replay :func:`bench.trace.cpu_trace` against each server in turn
    and print one table row per server (see the module docstring)."""
    trace = cpu_trace(seed)
    rows = []
    for url in urls:
        print(f"cpu engine: replaying {len(trace.requests)} requests "
              f"({trace.duration_s:.0f} s) against {url} ...", flush=True)
        label, results, limits, slo = asyncio.run(replay_http(trace, url))
        rows.append(summarize(label, results, trace, slo))
        print(f"  {label}: limit {min(l for _, l in limits) if limits else '?'}.."
              f"{max(l for _, l in limits) if limits else '?'}, SLO TTFT {slo.ttft_s:g} s, "
              f"ITL {slo.itl_s:g} s", flush=True)
    print(format_table(rows))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.autotune", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("bench/out"),
                        help="directory for limit.png and results.json (default: bench/out)")
    parser.add_argument("--seed", type=int, default=0, help="trace seed (default 0)")
    parser.add_argument("--cpu-engine", metavar="URL", action="append", default=[],
                        help="also replay the small CPU trace against this server (repeatable)")
    args = parser.parse_args(argv)
    sim_benchmark(args.out, args.seed)
    if args.cpu_engine:
        cpu_engine_benchmark(args.cpu_engine, args.seed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
