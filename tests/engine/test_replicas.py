"""Two real tiny replicas behind vllm-router (``deploy/replicas.py``): affinity, per-replica
autotuners, the queue KEDA reads, a killed engine, and a rolling restart under load.

One pair of replicas and one router serve the whole module (``stack``); the tests run in file
order and the later ones restart replicas. Which replica served a request is read from the
replicas' access records: each request carries an ``X-Request-Id`` of ours, which the router
forwards and the gateway logs as the prefix of its request id (``serve.logs``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil
import pytest
import yaml

from deploy.replicas import SESSION_HEADER, replica_command, router_command
from serve.sse import DONE, data_event
from tests.helpers import (
    ARTIFACTS,
    IMAGES,
    ROOT,
    Server,
    data_url,
    ensure_tiny_model,
    free_port,
    start_process,
    stop_process,
)

#: Each replica's own start limit, so their autotuners can be told apart.
START_LIMITS = (4, 6)
#: Seconds within which the router must take a replica out or put it back.
ROUTER_NOTICE_S = 5
#: Answer tokens of the load (a few hundred ms each on this CPU).
LOAD_TOKENS = 16
CHAT = "/v1/chat/completions"
#: vLLM's multimodal processor cache, per replica: it hits when a photo comes again as the same
#: bytes, which the intake's image cache guarantees (``serve.intake.cache``).
MM_CACHE_HITS = "vllm:mm_cache_hits_total"
#: The intake's own history-image cache, per replica (``serve.metrics.ImageCacheSeries``).
HISTORY_HITS = ("phi3v_image_cache_lookups_total", {"result": "hit"})


def cache_hits(replica: Server) -> tuple[float, float]:
    """``replica``'s (vLLM multimodal cache hits, history-image cache hits), one scrape."""
    scrape = replica.metrics()
    return (replica.metric(MM_CACHE_HITS, scrape=scrape),
            replica.metric(*HISTORY_HITS, scrape=scrape))


@dataclass
class Stack:
    """Replicas 1..N (``replicas[i - 1]``), the router in front, and every log a replica has
    written (a restarted replica writes a new one)."""

    model: Path
    ports: list[int]
    replicas: list[Server] = field(default_factory=list)
    router: Server | None = None
    router_metrics: str = ""
    logs: dict[int, list[Path]] = field(default_factory=dict)
    starts: dict[int, int] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return self.router.base_url

    def worker(self, i: int) -> str:
        return f"http://127.0.0.1:{self.ports[i - 1]}"

    def start_replica(self, i: int) -> Server:
        """Start replica ``i`` on its port (again) and wait for its /ready 200."""
        self.starts[i] = self.starts.get(i, 0) + 1
        log = ARTIFACTS / f"replica-{i}-{self.starts[i]}.log"
        args = ["--admission-limit", str(START_LIMITS[i - 1])]
        server = start_process(replica_command(self.ports[i - 1], self.model, args),
                               self.ports[i - 1], log, "/ready", server_cls=Server,
                               model=self.model.name)
        self.logs.setdefault(i, []).append(log)
        self.replicas[i - 1] = server
        return server

    def served_by(self, request_id: str) -> set[int]:
        """The replicas whose access log has ``request_id`` answered 200."""
        out = set()
        for i, paths in self.logs.items():
            for path in paths:
                for line in path.read_text(errors="replace").splitlines():
                    if request_id not in line or not line.startswith("{"):
                        continue
                    record = json.loads(line)
                    if (record.get("logger") == "serve.access" and record["status"] == 200
                            and record["request_id"].startswith(request_id)):
                        out.add(i)
        return out

    def healthy(self) -> dict[str, bool]:
        """The router's view of each worker (its ``GET /workers``)."""
        workers = httpx.get(f"{self.url}/workers", timeout=5).json()["workers"]
        return {w["url"]: w["is_healthy"] for w in workers}

    async def wait_router(self, i: int, healthy: bool, within_s: float) -> float:
        """Seconds until the router sees replica ``i`` as ``healthy``."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < within_s:
            if (await asyncio.to_thread(self.healthy)).get(self.worker(i)) is healthy:
                return time.monotonic() - t0
            await asyncio.sleep(0.1)
        raise AssertionError(f"the router did not mark replica {i} "
                             f"{'up' if healthy else 'down'} within {within_s} s: "
                             f"{self.healthy()}")

    def router_metric(self, name: str) -> float:
        return scraped(self.router_metrics, name)


def scraped(url: str, name: str) -> float:
    """The sum of the samples of ``name`` on the Prometheus page at ``url`` (0 if none)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url, timeout=5).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == name)


@pytest.fixture(scope="module")
def stack():
    model = ensure_tiny_model()
    ports: set[int] = set()
    while len(ports) < 4:  # the router, its metrics, two replicas: four distinct ports
        ports.add(free_port())
    router_port, metrics_port, *replica_ports = sorted(ports)
    stack = Stack(model, replica_ports, replicas=[None, None])  # type: ignore[list-item]
    try:
        # Both replicas boot at once (their engines load in parallel), then the router.
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            list(pool.map(stack.start_replica, (1, 2)))
        stack.router_metrics = f"http://127.0.0.1:{metrics_port}/metrics"
        stack.router = start_process(
            router_command(router_port, [stack.worker(1), stack.worker(2)], metrics_port),
            router_port, ARTIFACTS / "router.log", "/readiness", server_cls=Server,
            model=model.name, ready_timeout_s=60)
        yield stack
    finally:
        if stack.router is not None:
            stop_process(stack.router, 10)
        for server in stack.replicas:
            if server is not None:
                stop_process(server, 30)


# --- requests ------------------------------------------------------------------------------
def image(name: str) -> dict:
    return {"type": "image_url", "image_url": {"url": data_url(IMAGES / name)}}


def request_id() -> str:
    return f"t-{uuid.uuid4().hex[:16]}"


def headers(session: str | None, rid: str) -> dict[str, str]:
    return {"X-Request-Id": rid, **({SESSION_HEADER: session} if session else {})}


@dataclass
class Outcome:
    kind: str
    status: int | None = None
    done: bool = False
    errors: int = 0
    chunks: int = 0
    failure: str = ""

    @property
    def ok(self) -> bool:
        if self.failure or self.status != 200:
            return False
        return self.kind == "plain" or (self.done and self.errors == 0)


async def send(client: httpx.AsyncClient, url: str, model: str, content, session: str | None,
               stream: bool, rid: str | None = None, max_tokens: int = LOAD_TOKENS,
               messages: list | None = None, started: asyncio.Event | None = None) -> Outcome:
    """One chat request through ``url``; a transport failure is an outcome, not an error."""
    body = {"model": model, "max_tokens": max_tokens, "ignore_eos": True, "stream": stream,
            "messages": messages or [{"role": "user", "content": content}]}
    out = Outcome("stream" if stream else "plain")
    rid = rid or request_id()
    try:
        if not stream:
            r = await client.post(f"{url}{CHAT}", json=body, headers=headers(session, rid))
            out.status = r.status_code
            if r.status_code == 200 and not r.json().get("choices"):
                out.failure = f"no choices: {r.text[:200]}"
            elif r.status_code != 200:
                out.failure = r.text[:300]
            return out
        async with client.stream("POST", f"{url}{CHAT}", json=body,
                                 headers=headers(session, rid)) as r:
            out.status = r.status_code
            if r.status_code != 200:
                out.failure = (await r.aread()).decode(errors="replace")[:300]
                return out
            async for line in r.aiter_lines():
                event = data_event(line)
                out.done = out.done or event == DONE
                if isinstance(event, dict):
                    out.errors += "error" in event
                    out.chunks += 1
                    if started is not None:
                        started.set()
    except httpx.HTTPError as exc:
        out.failure = f"{type(exc).__name__}: {exc}"
    return out


async def owners(stack: Stack, sessions: list[str]) -> dict[str, int]:
    """Which replica each conversation key reaches now (one short request each)."""
    out = {}
    async with httpx.AsyncClient(timeout=60) as client:
        for session in sessions:
            rid = request_id()
            result = await send(client, stack.url, stack.model.name, "hi", session, False, rid,
                                max_tokens=1)
            assert result.ok, result
            await asyncio.sleep(0.05)  # the access record is written as the answer ends
            (out[session],) = stack.served_by(rid)
    return out


def engine_core(server: Server) -> psutil.Process:
    """The replica's engine process (vLLM names it ``VLLM::EngineCore``)."""
    children = psutil.Process(server.proc.pid).children(recursive=True)
    return next(p for p in children if p.name().startswith("VLLM::Engine"))


# --- affinity ------------------------------------------------------------------------------
async def test_a_conversation_stays_on_its_replica_and_hits_its_cache(stack):
    """Four turns with one X-Session-ID, re-sending their photos as chat clients do: every
    turn reaches the same replica, and from turn 2 on that replica's history-image cache hits
    (``phi3v_image_cache_lookups_total``), and so does vLLM's multimodal cache (the intake
    forwards a re-sent photo as the same bytes, ``serve.intake.cache``); the other replica
    sees none of it."""
    session = f"conv-{uuid.uuid4().hex[:8]}"
    new_photo = {1: image("chelsea.png"), 3: image("coffee.png")}  # re-sent on later turns
    messages: list[dict] = []
    served, hits = [], []
    async with httpx.AsyncClient(timeout=120) as client:
        for turn in range(1, 5):
            text = {"type": "text", "text": f"Turn {turn}: and now?"}
            messages.append({"role": "user",
                             "content": [new_photo[turn], text] if turn in new_photo else [text]})
            before = [cache_hits(s) for s in stack.replicas]
            rid = request_id()
            body = {"model": stack.model.name, "max_tokens": 4, "messages": messages}
            answer = await client.post(f"{stack.url}{CHAT}", json=body,
                                       headers=headers(session, rid))
            assert answer.status_code == 200, answer.text
            assert answer.headers["x-request-id"] == rid  # the router answers with ours
            messages.append({"role": "assistant",
                             "content": answer.json()["choices"][0]["message"]["content"]})
            await asyncio.sleep(0.05)
            served.append(stack.served_by(rid))
            hits.append([tuple(a - b for a, b in zip(cache_hits(s), was, strict=True))
                         for s, was in zip(stack.replicas, before, strict=True)])
    (home,) = served[0]
    assert all(s == {home} for s in served), served
    other = 2 if home == 1 else 1
    # turns 2-4 hit both caches: vLLM's and the history-image cache
    assert all(min(h[home - 1]) >= 1 for h in hits[1:]), hits
    assert all(h[other - 1] == (0, 0) for h in hits), hits


async def test_conversations_spread_over_both_replicas(stack):
    """Distinct conversation keys land on both replicas, each key always on the same one."""
    sessions = [f"spread-{i}" for i in range(12)]
    first = await owners(stack, sessions)
    assert set(first.values()) == {1, 2}, first
    assert await owners(stack, sessions[:4]) == {s: first[s] for s in sessions[:4]}


def limit_on_its_gauge(replica: Server, tries: int = 20) -> bool:
    """Whether ``replica``'s ``phi3v_max_num_seqs`` gauge shows its autotuner's limit. The
    autotuner may move the limit between two reads, so the gauge is read between two reads of
    its state and compared only when both give the same limit."""
    for _ in range(tries):
        before = httpx.get(f"{replica.base_url}/admin/autotuner", timeout=10).json()["limit"]
        gauge = replica.metric("phi3v_max_num_seqs")
        after = httpx.get(f"{replica.base_url}/admin/autotuner", timeout=10).json()["limit"]
        if before == after:
            return gauge == before
        time.sleep(0.2)
    raise AssertionError(f"the limit of {replica.base_url} never held still")


# --- per-replica admission, the queue KEDA reads ------------------------------------------
async def test_each_replica_keeps_its_own_limit_and_keda_sums_their_queues(stack):
    """A burst on one replica's conversations queues there only; each autotuner keeps its own
    limit (started at its own --admission-limit, shown by its own gauge); the ScaledObject's
    query, evaluated by promtool over both replicas' live scrapes, is the sum of their queues
    (phi3v_queued_requests: each replica's admission queue, phi3v_pending_requests, plus
    vLLM's waiting)."""
    by_replica = await owners(stack, [f"burst-{i}" for i in range(8)])
    busy, idle = 0, 1  # replica 1 gets the burst, replica 2 none of it
    keys = [k for k, i in by_replica.items() if i == busy + 1]
    assert keys, by_replica
    async with httpx.AsyncClient(timeout=300) as client:
        burst = [asyncio.create_task(send(client, stack.url, stack.model.name, "Tell a story.",
                                          keys[n % len(keys)], True, max_tokens=100))
                 for n in range(10)]
        for _ in range(200):
            await asyncio.sleep(0.1)
            samples = [await asyncio.to_thread(r.metrics) for r in stack.replicas]
            if stack.replicas[busy].metric("phi3v_pending_requests", scrape=samples[busy]) > 0:
                break
        states = [httpx.get(f"{r.base_url}/admin/autotuner", timeout=10).json()
                  for r in stack.replicas]
        results = await asyncio.gather(*burst)
    assert all(o.ok for o in results), [o for o in results if not o.ok]
    pending = [r.metric("phi3v_pending_requests", scrape=s)
               for r, s in zip(stack.replicas, samples, strict=True)]
    queued = [r.metric("phi3v_queued_requests", scrape=s)
              for r, s in zip(stack.replicas, samples, strict=True)]
    assert pending[busy] > 0 and pending[idle] == 0, pending
    assert all(q >= p for q, p in zip(queued, pending, strict=True)), (queued, pending)
    # Each autotuner is its replica's own: its start, its limit on its own gauge.
    assert [s["start"] for s in states] == list(START_LIMITS), states
    for r in stack.replicas:
        assert await asyncio.to_thread(limit_on_its_gauge, r)
    # KEDA: the ScaledObject's own query over both scrapes.
    api = yaml.safe_load_all((ROOT / "deploy" / "k8s" / "api.yaml").read_text())
    (scaled,) = [d for d in api if d and d["kind"] == "ScaledObject"]
    query = scaled["spec"]["triggers"][0]["metadata"]["query"]
    assert "phi3v_queued_requests" in query
    series = [{"series": f'phi3v_queued_requests{{job="phi3v", instance="replica-{i}"}}',
               "values": f"{q:g}"} for i, q in enumerate(queued, 1)]
    test = {"evaluation_interval": "1m",
            "tests": [{"interval": "1m", "input_series": series,
                       "promql_expr_test": [{"expr": query, "eval_time": "0m",
                                             "exp_samples": [{"labels": "{}",
                                                              "value": sum(queued)}]}]}]}
    path = ARTIFACTS / "keda-query-test.yml"
    path.write_text(yaml.safe_dump(test))
    promtool = shutil.which("promtool")
    assert promtool, "promtool missing: make system-deps"
    done = subprocess.run([promtool, "test", "rules", str(path)], capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stdout + done.stderr


# --- a lost engine -------------------------------------------------------------------------
async def test_a_killed_engine_leaves_the_ring_and_its_requests_go_to_the_other(stack):
    """kill -9 of replica 1's engine: its open streams end with one error event; requests
    sent after the kill, on its conversations too, are answered by replica 2; the router
    takes replica 1 out within seconds, and back once it has been restarted.

    A second router over the same replicas, whose health checks are too rare to notice,
    shows the retry alone: replica 1 refuses (503, then a refused connection), the router's
    one retry goes to replica 2."""
    lost = 1
    # The ring places keys by the replicas' addresses (free ports, a new pair each run): 8
    # keys all fell on one replica once, so probe 24 and keep at most 4 of each side.
    keys = await owners(stack, [f"lost-{i}" for i in range(24)])
    mine = [k for k, i in keys.items() if i == lost][:4]
    theirs = [k for k, i in keys.items() if i != lost][:4]
    assert mine and theirs, keys
    blind_port = free_port()
    blind_metrics = next(p for p in iter(free_port, None) if p != blind_port)
    blind = start_process(
        router_command(blind_port, [stack.worker(1), stack.worker(2)], blind_metrics,
                       overrides={"--health-check-interval-secs": "600"}),
        blind_port, ARTIFACTS / "router-blind.log", "/readiness", ready_timeout_s=60)
    try:
        async with httpx.AsyncClient(timeout=120) as client:
            started = [asyncio.Event() for _ in range(2)]
            streams = [asyncio.create_task(send(client, stack.url, stack.model.name,
                                                "A long story", mine[n % len(mine)], True,
                                                max_tokens=4000, started=started[n]))
                       for n in range(2)]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
            os.kill(engine_core(stack.replicas[lost - 1]).pid, signal.SIGKILL)
            t_kill = time.monotonic()
            # Sent once replica 1 knows its engine is gone (its /ready 503): through the
            # router, on its conversations and replica 2's, they are answered wherever the
            # conversation lived; through the blind router, replica 1 refuses them (503, a
            # refused connection once it has exited) and the one retry takes them to
            # replica 2.
            with contextlib.suppress(httpx.TransportError):
                while (await client.get(f"{stack.worker(lost)}/ready")).status_code == 200:
                    await asyncio.sleep(0.01)
            photo = [image("chelsea.png"), {"type": "text", "text": "?"}]
            after = [asyncio.create_task(send(client, stack.url, stack.model.name,
                                              photo if n % 2 else "hi", key, n % 3 == 0))
                     for n, key in enumerate(mine * 2 + theirs)]
            retried = [asyncio.create_task(send(client, blind.base_url, stack.model.name,
                                                "hi", key, bool(n % 2)))
                       for n, key in enumerate(mine * 2)]
            down_s = await stack.wait_router(lost, False, ROUTER_NOTICE_S)
            cut = await asyncio.gather(*streams)
            served = await asyncio.gather(*after)
            served_blind = await asyncio.gather(*retried)
        blind_retries = scraped(f"http://127.0.0.1:{blind_metrics}/metrics",
                                "vllm_router_retries_total")
    finally:
        stop_process(blind, 10)
    for o in cut:  # open streams on the lost replica: exactly one error event, no [DONE]
        assert o.status == 200 and o.errors == 1 and not o.done, o
    assert all(o.ok for o in served), [o for o in served if not o.ok]
    assert all(o.ok for o in served_blind), [o for o in served_blind if not o.ok]
    # Replica 1 refused the first ones (its breaker then kept the rest away): retried once.
    assert blind_retries >= 1, blind_retries
    # It exits non-zero, for its supervisor to restart it, saying why.
    gone = stack.replicas[lost - 1]
    assert await asyncio.to_thread(gone.proc.wait, 60) != 0
    assert time.monotonic() - t_kill < 25
    assert "engine lost" in gone.log_tail(200)
    print(f"router: replica {lost} down {down_s:.1f} s after the kill "
          f"({time.monotonic() - t_kill:.1f} s to the exit); router retries so far: "
          f"{stack.router_metric('vllm_router_retries_total'):g}")
    stack.start_replica(lost)
    up_s = await stack.wait_router(lost, True, ROUTER_NOTICE_S)
    print(f"router: replica {lost} back {up_s:.1f} s after its /ready 200")
    again = await owners(stack, mine)  # its conversations come back to it
    assert set(again.values()) == {lost}, again


# --- rolling restart -----------------------------------------------------------------------
async def test_rolling_restart_under_load_loses_nothing(stack):
    """Continuous mixed load (streams and plain answers, text and images, on conversations of
    both replicas) while each replica in turn gets SIGTERM, exits, and is started again: no
    request fails, every stream ends with [DONE] and no error event."""
    stop = asyncio.Event()
    results: list[Outcome] = []
    kinds = [("stream", "text"), ("plain", "image"), ("stream", "image"), ("plain", "text")]
    photo = [image("chelsea.png"), {"type": "text", "text": "What is it?"}]
    sessions = [f"roll-{i}" for i in range(10)]

    async def client_loop(n: int) -> None:
        rng = random.Random(n)
        async with httpx.AsyncClient(timeout=120) as client:
            k = n
            while not stop.is_set():
                kind, what = kinds[k % len(kinds)]
                k += 1
                results.append(await send(client, stack.url, stack.model.name,
                                          photo if what == "image" else "Say something.",
                                          rng.choice(sessions), kind == "stream"))

    loops = [asyncio.create_task(client_loop(n)) for n in range(2)]
    try:
        await asyncio.sleep(3)
        for i in (1, 2):
            served_before = len(results)
            server = stack.replicas[i - 1]
            os.kill(server.proc.pid, signal.SIGTERM)
            await stack.wait_router(i, False, ROUTER_NOTICE_S)
            assert await asyncio.to_thread(server.proc.wait, 60) == 0, server.log_tail()
            await asyncio.to_thread(stack.start_replica, i)
            await stack.wait_router(i, True, ROUTER_NOTICE_S)
            await asyncio.sleep(2)  # the restarted replica takes its share again
            assert len(results) > served_before  # the load went on meanwhile
        await asyncio.sleep(2)
    finally:
        stop.set()
        await asyncio.gather(*loops)
    failed = [o for o in results if not o.ok]
    streams = [o for o in results if o.kind == "stream"]
    print(f"rolling restart: {len(results)} requests ({len(streams)} streams), "
          f"{len(failed)} failed; router retries: "
          f"{stack.router_metric('vllm_router_retries_total'):g}")
    assert not failed, failed[:5]
    assert streams and all(o.done and o.errors == 0 for o in streams)
    assert {o.kind for o in results} == {"stream", "plain"}
