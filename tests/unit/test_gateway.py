"""The gateway in-process (no engine): an error no layer answered is an OpenAI-style 500,
counted like every answer; a scrape runs off the event loop."""

from __future__ import annotations

import asyncio
import json
import threading

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily

from serve.app import Gateway, Phase
from serve.settings import Settings


async def call(app, path: str) -> tuple[int, dict, list]:
    sent = []

    async def receive():
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": path, "headers": [],
             "query_string": b""}
    await app(scope, receive, send)
    start = next(m for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return start["status"], json.loads(body), sent


async def test_an_unanswered_error_is_a_counted_openai_500():
    gateway = Gateway(Settings(device="cpu"), registry=CollectorRegistry())

    async def broken(scope, receive, send):
        raise RecursionError("deep")

    gateway.state.openai_app, gateway.state.phase = broken, Phase.READY
    status, body, _ = await call(gateway, "/v1/chat/completions")
    assert status == 500 and body["error"]["type"] == "server_error"
    counted = gateway.metrics.http_responses.labels(route="/v1/chat/completions", code="500")
    assert counted._value.get() == 1


async def test_an_error_after_the_answer_started_is_not_answered_twice():
    gateway = Gateway(Settings(device="cpu"), registry=CollectorRegistry())

    async def half(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        raise RuntimeError("mid-answer")

    gateway.state.openai_app, gateway.state.phase = half, Phase.READY
    try:
        await call(gateway, "/v1/responses")
    except RuntimeError:
        pass  # re-raised for the server to close the connection
    else:
        raise AssertionError("an error after the response started must not be swallowed")
    assert gateway.metrics.http_responses.labels(route="/v1/responses",
                                                 code="200")._value.get() == 1


async def test_a_scrape_does_not_stall_the_event_loop():
    """A ``/metrics`` scrape is generated off the event loop that streams every answer: a
    collector that waits for the loop to run a coroutine completes (on the loop it would wait
    for itself until its timeout)."""
    registry = CollectorRegistry()
    loop_ran = threading.Event()
    seen = []

    class WaitsForTheLoop:
        def collect(self):
            seen.append(loop_ran.wait(timeout=5))
            yield GaugeMetricFamily("phi3v_test_probe", "test", value=1)

    registry.register(WaitsForTheLoop())
    gateway = Gateway(Settings(device="cpu"), registry=registry)

    async def tick():
        await asyncio.sleep(0.01)
        loop_ran.set()

    ticker = asyncio.create_task(tick())
    sent = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    await gateway({"type": "http", "method": "GET", "path": "/metrics", "headers": [],
                   "query_string": b""}, receive, send)
    await ticker
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    assert sent[0]["status"] == 200 and b"phi3v_test_probe 1.0" in body
    assert seen == [True]
