"""The replica's queue on the live ``/metrics``, as routers and autoscalers read it.

Admission holds requests at the gateway, so vLLM's ``vllm:num_requests_waiting`` sees only
what admission let in; ``phi3v_queued_requests`` is the whole queue (gateway + engine). The
endpoint picker's flags (``deploy/k8s/helm/inferencepool-values.yaml``) must name gauges this
server serves.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers import ROOT, start_server, stop_server

EPP_VALUES = ROOT / "deploy" / "k8s" / "helm" / "inferencepool-values.yaml"
#: The picker's metric flags (gateway-api-inference-extension v1.0, cmd/epp/runner/runner.go).
EPP_METRIC_FLAGS = ("total-queued-requests-metric", "kv-cache-usage-percentage-metric",
                    "lora-info-metric")


@pytest.fixture(scope="module")
def one_seq_server():
    """One sequence at a time in vLLM (max_num_seqs 1, static limit 1) and, once a completion
    rate is known, one more admitted into vLLM's waiting queue (engine queue 1); the rest
    wait at the gateway. Lenient SLO and queue wait, so nothing queued is refused while the
    test looks."""
    srv = start_server([
        "--autotune", "static", "--max-num-seqs", "1", "--admission-limit", "1",
        "--engine-queue", "1", "--max-queue", "4", "--max-queue-wait-s", "120",
        "--slo-ttft-s", "100", "--slo-itl-s", "50",
    ], name="one-seq-server")
    yield srv
    stop_server(srv)


async def complete_short(client: httpx.AsyncClient, srv) -> None:
    """One 1-token answer, to completion."""
    body = {"model": srv.model, "max_tokens": 1,
            "messages": [{"role": "user", "content": "Hi."}]}
    (await client.post(f"{srv.base_url}/v1/chat/completions", json=body)).raise_for_status()


async def stream_until_cancelled(client: httpx.AsyncClient, srv) -> None:
    body = {"model": srv.model, "max_tokens": 4000, "ignore_eos": True, "stream": True,
            "messages": [{"role": "user", "content": "Tell me a story."}]}
    async with client.stream("POST", f"{srv.base_url}/v1/chat/completions", json=body) as r:
        async for _ in r.aiter_bytes():
            pass


async def test_the_whole_queue_counts_requests_held_at_the_gateway(one_seq_server):
    """5 long requests: 1 runs, 1 waits inside vLLM, 3 wait at the gateway. vLLM's gauge says
    1; phi3v_queued_requests says 4, in the same scrape. (Two short answers first: the
    engine queue admits nobody before the server has a completion rate.)"""
    srv = one_seq_server
    async with httpx.AsyncClient(timeout=300) as client:
        for _ in range(2):
            await complete_short(client, srv)
        tasks = []
        try:
            for _ in range(5):  # one at a time: the first two reach vLLM, in order
                tasks.append(asyncio.create_task(stream_until_cancelled(client, srv)))
                await asyncio.sleep(0.3)
            deadline = time.monotonic() + 90
            while True:
                scrape = await asyncio.to_thread(srv.metrics)
                seen = {name: srv.metric(name, scrape=scrape) for name in (
                    "phi3v_pending_requests", "vllm:num_requests_waiting",
                    "vllm:num_requests_running", "phi3v_queued_requests")}
                if (seen["phi3v_pending_requests"], seen["vllm:num_requests_waiting"]) == (3, 1):
                    break
                assert time.monotonic() < deadline, f"never 3 at the gateway, 1 in vLLM: {seen}"
                await asyncio.sleep(0.1)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    assert seen["vllm:num_requests_running"] == 1
    assert seen["phi3v_queued_requests"] == 4, seen


def test_endpoint_picker_flags_name_gauges_this_server_serves(one_seq_server):
    """Each metric the picker is told to read is a gauge on the live /metrics (the picker
    reads a gauge's value); the LoRA scrape is off because the series is absent here, and
    the picker's own KV default is absent too (why the flag is set)."""
    values = yaml.safe_load(EPP_VALUES.read_text())
    flags = {f["name"]: f["value"] for f in values["inferenceExtension"]["flags"]}
    assert set(EPP_METRIC_FLAGS) <= set(flags)
    text = httpx.get(f"{one_seq_server.base_url}/metrics", timeout=10).text
    families = {f.name: f.type for f in text_string_to_metric_families(text)}
    assert flags["total-queued-requests-metric"] == "phi3v_queued_requests"
    for flag in ("total-queued-requests-metric", "kv-cache-usage-percentage-metric"):
        assert families.get(flags[flag]) == "gauge", (flag, flags[flag])
    assert flags["lora-info-metric"] == "" and "vllm:lora_requests_info" not in families
    assert "vllm:gpu_cache_usage_perc" not in families  # the picker's v1.0 default
