"""The real tiny engine on CPU for the autotuner benchmark: servers, request bodies, replay.

:func:`run_setting` starts a fresh ``python -m serve`` (the tiny Phi-3-vision built by
``python -m serve.models.build --size tiny``) with one admission setting, waits for
``/ready``, replays a trace with streamed requests (:func:`replay_http`) and stops it. Every
setting sees byte-identical requests: :func:`build_bodies` renders the trace once, with
seeded text and seeded crops of the real photos in ``../shared/images`` (``kind: real`` in
its ``MANIFEST.json``) as ``data:`` URLs. Each image is a distinct crop, so neither vLLM's
prefix cache nor its multimodal cache turns an upload into a cache hit: every image costs a
real CLIP encode and a 313-token prefill (``num_crops`` 1), like a stream of user uploads.

The client shares the machine's cores with the server, so it does its work up front (bodies
are encoded before the replay starts) and only reads the streams during the replay.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import io
import json
import os
import random
import time
from base64 import b64encode
from dataclasses import dataclass, field
from pathlib import Path

from bench.process import start_serve, stop_process
from bench.sim import RequestResult
from bench.trace import Trace, TraceRequest

ROOT = Path(__file__).resolve().parent.parent
#: The shared test photos (never copied into the project).
IMAGES_DIR = ROOT.parent / "shared" / "images"
#: Common English words for prompt text. The tiny model's tokenizer splits them into ~2.3
#: tokens each (measured on seeded samples of this list), hence :data:`TOKENS_PER_WORD`.
WORDS = ("the a of to and in is it you that he was for on are with as his they be at one "
         "have this from or had by hot but some what there we can out other were all your "
         "when up use word how said an each she which do their time if will way about many "
         "then them would write like so these her long make thing see him two has look more "
         "day could go come did my sound no most number who over know water than call first "
         "people may down side been now find").split()
TOKENS_PER_WORD = 2.3


# --- request bodies -------------------------------------------------------------------------
def real_photos(images_dir: Path = IMAGES_DIR) -> list[Path]:
    """The real photos of ``images_dir`` (``kind: real`` in its ``MANIFEST.json``)."""
    manifest = json.loads((images_dir / "MANIFEST.json").read_text())
    photos = [images_dir / e["file"] for e in manifest if e.get("kind") == "real"]
    if not photos:
        raise FileNotFoundError(f"no real photos listed in {images_dir / 'MANIFEST.json'}")
    return photos


def photo_crops(rng: random.Random, photos: list, n: int, salt: str = "") -> list[str]:
    """``n`` ``data:`` URLs of distinct seeded crops (60-100 % of each side) of ``photos``
    (opened Pillow images), as JPEG. A ``salt`` recolours the crop's top-left pixel (a colour
    from the salt's hash): other bytes, another content hash for every cache, the same
    geometry and so the same decode and resize work."""
    urls = []
    mark = tuple(hashlib.sha256(salt.encode()).digest()[:3]) if salt else None
    for _ in range(n):
        photo = rng.choice(photos)
        w, h = photo.size
        cw, ch = int(w * rng.uniform(0.6, 1.0)), int(h * rng.uniform(0.6, 1.0))
        x, y = rng.randint(0, w - cw), rng.randint(0, h - ch)
        crop = photo.crop((x, y, x + cw, y + ch)).convert("RGB")
        if mark is not None:
            crop.putpixel((0, 0), mark)
        buf = io.BytesIO()
        crop.save(buf, format="JPEG", quality=90)
        urls.append("data:image/jpeg;base64," + b64encode(buf.getvalue()).decode())
    return urls


def prompt_text(rng: random.Random, tokens: int) -> str:
    """Seeded words, about ``tokens`` tokens of the tiny model's tokenizer (distinct per
    request, so text prompts do not share cached prefixes either)."""
    return " ".join(rng.choice(WORDS) for _ in range(max(1, round(tokens / TOKENS_PER_WORD))))


def chat_body(req: TraceRequest, model: str, image_urls: list[str], text: str) -> dict:
    """A streamed chat request: the images, then the text; exactly ``req.output_tokens``
    tokens of answer (``ignore_eos``, vLLM's extension)."""
    content = [{"type": "image_url", "image_url": {"url": url}} for url in image_urls]
    content.append({"type": "text", "text": text})
    return {"model": model, "stream": True, "stream_options": {"include_usage": True},
            "max_tokens": req.output_tokens, "ignore_eos": True, "temperature": 0.0,
            "messages": [{"role": "user", "content": content}]}


@functools.lru_cache(maxsize=2)
def _opened_photos(images_dir: Path) -> tuple:
    """The real photos of ``images_dir`` decoded to RGB once per process (a paired run builds
    bodies for every arm of every episode from the same photos; only crops are taken)."""
    from PIL import Image

    photos = []
    for path in real_photos(images_dir):
        with Image.open(path) as im:
            photos.append(im.convert("RGB"))
    return tuple(photos)


def build_bodies(trace: Trace, model: str, images_dir: Path = IMAGES_DIR,
                 salt: str = "") -> list[bytes]:
    """The JSON body of every request of ``trace`` (deterministic in ``trace.seed``).

    A ``salt`` (one arm of a paired comparison) makes every body's content its own while
    keeping its work the same: the text starts with the salt word (its words and lengths
    otherwise unchanged) and each photo crop carries the salt's pixel
    (:func:`photo_crops`), so no arm hits another's prefix or image cache."""
    rng = random.Random(f"cpu-bodies-{trace.seed}")
    photos = _opened_photos(images_dir)
    bodies = []
    for req in trace.requests:
        urls = photo_crops(rng, photos, req.images, salt) if req.images else []
        text = prompt_text(rng, max(1, req.prompt_tokens - req.image_tokens))
        if salt:
            text = f"{salt} {text}"
        bodies.append(json.dumps(chat_body(req, model, urls, text)).encode())
    return bodies


# --- replay ---------------------------------------------------------------------------------
async def _replay_one(client, req: TraceRequest, body: bytes, start: float) -> RequestResult:
    """Send ``body`` at ``req``'s arrival time and time its stream (trace clock, seconds).

    ``finish_s`` is set only when the stream ends with ``[DONE]``; a request cancelled before
    (the drain deadline) or refused stays unfinished.
    """
    result = RequestResult(req)
    last = None
    try:
        await asyncio.sleep(max(0.0, start + req.arrival_s - time.monotonic()))
        async with client.stream("POST", "/v1/chat/completions", content=body,
                                 headers={"Content-Type": "application/json"}) as resp:
            if resp.status_code != 200:
                await resp.aread()
                result.dropped = resp.headers.get("X-Phi3v-Reject-Reason",
                                                  f"http_{resp.status_code}")
                result.dropped_s = time.monotonic() - start
                return result
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    result.finish_s = last
                    break
                if '"completion_tokens"' in line:  # the usage chunk (include_usage)
                    result.tokens = json.loads(line[6:])["usage"]["completion_tokens"]
                elif '"content":"' in line and '"content":""' not in line:
                    # one chunk per engine step with new text (the role chunk is empty); no
                    # JSON parse per token: the client shares the server's cores
                    last = time.monotonic() - start
                    if result.first_token_s is None:
                        result.first_token_s = last
    except asyncio.CancelledError:
        result.finish_s = None
    except Exception as exc:  # noqa: BLE001 - any transport failure is a lost request
        result.dropped = f"error:{type(exc).__name__}"
        result.dropped_s = time.monotonic() - start
        result.finish_s = None
    return result


@dataclass
class Replay:
    """One replay of a trace against one server.

    Attributes:
        mode: the server's autotuner mode (``auto`` or ``static``).
        label: ``auto`` or ``L=<n>``.
        results: per-request outcomes, in trace order (trace clock, seconds).
        limits: ``(t, limit)`` polled from ``/admin/autotuner`` (trace clock).
        fits: ``(t, burst_budget, burst_cap)`` polled with them (None where unknown).
        config: the server's controller config (``/admin/autotuner``): targets, ceiling...
        cut_off: requests still streaming at the drain deadline (cancelled, not good).
        end_s: trace-clock time the replay ended.
        preemptions: engine preemptions during the replay (``vllm:num_preemptions_total``).
    """

    mode: str
    label: str
    results: list[RequestResult]
    limits: list[tuple[float, int]]
    config: dict
    cut_off: int
    end_s: float
    preemptions: int | None = None
    fits: list[tuple[float, int | None, int | None]] = field(default_factory=list)


def _preemptions(text: str) -> int | None:
    for line in text.splitlines():
        if line.startswith("vllm:num_preemptions_total"):
            return int(float(line.rsplit(" ", 1)[1]))
    return None


async def replay_http(trace: Trace, base_url: str, bodies: list[bytes] | None = None,
                      drain_s: float = 60.0, poll_s: float = 1.0) -> Replay:
    """Replay ``trace`` in real time against an OpenAI-compatible streaming server.

    Each request is sent at its arrival time (``httpx``, one connection per request). TTFT
    and mean ITL come from the times of the first and last streamed tokens, the token count
    from ``usage``. ``/admin/autotuner`` is polled every ``poll_s``. Requests still open
    ``drain_s`` after the trace's end are cancelled (the client disconnects; the server aborts
    them) and count as not good.

    Args:
        bodies: the request bodies (:func:`build_bodies`); default: built here for the model
            the server lists first.
    """
    import httpx

    limits_http = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(None, connect=10),
                                 limits=limits_http) as client:
        answer = await client.get("/admin/autotuner")
        # Plain vLLM has no gateway: no autotuner, no limit (the ``unlimited`` baseline).
        state = answer.json() if answer.status_code == 200 else {
            "mode": "unlimited", "limit": None, "config": {}}
        if bodies is None:
            model = (await client.get("/v1/models")).json()["data"][0]["id"]
            bodies = await asyncio.to_thread(build_bodies, trace, model)
        preempt0 = _preemptions((await client.get("/metrics")).text)
        label = {"auto": "auto", "unlimited": "unlimited"}.get(state["mode"],
                                                              f"L={state['limit']}")
        limits: list[tuple[float, int]] = []
        #: (t, ITL fit, burst cap, ITL line (intercept s, slope s, p90 ratio) or None).
        fits: list[tuple[float, int | None, int | None]] = []
        start = time.monotonic()

        async def poll() -> None:
            while state["mode"] != "unlimited":
                try:
                    now = (await client.get("/admin/autotuner")).json()
                    t = time.monotonic() - start
                    limits.append((t, now["limit"]))
                    fits.append((t, now.get("burst_budget"), now.get("burst_cap")))
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(poll_s)

        poller = asyncio.create_task(poll())
        tasks = [asyncio.create_task(_replay_one(client, r, b, start))
                 for r, b in zip(trace.requests, bodies, strict=False)]
        deadline = trace.duration_s + drain_s
        _, pending = await asyncio.wait(tasks, timeout=max(0.0, start + deadline
                                                           - time.monotonic()))
        for task in pending:
            task.cancel()
        results = [await t for t in tasks]
        end_s = time.monotonic() - start
        poller.cancel()
        try:
            preempt1 = _preemptions((await client.get("/metrics")).text)
        except httpx.HTTPError:
            preempt1 = None
    preempted = None if preempt0 is None or preempt1 is None else preempt1 - preempt0
    return Replay(state["mode"], label, results, limits, state["config"], len(pending), end_s,
                  preempted, fits)


# --- CPU accounting -------------------------------------------------------------------------
_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _busy_cpu_s() -> float:
    """CPU seconds the whole machine has been busy (``/proc/stat``: all but idle/iowait)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / _CLK_TCK


def _proc_stat(path: str) -> tuple[int, float] | None:
    """``(session id, CPU seconds)`` of one ``/proc/PID/stat``, None if it vanished."""
    try:
        with open(path) as f:
            rest = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(rest[3]), (int(rest[11]) + int(rest[12])) / _CLK_TCK


def _ours_cpu_s(session: int | None) -> float:
    """CPU seconds of this process and of every live process in ``session`` (a server's)."""
    total = _proc_stat("/proc/self/stat")[1]
    if session is not None:
        for pid in os.listdir("/proc"):
            if pid.isdigit() and (st := _proc_stat(f"/proc/{pid}/stat")) and st[0] == session:
                total += st[1]
    return total


class CpuMeter:
    """Foreign CPU load: cores the machine spent on processes other than this client and the
    server's session (other users' jobs sharing the cores), averaged since :meth:`reset`.
    Returns None where ``/proc`` is not Linux's."""

    def __init__(self, session: int | None = None) -> None:
        self.session = session
        self.reset()

    def reset(self) -> None:
        try:
            self._t0, self._busy0 = time.monotonic(), _busy_cpu_s()
            self._ours0 = _ours_cpu_s(self.session)
        except OSError:
            self._t0 = None

    def foreign_cores(self) -> float | None:
        if self._t0 is None:
            return None
        elapsed = max(time.monotonic() - self._t0, 1e-3)
        foreign = (_busy_cpu_s() - self._busy0) - (_ours_cpu_s(self.session) - self._ours0)
        return max(0.0, foreign / elapsed)


def wait_quiet(max_wait_s: float, threshold_cores: float = 0.3, sample_s: float = 2.0) -> float:
    """Wait (at most ``max_wait_s``) until other processes use < ``threshold_cores`` over
    ``sample_s``. Returns the seconds waited."""
    t0 = time.monotonic()
    meter = CpuMeter()
    while True:
        meter.reset()
        time.sleep(sample_s)
        load = meter.foreign_cores()
        if load is None or load < threshold_cores or time.monotonic() - t0 >= max_wait_s:
            return time.monotonic() - t0


@dataclass
class Setting:
    """One server configuration of the benchmark: a label and its ``python -m serve`` flags,
    or ``raw``: plain vLLM's OpenAI server on the same engine (no gateway at all: the
    ``unlimited`` baseline)."""

    label: str
    args: list[str] = field(default_factory=list)
    raw: bool = False


def start_raw_vllm(log_path: Path):
    """Plain vLLM's ``python -m vllm.entrypoints.openai.api_server`` on the tiny model, with
    the engine arguments and environment our :class:`~serve.settings.Settings` produce (as
    ``make bench``'s raw side)."""
    import sys

    from bench.process import TINY_MODEL, free_port, start_process
    from serve.engine import vllm_cli_args
    from serve.settings import Settings

    port = free_port()
    settings = Settings(model=str(TINY_MODEL), port=port)
    return start_process(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", *vllm_cli_args(settings)],
        port, log_path, "/v1/models", env=settings.engine_env())


def run_setting(setting: Setting, trace: Trace, bodies: list[bytes], common_args: list[str],
                log_dir: Path, drain_s: float,
                attempt: int = 1) -> tuple[Replay, float, float | None]:
    """Start a fresh server with ``common_args + setting.args``, replay, stop it. The server
    logs to ``log_dir/server-<label>[-<attempt>].log``.

    Returns:
        the replay, the seconds the server took to become ready, and the foreign CPU load
        during the replay (cores, :class:`CpuMeter`).
    """
    name = setting.label.replace("=", "") + (f"-{attempt}" if attempt > 1 else "")
    if setting.raw:
        server = start_raw_vllm(log_dir / f"server-{name}.log")
    else:
        server = start_serve([*common_args, *setting.args], log_dir / f"server-{name}.log")
    try:
        meter = CpuMeter(session=server.proc.pid)
        replay = asyncio.run(replay_http(trace, server.base_url, bodies, drain_s=drain_s))
        foreign = meter.foreign_cores()
    finally:
        stop_process(server)
    return replay, server.ready_s, foreign
