"""What the autotuner reads and what it decides: :class:`Signals` in, :class:`Decision` out.

Plain data shared by the controller (:mod:`serve.admission.controller`), the fits
(:mod:`serve.admission.fits`), the loop that samples the signals
(:mod:`serve.admission.loop`) and the simulator (``bench/sim.py``). Standard library only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Direction = Literal["up", "down", "hold"]

#: ``reason`` label values of ``phi3v_autotuner_decisions_total``.
REASONS = ("demand", "kv_fit", "slo_ttft", "slo_itl", "kv_cache", "steady", "idle", "static",
           "bound")


@dataclass(frozen=True)
class Signals:
    """One sample of the system, taken every ``interval_s``.

    Attributes:
        t: monotonic time of the sample, seconds.
        pending: requests queued at the gateway (admission queue length).
        in_flight: requests admitted into the engine (<= current limit).
        engine_running: vLLM ``num_requests_running``.
        engine_waiting: vLLM ``num_requests_waiting``.
        kv_cache_usage: vLLM KV-cache usage, 0-1.
        preemptions: engine preemptions since the previous sample (shown in
            ``GET /admin/autotuner``; the controller cuts on the KV-cache usage before them).
        ttft_p90_s: engine-side TTFT p90 over the sliding window, seconds (None: no samples).
        itl_p90_s: p90 over the requests finished in the window of their mean inter-token
            latency (TPOT: what the goodput rule judges a request by), seconds (None: no
            samples).
        gpu_utilization: 0-1 from NVML, None where unavailable (CPU).
        arrivals: requests that arrived since the previous sample (admitted, queued or
            refused; None: unknown).
        mean_request_tokens: mean KV footprint (prompt + generated tokens) of recently
            finished requests, None before the first.
        prefill_tokens_per_s: prompt tokens/s the engine prefilled on the last burst
            (:class:`~serve.admission.engine_stats.EngineStatsFeed`), None before one.
    """

    t: float
    pending: int = 0
    in_flight: int = 0
    engine_running: int = 0
    engine_waiting: int = 0
    kv_cache_usage: float = 0.0
    preemptions: int = 0
    ttft_p90_s: float | None = None
    itl_p90_s: float | None = None
    gpu_utilization: float | None = None
    arrivals: int | None = None
    mean_request_tokens: float | None = None
    prefill_tokens_per_s: float | None = None


@dataclass(frozen=True)
class Decision:
    """A controller output: the new limit, which way it moved and why."""

    t: float
    old_limit: int
    new_limit: int
    direction: Direction
    reason: str
