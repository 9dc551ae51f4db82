"""Helpers of the test tiers: paths, image payloads, and starting/stopping a real API server."""

from __future__ import annotations

import base64
import io
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
IMAGES = ROOT.parent / "shared" / "images"
TINY_MODEL = ROOT / "models" / "phi-3-vision-tiny"
ARTIFACTS = ROOT / "test-artifacts"
#: Seconds the server may take to become ready (first start on a machine runs vLLM's model
#: inspection subprocess: ~35 s typical, measured in ../shared/vllm-cpu-notes.md).
READY_TIMEOUT_S = 300


def free_port() -> int:
    """An unused TCP port on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


def ensure_tiny_model() -> Path:
    """Build the tiny model (idempotent) and return its directory."""
    subprocess.run([sys.executable, "-m", "serve.models.build", "--size", "tiny",
                    "--out", str(TINY_MODEL)], cwd=ROOT, check=True)
    return TINY_MODEL


@dataclass
class Server:
    """A running ``python -m serve`` process."""

    base_url: str
    model: str
    proc: subprocess.Popen
    log_path: Path
    ready_statuses: list[int] = field(default_factory=list)

    def metrics(self) -> dict[tuple[str, tuple], float]:
        """One scrape of ``/metrics``: ``{(sample name, sorted label items): value}``."""
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(f"{self.base_url}/metrics", timeout=10).text
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

    def log_tail(self, n: int = 60) -> str:
        lines = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(lines[-n:])


def start_server(extra_args: list[str] | None = None, env: dict[str, str] | None = None,
                 name: str = "server") -> Server:
    """Start the API on a free port and wait until ``/ready`` answers 200.

    Records every ``/ready`` status seen while waiting (the 503s of the boot phase).
    """
    model = ensure_tiny_model()
    port = free_port()
    ARTIFACTS.mkdir(exist_ok=True)
    log_path = ARTIFACTS / f"{name}.log"
    log = open(log_path, "w")
    cmd = [sys.executable, "-m", "serve", "--model", str(model), "--port", str(port),
           *(extra_args or [])]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, **(env or {})}, start_new_session=True)
    server = Server(f"http://127.0.0.1:{port}", model.name, proc, log_path)
    try:
        wait_until_up(proc, f"{server.base_url}/ready", READY_TIMEOUT_S, server.log_tail,
                      seen=server.ready_statuses)
    except TimeoutError:
        stop_server(server)
        raise
    return server


def wait_until_up(proc: subprocess.Popen, url: str, timeout_s: float, log_tail,
                  seen: list[int] | None = None) -> None:
    """Poll ``url`` until it answers 200, recording every status in ``seen``.

    Raises:
        RuntimeError: the process exited (with its log tail).
        TimeoutError: no 200 within ``timeout_s`` seconds.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args} exited with {proc.returncode}:\n{log_tail()}")
        try:
            status = httpx.get(url, timeout=2).status_code
            if seen is not None:
                seen.append(status)
            if status == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.25)
    raise TimeoutError(f"{url} not up in {timeout_s}s:\n{log_tail()}")


def stop_group(proc: subprocess.Popen, grace_s: float) -> None:
    """SIGINT the process group, then SIGKILL it if it does not stop within ``grace_s``."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def stop_server(server: Server) -> None:
    """Stop a server started by :func:`start_server` (30 s grace)."""
    stop_group(server.proc, 30)
