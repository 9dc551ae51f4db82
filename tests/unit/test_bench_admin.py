"""The benchmarks' live admission switch (``--bench-admin``): absent by default, behind the
API keys, a 400 naming the field for a bad body, and each mode as the limiter enforces it,
from the autotuner's boot state."""

from __future__ import annotations

import httpx
from prometheus_client import CollectorRegistry

from serve.admission.loop import OFF_LIMIT
from serve.admission.signals import Signals
from serve.app import Gateway
from serve.settings import Settings

PATH = "/admin/bench/admission"


def client(**settings) -> tuple[Gateway, httpx.AsyncClient]:
    gateway = Gateway(Settings(device="cpu", **settings), registry=CollectorRegistry())
    return gateway, httpx.AsyncClient(transport=httpx.ASGITransport(app=gateway),
                                      base_url="http://gw")


async def test_the_switch_is_off_unless_asked_for():
    _, c = client()
    async with c:
        r = await c.post(PATH, json={"mode": "off"})
    assert r.status_code == 404


async def test_the_switch_is_behind_the_api_keys():
    gateway, c = client(bench_admin=True, api_keys=["k1"])
    async with c:
        assert (await c.post(PATH, json={"mode": "off"})).status_code == 401
        r = await c.post(PATH, json={"mode": "off"}, headers={"Authorization": "Bearer k1"})
    assert r.status_code == 200 and gateway.admission.limiter.limit == OFF_LIMIT


async def test_a_bad_body_is_a_400_naming_the_field():
    gateway, c = client(bench_admin=True)
    before = gateway.admission.limiter.limit
    async with c:
        bad_mode = await c.post(PATH, json={"mode": "fast"})
        no_limit = await c.post(PATH, json={"mode": "static"})
        bool_limit = await c.post(PATH, json={"mode": "static", "limit": True})
        not_json = await c.post(PATH, content=b"{")
    assert bad_mode.status_code == 400 and bad_mode.json()["error"]["param"] == "mode"
    assert no_limit.status_code == 400 and no_limit.json()["error"]["param"] == "limit"
    assert bool_limit.status_code == 400 and bool_limit.json()["error"]["param"] == "limit"
    assert not_json.status_code == 400
    assert gateway.admission.limiter.limit == before  # nothing changed


async def test_each_mode_starts_from_the_boot_state():
    gateway, c = client(bench_admin=True, max_num_seqs=32)
    loop, feed = gateway.admission.loop, gateway.admission.feed
    start = loop.controller.start
    async with c:
        r = await c.post(PATH, json={"mode": "static", "limit": 3})
        assert r.status_code == 200 and r.json()["mode"] == "static"
        assert gateway.admission.limiter.limit == 3 and loop.mode == "static"
        loop.tick()  # a static tick holds the limit
        assert gateway.admission.limiter.limit == 3
        # What the traffic taught and what the controller decided is forgotten on a switch.
        feed.request_tokens.append(500)
        feed._prefill_rate, feed._prefill_rate_s = 9000.0, feed.clock()
        loop.mode = "auto"
        loop.controller.step(Signals(t=0, pending=5, in_flight=start, kv_cache_usage=0.99))
        assert loop.controller.limit != start and loop.controller.decisions
        r = await c.post(PATH, json={"mode": "auto"})
        assert r.json()["mode"] == "auto" and r.json()["decisions"] == []
        assert loop.controller.limit == start == gateway.admission.limiter.limit
        assert feed.mean_request_tokens is None and feed.prefill_tokens_per_s is None
        r = await c.post(PATH, json={"mode": "off"})
        assert r.json()["mode"] == "off" and loop.mode == "static"
        assert gateway.admission.limiter.limit == OFF_LIMIT
        assert gateway.admission.limiter.slots.burst_budget is None
