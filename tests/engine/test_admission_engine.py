"""Admission control and the autotuner against the real tiny engine (CPU)."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from tests.helpers import start_server, stop_server

STATIC_LIMIT = 2
CEILING = 6


@pytest.fixture(scope="module")
def static_server():
    """A second server: static limit 2, tiny queue, lenient SLO (every completion is goodput)."""
    srv = start_server([
        "--autotune", "static", "--admission-limit", str(STATIC_LIMIT),
        "--max-num-seqs", str(CEILING), "--max-queue", "2", "--max-queue-wait-s", "6",
        "--slo-ttft-s", "100", "--slo-itl-s", "50", "--autotune-interval-s", "0.5",
    ], name="static-server")
    yield srv
    stop_server(srv)


def body(server, max_tokens: int, text: str = "Tell me a story.", stream: bool = True) -> dict:
    return {"model": server.model, "max_tokens": max_tokens, "ignore_eos": True,
            "stream": stream, "messages": [{"role": "user", "content": text}]}


async def drain(client: httpx.AsyncClient, server, max_tokens: int) -> httpx.Response:
    """A streamed request read to the end; returns the response (body consumed)."""
    async with client.stream("POST", f"{server.base_url}/v1/chat/completions",
                             json=body(server, max_tokens)) as r:
        async for _ in r.aiter_bytes():
            pass
    return r


async def test_running_never_exceeds_static_limit(static_server):
    srv = static_server
    samples: list[tuple[float, float]] = []
    async with httpx.AsyncClient(timeout=120) as client:
        # 4 long answers at once: 2 run, 2 queue (max_queue=2). Sample for a few seconds, then
        # the clients leave (which frees the slots), whatever the machine's speed.
        tasks = [asyncio.create_task(drain(client, srv, 4000)) for _ in range(4)]
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline or len(samples) < 10:
            scrape = await asyncio.to_thread(srv.metrics)
            samples.append((srv.metric("vllm:num_requests_running", scrape=scrape),
                            srv.metric("phi3v_running_requests", scrape=scrape)))
            await asyncio.sleep(0.02)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    assert max(engine for engine, _ in samples) == STATIC_LIMIT, samples
    assert all(engine <= STATIC_LIMIT and ours <= STATIC_LIMIT for engine, ours in samples)


async def wait_until(probe, timeout_s: float = 30.0, what: str = "condition") -> None:
    """Await ``probe()`` until it is truthy; fail after ``timeout_s`` seconds."""
    deadline = time.monotonic() + timeout_s
    while not await probe():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


async def test_exporter_series_after_known_sequence(static_server):
    srv = static_server
    m, am = srv.metric, srv.ametric
    before = {
        "finished": m("phi3v_finished_requests_total"),
        "goodput": m("phi3v_goodput_requests_total"),
        "full": m("phi3v_rejected_requests_total", {"reason": "queue_full"}),
        "timeout": m("phi3v_rejected_requests_total", {"reason": "queue_timeout"}),
        "waits": m("phi3v_queue_wait_seconds_count"),
        "static": m("phi3v_autotuner_decisions_total", {"direction": "hold", "reason": "static"}),
    }
    assert m("phi3v_max_num_seqs") == STATIC_LIMIT
    assert m("phi3v_max_num_seqs_ceiling") == CEILING
    assert m("phi3v_slo_ttft_seconds") == 100 and m("phi3v_slo_itl_seconds") == 50
    assert m("phi3v_autotuner_auto_mode") == 0
    text = httpx.get(f"{srv.base_url}/metrics").text
    assert "phi3v_gpu_utilization_ratio" not in text  # CPU: unavailable, not a fake 0

    async def running_is(n):
        return await am("phi3v_running_requests") == n

    async with httpx.AsyncClient(timeout=120) as client:
        # 2 long holders fill the limit, 2 short requests queue, a 5th is refused (queue full);
        # then the holders' clients leave (disconnect frees their slots) and the queued run.
        holders = [asyncio.create_task(drain(client, srv, 8000)) for _ in range(2)]
        await wait_until(lambda: running_is(2), what="2 running")
        queued = [asyncio.create_task(drain(client, srv, 4)) for _ in range(2)]

        async def two_pending():
            return await am("phi3v_pending_requests") == 2
        await wait_until(two_pending, what="2 pending")
        refused = await client.post(f"{srv.base_url}/v1/chat/completions",
                                    json=body(srv, 4, stream=False))
        assert refused.status_code == 429
        assert refused.headers["X-Phi3v-Reject-Reason"] == "queue_full"
        assert int(refused.headers["Retry-After"]) >= 1
        err = refused.json()["error"]
        assert err["type"] == "rate_limit_exceeded" and "max_queue=2" in err["message"]
        for h in holders:
            h.cancel()
        results = await asyncio.gather(*queued)
        assert [r.status_code for r in results] == [200, 200]

        # Queue timeout: hold both slots longer than max_queue_wait_s (6 s). An idle 2-core
        # machine decodes the tiny model at ~250 tokens/s per sequence: 8000 tokens outlast it.
        holders = [asyncio.create_task(drain(client, srv, 8000)) for _ in range(2)]
        await wait_until(lambda: running_is(2), what="2 running")
        t0 = time.monotonic()
        late = await client.post(f"{srv.base_url}/v1/chat/completions",
                                 json=body(srv, 4, stream=False))
        waited = time.monotonic() - t0
        assert late.status_code == 429
        assert late.headers["X-Phi3v-Reject-Reason"] == "queue_timeout"
        assert 5.9 <= waited < 12
        for h in holders:
            h.cancel()
        await asyncio.gather(*holders, return_exceptions=True)

    await wait_until(lambda: running_is(0), timeout_s=5, what="slots released")
    assert m("phi3v_pending_requests") == 0
    # Only the 2 queued requests completed (holders were abandoned by their clients).
    assert m("phi3v_finished_requests_total") - before["finished"] == 2
    assert m("phi3v_goodput_requests_total") - before["goodput"] == 2
    assert m("phi3v_rejected_requests_total", {"reason": "queue_full"}) - before["full"] == 1
    assert m("phi3v_rejected_requests_total", {"reason": "queue_timeout"}) - before["timeout"] == 1
    # Every admitted or refused request observed one queue wait: 4 holders, 2 queued, 2 refused.
    assert m("phi3v_queue_wait_seconds_count") - before["waits"] == 8
    assert m("phi3v_autotuner_decisions_total",
             {"direction": "hold", "reason": "static"}) > before["static"]
    state = httpx.get(f"{srv.base_url}/admin/autotuner").json()
    assert state["mode"] == "static" and state["limit"] == STATIC_LIMIT
    assert state["decisions"] and state["decisions"][-1]["reason"] == "static"


async def test_autotuner_raises_limit_and_admission_follows(server):
    """Session server (mode auto, start limit 8): under queued demand with latency headroom
    the limit goes up; the new limit shows on /metrics and in admission within one interval."""
    m = server.ametric
    state = httpx.get(f"{server.base_url}/admin/autotuner").json()
    interval = state["interval_s"]
    start_limit = int(await m("phi3v_max_num_seqs"))
    # The KV-safe capacity is computed from the engine's real KV cache (131,072 tokens on
    # CPU: far more than 32 image requests), while the explicit --admission-limit is kept.
    assert await m("phi3v_kv_safe_seqs") == state["config"]["ceiling"] == 32
    assert state["start"] == 8
    total = start_limit + 8
    async with httpx.AsyncClient(timeout=300) as client:
        # Long answers keep the queue non-empty over several autotuner intervals even on an
        # idle machine (~250 tokens/s per sequence).
        tasks = [asyncio.create_task(drain(client, server, 4000)) for _ in range(total)]
        deadline = time.monotonic() + 60
        raised_at = None
        while time.monotonic() < deadline:
            limit = await m("phi3v_max_num_seqs")
            if limit > start_limit:
                raised_at = time.monotonic()
                break
            await asyncio.sleep(0.1)
        assert raised_at is not None, "the autotuner never raised the limit under demand"
        decisions = httpx.get(f"{server.base_url}/admin/autotuner").json()["decisions"]
        ups = [d for d in decisions if d["direction"] == "up"]
        # (another step may have followed the one observed: any up step reached `limit`)
        assert any(d["reason"] == "demand" and d["new_limit"] == limit for d in ups), ups
        # Admission follows within one interval: more requests in flight than the old limit.
        admitted = None
        while time.monotonic() - raised_at < interval + 0.5:
            if await m("phi3v_running_requests") > start_limit:
                admitted = time.monotonic() - raised_at
                break
            await asyncio.sleep(0.05)
        assert admitted is not None, "a raised limit did not admit queued requests"
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def test_the_intake_estimates_prompts_as_vllm_counts_them(server):
    """The prompt estimate a burst's budget counts: image tokens as vLLM counts them, text
    close to it (usage.prompt_tokens of the real engine)."""
    import base64
    import io
    import random

    from PIL import Image
    from transformers import AutoTokenizer

    from bench.cpu_engine import prompt_text
    from serve.intake.budget import PromptBudget
    from serve.intake.request import RequestLimits, parse_chat_request
    from tests.helpers import ensure_tiny_model

    crops = httpx.get(f"{server.base_url}/admin/autotuner", timeout=10).json()[
        "kv_capacity"]["num_crops"]  # the server's num_crops, as vLLM counts with it
    budget = PromptBudget(AutoTokenizer.from_pretrained(ensure_tiny_model()), 8192, crops)
    buf = io.BytesIO()
    Image.new("RGB", (1000, 700), (90, 140, 200)).save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    rng = random.Random(5)
    for images in (0, 1):
        text = prompt_text(rng, 400)
        content = [{"type": "image_url", "image_url": {"url": url}}] * images + [
            {"type": "text", "text": text}]
        payload = {"model": server.model, "max_tokens": 1,
                   "messages": [{"role": "user", "content": content}]}
        usage = httpx.post(f"{server.base_url}/v1/chat/completions", json=payload,
                           timeout=120).json()["usage"]
        request = parse_chat_request(payload, RequestLimits(max_images=4))
        estimate = budget.estimate(request, [(1000, 700)] * images)
        text_only = budget.count(request, [(1000, 700)] * images).text
        assert abs(estimate - usage["prompt_tokens"]) <= 0.15 * text_only + 8, (estimate, usage)


async def test_a_burst_at_an_idle_server_is_admitted_by_its_predicted_prefill():
    """Mode auto: a burst of long prompts (4,000 tokens) at an idle server with a tight TTFT
    target (0.25 s). The first is always admitted (an empty backlog admits anything); the
    rest enter while the predicted prefill admitted before them plus their own fits the
    target, and, where the boot probes predict a prompt alone in time but behind the others
    late, some are refused at once (429, reason ``slo``). Once the burst is answered, nothing
    is left in the prefill backlog."""
    import random

    from bench.cpu_engine import prompt_text

    rng = random.Random(0)
    target = 0.25
    srv = start_server(["--max-num-seqs", "8", "--slo-ttft-s", str(target),
                        "--autotune-interval-s", "0.5", "--max-queue-wait-s", "60"],
                       name="burst-budget-server")

    def state() -> dict:
        return httpx.get(f"{srv.base_url}/admin/autotuner", timeout=10).json()

    async def one(client) -> tuple[int, str | None]:
        body = {"model": srv.model, "max_tokens": 2, "ignore_eos": True, "stream": True,
                "messages": [{"role": "user", "content": prompt_text(rng, 4000)}]}
        async with client.stream("POST", f"{srv.base_url}/v1/chat/completions",
                                 json=body) as r:
            async for _ in r.aiter_bytes():
                pass
        return r.status_code, r.headers.get("X-Phi3v-Reject-Reason")

    try:
        prefill = state()["prefill"]
        assert prefill["active"] and prefill["costs"]["token_s"] > 0, prefill
        await asyncio.sleep(1.5)  # the autotuner has seen the server idle
        async with httpx.AsyncClient(timeout=300) as client:
            answers = await asyncio.gather(*(one(client) for _ in range(8)))
        codes = [code for code, _ in answers]
        assert 200 in codes, answers
        assert set(codes) <= {200, 429}, answers
        assert all(reason == "slo" for code, reason in answers if code == 429), answers
        # Where the probes' costs make the outcome certain, it is what they predict.
        cost = prefill["margin"] * prefill["costs"]["token_s"] * 4000
        if cost < 0.8 * target and 8 * cost > 1.5 * target:
            assert codes.count(429) >= 1, (answers, prefill)
        deadline = time.monotonic() + 30
        while (p := state()["prefill"])["requests"]:
            assert time.monotonic() < deadline, p
            await asyncio.sleep(0.25)
        assert p["backlog_s"] == 0, p
    finally:
        stop_server(srv)


async def test_the_boot_probes_measure_the_prefill_and_the_backlog_drains(server, images):
    """The session server (mode auto) measured its engine's prefill costs at boot
    (``serve.admission.probe``): a prompt token and a step cost time. Requests join the
    prefill backlog when admitted and leave it by their first token: once a photo and
    a few chats are answered, nothing is left in it."""
    from tests.helpers import data_url

    prefill = httpx.get(f"{server.base_url}/admin/autotuner", timeout=10).json()["prefill"]
    costs = prefill["costs"]
    assert prefill["active"] and costs is not None
    assert costs["token_s"] > 0 and costs["step_s"] + costs["image_token_s"] >= 0
    photo = {"model": server.model, "max_tokens": 8, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(images / "astronaut.png")}},
        {"type": "text", "text": "What is it?"}]}]}
    async with httpx.AsyncClient(timeout=300) as client:
        answers = await asyncio.gather(
            client.post(f"{server.base_url}/v1/chat/completions", json=photo),
            *[client.post(f"{server.base_url}/v1/chat/completions",
                          json=body(server, 8, stream=stream)) for stream in (True, False) * 2])
    assert [a.status_code for a in answers] == [200] * 5
    prefill = httpx.get(f"{server.base_url}/admin/autotuner", timeout=10).json()["prefill"]
    assert prefill["requests"] == 0 and prefill["backlog_s"] == 0 and prefill["active"]
