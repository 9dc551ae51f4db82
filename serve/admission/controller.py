"""The live ``max_num_seqs`` autotuner: a pure controller (signals in, new limit + reason out).

Algorithm: AIMD with hysteresis and a cooldown, gated by latency headroom.

- **Decrease** multiplicatively (``limit * decrease_factor``, or ``* target / measured`` when
  a latency is further over its target, at most halving) on any sign of overload:
  engine-side TTFT p90 over target (unless the engine queue holds requests: then it counts
  their wait for a batch slot, :meth:`Controller.overload_reason`), the p90 of the finished
  requests' mean inter-token latency (TPOT) over the ITL target, a preemption since the last
  tick, or KV-cache usage at/above ``kv_high_ratio``. Then hold for ``cooldown_s`` so the
  effect can show before the next move: no increase, and no further cut on latency or KV
  usage (they still reflect the old limit); a preemption still cuts at once.
- **Increase** additively (``max(1, ceil(limit * increase_ratio))``, at most ``max_step``)
  only when the limit is what binds (in-flight >= limit), requests are queued at the gateway,
  and both latencies are below ``headroom`` x target (and GPU utilization, when known, is not
  already saturated); never past the **KV fit** (running x ``kv_high_ratio`` / KV usage:
  what the cache holds at the running requests' mean size; past it vLLM preempts) nor the
  **ITL fit** (:meth:`Controller.itl_fit`: the largest batch where nine requests in ten keep
  the inter-token target, on the line the finished requests drew of their TPOT against the
  batch they decoded in).
- **Restore** on idle (nothing in flight or queued, nothing arrived since the last sample):
  the limit becomes :meth:`Controller.idle_limit`: the boot figure (``start``, the KV-safe
  capacity), or once requests have finished what the recent traffic fits: the smaller of its
  KV fit, its TTFT fit (prompts the engine prefills within the TTFT target at the rate
  it showed on the last burst) and the ITL fit. Whatever made the limit lower or higher is
  in the past, and an idle engine must take the next burst at once. A server refusing
  every arrival is empty, not idle: it keeps its limit.
- **Hold** otherwise (the band between ``headroom`` x target and target is the hysteresis
  that prevents oscillation under steady load), and also on a latency breach while the last
  decrease is still draining (in-flight > limit): those slow samples come from requests
  admitted under the old limit, and cutting on them again is windup.
- **Burst budget**: the limiter admits a burst that reaches an idle engine past the limit
  while its prompt tokens fit what the engine prefills within the TTFT target
  (:meth:`Controller.burst_budget`, up to :meth:`Controller.burst_cap`;
  :meth:`serve.admission.limiter.SlotCounter.admits`): the idle limit's TTFT fit counts
  mean prompts, the budget the burst's own.
- **Burst grace**: for ``ttft_target_s + cooldown_s`` after a burst reaches an idle engine
  (admitted at the idle limit, whose TTFT fit bounds its prefill by the TTFT target), a
  latency breach does not cut (reason ``burst``): the burst's own prefill stalls the
  streams decoding beside it, and a cut would only refuse the queued rest of the burst.
  With requests queued, the limit rises to :meth:`Controller.idle_limit` recomputed on the
  burst's own prefill rate, when that is higher. A preemption or a full KV cache still
  cuts at once. The grace ends early when requests still arrive two ticks after the burst
  began: that is sustained traffic, not a burst.
- **Overload limit**: a busy period that was cut on an overload while requests kept
  arriving ends at what the engine held under every target; the next idle limit is at most
  that (:meth:`Controller.idle_limit`). After every cut the loop
  (:class:`~serve.admission.loop.AutotuneLoop`) starts the latency windows afresh, with the
  requests that reach the engine after the cut only
  (:meth:`~serve.admission.engine_stats.EngineStatsFeed.restart_latency_windows`).
- Bounds ``[min_seqs, ceiling]`` always; ``ceiling`` is the engine's ``--max-num-seqs``.

Sources: Netflix concurrency-limits ``AIMDLimit`` / ``Gradient2Limit`` (multiplicative backoff
on a latency signal, scaled by target / measured; additive probe; algorithm separate from
enforcement), Envoy adaptive concurrency filter (periodic sampling interval, named constants,
min/max bounds), TCP congestion avoidance (AIMD, Chiu & Jain 1989) and DistServe (Zhong et
al., OSDI 2024) for the objective: goodput = completed requests per second meeting both
their TTFT and ITL (TPOT) targets. The latency signals are measured *engine-side* (from
admission, excluding the gateway queue) so that queueing caused by a too-small limit is read
as demand, not as overload.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import asdict, dataclass, field

from serve.admission import fits
from serve.admission.rules import check as check_rules
from serve.admission.signals import Decision, Direction, Signals

#: Deepest single cut on a latency breach (fraction of the limit kept).
MIN_CUT_FACTOR = 0.5
#: Overload signals that lag a decrease (latency windows, KV usage): no second cut while the
#: last one drains or cools down. A preemption is news: it always cuts.
SOFT_REASONS = ("slo_ttft", "slo_itl", "kv_cache")
#: Latency overload signals, which a burst reaching an idle engine raises by itself.
LATENCY_REASONS = ("slo_ttft", "slo_itl")


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
        decrease_factor: multiplicative backoff (0.85: TCP-like halving is too harsh for a
            batch engine whose latency grows sub-linearly with batch size; 0.85 beat 0.75 on
            the simulator's phase trace, ``bench/autotune.py``).
        increase_ratio: additive step as a fraction of the limit (0.25: reach the ceiling from
            1 in ~O(log) ticks early on, gently near the top).
        max_step: most requests added per tick (bounds the overshoot of one probe).
        cooldown_s: seconds without increases after a decrease (>= 2 sampling intervals, so the
            decrease shows in the latency window before the next decision).
        kv_high_ratio: KV-cache usage (0-1) treated as full: vLLM preempts soon after.
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
    cooldown_s: float
    kv_high_ratio: float
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
            cooldown_s=s.autotune_cooldown_s, kv_high_ratio=s.autotune_kv_high_ratio)

    def __post_init__(self) -> None:
        if not 1 <= self.min_seqs <= self.ceiling:
            raise ValueError("need 1 <= min_seqs <= ceiling")
        if not 0 < self.decrease_factor < 1:
            raise ValueError("decrease_factor must be in (0, 1)")
        if not 0 < self.headroom <= 1:
            raise ValueError("headroom must be in (0, 1]")
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
    _cooldown_until: float = field(default=float("-inf"), init=False)
    #: End of the grace a burst at an idle engine gets from latency cuts (see :meth:`step`).
    _burst_until: float = field(default=float("-inf"), init=False)
    #: Ticks since that burst reached the idle engine.
    _burst_ticks: int = field(default=0, init=False)
    #: A cut on an overload while requests kept arriving, since the last idle tick.
    _sustained_cut: bool = field(default=False, init=False)
    #: The limit the last busy period with such a cut ended at (None: it had none).
    _overload_limit: int | None = field(default=None, init=False)
    #: A cut started the latency windows afresh, and the signal it cut on (``"ttft"``;
    #: ``"itl"`` after an inter-token cut) was not measured since: no probe (None: none).
    _await_sample: str | None = field(default=None, init=False)
    decisions: deque = field(init=False)

    def __post_init__(self) -> None:
        self.limit = self.start = self._clamp(self.limit)
        self.decisions = deque(maxlen=self.history)

    def set_start(self, limit: int) -> None:
        """Make ``limit`` (clamped) the starting and idle limit, and the limit now."""
        self.limit = self.start = self._clamp(limit)

    def set_capacity(self, kv_tokens: int | None) -> None:
        """The engine's KV-cache capacity in tokens (vLLM's ``num_gpu_blocks x block_size``),
        for :meth:`idle_limit`."""
        self.kv_tokens = kv_tokens

    def adopt(self, limit: int) -> None:
        """Continue from ``limit`` (clamped), which the limiter set itself: a burst's
        prefill budget held requests back, and a raise made during the burst became what it
        admitted (:meth:`serve.admission.limiter.SlotCounter.admits`)."""
        self.limit = self._clamp(limit)

    def burst_budget(self, prefill_tokens_per_s: float | None) -> int | None:
        """Prompt tokens a burst reaching an idle engine may bring past the limit (the
        limiter admits it by these where the limit would queue it:
        :meth:`serve.admission.limiter.SlotCounter.admits`), or None.

        ``rate x ttft_target``: what the engine prefills within the TTFT target at the rate
        it showed on the last burst, image encoding included
        (:attr:`~serve.admission.engine_stats.EngineStatsFeed.prefill_tokens_per_s`). The
        TTFT fit of :meth:`idle_limit` in tokens instead of mean prompts, so it holds for each
        burst's own sizes. None before any rate is known, and where no capacity was set (a
        pinned ``--admission-limit``: admission by count only).
        """
        if not self.kv_tokens or not self.config.on("burst_budget"):
            return None
        return fits.prefill_budget(prefill_tokens_per_s, self.config.ttft_target_s)

    def idle_limit(self, s: Signals) -> int:
        """The limit an idle engine takes the next burst with (requests).

        The smaller of two fits of the traffic seen lately:

        - **KV fit**: requests of ``mean_request_tokens`` that fill the KV cache
          (``kv_tokens``) to ``kv_high_ratio``; past it vLLM preempts.
        - **TTFT fit**: prompts of ``mean_prompt_tokens`` the engine prefills within the TTFT
          target at the throughput it showed on the last burst (``prefill_tokens_per_s``):
          ``rate x ttft_target / mean_prompt``. A burst admitted past it misses the target
          anyway and stretches the inter-token latency of everything running.

        At most the **overload limit**: where the last busy period ended, if it was cut on
        an overload while requests kept arriving (sustained traffic, not the drain of a
        burst). That is what the engine held at that traffic under *all* targets, the
        inter-token one included, which neither fit sees: on the CPU engine every image
        encode stalls every running stream, and the fits said 26-32 where the best fixed
        limit of the CPU suite's T2 and T6 was 16. Demand probes raise the limit past it
        again when the traffic allows.

        ``start`` (the boot figure, which assumes the largest image in every request) until
        requests have finished, and always where no capacity was set (:meth:`set_capacity`:
        the server does not set it when the operator pinned ``--admission-limit``).
        """
        return self._traffic_limit(s, ttft_fit=True)

    def burst_cap(self, s: Signals | None) -> int:
        """The most requests a burst admitted by its prefill budget may put in flight: the
        idle limit (:meth:`idle_limit`) without its TTFT fit, which the budget replaces with
        the burst's own sizes; the KV fit and the overload limit (what the engine held under
        the inter-token target) still bound it. ``start`` before any sample."""
        return self.start if s is None else self._traffic_limit(s, ttft_fit=False)

    def _traffic_limit(self, s: Signals, ttft_fit: bool) -> int:
        c = self.config
        if not self.kv_tokens:
            return self.start  # no capacity given: the start is fixed (or pinned)
        bounds = [self.itl_fit(s)]
        bounds.append(fits.kv_size_fit(self.kv_tokens, c.kv_high_ratio, s.mean_request_tokens)
                      if c.on("kv_idle_fit") else None)
        if ttft_fit and c.on("ttft_fit"):
            bounds.append(fits.ttft_fit(s.prefill_tokens_per_s, c.ttft_target_s,
                                        s.mean_prompt_tokens))
        if c.on("overload_limit"):
            bounds.append(self._overload_limit)
        if bounds[1] is None:  # before any request finished: the boot figure
            bounds[1] = self.start
        return self._clamp(min(b for b in bounds if b is not None))

    def _clamp(self, n: int) -> int:
        return max(self.config.min_seqs, min(self.config.ceiling, n))

    def overload_reason(self, s: Signals) -> str | None:
        """Why the engine is overloaded now, or None.

        A TTFT over its target while the engine queue holds requests (``engine_queued``) is
        not one: vLLM counts a request's TTFT from its arrival in the engine, so at the
        ceiling it includes the wait for a batch slot, which a lower limit would only move
        to the gateway queue (and the limiter bounds that wait by the TTFT target). In
        ``make bench`` a saturated, healthy engine read as overloaded that way and was cut
        32 -> 16 -> 8 on ``slo_ttft`` while plain vLLM kept its whole batch.
        """
        c = self.config
        if s.preemptions > 0:
            return "preemption"
        if s.kv_cache_usage >= c.kv_high_ratio:
            return "kv_cache"
        if s.ttft_p90_s is not None and s.ttft_p90_s > c.ttft_target_s \
                and not (s.engine_queued and c.on("engine_queue_ttft")):
            return "slo_ttft"
        if s.itl_p90_s is not None and s.itl_p90_s > c.itl_target_s:
            return "slo_itl"
        return None

    def has_headroom(self, s: Signals) -> bool:
        """Latency (and GPU, when known) leave room for more sequences. A window without
        samples (no request has finished yet) does not block a probe; the KV and ITL fits
        still bound it (:meth:`kv_fit`, :meth:`itl_fit`). After a cut, which starts the
        windows afresh, :meth:`step` waits for a TTFT (after an inter-token cut, a TPOT)
        measured at the new limit before the next probe: on the CPU suite's T5 a probe on
        the empty windows 3 s after a TTFT cut (13 -> 17) was followed by two more cuts, to 8
        and 4, and the long answers that came next queued behind the limit."""
        c = self.config
        ttft_ok = s.ttft_p90_s is None or s.ttft_p90_s < c.headroom * c.ttft_target_s
        itl_ok = s.itl_p90_s is None or s.itl_p90_s < c.headroom * c.itl_target_s
        gpu_ok = s.gpu_utilization is None or s.gpu_utilization < c.gpu_busy_ratio
        return ttft_ok and itl_ok and gpu_ok

    def _cut_factor(self, reason: str, s: Signals) -> float:
        """How much to keep on a cut: ``decrease_factor``, or less when a latency is far over
        its target: ``target / measured`` (Netflix Gradient2's ratio; latency grows at
        least linearly with the batch past saturation), never below :data:`MIN_CUT_FACTOR`.

        On the inter-token target, once the requests' TPOT line is known (:meth:`itl_fit`),
        the cut goes to that fit instead, between ``decrease_factor`` and
        :data:`MIN_CUT_FACTOR`: the line is the batch's own share of the TPOT, where the
        ratio also charges the batch with the stalls of prefills and image encodes, which
        a smaller batch does not remove (the CPU suite's T6, chat at 2x capacity: cuts
        18 -> 9 and 16 -> 13 on the ratio, demand probes straight back to 17-19, where a
        fixed 16 got nearly twice auto's good requests: 115 against 61)."""
        c = self.config
        measured, target = {"slo_ttft": (s.ttft_p90_s, c.ttft_target_s),
                            "slo_itl": (s.itl_p90_s, c.itl_target_s)}.get(reason, (None, None))
        if not measured:
            return c.decrease_factor
        if reason == "slo_itl" and c.on("itl_fit_cut"):
            fit = self.itl_fit(s)
            if fit is not None:
                return max(MIN_CUT_FACTOR, min(c.decrease_factor, fit / self.limit))
        if not c.on("gradient_cut"):
            return c.decrease_factor
        return max(MIN_CUT_FACTOR, min(c.decrease_factor, target / measured))

    def itl_fit(self, s: Signals) -> int | None:
        """The largest batch whose requests keep the inter-token target (requests), or None.

        From the finished requests' line ``tpot(n) = intercept + slope x n`` and their spread
        above it (:attr:`Signals.itl_line`): the largest ``n`` with ``tpot(n) x p90_ratio <=
        itl_target``, where nine requests in ten keep the target (the controller cuts when
        the p90 of the requests' TPOT is over it: :meth:`overload_reason`). None without a
        line, with a slope <= 0 (the batch does not slow the streams: a memory-bound engine)
        and where even the intercept misses the target (the requests are slow whatever the
        batch: fewer would not help). At least ``min_seqs``.

        On the CPU engine at saturation the token throughput is fixed, so each stream's TPOT
        grows with the batch: the CPU suite's T6 (chat at 2x capacity) kept the 50-ms target
        at a fixed 8-16 and missed it at 32 (p90 over mean 1.4-1.5 at each), where the idle
        limit from the KV and TTFT fits was 25.
        """
        if not self.config.on("itl_fit"):
            return None
        return fits.itl_fit(s.itl_line, self.config.itl_target_s, self.config.min_seqs)

    def kv_fit(self, s: Signals) -> int | None:
        """Sequences the KV cache holds below ``kv_high_ratio`` at the current mix, or None
        when unknown (nothing running, no usage reported).

        ``engine_running x kv_high_ratio / kv_cache_usage``: the running sequences' mean
        share of the cache, extrapolated. An increase past it would be answered by vLLM with
        preemption (recompute), so the controller does not probe beyond it.
        """
        if not self.config.on("kv_fit_probe"):
            return None
        return fits.kv_fit(s.engine_running, s.kv_cache_usage, self.config.kv_high_ratio)

    def step(self, s: Signals) -> Decision:
        """Decide the next limit from one sample; updates ``self.limit``."""
        c = self.config
        old = self.limit
        was_idle = bool(self.decisions) and self.decisions[-1].reason == "idle"
        if was_idle and (s.in_flight or s.pending or s.arrivals) and c.on("burst_grace"):
            # A burst reached the idle engine, admitted at the idle limit (its KV and TTFT
            # fits). Its own prefill stalls the streams decoding beside it: latency over the
            # target for as long as that prefill lasts, within the TTFT target by the TTFT
            # fit. A cut then only refuses the queued rest of the burst (on the simulator's
            # T2 it cut 26 -> 13 and 93 -> 58 in the first tick of a burst, where the best
            # fixed limit keeps 32 and 128).
            self._burst_until = s.t + c.ttft_target_s + c.cooldown_s
            self._burst_ticks = 0
        elif s.t < self._burst_until:
            self._burst_ticks += 1
            if self._burst_ticks >= 2 and s.arrivals and c.on("burst_grace_end"):
                # Still arriving two ticks after the burst began: not a burst but traffic
                # (a burst arrives within one tick interval; on the CPU engine the grace held
                # the limit at 32 through the first 5 s of T6's sustained 2x overload).
                self._burst_until = float("-inf")
        if s.ttft_p90_s is not None and self._await_sample == "ttft" \
                or s.itl_p90_s is not None and self._await_sample == "itl":
            self._await_sample = None
        reason = self.overload_reason(s)
        if reason in LATENCY_REASONS and s.t < self._burst_until:
            # Never a cut; a raise to the idle limit when the rest of the burst is queued:
            # the rate this burst's own prefill just showed (and the traffic's sizes) may
            # allow more than the limit it was admitted at (on the first burst after boot, the
            # worst-case KV-safe start: H200 T2's first burst 96 -> 106 good of L=128's 128).
            new = max(old, self.idle_limit(s)) if s.pending else old
            direction, reason = ("up" if new > old else "hold"), "burst"
        elif reason in SOFT_REASONS and s.in_flight > old and c.on("draining_hold"):
            # The last decrease is still draining (lowering never aborts running requests):
            # the late samples of requests admitted under the old limit would cut again and
            # again (windup, seen on the real CPU engine). Hard signals still cut at once.
            new, direction, reason = old, "hold", "draining"
        elif reason in SOFT_REASONS and s.t < self._cooldown_until and c.on("cooldown"):
            # The latency window (and the KV cache, which empties only as requests finish)
            # still reflect the limit before the last decrease: wait for the cooldown before
            # cutting on them again (on the CPU engine, one overload cut the limit 32 -> 8 in
            # seven 1-s ticks on the same stale p90).
            new, direction, reason = old, "hold", "cooldown"
        elif reason is not None:
            new = self._clamp(math.floor(old * self._cut_factor(reason, s)))
            self._cooldown_until = s.t + c.cooldown_s
            # No probe before the signal that cut was measured at the new limit: a TTFT,
            # or after an inter-token cut a finished request's TPOT (a TTFT comes first and
            # says nothing of it: the CPU suite's T6, chat at 2x capacity, probed 14 -> 18
            # and 15 -> 19 within 1-3 s of each inter-token cut, then cut again, and the
            # requests queued at the higher limit missed their TTFT target at the lower).
            self._await_sample = None if new >= old or not c.on("await_sample") else \
                "itl" if reason == "slo_itl" else "ttft"
            direction: Direction = "down" if new < old else "hold"
            if new == old:
                reason = "bound"
            if s.arrivals:
                self._sustained_cut = True
        elif s.t < self._cooldown_until and c.on("cooldown"):
            new, direction, reason = old, "hold", "cooldown"
        elif s.in_flight >= old and s.pending > 0 and self.has_headroom(s) \
                and not self._await_sample:
            step = min(c.max_step, max(1, math.ceil(old * c.increase_ratio)))
            new = self._clamp(old + step)
            reason = "demand"
            for fit_reason, fit in (("kv_fit", self.kv_fit(s)), ("itl_fit", self.itl_fit(s))):
                if fit is not None and new > fit:
                    new, reason = max(old, fit), fit_reason
            direction = "up" if new > old else "hold"
            if new == old and reason == "demand":
                reason = "bound"
        elif s.in_flight == 0 and s.pending == 0 and not s.arrivals and c.on("idle_restore"):
            # Idle: nothing in flight or queued, and nothing arrived since the last sample
            # (a server shedding every arrival under overload is empty, not idle).
            if not was_idle:  # the busy period ends: remember what its overload settled at
                self._overload_limit = old if self._sustained_cut else None
                self._sustained_cut = False
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
            "config": asdict(self.config),
            "cooldown_until": None if math.isinf(self._cooldown_until) else self._cooldown_until,
            "decisions": [asdict(d) for d in self.decisions],
        }
