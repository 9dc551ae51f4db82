"""``make bench``'s W1 client against the real server: vLLM's own serving benchmark, with the
goodput it scores under the SLO targets we pass it (``bench.workloads.serving_benchmark``)."""

from __future__ import annotations

import io

from bench.process import TINY_MODEL
from bench.workloads import serving_benchmark
from serve.admission.goodput import SloTargets


def test_vllm_serving_benchmark_scores_goodput_by_our_targets(server):
    """Four text chats at concurrency 2: under lenient targets every finished request is good
    (goodput = throughput); under a TTFT target no request can meet (1 us) none is; without
    targets no goodput is scored."""
    def bench(slo: SloTargets | None) -> dict:
        return serving_benchmark(server.base_url, TINY_MODEL, server.model, "text", 2, 4, 0,
                                 io.StringIO(), slo)

    lenient = bench(SloTargets(60.0, 5.0))
    assert lenient["completed"] == 4, lenient
    assert abs(lenient["request_goodput"] - lenient["request_throughput"]) < 1e-9
    impossible = bench(SloTargets(1e-6, 5.0))
    assert impossible["completed"] == 4 and impossible["request_goodput"] == 0.0
    assert bench(None).get("request_goodput") is None


def test_vllm_serving_benchmark_does_not_scrape_the_server(server):
    """A run sends its chats and nothing to ``/metrics`` (``bench.workloads.no_metrics_probes``:
    ``make bench`` charges a segment's API-process CPU to its requests)."""
    def scrapes() -> float:  # /metrics, like every route of no label of its own: "other"
        return server.metric("phi3v_http_responses_total", {"route": "other", "code": "200"})

    first = scrapes()
    per_read = scrapes() - first  # what one read of the counter adds itself
    before = scrapes()
    result = serving_benchmark(server.base_url, TINY_MODEL, server.model, "text", 2, 2, 0,
                               io.StringIO())
    assert result["completed"] == 2, result
    assert scrapes() - before == per_read
