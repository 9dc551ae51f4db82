"""``python -m serve`` (console script ``phi3v-serve``): run the API server.

Every flag of ``vllm serve`` works with vLLM's meaning, plus our gateway's flags (fields of
:class:`serve.settings.Settings`, each also a ``PHI3V_*`` environment variable) and
``--config FILE``: see :mod:`serve.cli`.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from serve.accounting import usage_db_path
from serve.cli import CliError, parse_settings
from serve.keys import KeyStore
from serve.logs import configure_logging
from serve.routes import RouteTable
from serve.settings import REAL_MODEL_ID, Settings
from serve.usage import UsageStore


def check_model_dir(settings: Settings) -> str | None:
    """A user-facing message when ``settings.model`` cannot be served, else ``None``."""
    path = Path(settings.model)
    if not (path / "config.json").is_file():
        return (f"No model directory at {path} (config.json missing). Build the demo model "
                "with `make demo` (or `python -m serve.models.build --size tiny --out "
                f"{path}`), or see the README to serve the real {REAL_MODEL_ID}.")
    dangling = sorted(p.name for p in path.iterdir() if p.is_symlink() and not p.exists())
    if dangling:
        # prepare_real links the weights relatively: mounted in a container or on a volume,
        # the weights directory must keep its place relative to the model directory.
        first = path / dangling[0]
        return (f"{path} links to files that are not there: {', '.join(dangling)} "
                f"({first} -> {first.readlink()}). Mount the weights directory where that "
                "link points (deploy/README.md: models/ and weights/ side by side), or "
                "rebuild the links with `make serve WEIGHTS=...`.")
    if settings.load_format != "dummy" and not any(path.glob("*.safetensors")):
        return (f"{path} has no *.safetensors weights. Serve it with --load-format dummy "
                "(random weights, for benchmarks) or put the weights there.")
    return None


def check_step_budget(settings: Settings) -> str | None:
    """A user-facing message when the largest image a request may carry cannot fit one engine
    step, else ``None``.

    vLLM encodes an image's tokens in a single step (they are not chunked), so an image above
    ``max_num_batched_tokens`` fails inside vLLM, mid-stream when streaming. Refused at start.
    """
    from serve.admission.capacity import max_image_tokens

    s = settings.resolved()
    largest = max_image_tokens(s.max_num_crops)
    if s.max_images_per_prompt > 0 and largest > s.max_num_batched_tokens:
        return (f"--max-num-batched-tokens {s.max_num_batched_tokens} is smaller than the "
                f"largest image --max-num-crops {s.max_num_crops} allows ({largest} tokens; one "
                f"image is encoded in one engine step). Raise --max-num-batched-tokens to at "
                f"least {largest} or lower --max-num-crops.")
    return None


#: Open files the process needs besides client connections: model files, the engine's
#: sockets and pipes, image URL fetches, logs, with room for GPU runtimes' own.
RESERVED_FILES = 1024


def raise_open_file_limit(settings: Settings) -> str | None:
    """Raise the soft open-file limit (``ulimit -n``) to hold ``--max-connections`` plus
    :data:`RESERVED_FILES` when it is lower, up to the hard limit; a user-facing message when
    the hard limit is too low, else ``None``. Above the limit the cap would never be reached:
    ``accept()`` would fail first (EMFILE) and asyncio stop accepting for a while."""
    import resource

    need = settings.max_connections + RESERVED_FILES
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= need:
        return None
    if hard != resource.RLIM_INFINITY and hard < need:
        return (f"--max-connections {settings.max_connections} needs {need} open files "
                f"({RESERVED_FILES} besides the connections) but the hard limit is {hard}: "
                f"lower --max-connections to at most {max(hard - RESERVED_FILES, 1)} or raise "
                "the limit (ulimit -Hn; Docker/compose: ulimits.nofile).")
    resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))
    return None


def server_options(settings: Settings) -> dict:
    """``uvicorn.Config`` keywords for vLLM's server flags (``serve.cli.VLLM_FLAG_POLICY``,
    kind "server"), as vLLM's launcher passes them
    (``vllm/entrypoints/launchers/api_server/entry.py``); only those given, so uvicorn's
    defaults stay where the operator set nothing."""
    given = settings.vllm_args
    # uvicorn's access line is replaced by the gateway's access record (serve.logs), which
    # --disable-uvicorn-access-log and --disable-access-log-for-endpoints govern.
    opts: dict = {"log_level": given.get("uvicorn_log_level", settings.log_level),
                  "access_log": False}
    for key in ("ssl_keyfile", "ssl_certfile", "ssl_ca_certs", "ssl_cert_reqs", "ssl_ciphers",
                "uds", "root_path"):
        if given.get(key) is not None:
            opts[key] = given[key]
    return opts


def main(argv: list[str] | None = None) -> int:
    """Parse flags, then serve until SIGINT/SIGTERM. Returns the process exit status."""
    # vLLM reads its environment at import time, and the parser is vLLM's: set it first.
    from serve.engine import apply_engine_env

    apply_engine_env(Settings.model_construct(device=os.environ.get("PHI3V_DEVICE")))
    try:
        settings = parse_settings(argv)
    except CliError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    # Hardware defaults resolved once, here; every later `resolved()` returns this object.
    settings = settings.resolved()
    problem = (check_model_dir(settings) or check_step_budget(settings)
               or raise_open_file_limit(settings))
    try:
        RouteTable(settings.open_routes)
        if settings.keys_file is not None:
            KeyStore(settings.keys_file)  # a clear error now rather than a traceback later
        UsageStore(usage_db_path(settings)).close()  # likewise for an unwritable --usage-db
    except ValueError as exc:
        problem = str(exc)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2

    configure_logging(settings)

    import uvicorn

    from serve.app import create_app
    from serve.http_limits import ConnectionLimits, bounded_http_protocol
    from serve.lifecycle import DrainingServer

    server: DrainingServer | None = None
    failed = False

    def on_fatal() -> None:
        nonlocal failed
        failed = True
        if server is not None:
            server.should_exit = True

    app = create_app(settings, on_fatal=on_fatal)
    # The drain (serve.lifecycle) ends every request before uvicorn stops: its own grace only
    # covers the engine requests aborted by that.
    config = uvicorn.Config(app, host=settings.host, port=settings.port,
                            timeout_graceful_shutdown=5, lifespan="on",
                            **server_options(settings),
                            timeout_keep_alive=settings.http_keep_alive_timeout_s,
                            http=bounded_http_protocol(ConnectionLimits.from_settings(settings),
                                                       app.count_refused))
    server = DrainingServer(config, lambda: app.drain(settings.drain_timeout_s),
                            ssl_refresh=settings.vllm_args.get("enable_ssl_refresh", False))
    server.run()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
