"""The admission pieces of one API process (limiter, engine-stats feed, autotune loop, SLO
targets), built from :class:`~serve.settings.Settings` and bound to the Prometheus gauges."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from serve.admission.capacity import kv_safe_seqs, tokens_per_request
from serve.admission.controller import Controller, ControllerConfig
from serve.admission.engine_stats import EngineStatsFeed, stat_logger_factory
from serve.admission.goodput import SloTargets
from serve.admission.limiter import AdmissionLimiter, burst_window_s
from serve.admission.loop import AutotuneLoop
from serve.admission.middleware import AdmissionMiddleware
from serve.metrics import Metrics
from serve.settings import Settings

log = logging.getLogger("serve.admission")


@dataclass
class Admission:
    """The admission pieces of one API process, built from :class:`Settings`."""

    limiter: AdmissionLimiter
    feed: EngineStatsFeed
    loop: AutotuneLoop
    slo: SloTargets
    metrics: Metrics
    middleware: AdmissionMiddleware | None = None
    #: How the KV-safe capacity was computed (``GET /admin/autotuner`` -> ``kv_capacity``);
    #: None until the engine reported its KV cache.
    kv_capacity: dict | None = None

    @classmethod
    def from_settings(cls, settings: Settings, metrics: Metrics | None = None) -> "Admission":
        """The admission pieces for ``settings``, exported to ``metrics`` (a private registry
        when None)."""
        s = settings.resolved()
        metrics = metrics if metrics is not None else Metrics()
        config = ControllerConfig.from_settings(s)
        limiter = AdmissionLimiter(s.admission_limit, s.max_queue, s.max_queue_wait_s,
                                   ceiling=s.max_num_seqs, engine_queue=s.engine_queue,
                                   engine_queue_wait_s=s.slo_ttft_s,
                                   burst_window_s=burst_window_s(
                                       s.slo_ttft_s, s.autotune_interval_s),
                                   ttft_target_s=s.slo_ttft_s, itl_target_s=s.slo_itl_s,
                                   step_tokens=s.max_num_batched_tokens or 0)
        feed = EngineStatsFeed(window_s=s.autotune_window_s, step_tokens=s.max_num_batched_tokens,
                               ttft_target_s=s.slo_ttft_s)
        loop = AutotuneLoop(Controller(config, s.admission_limit), limiter, feed,
                            mode=s.autotune, interval_s=s.autotune_interval_s, metrics=metrics)
        admission = cls(limiter, feed, loop, SloTargets(s.slo_ttft_s, s.slo_itl_s), metrics)
        admission.export()
        return admission

    def export(self) -> None:
        """Bind the gauges to live values (read at scrape time, never stale)."""
        lim, m, feed = self.limiter, self.metrics, self.feed
        m.pending.set_function(lambda: lim.pending)
        # The whole queue: the gateway's plus vLLM's, which holds only what admission let in.
        m.queued.set_function(lambda: lim.pending + feed.engine_queue)
        m.running.set_function(lambda: lim.in_flight)
        m.max_num_seqs.set_function(lambda: lim.limit)
        m.prefill_backlog.set_function(lambda: lim.backlog.backlog_s)
        m.tenants.slots = lambda tenant: (lim.queue.in_flight(tenant), lim.queue.pending(tenant))
        config = self.loop.controller.config
        m.ceiling.set(config.ceiling)
        m.min_seqs.set(config.min_seqs)
        m.headroom.set(config.headroom)
        m.kv_high.set(config.kv_high_ratio)
        m.gpu_busy.set(config.gpu_busy_ratio)
        m.max_queue.set(lim.max_queue)
        m.slo_ttft.set(self.slo.ttft_s)
        m.slo_itl.set(self.slo.itl_s)
        m.auto_mode.set(1 if self.loop.mode == "auto" else 0)

    def apply_kv_capacity(self, settings: Settings, kv_tokens: int | None,
                          engine_kv: dict | None = None) -> int | None:
        """Start the autotuner at the engine's KV-safe capacity (``serve.admission.capacity``).

        Only in mode ``auto`` and when ``admission_limit`` was not set explicitly; the limit
        is also what the controller restores when the engine goes idle. The figures are kept
        in :attr:`kv_capacity`.

        Args:
            settings: the server's settings (unresolved: an explicit limit is kept).
            kv_tokens: the engine's KV-cache capacity, tokens (None: unknown, keep the
                ceiling).
            engine_kv: what vLLM reported about its KV cache (``serve.engine.kv_cache_size``:
                blocks, block size, explicit size), copied into :attr:`kv_capacity`.

        Returns:
            the KV-safe capacity in requests, or None when ``kv_tokens`` is unknown.
        """
        if kv_tokens is None:
            return None
        s = settings.resolved()
        capacity = kv_safe_seqs(kv_tokens, s.num_crops, s.max_num_seqs,
                                max_model_len=s.max_model_len)
        self.metrics.kv_safe_seqs.set(capacity)
        if engine_kv is None:
            source = "kv_tokens as given"
        elif engine_kv.get("kv_cache_memory_bytes"):
            source = "vLLM num_gpu_blocks x block_size; KV cache sized by kv_cache_memory_bytes"
        else:
            source = "vLLM num_gpu_blocks x block_size; KV cache sized by its memory profile"
        self.kv_capacity = {
            **(engine_kv or {}),
            "kv_cache_tokens": kv_tokens,
            "source": source,
            "num_crops": s.num_crops,
            "tokens_per_request": tokens_per_request(s.num_crops,
                                                     max_model_len=s.max_model_len),
            "max_num_seqs": s.max_num_seqs,
            "kv_safe_seqs": capacity,
        }
        if s.autotune == "auto" and not s.admission_limit_explicit:
            self.loop.controller.set_start(capacity)
            # ... and learn the idle limit from the traffic (Controller.idle_limit).
            self.loop.controller.set_capacity(kv_tokens)
            self.limiter.set_limit(self.loop.controller.limit)
        return capacity

    async def measure_prefill(self, engine, settings: Settings) -> None:
        """Measure the engine's prefill costs (``serve.admission.probe``) for the limiter's
        prefill backlog, then forget what the probes taught the feed (the autotuner starts
        from no traffic). A failed probe leaves the backlog off, logged: admission by count
        still works."""
        from serve.admission.probe import measure

        s = settings.resolved()
        try:
            self.limiter.backlog.costs = await measure(engine, s.num_crops,
                                                       s.max_num_batched_tokens or 0)
        except Exception:  # noqa: BLE001 - the gateway runs without the backlog
            log.exception("prefill probes failed; admission by predicted prefill is off")
        self.feed.forget()

    def stat_loggers(self) -> list:
        """vLLM stat logger factories feeding :attr:`feed` (imports vLLM)."""
        return [stat_logger_factory(self.feed)]

    def wrap(self, app, engine_alive=None) -> AdmissionMiddleware:
        """``app`` behind admission control (kept as :attr:`middleware`: the drain cuts its
        open requests); ``engine_alive`` as :class:`AdmissionMiddleware`'s."""
        self.middleware = AdmissionMiddleware(app, self.limiter, self.slo, self.metrics,
                                              engine_alive=engine_alive)
        return self.middleware
