"""Replicas behind vLLM's router on one machine: ``make demo-replicas`` and the replica tests.

`vllm-router <https://github.com/vllm-project/router>`_ (PyPI ``vllm-router``, a Rust binary)
routes; nothing here routes. This module names the router's flags once (:data:`ROUTER_FLAGS`,
each with the reason it is set), builds the command lines of the router and of our gateways,
and runs them together for the demo. The Kubernetes router (``deploy/k8s/router.yaml``) passes
the same flags (``tests/unit/test_replicas.py`` compares them).

Layout on one machine: the router listens on the API port (``PORT``, 8000), the one address
clients and the UI use; replica ``i`` (1..N) is a whole ``python -m serve`` (gateway and
engine) on ``PORT + i``; the router's own Prometheus metrics are on ``ROUTER_METRICS_PORT``
(29000). ``monitoring/prometheus/prometheus-replicas.yml`` scrapes all of them.

What the router does with these flags (vllm-router 0.1.17, measured in the tests):

1. **Affinity.** ``consistent_hash`` over the request's ``X-Session-ID`` header, else
   ``X-User-ID``, ``X-Tenant-ID``, ``X-Request-ID`` (:data:`AFFINITY_HEADERS`): a
   conversation's turns reach one replica, whose image cache and vLLM prefix and multimodal
   caches hold its history. The ring has 160 points per healthy replica; a replica that
   leaves moves only the keys it owned, and they move back when it returns. A request with
   none of these headers hashes an empty key: every such request reaches the same replica.
2. **Membership.** Every replica's ``/ready`` each second; one 503 (draining, engine lost,
   booting) or a refused connection takes it out, two 200s put it back.
3. **Retries.** A request whose answer is a 408, 429, 500, 502, 503 or 504 *status* is sent
   once more (2 attempts in all). A status is all the router retries on: once a replica has
   answered 200 the answer is passed through as it comes, so a stream that has started is
   never sent twice; an error after that reaches the client as our one SSE error event. What
   is retried never gave the client a byte: a refusal (admission, drain, no engine), or a
   non-streamed generation the replica cut and answered 503 (drain timeout, engine lost),
   whose output was discarded: the retry costs compute, it duplicates nothing the client
   sees. The router re-picks the replica for the second attempt: a 5xx
   (or a refused connection, which the router counts as a 500) opens that replica's circuit
   breaker, so the second attempt goes to another replica. A 429 counts as a success for the
   breaker (a client error), so it is retried on the *same* replica after 50 ms; vllm-router
   has no setting to send it elsewhere.
4. **Request ids.** The router takes the client's ``X-Request-Id``, forwards it and answers
   with it; our gateway runs the request under that id plus a suffix (``serve.logs``), so the
   client's id is the prefix of the id in our access record. A request without one gets an
   id the router makes up and does not forward: the UI always sends one.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: Headers the router's consistent hash reads, in its order (the first present wins).
AFFINITY_HEADERS = ("X-Session-ID", "X-User-ID", "X-Tenant-ID", "X-Request-ID")
#: The header our UI sends with each turn: the conversation (Chainlit thread) id.
SESSION_HEADER = AFFINITY_HEADERS[0]
ROUTER_METRICS_PORT = 29000
#: Seconds a replica may take to answer /ready 200 (a first start on a busy 2-core machine).
READY_TIMEOUT_S = 300
#: Flags of every replica here: the router asks /ready each second, which would otherwise be
#: an access record per replica per second (``serve.logs``).
REPLICA_ARGS = ("--disable-access-log-for-endpoints", "/ready,/health")


@dataclass(frozen=True)
class Flag:
    """One vllm-router flag we set: its value and why (``vllm-router --help`` has the rest)."""

    name: str
    value: str
    why: str


ROUTER_FLAGS: tuple[Flag, ...] = (
    Flag("--policy", "consistent_hash",
         "a conversation's turns reach one replica, keyed on X-Session-ID (AFFINITY_HEADERS); "
         "a leaving replica moves only its own keys"),
    Flag("--health-check-endpoint", "/ready",
         "our readiness, not liveness: 503 while booting, draining or after the engine is lost, "
         "so the router stops sending before requests fail (/health stays 200 while draining)"),
    Flag("--health-check-interval-secs", "1",
         "a drain or a lost engine leaves the ring within a second; one GET per second per "
         "replica is free"),
    Flag("--health-failure-threshold", "1",
         "/ready is not flaky: its 503 means draining, booting or no engine, never load"),
    Flag("--cb-failure-threshold", "1",
         "the router's retry picks the replica again, and consistent hashing picks the same one "
         "unless its breaker is open: one 5xx opens it, so the retry goes to another replica"),
    Flag("--cb-timeout-duration-secs", "3",
         "the breaker only steers the retry; /ready decides membership. Open for 3 s (default "
         "60), a restarted replica rejoins when its /ready says so"),
    Flag("--cb-success-threshold", "1",
         "one answered request after the breaker half-opens closes it"),
    Flag("--retry-max-retries", "2",
         "attempts in all: a refused request is sent once more, never a third time"),
    Flag("--request-id-headers", "x-request-id",
         "the one header our gateway takes its request id from (its default list also takes "
         "x-correlation-id, which our gateway would not see as the id)"),
    Flag("--cors-allowed-origins", "https://cors-disabled.invalid",
         "the router answers CORS itself and its default grants every origin; our gateway's "
         "CORS is off unless --allowed-origins: an origin no browser can have keeps it off "
         "(set the gateway's origins here instead when it is on)"),
    Flag("--worker-startup-check-interval", "1",
         "a replica being added (service discovery) is polled each second, not every 30 s"),
    Flag("--log-level", "warning",
         "at info the router writes three lines per request (its hash decision)"),
)


def router_flag_args(overrides: dict[str, str] | None = None) -> list[str]:
    """:data:`ROUTER_FLAGS` as command-line arguments, with ``overrides`` (flag: value)."""
    values = {flag.name: flag.value for flag in ROUTER_FLAGS} | (overrides or {})
    return [part for name, value in values.items() for part in (name, value)]


def router_binary() -> str:
    """The ``vllm-router`` of this environment (the ``router`` extra in pyproject.toml)."""
    beside = Path(sys.executable).parent / "vllm-router"
    found = str(beside) if beside.is_file() else shutil.which("vllm-router")
    if not found:
        raise FileNotFoundError("vllm-router is not installed: make install (the router extra)")
    return found


def router_command(port: int, workers: list[str], metrics_port: int = ROUTER_METRICS_PORT,
                   host: str = "127.0.0.1", overrides: dict[str, str] | None = None
                   ) -> list[str]:
    """The router on ``host:port`` over the replicas at ``workers`` (base URLs), with
    :data:`ROUTER_FLAGS` (``overrides``: flag -> value, for tests)."""
    return [router_binary(), "--host", host, "--port", str(port), "--worker-urls", *workers,
            "--prometheus-host", host, "--prometheus-port", str(metrics_port),
            *router_flag_args(overrides)]


def replica_command(port: int, model: Path | str, args: list[str] | tuple[str, ...] = (),
                    host: str = "127.0.0.1") -> list[str]:
    """One replica: a whole ``python -m serve`` (gateway and its engine) on ``host:port``,
    with :data:`REPLICA_ARGS` and ``args``."""
    return [sys.executable, "-m", "serve", "--model", str(model), "--host", host,
            "--port", str(port), *REPLICA_ARGS, *args]


def replica_ports(port: int, replicas: int) -> list[int]:
    """The replicas' ports beside the router's ``port``: ``port + 1 .. port + replicas``."""
    return [port + i for i in range(1, replicas + 1)]


# --- make demo-replicas ---------------------------------------------------------------------
class Group:
    """Child processes whose output is copied to ours, each line prefixed with its name."""

    def __init__(self) -> None:
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, name: str, cmd: list[str], env: dict[str, str] | None = None) -> None:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
                                start_new_session=True, text=True, errors="replace")
        self.procs[name] = proc

        def copy() -> None:
            for line in proc.stdout:
                sys.stdout.write(f"{name:>9} | {line}")
                sys.stdout.flush()

        threading.Thread(target=copy, daemon=True).start()

    def exited(self) -> str | None:
        """The name of a child that has exited, if any."""
        return next((n for n, p in self.procs.items() if p.poll() is not None), None)

    def stop(self, grace_s: float = 45.0) -> None:
        """SIGTERM every child (replicas drain, ``serve.lifecycle``), SIGKILL what is left."""
        for proc in self.procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for proc in self.procs.values():
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def wait_ready(group: Group, urls: list[str], timeout_s: float) -> bool:
    """Wait until every URL answers 200; False when a child exits or time runs out."""
    import httpx

    deadline = time.monotonic() + timeout_s
    pending = list(urls)
    while pending and time.monotonic() < deadline:
        if group.exited():
            return False
        try:
            if httpx.get(pending[0], timeout=2).status_code == 200:
                pending.pop(0)
                continue
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    return not pending


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="N replicas behind vllm-router, and the UI.")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--model", default=str(ROOT / "models" / "phi-3-vision-tiny"))
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="the router's (the API's) port")
    parser.add_argument("--router-metrics-port", type=int, default=ROUTER_METRICS_PORT)
    parser.add_argument("--ui-python", help="the UI's interpreter (ui/.venv); none: no UI")
    parser.add_argument("--ui-port", type=int, default=8080)
    parser.add_argument("--replica-args", default="",
                        help="extra flags of every python -m serve, one string")
    args = parser.parse_args(argv)

    group = Group()
    workers = [f"http://{args.host}:{p}" for p in replica_ports(args.port, args.replicas)]
    try:
        for i, url in enumerate(workers, 1):
            group.start(f"replica-{i}", replica_command(int(url.rsplit(":", 1)[1]), args.model,
                                                        args.replica_args.split(), args.host))
        # The router starts once every replica is ready (it waits for them itself, polling).
        if not wait_ready(group, [f"{w}/ready" for w in workers], READY_TIMEOUT_S):
            print(f"demo-replicas: {group.exited() or 'a replica'} did not become ready",
                  file=sys.stderr)
            return 1
        group.start("router", router_command(args.port, workers, args.router_metrics_port,
                                             args.host))
        api = f"http://{args.host}:{args.port}"
        if args.ui_python:
            # GET /limits is ours, not an OpenAI route: the router answers it 404, so the UI
            # asks the replicas for it (any one that answers).
            limits = "[" + ",".join(f'"{w}"' for w in workers) + "]"
            group.start("ui", [args.ui_python, "-m", "ui", "--host", args.host,
                               "--port", str(args.ui_port), "--api-base-url", api],
                        env={"PHI3V_UI_LIMITS_URLS": limits})
        if not wait_ready(group, [f"{api}/readiness"], 60):
            print("demo-replicas: the router did not become ready", file=sys.stderr)
            return 1
        print(f"\n  API: {api}/v1   (vllm-router over {args.replicas} replicas: "
              f"{', '.join(workers)})")
        print(f"  Router metrics: http://{args.host}:{args.router_metrics_port}/metrics;  "
              f"replicas' /metrics, /limits, /admin/autotuner on their own ports")
        if args.ui_python:
            print(f"  UI:  http://{args.host}:{args.ui_port}   (login: "
                  f"{os.environ.get('PHI3V_UI_DEMO_USER', 'demo')} / "
                  f"{os.environ.get('PHI3V_UI_DEMO_PASSWORD', 'demo')})")
        print(f"  Affinity: send {SESSION_HEADER}: <conversation id> with each turn\n",
              flush=True)
        while (gone := group.exited()) is None:
            time.sleep(0.5)
        print(f"demo-replicas: {gone} exited; stopping the others", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        group.stop()


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt  # SIGTERM (make, a supervisor) stops the demo as Ctrl-C does


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _interrupt)
    sys.exit(main())
