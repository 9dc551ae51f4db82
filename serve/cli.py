"""``python -m serve``'s command line: every flag of ``vllm serve`` with vLLM's meaning and
default, our gateway's flags beside it as their own group, and ``--config FILE``.

The parser is vLLM's own (``make_arg_parser`` over ``FlexibleArgumentParser``: its groups,
types, ``--help=<group>`` search and ``--config`` YAML loading), with one group added,
**Gateway**, made from the :class:`~serve.settings.Settings` fields vLLM has no flag for.
Where both name the same thing (``--max-num-seqs``, ``--dtype``, ``--host``,
``--allowed-origins``...) the flag is vLLM's and its value fills the setting of that name.

Precedence, highest first: the command line; the ``--config`` file (vLLM inserts its keys as
flags before the command line's, so the command line wins); ``PHI3V_*`` environment variables
(gateway settings and the vLLM flags that are settings); our hardware defaults
(:meth:`Settings.resolved`: float32, eager and ``num_crops=1`` on CPU...), which apply only
where nothing above set a value; vLLM's defaults.

Every vLLM flag is one of: a setting (same name, read by the gateway, passed on to vLLM where
vLLM reads it), passed to vLLM unchanged (engine flags into ``AsyncEngineArgs``, frontend
flags into vLLM's OpenAI app: kept in :attr:`Settings.vllm_args`), or listed in
:data:`VLLM_FLAG_POLICY` with what the gateway does with it. ``tests/unit/test_cli_flags.py``
enumerates vLLM's parser at run time and fails on a flag that is none of these.

Importing this module is cheap; :func:`build_parser` imports vLLM.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import re
import sys
import types
import typing
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, get_args, get_origin

import pydantic

from serve.settings import ENV_PREFIX, Settings, detect_device

if TYPE_CHECKING:  # pragma: no cover
    from vllm.utils.argparse_utils import FlexibleArgumentParser

#: Title of our flags' group in ``--help`` (``--help=gateway`` lists them).
GATEWAY_GROUP = "Gateway"

#: ``PHI3V_*`` variables that are not settings of this process: the chat UI's (``ui/``), the
#: test harness's, and the key clients send in the README's and deploy/'s examples.
FOREIGN_ENV_PREFIXES = (f"{ENV_PREFIX}UI_", f"{ENV_PREFIX}TEST_")
FOREIGN_ENV_NAMES = frozenset({f"{ENV_PREFIX}API_KEY"})

# How each vLLM flag that is not plain pass-through is handled. Kinds:
#   "mapped":  fills a setting of another name (the value's meaning is vLLM's)
#   "server":  applied by our HTTP server exactly as vLLM's launcher applies it
#   "app":     vLLM's OpenAI app takes it unchanged
#   "ours":    ours wins: given or not, the gateway sets it (the reason says why)
#   "refused": a launcher mode of `vllm serve` this single-API-process server does not run;
#              its default is accepted, any other value stops the start with the reason
# Settings of the same name as a vLLM flag are not listed: they are settings.
VLLM_FLAG_POLICY: dict[str, tuple[str, str]] = {
    "model_tag": ("mapped", "the positional model of `vllm serve MODEL`: --model"),
    "config": ("mapped", "YAML file of flags (vLLM's format), gateway flags included"),
    "api_key": ("mapped", "added to --api-keys: the gateway checks keys before every route "
                "but /health and /ready, and vLLM's own check is off"),
    "limit_mm_per_prompt": ("mapped", "its 'image' count is --max-images-per-prompt (intake "
                            "refuses more images with a 400 before vLLM)"),
    "mm_processor_kwargs": ("mapped", "its 'num_crops' is --num-crops; other keys go to vLLM"),
    "kv_cache_memory_bytes": ("mapped", "on CPU it is --cpu-kv-cache-bytes; on GPU passed to "
                              "vLLM (instead of --gpu-memory-utilization)"),
    "h11_max_incomplete_event_size": ("mapped", "--max-header-bytes: our server parses with "
                                      "httptools and bounds the head as it arrives (431)"),
    "h11_max_header_count": ("mapped", "--max-header-count (431 above it)"),
    "uds": ("server", "listen on this Unix socket instead of --host/--port"),
    "uvicorn_log_level": ("server", "uvicorn's log level"),
    "disable_uvicorn_access_log": ("server", "no access record per request (the gateway's "
                                   "serve.access record replaces uvicorn's line)"),
    "disable_access_log_for_endpoints": ("server", "paths whose access records are not "
                                         "logged (health probes)"),
    "ssl_keyfile": ("server", "TLS key file"),
    "ssl_certfile": ("server", "TLS certificate file"),
    "ssl_ca_certs": ("server", "TLS CA certificates (client certificates)"),
    "ssl_cert_reqs": ("server", "whether a client certificate is required (ssl module)"),
    "ssl_ciphers": ("server", "TLS ciphers"),
    "enable_ssl_refresh": ("server", "reload the TLS files when they change"),
    "root_path": ("server", "ASGI root_path behind a path-prefix proxy"),
    "middleware": ("app", "extra ASGI middleware inside vLLM's app (behind our intake)"),
    "enable_request_id_headers": ("app", "X-Request-Id on vLLM's responses (the gateway "
                                  "echoes it on every generation answer anyway)"),
    "disable_fastapi_docs": ("app", "vLLM's /docs (closed unless --open-routes anyway)"),
    "enable_offline_docs": ("app", "vLLM's /docs without a CDN"),
    "enable_flash_late_interaction": ("app", "a pooling-model option of vLLM's app"),
    "trust_remote_code": ("ours", "always on: the model directory's processor code is ours "
                          "(serve/models), and Phi-3-vision needs it"),
    "trust_request_mm_kwargs": ("ours", "always on: intake accepts only num_crops per "
                                "request, bounded by --max-num-crops"),
    "disable_log_stats": ("ours", "always off: admission and the autotuner read vLLM's "
                          "per-step stats"),
    "allowed_media_domains": ("ours", "vLLM never fetches media: intake fetches image URLs "
                              "itself under --image-urls/--image-url-allowlist (SSRF rules)"),
    "allowed_local_media_path": ("ours", "vLLM never reads local files: intake accepts only "
                                 "data: and (with --image-urls) http(s) image URLs"),
    "headless": ("refused", "no API server at all (multi-node data parallel workers): run "
                 "`python -m vllm.entrypoints.cli.main serve --headless` for those nodes"),
    "api_server_count": ("refused", "one API process per replica: scale API processes by "
                         "replicas behind a router (deploy/README.md)"),
    "grpc": ("refused", "the gateway serves HTTP only"),
    "grpc_port": ("refused", "the gateway serves HTTP only"),
    "data_parallel_supervisor_port": ("refused", "no data-parallel supervisor: one API "
                                      "process"),
    "dp_supervisor_probe_interval_s": ("refused", "no data-parallel supervisor"),
    "dp_supervisor_probe_timeout_s": ("refused", "no data-parallel supervisor"),
    "dp_supervisor_probe_failure_threshold": ("refused", "no data-parallel supervisor"),
}

#: Values a "refused" flag may take (its default, or these).
REFUSED_OK = {"api_server_count": (1,)}


class CliError(ValueError):
    """A flag, value or environment variable that cannot start the server; the message names
    it (and the nearest valid name for a misspelling)."""


def _serve_parser_class():
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    class ServeArgumentParser(FlexibleArgumentParser):
        """vLLM's parser whose unknown-flag error names the nearest valid flag."""

        def error(self, message: str) -> typing.NoReturn:
            if message.startswith("unrecognized arguments:"):
                hints = []
                for token in message.split(":", 1)[1].split():
                    if token.startswith("--"):
                        near = nearest(token.split("=", 1)[0], self._option_string_actions)
                        if near:
                            hints.append(f"{token.split('=', 1)[0]}: did you mean {near}?")
                if hints:
                    message += "\n" + "\n".join(hints)
            super().error(message)

    return ServeArgumentParser


def nearest(name: str, candidates) -> str | None:
    """The candidate closest to ``name`` (difflib ratio >= 0.6), or None."""
    found = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.6)
    return found[0] if found else None


def build_parser() -> "FlexibleArgumentParser":
    """vLLM's ``vllm serve`` parser with the **Gateway** group added. Imports vLLM."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser

    parser = make_arg_parser(_serve_parser_class()(
        prog="python -m serve",
        usage="python -m serve [MODEL] [--config FILE] [vLLM and gateway flags] "
              "(--help: the groups; --help=<group or flag>: its flags)",
        description="Phi-3-vision serving stack: vLLM's OpenAI server behind our gateway. "
        "Every `vllm serve` flag works as in vLLM; the Gateway group holds ours (each also a "
        f"{ENV_PREFIX}<NAME> environment variable). Precedence: command line > --config file > "
        f"{ENV_PREFIX}* variables > hardware defaults > vLLM's defaults."))
    # vLLM's choices are upper case; ours (and uvicorn's) are lower case: accept both.
    parser._option_string_actions["--log-level"].type = str.upper
    parser.vllm_dests = vllm_dests(parser)
    parser.vllm_defaults = {a.dest: a.default for a in parser._actions}
    add_gateway_group(parser, parser.vllm_dests)
    return parser


def vllm_dests(parser: argparse.ArgumentParser) -> set[str]:
    """Destinations of every action of ``parser`` (vLLM's flags, before ours are added)."""
    return {a.dest for a in parser._actions}


def gateway_fields(dests: set[str]) -> dict[str, Any]:
    """Settings fields that are our own flags: those vLLM has no flag of the same name for."""
    return {name: f for name, f in Settings.model_fields.items()
            if name not in dests and name != "vllm_args"}


def shared_fields(dests: set[str]) -> set[str]:
    """Settings fields that are vLLM flags of the same name (vLLM's parser reads them)."""
    return set(Settings.model_fields) & dests


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_gateway_group(parser: argparse.ArgumentParser, dests: set[str]) -> None:
    """Add one flag per field of :func:`gateway_fields`: booleans as ``--x/--no-x``, lists
    as one or more values (or one JSON list), literals with their choices; everything else
    is read as text and converted and checked by the ``Settings`` model."""
    group = parser.add_argument_group(
        GATEWAY_GROUP, f"Our gateway: intake, admission and autotuner, connection limits, "
        f"auth, observability. Each flag is also the environment variable "
        f"{ENV_PREFIX}<FLAG_NAME>.")
    for name, field in gateway_fields(dests).items():
        # vLLM's help formatter appends "(default: ...)"; None is a hardware default, which
        # the description states.
        kwargs: dict[str, Any] = {"dest": name, "help": field.description,
                                  "default": field.get_default()}
        base = _without_none(field.annotation)
        if base is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif get_origin(base) is list:
            kwargs["nargs"] = "+"
        elif get_origin(base) is typing.Literal:
            kwargs["choices"] = list(get_args(base))
        else:
            kwargs["metavar"] = getattr(base, "__name__", "VALUE").upper()
        group.add_argument(_flag(name), **kwargs)


def _without_none(annotation: Any) -> Any:
    """``X`` for ``X | None`` (and ``Optional[X]``), else the annotation itself."""
    if get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in get_args(annotation) if a is not type(None)]
        return args[0] if len(args) == 1 else annotation
    return annotation


def list_value(values: Sequence[str]) -> list:
    """A list flag's value: one JSON list (``'["a","b"]'``) or the values themselves."""
    if len(values) == 1 and values[0].lstrip().startswith("["):
        try:
            parsed = json.loads(values[0])
        except json.JSONDecodeError as exc:
            raise CliError(f"not a JSON list: {values[0]!r} ({exc})") from exc
        if isinstance(parsed, list):
            return parsed
    return list(values)


def check_environment(environ: Mapping[str, str]) -> None:
    """Refuse ``PHI3V_*`` variables that name no setting (pydantic-settings would ignore
    them silently).

    Raises:
        CliError: naming the variable and the nearest setting's variable.
    """
    known = {ENV_PREFIX + name.upper() for name in Settings.model_fields}
    for key in sorted(environ):
        name = key.upper()
        if (not name.startswith(ENV_PREFIX) or name in known or name in FOREIGN_ENV_NAMES
                or name.startswith(FOREIGN_ENV_PREFIXES)):
            continue
        near = nearest(name, known)
        hint = f"; did you mean {near}?" if near else ""
        raise CliError(f"unknown environment variable {key} (not a setting of python -m "
                       f"serve){hint}")


def _suppress_defaults(parser: argparse.ArgumentParser) -> None:
    """Let the namespace hold only what the command line (and --config) gave: a flag left
    out must not override an environment variable or a hardware default."""
    for action in parser._actions:
        if action.dest != "help":
            action.default = argparse.SUPPRESS


def _map_vllm_flag(dest: str, value: Any, out: dict[str, Any], vllm_args: dict[str, Any],
                   device: str, default: Any) -> None:
    """Apply one "mapped"/"refused" flag of :data:`VLLM_FLAG_POLICY` (its docs)."""
    if dest == "model_tag":
        if value is not None:
            if out.get("model", value) != value:
                raise CliError(f"the model is given twice: {value!r} and --model "
                               f"{out['model']!r}")
            out["model"] = value
    elif dest == "config":
        pass  # FlexibleArgumentParser inserted its contents as flags
    elif dest == "api_key":
        out["api_keys"] = [*out.get("api_keys", []), *(value or [])]
    elif dest == "limit_mm_per_prompt":
        rest = dict(value or {})
        image = rest.pop("image", None)
        if isinstance(image, Mapping):
            image = image.get("count")
        if image is not None:
            out["max_images_per_prompt"] = image
        if rest:
            vllm_args[dest] = rest
    elif dest == "mm_processor_kwargs":
        rest = dict(value or {})
        if "num_crops" in rest:
            out["num_crops"] = rest.pop("num_crops")
        if rest:
            vllm_args[dest] = rest
    elif dest == "kv_cache_memory_bytes":
        if device == "cpu":
            out["cpu_kv_cache_bytes"] = value
        else:
            vllm_args[dest] = value
    elif dest == "h11_max_incomplete_event_size":
        out["max_header_bytes"] = value
    elif dest == "h11_max_header_count":
        out["max_header_count"] = value
    elif VLLM_FLAG_POLICY[dest][0] == "refused":
        if value != default and value not in REFUSED_OK.get(dest, ()):
            raise CliError(f"{_flag(dest)} {value}: not supported by python -m serve "
                           f"({VLLM_FLAG_POLICY[dest][1]})")
    elif VLLM_FLAG_POLICY[dest][0] == "ours":
        print(f"warning: {_flag(dest)} is set by the gateway ({VLLM_FLAG_POLICY[dest][1]}); "
              "the value given is not used", file=sys.stderr)
    else:  # "server" and "app": vLLM's value, used where vLLM uses it
        vllm_args[dest] = value


def _shared_value(dest: str, value: Any) -> Any:
    if dest == "log_level":
        return str(value).lower()
    return value


def settings_from_namespace(ns: argparse.Namespace, parser: argparse.ArgumentParser
                            ) -> Settings:
    """The :class:`Settings` for the flags in ``ns`` (only those given: see
    :func:`_suppress_defaults`), environment variables and defaults below them.

    Raises:
        CliError: a refused flag, or a value the settings model rejects (named by its flag).
    """
    given = vars(ns)
    vllm = parser.vllm_dests
    shared = shared_fields(vllm)
    out: dict[str, Any] = {}
    vllm_args: dict[str, Any] = {}
    # Settings of the same name first: mapped flags may add to them (--api-key).
    for dest, value in given.items():
        if dest in shared:
            out[dest] = _shared_value(dest, value)
        elif dest not in vllm:
            is_list = get_origin(_without_none(Settings.model_fields[dest].annotation)) is list
            out[dest] = list_value(value) if is_list else value
    device = out.get("device") or os.environ.get(f"{ENV_PREFIX}DEVICE") or detect_device()
    for dest, value in given.items():
        if dest in shared or dest not in vllm:
            continue
        if dest in VLLM_FLAG_POLICY:
            _map_vllm_flag(dest, value, out, vllm_args, device, parser.vllm_defaults[dest])
        else:
            vllm_args[dest] = value
    try:
        return Settings(**out, vllm_args=vllm_args)
    except pydantic.ValidationError as exc:
        problems = []
        for err in exc.errors():
            name = str(err["loc"][0]) if err["loc"] else ""
            problems.append(f"{_flag(name)}: {err['msg']}"
                            + (f" (got {err['input']!r})" if "input" in err else ""))
        raise CliError("; ".join(problems)) from exc


def wants_help(argv: Sequence[str]) -> bool:
    """Whether ``argv`` asks for help (``-h``, ``--help``, ``--help=<group or flag>``)."""
    return any(a == "-h" or re.fullmatch(r"--help(=.*)?", a) for a in argv)


def parse_settings(argv: Sequence[str] | None = None,
                   environ: Mapping[str, str] | None = None) -> Settings:
    """Settings for a command line (default ``sys.argv[1:]``) and environment (default
    ``os.environ``). ``--help`` prints and exits 0, as vLLM's does; an unknown flag exits 2
    with the nearest valid one (argparse's exit).

    Raises:
        CliError: an unknown ``PHI3V_*`` variable, a refused flag or an invalid value.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    check_environment(os.environ if environ is None else environ)
    parser = build_parser()
    if wants_help(argv):
        parser.parse_args(argv)  # prints the help and exits
    _suppress_defaults(parser)
    try:
        ns = parser.parse_args(argv)
    except (ValueError, AssertionError, OSError) as exc:  # --config problems
        raise CliError(str(exc)) from exc
    return settings_from_namespace(ns, parser)
