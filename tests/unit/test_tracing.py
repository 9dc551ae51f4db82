"""The request path's spans (``serve.tracing``), in-process: the gateway's real layers in front
of a scripted peer (the network peer vLLM's app would be), spans kept in memory. The trace
received over OTLP with vLLM's own span in it is ``tests/engine/test_tracing.py``."""

from __future__ import annotations

import asyncio
import threading

import httpx
from opentelemetry import trace
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import CollectorRegistry

from serve.app import Gateway, Phase, compose
from serve.settings import Settings
from serve.tracing import NO_SPANS, SERVICE_NAME, Tracing

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
CHAT = {"messages": [{"role": "user", "content": "Hi"}]}


class Peer:
    """vLLM's app in the tests: records the headers it gets, answers 200 (once ``release`` is
    set, when given)."""

    def __init__(self, release: asyncio.Event | None = None) -> None:
        self.headers: list[dict[bytes, bytes]] = []
        self.release = release

    async def __call__(self, scope, receive, send) -> None:
        await receive()
        self.headers.append(dict(scope["headers"]))
        if self.release is not None:
            await self.release.wait()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": b"{}", "more_body": False})


def traced_gateway(peer: Peer, **settings) -> tuple[Gateway, InMemorySpanExporter]:
    """A ready gateway whose layers lead to ``peer``, tracing to memory."""
    gateway = Gateway(Settings(device="cpu", **settings), registry=CollectorRegistry())
    spans = InMemorySpanExporter()
    gateway.tracing = Tracing(SimpleSpanProcessor(spans))
    gateway.state.openai_app = compose(peer, gateway.request_layers())
    gateway.state.phase = Phase.READY
    return gateway, spans


def client(gateway: Gateway) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=gateway), base_url="http://gw")


def by_name(spans) -> dict[str, object]:
    return {s.name: s for s in spans}


def traceparent(span) -> str:
    ctx = span.get_span_context()
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{ctx.trace_flags:02x}"


def test_tracing_off_creates_nothing_and_adds_no_layer():
    """No endpoint: no tracer, no provider set globally, no span layer, no export thread."""
    gateway = Gateway(Settings(device="cpu"), registry=CollectorRegistry())
    assert gateway.tracing is None
    assert all(layers == [] for layers in NO_SPANS)
    # body limit, intake, tenant limits, admission, stream guard
    assert len(gateway.request_layers()) == 5
    assert isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)
    assert not [t for t in threading.enumerate() if "Otel" in t.name]


def test_tracing_on_adds_one_layer_per_span():
    gateway = Gateway(Settings(device="cpu", otlp_traces_endpoint="http://127.0.0.1:9"),
                      registry=CollectorRegistry())
    try:
        assert gateway.tracing is not None
        assert len(gateway.request_layers()) == 9
        assert [t for t in threading.enumerate() if "Otel" in t.name]  # the batch exporter
        # The gateway's provider is its own: vLLM sets the global one.
        assert isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)
    finally:
        gateway.tracing.shutdown()


async def test_the_client_trace_continues_and_vllm_gets_the_server_span_as_parent():
    peer = Peer()
    gateway, exporter = traced_gateway(peer)
    async with client(gateway) as c:
        r = await c.post("/v1/chat/completions", json=CHAT, headers={
            "traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01", "tracestate": "vendor=x"})
    assert r.status_code == 200
    spans = by_name(exporter.get_finished_spans())
    server = spans["POST /v1/chat/completions"]
    assert server.kind is trace.SpanKind.SERVER
    assert server.resource.attributes["service.name"] == SERVICE_NAME
    assert f"{server.context.trace_id:032x}" == CLIENT_TRACE
    assert f"{server.parent.span_id:016x}" == CLIENT_SPAN and server.parent.is_remote
    assert server.attributes["http.response.status_code"] == 200
    assert server.attributes["phi3v.request_id"] == r.headers["x-request-id"]
    for name in ("intake", "admission"):
        assert spans[name].parent.span_id == server.context.span_id
        assert spans[name].context.trace_id == server.context.trace_id
    assert spans["intake"].attributes["phi3v.intake.outcome"] == "accepted"
    assert spans["intake"].attributes["phi3v.intake.images"] == 0
    assert spans["intake"].end_time <= spans["admission"].start_time
    admission = spans["admission"].attributes
    assert admission["phi3v.admission.outcome"] == "admitted"
    assert admission["phi3v.admission.limit"] == gateway.admission.limiter.limit
    # vLLM's app sees one traceparent: the gateway's server span, the client's tracestate kept.
    assert peer.headers[0][b"traceparent"].decode() == traceparent(server)
    assert peer.headers[0][b"tracestate"] == b"vendor=x"


async def test_without_a_traceparent_the_gateway_starts_the_trace():
    peer = Peer()
    gateway, exporter = traced_gateway(peer)
    async with client(gateway) as c:
        assert (await c.post("/v1/chat/completions", json=CHAT)).status_code == 200
        assert (await c.get("/v1/models")).status_code == 200  # not a generation route
    spans = by_name(exporter.get_finished_spans())
    assert set(spans) == {"POST /v1/chat/completions", "intake", "admission"}
    server = spans["POST /v1/chat/completions"]
    assert server.parent is None
    assert peer.headers[0][b"traceparent"].decode() == traceparent(server)


async def test_a_refusing_stage_ends_its_span_with_the_status_and_reason():
    """Intake refuses bad JSON (400): no admission span. Admission refuses a request over its
    limit and queue (429 ``queue_full``): the reason and the live limit on its span."""
    release = asyncio.Event()
    peer = Peer(release)
    gateway, exporter = traced_gateway(peer, autotune="static", admission_limit=1, max_queue=0)
    async with client(gateway) as c:
        r = await c.post("/v1/chat/completions", content=b'{"messages": [')
        assert r.status_code == 400
        refused = by_name(exporter.get_finished_spans())
        assert set(refused) == {"POST /v1/chat/completions", "intake"}
        assert refused["intake"].attributes["phi3v.intake.outcome"] == "refused"
        assert refused["intake"].attributes["http.response.status_code"] == 400
        assert "phi3v.intake.images" not in refused["intake"].attributes
        exporter.clear()

        held = asyncio.create_task(c.post("/v1/chat/completions", json=CHAT))
        while not peer.headers:
            await asyncio.sleep(0.01)
        r = await c.post("/v1/chat/completions", json=CHAT)
        release.set()
        assert (await held).status_code == 200
    assert r.status_code == 429
    spans = exporter.get_finished_spans()
    refusal = [s for s in spans if s.name == "admission"
               and s.attributes["phi3v.admission.outcome"] == "refused"]
    assert len(refusal) == 1
    attrs = refusal[0].attributes
    assert attrs["phi3v.admission.reason"] == "queue_full"
    assert attrs["http.response.status_code"] == 429
    assert attrs["phi3v.admission.limit"] == 1 and attrs["phi3v.admission.in_flight"] == 1
    assert len(peer.headers) == 1  # the refused request never reached vLLM's app
