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
from dataclasses import dataclass, replace

from serve.admission.fair import DEFAULT_TENANT

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
        tenant: who sends it (the API key's tenant; one tenant unless a trace says).
    """

    id: int
    arrival_s: float
    prompt_tokens: int
    image_tokens: int
    images: int
    output_tokens: int
    phase: str
    tenant: str = DEFAULT_TENANT


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
        num_crops: (min, max) Phi-3-vision ``num_crops`` of the images (vision and chat).
        image_share: fraction of ``chat`` requests that carry one image (0-1).
        images: (min, max) images per ``vision`` request.
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
    image_share: float = 0.0
    images: tuple[int, int] = (1, 2)


@dataclass(frozen=True)
class Trace:
    """A workload: its phases (back to back, from t = 0) and its requests (by arrival)."""

    phases: tuple[Phase, ...]
    requests: tuple[TraceRequest, ...]
    seed: int
    #: Weight of each tenant in fair admission, ``((tenant, weight), ...)``; 1 if absent.
    weights: tuple[tuple[str, float], ...] = ()

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
        prompt = _lognormal_int(rng, 250, 0.6, 20, 1500)
        if phase.image_share and rng.random() < phase.image_share:
            img = image_tokens(*rng.choice(IMAGE_SIZES), rng.randint(*phase.num_crops))
            return prompt + img, img, 1, rng.randint(lo, hi)
        return prompt, 0, 0, rng.randint(lo, hi)
    if phase.kind == "vision":
        few, many = phase.images
        if few == many or rng.random() < 0.6:
            images = few
        else:  # (no draw for the default (1, 2): the seeded traces stay what they were)
            images = many if many == few + 1 else rng.randint(few + 1, many)
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


def cpu_trace(seed: int = 0, phase_s: float = 25.0,
              rate_scale: tuple[float, float, float] = (1.0, 1.0, 1.0)) -> Trace:
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

    ``rate_scale`` multiplies the three phases' rates (chat, vision, long): this machine's
    throughput per mix over :data:`CPU_CAPACITY`'s, so the trace loads a slower or faster
    machine alike (:func:`cpu_suite`).
    """
    bursts = dict(bursts=1, burst_s=(0.2 * phase_s, 0.35 * phase_s))
    chat, vision, long = rate_scale
    return build_trace((
        Phase("A-chat", phase_s, 10.0 * chat, "chat", output_tokens=(16, 128), **bursts),
        Phase("B-vision", phase_s, 1.5 * vision, "vision", output_tokens=(16, 64),
              num_crops=(1, 1), **bursts),
        Phase("C-long", phase_s, 1.5 * long, "long", output_tokens=(200, 400), **bursts),
    ), seed)


# --- The trace suite (issue 12): six workloads, each scaled to the engine's capacity ---------
#
# Request shapes, from public workload statistics:
# - chat prompts: lognormal, median 250 tokens (a few turns of history: LMSYS-Chat-1M reports
#   69.5 prompt and 214.5 response tokens per turn, Zheng et al., ICLR 2024, table 1; ShareGPT
#   161 input / 338 output tokens, Kwon et al., SOSP 2023, section 6.1);
# - chat answers: uniform 16-400 tokens (mean 208, LMSYS-Chat-1M's 214.5);
# - images: the upload sizes of IMAGE_SIZES (12 MP phone photos 4032x3024, the default of
#   current phone cameras; HD screenshots; scans), at the server's num_crops: 16 on GPU gives
#   1,921 (4:3) to 2,509 (square) tokens per image, 1 on CPU 313;
# - long answers (T4): uniform 1,000-2,000 tokens (long-form generation, LongWriter-style
#   requests; the range).

#: Share of chat requests that carry one image (image-and-text chat).
CHAT_IMAGE_SHARE = 0.3
#: The suite's trace names, in order.
SUITE = ("T1", "T2", "T3", "T4", "T5", "T6")
#: What each trace is (for tables and the README).
SUITE_DESCRIPTIONS = {
    "T1": "steady chat (30 % with an image) at 60 % of capacity",
    "T2": "on/off: idle, then 2x max_num_seqs requests at once, 3 times",
    "T3": "image-heavy (one num_crops=16 image each) at 120 % of capacity",
    "T4": "long answers (1-2k tokens) at capacity: KV-cache pressure",
    "T5": "the phase trace: chat, vision, long answers, bursts in each",
    "T6": "sustained overload: chat at 2x capacity",
}


@dataclass(frozen=True)
class Capacity:
    """What one engine sustains: saturated throughput per request mix, and its ceiling.

    Attributes:
        chat_rps: finished requests/s of the chat mix (T1, T2, T6) with a full backlog.
        vision_rps: the same for T3's image requests.
        long_rps: the same for T4's long answers.
        ceiling: the engine's ``max_num_seqs``, requests.
        num_crops: ``num_crops`` of the images, (min, max).
        chat_output_tokens: (min, max) answer length of chat requests, tokens.
    """

    chat_rps: float
    vision_rps: float
    long_rps: float
    ceiling: int
    num_crops: tuple[int, int] = (16, 16)
    chat_output_tokens: tuple[int, int] = (16, 400)


def chat_phase(name: str, duration_s: float, rate_per_s: float, capacity: Capacity) -> Phase:
    """A chat phase of the suite: Poisson, no bursts, ``CHAT_IMAGE_SHARE`` with an image."""
    return Phase(name, duration_s, rate_per_s, "chat", bursts=0,
                 output_tokens=capacity.chat_output_tokens, num_crops=capacity.num_crops,
                 image_share=CHAT_IMAGE_SHARE)


def vision_phase(name: str, duration_s: float, rate_per_s: float, capacity: Capacity) -> Phase:
    """T3's requests: one image at the capacity's ``num_crops`` each, 60-300 output tokens."""
    return Phase(name, duration_s, rate_per_s, "vision", bursts=0, output_tokens=(60, 300),
                 num_crops=capacity.num_crops, images=(1, 1))


def long_phase(name: str, duration_s: float, rate_per_s: float) -> Phase:
    """T4's requests: text prompts, 1,000-2,000 output tokens."""
    return Phase(name, duration_s, rate_per_s, "long", bursts=0, output_tokens=(1000, 2000))


def backlog_trace(phase: Phase, n: int, seed: int = 0) -> Trace:
    """``n`` requests of ``phase``'s kind all arriving within the first millisecond: the
    saturating load whose throughput defines :class:`Capacity`."""
    rng = random.Random(seed)
    requests = tuple(TraceRequest(i, i * 1e-6, *_request(rng, phase), phase.name)
                     for i in range(n))
    return Trace((replace(phase, duration_s=1.0),), requests, seed)


def on_off_trace(name: str, capacity: Capacity, cycles: int = 3, period_s: float = 45.0,
                 idle_s: float = 30.0, spread_s: float = 1.0, seed: int = 0) -> Trace:
    """T2: ``cycles`` periods of ``idle_s`` of silence, then ``2 x ceiling`` chat requests
    arriving uniformly within ``spread_s`` (a class starting, a batch job, a retry storm)."""
    rng = random.Random(seed)
    phase = chat_phase(name, period_s, 1.0, capacity)
    arrivals = sorted(c * period_s + idle_s + rng.uniform(0, spread_s)
                      for c in range(cycles) for _ in range(2 * capacity.ceiling))
    requests = tuple(TraceRequest(i, t, *_request(rng, phase), name)
                     for i, t in enumerate(arrivals))
    return Trace((replace(phase, duration_s=cycles * period_s),), requests, seed)


def suite(capacity: Capacity, seed: int = 0, scale: float = 1.0,
          names: tuple[str, ...] = SUITE) -> dict[str, Trace]:
    """The trace suite for an engine of ``capacity``: ``{name: trace}``, seeded.

    ``scale`` shortens every trace (durations x ``scale``; T2 keeps its 3 bursts with shorter
    idle gaps): 1.0 on the simulator (2-9 simulated minutes each), ~0.1 on the CPU engine.
    """
    c = capacity
    # T2's quiet spell: long enough for the engine to serve what a burst left queued at the
    # gateway (its default max_queue, 256, + max_num_seqs in flight), 30-120 s.
    idle = min(120.0, max(30.0, (256 + c.ceiling) / c.chat_rps))
    traces = {
        "T1": lambda: build_trace((chat_phase("T1", 300 * scale, 0.6 * c.chat_rps, c),), seed),
        "T2": lambda: on_off_trace("T2", c, period_s=(idle + 15) * scale, idle_s=idle * scale,
                                   seed=seed),
        "T3": lambda: build_trace((vision_phase("T3", 240 * scale, 1.2 * c.vision_rps, c),),
                                  seed),
        "T4": lambda: build_trace((long_phase("T4", 300 * scale, 1.0 * c.long_rps),), seed),
        "T5": lambda: phase_trace(seed, 180 * scale),
        "T6": lambda: build_trace((chat_phase("T6", 240 * scale, 2.0 * c.chat_rps, c),), seed),
    }
    return {name: traces[name]() for name in names}


def concat_traces(traces: dict[str, Trace], gap_s: float) -> tuple[Trace, dict[str, Trace]]:
    """Play ``traces`` back to back, each followed by ``gap_s`` seconds of silence (for the
    engine to serve what the trace left, before the next starts): one trace to replay on one
    server, and each part as its own trace (its phases, requests and duration) to count
    goodput per part. Phases are renamed ``<part>`` or ``<part>/<phase>``."""
    phases: list[Phase] = []
    requests: list[TraceRequest] = []
    parts: dict[str, Trace] = {}
    offset = 0.0
    for name, trace in traces.items():
        rename = {p.name: name if p.name == name else f"{name}/{p.name}" for p in trace.phases}
        own_phases = tuple(replace(p, name=rename[p.name]) for p in trace.phases)
        own = tuple(replace(r, id=len(requests) + i, arrival_s=offset + r.arrival_s,
                            phase=rename[r.phase]) for i, r in enumerate(trace.requests))
        parts[name] = Trace(own_phases, own, trace.seed)
        phases += [*own_phases, Phase(f"{name}/gap", gap_s, 0.0, "chat", bursts=0)]
        requests += own
        offset += trace.duration_s + gap_s
    seed = next(iter(traces.values())).seed if traces else 0
    return Trace(tuple(phases), tuple(requests), seed), parts


#: The real tiny engine on this machine's 2 cores, measured with ``python -m bench.autotune
#: --cpu-capacity`` (128 requests of each mix at once, ``max_num_seqs`` 32, idle machine):
#: chat 128 in 13.0 s, one-image requests 128 in 43.0 s, 200-400-token answers 128 in
#: 18.8 s. What the CPU suite's rates are fractions of. Chat answers are 16-128 tokens.
CPU_CAPACITY = Capacity(chat_rps=9.8, vision_rps=3.0, long_rps=6.8, ceiling=32,
                        num_crops=(1, 1), chat_output_tokens=(16, 128))


def cpu_suite(seed: int = 0, capacity: Capacity = CPU_CAPACITY,
              phase_s: float = 10.0) -> dict[str, Trace]:
    """The suite's T1, T2, T5 and T6 at CPU scale (~2 minutes of traffic in all):

    - T1: 20 s of chat at 60 % of ``capacity``;
    - T2: 3 x (``idle`` s of silence, then 2 x ``max_num_seqs`` chat requests within 1 s),
      ``idle`` long enough to serve a burst (1.5 x its size / the chat capacity);
    - T5: :func:`cpu_trace` with ``phase_s`` phases;
    - T6: 20 s of chat at 2 x ``capacity``.

    ``capacity``: the engine's throughput per mix, measured on this machine in the same run
    (``python -m bench.autotune``'s CPU suite does) or :data:`CPU_CAPACITY`, the figures of
    one idle run (this machine's speed moves by up to ~1.5x from day to day: fixed rates
    turn "60 % of capacity" into an overload on a slow day).
    """
    c = capacity
    ref = CPU_CAPACITY
    scale = (c.chat_rps / ref.chat_rps, c.vision_rps / ref.vision_rps,
             c.long_rps / ref.long_rps)
    idle = 1.5 * 2 * c.ceiling / c.chat_rps
    return {
        "T1": build_trace((chat_phase("T1", 20.0, 0.6 * c.chat_rps, c),), seed),
        "T2": on_off_trace("T2", c, period_s=idle + 4.0, idle_s=idle, seed=seed),
        "T5": cpu_trace(seed, phase_s, scale),
        "T6": build_trace((chat_phase("T6", 20.0, 2.0 * c.chat_rps, c),), seed),
    }


def tenants_trace(capacity: Capacity, rates: dict[str, float], seed: int = 0,
                  duration_s: float = 240.0, weights: dict[str, float] | None = None) -> Trace:
    """Tenants sharing one engine: each tenant sends chat requests (the suite's chat mix)
    at ``rates[tenant]`` times ``capacity.chat_rps``, Poisson, for ``duration_s``; the
    requests are merged by arrival. ``weights``: each tenant's weight in fair admission.
    Seeded per tenant, so a tenant's requests are the same whoever else sends."""
    requests: list[TraceRequest] = []
    phases = []
    for i, (tenant, rate) in enumerate(sorted(rates.items())):
        part = build_trace((chat_phase(tenant, duration_s, rate * capacity.chat_rps,
                                       capacity),), seed * 1000 + i)
        phases.append(part.phases[0])
        requests += [replace(r, tenant=tenant) for r in part.requests]
    requests.sort(key=lambda r: r.arrival_s)
    merged = tuple(replace(r, id=i) for i, r in enumerate(requests))
    phase = replace(phases[0], name="tenants", rate_per_s=sum(p.rate_per_s for p in phases))
    return Trace((phase,), merged, seed, tuple(sorted((weights or {}).items())))
