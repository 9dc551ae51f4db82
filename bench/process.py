"""Managed server processes, written once for the benchmarks and the tests: start a server in
its own process group, wait until it answers, read its log, stop it (SIGINT, then SIGKILL).

``python -m serve`` and raw vLLM's ``python -m vllm.entrypoints.openai.api_server`` both run
through :func:`start_process`; the tests' ``Server`` adds its ``/metrics`` helpers on top.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TINY_MODEL = ROOT / "models" / "phi-3-vision-tiny"
#: Seconds a server may take to become ready (first start on a machine runs vLLM's model
#: inspection subprocess: ~35 s typical, measured in ../shared/vllm-cpu-notes.md).
READY_TIMEOUT_S = 300


#: Where the benchmarks' ledgers live: what a run appends there is results, not a change to
#: the code measured, so it never makes the checkout dirty (:func:`git_state`).
RESULTS = "bench/results"
#: The code measured: every tracked file outside :data:`RESULTS` but the Markdown prose, the
#: tests and the chat UI (a ``git`` pathspec; its ``*`` matches across directories). No
#: program reads a ``.md`` file, and no benchmark runs a test or the UI (its own venv, which
#: talks to the API over HTTP only), so a commit of manuals, notes, tests or the UI leaves the
#: measured code as it was and the runs before and after it pool.
CODE_PATHSPEC = (".", f":(exclude){RESULTS}", ":(exclude)*.md", ":(exclude)tests",
                 ":(exclude)ui")


def git_state(root: Path = ROOT) -> tuple[str, bool]:
    """``(commit, dirty)`` of the checkout at ``root``: HEAD (``"unknown"`` outside git), and
    whether the tracked code (:data:`CODE_PATHSPEC`) differs from it. A benchmark ledger keys its
    records by it, so a second run of the same code pools with the first even before the
    first's records are committed."""
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True,
                            text=True).stdout.strip() or "unknown"
    dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", *CODE_PATHSPEC],
                           cwd=root).returncode != 0
    return commit, dirty


def same_code(a: str, b: str, root: Path = ROOT) -> bool:
    """Whether commits ``a`` and ``b`` hold the same code (:data:`CODE_PATHSPEC`): the same
    code measured (a commit of a ledger or of prose changes no code). False when git
    cannot tell (an unknown commit, no repository)."""
    if a == b:
        return True
    diff = subprocess.run(["git", "diff", "--quiet", a, b, "--", *CODE_PATHSPEC], cwd=root,
                          capture_output=True)
    return diff.returncode == 0


#: Where :func:`free_port` draws from when the kernel does not say its ephemeral range.
EPHEMERAL_RANGE = (32768, 60999)
#: The lowest port :func:`free_port` hands out (above the registered services most machines run).
LOWEST_PORT = 10000


def ephemeral_range(path: Path = Path("/proc/sys/net/ipv4/ip_local_port_range")
                    ) -> tuple[int, int]:
    """The kernel's ephemeral port range ``(low, high)``, inclusive: where it picks the local
    port of every outgoing connection and of every ``bind(port 0)``."""
    try:
        low, high = map(int, path.read_text().split())
        return low, high
    except (OSError, ValueError):
        return EPHEMERAL_RANGE


def free_port(rng: random.Random | None = None) -> int:
    """A TCP port on 127.0.0.1 that nothing listens on, drawn at random below the kernel's
    ephemeral range.

    A port that ``bind(0)`` returns lies inside that range, so between the draw and the
    server's own bind any outgoing connection, or an engine's ``bind(0)`` for its own sockets,
    can take it (``Address already in use``). Below the range only an explicit bind can.

    Raises:
        OSError: no free port found in 200 draws.
    """
    rng = rng or random.Random()
    low = ephemeral_range()[0]
    for _ in range(200):
        port = rng.randrange(LOWEST_PORT, low) if low > LOWEST_PORT else 0
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return s.getsockname()[1]
    raise OSError("no free TCP port below the ephemeral range")


def ensure_tiny_model(model: Path = TINY_MODEL) -> Path:
    """Build the tiny model, or rebuild it when the builder's sources changed
    (``python -m serve.models.build`` is idempotent: a second of work when up to date)."""
    subprocess.run([sys.executable, "-m", "serve.models.build", "--size", "tiny",
                    "--out", str(model)], cwd=ROOT, check=True)
    return model


@dataclass
class ManagedServer:
    """A server process started by :func:`start_process`.

    Attributes:
        base_url: ``http://127.0.0.1:<port>``.
        proc: the process (leader of its own process group).
        log_path: its stdout and stderr.
        args: the flags it was started with (for reports).
        ready_s: seconds from start to the first 200 of its readiness path.
        ready_statuses: every status the readiness path answered while it started (the 503s
            of the boot phase, then 200).
    """

    base_url: str
    proc: subprocess.Popen
    log_path: Path
    args: list[str]
    ready_s: float | None = None
    ready_statuses: list[int] = field(default_factory=list)

    @property
    def url(self) -> str:
        return self.base_url

    def log_tail(self, n: int = 60) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])


def wait_until_up(proc: subprocess.Popen, url: str, timeout_s: float,
                  log_tail: Callable[[], str], seen: list[int] | None = None) -> None:
    """Poll ``url`` until it answers 200, recording every status in ``seen``.

    Raises:
        RuntimeError: the process exited (with its log tail).
        TimeoutError: no 200 within ``timeout_s`` seconds.
    """
    import httpx

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
    raise TimeoutError(f"{url} not up in {timeout_s:g} s:\n{log_tail()}")


def start_process(cmd: list[str], port: int, log_path: Path, ready_path: str = "/ready",
                  args: list[str] | None = None, env: dict[str, str] | None = None,
                  ready_timeout_s: float = READY_TIMEOUT_S,
                  server_cls: type[ManagedServer] = ManagedServer, unset: tuple[str, ...] = (),
                  **fields) -> ManagedServer:
    """Start an HTTP server process ``cmd`` listening on ``port`` in its own process group and
    wait until ``ready_path`` answers 200.

    Args:
        env: variables added to this process's environment; ``unset``: names removed from it.
        server_cls, fields: the class of the returned object and its extra fields.

    Raises:
        RuntimeError: the process exited (with its log tail).
        TimeoutError: not ready within ``ready_timeout_s`` seconds (the process is stopped).
    """
    log_path.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        child_env = {k: v for k, v in {**os.environ, **(env or {})}.items() if k not in unset}
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                env=child_env, start_new_session=True)
    server = server_cls(base_url=f"http://127.0.0.1:{port}", proc=proc, log_path=log_path,
                        args=args or cmd, **fields)
    try:
        wait_until_up(proc, f"{server.base_url}{ready_path}", ready_timeout_s, server.log_tail,
                      seen=server.ready_statuses)
    except TimeoutError:
        stop_process(server)
        raise
    server.ready_s = time.monotonic() - t0
    return server


def start_serve(args: list[str], log_path: Path, model_dir: Path = TINY_MODEL,
                env: dict[str, str] | None = None, ready_timeout_s: float = READY_TIMEOUT_S,
                server_cls: type[ManagedServer] = ManagedServer, **fields) -> ManagedServer:
    """Start ``python -m serve --model MODEL_DIR --port P *args`` and wait for ``/ready``
    200."""
    port = free_port()
    cmd = [sys.executable, "-m", "serve", "--model", str(model_dir), "--port", str(port),
           *args]
    return start_process(cmd, port, log_path, "/ready", args, env, ready_timeout_s,
                         server_cls, **fields)


def stop_group(proc: subprocess.Popen, grace_s: float) -> None:
    """SIGINT the process group, then SIGKILL it if it does not stop within ``grace_s``."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def stop_process(server: ManagedServer, grace_s: float = 30.0) -> None:
    """Stop a server started by :func:`start_process` (:func:`stop_group`)."""
    stop_group(server.proc, grace_s)
