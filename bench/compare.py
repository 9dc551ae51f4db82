"""``make bench``: ours against raw vLLM, with a second raw vLLM as the A/A control, in
interleaved blocks that end in one verdict.

``python -m bench.compare [--blocks 9] [--seed 0] [--out bench/out] [--ledger
bench/results/ledger.jsonl] [--md bench/results/bench.md]``

The method (``bench/README.md``; Kalibera & Jones, "Rigorous benchmarking in reasonable time",
ISMM 2013): three **arms** stay up for the whole half of a run, started with one environment
(the engine's variables of :meth:`serve.settings.Settings.engine_env`, ``PYTHONHASHSEED=0``)
on the engine arguments of one ``Settings`` (``PHI3V_*`` variables apply to all three):

- **ours**: ``python -m serve``;
- **raw**: vLLM's own OpenAI server with :func:`serve.engine.vllm_cli_args`;
- **raw2**: a second raw vLLM, identical to the first: the A/A control. Its ratio to raw is
  what two identical servers differ by on this machine, that day: when its interval leaves
  its band the run is **unresolved** and says so.

Each **block** runs every gated cell (:data:`GATED`) once per arm, the arms of each cell in a
balanced random order (:func:`bench.stats.balanced_orders`), the cells in a random order, the
segments back to back; every arm of a (block, cell) gets byte-identical requests, distinct from
every other block's. All three arms are stopped and started again between the two halves of
the run, so that an instance sitting a few per cent off its twin shows as noise between
blocks, not as a verdict. A cell whose segment ran while the machine was busy elsewhere
(:data:`MAX_STEAL`, :data:`MAX_FOREIGN_CPU`) is run again at the end, at most
:data:`MAX_RERUNS` times. Each segment is appended to the ledger as it ends
(:mod:`bench.verdict` reads it); when more blocks could settle the verdict (it is
**inconclusive**, or unresolved only by A/A intervals whose estimate lies inside the band:
:attr:`bench.verdict.Verdict.wants_more_blocks`) the run adds :data:`EXTENSION_BLOCKS`
blocks, at most :data:`MAX_EXTENSIONS` times, then judges.

Per segment: requests/s, output tokens/s, TTFT p50 and mean (client side), vLLM's engine-side
mean TTFT (``/metrics``: the difference is what the HTTP path in front of the engine adds),
CPU milliseconds per request of the server's API process (the server's own process: vLLM
runs its engine core in a child process, ``VLLM::EngineCore``) and of its engine (the
children, reported only), and the machine's steal time and other processes' CPU
(``/proc/stat`` against the CPU of the servers and this client).

Reported, not gated (one segment per half, ours and raw, in the run record): text c=1,
image c=1 and c=4, W5 (ITL of running streams while photos arrive), and with ``--full``
image c=64. Peak RSS of each arm's process tree is sampled over the whole run.

GPU run (``bench/gpu.sh``): ``--extra-arm raw4`` adds a fourth arm to every block, raw vLLM
with ``--api-server-count 4`` (:data:`EXTRA_ARMS`: vLLM's own answer to its one multimodal
thread per API process), and ``--photo-throughput C`` a cell ``photos`` (:data:`PHOTOS_CELL`):
``2 C`` distinct 12 MP photos, ``C`` in flight, scored in requests/s.

Output: the ledger (``bench/results/ledger.jsonl``, committed history), the verdict table
(``bench/results/bench.md``), ``OUT/bench.json`` and the server logs (``OUT/logs``, not
committed), and as last line :func:`bench.verdict.verdict_line`'s ``verdict valid=...
result=...`` over every run of this commit in the ledger. Progress goes to stderr
(:mod:`bench.progress`): the block running, segments done of the total and an ETA.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import secrets
import signal
import sys
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from bench import workloads as w
from bench.cpu_engine import IMAGES_DIR, real_photos
from bench.process import (
    ROOT,
    ManagedServer,
    ensure_tiny_model,
    free_port,
    git_state,
    start_process,
    start_serve,
    stop_process,
)
from bench.progress import bar as progress_bar
from bench.progress import say
from serve.admission.engine_stats import percentile

ARMS = ("ours", "raw", "raw2")
#: Arms ``--extra-arm`` may add: raw vLLM with this many API processes (one engine).
EXTRA_ARMS = {"raw4": 4}
#: The cell ``--photo-throughput`` adds: distinct phone photos at a concurrency, requests/s.
PHOTOS_CELL = "photos"


@dataclass(frozen=True)
class W1Cell:
    """A cell of vLLM's serving benchmark (:func:`bench.workloads.serving_benchmark`):
    ``kind`` text or image (:data:`bench.workloads.W1_KINDS`), ``concurrency`` requests in
    flight, ``prompts`` per segment (at least two waves where the time allows: a single wave
    is mostly ramp-up and tail)."""

    kind: str
    concurrency: int
    prompts: int


#: The gated cells of issue 31 and what one segment of each runs. W1 cells: ~2-6 s per
#: segment on this CPU; ``photo`` (W2) one distinct 12 MP photo; ``history`` (W3) a 4-turn
#: chat that re-sends its 12 MP photos; ``burst`` (W4) ``max_num_seqs`` text chats at once at
#: an idle server (text, so that the burst takes seconds: a burst of image chats is ~13 s
#: per arm here, most of a block).
GATED: dict[str, W1Cell | str] = {
    "text4": W1Cell("text", 4, 16), "text16": W1Cell("text", 16, 32),
    "text64": W1Cell("text", 64, 128), "image16": W1Cell("image", 16, 16),
    "photo": "photo", "history": "history", "burst": "burst"}
#: Reported, not gated: W1 cells run once per half for ours and raw.
REPORTED = {"text1": W1Cell("text", 1, 8), "image1": W1Cell("image", 1, 4),
            "image4": W1Cell("image", 4, 8)}
#: Only with ``--full``: ~25 s per arm here.
REPORTED_FULL = {"image64": W1Cell("image", 64, 64)}
HISTORY_TURNS = 4
#: Answer lengths (tokens) of the photo, history and burst cells.
PHOTO_TOKENS, HISTORY_TOKENS, BURST_TOKENS = 8, 16, 32
#: A segment is run again when, over it, steal time exceeded this share of the machine's CPU
#: time (the hypervisor gave the cores to another guest) ...
MAX_STEAL = 0.05
#: ... or processes other than the three servers and this client used more than this share
#: of it (another job on the machine).
MAX_FOREIGN_CPU = 0.10
#: Times a flagged (block, cell) row is run again, at the end (issue 31: at most twice).
MAX_RERUNS = 2
#: Blocks added when more blocks could settle the verdict, and how many times (issue 31: 4,
#: twice).
EXTENSION_BLOCKS, MAX_EXTENSIONS = 4, 2
DEFAULT_LEDGER = ROOT / "bench" / "results" / "ledger.jsonl"


# --- the arms ------------------------------------------------------------------------------
def arm_env() -> dict[str, str]:
    """The environment every arm starts with: the engine's variables
    (:meth:`Settings.engine_env`) and a fixed hash seed (dict and set orders, hence some
    allocation patterns, then do not differ between two starts)."""
    from serve.settings import Settings

    return {**Settings().engine_env(), "PYTHONHASHSEED": "0"}


def start_arm(name: str, out: Path, model: Path) -> ManagedServer:
    """Start one arm (module docstring), log in ``out/logs/NAME-<time>.log``."""
    log = out / "logs" / f"{name}-{time.strftime('%H%M%S')}.log"
    if name == "ours":
        return start_serve([], log, model_dir=model, env=arm_env())
    from serve.engine import vllm_cli_args
    from serve.settings import Settings

    port = free_port()
    settings = Settings(model=str(model), port=port)
    if name in EXTRA_ARMS:
        # Only `vllm serve` (its CLI module) starts several API processes; the api_server
        # module ignores --api-server-count.
        cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve",
               *vllm_cli_args(settings), "--api-server-count", str(EXTRA_ARMS[name])]
    else:
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
               *vllm_cli_args(settings)]
    return start_process(cmd, port, log, "/v1/models", env=arm_env())


def start_arms(out: Path, model: Path, names: tuple[str, ...] = ARMS) -> dict[str, ManagedServer]:
    """Start the arms ``names`` at once (start-up is not measured) and wait for all.

    Raises:
        RuntimeError, TimeoutError: an arm did not come up (the others are stopped).
    """
    with ThreadPoolExecutor(len(names)) as pool:
        futures = {name: pool.submit(start_arm, name, out, model) for name in names}
    arms, errors = {}, []
    for name, future in futures.items():
        try:
            arms[name] = future.result()
        except (RuntimeError, TimeoutError) as exc:
            errors.append(f"{name}: {exc}")
    if errors:
        stop_arms(arms)
        raise RuntimeError("; ".join(errors))
    return arms


def stop_arms(arms: dict[str, ManagedServer]) -> None:
    for server in arms.values():
        stop_process(server)


def model_dir() -> Path:
    """The model every arm serves: ``Settings().model`` (``PHI3V_MODEL``), the tiny model by
    default (built if missing)."""
    from serve.settings import DEFAULT_TINY_MODEL_DIR, Settings

    model = Settings().model
    if model == DEFAULT_TINY_MODEL_DIR:
        return ensure_tiny_model()
    return (ROOT / model).resolve()


# --- CPU accounting from /proc ---------------------------------------------------------------
CLOCK_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of one process (all its threads), 0 when it is gone
    (``/proc/PID/stat`` fields 14 and 15, proc(5))."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) * CLOCK_TICK_S


def arm_cpu_s(server: ManagedServer) -> tuple[float, float]:
    """``(API process, engine)`` CPU seconds of an arm: the server's own process, and the sum
    of its descendants (vLLM's engine core process and its helpers)."""
    import psutil

    api = process_cpu_s(server.proc.pid)
    engine = 0.0
    try:
        children = psutil.Process(server.proc.pid).children(recursive=True)
    except psutil.Error:
        children = []
    for child in children:
        engine += process_cpu_s(child.pid)
    return api, engine


def machine_cpu_s() -> tuple[float, float, float]:
    """``(busy, steal, total)`` CPU seconds of the whole machine since boot, all cores
    (``/proc/stat`` ``cpu`` line: user nice system idle iowait irq softirq steal, proc(5);
    guest time is already inside user)."""
    with open("/proc/stat") as f:
        values = [int(v) for v in f.readline().split()[1:9]]
    user, nice, system, idle, iowait, irq, softirq, steal = values
    busy = user + nice + system + irq + softirq
    return (busy * CLOCK_TICK_S, steal * CLOCK_TICK_S,
            (busy + idle + iowait + steal) * CLOCK_TICK_S)


class Meter:
    """CPU over one segment: the measured arm's API and engine CPU seconds, and the machine's
    steal and foreign shares (CPU not used by the arms or this client, over the machine's
    total)."""

    def __init__(self, arms: dict[str, ManagedServer], arm: str) -> None:
        self.arms, self.arm = arms, arm

    def _ours(self) -> float:
        """CPU seconds of every arm's tree and of this client process."""
        return sum(sum(arm_cpu_s(s)) for s in self.arms.values()) + sum(os.times()[:2])

    def __enter__(self) -> Meter:
        self.t0 = arm_cpu_s(self.arms[self.arm])
        self.m0 = machine_cpu_s()
        self.o0 = self._ours()
        return self

    def __exit__(self, *exc) -> None:
        api, engine = arm_cpu_s(self.arms[self.arm])
        busy, steal, total = machine_cpu_s()
        ours = self._ours()
        span = max(total - self.m0[2], 1e-9)
        self.api_s, self.engine_s = api - self.t0[0], engine - self.t0[1]
        self.steal = (steal - self.m0[1]) / span
        self.foreign = max(0.0, (busy - self.m0[0]) - (ours - self.o0)) / span

    @property
    def flagged(self) -> bool:
        return self.steal > MAX_STEAL or self.foreign > MAX_FOREIGN_CPU


class PeakRss:
    """Peak RSS of each arm's process tree (MiB), sampled every ``period_s`` on a thread
    (:class:`bench.workloads.RssSampler` per arm)."""

    def __init__(self, period_s: float = 0.1) -> None:
        self.period_s = period_s
        self.peak_mib: dict[str, float] = {}
        self._arms: dict[str, ManagedServer] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def watch(self, arms: dict[str, ManagedServer]) -> None:
        self._arms = arms
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            for name, server in list(self._arms.items()):
                mib = w.RssSampler(server.proc.pid).tree_rss() / 2**20
                self.peak_mib[name] = max(self.peak_mib.get(name, 0.0), mib)
            self._stop.wait(self.period_s)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


# --- one segment ---------------------------------------------------------------------------
@dataclass
class Inputs:
    """What the cells send, made once per run before any timing: the model's served name,
    its directory (vLLM's benchmark loads its tokenizer), real photos as sources, the engine's
    ``max_num_seqs`` (W4's burst size) and a cache of 12 MP photos by seed."""

    model: str
    model_dir: Path
    sources: list[Path]
    burst_size: int
    log: object
    photos: dict[int, str]

    def photo(self, seed: int) -> str:
        if seed not in self.photos:
            self.photos[seed] = w.photo_urls(self.sources, 1, seed)[0]
        return self.photos[seed]

    def prepare(self, seeds: list[int]) -> None:
        """Build the photos of ``seeds`` now (two threads), outside any segment."""
        missing = [s for s in seeds if s not in self.photos]
        with ThreadPoolExecutor(2) as pool:
            for seed, url in zip(missing, pool.map(
                    lambda s: w.photo_urls(self.sources, 1, s)[0], missing), strict=True):
                self.photos[seed] = url


def cell_seed(seed: int, block: int, cell: str) -> int:
    """The seed of a (block, cell)'s requests: the same for every arm, distinct per block."""
    return seed * 1_000_003 + block * 1009 + zlib.crc32(cell.encode()) % 1009


def photo_seeds(seed: int, block: int) -> list[int]:
    """Seeds of the photos a block sends: W2's one, then W3's turns."""
    base = cell_seed(seed, block, "photo") * 10
    return [base + k for k in range(1 + HISTORY_TURNS)]


def photos_cell_seeds(seed: int, block: int, concurrency: int) -> list[int]:
    """Seeds of the ``2 x concurrency`` photos of a block's :data:`PHOTOS_CELL` (two waves)."""
    base = cell_seed(seed, block, PHOTOS_CELL) * 1000
    return [base + k for k in range(2 * concurrency)]


def run_w1(url: str, spec: W1Cell, seed: int, inputs: Inputs,
           meter: contextlib.AbstractContextManager | None = None) -> dict:
    """One W1 segment; metrics in the ledger's names (:mod:`bench.verdict`). ``meter`` spans
    the requests only: the two ``/metrics`` scrapes around them (vLLM's engine-side TTFT)
    cost the API process milliseconds each, which are no request's."""
    before = w.engine_ttft_totals(url)
    with meter or contextlib.nullcontext():
        r = w.serving_benchmark(url, inputs.model_dir, inputs.model, spec.kind,
                                spec.concurrency, spec.prompts, seed, inputs.log, warmups=0)
    after = w.engine_ttft_totals(url)
    engine = ((after[0] - before[0]) / (after[1] - before[1]) * 1000
              if after[1] > before[1] else None)
    return {"rps": r["request_throughput"], "tok_s": r["output_throughput"],
            "ttft_p50_ms": r["median_ttft_ms"], "ttft_mean_ms": r["mean_ttft_ms"],
            "engine_ttft_mean_ms": engine, "completed": r["completed"], "failed": r["failed"]}


def _ok_ttfts_ms(results: list[w.StreamResult]) -> list[float]:
    bad = [r for r in results if not r.ok]
    if bad:
        raise RuntimeError(f"{len(bad)} request(s) failed: {bad[0].status} {bad[0].error}")
    return [r.ttft_s * 1000 for r in results]


def run_cell(url: str, cell: str, spec: W1Cell | str, block_seed: int, photos: list[str],
             inputs: Inputs,
             meter: contextlib.AbstractContextManager | None = None) -> dict:
    """One segment of ``cell`` against the server at ``url``, its requests inside ``meter``.
    Returns its metrics.

    Raises:
        RuntimeError: a photo or history request failed (a W1 or burst failure is counted).
    """
    if isinstance(spec, W1Cell):
        return run_w1(url, spec, block_seed, inputs, meter)
    with meter or contextlib.nullcontext():
        return _run_requests(url, spec, block_seed, photos, inputs)


def _run_requests(url: str, spec: str, block_seed: int, photos: list[str],
                  inputs: Inputs) -> dict:
    """The requests of a cell that is not W1 (:func:`run_cell`)."""
    if spec == "photo":
        (ttft,) = _ok_ttfts_ms(asyncio.run(w.photo_ttft(url, inputs.model, photos[:1])))
        return {"ttft_ms": ttft, "completed": 1}
    if spec == PHOTOS_CELL:  # `photos` are photos_cell_seeds': two waves in flight
        t0 = time.perf_counter()
        results = asyncio.run(w.photos_concurrently(url, inputs.model, photos,
                                                    len(photos) // 2))
        makespan = time.perf_counter() - t0
        return {"rps": len(results) / makespan,
                "ttft_p50_ms": percentile(_ok_ttfts_ms(results), 50), "completed": len(results)}
    if spec == "history":
        (turns,) = asyncio.run(w.multiturn(url, inputs.model, [photos[1:]], HISTORY_TOKENS))
        ttfts = _ok_ttfts_ms(turns)
        return {"ttft_late_ms": sum(ttfts[2:]) / len(ttfts[2:]), "ttft_turns_ms": ttfts,
                "completed": len(turns)}
    bodies = [w.chat_body(inputs.model, [{"role": "user", "content": f"Write story {block_seed}"
                                          f"-{i} about a lighthouse."}],
                          BURST_TOKENS, ignore_eos=True) for i in range(inputs.burst_size)]
    results, makespan = asyncio.run(w.burst(url, bodies))
    return {"makespan_s": makespan, "non200": sum(not r.ok for r in results),
            "n": len(bodies), "completed": sum(r.ok for r in results)}


# --- blocks --------------------------------------------------------------------------------
@dataclass
class Run:
    """One ``make bench`` run: its identity in the ledger and where records go."""

    run_id: str
    commit: str
    dirty: bool
    ledger: Path
    seed: int
    #: The arms of every block, and the concurrency of the photos cell (0: no photos cell).
    arms: tuple[str, ...] = ARMS
    photo_throughput: int = 0

    @property
    def cells(self) -> tuple[str, ...]:
        """The cells of every block."""
        return (*GATED, *((PHOTOS_CELL,) if self.photo_throughput else ()))

    def record(self, **fields) -> dict:
        rec = {"schema": 1, "run": self.run_id, "commit": self.commit, "dirty": self.dirty,
               **fields, "t": time.time()}
        self.ledger.parent.mkdir(parents=True, exist_ok=True)
        with open(self.ledger, "a") as f:
            f.write(json.dumps(rec) + "\n")
        return rec


def run_row(run: Run, arms: dict[str, ManagedServer], half: int, block: int, cell: str,
            order: tuple[str, ...], inputs: Inputs, rerun: int = 0, bar=None) -> bool:
    """Every arm's segment of one (block, cell), in ``order``, back to back, each appended to
    the ledger. Returns True when a segment was flagged (the row is to run again). ``bar``
    (:func:`bench.progress.bar`, optional) counts the segments."""
    spec = GATED.get(cell, cell)
    seed = cell_seed(run.seed, block, cell)
    photos = [inputs.photo(s) for s in (
        photos_cell_seeds(run.seed, block, run.photo_throughput) if cell == PHOTOS_CELL
        else photo_seeds(run.seed, block))]
    flagged = False
    for position, arm in enumerate(order):
        if bar is not None:
            bar.set_postfix_str(f"{cell} {arm}" + (f" (again, {rerun})" if rerun else ""))
        meter = Meter(arms, arm)
        metrics = run_cell(arms[arm].base_url, cell, spec, seed, photos, inputs, meter)
        n = max(metrics.get("completed", 0), 1)
        metrics["api_cpu_ms"] = meter.api_s * 1000 / n
        metrics["engine_cpu_ms"] = meter.engine_s * 1000 / n
        run.record(half=half, block=block, cell=cell, arm=arm, position=position, rerun=rerun,
                   flagged=meter.flagged, metrics=metrics,
                   machine={"steal": round(meter.steal, 4),
                            "foreign_cpu": round(meter.foreign, 4)})
        flagged |= meter.flagged
        if bar is not None:
            bar.update()
    return flagged


def block_plan(seed: int, blocks: range, arms: tuple[str, ...] = ARMS,
               cells: tuple[str, ...] = tuple(GATED)) -> list[tuple[int, list[tuple[str, tuple]]]]:
    """For each block, its ``cells`` in a random order, each with the ``arms``' order from
    that cell's balanced sequence (:func:`bench.stats.balanced_orders`: every permutation
    equally often over each 6 blocks for three arms, 24 for four). Deterministic in ``seed``."""
    from bench.stats import balanced_orders

    last = blocks.stop
    orders = {cell: balanced_orders(last, arms, random.Random(f"{seed}:{cell}"))
              for cell in cells}
    plan = []
    for block in blocks:
        shuffled = list(cells)
        random.Random(f"{seed}:cells:{block}").shuffle(shuffled)
        plan.append((block, [(cell, tuple(orders[cell][block])) for cell in shuffled]))
    return plan


def run_blocks(run: Run, arms: dict[str, ManagedServer], half: int, blocks: range,
               inputs: Inputs, pending: list, bar=None, total_blocks: int | None = None) -> None:
    """Run ``blocks``; a flagged (block, cell) row is appended to ``pending`` as
    ``(block, cell, order, reruns so far)``. ``bar`` (optional) counts the segments and names
    the block, ``block B/total_blocks``."""
    for block, cells in block_plan(run.seed, blocks, run.arms, run.cells):
        if bar is not None:
            bar.set_description(f"block {block + 1}/{total_blocks or blocks.stop} "
                                f"(half {half})")
            bar.set_postfix_str("photos")
        inputs.prepare(photo_seeds(run.seed, block) + (photos_cell_seeds(
            run.seed, block, run.photo_throughput) if run.photo_throughput else []))
        t0 = time.monotonic()
        for cell, order in cells:
            if run_row(run, arms, half, block, cell, order, inputs, bar=bar):
                pending.append((block, cell, order, 0))
        say(f"block {block} (half {half}): {time.monotonic() - t0:.0f} s")


def rerun_flagged(run: Run, arms: dict[str, ManagedServer], half: int, pending: list,
                  inputs: Inputs, bar=None) -> int:
    """Run the flagged rows again (each at most :data:`MAX_RERUNS` times). Returns how many
    rows ran again. ``bar`` (optional) grows by each row's segments and counts them."""
    count = 0
    while pending:
        block, cell, order, done = pending.pop(0)
        if done >= MAX_RERUNS:
            continue
        count += 1
        if bar is not None:
            bar.set_description(f"running flagged rows again (half {half})")
            bar.total += len(order)
            bar.refresh()
        if run_row(run, arms, half, block, cell, order, inputs, rerun=done + 1, bar=bar):
            pending.append((block, cell, order, done + 1))
    return count


def warm_up(arms: dict[str, ManagedServer], inputs: Inputs, seed: int) -> None:
    """Unscored requests: the first requests of a process pay one-off costs (compilation of
    the engine's paths, the image processor's first load, allocator growth)."""
    photo = inputs.photo(seed * 7 + 1)
    for server in arms.values():
        w.serving_benchmark(server.base_url, inputs.model_dir, inputs.model, "text", 4, 8,
                            seed, inputs.log, warmups=0)
        w.serving_benchmark(server.base_url, inputs.model_dir, inputs.model, "image", 4, 4,
                            seed, inputs.log, warmups=0)
        asyncio.run(w.photo_ttft(server.base_url, inputs.model, [photo]))


def report_segments(full: bool) -> int:
    """Segments :func:`report_half` runs: each reported cell and W5, for ours and raw."""
    return 2 * (len(REPORTED) + (len(REPORTED_FULL) if full else 0) + 1)


def report_half(arms: dict[str, ManagedServer], inputs: Inputs, seed: int, full: bool,
                bar=None) -> dict:
    """The reported cells (not gated) for ours and raw: W1 cells and W5. ``bar`` (optional)
    counts the segments (:func:`report_segments`)."""
    out: dict = {}
    cells = {**REPORTED, **(REPORTED_FULL if full else {})}

    def step(cell: str, arm: str) -> None:
        if bar is not None:
            bar.set_description("reported cells")
            bar.set_postfix_str(f"{cell} {arm}")

    for cell, spec in cells.items():
        for arm in ("ours", "raw"):
            step(cell, arm)
            out.setdefault(cell, {})[arm] = run_w1(arms[arm].base_url, spec,
                                                   cell_seed(seed, 10_000, cell), inputs)
            if bar is not None:
                bar.update()
    photos = w.photo_urls(inputs.sources, 3, cell_seed(seed, 10_000, "w5"))
    for arm in ("ours", "raw"):
        step("w5", arm)
        texts, shots = asyncio.run(w.itl_under_photos(arms[arm].base_url, inputs.model, photos))
        itls = [i for r in texts for i in r.itls_s]
        out.setdefault("w5", {})[arm] = {
            "itl_p99_ms": percentile(itls, 99) * 1000 if itls else None,
            "itl_max_ms": max(itls) * 1000 if itls else None,
            "failed": sum(not r.ok for r in [*texts, *shots])}
        if bar is not None:
            bar.update()
    return out


# --- the run -------------------------------------------------------------------------------
def engine_ceiling() -> int:
    """The engine's ``max_num_seqs`` (``Settings``, resolved for this machine): W4's burst."""
    from serve.settings import Settings

    return Settings().resolved().max_num_seqs


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.compare", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=9,
                        help="blocks before the first verdict, split over the two halves")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "out",
                        help="bench.json and server logs (not committed)")
    parser.add_argument("--ledger", type=Path, default=DEFAULT_LEDGER)
    parser.add_argument("--md", type=Path, default=ROOT / "bench" / "results" / "bench.md",
                        help="the verdict table")
    parser.add_argument("--full", action="store_true", help="also report image c=64 (~2 min)")
    parser.add_argument("--no-extend", action="store_true",
                        help="judge after --blocks even when inconclusive")
    parser.add_argument("--extra-arm", action="append", default=[], choices=sorted(EXTRA_ARMS),
                        help="add this arm to every block: raw4 = raw vLLM with "
                        "--api-server-count 4 (bench/gpu.sh)")
    parser.add_argument("--photo-throughput", type=int, default=0, metavar="C",
                        help=f"add the cell {PHOTOS_CELL!r}: 2C distinct 12 MP photos, C in "
                        "flight, requests/s (0: off)")
    args = parser.parse_args(argv)
    if args.blocks < 2:
        parser.error("--blocks must be at least 2 (one per half)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from bench import verdict as v
    from serve.engine import apply_engine_env
    from serve.settings import Settings

    apply_engine_env(Settings())  # vLLM's benchmark client is imported in this process
    # A SIGTERM (a CI timeout, `kill`) unwinds like Ctrl-C, so the arms, each in its own
    # process group, are stopped by the `finally` below instead of outliving the run.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    t_start = time.monotonic()
    commit, dirty = git_state()
    run = Run(f"{datetime.now(timezone.utc):%Y%m%dT%H%M%SZ}-{secrets.token_hex(2)}", commit,
              dirty, args.ledger, args.seed, (*ARMS, *dict.fromkeys(args.extra_arm)),
              args.photo_throughput)
    print(f"run {run.run_id} on {commit[:12]}{' (uncommitted changes)' if dirty else ''}",
          flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    model = model_dir()
    rss = PeakRss()
    reported: dict = {}
    reruns = 0
    first = (args.blocks + 1) // 2
    halves = [range(0, first), range(first, args.blocks)]
    arms: dict[str, ManagedServer] = {}
    # Segments: every arm of every cell of every block, and each half's reported cells; the
    # total grows when flagged rows run again and when the run adds blocks.
    per_block = len(run.cells) * len(run.arms)
    bar = progress_bar(args.blocks * per_block + len(halves) * report_segments(args.full),
                       "bench", "segment")
    total_blocks = args.blocks
    with open(args.out / "logs-vllm-bench.txt", "w") as log, bar:
        try:
            for half, blocks in enumerate(halves):
                stop_arms(arms)
                t0 = time.monotonic()
                bar.set_description(f"half {half}: starting {len(run.arms)} servers")
                bar.set_postfix_str(", ".join(run.arms))
                arms = start_arms(args.out, model, run.arms)
                rss.watch(arms)
                name = w.served_model(arms["ours"].base_url)
                inputs = Inputs(name, model, real_photos(IMAGES_DIR), engine_ceiling(), log, {})
                bar.set_description(f"half {half}: warm-up")
                warm_up(arms, inputs, args.seed + half)
                say(f"half {half}: arms up and warm in {time.monotonic() - t0:.0f} s")
                pending: list = []
                run_blocks(run, arms, half, blocks, inputs, pending, bar, total_blocks)
                reruns += rerun_flagged(run, arms, half, pending, inputs, bar)
                if half < len(halves) - 1:
                    reported[f"half{half}"] = report_half(arms, inputs, args.seed + half,
                                                          args.full, bar)
            next_block, extensions = args.blocks, 0
            while not args.no_extend and extensions < MAX_EXTENSIONS:
                # This run's blocks so far, with its peaks so far (its run record comes last).
                verdict = v.judge([*(r for r in v.read_ledger(args.ledger)
                                     if r.get("run") == run.run_id),
                                   {"kind": "run", "run": run.run_id,
                                    "rss_peak_mib": dict(rss.peak_mib)}])
                if not verdict.wants_more_blocks:
                    break
                extensions += 1
                blocks = range(next_block, next_block + EXTENSION_BLOCKS)
                say(f"{verdict.result}: {EXTENSION_BLOCKS} more blocks ({extensions} of "
                    f"{MAX_EXTENSIONS})")
                total_blocks = blocks.stop
                bar.total += EXTENSION_BLOCKS * per_block
                bar.refresh()
                pending = []
                run_blocks(run, arms, 1, blocks, inputs, pending, bar, total_blocks)
                reruns += rerun_flagged(run, arms, 1, pending, inputs, bar)
                next_block = blocks.stop
            # The last half reports after its added blocks: the reported cells load ours
            # and raw but not raw2, which would tilt the A/A of a block run after them.
            reported[f"half{len(halves) - 1}"] = report_half(
                arms, inputs, args.seed + len(halves) - 1, args.full, bar)
            bar.set_description("stopping the servers")
            bar.set_postfix_str("")
        finally:
            stop_arms(arms)
            rss.stop()
    seconds = time.monotonic() - t_start
    run.record(kind="run", blocks=next_block, extensions=extensions, reruns=reruns,
               rss_peak_mib={k: round(x, 1) for k, x in rss.peak_mib.items()},
               reported=reported, seconds=round(seconds, 1))
    (args.out / "bench.json").write_text(json.dumps(
        {"run": run.run_id, "commit": commit, "dirty": dirty, "seconds": seconds,
         "reported": reported, "rss_peak_mib": rss.peak_mib}, indent=1))
    print(f"run {run.run_id}: {next_block} blocks, {reruns} rows run again, "
          f"{seconds:.0f} s", flush=True)
    return v.main(["--ledger", str(args.ledger), "--md", str(args.md)])


if __name__ == "__main__":
    sys.exit(main())
