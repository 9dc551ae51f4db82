"""Every ``phi3v_*`` Prometheus series of the stack, declared in one place.

The series sit next to vLLM's ``vllm:*`` ones on the same ``/metrics``: the API process builds
one :class:`Metrics` on vLLM's registry (``serve.app``); tests and the simulator build theirs
on a fresh :class:`~prometheus_client.CollectorRegistry`, so nothing here is process-global.
Names carry base units and counters ``_total`` (prometheus/client_python appends it), as
Prometheus' naming guide asks. The names are a contract: dashboards, alert rules and
autoscalers use them (``monitoring/README.md`` lists them; a test keeps the two equal).

| series | type | unit | updated by |
|---|---|---|---|
| ``phi3v_requests_total`` | counter | requests | admission middleware, on arrival |
| ``phi3v_rejected_requests_total{reason}`` | counter | requests | admission middleware (429) |
| ``phi3v_queue_wait_seconds`` | histogram | seconds | admission middleware |
| ``phi3v_finished_requests_total`` | counter | requests | admission middleware |
| ``phi3v_aborted_requests_total`` | counter | requests | admission middleware |
| ``phi3v_goodput_requests_total`` | counter | requests | admission middleware |
| ``phi3v_request_ttft_seconds`` | histogram | seconds | admission middleware |
| ``phi3v_request_images`` | histogram | images | admission middleware |
| ``phi3v_pending_requests`` | gauge | requests | read from the limiter at scrape |
| ``phi3v_queued_requests`` | gauge | requests | read from limiter + engine stats at scrape |
| ``phi3v_running_requests`` | gauge | requests | read from the limiter at scrape |
| ``phi3v_max_num_seqs`` | gauge | requests | read from the limiter at scrape |
| ``phi3v_prefill_backlog_seconds`` | gauge | seconds | read from the limiter at scrape |
| ``phi3v_max_num_seqs_ceiling`` | gauge | requests | admission service, at start |
| ``phi3v_kv_safe_seqs`` | gauge | requests | admission service, after the engine boots |
| ``phi3v_max_queue`` | gauge | requests | admission service, at start |
| ``phi3v_slo_ttft_seconds`` | gauge | seconds | admission service, at start |
| ``phi3v_slo_itl_seconds`` | gauge | seconds | admission service, at start |
| ``phi3v_autotuner_decisions_total{direction,reason}`` | counter | decisions | autotuner loop |
| ``phi3v_autotuner_min_seqs`` | gauge | requests | admission service, at start |
| ``phi3v_autotuner_headroom_ratio`` | gauge | ratio | admission service, at start |
| ``phi3v_autotuner_kv_high_ratio`` | gauge | ratio | admission service, at start |
| ``phi3v_autotuner_gpu_busy_ratio`` | gauge | ratio | admission service, at start |
| ``phi3v_autotuner_auto_mode`` | gauge | 0/1 | admission service, at start |
| ``phi3v_gpu_utilization_ratio`` | gauge | ratio | autotuner loop (only where NVML sees a GPU) |
| ``phi3v_http_responses_total{route,code}`` | counter | responses | gateway, every answer |
| ``phi3v_ready`` | gauge | 0/1 | gateway life cycle |
| ``phi3v_tenant_requests_total{tenant}`` | counter | requests | tenant accounting, each request |
| ``phi3v_tenant_tokens_total{tenant,kind}`` | counter | tokens | tenant accounting, at the end |
| ``phi3v_tenant_refusals_total{tenant,reason}`` | counter | requests | tenant accounting (429) |
| ``phi3v_tenant_good_requests_total{tenant}`` | counter | requests | tenant accounting (goodput) |
| ``phi3v_tenant_budget_used_ratio{tenant,period}`` | gauge | ratio | quota, read at scrape |
| ``phi3v_tenant_running_requests{tenant}`` | gauge | requests | fair queue, read at scrape |
| ``phi3v_tenant_pending_requests{tenant}`` | gauge | requests | fair queue, read at scrape |
| ``phi3v_image_cache_lookups_total{result}`` | counter | lookups | image cache, at scrape |
| ``phi3v_image_cache_bytes`` | gauge | bytes | image cache, at scrape |

The ``tenant`` label is a tenant's name from the keys file (``default`` without one): never a
key, and bounded by the file.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from serve.admission.limiter import REJECT_REASONS
from serve.admission.signals import REASONS as DECISION_REASONS
from serve.quota import LIMITS
from serve.routes import GENERATION_ROUTES

#: Buckets (seconds) for queue wait and gateway-side TTFT: 10 ms .. 2 min.
LATENCY_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120)
#: Buckets of images per request (the default limit is 4; ``--max-images-per-prompt`` up to 16).
IMAGE_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 16)
#: ``code`` label values created at 0 for each generation route, so rates exist at once.
INITIAL_CODES = ("200", "400", "429", "500", "503")
#: ``kind`` label of ``phi3v_tenant_tokens_total`` (prompt tokens include the image tokens).
TOKEN_KINDS = ("prompt", "completion", "image")
#: ``reason`` label of ``phi3v_tenant_refusals_total``: a tenant limit (``serve.quota``) or
#: admission's 429 reason.
TENANT_REFUSAL_REASONS = (*LIMITS, *REJECT_REASONS)


class Metrics:
    """The ``phi3v_*`` series of one API process (module docstring), in ``registry``.

    Every label value known in advance (rejection reasons, decision reasons, the usual codes
    of each generation route) is created at 0, so rates exist before the first event.

    Args:
        registry: where the series are registered; a fresh registry when None (tests, the
            simulator). The API process passes vLLM's, so ``/metrics`` serves both.

    Raises:
        ValueError: a series of the same name is already in ``registry``
            (``prometheus_client``'s duplicate check: one :class:`Metrics` per registry).
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        # --- admission middleware -----------------------------------------------------------
        self.requests = Counter("phi3v_requests",
                                "Generation requests that reached admission control "
                                "(arrivals).", registry=r)
        self.rejected = Counter("phi3v_rejected_requests",
                                "Requests refused by admission control (HTTP 429), by reason.",
                                ["reason"], registry=r)
        self.queue_wait = Histogram("phi3v_queue_wait_seconds",
                                    "Seconds a request waited at the gateway before admission "
                                    "or refusal.", buckets=LATENCY_BUCKETS_S, registry=r)
        self.finished = Counter("phi3v_finished_requests",
                                "Generation requests that finished with a complete answer "
                                "(HTTP 200).", registry=r)
        self.aborted = Counter("phi3v_aborted_requests",
                               "Generation requests whose client left before the whole answer "
                               "was sent (vLLM aborted them; not finished, not goodput).",
                               registry=r)
        self.goodput = Counter("phi3v_goodput_requests",
                               "Finished requests that met both the TTFT and the ITL target "
                               "(goodput).", registry=r)
        self.ttft = Histogram("phi3v_request_ttft_seconds",
                              "Client-side TTFT of streamed requests, queue wait included, "
                              "seconds.", buckets=LATENCY_BUCKETS_S, registry=r)
        self.images = Histogram("phi3v_request_images", "Images per generation request.",
                                buckets=IMAGE_BUCKETS, registry=r)
        # --- limiter state, read at scrape time -----------------------------------------------
        self.pending = Gauge("phi3v_pending_requests",
                             "Requests queued at the gateway, waiting for an engine slot.",
                             registry=r)
        # The replica's whole queue, the one a router or an autoscaler must read: admission
        # holds requests at the gateway, so vLLM's own vllm:num_requests_waiting stays near 0
        # while requests wait here (deploy/k8s/helm/inferencepool-values.yaml, api.yaml's KEDA).
        self.queued = Gauge("phi3v_queued_requests",
                            "Requests waiting for the engine on this replica: the gateway's "
                            "admission queue (phi3v_pending_requests) plus vLLM's waiting "
                            "queue (vllm:num_requests_waiting), requests.", registry=r)
        self.running = Gauge("phi3v_running_requests",
                             "Requests admitted into the engine and not finished (in flight).",
                             registry=r)
        self.max_num_seqs = Gauge("phi3v_max_num_seqs",
                                  "Live admission limit: the effective max_num_seqs "
                                  "(requests).", registry=r)
        self.prefill_backlog = Gauge("phi3v_prefill_backlog_seconds",
                                     "Predicted prefill of the requests admitted without a "
                                     "first token yet, engine seconds (mode auto; "
                                     "serve.admission.prefill).", registry=r)
        # --- configuration, set at start --------------------------------------------------------
        self.ceiling = Gauge("phi3v_max_num_seqs_ceiling",
                             "Engine max_num_seqs fixed at start: the highest the live limit "
                             "can go.", registry=r)
        self.kv_safe_seqs = Gauge("phi3v_kv_safe_seqs",
                                  "Requests whose KV cache fits at once (engine KV tokens / "
                                  "tokens of a typical image request, at most the ceiling): "
                                  "auto's start and idle limit.", registry=r)
        self.max_queue = Gauge("phi3v_max_queue",
                               "Most requests the gateway queue holds (max_queue).", registry=r)
        self.slo_ttft = Gauge("phi3v_slo_ttft_seconds", "TTFT target, seconds (p90 objective).",
                              registry=r)
        self.slo_itl = Gauge("phi3v_slo_itl_seconds", "Inter-token latency target, seconds.",
                             registry=r)
        self.min_seqs = Gauge("phi3v_autotuner_min_seqs", "Floor of the live limit (requests).",
                              registry=r)
        self.headroom = Gauge("phi3v_autotuner_headroom_ratio",
                              "The autotuner increases only while p90 latency < headroom x "
                              "target.", registry=r)
        self.kv_high = Gauge("phi3v_autotuner_kv_high_ratio",
                             "KV-cache usage (0-1) the autotuner treats as full.", registry=r)
        self.gpu_busy = Gauge("phi3v_autotuner_gpu_busy_ratio",
                              "GPU utilization (0-1) above which the autotuner does not "
                              "increase.", registry=r)
        self.auto_mode = Gauge("phi3v_autotuner_auto_mode",
                               "1 when the autotuner moves the limit (mode auto), 0 when "
                               "static.", registry=r)
        # --- autotuner loop -------------------------------------------------------------------
        self.decisions = Counter("phi3v_autotuner_decisions",
                                 "Autotuner decisions, by direction (up/down/hold) and reason.",
                                 ["direction", "reason"], registry=r)
        self._gpu_utilization: Gauge | None = None
        # --- gateway ------------------------------------------------------------------------
        self.http_responses = Counter("phi3v_http_responses",
                                      "HTTP responses by route and status code, the gateway's "
                                      "own 401/413/429/503 included.", ["route", "code"],
                                      registry=r)
        self.ready = Gauge("phi3v_ready",
                           "1 while /ready answers 200 (the engine can serve), else 0.",
                           registry=r)
        # --- tenants (serve.accounting) ---------------------------------------------------
        self.tenants = TenantSeries(r)
        # --- intake (serve.intake.cache) --------------------------------------------------
        self.image_cache = ImageCacheSeries(r)
        for reason in REJECT_REASONS:
            self.rejected.labels(reason=reason)
        for route in GENERATION_ROUTES:
            for code in INITIAL_CODES:
                self.http_responses.labels(route=route, code=code)
        for code in ("408", "431", "503"):  # answered below the app (serve.http_limits)
            self.http_responses.labels(route="other", code=code)
        for direction in ("up", "down", "hold"):
            for reason in DECISION_REASONS:
                self.decisions.labels(direction=direction, reason=reason)

    def record_decision(self, direction: str, reason: str) -> None:
        """Count one autotuner decision."""
        self.decisions.labels(direction=direction, reason=reason).inc()

    def set_gpu_utilization(self, ratio: float | None) -> None:
        """``phi3v_gpu_utilization_ratio`` (0-1). Registered on the first known value, so on
        a machine without a GPU the series is absent rather than a fake 0."""
        if ratio is None:
            return
        if self._gpu_utilization is None:
            self._gpu_utilization = Gauge("phi3v_gpu_utilization_ratio",
                                          "GPU utilization 0-1 (NVML, mean over GPUs).",
                                          registry=self.registry)
        self._gpu_utilization.set(ratio)

    def names(self) -> list[str]:
        """Every series name this object can expose (sample names, e.g. ``_total``), sorted:
        the registry's, plus the GPU gauge that appears where NVML sees a GPU."""
        names = {m.name + ("_total" if m.type == "counter" else "")
                 for m in self.registry.collect()}
        return sorted(names | {"phi3v_gpu_utilization_ratio"})


class TenantSeries:
    """The ``phi3v_tenant_*`` series: a collector that keeps each tenant's counts as plain
    integers and exports them at scrape time (client_python's custom-collector shape).
    Counting a request (:meth:`count`) is a few additions on the event loop: no lock and no
    label lookup per request, which five labelled counters cost (~3 us).

    Every tenant added (:meth:`add_tenant`) exports all its series at 0 (each token kind and
    refusal reason), so its rates exist before its first request. The budget gauge reads
    :attr:`budgets` at scrape time, the slot gauges :attr:`slots`.
    """

    #: The counts of a tenant, in the order :meth:`count` keeps them.
    FIELDS = ("requests", "prompt", "completion", "image", "good")

    def __init__(self, registry: CollectorRegistry) -> None:
        #: tenant -> [requests, prompt, completion, image, good requests]
        self._counts: dict[str, list[int]] = {}
        #: tenant -> refusals by reason
        self._refusals: dict[str, dict[str, int]] = {}
        #: ``(tenant, period, ratio)`` of every budget: bound by ``serve.accounting``.
        self.budgets: Callable[[], Iterable[tuple[str, str, float]]] = tuple
        #: ``tenant -> (running, pending)``: the admission slots the tenant holds and its
        #: requests waiting for one (``serve.admission.fair.FairQueue``); bound by
        #: ``serve.admission.service``. None: the slot gauges are not exported.
        self.slots: Callable[[str], tuple[int, int]] | None = None
        registry.register(self)

    def add_tenant(self, tenant: str) -> None:
        """Export ``tenant``'s series (at 0 until it counts)."""
        self._counts.setdefault(tenant, [0] * len(self.FIELDS))
        self._refusals.setdefault(tenant, dict.fromkeys(TENANT_REFUSAL_REASONS, 0))

    def count(self, tenant: str, prompt: int = 0, completion: int = 0, image: int = 0,
              good: bool = False, refusal: str | None = None) -> None:
        """One request of ``tenant`` (added first, :meth:`add_tenant`): its tokens, whether
        it was good, the reason it was refused (one of :data:`TENANT_REFUSAL_REASONS`)."""
        row = self._counts[tenant]
        row[0] += 1
        row[1] += prompt
        row[2] += completion
        row[3] += image
        row[4] += good
        if refusal is not None:
            self._refusals[tenant][refusal] += 1

    def value(self, tenant: str, field: str) -> int:
        """One count of ``tenant`` (:data:`FIELDS`)."""
        return self._counts[tenant][self.FIELDS.index(field)]

    def describe(self) -> Iterator[Metric]:
        return iter(self._families())

    def collect(self) -> Iterator[Metric]:
        requests, tokens, refusals, good, budget, running, pending = self._families()
        slots = self.slots
        for tenant, row in list(self._counts.items()):
            n, prompt, completion, image, good_n = tuple(row)
            requests.add_metric([tenant], n)
            for kind, value in zip(TOKEN_KINDS, (prompt, completion, image), strict=True):
                tokens.add_metric([tenant, kind], value)
            good.add_metric([tenant], good_n)
            if slots is not None:
                held, waiting = slots(tenant)
                running.add_metric([tenant], held)
                pending.add_metric([tenant], waiting)
        for tenant, reasons in list(self._refusals.items()):
            for reason, n in list(reasons.items()):
                refusals.add_metric([tenant, reason], n)
        for tenant, period, ratio in self.budgets():
            budget.add_metric([tenant, period], ratio)
        return iter((requests, tokens, refusals, good, budget, running, pending))

    @staticmethod
    def _families() -> tuple[Metric, ...]:
        return (
            CounterMetricFamily("phi3v_tenant_requests",
                                "Generation requests of each tenant that passed the intake "
                                "(refused ones included).", labels=["tenant"]),
            CounterMetricFamily("phi3v_tenant_tokens",
                                "Tokens of each tenant's requests by kind: prompt (image "
                                "tokens included), completion, image.",
                                labels=["tenant", "kind"]),
            CounterMetricFamily("phi3v_tenant_refusals",
                                "Requests of each tenant refused with 429, by reason: the "
                                "tenant limit, or admission's reason.",
                                labels=["tenant", "reason"]),
            CounterMetricFamily("phi3v_tenant_good_requests",
                                "Finished requests of each tenant that met both latency "
                                "targets (goodput).", labels=["tenant"]),
            GaugeMetricFamily("phi3v_tenant_budget_used_ratio",
                              "Share of each tenant's token budget used (tokens of the UTC day "
                              "or month / tokens_per_day or tokens_per_month); only tenants "
                              "with that budget.", labels=["tenant", "period"]),
            GaugeMetricFamily("phi3v_tenant_running_requests",
                              "Admission slots each tenant holds now: its requests admitted "
                              "into the engine and not finished.", labels=["tenant"]),
            GaugeMetricFamily("phi3v_tenant_pending_requests",
                              "Requests of each tenant waiting at the gateway for a slot.",
                              labels=["tenant"]),
        )


class ImageCacheSeries:
    """``phi3v_image_cache_lookups_total{result}`` and ``phi3v_image_cache_bytes``: the
    intake's cache of prepared images (``serve.intake.cache.ImageCache``), read at scrape time
    from the cache's own counts, so a lookup costs nothing more. A chat client re-sends its
    history's images every turn: a ``hit`` is such an image forwarded as the bytes vLLM saw
    before (vLLM's ``vllm:mm_cache_hits_total`` then hits too, on the same replica).

    Until :attr:`cache` is bound (``serve.app``) both series export 0.
    """

    #: ``result`` label values.
    RESULTS = ("hit", "miss")

    def __init__(self, registry: CollectorRegistry) -> None:
        #: The cache read at scrape: anything with ``hits``, ``misses`` and ``nbytes``.
        self.cache = None
        registry.register(self)

    def describe(self) -> Iterator[Metric]:
        return iter(self._families())

    def collect(self) -> Iterator[Metric]:
        lookups, held = self._families()
        cache = self.cache
        hits, misses, nbytes = ((cache.hits, cache.misses, cache.nbytes) if cache is not None
                                else (0, 0, 0))
        lookups.add_metric(["hit"], hits)
        lookups.add_metric(["miss"], misses)
        held.add_metric([], nbytes)
        return iter((lookups, held))

    @staticmethod
    def _families() -> tuple[Metric, ...]:
        return (
            CounterMetricFamily("phi3v_image_cache_lookups",
                                "Lookups of the intake's prepared-image cache by result: "
                                "hit (an image seen before, e.g. re-sent history) or miss.",
                                labels=["result"]),
            GaugeMetricFamily("phi3v_image_cache_bytes",
                              "Bytes the intake's prepared-image cache holds "
                              "(at most --image-cache-bytes)."),
        )
