"""Our Prometheus series, next to vLLM's ``vllm:*`` ones on the same ``/metrics``.

Declared once here, in the default registry that vLLM's Prometheus stat logger also uses, with
base units in names and ``_total`` on counters (prometheus/client_python conventions; the
client appends ``_total`` to counters). The ``phi3v_*`` names are a contract: dashboards, alert
rules and autoscalers refer to them.
"""

from __future__ import annotations

from prometheus_client import REGISTRY, Counter, Gauge, Histogram

from serve.admission.controller import REASONS
from serve.admission.limiter import REJECT_REASONS

#: Buckets (seconds) for queue wait and gateway-side TTFT: 10 ms .. 2 min.
LATENCY_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120)

PENDING = Gauge("phi3v_pending_requests",
                "Requests queued at the gateway, waiting for an engine slot.")
RUNNING = Gauge("phi3v_running_requests",
                "Requests admitted into the engine and not finished (in flight).")
MAX_NUM_SEQS = Gauge("phi3v_max_num_seqs",
                     "Live admission limit: the effective max_num_seqs (requests).")
CEILING = Gauge("phi3v_max_num_seqs_ceiling",
                "Engine max_num_seqs fixed at start: the highest the live limit can go.")
KV_SAFE_SEQS = Gauge("phi3v_kv_safe_seqs",
                     "Requests whose KV cache fits at once (engine KV tokens / tokens of a "
                     "typical image request, at most the ceiling): auto's start and idle limit.")
REJECTED = Counter("phi3v_rejected_requests",
                   "Requests refused by admission control (HTTP 429), by reason.", ["reason"])
QUEUE_WAIT = Histogram("phi3v_queue_wait_seconds",
                       "Seconds a request waited at the gateway before admission or refusal.",
                       buckets=LATENCY_BUCKETS_S)
DECISIONS = Counter("phi3v_autotuner_decisions",
                    "Autotuner decisions, by direction (up/down/hold) and reason.",
                    ["direction", "reason"])
FINISHED = Counter("phi3v_finished_requests",
                   "Chat requests that finished with a complete answer (HTTP 200).")
ABORTED = Counter("phi3v_aborted_requests",
                  "Generation requests whose client left before the whole answer was sent "
                  "(vLLM aborted them; not finished, not goodput).")
GOODPUT = Counter("phi3v_goodput_requests",
                  "Finished requests that met both the TTFT and the ITL target (goodput).")
SLO_TTFT = Gauge("phi3v_slo_ttft_seconds", "TTFT target, seconds (p90 objective).")
SLO_ITL = Gauge("phi3v_slo_itl_seconds", "Inter-token latency target, seconds.")
TTFT = Histogram("phi3v_request_ttft_seconds",
                 "Client-side TTFT of streamed requests, queue wait included, seconds.",
                 buckets=LATENCY_BUCKETS_S)
IMAGES = Histogram("phi3v_request_images",
                   "Images per chat request.", buckets=(0, 1, 2, 3, 4, 6, 8, 16))
REQUESTS = Counter("phi3v_requests",
                   "Generation requests that reached admission control (arrivals).")
MAX_QUEUE = Gauge("phi3v_max_queue", "Most requests the gateway queue holds (max_queue).")
MIN_SEQS = Gauge("phi3v_autotuner_min_seqs", "Floor of the live limit (requests).")
HEADROOM = Gauge("phi3v_autotuner_headroom_ratio",
                 "The autotuner increases only while p90 latency < headroom x target.")
KV_HIGH = Gauge("phi3v_autotuner_kv_high_ratio",
                "KV-cache usage (0-1) the autotuner treats as full.")
GPU_BUSY = Gauge("phi3v_autotuner_gpu_busy_ratio",
                 "GPU utilization (0-1) above which the autotuner does not increase.")
AUTOTUNER_AUTO = Gauge("phi3v_autotuner_auto_mode",
                       "1 when the autotuner moves the limit (mode auto), 0 when static.")

for _reason in REJECT_REASONS:
    REJECTED.labels(reason=_reason)


class GpuUtilizationGauge:
    """``phi3v_gpu_utilization_ratio``: registered only where NVML reports a GPU, so on CPU
    the series is absent rather than a fake 0."""

    def __init__(self) -> None:
        self._gauge: Gauge | None = None

    def set(self, ratio: float | None) -> None:
        """Record utilization 0-1; ``None`` (unavailable) leaves the series absent."""
        if ratio is None:
            return
        if self._gauge is None:
            self._gauge = Gauge("phi3v_gpu_utilization_ratio",
                                "GPU utilization 0-1 (NVML, mean over GPUs).",
                                registry=REGISTRY)
        self._gauge.set(ratio)


def record_decision(direction: str, reason: str) -> None:
    """Count one autotuner decision."""
    DECISIONS.labels(direction=direction, reason=reason).inc()


def init_decision_series(directions=("up", "down", "hold")) -> None:
    """Create every (direction, reason) pair at 0 so rates exist before the first event."""
    for d in directions:
        for r in REASONS:
            DECISIONS.labels(direction=d, reason=r)
