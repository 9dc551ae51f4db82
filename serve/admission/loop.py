"""The autotuner loop: every ``interval_s`` sample the signals, ask the controller, apply.

I/O lives here (clock, NVML, the limiter, Prometheus gauges); the decision logic is the pure
:class:`serve.admission.controller.Controller`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Literal

from serve.admission.controller import Controller
from serve.admission.engine_stats import EngineStatsFeed
from serve.admission.limiter import AdmissionLimiter
from serve.admission.signals import Decision, Signals
from serve.metrics import Metrics

log = logging.getLogger("serve.autotuner")  # the feature's name in the logs, as before

Mode = Literal["auto", "static"]
#: The limit of the benchmark's mode ``off`` (:meth:`AutotuneLoop.set_mode`): no request
#: ever waits at the gateway, so vLLM's own ``max_num_seqs`` and waiting queue are all there
#: is, as with plain vLLM.
OFF_LIMIT = 1_000_000


class GpuUtilization:
    """Mean GPU utilization (0-1) from NVML (``nvidia-ml-py``); ``None`` where no GPU/NVML."""

    def __init__(self) -> None:
        self._handles: list = []
        self._nvml = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i)
                             for i in range(pynvml.nvmlDeviceGetCount())]
            self._nvml = pynvml
        except Exception:  # noqa: BLE001 - no driver, no GPU, no package: unavailable
            self._handles = []

    @property
    def available(self) -> bool:
        return bool(self._handles)

    def read(self) -> float | None:
        """Utilization over NVML's last sample period, 0-1, or None when unavailable."""
        if not self._handles:
            return None
        try:
            rates = [self._nvml.nvmlDeviceGetUtilizationRates(h).gpu for h in self._handles]
        except Exception:  # noqa: BLE001 - a transient NVML error is "unknown", not 0
            return None
        return sum(rates) / len(rates) / 100.0


class AutotuneLoop:
    """Samples signals every ``interval_s`` and moves the limiter's limit (mode ``auto``).

    In mode ``static`` it still samples (for ``/admin/autotuner`` and the metrics) but never
    changes the limit. Decisions and GPU utilization are exported to ``metrics`` (a private
    registry when None, as in the simulator).
    """

    def __init__(self, controller: Controller, limiter: AdmissionLimiter, feed: EngineStatsFeed,
                 mode: Mode = "auto", interval_s: float = 2.0,
                 gpu: GpuUtilization | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 metrics: Metrics | None = None) -> None:
        self.controller = controller
        self.limiter = limiter
        self.feed = feed
        self.mode = mode
        #: What ``/admin/autotuner`` reports as the mode: ``mode``, or ``off``
        #: (:meth:`set_mode`).
        self.mode_label: str = mode
        self.interval_s = interval_s
        self.gpu = gpu if gpu is not None else GpuUtilization()
        self.metrics = metrics if metrics is not None else Metrics()
        self._clock = clock
        self._last_preemptions = feed.preemptions_total
        self._last_arrivals = limiter.snapshot().arrivals
        self.last_signals: Signals | None = None
        self._task: asyncio.Task | None = None
        self.limiter.set_limit(controller.limit)
        # The prefill backlog counts first tokens in every mode, and bounds admission in auto.
        feed.on_first_tokens = limiter.first_tokens
        limiter.backlog.active = mode == "auto"
        if mode == "auto":
            feed.on_prefill_rate = self._set_burst_budget

    def _set_burst_budget(self, rate: float | None) -> None:
        """Give the limiter the prompt tokens a burst may bring at prefill ``rate``
        (:meth:`Controller.burst_budget`): at every tick, and as soon as a burst measured the
        rate (the first burst after boot has no rate until its first requests got their
        first token)."""
        budget = self.controller.burst_budget(rate)
        cap = None if budget is None else self.controller.burst_cap(self.last_signals)
        rate = None if budget is None else rate
        slots = self.limiter.slots
        if (budget, cap, rate) != (slots.burst_budget, slots.burst_cap, slots.bursts.rate):
            self.limiter.set_burst_budget(budget, cap, rate)

    def set_mode(self, mode: Literal["auto", "static", "off"], limit: int | None = None) -> None:
        """Benchmarks only (``--bench-admin``): switch the admission mode live and start from
        the boot state, so that each arm of an episode meets the same server.

        The controller goes back to its start (:meth:`Controller.reset`), the feed and the
        limiter forget what the traffic taught (:meth:`EngineStatsFeed.forget`,
        :meth:`~serve.admission.slots.SlotCounter.forget`: an arm would otherwise shed a
        burst by the drain rate the arm before it measured; the prefill share's window,
        :meth:`~serve.admission.prefill.PrefillBacklog.forget_share`), the burst budget is
        dropped.
        ``auto``: the autotuner moves the limit from its start; ``static``: the limit is
        ``limit``; ``off``: :data:`OFF_LIMIT` (no gateway limit). Requests in flight keep
        their slots.

        Raises:
            ValueError: an unknown mode, or ``static`` without a limit >= 1.
        """
        if mode not in ("auto", "static", "off"):
            raise ValueError(f"unknown mode {mode!r}")
        if mode == "static" and (limit is None or limit < 1):
            raise ValueError("mode static needs a limit >= 1")
        self.controller.reset()
        self.feed.forget()
        self.limiter.slots.forget()
        self.limiter.backlog.forget_share()
        self.limiter.set_burst_budget(None, None)
        self.limiter.slots.set_probe_room(0)
        self.last_signals = None
        self.mode, self.mode_label = ("auto" if mode == "auto" else "static"), mode
        self.feed.on_prefill_rate = self._set_burst_budget if mode == "auto" else None
        self.limiter.backlog.active = mode == "auto"
        self.limiter.set_limit(self.controller.limit if mode == "auto"
                               else limit if mode == "static" else OFF_LIMIT)
        self.metrics.auto_mode.set(1 if mode == "auto" else 0)

    def sample(self) -> Signals:
        """Read every signal now."""
        snap = self.limiter.snapshot()
        preempted = self.feed.preemptions_total - self._last_preemptions
        self._last_preemptions = self.feed.preemptions_total
        arrivals = snap.arrivals - self._last_arrivals
        self._last_arrivals = snap.arrivals
        return Signals(
            t=self._clock(),
            pending=snap.pending,
            # Requests waiting inside vLLM at the ceiling (the limiter's engine queue) are not
            # in the batch: the controller sees at most the ceiling in flight.
            in_flight=min(snap.in_flight, self.controller.config.ceiling),
            engine_running=self.feed.running,
            engine_waiting=self.feed.waiting,
            kv_cache_usage=self.feed.kv_cache_usage,
            preemptions=preempted,
            arrivals=arrivals,
            ttft_p90_s=self.feed.ttft.percentile(90),
            itl_p90_s=self.feed.tpot.percentile(90),
            mean_request_tokens=self.feed.mean_request_tokens,
            prefill_tokens_per_s=self.feed.prefill_tokens_per_s,
            gpu_utilization=self.gpu.read(),
        )

    def tick(self) -> Decision:
        """One control step: sample, decide, apply, export."""
        signals = self.sample()
        self.last_signals = signals
        self.metrics.set_gpu_utilization(signals.gpu_utilization)
        if self.mode == "auto":
            decision = self.controller.step(signals)
            self.limiter.slots.set_probe_room(self.controller.probe_room(signals))
            self._set_burst_budget(signals.prefill_tokens_per_s)
            if decision.new_limit != self.limiter.limit:
                self.limiter.set_limit(decision.new_limit)
            if decision.direction != "hold":
                log.info("max_num_seqs %d -> %d (%s)", decision.old_limit, decision.new_limit,
                         decision.reason)
        else:
            limit = self.limiter.limit
            decision = Decision(signals.t, limit, limit, "hold", "static")
            self.controller.decisions.append(decision)
        self.metrics.record_decision(decision.direction, decision.reason)
        return decision

    async def run(self) -> None:
        """Tick forever every ``interval_s`` (a failing tick is logged, never fatal)."""
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                self.tick()
            except Exception:
                log.exception("autotuner tick failed")

    def start(self) -> None:
        self._task = asyncio.create_task(self.run(), name="autotuner")

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def state(self) -> dict:
        """JSON for ``GET /admin/autotuner``."""
        s = self.last_signals
        return {
            "mode": self.mode_label,
            "interval_s": self.interval_s,
            "limit": self.limiter.limit,
            "capacity": self.limiter.capacity,
            "burst_budget": self.limiter.slots.burst_budget,
            "burst_cap": self.limiter.slots.burst_cap,
            "probe_room": self.limiter.slots.probe_room,
            "engine_queue": self.limiter.engine_queue,
            "in_flight": self.limiter.in_flight,
            "pending": self.limiter.pending,
            # The queue deadline's inputs: admission to first token (p90, seconds) of recent
            # answers, and what it leaves of the TTFT target (SlotCounter.queue_wait_bound_s).
            "first_token_p90_s": self.limiter.slots.first_token_s(),
            "queue_wait_bound_s": self.limiter.slots.queue_wait_bound_s(
                self.controller.config.ttft_target_s),
            # Admission by predicted prefill (serve.admission.prefill): the boot probes'
            # costs and the prefill admitted without a first token now.
            "prefill": self.limiter.backlog.state(),
            "gpu_utilization_available": self.gpu.available,
            "last_signals": None if s is None else s.__dict__,
            **{k: v for k, v in self.controller.state().items() if k != "limit"},
        }
