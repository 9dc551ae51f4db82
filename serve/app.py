"""The ASGI entry point: our operational routes in front of vLLM's OpenAI app.

The HTTP server starts at once and answers ``/health`` and ``/ready`` while the engine boots
in the background (tens of seconds on CPU, minutes for real weights on GPU); until then every
API route answers 503 with ``Retry-After``. Once the engine is up, everything that is not ours
goes to vLLM's own OpenAI app (``serve.engine.build_openai_app``).

Routes owned here:

- ``GET /health``: liveness. 200 while the process and the engine are alive (also while
  booting), 503 once the engine is dead or failed to start (restart me).
- ``GET /ready``: readiness. 200 only when the engine can serve, else 503 with the phase.
- ``GET /metrics``: Prometheus text format: vLLM's ``vllm:*`` series and ours, one registry.
- ``GET /admin/autotuner``: read-only JSON: live limit, signals, last decisions, the
  KV-safe capacity computed at boot (``kv_capacity``).
- ``GET /limits``: the request limits clients must respect (image bytes/pixels/count/formats).
- ``GET /admin/routes``: every route of vLLM's app with its policy from ``serve.routes``.
- ``GET /admin/usage``: usage per tenant and UTC day (``serve.accounting``).
- ``POST /admin/bench/admission`` (only with ``--bench-admin``): set the admission mode
  live and reset the autotuner (benchmarks).
- ``GET /admin/bench/steps`` (only with ``--bench-admin``): vLLM's timing of each engine step
  since the last read (with vLLM's ``--enable-logging-iteration-details``; ``serve.steplog``).

With ``--allowed-origins``, CORS is answered in front of everything, auth included
(``serve.cors``): a browser's preflight is never a 401.

Auth (``serve.auth``) puts the request's tenant (``serve.tenants``) in the scope; with a keys
file (``--keys-file``, ``serve.keys``) ``/admin/*`` needs an admin tenant, and SIGHUP reloads
the file.

Every other path is looked up in the route table (``serve.routes``): generation routes take
the full request path (body limit -> intake -> tenant limits -> admission -> stream guard ->
vLLM), read-only vLLM routes are served as is, and everything else (administration, scaling,
batch, token-level and, unless ``--open-routes``, the routes without intake) is 404. With
``--otlp-traces-endpoint`` each generation request is traced (``serve.tracing``).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import prometheus_client
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from serve import engine as engine_mod
from serve import http_metrics
from serve.accounting import Accounting
from serve.admission.engine_stats import stalled_s, stat_logger_factory
from serve.admission.service import Admission
from serve.asgi import REQUEST_STATE_KEY, BodyLimitMiddleware, response_channel
from serve.auth import Auth
from serve.cors import cors_layer
from serve.errors import ENGINE_LOST, RETRY_AFTER_S, SHUTTING_DOWN, openai_error
from serve.intake.service import Intake
from serve.logs import AccessLog
from serve.metrics import Metrics
from serve.routes import CLOSED, OPTIONAL, RouteTable
from serve.settings import Settings
from serve.steplog import StepLog
from serve.streamguard import StreamGuardMiddleware
from serve.tracing import NO_SPANS, Tracing

log = logging.getLogger("serve.app")

#: Seconds between two checks of the engine (death, freeze).
WATCH_INTERVAL_S = 0.25
#: Seconds between losing the engine and exiting: open streams receive vLLM's own error event.
EXIT_DELAY_S = 1.0


class Phase(str, enum.Enum):
    """Life cycle of the API process."""

    STARTING = "starting"
    READY = "ready"
    FAILED = "failed"
    DRAINING = "draining"


@dataclass
class ServerState:
    """Mutable state of one API process (one engine). Owned by :class:`Gateway`."""

    phase: Phase = Phase.STARTING
    engine: Any = None  # vllm AsyncLLM once booted
    openai_app: ASGIApp | None = None
    error: str | None = None
    started_at: float = field(default_factory=time.monotonic)
    #: (path template, methods) of every route of vLLM's app, once built.
    vllm_routes: list[tuple[str, tuple[str, ...]]] = field(default_factory=list)
    ready_after_s: float | None = None

    def engine_alive(self) -> bool:
        """False once vLLM reports its engine core dead (``AsyncLLM.errored``)."""
        return self.engine is None or not self.engine.errored


class Gateway:
    """ASGI app: owns ``/health``, ``/ready``, ``/metrics`` and the engine life cycle.

    Args:
        settings: the stack's settings.
        on_fatal: called (no arguments) when the engine fails to boot, so the server can exit
            with a non-zero status instead of serving 503 forever.
        registry: where the ``phi3v_*`` series go (``serve.metrics``) and what ``/metrics``
            serves; when None, the default registry, which vLLM's stat loggers use too.
    """

    def __init__(self, settings: Settings, on_fatal: Callable[[], None] | None = None,
                 registry: prometheus_client.CollectorRegistry | None = None) -> None:
        self.settings = settings
        self.state = ServerState()
        self._on_fatal = on_fatal
        self._boot_task: asyncio.Task | None = None
        self._exit_stack = contextlib.AsyncExitStack()
        # vLLM's registry by default, so /metrics serves both (see metrics()); tests pass their own.
        self.metrics = Metrics(registry if registry is not None else prometheus_client.REGISTRY)
        #: What ``/metrics`` serves: vLLM's registry (None: looked up at the first scrape,
        #: vLLM is imported only once the engine environment is set), or the test's.
        self._scrape_registry = registry
        self.admission = Admission.from_settings(settings, self.metrics)
        #: The engine steps' timing for the benchmarks' calibration (``--bench-admin`` only).
        self.steps = StepLog() if settings.bench_admin else None
        self.intake = Intake.from_settings(settings)
        self.metrics.image_cache.cache = self.intake.cache
        #: Tenant limits and usage (``serve.accounting``, ``serve.quota``, ``serve.usage``).
        self.accounting = Accounting.from_settings(settings, self.metrics)
        #: API keys and their tenants (``serve.auth``, ``serve.keys``).
        self.auth = Auth.from_settings(settings)
        self.routes = RouteTable(settings.open_routes)
        #: OpenTelemetry spans of the request path (``serve.tracing``); None: off.
        self.tracing = Tracing.from_settings(settings)
        self._open_paths = {"/health", "/ready"} | (
            set() if settings.metrics_require_auth else {"/metrics"})
        self.own = Starlette(
            routes=[
                Route("/health", self.health, methods=["GET"]),
                Route("/ready", self.ready, methods=["GET"]),
                Route("/metrics", self.metrics_page, methods=["GET"]),
                Route("/admin/autotuner", self.autotuner_state, methods=["GET"]),
                Route("/limits", self.limits, methods=["GET"]),
                Route("/admin/routes", self.route_table, methods=["GET"]),
                Route("/admin/usage", self.accounting.usage_page, methods=["GET"]),
                *([Route("/admin/bench/admission", self.bench_admission, methods=["POST"]),
                   Route("/admin/bench/steps", self.bench_steps, methods=["GET"])]
                  if settings.bench_admin else []),
            ],
            lifespan=self._lifespan,
        )
        self._own_paths = {r.path for r in self.own.routes}
        #: One access record per HTTP request, and its request id (``serve.logs``).
        self.access = AccessLog.from_settings(settings, self.route_of)
        #: CORS (``--allowed-origins``, ``serve.cors``), then :meth:`_serve`.
        self._entry = cors_layer(self._serve, settings)

    # --- ASGI -------------------------------------------------------------------------------
    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self.own(scope, receive, send)
            return
        if scope["type"] == "http":
            send = response_channel(send, scope)  # the one send wrapper of the request's layers
            http_metrics.count_responses(scope, send, self.metrics.http_responses)
            with self.access.request(scope, send):  # request id, then the access record
                await self._entry(scope, receive, send)
            return
        await self._entry(scope, receive, send)

    async def _serve(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Auth, the route table, then our routes or vLLM's app behind the request layers."""
        if scope["type"] == "http" and scope.get("path") not in self._open_paths:
            refusal = self.auth.check(scope)  # the tenant, in the scope and the access record
            if refusal is not None:
                await refusal(scope, receive, send)
                return
        if scope.get("path") in self._own_paths:
            await self.own(scope, receive, send)
            return
        if self.routes.policy(scope.get("path", "")) in (OPTIONAL, CLOSED):
            await _closed(scope, receive, send)
            return
        inner = self.state.openai_app
        if inner is None or self.state.phase is not Phase.READY or not self.state.engine_alive():
            if scope["type"] == "http":
                await self._unavailable()(scope, receive, send)
            return
        try:
            await inner(scope, receive, send)
        except Exception:
            # An error no layer answered (vLLM's app re-raises what it does not handle):
            # the client gets an OpenAI-style 500, counted like every answer, instead of
            # uvicorn's plain-text one that no counter sees.
            if scope["type"] != "http" or "status" in scope.get(REQUEST_STATE_KEY, {}):
                raise
            log.exception("unhandled error on %s", scope.get("path"))
            await openai_error(500, "internal server error", type_="server_error")(
                scope, receive, send)

    def route_of(self, path: str) -> str:
        """The route template of ``path``: ours, vLLM's (``serve.routes``), else ``other``."""
        return path if path in self._own_paths else self.routes.template(path) or "other"

    def count_refused(self, status: int, path: str | None = None) -> None:
        """Count an answer written below the app by ``serve.http_limits`` (431 head too
        large, 408 request too slow, 503 at the connection cap); ``path`` None (the head was
        not read) counts as route ``other``."""
        self.metrics.http_responses.labels(route=http_metrics.route_label(path or ""),
                                           code=str(status)).inc()

    def _unavailable(self) -> Response:
        phase = self.state.phase
        if phase is Phase.DRAINING:
            message = SHUTTING_DOWN
        elif phase is Phase.FAILED or not self.state.engine_alive():
            message = ENGINE_LOST
        else:
            message = f"The server is {phase.value}; the model is not ready to serve yet."
        return openai_error(503, message, type_="service_unavailable",
                            headers={"Retry-After": str(RETRY_AFTER_S)})

    async def drain(self, timeout_s: float) -> None:
        """Stop taking work and let running requests finish (SIGTERM, ``serve.lifecycle``).

        At once: ``/ready`` 503 and ``phi3v_ready`` 0 (``/health`` stays 200), new requests
        503 + ``Retry-After``, queued ones too. Running requests get ``timeout_s`` seconds;
        then each open stream gets one error event and each answer not started a 503.
        """
        if self.state.phase is Phase.FAILED:
            return
        self.state.phase = Phase.DRAINING
        self.metrics.ready.set(0)
        limiter = self.admission.limiter
        refused = limiter.reject_waiting(RETRY_AFTER_S, SHUTTING_DOWN)
        log.info("SIGTERM: draining; %d running get %g s, %d queued refused",
                 limiter.in_flight, timeout_s, refused)
        deadline = time.monotonic() + timeout_s
        while limiter.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        middleware = self.admission.middleware
        if limiter.in_flight and middleware is not None:
            cut = await middleware.cut_open("The server is shutting down (drain timeout); "
                                            "retry on another replica.", RETRY_AFTER_S)
            log.warning("drain timeout after %g s: %d requests cut", timeout_s, cut)
        else:
            log.info("drained: no request running")

    # --- routes -----------------------------------------------------------------------------
    async def health(self, request: Request) -> Response:
        """Liveness: 200 unless the engine failed to start or died."""
        ok = self.state.phase is not Phase.FAILED and self.state.engine_alive()
        body = {"status": "ok" if ok else "dead", "phase": self.state.phase.value}
        if self.state.error:
            body["error"] = self.state.error
        return JSONResponse(body, status_code=200 if ok else 503)

    async def ready(self, request: Request) -> Response:
        """Readiness: 200 only while the engine can take requests."""
        ok = self.state.phase is Phase.READY and self.state.engine_alive()
        body = {"status": "ready" if ok else "not ready", "phase": self.state.phase.value,
                "model": self.settings.model_name}
        headers = None if ok else {"Retry-After": str(RETRY_AFTER_S)}
        return JSONResponse(body, status_code=200 if ok else 503, headers=headers)

    async def metrics_page(self, request: Request) -> Response:
        """Prometheus exposition of vLLM's registry (which also holds our series).

        Generated in a worker thread, as vLLM's own ``/metrics`` (a plain FastAPI route) is:
        one scrape of the ~900 series is ~30 ms of Python on the CPU machine, which on the
        event loop stalled every running stream for as long, at every scrape."""
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        registry = self._scrape_registry if self._scrape_registry is not None else _registry()
        return Response(await asyncio.to_thread(generate_latest, registry),
                        media_type=CONTENT_TYPE_LATEST)

    def curl_example(self) -> str:
        """A copy-pasteable text chat request for the ready line."""
        auth = " -H 'Authorization: Bearer $PHI3V_API_KEY'" if self.auth.enabled else ""
        body = json.dumps({"model": self.settings.model_name, "max_tokens": 32,
                           "messages": [{"role": "user", "content": "Hello!"}]})
        return (f"curl -s http://{self.settings.host}:{self.settings.port}/v1/chat/completions"
                f" -H 'Content-Type: application/json'{auth} -d '{body}'")

    async def limits(self, request: Request) -> Response:
        """Client-facing request limits (one source of truth for UIs and clients)."""
        return JSONResponse(self.settings.client_limits())

    async def route_table(self, request: Request) -> Response:
        """Every route this server answers: ours (policy ``own``) and vLLM's app as it runs
        here with its policy (``serve.routes``; ``open`` tells whether requests reach it), and
        vLLM's routes the table does not classify (closed, and a test fails on them)."""
        own = [{"path": r.path, "methods": sorted(r.methods or ()), "policy": "own",
                "open": True} for r in self.own.routes]
        vllm = [{"path": path, "methods": list(methods), "policy": policy,
                 "open": policy not in (OPTIONAL, CLOSED)}
                for path, methods in self.state.vllm_routes if path not in self._own_paths
                for policy in (self.routes.policy(path),)]
        return JSONResponse({"routes": own + vllm, "unclassified": self.routes.unclassified(
            path for path, _ in self.state.vllm_routes)})

    async def autotuner_state(self, request: Request) -> Response:
        """Read-only autotuner state: limit, last signals, recent decisions, and
        ``kv_capacity``: the boot figure the autotuner starts from (KV-cache blocks and
        tokens from vLLM, tokens per request, KV-safe requests; null before the engine is up).
        (``capacity`` is the limiter's: limit + engine queue.)"""
        return JSONResponse({**self.admission.loop.state(),
                             "kv_capacity": self.admission.kv_capacity})

    async def bench_admission(self, request: Request) -> Response:
        """``--bench-admin`` only: ``{"mode": "auto" | "static" | "off", "limit": L}`` sets
        the admission mode live and resets the autotuner and the drain rate to their boot state
        (:meth:`serve.admission.loop.AutotuneLoop.set_mode`); answers the new
        ``/admin/autotuner`` state, or 400 naming the field."""
        try:
            body = json.loads(await request.body() or b"null")
        except ValueError:
            return openai_error(400, "The body must be a JSON object.")
        if not isinstance(body, dict):
            return openai_error(400, "The body must be a JSON object.")
        mode, limit = body.get("mode"), body.get("limit")
        if mode not in ("auto", "static", "off"):
            return openai_error(400, "'mode' must be one of auto, static, off.", param="mode")
        if mode == "static" and (not isinstance(limit, int) or isinstance(limit, bool)
                                 or limit < 1):
            return openai_error(400, "'limit' must be an integer >= 1 with mode static.",
                                param="limit")
        self.admission.loop.set_mode(mode, limit)
        return JSONResponse({**self.admission.loop.state(),
                             "kv_capacity": self.admission.kv_capacity})

    async def bench_steps(self, request: Request) -> Response:
        """``--bench-admin`` only: the engine steps' details since the last read
        (:meth:`serve.steplog.StepLog.drain`); empty unless vLLM runs with
        ``--enable-logging-iteration-details``."""
        return JSONResponse(self.steps.drain())

    def request_layers(self) -> list[Callable[[ASGIApp], ASGIApp]]:
        """The layers every request to vLLM's app passes, outermost first (CORS, auth and the
        route table come before: :meth:`__call__`, :meth:`_serve`). Each wraps an ASGI app;
        generation routes (``serve.routes.GENERATION_ROUTES``) get all of them, other routes
        pass through unchanged except for the body limit. With tracing, ``spans`` adds the
        span layers (``serve.tracing``: the server span, then one span per stage); without,
        none."""
        spans = self.tracing.layers(self.admission.limiter) if self.tracing else NO_SPANS
        return [
            *spans.request,  # the request's server span
            lambda inner: BodyLimitMiddleware(inner, self.settings.max_request_bytes),
            *spans.intake,
            self.intake.wrap,  # validation, images, prompt length, request ids
            self.accounting.wrap,  # tenant limits (queued requests count), usage
            *spans.admission,
            # the live max_num_seqs, goodput accounting
            lambda inner: self.admission.wrap(inner, self.state.engine_alive),
            *spans.engine,  # vLLM's span joins the request's trace
            # one error event, never a silent cut
            lambda inner: StreamGuardMiddleware(inner, self.settings.responses_incomplete_event),
        ]

    async def watch_engine(self) -> None:
        """Until the engine is lost: every :data:`WATCH_INTERVAL_S`, check that it lives
        (``AsyncLLM.errored``) and that it ran a step within ``engine_stall_timeout_s`` while
        requests were in it (``serve.admission.engine_stats.stalled_s``)."""
        feed, slots = self.admission.feed, self.admission.limiter.slots
        while self.state.phase is Phase.READY:
            await asyncio.sleep(WATCH_INTERVAL_S)
            if not self.state.engine_alive():
                await self.engine_lost("the engine process died")
                return
            stalled = stalled_s(time.monotonic(), feed.last_step_s, slots.busy_since)
            if stalled > self.settings.engine_stall_timeout_s:
                await self.engine_lost(f"the engine ran no step for {stalled:.0f} s with "
                                       "requests in it (frozen)")
                return

    async def engine_lost(self, reason: str) -> None:
        """The engine died or froze: ``/health`` 503 (phase ``failed``), waiting and new
        requests 503 + ``Retry-After``, open ones ended (one error event or a 503) after
        :data:`EXIT_DELAY_S`, then the process exits 1 so that its supervisor (Kubernetes,
        compose ``restart``) starts a fresh one: a vLLM engine does not come back in place."""
        if self.state.phase is not Phase.READY:
            return
        self.state.phase, self.state.error = Phase.FAILED, reason
        self.metrics.ready.set(0)
        log.error("%s: refusing requests, then exiting for a restart", reason)
        refused = self.admission.limiter.reject_waiting(RETRY_AFTER_S, ENGINE_LOST)
        await asyncio.sleep(EXIT_DELAY_S)
        cut = 0
        if self.admission.middleware is not None:
            cut = await self.admission.middleware.cut_open(ENGINE_LOST, RETRY_AFTER_S)
        log.error("engine lost: %d queued refused, %d open requests ended; exiting", refused,
                  cut)
        if self._on_fatal:
            self._on_fatal()

    # --- life cycle -------------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def _lifespan(self, app: Starlette):
        log.info("effective settings: %s", json.dumps(engine_mod.effective_settings(self.settings)))
        self.accounting.start()  # closed last (the exit stack unwinds in reverse): after the drain
        self._exit_stack.push_async_callback(asyncio.to_thread, self.accounting.close)
        if self.intake.workers is not None:
            # Shut down last (the exit stack unwinds in reverse): after the engine and the drain.
            self._exit_stack.push_async_callback(asyncio.to_thread, self.intake.workers.close)
        if self.tracing is not None:  # after the engine: the last requests' spans leave
            self._exit_stack.push_async_callback(asyncio.to_thread, self.tracing.shutdown)
        self._exit_stack.callback(self.auth.on_sighup(asyncio.get_running_loop()))
        self._boot_task = asyncio.create_task(self._boot(), name="engine-boot")
        self._boot_task.add_done_callback(_log_failure)
        try:
            yield
        finally:
            self.state.phase = Phase.DRAINING
            self.metrics.ready.set(0)
            if self._boot_task and not self._boot_task.done():
                self._boot_task.cancel()
                with contextlib.suppress(BaseException):
                    await self._boot_task
            await self._exit_stack.aclose()

    async def _boot(self) -> None:
        workers = None
        if self.intake.workers is not None:
            # The image workers start beside the engine (their forkserver imports Pillow and
            # torch: seconds), so the first photo does not pay for it.
            workers = asyncio.create_task(asyncio.to_thread(self.intake.workers.start),
                                          name="image-workers")
        try:
            stat_loggers = self.admission.stat_loggers() + (
                [stat_logger_factory(self.steps)] if self.steps is not None else [])
            engine = await engine_mod.start_engine(self.settings, stat_loggers=stat_loggers)
            self._exit_stack.callback(engine.shutdown)
            self.state.engine = engine
            app = await engine_mod.build_openai_app(engine, self.settings)
            self.state.vllm_routes = sorted(
                {(r.path, tuple(sorted(getattr(r, "methods", None) or ()))) for r in app.routes})
            unknown = self.routes.unclassified(path for path, _ in self.state.vllm_routes)
            if unknown:
                log.warning("vLLM routes not in serve/routes.py, closed: %s", ", ".join(unknown))
            # Run vLLM's app lifespan (its periodic stats logging) as vLLM's server would.
            await self._exit_stack.enter_async_context(app.router.lifespan_context(app))
            await self.intake.load_budget(engine, self.settings)
            if workers is not None:
                log.info("image workers: pids %s", await workers)
            engine_kv = engine_mod.kv_cache_size(engine)
            kv_tokens = engine_kv["kv_cache_tokens"] if engine_kv else None
            capacity = self.admission.apply_kv_capacity(self.settings, kv_tokens, engine_kv)
            kv = self.admission.kv_capacity or {}
            log.info("KV cache: %s tokens (%s blocks of %s); %s tokens per request; KV-safe "
                     "capacity %s requests; admission limit %d", kv_tokens,
                     kv.get("num_gpu_blocks"), kv.get("block_size"),
                     kv.get("tokens_per_request"), capacity, self.admission.limiter.limit)
            await self.admission.measure_prefill(engine, self.settings)
            self.state.openai_app = compose(app, self.request_layers())
            self.admission.loop.start()
            self._exit_stack.push_async_callback(self.admission.loop.stop)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            self.state.phase = Phase.FAILED
            self.state.error = f"{type(exc).__name__}: {exc}"
            log.exception("engine failed to start")
            if self._on_fatal:
                self._on_fatal()
            return
        self.state.ready_after_s = time.monotonic() - self.state.started_at
        self.state.phase = Phase.READY
        watch = asyncio.create_task(self.watch_engine(), name="engine-watch")
        watch.add_done_callback(_log_failure)
        self._exit_stack.callback(watch.cancel)
        self.metrics.ready.set(1)
        log.info("engine config: %s", json.dumps(engine_mod.engine_config_summary(engine)))
        log.info("ready in %.1f s: model %r at http://%s:%d/v1", self.state.ready_after_s,
                 self.settings.model_name, self.settings.host, self.settings.port)
        log.info("try: %s   (an image chat example is in the README)", self.curl_example())


async def _closed(scope: Scope, receive: Receive, send: Send) -> None:
    """A route the route table closes (``serve.routes``): 404, as for a path that does not
    exist (a websocket is closed)."""
    if scope["type"] == "websocket":
        await send({"type": "websocket.close", "code": 1008})
        return
    if scope["type"] == "http":
        await openai_error(404, f"{scope.get('path')} is not served here",
                           type_="not_found_error")(scope, receive, send)


def compose(app: ASGIApp, layers: list[Callable[[ASGIApp], ASGIApp]]) -> ASGIApp:
    """``app`` wrapped by ``layers`` (outermost first)."""
    for layer in reversed(layers):
        app = layer(app)
    return app


def _log_failure(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("%s failed", task.get_name(), exc_info=task.exception())


def _registry():
    from vllm.v1.metrics.prometheus import get_prometheus_registry

    return get_prometheus_registry()


def create_app(settings: Settings, on_fatal: Callable[[], None] | None = None) -> Gateway:
    """The ASGI application for ``settings`` (see :class:`Gateway`)."""
    return Gateway(settings, on_fatal=on_fatal)

