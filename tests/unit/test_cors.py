"""CORS (``serve.cors``) on the gateway in-process, no engine: a scripted peer stands where
vLLM's app would, behind the real request layers. Preflights are answered in front of auth,
every answer to an allowed origin carries one ``Access-Control-Allow-Origin`` (refusals of
ours included), and without ``--allowed-origins`` nothing changes. Also: vLLM's own
``CORSMiddleware`` is taken off its app (``serve.engine.drop_cors_middleware``)."""

from __future__ import annotations

import asyncio
import json

import httpx
from fastapi import FastAPI
from prometheus_client import CollectorRegistry
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import JSONResponse

from serve.app import Gateway, Phase, compose
from serve.engine import drop_cors_middleware
from serve.settings import Settings

ALLOWED, OTHER = "http://app.example", "http://evil.example"
KEY = {"Authorization": "Bearer k"}
CHAT = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}


def gateway(peer=None, **settings) -> Gateway:
    """A ready gateway with API key ``k`` whose vLLM app is ``peer`` (default: an answer
    echoing the body it received) behind the real request layers."""
    async def echo(scope, receive, send):
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        await JSONResponse({"received": json.loads(body or b"null")})(scope, receive, send)

    settings = {"device": "cpu", "api_keys": ["k"], "allowed_origins": [ALLOWED], **settings}
    app = Gateway(Settings(**settings), registry=CollectorRegistry())
    app.state.openai_app = compose(peer or echo, app.request_layers())
    app.state.phase = Phase.READY
    return app


def client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")


def preflight(origin: str, method: str = "POST") -> dict[str, str]:
    return {"Origin": origin, "Access-Control-Request-Method": method,
            "Access-Control-Request-Headers": "authorization, content-type"}


def allow_origin(response: httpx.Response) -> list[str]:
    """Every ``Access-Control-Allow-Origin`` value of ``response`` (a browser takes one)."""
    return response.headers.get_list("access-control-allow-origin")


async def test_a_preflight_is_answered_before_auth_on_every_route():
    app = gateway()
    async with client(app) as c:
        for path in ("/v1/chat/completions", "/v1/responses", "/v1/models", "/limits",
                     "/health"):
            r = await c.options(path, headers=preflight(ALLOWED))
            assert r.status_code == 200, (path, r.text)
            assert allow_origin(r) == [ALLOWED]
            assert "POST" in r.headers["access-control-allow-methods"]
            assert r.headers["access-control-allow-headers"] == "authorization, content-type"
        refused = await c.options("/v1/chat/completions", headers=preflight(OTHER))
    assert refused.status_code == 400 and allow_origin(refused) == []
    counted = app.metrics.http_responses.labels(route="/v1/chat/completions", code="200")
    assert counted._value.get() == 1  # a preflight is counted like every answer


async def test_answers_to_an_allowed_origin_carry_the_headers_once_refusals_included():
    async with client(gateway()) as c:
        ok = await c.post("/v1/chat/completions", json=CHAT,
                          headers={**KEY, "Origin": ALLOWED})
        no_key = await c.post("/v1/chat/completions", json=CHAT, headers={"Origin": ALLOWED})
        refused = await c.post("/v1/chat/completions", json={**CHAT, "n": 5},
                               headers={**KEY, "Origin": ALLOWED})
        closed = await c.post("/tokenize", json={}, headers={**KEY, "Origin": ALLOWED})
        limits = await c.get("/limits", headers={**KEY, "Origin": ALLOWED})
        other = await c.post("/v1/chat/completions", json=CHAT,
                             headers={**KEY, "Origin": OTHER})
        plain = await c.post("/v1/chat/completions", json=CHAT, headers=KEY)
    assert ok.status_code == 200 and ok.json()["received"]["messages"]
    assert no_key.status_code == 401 and no_key.json()["error"]["code"] == "invalid_api_key"
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "n"
    assert closed.status_code == 404 and limits.status_code == 200
    for r in (ok, no_key, refused, closed, limits):
        assert allow_origin(r) == [ALLOWED], r.request.url
        assert "Origin" in r.headers["vary"]
    assert "X-Request-Id" in ok.headers["access-control-expose-headers"]
    # Another origin, and a client that is no browser, are served without the header.
    assert other.status_code == 200 and allow_origin(other) == []
    assert plain.status_code == 200 and allow_origin(plain) == []


async def test_a_503_and_a_429_of_ours_carry_the_headers():
    release = asyncio.Event()

    async def held(scope, receive, send):
        await release.wait()
        await JSONResponse({})(scope, receive, send)

    app = gateway(held, admission_limit=1, autotune="static", max_queue=0)
    headers = {**KEY, "Origin": ALLOWED}
    async with client(app) as c:
        first = asyncio.create_task(c.post("/v1/chat/completions", json=CHAT, headers=headers))
        while app.admission.limiter.in_flight == 0:
            await asyncio.sleep(0.01)
        full = await c.post("/v1/chat/completions", json=CHAT, headers=headers)
        release.set()
        assert (await first).status_code == 200
        app.state.phase = Phase.STARTING
        booting = await c.post("/v1/chat/completions", json=CHAT, headers=headers)
    assert full.status_code == 429 and allow_origin(full) == [ALLOWED]
    assert "Retry-After" in full.headers["access-control-expose-headers"]
    assert booting.status_code == 503 and allow_origin(booting) == [ALLOWED]


async def test_without_allowed_origins_there_is_no_cors():
    async with client(gateway(allowed_origins=[])) as c:
        pre = await c.options("/v1/chat/completions", headers=preflight(ALLOWED))
        ok = await c.post("/v1/chat/completions", json=CHAT, headers={**KEY, "Origin": ALLOWED})
    assert pre.status_code == 401  # as before: the preflight carries no key
    assert ok.status_code == 200
    assert not [h for r in (pre, ok) for h in r.headers if h.startswith("access-control-")]


async def test_vllm_cors_middleware_is_taken_off_its_app():
    """vLLM adds Starlette's ``CORSMiddleware`` from ``--allowed-origins``: left on, an answer
    would carry a second ``Access-Control-Allow-Origin`` below the gateway's."""
    app = FastAPI()
    app.add_api_route("/v1/models", lambda: {"data": []}, methods=["GET"])
    app.add_middleware(CORSMiddleware, allow_origins=["*"], allow_methods=["*"])
    app.middleware_stack = app.build_middleware_stack()  # built already, as vLLM leaves it
    async with client(app) as c:
        before = await c.get("/v1/models", headers={"Origin": ALLOWED})
    assert drop_cors_middleware(app) == 1
    assert drop_cors_middleware(app) == 0  # idempotent
    async with client(app) as c:
        after = await c.get("/v1/models", headers={"Origin": ALLOWED})
    assert allow_origin(before) == ["*"]
    assert after.status_code == 200 and allow_origin(after) == []
