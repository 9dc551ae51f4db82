"""Start vLLM's V1 async engine (``AsyncLLM``) and vLLM's own OpenAI app around it.

We do not re-implement the OpenAI protocol: vLLM's FastAPI app (``build_app`` +
``init_app_state`` from ``vllm.entrypoints.launchers``) serves ``/v1/chat/completions``,
``/v1/models`` and friends on top of the engine we start here. See ``serve/DESIGN.md``.

vLLM must be imported only after :meth:`serve.settings.Settings.engine_env` has been applied
to ``os.environ`` (see :func:`apply_engine_env`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from argparse import Namespace
from typing import TYPE_CHECKING, Any

from serve.errors import use_client_field_names
from serve.settings import Settings

if TYPE_CHECKING:  # pragma: no cover
    from fastapi import FastAPI
    from vllm.v1.engine.async_llm import AsyncLLM

log = logging.getLogger("serve.engine")


def apply_engine_env(settings: Settings) -> None:
    """Put the engine's required environment into ``os.environ`` (user values win)."""
    for key, value in settings.engine_env().items():
        os.environ.setdefault(key, value)


def vllm_frontend_args(settings: Settings) -> Namespace:
    """The ``argparse.Namespace`` of vLLM's ``vllm serve`` for our settings: what vLLM's
    OpenAI app and ``AsyncEngineArgs.from_cli_args`` read.

    Built in three layers, later ones winning: vLLM's own defaults (its parser on an empty
    command line), the vLLM flags the operator gave that are not settings
    (:attr:`Settings.vllm_args`, ``serve.cli``), then :meth:`Settings.engine_kwargs` (the
    settings, hardware defaults resolved). Then what the gateway does itself is switched off
    in vLLM's app: API-key checks (``serve.auth``) and CORS (the gateway's outer layer), and
    per-request ``mm_processor_kwargs`` are trusted (intake bounds them).
    """
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    args = make_arg_parser(FlexibleArgumentParser()).parse_args([])
    for key, value in {**settings.vllm_args, **settings.engine_kwargs()}.items():
        setattr(args, key, value)
    args.model_tag = None
    if "use_tqdm_on_load" not in settings.vllm_args:
        from serve.logs import resolved_format

        # A progress bar is not a JSON line: keep JSON logs parseable unless asked.
        args.use_tqdm_on_load = resolved_format(settings.log_format) == "text"
    args.host, args.port = settings.host, settings.port
    args.api_key = None
    args.allowed_origins = []
    args.trust_request_mm_kwargs = True
    return args


def vllm_cli_args(settings: Settings) -> list[str]:
    """Command-line flags of vLLM's own OpenAI server for the engine our ``settings`` run.

    ``python -m vllm.entrypoints.openai.api_server *vllm_cli_args(s)`` (with
    :meth:`Settings.engine_env` in its environment) is plain vLLM on the same engine: the
    baseline of ``make bench``. Derived from :meth:`Settings.engine_kwargs`, never restated:
    ``key`` becomes ``--key`` (``_`` to ``-``), ``True`` ``--key``, ``False`` ``--no-key`` (or
    nothing where vLLM's flag is a plain switch that is off by default), dicts JSON, lists one
    value each. Imports vLLM (its argument parser is the reference).

    Raises:
        ValueError: a ``False`` setting vLLM's parser cannot express.
    """
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser())
    options = parser._option_string_actions
    argv: list[str] = []
    for key, value in {**settings.vllm_args, **settings.engine_kwargs()}.items():
        flag = "--" + key.replace("_", "-")
        if value is None:  # vLLM's default (every such flag of vLLM defaults to None)
            continue
        if isinstance(value, bool):
            negative = "--no-" + key.replace("_", "-")
            if value:
                argv.append(flag)
            elif negative in options:
                argv.append(negative)
            elif options[flag].default:
                raise ValueError(f"vLLM has no flag to turn {key} off")
        elif isinstance(value, dict):
            argv += [flag, json.dumps(value)]
        elif isinstance(value, (list, tuple)):
            argv += [flag, *map(str, value)]
        else:
            argv += [flag, str(value)]
    return [*argv, "--host", settings.host, "--port", str(settings.port)]


def build_engine_args(settings: Settings):
    """vLLM ``AsyncEngineArgs`` for ``settings`` (resolved for the detected hardware): every
    engine flag of :func:`vllm_frontend_args`, as ``vllm serve`` builds them."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    return AsyncEngineArgs.from_cli_args(vllm_frontend_args(settings))


def effective_settings(settings: Settings) -> dict[str, Any]:
    """The settings as they take effect (hardware defaults resolved), for the start-up log:
    JSON values (paths as strings), and the API keys as their number, never the keys."""
    dumped = settings.resolved().model_dump(mode="json")
    dumped["api_keys"] = f"{len(dumped['api_keys'])} keys (not logged)"
    return dumped


async def start_engine(settings: Settings, stat_loggers: list | None = None) -> "AsyncLLM":
    """Create and start vLLM's ``AsyncLLM`` (the V1 ``AsyncLLMEngine``).

    Args:
        settings: the stack's settings.
        stat_loggers: extra vLLM ``StatLoggerFactory`` objects; vLLM's own Prometheus logger
            (the ``vllm:*`` series) is always added by vLLM itself.

    Raises:
        Whatever vLLM raises when the model directory or the engine configuration is invalid.
    """
    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.engine.async_llm import AsyncLLM

    engine_args = build_engine_args(settings)
    # Construction blocks for the whole model load (seconds on CPU, minutes on GPU): run it in
    # a thread so the event loop keeps answering /health and /ready meanwhile. AsyncLLM starts
    # its output handler lazily on the first request when built outside the loop.
    engine = await asyncio.to_thread(
        AsyncLLM.from_engine_args,
        engine_args,
        usage_context=UsageContext.OPENAI_API_SERVER,
        stat_loggers=stat_loggers,
    )
    # Same as vLLM's own server: do not keep the profiling dummy images in the cache.
    await engine.reset_mm_cache()
    return engine


async def build_openai_app(engine: "AsyncLLM", settings: Settings) -> "FastAPI":
    """vLLM's own OpenAI-compatible FastAPI app, wired to ``engine``, its request-validation
    errors naming the field the client sent (``serve.errors.use_client_field_names``)."""
    from vllm.entrypoints.launchers.api_server.app_state import init_app_state
    from vllm.entrypoints.launchers.app import build_app

    args = vllm_frontend_args(settings)
    supported_tasks = await engine.get_supported_tasks()
    app = build_app(args, supported_tasks, engine.model_config)
    drop_http_instrumentation(app)
    drop_cors_middleware(app)  # the gateway answers CORS in front of auth (serve.cors)
    use_client_field_names(app)  # validation errors name the field the client sent
    await init_app_state(engine, app.state, args, supported_tasks)
    return app


#: The ASGI middleware vLLM puts on its app for prometheus-fastapi-instrumentator's
#: ``http_*`` series (``vllm.entrypoints.serve.instrumentator.metrics.attach_router``), by
#: module and class name: the gateway counts every response itself.
HTTP_INSTRUMENTATION = ("prometheus_fastapi_instrumentator.middleware",
                        "PrometheusInstrumentatorMiddleware")
#: The series that middleware registers (its ``metrics.default``), by name.
HTTP_SERIES = ("http_requests_total", "http_request_size_bytes", "http_response_size_bytes",
               "http_request_duration_highr_seconds", "http_request_duration_seconds")


def drop_http_instrumentation(app: "FastAPI") -> int:
    """Take prometheus-fastapi-instrumentator's middleware off vLLM's app, and its ``http_*``
    series out of the registry it put them in. Returns how many middlewares were taken off
    (1 on vLLM 0.32). Idempotent.

    Why: the gateway already counts every HTTP response by route and status
    (``phi3v_http_responses_total``, ``serve.http_metrics``: a head hook, nothing per token),
    including those vLLM's app never sees (401, 404 of closed routes, 413, 429, 503), and
    vLLM reports request latencies itself (``vllm:e2e_request_latency_seconds``,
    ``vllm:time_to_first_token_seconds``). The instrumentator's middleware is a second
    account of the same responses on the event loop that streams every answer: per request
    a walk of the app's ~50 routes (a regex each until one matches), a ``Response`` built and
    five series observed; per streamed token one more coroutine call. Measured in-process
    (a FastAPI app of 41 routes streaming 64 chunks, this CPU): 246 us per request without
    it, 360 us with it, about a third of what all our request layers cost per request
    (``python -m bench.layers``). No dashboard or rule of ``monitoring/`` reads its series.

    vLLM's app has built its middleware stack already (its SageMaker bootstrap,
    ``model_hosting_container_standards``, rebuilds it inside ``build_app``), which
    constructed the middleware and registered its series: the stack is reset (Starlette
    rebuilds it from ``user_middleware`` on the first request) and the series unregistered
    (prometheus-client has no public listing of a registry's collectors: its
    ``_names_to_collectors``, read only here; ``tests/engine/test_api.py`` checks the series
    are gone from ``/metrics``).
    """
    module, name = HTTP_INSTRUMENTATION
    ours = [m for m in app.user_middleware
            if (m.cls.__module__, m.cls.__name__) == (module, name)]
    if not ours:
        return 0
    app.user_middleware[:] = [m for m in app.user_middleware if m not in ours]
    app.middleware_stack = None
    for registry in {m.kwargs.get("registry") for m in ours} - {None}:
        by_name = getattr(registry, "_names_to_collectors", {})
        for collector in [by_name[n] for n in HTTP_SERIES if n in by_name]:
            registry.unregister(collector)
    return len(ours)


def drop_cors_middleware(app: "FastAPI") -> int:
    """Take Starlette's ``CORSMiddleware`` off vLLM's app (vLLM adds it from
    ``--allowed-origins`` and friends, ``vllm.entrypoints.serve.middleware.register``).
    Returns how many were taken off (1 on vLLM 0.32). Idempotent.

    Why: the gateway answers CORS itself, in front of auth and over its own routes too
    (``serve.cors``); a second one inside would add ``Access-Control-*`` headers to vLLM's
    answers again, and a browser refuses an answer with two ``Access-Control-Allow-Origin``
    values. The middleware stack is reset as in :func:`drop_http_instrumentation`."""
    from starlette.middleware.cors import CORSMiddleware

    ours = [m for m in app.user_middleware if m.cls is CORSMiddleware]
    if not ours:
        return 0
    app.user_middleware[:] = [m for m in app.user_middleware if m not in ours]
    app.middleware_stack = None
    return len(ours)


def kv_cache_size(engine: "AsyncLLM") -> dict[str, int | None] | None:
    """The engine's KV cache as vLLM sized it at start, or None where vLLM did not report it.

    Keys: ``num_gpu_blocks``, ``block_size`` (tokens per block), ``kv_cache_tokens``
    (``num_gpu_blocks x block_size``: the capacity in tokens) and ``kv_cache_memory_bytes``
    (the explicit size vLLM was given, as on CPU; None where it profiled GPU memory).
    """
    cache = engine.vllm_config.cache_config
    blocks, block_size = getattr(cache, "num_gpu_blocks", None), cache.block_size
    if not blocks or not block_size:
        return None
    return {"num_gpu_blocks": blocks, "block_size": block_size,
            "kv_cache_tokens": blocks * block_size,
            "kv_cache_memory_bytes": getattr(cache, "kv_cache_memory_bytes", None)}


def engine_config_summary(engine: "AsyncLLM") -> dict[str, Any]:
    """The scheduler/cache numbers vLLM actually chose (after its own defaults and checks)."""
    cfg = engine.vllm_config
    picks = {
        "scheduler_config": ("max_num_seqs", "max_num_batched_tokens", "enable_chunked_prefill"),
        "model_config": ("max_model_len", "dtype"),
        "cache_config": ("enable_prefix_caching", "num_gpu_blocks", "block_size"),
        "parallel_config": ("tensor_parallel_size", "pipeline_parallel_size"),
    }
    return {name: str(getattr(getattr(cfg, section), name, None))
            for section, names in picks.items() for name in names}
