"""Life cycle on the real tiny engine: SIGTERM drains (``serve.lifecycle``, ``Gateway.drain``);
a frozen engine (``Gateway.watch_engine``) is detected, its work refused, and the server exits
for its supervisor to restart it.

Checked where a test starts a server anyway (a start costs ~30 s here): a quiet server's
SIGTERM in ``test_cli_live``; a killed engine (``kill -9``) in ``test_replicas``, whose lost
replica refuses work, ends its open streams with one error event and exits non-zero."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time

import httpx
import psutil

from serve.sse import DONE, data_event
from tests.helpers import start_server, stop_server

DRAIN_S = 12
#: Answer tokens of the stream that must finish inside the grace (3-10 ms a token here).
SHORT_TOKENS = 400


def chat(model: str, max_tokens: int, stream: bool) -> dict:
    return {"model": model, "max_tokens": max_tokens, "stream": stream, "ignore_eos": True,
            "messages": [{"role": "user", "content": "Tell me a long story."}]}


async def stream(client, srv, max_tokens: int) -> dict:
    """One streamed chat: status, whether it ended with [DONE], the error events seen."""
    out = {"status": None, "done": False, "errors": 0, "chunks": 0}
    async with client.stream("POST", f"{srv.base_url}/v1/chat/completions",
                             json=chat(srv.model, max_tokens, True)) as r:
        out["status"] = r.status_code
        async for line in r.aiter_lines():
            event = data_event(line)
            out["done"] = out["done"] or event == DONE
            if isinstance(event, dict):
                out["errors"] += "error" in event
                out["chunks"] += 1
    return out


async def test_sigterm_drains_running_requests_refuses_new_ones_and_exits_0():
    srv = start_server(["--drain-timeout-s", str(DRAIN_S), "--autotune", "static",
                        "--admission-limit", "4", "--engine-queue", "0"], name="drain-server")
    try:
        async with httpx.AsyncClient(timeout=120) as client:

            async def wait_for(in_flight: int, pending: int) -> dict:
                deadline = time.monotonic() + 30
                while time.monotonic() < deadline:
                    state = (await client.get(f"{srv.base_url}/admin/autotuner")).json()
                    if (state["in_flight"], state["pending"]) == (in_flight, pending):
                        return state
                    await asyncio.sleep(0.05)
                raise AssertionError(f"never {in_flight} running and {pending} queued: {state}")

            long_streams = [asyncio.create_task(stream(client, srv, 4000)) for _ in range(2)]
            long_plain = asyncio.create_task(client.post(
                f"{srv.base_url}/v1/chat/completions", json=chat(srv.model, 4000, False)))
            # Running at SIGTERM, done well within the grace (~4 s at this machine's pace).
            short_stream = asyncio.create_task(stream(client, srv, SHORT_TOKENS))
            await wait_for(4, 0)
            queued = [asyncio.create_task(client.post(f"{srv.base_url}/v1/chat/completions",
                                                      json=chat(srv.model, 8, False)))
                      for _ in range(2)]
            await wait_for(4, 2)

            os.kill(srv.proc.pid, signal.SIGTERM)
            t_term = time.monotonic()
            await asyncio.sleep(0.3)
            # At once: not ready, still alive, new and queued work refused with Retry-After.
            ready = await client.get(f"{srv.base_url}/ready")
            assert ready.status_code == 503 and ready.json()["phase"] == "draining"
            assert (await client.get(f"{srv.base_url}/health")).status_code == 200
            metrics = (await client.get(f"{srv.base_url}/metrics")).text
            assert "phi3v_ready 0.0" in metrics
            new = await client.post(f"{srv.base_url}/v1/chat/completions",
                                    json=chat(srv.model, 8, False))
            assert new.status_code == 503 and new.headers["retry-after"]
            for task in queued:
                refused = await task
                assert refused.status_code == 503 and refused.headers["retry-after"]
                assert refused.json()["error"]["type"] == "service_unavailable"

            short = await short_stream  # shorter than the grace: finishes normally
            assert short["done"] and short["errors"] == 0 and short["chunks"] > 0
            for task in long_streams:  # longer: exactly one error event, no [DONE]
                cut = await task
                assert cut["status"] == 200 and cut["errors"] == 1 and not cut["done"], cut
            plain = await long_plain
            assert plain.status_code == 503 and plain.headers["retry-after"]
            assert time.monotonic() - t_term < DRAIN_S + 5
        assert srv.proc.wait(30) == 0, srv.log_tail()
        assert time.monotonic() - t_term < DRAIN_S + 20
        log = srv.log_tail(200)
        assert "draining" in log and "3 requests cut" in log, log
    finally:
        stop_server(srv)


def engine_core(srv) -> psutil.Process:
    """The server's engine process, found by its title (vLLM names it ``VLLM::EngineCore``)."""
    children = psutil.Process(srv.proc.pid).children(recursive=True)
    return next(p for p in children if p.name().startswith("VLLM::Engine"))


async def test_a_frozen_engine_is_detected_refuses_work_and_exits_nonzero():
    """SIGSTOP of the engine process: after ``--engine-stall-timeout-s`` with work in it and
    no step, the gateway treats it as lost: the queued request is refused (503, not a 500,
    not a hang), the running stream ends with one error event, and the process exits
    non-zero."""
    srv = start_server(["--autotune", "static", "--admission-limit", "1", "--engine-queue", "0",
                        "--engine-stall-timeout-s", "3"], name="engine-frozen")
    core = None
    try:
        async with httpx.AsyncClient(timeout=60) as client:
            running = asyncio.create_task(stream(client, srv, 4000))
            await asyncio.sleep(1.0)
            queued = asyncio.create_task(client.post(f"{srv.base_url}/v1/chat/completions",
                                                     json=chat(srv.model, 8, False)))
            await asyncio.sleep(0.5)
            core = engine_core(srv)
            os.kill(core.pid, signal.SIGSTOP)
            t0 = time.monotonic()
            refused = await queued  # refused, not 500, not hanging
            assert refused.status_code == 503 and refused.headers["retry-after"], refused.text
            assert refused.json()["error"]["type"] == "service_unavailable"
            cut = await running  # exactly one error event, no [DONE]
            assert cut["errors"] == 1 and not cut["done"], cut
            try:
                health = await client.get(f"{srv.base_url}/health")
                new = await client.post(f"{srv.base_url}/v1/chat/completions",
                                        json=chat(srv.model, 8, False))
                assert health.status_code == 503
                assert new.status_code == 503 and new.headers["retry-after"]
            except httpx.TransportError:
                pass  # already gone: the process exits right after
        code = srv.proc.wait(30)
        assert code != 0, srv.log_tail()  # for the supervisor to restart it
        assert time.monotonic() - t0 < 25
        assert "engine lost" in srv.log_tail(200)
    finally:
        if core is not None:
            with contextlib.suppress(psutil.Error):
                core.resume()
        stop_server(srv)
