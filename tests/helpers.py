"""Helpers of the test tiers: paths, image payloads, and starting/stopping a real API server."""

from __future__ import annotations

import base64
import io
import json
import re
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from bench.process import (  # noqa: F401 - re-exported: the tests' one import place
    READY_TIMEOUT_S,
    ROOT,
    TINY_MODEL,
    ManagedServer,
    ensure_tiny_model,
    free_port,
    start_process,
    start_serve,
    stop_group,
    stop_process,
    wait_until_up,
)

IMAGES = ROOT.parent / "shared" / "images"
ARTIFACTS = ROOT / "test-artifacts"


def data_url(path_or_bytes: Path | bytes, mime: str | None = None) -> str:
    """A ``data:`` URL for an image file (or raw bytes)."""
    if isinstance(path_or_bytes, Path):
        raw = path_or_bytes.read_bytes()
        mime = mime or {"png": "image/png", "jpg": "image/jpeg", "gif": "image/gif"}.get(
            path_or_bytes.suffix.lstrip(".").lower(), "application/octet-stream")
    else:
        raw = path_or_bytes
    return f"data:{mime or 'image/png'};base64,{base64.b64encode(raw).decode()}"


def png_bytes(image) -> bytes:
    """Encode a Pillow image as PNG bytes."""
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


@dataclass
class Server(ManagedServer):
    """A running ``python -m serve`` (``bench.process``) with ``/metrics`` helpers."""

    model: str = ""

    def metrics(self, names: tuple[str, ...] = ()) -> dict[tuple[str, tuple], float]:
        """One scrape of ``/metrics``: ``{(sample name, sorted label items): value}``; with
        ``names``, only the samples whose name starts with one of them (the rest of the text
        is not parsed: cheaper for a loop that samples a few series while under load)."""
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(f"{self.base_url}/metrics", timeout=10).text
        if names:
            text = "\n".join(line for line in text.splitlines() if line.startswith(names))
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for family in text_string_to_metric_families(text) for s in family.samples}

    def metric(self, name: str, labels: dict[str, str] | None = None,
               scrape: dict | None = None) -> float:
        """Sum of the samples of ``name`` matching ``labels`` (from ``scrape`` or a new one)."""
        scrape = self.metrics() if scrape is None else scrape
        matches = [v for (n, lbl), v in scrape.items() if n == name
                   and all(dict(lbl).get(k) == want for k, want in (labels or {}).items())]
        if not matches:
            raise KeyError(f"{name}{labels or ''} not on /metrics")
        return sum(matches)

    async def ametric(self, name: str, labels: dict[str, str] | None = None) -> float:
        """:meth:`metric` without blocking the event loop (runs in a thread)."""
        import asyncio

        return await asyncio.to_thread(self.metric, name, labels)

    async def ametrics(self, names: tuple[str, ...] = ()) -> dict[tuple[str, tuple], float]:
        """:meth:`metrics` without blocking the event loop (runs in a thread)."""
        import asyncio

        return await asyncio.to_thread(self.metrics, names)


@dataclass
class CliResult:
    """What a run of the command line gave: exit status and output."""

    returncode: int
    stdout: str
    stderr: str


def serve_cli(*argv: str, timeout_s: int = 120) -> CliResult:
    """``python -m serve *argv`` run in this process (``serve.__main__.main``, which the
    module's ``__main__`` calls), for the runs that stop before serving: ``--help``, refused
    flags, settings and model directories. Saves the ~13 s a new process spends importing
    vLLM. The environment (vLLM's, set before its parser runs) is restored afterwards; a run
    that starts to serve instead is stopped by ``TimeoutError`` after ``timeout_s``."""
    import contextlib
    import os
    import signal

    from serve.__main__ import main

    def too_long(signum, frame):
        raise TimeoutError(f"python -m serve {' '.join(argv)} did not stop within {timeout_s} s")

    out, err = io.StringIO(), io.StringIO()
    saved = dict(os.environ)
    previous = signal.signal(signal.SIGALRM, too_long)
    signal.alarm(timeout_s)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(list(argv))
            except SystemExit as exc:  # argparse: --help, a usage error
                code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
        os.environ.clear()
        os.environ.update(saved)
    return CliResult(code, out.getvalue(), err.getvalue())


def vllm_token_event(content: bytes, finish: bytes = b"null") -> bytes:
    """A chat token event as vLLM 0.32 writes it (captured from the tiny model): compact JSON,
    one choice; ``content`` and ``finish`` are JSON literals (``b'"hi"'``, ``b'"abort"'``)."""
    return (b'data: {"id":"chatcmpl-3","object":"chat.completion.chunk","created":1,"model":"m",'
            b'"choices":[{"index":0,"delta":{"content":' + content + b'},"logprobs":null,'
            b'"finish_reason":' + finish + b',"token_ids":null}]}\n\n')


def start_server(extra_args: list[str] | None = None, env: dict[str, str] | None = None,
                 name: str = "server") -> Server:
    """Start the API on the tiny model on a free port and wait until ``/ready`` answers 200
    (every ``/ready`` status seen on the way is in ``ready_statuses``: the 503s of the boot).
    Its log is ``test-artifacts/<name>.log``."""
    model = ensure_tiny_model()
    return start_serve(extra_args or [], ARTIFACTS / f"{name}.log", model_dir=model, env=env,
                       ready_timeout_s=READY_TIMEOUT_S, server_cls=Server, model=model.name)


def stop_server(server: Server) -> None:
    """Stop a server started by :func:`start_server` (30 s grace)."""
    stop_process(server, 30)


#: The session's ``gateway`` server (tests/conftest.py): its one ``--allowed-origins`` origin
#: and its plain ``--api-keys`` key (tenant ``default``, admin).
GATEWAY_ORIGIN = "http://app.example"
GATEWAY_KEY = "plain-key"
#: Its ``--max-request-bytes``, and the hosts of its ``--image-url-allowlist`` (the hostile
#: tests' spellings of loopback; only 127.0.0.2 is an allowed network).
GATEWAY_MAX_BODY = 3 * 2**20
GATEWAY_URL_HOSTS = ["127.0.0.2", "localhost", "127.0.0.1", "127.1", "0x7f000001", "::1"]
#: Flags of a server whose output is JSON lines (``serve.logs``) without vLLM's progress bar.
JSON_LOGS = ["--log-format", "json", "--no-use-tqdm-on-load"]


def keys_cli(keys_file: Path, *argv: str) -> str:
    """``python -m serve.keys --file KEYS_FILE *argv`` as an operator runs it; its stdout.
    Raises ``subprocess.CalledProcessError`` when it fails."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "serve.keys", "--file", str(keys_file), *argv],
                          cwd=ROOT, capture_output=True, text=True, timeout=60, check=True)
    return done.stdout.strip()


def add_key(keys_file: Path, tenant: str, *flags: str) -> str:
    """A new key of ``tenant`` in ``keys_file`` (created with ``flags``, e.g. ``--admin``,
    ``--weight 3``) through :func:`keys_cli`; its token."""
    return keys_cli(keys_file, "add", "--tenant", tenant, *flags).splitlines()[-1]


class ImagePeer:
    """An outside image server for the ``--image-urls`` tests, on 127.0.0.2 (the address the
    tests exempt with ``allowed_networks``), a thread per connection. Paths: ``/img.png``
    serves ``png``; ``/hang...`` reads the request and never answers (until the client
    leaves); ``/drip...`` sends the headers, then one byte every 0.1 s. :attr:`base` is its
    ``http://127.0.0.2:<port>``; :meth:`close` stops it."""

    def __init__(self, png: bytes) -> None:
        import http.server
        import threading
        import time

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self):
                if self.path.startswith("/img.png"):
                    self.send_response(200)
                    self.send_header("Content-Type", "image/png")
                    self.send_header("Content-Length", str(len(png)))
                    self.end_headers()
                    self.wfile.write(png)
                elif self.path.startswith("/hang"):
                    self.connection.settimeout(60)
                    try:
                        self.connection.recv(1)  # returns when the client closes
                    except OSError:
                        pass
                elif self.path.startswith("/drip"):
                    self.send_response(200)
                    self.send_header("Content-Type", "image/png")
                    self.send_header("Content-Length", str(len(png)))
                    self.end_headers()
                    try:
                        for byte in png[:600]:
                            self.wfile.write(bytes([byte]))
                            self.wfile.flush()
                            time.sleep(0.1)
                    except OSError:
                        pass  # the client gave up
                elif self.path.startswith("/redirect-malformed"):
                    # a Location httpx takes but urllib cannot join (an unclosed IPv6 bracket)
                    self.send_response(302)
                    self.send_header("Location", "http://u[ser@127.0.0.2/x.png")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                else:
                    self.send_error(404)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.2", 0), Handler)
        self.server.daemon_threads = True
        self.server.request_queue_size = 64  # a burst of fetches connects at once
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.base = f"http://127.0.0.2:{self.server.server_address[1]}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


#: Output lines that are no log record (``serve.logs``): PyTorch's C++ warnings, and what a
#: process logs before it configures logging (vLLM's Triton check when vLLM is imported, in
#: the API process and in the engine-core process).
NOT_RECORDS = re.compile(r"^\[[WIE]\d{4} |^Triton is installed")


def log_lines(server, request_ids=()) -> list[dict]:
    """The output (stdout and stderr) of a server logging JSON (``--log-format json``), every
    line but :data:`NOT_RECORDS` parsed as JSON, once it holds the access record of each of
    ``request_ids`` (written as each answer ends; 30 s at most)."""
    deadline = time.monotonic() + 30
    while True:
        lines = [line for line in server.log_path.read_text().splitlines()
                 if line.strip() and not NOT_RECORDS.match(line)]
        bad = [line for line in lines if not _is_json(line)]
        assert not bad, f"{len(bad)} of {len(lines)} lines are not JSON:\n" + "\n".join(bad[:20])
        records = [json.loads(line) for line in lines]
        logged = {r.get("request_id") for r in records if r["logger"] == "serve.access"}
        if set(request_ids) <= logged or time.monotonic() > deadline:
            return records
        time.sleep(0.2)


def _is_json(line: str) -> bool:
    try:
        return isinstance(json.loads(line), dict)
    except ValueError:
        return False
