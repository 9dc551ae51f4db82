"""Seeded, phase-changing workloads for the autotuner benchmark.

The default scenario (:func:`phase_trace`) has three phases of ``phase_s`` (180) seconds, each
with three bursts (windows of 5-12 s at 2-4x the phase's base rate), Poisson arrivals:

- **A, chat** (15 req/s): short text prompts (median 250 tokens) and answers (16-160 tokens).
  Throughput needs ~100 sequences in flight (Little's law), so the best limit is high.
- **B, vision** (2 req/s): 1-2 images per prompt at ``num_crops`` 4..16 (Phi-3-vision: 313
  image tokens for one 336-px tile .. 2509 for 4x4 tiles; 757..2509 for these sizes and crops,
  :func:`image_tokens`), 60-300 output tokens. A prompt is ~2k tokens of KV cache and ~0.15 s
  of prefill: a large limit overfills the KV cache (vLLM preempts and recomputes
  multi-thousand-token prompts) and lets bursts of prefills stretch every step.
- **C, long answers** (2 req/s): 500-1000 output tokens. A sequence grows to ~1k tokens of KV
  for ~30 s, so the KV cache, not compute, bounds the useful limit.

With the engine :data:`bench.sim.GPU_LIKE` (48k tokens of KV cache) and the GPU SLO of
``serve.settings`` (TTFT 2 s, ITL 0.1 s), the best static limit differs by phase. Measured at
seed 0 (good requests by phase of arrival, ``python -m bench.autotune``; * = best)::

    L     A-chat  B-vision  C-long
    16      1024      344*     157
    32      1769      288      295
    64      2725      255      393*
    128     3020*     255      288
    256     1291      254      287

Image token counts come from our Phi-3-vision processor (:mod:`serve.models.remote_code.
processing_phi3_v`: HD transform + Microsoft's token formula), so they are the counts vLLM
sees for those image sizes.
"""

from __future__ import annotations

import functools
import math
import random
from dataclasses import dataclass

#: Typical upload sizes (width, height) in pixels: phone photos, screenshots, scans, charts.
IMAGE_SIZES = ((4032, 3024), (3024, 4032), (1920, 1080), (1280, 720), (1024, 768),
               (800, 600), (640, 480), (1080, 1920), (1700, 2200), (512, 512), (2048, 1536))


@dataclass(frozen=True)
class TraceRequest:
    """One request of a workload.

    Attributes:
        id: index in the trace (arrival order).
        arrival_s: arrival time, seconds from the start of the trace.
        prompt_tokens: prompt length in tokens, image tokens included (as vLLM counts them).
        image_tokens: how many of ``prompt_tokens`` are image tokens (0 for text).
        images: number of images.
        output_tokens: tokens the answer has (``max_tokens`` with ``ignore_eos`` on replay).
        phase: name of the phase the request arrived in.
    """

    id: int
    arrival_s: float
    prompt_tokens: int
    image_tokens: int
    images: int
    output_tokens: int
    phase: str


@dataclass(frozen=True)
class Phase:
    """One stretch of a workload.

    Attributes:
        name: label (results are grouped by the phase of arrival).
        duration_s: length, seconds.
        rate_per_s: base Poisson arrival rate, requests per second.
        kind: ``chat``, ``vision`` or ``long``: which request generator to use.
        bursts: number of burst windows in the phase.
        burst_s: (min, max) length of a burst window, seconds.
        burst_factor: (min, max) multiplier of the rate inside a burst.
        output_tokens: (min, max) answer length in tokens, uniform; None: the kind's default
            (chat 16-160, vision 60-300, long 500-1000).
        num_crops: (min, max) Phi-3-vision ``num_crops`` of the images (vision only).
    """

    name: str
    duration_s: float
    rate_per_s: float
    kind: str
    bursts: int = 3
    burst_s: tuple[float, float] = (5.0, 12.0)
    burst_factor: tuple[float, float] = (2.0, 4.0)
    output_tokens: tuple[int, int] | None = None
    num_crops: tuple[int, int] = (4, 16)


@dataclass(frozen=True)
class Trace:
    """A workload: its phases (back to back, from t = 0) and its requests (by arrival)."""

    phases: tuple[Phase, ...]
    requests: tuple[TraceRequest, ...]
    seed: int

    @property
    def duration_s(self) -> float:
        """Total length of the phases, seconds (the denominator of goodput)."""
        return sum(p.duration_s for p in self.phases)


@functools.lru_cache(maxsize=None)
def image_tokens(width: int, height: int, num_crops: int) -> int:
    """Phi-3-vision image tokens of one ``width`` x ``height`` image at ``num_crops``.

    Uses the processor's own HD transform and token formula
    (``(h*w + 1) * 144 + 1 + (h + 1) * 12``): 313 for one 336-px tile, 2509 for 4x4 tiles at
    ``num_crops`` 16. Imports the processor lazily (it needs torch).
    """
    from serve.models.remote_code.processing_phi3_v import hd_transform_size, num_image_tokens

    _, _, padded_w, padded_h, _, _ = hd_transform_size(width, height, num_crops)
    return num_image_tokens(padded_w, padded_h)


def _lognormal_int(rng: random.Random, median: float, sigma: float, lo: int, hi: int) -> int:
    return int(min(hi, max(lo, round(rng.lognormvariate(math.log(median), sigma)))))


#: Default answer lengths (min, max) in tokens by request kind.
OUTPUT_TOKENS = {"chat": (16, 160), "vision": (60, 300), "long": (500, 1000)}


def _request(rng: random.Random, phase: Phase) -> tuple[int, int, int, int]:
    """(prompt_tokens, image_tokens, images, output_tokens) for one request of ``phase``."""
    if phase.kind not in OUTPUT_TOKENS:
        raise ValueError(f"unknown request kind {phase.kind!r}")
    lo, hi = phase.output_tokens or OUTPUT_TOKENS[phase.kind]
    if phase.kind == "chat":
        return _lognormal_int(rng, 250, 0.6, 20, 1500), 0, 0, rng.randint(lo, hi)
    if phase.kind == "vision":
        images = 1 if rng.random() < 0.6 else 2
        num_crops = rng.randint(*phase.num_crops)
        img = sum(image_tokens(*rng.choice(IMAGE_SIZES), num_crops) for _ in range(images))
        text = _lognormal_int(rng, 80, 0.5, 10, 500)
        return text + img, img, images, rng.randint(lo, hi)
    return _lognormal_int(rng, 300, 0.5, 30, 2000), 0, 0, rng.randint(lo, hi)


def _bursts(rng: random.Random, phase: Phase) -> list[tuple[float, float, float]]:
    """Non-overlapping (start, end, factor) burst windows inside ``[0, duration_s)``."""
    if phase.bursts <= 0:
        return []
    slot = phase.duration_s / phase.bursts
    out = []
    for i in range(phase.bursts):
        length = min(rng.uniform(*phase.burst_s), 0.8 * slot)
        start = i * slot + rng.uniform(0.1 * slot, slot - length)
        out.append((start, start + length, rng.uniform(*phase.burst_factor)))
    return out


def build_trace(phases: tuple[Phase, ...] | list[Phase], seed: int = 0) -> Trace:
    """Poisson arrivals phase after phase, with burst windows; deterministic in ``seed``.

    Arrivals are generated by thinning (Lewis & Shedler 1979) a Poisson process at the phase's
    peak rate, so the rate is piecewise constant: ``rate_per_s`` outside bursts,
    ``rate_per_s x factor`` inside them.
    """
    rng = random.Random(seed)
    requests: list[TraceRequest] = []
    start = 0.0
    for phase in phases:
        bursts = _bursts(rng, phase)
        peak = phase.rate_per_s * max([f for _, _, f in bursts] + [1.0])
        t = 0.0
        while True:
            t += rng.expovariate(peak)
            if t >= phase.duration_s:
                break
            factor = next((f for b0, b1, f in bursts if b0 <= t < b1), 1.0)
            if rng.random() * peak > phase.rate_per_s * factor:
                continue
            prompt, img, images, out = _request(rng, phase)
            requests.append(TraceRequest(len(requests), start + t, prompt, img, images, out,
                                         phase.name))
        start += phase.duration_s
    return Trace(tuple(phases), tuple(requests), seed)


def default_phases(phase_s: float = 180.0) -> tuple[Phase, ...]:
    """The benchmark's three phases (see the module docstring), ``phase_s`` seconds each."""
    return (Phase("A-chat", phase_s, 15.0, "chat"),
            Phase("B-vision", phase_s, 2.0, "vision"),
            Phase("C-long", phase_s, 2.0, "long"))


def phase_trace(seed: int = 0, phase_s: float = 180.0) -> Trace:
    """The default phase-changing workload (:func:`default_phases`) at ``seed``."""
    return build_trace(default_phases(phase_s), seed)


def cpu_trace(seed: int = 0, phase_s: float = 25.0) -> Trace:
    """A small version (3 x ``phase_s`` s) for the real tiny engine on a 2-core CPU.

    Same phases, one 2-4x burst each, scaled to what the tiny model does on 2 cores
    (measured on an otherwise idle machine): a decode step of ~3.5 ms + 0.27 ms per running
    sequence (~2,400 tokens/s at 16-32 sequences), an image at ``num_crops`` 1 (313 tokens)
    ~0.3 s of CLIP encode inside one engine step, ``max_num_seqs`` 32.

    - **A, chat** (10 req/s, 16-128 output tokens, ~250-token prompts): ~700 tokens/s
      outside the burst, 1,400-2,800 inside it: only the larger limits keep up.
    - **B, vision** (1.5 req/s, 1-2 images, 16-64 output tokens): ~0.6 s of encodes per
      second, saturated in the burst; every encode stalls every running decode.
    - **C, long answers** (1.5 req/s, 200-400 output tokens): ~450 tokens/s, 1-2 s per
      answer; a small limit queues them past the TTFT target, most of all in the burst.
    """
    bursts = dict(bursts=1, burst_s=(0.2 * phase_s, 0.35 * phase_s))
    return build_trace((
        Phase("A-chat", phase_s, 10.0, "chat", output_tokens=(16, 128), **bursts),
        Phase("B-vision", phase_s, 1.5, "vision", output_tokens=(16, 64), num_crops=(1, 1),
              **bursts),
        Phase("C-long", phase_s, 1.5, "long", output_tokens=(200, 400), **bursts),
    ), seed)
