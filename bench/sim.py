"""A deterministic discrete-event model of vLLM's continuous-batching engine behind our gate.

What is modelled, and from where:

- **Engine step** (vLLM V1 ``Scheduler.schedule``): one step schedules the *running* requests
  first, in order (a decode needs 1 token, a partly prefilled prompt its next chunk), then
  *waiting* ones (FCFS) while the token budget ``max_num_batched_tokens`` (chunked prefill)
  and ``max_num_seqs`` allow. A step takes ``a + b * batch + c * prefill_tokens + d *
  encoded_image_tokens + e * context_tokens_read`` seconds (:class:`EngineConfig`); every
  request whose known tokens are all computed at the end of the step samples one token.
- **KV cache** (vLLM ``KVCacheManager``): ``num_gpu_blocks`` blocks of ``block_size`` (16)
  tokens, allocated as tokens are computed. When a running request cannot get a block, the
  newest running request is preempted (``running.pop()``): its blocks are freed, it goes back
  to the *head* of the waiting queue and later re-prefills prompt + generated tokens
  (preemption by recompute). New requests are not scheduled in a step that preempted.
- **Images**: a Phi-3-vision image is ``313..2509`` tokens of the prompt; the vision encoder
  runs once per (re)prefill, costs ``d`` per image token and shares the per-step encoder
  budget (``max_num_batched_tokens``, as vLLM's ``compute_encoder_budget``).
- **Gateway** (:class:`SimGate`): the real :class:`~serve.admission.limiter.AdmissionLimiter`
  arithmetic (slots, completion rate, expected wait) with a synchronous FIFO queue: at most
  ``L`` requests admitted, ``max_queue``, ``max_queue_wait_s`` timeouts and the middleware's
  SLO shedding (expected wait > TTFT target -> rejected at once).
- **Control**: each step emits ``SchedulerStats`` / ``IterationStats``-shaped records into a
  real :class:`~serve.admission.engine_stats.EngineStatsFeed` on the simulated clock, and the real
  :class:`~serve.admission.loop.AutotuneLoop` + :class:`~serve.admission.controller.
  Controller` tick every ``interval_s`` of simulated time and move the gate's limit.

Every request ends either finished or dropped (gateway refusal); goodput is DistServe's
(client-side TTFT incl. queue wait <= target and mean ITL <= target), as
:mod:`serve.admission.middleware` counts it.
"""

from __future__ import annotations

import collections
import functools
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from pathlib import Path

from bench.trace import Trace, TraceRequest
from serve.admission.burst import burst_window_s as burst_window
from serve.admission.capacity import kv_safe_seqs
from serve.admission.controller import Controller, ControllerConfig
from serve.admission.engine_stats import EngineStatsFeed
from serve.admission.fair import FairQueue
from serve.admission.goodput import SloTargets, streamed_good
from serve.admission.limiter import QUEUE_FULL, QUEUE_TIMEOUT, queue_wait_limit
from serve.admission.limiter import SLO as SLO_REJECT
from serve.admission.loop import AutotuneLoop
from serve.admission.prefill import PrefillBacklog, PrefillCosts
from serve.admission.signals import Decision
from serve.admission.slots import LimiterSnapshot, Slot, SlotCounter
from serve.settings import Settings


@dataclass(frozen=True)
class EngineConfig:
    """Constants of the engine model. Times in seconds, sizes in tokens/blocks/requests.

    Attributes:
        step_base_s: ``a``, fixed cost of one step (kernel launches, sampling, scheduling).
        step_per_seq_s: ``b``, extra cost per scheduled sequence (decode attention, KV reads).
        step_per_prefill_token_s: ``c``, cost per prompt token computed (a compute-bound GEMM).
        step_per_image_token_s: ``d``, vision-encoder cost per image token encoded.
        step_per_kv_token_s: ``e``, cost per token of KV cache a scheduled sequence reads
            (attention over its context: memory-bound on a GPU). 0 in :data:`GPU_LIKE`, whose
            ``b`` holds an average.
        max_num_batched_tokens: token budget of one step (chunked prefill).
        max_num_seqs: engine ceiling on running sequences (the limiter's ceiling).
        block_size: tokens per KV block (vLLM's default 16).
        num_gpu_blocks: KV-cache capacity in blocks.
    """

    step_base_s: float = 0.015
    step_per_seq_s: float = 0.00025
    step_per_prefill_token_s: float = 0.00006
    step_per_image_token_s: float = 0.00002
    step_per_kv_token_s: float = 0.0
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    block_size: int = 16
    num_gpu_blocks: int = 3000

    @property
    def kv_capacity_tokens(self) -> int:
        return self.block_size * self.num_gpu_blocks


#: A GPU-like engine for Phi-3-vision (4.2 B parameters; 32 layers x K,V x 3072 x 2 bytes =
#: 384 KiB of bf16 KV cache per token, no GQA): 15 ms per step + 0.25 ms per sequence +
#: 0.06 ms per prefill token (~ an A100/L40S-class GPU: a full 8192-token prefill step ~0.5 s),
#: the CLIP vision encoder at ~1/3 of the LM's per-token prefill cost (ViT-L/14-336, ~0.3 B
#: parameters over 576 patches per 144-token crop), and 3000 KV blocks = 48k tokens (18 GiB of
#: KV cache: a 40-48 GB card after the 8 GiB of weights and activations).
GPU_LIKE = EngineConfig()

# --- H200 profile: the full-size Phi-3-vision on one NVIDIA H200, from first principles -------
#: H200 SXM: 141 GB of HBM3e at 4.8 TB/s, 989 TFLOP/s dense bf16 (NVIDIA H200 datasheet).
H200_HBM_BYTES = 141e9
H200_HBM_BYTES_PER_S = 4.8e12
H200_BF16_FLOP_PER_S = 989e12
#: Fractions of the peaks a serving engine reaches: ~80 % of HBM bandwidth in a memory-bound
#: decode (streaming GEMV / paged attention), ~50 % model FLOP utilisation in a large prefill
#: (typical of dense transformer inference; MLPerf-class kernels reach 60-70 %).
H200_BW_EFFICIENCY = 0.8
H200_MFU = 0.5
#: Phi-3-vision: 3.8 B language-model parameters (Phi-3-mini) + the CLIP ViT-L/14-336 vision
#: tower (0.30 B; 577 positions per 336-px crop, 144 image tokens per crop after the 2x2
#: merge), bf16 (2 bytes). KV bytes per token: the planner's ``kv_bytes_per_token`` of the
#: full config (32 layers x (K, V) x 32 heads x 96 dims x 2 bytes = 384 KiB, no GQA).
PHI3V_LM_PARAMS = 3.8e9
PHI3V_CLIP_PARAMS = 0.30e9
#: vLLM V1's per-step CPU work with CUDA graphs (scheduling, input preparation, sampling,
#: detokenisation): ~2.5 ms per step, measured on H100-class hosts in vLLM's V1 design notes.
STEP_CPU_OVERHEAD_S = 0.0025


@functools.lru_cache(maxsize=None)
def h200_profile() -> EngineConfig:
    """The engine model of the full-size Phi-3-vision on one H200, from first principles.

    Step time ``a + b*batch + c*prefill + d*image + e*kv_read`` (seconds):

    - ``a`` = LM weights / (bandwidth x 0.8) + CPU overhead: every step streams the 7.6 GB of
      LM weights once (1.98 ms) + 2.5 ms = 4.5 ms;
    - ``b`` = 20 us per sequence (sampling, per-sequence kernel work);
    - ``c`` = 2 x 3.8e9 FLOP per prompt token (Kaplan et al. 2020: 2N per token) at 50 % of
      989 TFLOP/s = 15.4 us per prefill token (image tokens included: the LM prefills them);
    - ``d`` = the CLIP tower: 2 x 0.30e9 FLOP x 577 positions per crop / 144 image tokens per
      crop at 50 % MFU = 4.9 us per image token;
    - ``e`` = 384 KiB of KV read per context token at 80 % of 4.8 TB/s = 0.10 us.

    KV blocks: the capacity planner's figure (:mod:`serve.plan`: vLLM V1's
    ``gpu_memory_utilization`` x memory - weights - activation peak - non-torch memory - CUDA
    graphs, in blocks of 16 tokens x 384 KiB) for 141 GB at the GPU defaults of
    :class:`~serve.settings.Settings`.
    """
    from serve.models.build import model_config
    from serve.plan import Deployment, ModelShape, gpu_kv_cache_bytes, kv_bytes_per_token, plan_row

    shape = ModelShape.from_config(model_config("full"), "bfloat16")
    dep = Deployment()
    row = plan_row("H200", gpu_kv_cache_bytes(int(H200_HBM_BYTES), shape, dep), shape, dep)
    bw = H200_HBM_BYTES_PER_S * H200_BW_EFFICIENCY
    flops = H200_BF16_FLOP_PER_S * H200_MFU
    return EngineConfig(
        step_base_s=2 * PHI3V_LM_PARAMS / bw + STEP_CPU_OVERHEAD_S,
        step_per_seq_s=20e-6,
        step_per_prefill_token_s=2 * PHI3V_LM_PARAMS / flops,
        step_per_image_token_s=2 * PHI3V_CLIP_PARAMS * 577 / 144 / flops,
        step_per_kv_token_s=kv_bytes_per_token(shape) / bw,
        block_size=dep.block_size, num_gpu_blocks=row.blocks)


#: The committed ``cpu`` profile: this machine's tiny engine, fitted by ``python -m
#: bench.calibrate --update`` from vLLM's per-step timing (the file says when and how).
CPU_PROFILE_PATH = Path(__file__).resolve().parent / "cpu-profile.json"


def cpu_profile(path: Path = CPU_PROFILE_PATH) -> EngineConfig:
    """The engine model of the tiny Phi-3-vision on this machine's CPU, as
    :mod:`bench.calibrate` fitted it (``path``: its ``cpu-profile.json``).
    Raises FileNotFoundError / KeyError for a missing file or field."""
    engine = json.loads(path.read_text())["engine"]
    return EngineConfig(**{f.name: engine[f.name] for f in fields(EngineConfig)})


#: The simulator's engine profiles by name (``make bench-autotune`` runs the suite on each).
PROFILES: dict[str, Callable[[], EngineConfig]] = {"gpu-like": lambda: GPU_LIKE,
                                                   "h200": h200_profile,
                                                   "cpu": cpu_profile}


@dataclass(frozen=True)
class Setup:
    """Everything around the engine model that ``serve.settings`` fixes on a real server.

    Attributes:
        engine: engine constants (its ``max_num_seqs`` is the controller's ceiling).
        slo: latency targets: controller targets, SLO shedding and goodput, seconds.
        controller: the autotuner's constants (``ceiling`` = ``engine.max_num_seqs``).
        start_limit: auto's starting limit, requests.
        interval_s: seconds between autotuner ticks.
        window_s: sliding window of the TTFT/ITL percentiles, seconds.
        max_queue: most requests queued at the gateway; one more is rejected ``queue_full``.
        max_queue_wait_s: seconds a request may wait for a slot before ``queue_timeout``.
        slo_shedding: reject at once a request whose expected queue wait exceeds the TTFT
            target (what :class:`~serve.admission.middleware.AdmissionMiddleware` does).
        engine_queue: requests admitted past the limit at the ceiling, waiting in the
            engine (the limiter's ``engine_queue``, bounded by the TTFT target as there).
    """

    engine: EngineConfig
    slo: SloTargets
    controller: ControllerConfig
    start_limit: int
    interval_s: float
    window_s: float
    max_queue: int
    max_queue_wait_s: float
    slo_shedding: bool = True
    engine_queue: int = 0

    @classmethod
    def default(cls) -> "Setup":
        """A server with the default GPU settings on the :data:`GPU_LIKE` engine (every value
        from :class:`~serve.settings.Settings`: no default is restated here)."""
        return cls.from_settings(Settings(device="cuda"))

    @classmethod
    def from_settings(cls, settings: Settings, engine: EngineConfig = GPU_LIKE) -> "Setup":
        """The setup a server with these settings runs (GPU defaults for ``device=cuda``).

        The controller constants come from :meth:`ControllerConfig.from_settings`, as in
        the server; the engine takes the settings' ``max_num_seqs`` and
        ``max_num_batched_tokens``. ``start_limit`` is what ``autotune=auto`` starts from on a
        server with this engine: the KV-safe capacity of its KV cache
        (:func:`serve.admission.capacity.kv_safe_seqs`), unless the settings fix a limit.
        """
        s = settings.model_copy(update={"autotune": "auto"}).resolved()
        config = ControllerConfig.from_settings(s)
        engine = replace(engine, max_num_seqs=s.max_num_seqs,
                         max_num_batched_tokens=s.max_num_batched_tokens)
        start = s.admission_limit if s.admission_limit_explicit else kv_safe_seqs(
            engine.kv_capacity_tokens, s.num_crops, s.max_num_seqs)
        return cls(engine=engine, slo=SloTargets(s.slo_ttft_s, s.slo_itl_s), controller=config,
                   start_limit=start, interval_s=s.autotune_interval_s,
                   window_s=s.autotune_window_s, max_queue=s.max_queue,
                   max_queue_wait_s=s.max_queue_wait_s, engine_queue=s.engine_queue)


@dataclass(frozen=True)
class SchedulerStats:
    """The fields of vLLM's ``SchedulerStats`` that :class:`EngineStatsFeed` reads."""

    num_running_reqs: int
    num_waiting_reqs: int
    kv_cache_usage: float


@dataclass(frozen=True)
class FinishedRequestStats:
    """The fields of vLLM's ``FinishedRequestStats`` that :class:`EngineStatsFeed` reads
    (seconds)."""

    num_prompt_tokens: int
    num_generation_tokens: int
    num_preemptions: int
    mean_time_per_output_token: float


@dataclass(frozen=True)
class IterationStats:
    """The fields of vLLM's ``IterationStats`` that a stat logger can read (seconds)."""

    num_preempted_reqs: int
    num_prompt_tokens: int
    time_to_first_tokens_iter: list[float]
    inter_token_latencies_iter: list[float]
    finished_requests: list[FinishedRequestStats]


@dataclass
class RequestResult:
    """What happened to one request. Times are seconds on the trace clock (None: never).

    Attributes:
        request: the trace request.
        admitted_s: when the gateway let it into the engine.
        first_token_s: when its first token was sampled (end of that step).
        finish_s: when its last token was sampled.
        tokens: output tokens generated.
        preemptions: times the engine preempted it.
        dropped: gateway rejection reason (``queue_full``, ``queue_timeout``, ``slo``) or None.
        dropped_s: when it was rejected.
    """

    request: TraceRequest
    admitted_s: float | None = None
    first_token_s: float | None = None
    finish_s: float | None = None
    tokens: int = 0
    preemptions: int = 0
    dropped: str | None = None
    dropped_s: float | None = None

    @property
    def arrival_s(self) -> float:
        return self.request.arrival_s

    @property
    def finished(self) -> bool:
        return self.finish_s is not None

    @property
    def ttft_s(self) -> float | None:
        """Client-side time to first token, queue wait included, seconds."""
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s

    @property
    def mean_itl_s(self) -> float | None:
        """Mean inter-token latency after the first token (TPOT), seconds; None for 1 token."""
        if self.finish_s is None or self.tokens < 2:
            return None
        return (self.finish_s - self.first_token_s) / (self.tokens - 1)

    def good(self, slo: SloTargets) -> bool:
        """Finished within both targets (the server's rule for a stream,
        ``serve.admission.goodput``)."""
        return self.finished and streamed_good(self.ttft_s, self.mean_itl_s, slo)


@dataclass
class RunResult:
    """One simulation run.

    Attributes:
        label: ``auto`` or ``L=<n>``.
        requests: per-request outcomes, in trace order.
        limits: ``(t, limit)`` after every autotuner tick (seconds, requests).
        decisions: every controller decision (auto) or ``static`` hold.
        preemptions: engine preemptions in total.
        steps: engine steps run.
        end_s: simulated time when the last request ended.
    """

    label: str
    requests: list[RequestResult]
    limits: list[tuple[float, int]]
    decisions: list[Decision]
    preemptions: int
    steps: int
    end_s: float


class _Seq:
    """Engine-side state of one admitted request (hot loop: slots only)."""

    __slots__ = ("result", "prompt", "image_tokens", "out", "computed", "generated",
                 "blocks", "last_token_s", "slot")

    def __init__(self, result: RequestResult, slot: Slot) -> None:
        req = result.request
        self.result = result
        self.prompt = req.prompt_tokens
        self.image_tokens = req.image_tokens
        self.out = req.output_tokens
        self.computed = 0      # tokens whose KV is in the cache
        self.generated = 0     # output tokens sampled
        self.blocks = 0        # KV blocks held
        self.last_token_s = 0.0
        self.slot = slot


class SimGate:
    """The simulator's admission gate: the server's fair queue
    (:class:`~serve.admission.fair.FairQueue`, one FIFO per tenant) over the server's
    :class:`~serve.admission.limiter.SlotCounter`, both used through their public interfaces.

    Slot counting, a burst's prefill budget (on each request's prompt tokens: the trace's
    exact count, where the server has its intake's estimate), the completion-rate window and
    the expected-wait estimate are the real counter's; only the queue (asyncio futures in
    :class:`AdmissionLimiter`, plain items here) differs. The autotuner sees the limiter's
    interface: ``snapshot()``, ``limit``, ``set_limit()``, ``set_burst_budget()``,
    ``in_flight``, ``pending``.

    Args:
        limit, max_queue, max_queue_wait_s, clock: as :class:`AdmissionLimiter`.
        shed_ttft_s: TTFT target for SLO shedding (and the engine queue's bound), None to
            disable it.
        ceiling, engine_queue, ablate: as :class:`SlotCounter` (no engine queue by default).
        step_tokens: the engine's ``max_num_batched_tokens`` (the prefill backlog's steps:
            :class:`~serve.admission.prefill.PrefillBacklog`).
        on_admit: called with ``(result, slot)`` when a request enters the engine.
        on_drop: called with ``(result, reason)`` when the gate rejects a request.
        weights: each tenant's weight in fair admission (1 if absent).
    """

    def __init__(self, limit: int, max_queue: int, max_queue_wait_s: float,
                 clock: Callable[[], float], shed_ttft_s: float | None,
                 on_admit: Callable[[RequestResult, Slot], None],
                 on_drop: Callable[[RequestResult, str], None],
                 ceiling: int | None = None, engine_queue: int = 0,
                 burst_window_s: float = 2.0, ablate: frozenset[str] = frozenset(),
                 weights: dict[str, float] | None = None, step_tokens: int = 0,
                 itl_target_s: float | None = None) -> None:
        self.slots = SlotCounter(limit, clock=clock, on_free=self._wake, ceiling=ceiling,
                                 engine_queue=engine_queue, engine_queue_wait_s=shed_ttft_s,
                                 burst_window_s=burst_window_s, ablate=ablate)
        self.max_queue = max_queue
        self.max_queue_wait_s = max_queue_wait_s
        self.clock = clock
        self.queue: FairQueue[RequestResult] = FairQueue(ablate)
        self.backlog = PrefillBacklog(shed_ttft_s, step_tokens, ablate=ablate,
                                      itl_target_s=itl_target_s, clock=clock)
        self.weights = weights or {}
        self.shed_ttft_s = shed_ttft_s
        self.on_admit = on_admit
        self.on_drop = on_drop
        #: id(queued result) -> (latest admission time, whether the TTFT deadline set it).
        self._deadlines: dict[int, tuple[float, bool]] = {}
        #: Queued requests of a burst's first wave, which got no deadline (the limiter's
        #: ``_first_wave``).
        self._first_wave: list[RequestResult] = []

    @property
    def limit(self) -> int:
        return self.slots.limit

    @property
    def in_flight(self) -> int:
        return self.slots.in_flight

    @property
    def pending(self) -> int:
        return len(self.queue)

    def set_limit(self, limit: int) -> None:
        self.slots.set_limit(limit)

    def set_burst_budget(self, tokens: int | None, cap: int | None = None,
                         rate: float | None = None) -> None:
        self.slots.set_burst_budget(tokens, cap, rate)

    def snapshot(self) -> LimiterSnapshot:
        return self.slots.snapshot(self.pending)

    def offer(self, result: RequestResult) -> None:
        """A request arrives now: admit, queue or reject it (the middleware's ``_acquire``)."""
        self.slots.arrived()
        if self._first_wave:
            self._end_first_wave()
        req = result.request
        tokens, tenant = req.prompt_tokens, req.tenant
        cost = self.backlog.cost(tokens, req.image_tokens)
        if not self.queue and self.backlog.admits_at(cost, self.slots) and \
                self.slots.admits(tokens):
            self.queue.started(tenant)
            self._enter(result, self.slots.take(result.arrival_s, tokens), tenant, cost)
            return
        if self.queue.pending(tenant) >= self.max_queue:
            self.on_drop(result, QUEUE_FULL)
            return
        if self.slots.slo_wait_s(self.queue.position(tenant), self.shed_ttft_s,
                                 self.queue.ahead(tenant, self.slots.ahead())) is not None or \
                self._hopeless(result, cost, self.queue.position(tenant)):
            self.on_drop(result, SLO_REJECT)
            return
        # The limiter's wait bound, fixed when the request queues (AdmissionLimiter.acquire).
        wait, deadline = queue_wait_limit(self.slots, self.queue, tenant, self.shed_ttft_s,
                                          self.max_queue_wait_s)
        self._deadlines[id(result)] = (result.arrival_s + wait, deadline)
        self.queue.push(tenant, result, self.weights.get(tenant, 1.0))
        if self.shed_ttft_s is not None and not deadline and self.slots.first_wave() and \
                self.queue.over_share(tenant):
            self._first_wave.append(result)

    def _end_first_wave(self) -> None:
        """The limiter's ``_end_first_wave``: once the open burst outgrew its first wave, the
        first wave's requests still queued get the queue deadline from their arrival."""
        ended = self.slots.first_wave_ended()
        if ended is False:
            return
        waiting, self._first_wave = self._first_wave, []
        bound = self.slots.queue_wait_bound_s(self.shed_ttft_s) if ended else None
        for result in waiting:
            latest = self._deadlines.get(id(result))
            if bound is not None and latest is not None and \
                    result.arrival_s + bound < latest[0]:
                self._deadlines[id(result)] = (result.arrival_s + bound, True)

    def _enter(self, result: RequestResult, slot: Slot, tenant: str, cost: float) -> None:
        """``result`` enters the engine with ``slot`` (``tenant``'s), predicted to prefill
        in ``cost`` seconds: the limiter's ``_granted``."""
        key, tokens = id(result), result.request.prompt_tokens
        if self.backlog.on:
            self.backlog.add(key, cost, tokens)

        def released() -> None:
            self.queue.finished(tenant)
            self.backlog.discard(key)
        slot.on_release = released
        self.on_admit(result, slot)

    def _hopeless(self, result: RequestResult, cost: float, position: float) -> bool:
        """The limiter's ``_hopeless``: :meth:`PrefillBacklog.hopeless_behind` this queue,
        while the request's tenant is the only one active."""
        backlog = self.backlog
        return self.queue.share(result.request.tenant) >= 1.0 and backlog.hopeless_behind(
            self.clock() - result.arrival_s, cost, result.request.prompt_tokens, position,
            ((backlog.cost(r.request.prompt_tokens, r.request.image_tokens),
              r.request.prompt_tokens) for r in self.queue.items()))

    def first_tokens(self, n: int) -> None:
        """The engine produced ``n`` first tokens (the limiter's ``first_tokens``)."""
        if self.backlog.first_tokens(n):
            self._wake()

    def expire(self) -> None:
        """Reject queued requests past their wait bound: ``max_queue_wait_s``, or the TTFT
        deadline (:meth:`SlotCounter.queue_wait_bound_s`, reason ``slo``). Only each FIFO's
        head is checked, as it is the only one :meth:`_wake` admits next (a later request's
        deadline can come first when the bound shrank; it is refused once it is a head)."""
        now = self.clock()
        expired = True
        while expired:
            expired = [(t, r) for t, r in self.queue.heads()
                       if now > self._deadlines[id(r)][0]]
            for tenant, result in expired:
                self.queue.remove(tenant, result)
                _, deadline = self._deadlines.pop(id(result))
                self.on_drop(result, SLO_REJECT if deadline else QUEUE_TIMEOUT)

    def _wake(self) -> None:
        self.expire()
        while (head := self.queue.head()) is not None:
            tenant, result = head
            req = result.request
            cost = self.backlog.cost(req.prompt_tokens, req.image_tokens)
            if self._hopeless(result, cost, 0):
                self.queue.pop(tenant)
                del self._deadlines[id(result)]
                self.on_drop(result, SLO_REJECT)
                continue
            if not self.backlog.admits_at(cost, self.slots) or \
                    not self.slots.admits(req.prompt_tokens, result.arrival_s):
                break
            self.queue.pop(tenant)
            del self._deadlines[id(result)]
            self._enter(result, self.slots.take(result.arrival_s, req.prompt_tokens,
                                                queued=True), tenant, cost)


#: The prefill probes' prompts, tokens: short and long text, and an image prompt (a 336 x 336
#: photo at 4 crops: 757 image tokens, and 16 of text), as the server's boot probes
#: (``serve.admission.probe``).
PROBE_SHORT, PROBE_LONG, PROBE_IMAGE = 16, 1024, (773, 757)


def alone_ttft_s(engine: EngineConfig, tokens: int, image_tokens: int = 0) -> float:
    """Seconds from admission to the first token of a prompt of ``tokens`` tokens
    (``image_tokens`` of them image tokens) alone on an idle engine of the model
    (:meth:`Simulation._schedule`'s step time, prefilled in chunks of
    ``max_num_batched_tokens``)."""
    total, done = 0.0, 0
    while done < tokens:
        n = min(engine.max_num_batched_tokens, tokens - done)
        total += (engine.step_base_s + engine.step_per_seq_s
                  + engine.step_per_prefill_token_s * n
                  + (engine.step_per_image_token_s * image_tokens if not done else 0.0)
                  + engine.step_per_kv_token_s * (done + n))
        done += n
    return total


@functools.lru_cache(maxsize=None)
def probe_costs(engine: EngineConfig) -> PrefillCosts:
    """The prefill costs the server's boot probes would measure on this engine model
    (:meth:`PrefillCosts.from_probes` on :func:`alone_ttft_s` of the probes' prompts)."""
    long = min(PROBE_LONG, engine.max_num_batched_tokens)
    tokens, image = PROBE_IMAGE
    return PrefillCosts.from_probes((PROBE_SHORT, alone_ttft_s(engine, PROBE_SHORT)),
                                    (long, alone_ttft_s(engine, long)),
                                    (tokens, image, alone_ttft_s(engine, tokens, image)))


class _NoGpu:
    """GPU utilization source of the simulator: unavailable (as on CPU)."""

    available = False

    def read(self) -> None:
        return None


class Simulation:
    """One run of a trace through the gate and the engine model.

    Args:
        trace: the workload.
        mode: ``auto`` (the controller moves the limit), ``static`` (fixed ``limit``) or
            ``unlimited`` (no gateway limit, queue or shedding: every request goes straight
            to the engine, whose own ``max_num_seqs`` and waiting queue are all there is,
            as with plain vLLM).
        limit: the static limit; None: ``setup.start_limit`` (auto's start), requests.
        setup: engine, SLO, controller and gateway constants (:meth:`Setup.default` when
            None).
        on_step: called with the simulation after every engine step (tests: invariants).
    """

    def __init__(self, trace: Trace, mode: str = "auto", limit: int | None = None,
                 setup: Setup | None = None,
                 on_step: Callable[["Simulation"], None] | None = None) -> None:
        setup = setup if setup is not None else Setup.default()
        engine = setup.engine
        longest = max((r.prompt_tokens + r.output_tokens for r in trace.requests), default=0)
        if -(-longest // engine.block_size) > engine.num_gpu_blocks:
            # vLLM refuses to start when max_model_len does not fit in the KV cache.
            raise ValueError(f"a {longest}-token request does not fit in "
                             f"{engine.kv_capacity_tokens} tokens of KV cache")
        self.trace = trace
        self.mode = mode
        self.setup = setup
        self.engine = engine
        self.now = 0.0
        self.on_step = on_step
        self.results = [RequestResult(r) for r in trace.requests]
        self.running: list[_Seq] = []
        self.waiting: collections.deque[_Seq] = collections.deque()
        self.free_blocks = engine.num_gpu_blocks
        self.preemptions = 0
        self.steps = 0
        if mode not in ("auto", "static", "unlimited"):
            raise ValueError(f"unknown mode {mode!r}")
        unlimited = mode == "unlimited"
        if unlimited:
            limit = max(1, len(trace.requests))  # never binds: the gate admits at once
        limit = setup.start_limit if limit is None else limit
        self.gate = SimGate(limit, setup.max_queue, setup.max_queue_wait_s, self.clock,
                            setup.slo.ttft_s if setup.slo_shedding and not unlimited
                            else None, self._admit, self._drop,
                            ceiling=None if unlimited else engine.max_num_seqs,
                            engine_queue=setup.engine_queue,
                            burst_window_s=burst_window(setup.slo.ttft_s, setup.interval_s),
                            ablate=setup.controller.ablate if mode == "auto" else frozenset(),
                            weights=dict(trace.weights),
                            step_tokens=engine.max_num_batched_tokens,
                            itl_target_s=setup.slo.itl_s)
        self.gate.backlog.costs = probe_costs(engine)
        self.feed = EngineStatsFeed(window_s=setup.window_s, clock=self.clock,
                                    step_tokens=engine.max_num_batched_tokens,
                                    ttft_target_s=setup.slo.ttft_s)
        config = replace(setup.controller, ceiling=engine.max_num_seqs,
                         min_seqs=min(setup.controller.min_seqs, engine.max_num_seqs))
        if unlimited:
            config = replace(config, ceiling=limit)
        self.loop = AutotuneLoop(Controller(config, limit, history=1_000_000), self.gate,
                                   self.feed, mode="auto" if mode == "auto" else "static",
                                   interval_s=setup.interval_s,
                                   gpu=_NoGpu(), clock=self.clock)
        self.loop.controller.set_capacity(engine.kv_capacity_tokens)
        self.limits: list[tuple[float, int]] = [(0.0, self.gate.limit)]

    def clock(self) -> float:
        """The simulated clock, seconds."""
        return self.now

    # --- gate callbacks -------------------------------------------------------------------
    def _admit(self, result: RequestResult, slot: Slot) -> None:
        result.admitted_s = self.now
        self.waiting.append(_Seq(result, slot))

    def _drop(self, result: RequestResult, reason: str) -> None:
        result.dropped = reason
        result.dropped_s = (result.arrival_s + self.gate.max_queue_wait_s
                            if reason == QUEUE_TIMEOUT else self.now)

    # --- engine ---------------------------------------------------------------------------
    @property
    def kv_used_blocks(self) -> int:
        return self.engine.num_gpu_blocks - self.free_blocks

    def _preempt_newest(self) -> _Seq:
        seq = self.running.pop()
        self.free_blocks += seq.blocks
        seq.blocks = 0
        seq.computed = 0
        seq.result.preemptions += 1
        self.waiting.appendleft(seq)
        self.preemptions += 1
        return seq

    def _schedule(self) -> tuple[list[tuple[_Seq, int]], float, int]:
        """One scheduler pass: ``(scheduled (seq, tokens), step seconds, preempted)``."""
        eng = self.engine
        bs = eng.block_size
        budget = eng.max_num_batched_tokens
        encoder_budget = eng.max_num_batched_tokens
        scheduled: list[tuple[_Seq, int]] = []
        prefill = encoded = preempted = 0
        running = self.running
        i = 0
        while i < len(running) and budget > 0:
            seq = running[i]
            need = seq.prompt + seq.generated - seq.computed
            n = need if need < budget else budget
            extra = -(-(seq.computed + n) // bs) - seq.blocks
            if extra > self.free_blocks:
                victim = None
                while extra > self.free_blocks and victim is not seq:
                    victim = self._preempt_newest()
                    preempted += 1
                if victim is seq:
                    break  # the request itself was the newest: it waits, the pass ends
            self.free_blocks -= extra
            seq.blocks += extra
            scheduled.append((seq, n))
            budget -= n
            if need > 1:
                prefill += n
            i += 1
        if not preempted:
            waiting = self.waiting
            while waiting and budget > 0 and len(running) < eng.max_num_seqs:
                seq = waiting[0]
                if seq.image_tokens and seq.image_tokens > encoder_budget:
                    break
                need = seq.prompt + seq.generated
                n = need if need < budget else budget
                blocks = -(-n // bs)
                if blocks > self.free_blocks:
                    break
                waiting.popleft()
                running.append(seq)
                self.free_blocks -= blocks
                seq.blocks = blocks
                scheduled.append((seq, n))
                budget -= n
                prefill += n
                encoded += seq.image_tokens
                encoder_budget -= seq.image_tokens
        dt = (eng.step_base_s + eng.step_per_seq_s * len(scheduled)
              + eng.step_per_prefill_token_s * prefill + eng.step_per_image_token_s * encoded)
        if eng.step_per_kv_token_s:
            dt += eng.step_per_kv_token_s * sum(seq.computed + n for seq, n in scheduled)
        return scheduled, dt, preempted

    def _complete(self, scheduled: list[tuple[_Seq, int]], preempted: int) -> None:
        """End of a step at ``self.now``: sample tokens, finish requests, report stats."""
        now = self.now
        ttfts: list[float] = []
        itls: list[float] = []
        finished = prompt_done = 0
        for seq, n in scheduled:
            seq.computed += n
            if seq.computed < seq.prompt + seq.generated:
                continue  # a prefill chunk that did not reach the end of the prompt
            seq.generated += 1
            result = seq.result
            if seq.generated == 1:
                prompt_done += seq.prompt
            if result.first_token_s is None:
                result.first_token_s = now
                ttfts.append(now - result.admitted_s)
            else:
                itls.append(now - seq.last_token_s)
            seq.last_token_s = now
            if seq.generated >= seq.out:
                finished += 1
        done: list[FinishedRequestStats] = []
        if finished:
            keep = []
            for seq in self.running:
                if seq.generated >= seq.out:
                    self._finish(seq, done)
                else:
                    keep.append(seq)
            self.running[:] = keep
        eng = self.engine
        self.feed.record(
            SchedulerStats(len(self.running), len(self.waiting),
                           self.kv_used_blocks / eng.num_gpu_blocks),
            IterationStats(preempted, prompt_done, ttfts, itls, done))

    def _finish(self, seq: _Seq, done: list[FinishedRequestStats]) -> None:
        """Free a finished sequence's blocks and slot; report it like vLLM does."""
        self.free_blocks += seq.blocks
        seq.blocks = 0
        result = seq.result
        result.finish_s = self.now
        result.tokens = seq.generated
        seq.slot.release(completed=True, first_token_at=result.first_token_s)
        done.append(FinishedRequestStats(
            seq.prompt, seq.generated, result.preemptions,
            (self.now - result.first_token_s) / max(1, seq.generated - 1)))

    # --- event loop -----------------------------------------------------------------------
    def _events_until(self, t: float) -> None:
        """Process arrivals and autotuner ticks up to ``t``, in time order."""
        results, i = self.results, self._next_arrival
        while True:
            arrival = results[i].arrival_s if i < len(results) else math.inf
            nxt = min(arrival, self._next_tick)
            if nxt > t:
                break
            self.now = nxt
            if arrival <= self._next_tick:
                self.gate.expire()
                self.gate.offer(results[i])
                i += 1
            else:
                self.gate.expire()
                self.loop.tick()
                self.limits.append((self.now, self.gate.limit))
                self._next_tick += self.loop.interval_s
        self._next_arrival = i

    def run(self) -> RunResult:
        """Simulate the whole trace; returns when every request has finished or been dropped."""
        self._next_arrival = 0
        self._next_tick = self.loop.interval_s
        n = len(self.results)
        while True:
            if self.running or self.waiting:
                scheduled, dt, preempted = self._schedule()
                t_end = self.now + dt
                self._events_until(t_end)
                self.now = t_end
                self._complete(scheduled, preempted)
                self.steps += 1
                if self.on_step is not None:
                    self.on_step(self)
            elif self._next_arrival < n or self.gate.queue:
                self._events_until(min(self.results[self._next_arrival].arrival_s
                                       if self._next_arrival < n else math.inf,
                                       self._next_tick))
            else:
                break
            self.gate.expire()
        label = self.mode if self.mode != "static" else f"L={self.gate.limit}"
        return RunResult(label, self.results, self.limits,
                         list(self.loop.controller.decisions), self.preemptions,
                         self.steps, self.now)


def simulate(trace: Trace, mode: str = "auto", limit: int | None = None,
             setup: Setup | None = None) -> RunResult:
    """Run one :class:`Simulation` of ``trace``; see its arguments."""
    return Simulation(trace, mode, limit, setup).run()
