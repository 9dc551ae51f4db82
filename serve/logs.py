"""Logs of the API process: one format for every logger, the request id on every record logged
while a request is served, and one access record per request.

**Format** (``--log-format``): ``json`` writes one JSON object per line (python-json-logger):
``time`` (ISO 8601, UTC), ``level``, ``logger``, ``process`` (pid), ``message``, the
``request_id`` while a request is served, the record's own fields (``extra=``) and a traceback
as ``exc_info``. ``text`` writes ``time level logger: message key=value ...``. ``auto`` (the
default): text on a terminal, JSON otherwise (containers, systemd, log shippers).

**One stream.** One handler on the root logger (stderr) formats every record: ours
(``serve.*``), vLLM's (``vllm.*``), uvicorn's and Python's warnings. Three parties configure
logging, and :func:`configure_logging` makes them apply the same configuration
(:func:`logging_config`):

1. ours, applied at once;
2. vLLM's: vLLM applies a logging ``dictConfig`` while the engine starts, in the API process
   and in an engine-core process (``vllm/logger.py``, ``_configure_vllm_root_logger``), its
   own unless ``VLLM_LOGGING_CONFIG_PATH`` names a file: vLLM's supported way to give it a
   configuration. Ours is written to a file and named there, unless the operator set that
   variable or turned vLLM's configuration off (``VLLM_CONFIGURE_LOGGING=0``): theirs wins;
3. uvicorn's: ``uvicorn.Config`` applies ``uvicorn.config.LOGGING_CONFIG`` unless it is given
   another ``log_config``; that dict's content becomes ours. uvicorn's access log is off: the
   access record below replaces it.

Not log records, so in neither format: what a process writes before it configures logging
(vLLM's import-time warnings), native libraries' own lines (PyTorch's C++ warnings), progress
bars (vLLM's weight loading: its ``--no-use-tqdm-on-load`` turns them off) and a crash's
traceback.

**Request id.** The gateway opens each HTTP request's record (:meth:`AccessLog.request`):
the request's state dict (``serve.asgi.REQUEST_STATE_KEY``, shared by every layer) becomes the
value of a context variable, and :class:`RequestIdFilter` adds its ``request_id`` to every
record logged in that context (worker threads started with ``asyncio.to_thread`` included).
The id starts as the client's ``X-Request-Id`` (when at most 256 printable characters) or a
new one; the intake replaces it with the one the request runs under in vLLM
(``serve.intake.middleware``). Every answer carries it in ``X-Request-Id``.

**Access record**: logger ``serve.access``, INFO, once per HTTP request, when its answer has
ended (a stream at its end, or when its client left). Fields, each from the layer that knows
it (:func:`note`), null where it does not apply:

- ``method``, ``route`` (the path template: ``/v1/chat/completions``,
  ``/v1/responses/{response_id}``; ``other`` for a path of no route), ``status`` (the one
  ``phi3v_http_responses_total`` counted: ``499`` when the client left before the answer
  started, ``serve.http_metrics``);
- ``tenant``: the tenant of the request's API key (``serve.auth``; null for a refused key and
  the open routes); ``user``: the ``user`` field of a generation request's body as the client
  sent it (``serve.intake``), from any key;
- ``reject_reason``: why the gateway refused it: admission's reason (``queue_full``,
  ``queue_timeout``, ``slo``, ``unavailable``: the ``X-Phi3v-Reject-Reason`` header and the
  ``reason`` label of ``phi3v_rejected_requests_total``), or the intake's (the error's code:
  ``image_too_large``, ``context_length_exceeded``, else ``invalid_request``);
- ``prompt_tokens``, ``completion_tokens``: vLLM's own count, the usage its chat and
  completions handlers report on the request's state (``final_usage_info``), streamed or not
  (the Responses API reports none there); ``image_tokens``: the intake's (the Phi-3-vision
  formula for the prepared images);
- ``queue_wait_s``: the wait in the gateway's admission queue; ``ttft_s``: from the request's
  arrival at the gateway to the first streamed event with tokens (streams only: a
  non-streamed answer has no first token a client sees); ``e2e_s``: arrival to the end;
  ``client_left``;
- ``content``, only with ``--enable-log-requests``: the messages' text (a completions prompt as
  sent) and each image's bytes, SHA-256 and pixel size. Without it no record holds prompt or
  image content.

Every field is gathered at the request's end or where a layer already holds it: nothing runs
per streamed token. vLLM's flags for uvicorn's access log apply to this record
(:meth:`AccessLog.from_settings`): ``--disable-access-log-for-endpoints /health,/ready``
drops the probes' records, ``--disable-uvicorn-access-log`` all of them.
"""

from __future__ import annotations

import atexit
import contextlib
import contextvars
import copy
import json
import logging
import logging.config
import os
import secrets
import sys
import tempfile
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pythonjsonlogger.core import RESERVED_ATTRS
from pythonjsonlogger.json import JsonEncoder
from pythonjsonlogger.msgspec import MsgspecFormatter
from starlette.types import Message, Scope

from serve.asgi import REQUEST_STATE_KEY, ResponseChannel
from serve.intake.request import MAX_REQUEST_ID_CHARS

if TYPE_CHECKING:  # pragma: no cover
    from serve.settings import Settings

access_log = logging.getLogger("serve.access")

#: The state dict of the request being served (``serve.asgi.REQUEST_STATE_KEY``), or None.
_REQUEST: contextvars.ContextVar[dict | None] = contextvars.ContextVar("phi3v_request",
                                                                        default=None)
REQUEST_ID_HEADER = b"x-request-id"
#: Record attributes that are no field of the record's own: uvicorn's coloured copy of the
#: message, the process name vLLM's record factory adds, a field vLLM's formatter sets.
NOT_FIELDS = ("color_message", "vllm_process_name", "fileinfo")
_STANDARD = frozenset((*RESERVED_ATTRS, *NOT_FIELDS, "taskName"))


# --- formats ----------------------------------------------------------------------------------
class JsonFormatter(MsgspecFormatter):
    """One JSON object per record: ``time``, ``level``, ``logger``, ``process``,
    ``message``, then the record's own fields (``request_id``, ``extra=``). Compact JSON,
    encoded by msgspec (python-json-logger's own formatter for it): the access record runs
    on the event loop once per request, and msgspec's encoder takes a third of the time of
    Python's ``json`` for it. A record msgspec cannot encode (a lone surrogate, which
    Python puts in the names it decodes from non-UTF-8 bytes, such as file names) is
    written by Python's ``json`` instead (escaped), not lost."""

    def jsonify_log_record(self, log_data: dict) -> str:
        try:
            return super().jsonify_log_record(log_data)
        except (UnicodeEncodeError, TypeError, ValueError, OverflowError):
            return json.dumps(log_data, cls=JsonEncoder)

    def __init__(self) -> None:
        super().__init__("%(levelname)s %(name)s %(process)d %(message)s",
                         rename_fields={"levelname": "level", "name": "logger"},
                         reserved_attrs=sorted(_STANDARD), timestamp="time")


class TextFormatter(logging.Formatter):
    """``time level logger: message key=value ...``: the record's own fields (``extra=``,
    ``request_id``) as ``key=value`` after the message, strings with spaces and objects as
    JSON."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802 - logging's name
        fields = "".join(f" {k}={_text_value(v)}" for k, v in record.__dict__.items()
                         if k not in _STANDARD and not k.startswith("_") and v is not None)
        return super().formatMessage(record) + fields


def _text_value(value: Any) -> str:
    if isinstance(value, str):
        return value if value and " " not in value and "=" not in value else json.dumps(value)
    if isinstance(value, (dict, list, tuple)):
        return json.dumps(value, default=str)
    return str(value)


class RequestIdFilter(logging.Filter):
    """Adds ``request_id`` to every record logged while a request is served (module
    docstring); a handler filter, so records of every logger get it."""

    def filter(self, record: logging.LogRecord) -> bool:
        state = _REQUEST.get()
        if state is not None:
            record.request_id = state.get("request_id")
        return True


def resolved_format(log_format: str) -> str:
    """``text`` or ``json`` for ``--log-format`` (``auto``: text on a terminal)."""
    if log_format == "auto":
        return "text" if sys.stderr.isatty() else "json"
    return log_format


# --- configuration ----------------------------------------------------------------------------
def logging_config(settings: Settings) -> dict:
    """The ``logging.config.dictConfig`` of the API process (module docstring): one stderr
    handler on the root logger, ``--log-level`` for ours and uvicorn's, vLLM's from
    ``VLLM_LOGGING_LEVEL`` when set, else ``--log-level`` too; uvicorn's access log off."""
    level = settings.log_level.upper()
    formatter = "JsonFormatter" if resolved_format(settings.log_format) == "json" else \
        "TextFormatter"
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "filters": {"request_id": {"()": f"{__name__}.RequestIdFilter"}},
        "formatters": {"phi3v": {"()": f"{__name__}.{formatter}"}},
        "handlers": {"phi3v": {"()": f"{__name__}.stream_handler", "stream": "ext://sys.stderr",
                               "formatter": "phi3v", "filters": ["request_id"]}},
        "root": {"level": "WARNING", "handlers": ["phi3v"]},
        "loggers": {
            "serve": {"level": level, "handlers": [], "propagate": True},
            "vllm": {"level": os.environ.get("VLLM_LOGGING_LEVEL", level).upper(),
                     "handlers": [], "propagate": True},
            "uvicorn": {"level": level, "handlers": [], "propagate": True},
            "uvicorn.error": {"level": level, "handlers": [], "propagate": True},
            "uvicorn.access": {"handlers": [], "propagate": False},
        },
    }


def stream_handler(stream) -> logging.Handler:
    """The handler of :func:`logging_config`: a ``StreamHandler`` on ``stream``. Python's
    warnings become records too (``py.warnings``), in every process that applies the
    configuration (an engine-core process included)."""
    logging.captureWarnings(True)
    return logging.StreamHandler(stream)


def configure_logging(settings: Settings) -> None:
    """Apply :func:`logging_config` here, and have vLLM and uvicorn apply it when they
    configure logging (module docstring). Call it before the engine starts and before
    ``uvicorn.Config`` is built."""
    config = logging_config(settings)
    logging.config.dictConfig(config)
    _give_uvicorn(config)
    _give_vllm(config)


def _give_uvicorn(config: dict) -> None:
    """Make ``config`` the default ``log_config`` of ``uvicorn.Config`` (that default is the
    dict ``uvicorn.config.LOGGING_CONFIG`` itself, so its content is replaced in place)."""
    try:
        from uvicorn.config import LOGGING_CONFIG
    except ImportError:  # pragma: no cover - uvicorn is a dependency
        return
    LOGGING_CONFIG.clear()
    LOGGING_CONFIG.update(copy.deepcopy(config))


#: The file :func:`_give_vllm` wrote (None: none yet).
_vllm_config_path: str | None = None


def _give_vllm(config: dict) -> None:
    """Name ``config``, written to a temporary file, in ``VLLM_LOGGING_CONFIG_PATH`` (removed
    at exit), unless the operator set that variable or ``VLLM_CONFIGURE_LOGGING=0`` (vLLM
    refuses a file then)."""
    global _vllm_config_path
    path = os.environ.get("VLLM_LOGGING_CONFIG_PATH")
    if (path and path != _vllm_config_path) or \
            os.environ.get("VLLM_CONFIGURE_LOGGING", "1") == "0":
        return
    if path is None:
        fd, path = tempfile.mkstemp(prefix="phi3v-logging-", suffix=".json")
        os.close(fd)
        atexit.register(_remove, path)
    with open(path, "w") as file:
        json.dump(config, file)
    _vllm_config_path = os.environ["VLLM_LOGGING_CONFIG_PATH"] = path


def _remove(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


# --- the request's record ---------------------------------------------------------------------
def note(**fields: Any) -> None:
    """Add ``fields`` to the state of the request being served (its access record); nothing
    outside a request."""
    state = _REQUEST.get()
    if state is not None:
        state.update(fields)


def served_request_id() -> str | None:
    """The request id of the request being served (its access record's; None outside a
    request)."""
    state = _REQUEST.get()
    return None if state is None else state.get("request_id")


def client_request_id(scope: Scope) -> str | None:
    """The client's ``X-Request-Id``, when at most :data:`MAX_REQUEST_ID_CHARS` printable
    characters (the intake's rule, ``serve.intake.request.check_request_id``), else None."""
    for name, value in scope.get("headers") or ():
        if name == REQUEST_ID_HEADER:
            try:
                text = value.decode()
            except UnicodeDecodeError:
                text = value.decode("latin-1")
            return text if 0 < len(text) <= MAX_REQUEST_ID_CHARS and text.isprintable() \
                else None
    return None


class AccessLog:
    """The access record of every HTTP request (module docstring).

    Args:
        route_of: the route template of a request path (``other`` for none).
        log_content: records carry the request's ``content`` (``--enable-log-requests``).
        skip_paths: request paths that get no record (the request id still applies).
        enabled: False: no record at all.

    The request's state dict holds what the layers noted: ``request_id``; ``code`` (the
    counted status, ``serve.http_metrics``) and ``client_left`` (admission); ``tenant``
    (auth) and ``user`` (intake);
    ``reject_reason``; ``image_tokens`` and ``content`` (intake); ``queue_wait_s`` and
    ``first_token_s`` (admission, on the monotonic clock). vLLM's usage is read from the
    scope's ``state`` (Starlette's ``request.state``, where vLLM's handlers put
    ``request_metadata``).
    """

    def __init__(self, route_of: Callable[[str], str], log_content: bool = False,
                 skip_paths: frozenset[str] = frozenset(), enabled: bool = True) -> None:
        self.route_of = route_of
        self.log_content = log_content
        self.skip_paths = skip_paths
        self.enabled = enabled

    @classmethod
    def from_settings(cls, settings: Settings, route_of: Callable[[str], str]) -> "AccessLog":
        """The access log of ``settings``: ``--enable-log-requests``, and vLLM's flags for
        uvicorn's access log, which this record replaces: ``--disable-uvicorn-access-log``
        (no record) and ``--disable-access-log-for-endpoints /health,/metrics`` (no record
        for those paths, matched exactly as vLLM does)."""
        given = settings.vllm_args
        skip = given.get("disable_access_log_for_endpoints") or ""
        return cls(route_of, settings.enable_log_requests,
                   frozenset(p.strip() for p in skip.split(",") if p.strip()),
                   enabled=not given.get("disable_uvicorn_access_log", False))

    def request(self, scope: Scope, channel: ResponseChannel) -> "_Served":
        """``with access.request(scope, channel) as state:`` serve one HTTP request inside the
        block: its request id set (a head hook puts it in ``X-Request-Id``), its access record
        logged when the response ends (an end hook of ``channel``: its last message sent,
        else the block's end). ``state`` is the request's state dict."""
        start = time.monotonic()
        state = scope.setdefault(REQUEST_STATE_KEY, {})
        state["request_id"] = client_request_id(scope) or secrets.token_hex(8)
        scope.setdefault("state", {})  # shared with vLLM's app, which reports usage there

        def echo(message: Message) -> Message:
            headers = [(k, v) for k, v in message.get("headers") or []
                       if k.lower() != REQUEST_ID_HEADER]
            headers.append((REQUEST_ID_HEADER, state["request_id"].encode()))
            return {**message, "headers": headers}

        def record(failed: bool) -> None:
            if access_log.isEnabledFor(logging.INFO):
                self.log(scope, state, start, time.monotonic(), failed)

        channel.on_head(echo)
        if self.enabled and scope.get("path") not in self.skip_paths:
            channel.on_end(record)
        return _Served(state, channel)

    def log(self, scope: Scope, state: dict, start: float, end: float,
            failed: bool = False) -> None:
        """Log the access record of a request that arrived at ``start`` and whose answer
        ended at ``end`` (monotonic clock; ``failed``: an error ended it). A request that got
        no answer: 500 when an error ended it, else 499 (its client left)."""
        code = state.get("code")
        if code is not None:
            status = int(code)
        else:
            status = 500 if failed else 499
        prompt_tokens, completion_tokens = vllm_usage(scope)
        first = state.get("first_token_s")
        fields = {
            "request_id": state.get("request_id"),  # as the filter adds it, for any handler
            "method": scope.get("method"),
            "route": self.route_of(scope.get("path", "")),
            "status": status,
            "tenant": state.get("tenant"),
            "user": state.get("user"),
            "reject_reason": state.get("reject_reason"),
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "image_tokens": state.get("image_tokens"),
            "queue_wait_s": _seconds(state.get("queue_wait_s")),
            "ttft_s": _seconds(first - start if first is not None else None),
            "e2e_s": _seconds(end - start),
            "client_left": bool(state.get("client_left")),
        }
        if self.log_content and state.get("content") is not None:
            fields["content"] = state["content"]
        access_log.info("%s %s %s", fields["method"], fields["route"], status, extra=fields)


class _Served:
    """The block of :meth:`AccessLog.request`: the request's state is the current one
    (:func:`note`) inside it, and the response ends (``ResponseChannel.end``, failed when an
    exception leaves the block) when it exits. A class rather than a generator-based
    context manager: it is entered once per HTTP request."""

    __slots__ = ("state", "channel", "token")

    def __init__(self, state: dict, channel: ResponseChannel) -> None:
        self.state = state
        self.channel = channel

    def __enter__(self) -> dict:
        self.token = _REQUEST.set(self.state)
        return self.state

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            self.channel.end(failed=exc_type is not None)
        finally:
            _REQUEST.reset(self.token)


def vllm_usage(scope: Scope) -> tuple[int | None, int | None]:
    """vLLM's own count of a request's prompt and completion tokens: the usage its chat and
    completions handlers report on the request's state (``final_usage_info``), streamed or
    not; (None, None) where it reported none (the Responses API, a client that left before
    the end). The access record's and the tenant accounting's (``serve.accounting``) one
    source."""
    usage = getattr((scope.get("state") or {}).get("request_metadata"), "final_usage_info",
                    None)
    return getattr(usage, "prompt_tokens", None), getattr(usage, "completion_tokens", None)


def _seconds(value: float | None) -> float | None:
    return None if value is None else round(value, 6)
