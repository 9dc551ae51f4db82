"""The live ``max_num_seqs`` autotuner: a pure controller (signals in, new limit + reason out).

Algorithm: AIMD with hysteresis, gated by latency headroom, bounded by what the KV cache
holds, and restored on idle to what the recent traffic fits.

- **Decrease** multiplicatively (``limit x decrease_factor``) on any sign of overload
  (:meth:`Controller.overload_reason`): KV-cache usage at or above ``kv_high_ratio`` (vLLM
  preempts past it) while requests queue at the gateway, the engine-side TTFT p90 over its
  target, the p90 of the finished requests' mean inter-token latency (TPOT) over the ITL
  target.
- **Increase** additively (``max(1, ceil(limit x increase_ratio))``, at most ``max_step``)
  only when the limit is what binds (in flight >= limit), requests are queued at the gateway,
  and both latencies are below ``headroom`` x target (and GPU utilization, when known, is not
  saturated); never past the **KV fit** (:func:`serve.admission.fits.kv_fit`: what the
  cache holds at the running requests' mean size up to ``kv_probe_ratio``, below the KV cut's
  ``kv_high_ratio``; past it vLLM preempts). The requests the
  next probe would admit are queued, not shed for their expected wait
  (:meth:`Controller.probe_room`).
- **Restore** on idle (nothing in flight or queued, nothing arrived since the last sample):
  the limit becomes :meth:`Controller.idle_limit`, the boot figure (``start``, the KV-safe
  capacity) until requests have finished, then what the recent traffic fits: its KV size fit
  (:mod:`serve.admission.fits`). An idle engine must take
  the next burst at once, at a size it serves within the targets. A server refusing every
  arrival is empty, not idle: it keeps its limit.
- **Hold** otherwise: the band between ``headroom`` x target and target is the hysteresis
  that prevents oscillation under steady load.
- **Burst budget** (:meth:`Controller.burst_budget`): the prompt tokens the engine prefills
  within the TTFT target; the limiter's burst admission (:mod:`serve.admission.burst`) lets
  a burst that reaches an idle engine in past the limit by it, up to
  :meth:`Controller.burst_cap`. The controller computes it; it never moves the limit.
- Bounds ``[min_seqs, ceiling]`` always; ``ceiling`` is the engine's ``--max-num-seqs``.

The controller is the only writer of the limit. Every rule past plain AIMD is named in
:data:`serve.admission.rules.RULES` and earned its place in the ablation of
``python -m bench.ablate`` (docs/admission.md has the table); rules whose
removal cost less than 2 % goodput on every trace and profile of the simulator over ten
seeds were removed.

Sources: Netflix concurrency-limits ``AIMDLimit`` (multiplicative backoff on a latency
signal, additive probe, algorithm separate from enforcement), Envoy adaptive concurrency
filter (periodic sampling interval, named constants, min/max bounds), TCP congestion
avoidance (AIMD, Chiu & Jain 1989) and DistServe (Zhong et al., OSDI 2024) for the
objective: goodput = completed requests per second meeting both their TTFT and ITL (TPOT)
targets. The latency signals are measured *engine-side* (from admission, excluding the
gateway queue) so that queueing caused by a too-small limit is read as demand, not as
overload.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import asdict, dataclass, field

from serve.admission import fits
from serve.admission.rules import check as check_rules
from serve.admission.signals import Decision, Direction, Signals


@dataclass(frozen=True)
class ControllerConfig:
    """Constants of the autotuner; each has a unit and a reason. Their defaults are written
    once, in :class:`serve.settings.Settings` (``--autotune-*``, ``--slo-*``, ``--min-seqs``,
    ``--max-num-seqs``); build one with :meth:`from_settings`. Only ``gpu_busy_ratio``, which
    no setting exposes, has its default here.

    Attributes:
        min_seqs: floor of the limit (requests). Never starve the engine completely.
        ceiling: top of the limit (requests): the engine's ``max_num_seqs``.
        ttft_target_s: TTFT target in seconds (p90, engine-side).
        itl_target_s: inter-token latency target in seconds (p90).
        headroom: increase only while latency < headroom x target (0.7: 30 % margin keeps the
            next step from overshooting; the gap to 1.0 is the hysteresis band).
        decrease_factor: multiplicative backoff (0.9: TCP-like halving is too harsh for a
            batch engine whose latency grows sub-linearly with batch size, and the requests
            in flight past a cut limit drain over several decisions, each of which may cut
            again).
        increase_ratio: additive step as a fraction of the limit (0.25: reach the ceiling from
            1 in ~O(log) ticks early on, gently near the top).
        max_step: most requests added per tick (bounds the overshoot of one probe).
        kv_high_ratio: KV-cache usage (0-1) treated as full: vLLM preempts soon after.
        kv_probe_ratio: KV-cache usage (0-1, at most ``kv_high_ratio``) a probe may fill at
            the running requests' mean size (:meth:`Controller.kv_fit`): the gap below
            ``kv_high_ratio`` is the hysteresis band of the KV cut, as ``headroom`` is for
            latency (a probe that lands at the cut's threshold is cut back at the next
            decision).
        gpu_busy_ratio: GPU utilization (0-1) above which adding sequences is not expected to
            add throughput; ignored where utilization is unavailable (CPU).
        ablate: names of :data:`serve.admission.rules.RULES` switched off (the ablation
            benchmark only; empty in the server).
    """

    min_seqs: int
    ceiling: int
    ttft_target_s: float
    itl_target_s: float
    headroom: float
    decrease_factor: float
    increase_ratio: float
    max_step: int
    kv_high_ratio: float
    kv_probe_ratio: float
    gpu_busy_ratio: float = 0.98
    ablate: frozenset[str] = frozenset()

    @classmethod
    def from_settings(cls, settings) -> "ControllerConfig":
        """The constants of ``settings`` (a :class:`serve.settings.Settings`, resolved for the
        hardware here; not imported, so this module stays standard-library only)."""
        s = settings.resolved()
        return cls(
            min_seqs=min(s.min_seqs, s.max_num_seqs), ceiling=s.max_num_seqs,
            ttft_target_s=s.slo_ttft_s, itl_target_s=s.slo_itl_s,
            headroom=s.autotune_headroom, decrease_factor=s.autotune_decrease_factor,
            increase_ratio=s.autotune_increase_ratio, max_step=s.autotune_max_step,
            kv_high_ratio=s.autotune_kv_high_ratio,
            # A cut threshold lowered under the probe's default takes the probe down with it.
            kv_probe_ratio=min(s.autotune_kv_probe_ratio, s.autotune_kv_high_ratio))

    def __post_init__(self) -> None:
        if not 1 <= self.min_seqs <= self.ceiling:
            raise ValueError("need 1 <= min_seqs <= ceiling")
        if not 0 < self.decrease_factor < 1:
            raise ValueError("decrease_factor must be in (0, 1)")
        if not 0 < self.headroom <= 1:
            raise ValueError("headroom must be in (0, 1]")
        if not 0 < self.kv_probe_ratio <= self.kv_high_ratio:
            raise ValueError("need 0 < kv_probe_ratio <= kv_high_ratio")
        object.__setattr__(self, "ablate", check_rules(self.ablate))

    def on(self, rule: str) -> bool:
        """Whether ``rule`` (a :data:`serve.admission.rules.RULES` name) is in force."""
        return rule not in self.ablate



@dataclass
class Controller:
    """AIMD autotuner for the admission limit (see module docstring).

    Args:
        config: constants.
        limit: starting limit (clamped to the bounds); also the limit restored on idle.
        history: how many decisions to keep for ``/admin/autotuner``.
    """

    config: ControllerConfig
    limit: int
    history: int = 50
    start: int = field(init=False)
    #: The engine's KV-cache capacity, tokens (None: unknown; see :meth:`set_capacity`).
    kv_tokens: int | None = field(default=None, init=False)
    decisions: deque = field(init=False)

    def __post_init__(self) -> None:
        self.limit = self.start = self._clamp(self.limit)
        self.decisions = deque(maxlen=self.history)

    def set_start(self, limit: int) -> None:
        """Make ``limit`` (clamped) the starting and idle limit, and the limit now."""
        self.limit = self.start = self._clamp(limit)

    def reset(self) -> None:
        """Back to the boot state: the limit is ``start`` again, no decisions kept."""
        self.limit = self.start
        self.decisions.clear()

    def set_capacity(self, kv_tokens: int | None) -> None:
        """The engine's KV-cache capacity in tokens (vLLM's ``num_gpu_blocks x block_size``),
        for :meth:`idle_limit`."""
        self.kv_tokens = kv_tokens

    def burst_budget(self, prefill_tokens_per_s: float | None) -> int | None:
        """Prompt tokens a burst reaching an idle engine may bring past the limit
        (:class:`serve.admission.burst.BurstAdmission`), or None.

        ``rate x ttft_target`` (:func:`serve.admission.fits.prefill_budget`): what the engine
        prefills within the TTFT target at the rate it showed on the last burst, image
        encoding included (:attr:`~serve.admission.engine_stats.EngineStatsFeed.
        prefill_tokens_per_s`), in tokens, so it holds for each burst's own sizes. None before
        any rate is known, and
        where no capacity was set (a pinned ``--admission-limit``: admission by count only).
        """
        if not self.kv_tokens or not self.config.on("burst_budget"):
            return None
        return fits.prefill_budget(prefill_tokens_per_s, self.config.ttft_target_s)

    def idle_limit(self, s: Signals) -> int:
        """The limit an idle engine takes the next burst with (requests): the **KV size fit**
        (:func:`serve.admission.fits.kv_size_fit`): requests of the recent mean size (prompt +
        generated) that fill the KV cache to ``kv_high_ratio``. What the engine prefills
        within the TTFT target is the prefill backlog's bound (``serve.admission.prefill``),
        request by request. ``start`` (the boot figure, which assumes the largest image in
        every request) until requests have finished, and always where no capacity was set
        (:meth:`set_capacity`: the server does not set it when the operator pinned
        ``--admission-limit``).
        """
        return self._traffic_limit(s)

    def burst_cap(self, s: Signals | None) -> int:
        """The most requests a burst admitted by its prefill budget may put in flight: the
        idle limit (:meth:`idle_limit`) once a request has finished.
        Before that, the ceiling: ``start`` assumes the largest image in every request,
        while the budget counts the burst's own prompt tokens (a burst of chats at boot
        would otherwise stop at the count a burst of the largest images fits), and the KV
        cut answers a burst whose answers outgrow the cache.
        ``start`` where no capacity was set (no budget then)."""
        if not self.kv_tokens:
            return self.start
        if s is None or s.mean_request_tokens is None:
            return self.config.ceiling
        return self._traffic_limit(s)

    def _traffic_limit(self, s: Signals) -> int:
        c = self.config
        if not self.kv_tokens:
            return self.start  # no capacity given: the start is fixed (or pinned)
        limit = fits.kv_size_fit(self.kv_tokens, c.kv_high_ratio, s.mean_request_tokens) \
            if c.on("kv_idle_fit") else None
        return self._clamp(self.start if limit is None else limit)  # start: none finished yet

    def _clamp(self, n: int) -> int:
        return max(self.config.min_seqs, min(self.config.ceiling, n))

    def overload_reason(self, s: Signals) -> str | None:
        """Why the engine is overloaded now (``kv_cache``, ``slo_ttft``, ``slo_itl``), or None.

        The KV-cache cut needs requests queued at the gateway as well as the usage at
        ``kv_high_ratio``: with none queued, the limit holds nothing back, and what fills the
        cache is the growth of the requests in flight, which no cut undoes. vLLM preempts the
        newest of them and recomputes it when blocks free; a cut there only refuses the next
        arrivals, which an engine at its capacity, not past it, would have served (the
        simulator's gpu-like T4, docs/admission.md). A preemption is no sign of its own: it
        follows the KV-cache usage the ``kv_cache`` cut reads, and a cut on it as well earned
        less than 2 % (the ablation table)."""
        c = self.config
        if s.kv_cache_usage >= c.kv_high_ratio and s.pending > 0 and c.on("kv_cache_cut"):
            return "kv_cache"
        if s.ttft_p90_s is not None and s.ttft_p90_s > c.ttft_target_s:
            return "slo_ttft"
        if s.itl_p90_s is not None and s.itl_p90_s > c.itl_target_s:
            return "slo_itl"
        return None

    def has_headroom(self, s: Signals) -> bool:
        """Latency (and GPU, when known) leave room for more sequences. A window without
        samples (no request has finished yet) does not block a probe; the KV fit still
        bounds it (:meth:`kv_fit`)."""
        c = self.config
        ttft_ok = s.ttft_p90_s is None or s.ttft_p90_s < c.headroom * c.ttft_target_s
        itl_ok = s.itl_p90_s is None or s.itl_p90_s < c.headroom * c.itl_target_s
        gpu_ok = s.gpu_utilization is None or s.gpu_utilization < c.gpu_busy_ratio
        return ttft_ok and itl_ok and gpu_ok

    def probe_room(self, s: Signals) -> int:
        """Requests the next decision would add to the limit for a queue, judged on sample
        ``s`` (rule ``probe_no_shed``): what :meth:`_probe` adds when nothing says overload
        and both latencies have headroom; 0 otherwise. The limiter queues that many instead
        of shedding them (:meth:`serve.admission.slots.SlotCounter.set_probe_room`): the
        expected wait it sheds by is Little's law at today's limit, which the probe is about
        to raise."""
        if not self.config.on("probe_no_shed") or self.overload_reason(s) is not None \
                or not self.has_headroom(s):
            return 0
        return self._probe(s)[0] - self.limit

    def _probe(self, s: Signals) -> tuple[int, str]:
        """The limit one probe from the limit now reaches, and why: ``demand`` (the probe's
        step, within the bounds) or ``kv_fit`` (stopped at the KV fit, never below the limit
        now)."""
        c = self.config
        step = min(c.max_step, max(1, math.ceil(self.limit * c.increase_ratio)))
        new = self._clamp(self.limit + step)
        fit = self.kv_fit(s)
        if fit is not None and new > fit:
            return max(self.limit, fit), "kv_fit"
        return new, "demand"

    def kv_fit(self, s: Signals) -> int | None:
        """Sequences the KV cache holds at ``kv_probe_ratio`` usage at the current mix
        (:func:`serve.admission.fits.kv_fit`), or None when unknown."""
        if not self.config.on("kv_fit_probe"):
            return None
        return fits.kv_fit(s.engine_running, s.kv_cache_usage, self.config.kv_probe_ratio)

    def step(self, s: Signals) -> Decision:
        """Decide the next limit from one sample; updates ``self.limit``."""
        c = self.config
        old = self.limit
        reason = self.overload_reason(s)
        direction: Direction
        if reason is not None:
            new = self._clamp(math.floor(old * c.decrease_factor))
            direction = "down" if new < old else "hold"
            if new == old:
                reason = "bound"
        elif s.in_flight >= old and s.pending > 0 and self.has_headroom(s):
            new, reason = self._probe(s)
            direction = "up" if new > old else "hold"
            if new == old and reason == "demand":
                reason = "bound"
        elif s.in_flight == 0 and s.pending == 0 and not s.arrivals and c.on("idle_restore"):
            # Idle: nothing in flight or queued, and nothing arrived since the last sample
            # (a server shedding every arrival under overload is empty, not idle).
            new = self.idle_limit(s)
            direction = "up" if new > old else "down" if new < old else "hold"
            reason = "idle"
        else:
            new, direction, reason = old, "hold", "steady"
        self.limit = new
        decision = Decision(s.t, old, new, direction, reason)
        self.decisions.append(decision)
        return decision

    def state(self) -> dict:
        """JSON-able state for ``GET /admin/autotuner``."""
        return {
            "limit": self.limit,
            "start": self.start,
            "config": {**asdict(self.config), "ablate": sorted(self.config.ablate)},
            "decisions": [asdict(d) for d in self.decisions],
        }
