"""What we take off vLLM's app (``serve.engine.drop_http_instrumentation``), on a real FastAPI
app instrumented the way vLLM 0.32 instruments its own (prometheus-fastapi-instrumentator)."""

from __future__ import annotations

import httpx
from fastapi import FastAPI
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_fastapi_instrumentator import Instrumentator
from starlette.responses import StreamingResponse

from serve.engine import drop_http_instrumentation


def instrumented_app(registry: CollectorRegistry) -> FastAPI:
    """A streaming chat route behind the instrumentator, as vLLM's ``attach_router`` sets it,
    with the middleware stack built already, as vLLM's SageMaker bootstrap leaves it (which
    constructs the middleware and registers its series)."""
    app = FastAPI()

    async def chat():
        async def tokens():
            for _ in range(3):
                yield b'data: {"choices":[]}\n\n'
        return StreamingResponse(tokens(), media_type="text/event-stream")

    app.add_api_route("/v1/chat/completions", chat, methods=["POST"])
    Instrumentator(excluded_handlers=["/metrics"], registry=registry).add().instrument(app)
    app.middleware_stack = app.build_middleware_stack()
    return app


async def post(app: FastAPI) -> httpx.Response:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        return await client.post("/v1/chat/completions", json={})


async def test_the_instrumentator_and_its_series_are_taken_off():
    kept_registry, dropped_registry = CollectorRegistry(), CollectorRegistry()
    kept, dropped = instrumented_app(kept_registry), instrumented_app(dropped_registry)
    assert b"http_requests_total" in generate_latest(dropped_registry)  # registered at build
    assert drop_http_instrumentation(dropped) == 1
    assert drop_http_instrumentation(dropped) == 0  # idempotent
    for app in (kept, dropped):
        answer = await post(app)
        assert answer.status_code == 200 and answer.text.count("data:") == 3
    assert b"http_requests_total{" in generate_latest(kept_registry)  # the control counts
    assert b"http_request" not in generate_latest(dropped_registry)
