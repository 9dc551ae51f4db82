"""OpenTelemetry traces of the request path, in the same trace as vLLM's own request span.

With ``--otlp-traces-endpoint`` (vLLM's flag, ``Settings.otlp_traces_endpoint``) each
generation request (``serve.routes.GENERATION_ROUTES``) is one trace::

    POST /v1/chat/completions   SERVER, ours: the whole request; continues the client's
    |                           W3C ``traceparent``, else starts a new trace
    |-- intake                  validation, image fetch and decode, prompt length
    |-- admission               the wait for a slot and the decision (the live limit;
    |                           the refusal reason when refused)
    `-- llm_request             SERVER, vLLM's: its timings (queue, prefill, decode, tokens)

1. vLLM makes ``llm_request`` when the request finishes (``vllm.v1.engine.output_processor``,
   ``OutputProcessor.do_tracing``) in the API process, whichever process runs the engine core,
   with the parent read from the ``traceparent`` header its app received
   (``vllm.tracing.extract_trace_context``). The gateway rewrites that header to its own server
   span (:class:`ForwardLayer`), so vLLM's span joins the gateway's trace. Both sides use
   opentelemetry's W3C Trace Context propagator; no header is parsed here.
2. vLLM sets the process's global ``TracerProvider`` (``vllm.tracing.otel.init_otel_tracer``,
   when ``AsyncLLM`` starts). The gateway keeps a provider of its own (service
   :data:`SERVICE_NAME`) with vLLM's exporter rule (:func:`span_exporter`), so one collector
   endpoint receives both; vLLM's spans carry service :data:`VLLM_SERVICE_NAME` unless
   ``OTEL_SERVICE_NAME`` is set. Spans leave in batches (``BatchSpanProcessor``, tuned by the
   ``OTEL_BSP_*`` variables: every 5 s by default).
3. Off (no endpoint), :meth:`Tracing.from_settings` is None and the gateway adds no layer:
   the request path pays nothing.

Each span is opened and closed by a layer of the request path (:class:`SpanLayers`), placed
between the request's own layers in ``Gateway.request_layers``: a stage span ends where the
next layer is reached (passed), or when the answer starts while it is open (that stage
answered: refused), or when the request ends without an answer (the client left).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, NamedTuple

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from serve.asgi import (
    IMAGES_SCOPE_KEY,
    PROMPT_TOKENS_SCOPE_KEY,
    REQUEST_STATE_KEY,
    response_channel,
)
from serve.routes import GENERATION_ROUTES
from serve.settings import Settings

#: ``service.name`` of the gateway's spans.
SERVICE_NAME = "phi3v-gateway"
#: ``service.name`` of vLLM's spans when ``OTEL_SERVICE_NAME`` is not set (vLLM sets none:
#: they would read ``unknown_service``).
VLLM_SERVICE_NAME = "vllm"
#: ASGI scope key of the request's :class:`RequestTrace` (generation requests, tracing on).
TRACE_SCOPE_KEY = "phi3v.trace"
#: Response header naming why admission refused a request (``serve.admission.middleware``).
REJECT_REASON_HEADER = b"x-phi3v-reject-reason"
#: Response header carrying the request's id (``serve.intake.middleware``).
REQUEST_ID_HEADER = b"x-request-id"

PROPAGATOR = TraceContextTextMapPropagator()
#: The W3C Trace Context headers (``traceparent``, ``tracestate``) as ASGI names.
TRACE_HEADERS = frozenset(name.encode("latin-1") for name in PROPAGATOR.fields)


def span_exporter(endpoint: str) -> SpanExporter:
    """The OTLP exporter for ``endpoint``, chosen as vLLM chooses its own
    (``vllm.tracing.otel.get_span_exporter``), so one endpoint serves both:
    ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` ``grpc`` (the default; plaintext unless the
    endpoint is ``https://``) or ``http/protobuf`` (the endpoint is the full URL,
    ``.../v1/traces``).

    Raises:
        ValueError: another protocol.
    """
    protocol = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "grpc")
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter(endpoint=endpoint, insecure=True)
    if protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter(endpoint=endpoint)
    raise ValueError(f"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL {protocol!r} is not supported "
                     "(vLLM's exporter takes grpc or http/protobuf)")


class SpanLayers(NamedTuple):
    """The tracing layers, each a list of at most one layer, in request order: ``request``
    (outermost: the server span), ``intake`` (before the intake), ``admission`` (between the
    intake and admission), ``engine`` (after admission: vLLM gets our ``traceparent``)."""

    request: list[Callable[[ASGIApp], ASGIApp]]
    intake: list[Callable[[ASGIApp], ASGIApp]]
    admission: list[Callable[[ASGIApp], ASGIApp]]
    engine: list[Callable[[ASGIApp], ASGIApp]]


#: Tracing off: no layer anywhere.
NO_SPANS = SpanLayers([], [], [], [])


class Stage(NamedTuple):
    """A stage span: its ``name``, the outcome word when the request passed on (``passed``),
    and its attributes at the decision (``attributes(scope)``, scope as the next layer or the
    stage itself saw it)."""

    name: str
    passed: str
    attributes: Callable[[Scope], dict[str, Any]] | None = None


def intake_attributes(scope: Scope) -> dict[str, Any]:
    """What the intake found, in the scope it hands on (none when it refused): images and
    estimated prompt tokens."""
    found = {"phi3v.intake.images": scope.get(IMAGES_SCOPE_KEY),
             "phi3v.intake.prompt_tokens": scope.get(PROMPT_TOKENS_SCOPE_KEY)}
    return {key: value for key, value in found.items() if value is not None}


def admission_attributes(limiter) -> Callable[[Scope], dict[str, Any]]:
    """The limiter at the decision: the live limit, requests admitted, requests queued."""
    return lambda scope: {"phi3v.admission.limit": limiter.limit,
                          "phi3v.admission.in_flight": limiter.in_flight,
                          "phi3v.admission.queued": limiter.pending}


class Tracing:
    """The gateway's tracer and its layers.

    Args:
        processor: where finished spans go (a ``BatchSpanProcessor`` over the OTLP exporter in
            the server; tests pass their own).
    """

    def __init__(self, processor: SpanProcessor) -> None:
        self.provider = TracerProvider(resource=Resource.create({"service.name": SERVICE_NAME}))
        self.provider.add_span_processor(processor)
        self.tracer = self.provider.get_tracer("serve")

    @classmethod
    def from_settings(cls, settings: Settings) -> Tracing | None:
        """Tracing to ``settings.otlp_traces_endpoint``; None when unset (off). Names vLLM's
        service (``OTEL_SERVICE_NAME``, a user's value wins) before vLLM reads it."""
        endpoint = settings.otlp_traces_endpoint
        if not endpoint:
            return None
        os.environ.setdefault("OTEL_SERVICE_NAME", VLLM_SERVICE_NAME)
        return cls(BatchSpanProcessor(span_exporter(endpoint)))

    def layers(self, limiter) -> SpanLayers:
        """The layers for a gateway whose admission is ``limiter``."""
        intake = Stage("intake", "accepted", intake_attributes)
        admission = Stage("admission", "admitted", admission_attributes(limiter))
        return SpanLayers(
            request=[lambda inner: ServerSpanLayer(inner, self.tracer)],
            intake=[lambda inner: StageLayer(inner, intake)],
            admission=[lambda inner: StageLayer(inner, admission)],
            engine=[ForwardLayer],
        )

    def shutdown(self) -> None:
        """Export what is left and stop (blocking: run it in a thread)."""
        self.provider.shutdown()


class _ScopeHeaders:
    """The propagator's getter over ASGI headers (``[(name, value)]``, lowercase bytes)."""

    @staticmethod
    def get(carrier: list[tuple[bytes, bytes]], key: str) -> list[str] | None:
        name = key.lower().encode("latin-1")
        return [v.decode("latin-1") for k, v in carrier if k == name] or None

    @staticmethod
    def keys(carrier: list[tuple[bytes, bytes]]) -> list[str]:
        return [k.decode("latin-1") for k, _ in carrier]


class RequestTrace:
    """The spans of one request: the server span and its open stage span, if any."""

    __slots__ = ("tracer", "span", "stage", "stage_span", "stage_scope", "status", "_named")

    def __init__(self, tracer: trace.Tracer, span: trace.Span) -> None:
        self.tracer = tracer
        self.span = span
        self.stage: Stage | None = None
        self.stage_span: trace.Span | None = None
        self.stage_scope: Scope | None = None
        self.status: int | None = None
        self._named = False

    def enter(self, stage: Stage | None, scope: Scope, send: Send) -> None:
        """End the open stage (passed on: ``scope`` is what the next layer sees), then start
        ``stage`` (None: none)."""
        if not self._named and IMAGES_SCOPE_KEY in scope:
            # Past the intake, whose head hook (registered by now) echoes the request id.
            self._named = True
            response_channel(send, scope).on_head(self._request_id)
        if self.stage_span is not None:
            self._end_stage(scope, self.stage.passed)
        if stage is not None:
            self.stage, self.stage_scope = stage, scope
            self.stage_span = self.tracer.start_span(
                stage.name, context=trace.set_span_in_context(self.span))

    def on_head(self, message: Message) -> Message:
        """Response head hook: the status; an open stage answered (refused) the request."""
        self.status = status = message["status"]
        self.span.set_attribute("http.response.status_code", status)
        if self.stage_span is not None:
            self.stage_span.set_attribute("http.response.status_code", status)
            for name, value in message.get("headers") or []:
                if name == REJECT_REASON_HEADER:
                    self.stage_span.set_attribute(f"phi3v.{self.stage.name}.reason",
                                                  value.decode("latin-1"))
            self._end_stage(self.stage_scope, "refused")
        return message

    def _request_id(self, message: Message) -> Message:
        """Response head hook: the request's id (``X-Request-Id``) on the server span."""
        for name, value in message.get("headers") or []:
            if name == REQUEST_ID_HEADER:
                self.span.set_attribute("phi3v.request_id", value.decode("latin-1"))
        return message

    def forward_headers(self, headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
        """``headers`` with the Trace Context headers replaced by the server span's."""
        carrier: dict[str, str] = {}
        PROPAGATOR.inject(carrier, context=trace.set_span_in_context(self.span))
        return [*((k, v) for k, v in headers if k not in TRACE_HEADERS),
                *((k.encode("latin-1"), v.encode("latin-1")) for k, v in carrier.items())]

    def finish(self, scope: Scope, error: BaseException | None = None) -> None:
        """End the request's spans. A stage still open ends ``failed`` (``error``) or
        ``abandoned`` (the client left before an answer)."""
        if self.stage_span is not None:
            self._end_stage(self.stage_scope, "failed" if error is not None else "abandoned")
        state = scope.get(REQUEST_STATE_KEY) or {}
        if state.get("client_left"):
            self.span.set_attribute("phi3v.client_left", True)
        if error is not None:
            self.span.record_exception(error)
            self.span.set_status(Status(StatusCode.ERROR, type(error).__name__))
        elif self.status is not None and self.status >= 500:
            self.span.set_status(Status(StatusCode.ERROR))
        self.span.end()

    def _end_stage(self, scope: Scope, outcome: str) -> None:
        span, stage = self.stage_span, self.stage
        if stage.attributes is not None:
            span.set_attributes(stage.attributes(scope))
        span.set_attribute(f"phi3v.{stage.name}.outcome", outcome)
        if outcome == "refused" and self.status is not None and self.status >= 500:
            span.set_status(Status(StatusCode.ERROR))
        span.end()
        self.stage = self.stage_span = self.stage_scope = None


class ServerSpanLayer:
    """The server span of each generation request (other requests pass untouched), child of
    the client's ``traceparent`` when it sent a valid one."""

    def __init__(self, app: ASGIApp, tracer: trace.Tracer) -> None:
        self.app = app
        self.tracer = tracer

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path")
        if (scope["type"] != "http" or scope.get("method") != "POST"
                or path not in GENERATION_ROUTES):
            await self.app(scope, receive, send)
            return
        parent = PROPAGATOR.extract(scope.get("headers") or [], getter=_ScopeHeaders)
        span = self.tracer.start_span(f"POST {path}", context=parent, kind=SpanKind.SERVER,
                                      attributes={"http.request.method": "POST",
                                                  "url.path": path, "http.route": path})
        request = RequestTrace(self.tracer, span)
        channel = response_channel(send, scope)
        channel.on_head(request.on_head)
        scope = {**scope, TRACE_SCOPE_KEY: request}
        # Current in this task while the request runs (log records can name the trace).
        token = otel_context.attach(trace.set_span_in_context(span))
        error = None
        try:
            await self.app(scope, receive, channel)
        except BaseException as exc:
            error = exc
            raise
        finally:
            request.finish(scope, error)
            otel_context.detach(token)


class StageLayer:
    """Ends the open stage span (passed) and starts ``stage``'s."""

    def __init__(self, app: ASGIApp, stage: Stage) -> None:
        self.app = app
        self.stage = stage

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        request = scope.get(TRACE_SCOPE_KEY)
        if request is not None:
            request.enter(self.stage, scope, send)
        await self.app(scope, receive, send)


class ForwardLayer:
    """Ends the open stage span (passed) and hands the request on with the server span as its
    ``traceparent`` (and ``tracestate``), the parent of vLLM's ``llm_request``."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        request = scope.get(TRACE_SCOPE_KEY)
        if request is not None:
            request.enter(None, scope, send)
            scope = {**scope, "headers": request.forward_headers(scope.get("headers") or [])}
        await self.app(scope, receive, send)
