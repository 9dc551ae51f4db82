"""CORS on the real server (``serve.cors``): ``--allowed-origins`` with API keys on (the
session's ``gateway``). A browser's preflight is answered before auth, every answer to an
allowed origin carries one ``Access-Control-Allow-Origin`` (vLLM's own CORS layer is off its
app), and without ``--allowed-origins`` (the session's ``server``) no answer carries any CORS
header."""

from __future__ import annotations

import httpx
import pytest

from tests.helpers import GATEWAY_KEY as KEY
from tests.helpers import GATEWAY_ORIGIN as ALLOWED

OTHER = "http://evil.example"


@pytest.fixture(scope="module")
def cors_server(gateway):
    return gateway.server


def preflight(server, origin: str, path: str = "/v1/chat/completions") -> httpx.Response:
    return httpx.options(f"{server.base_url}{path}", timeout=30, headers={
        "Origin": origin, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})


def chat(server, headers: dict[str, str], **fields) -> httpx.Response:
    body = {"model": server.model, "max_tokens": 2,
            "messages": [{"role": "user", "content": "hi"}], **fields}
    return httpx.post(f"{server.base_url}/v1/chat/completions", json=body, headers=headers,
                      timeout=120)


def allow_origin(response: httpx.Response) -> list[str]:
    """Every ``Access-Control-Allow-Origin`` value (a browser refuses more than one)."""
    return response.headers.get_list("access-control-allow-origin")


def test_preflight_from_an_allowed_origin_is_not_a_401(cors_server):
    for path in ("/v1/chat/completions", "/v1/models", "/limits"):
        r = preflight(cors_server, ALLOWED, path)
        assert r.status_code == 200, (path, r.status_code, r.text)
        assert allow_origin(r) == [ALLOWED]
        assert r.headers["access-control-allow-headers"] == "authorization, content-type"
    refused = preflight(cors_server, OTHER)
    assert refused.status_code == 400 and allow_origin(refused) == []


def test_requests_from_an_allowed_origin_still_need_the_key(cors_server):
    origin = {"Origin": ALLOWED}
    ok = chat(cors_server, {**origin, "Authorization": f"Bearer {KEY}"})
    assert ok.status_code == 200, ok.text
    assert ok.json()["choices"][0]["message"]["content"] is not None
    no_key = chat(cors_server, origin)
    assert no_key.status_code == 401 and no_key.json()["error"]["code"] == "invalid_api_key"
    models = httpx.get(f"{cors_server.base_url}/v1/models", timeout=30,
                       headers={**origin, "Authorization": f"Bearer {KEY}"})
    assert models.status_code == 200
    with httpx.stream("POST", f"{cors_server.base_url}/v1/chat/completions", timeout=120,
                      headers={**origin, "Authorization": f"Bearer {KEY}"},
                      json={"model": cors_server.model, "max_tokens": 2, "stream": True,
                            "messages": [{"role": "user", "content": "hi"}]}) as streamed:
        text = streamed.read().decode()
    assert streamed.status_code == 200 and "data: [DONE]" in text
    for r in (ok, no_key, models, streamed):
        assert allow_origin(r) == [ALLOWED], r.request.url
    assert "X-Request-Id" in ok.headers["access-control-expose-headers"]
    other = chat(cors_server, {"Origin": OTHER, "Authorization": f"Bearer {KEY}"})
    assert other.status_code == 200 and allow_origin(other) == []


def test_without_allowed_origins_no_answer_carries_cors_headers(server):
    answers = [preflight(server, ALLOWED), chat(server, {"Origin": ALLOWED}),
               httpx.get(f"{server.base_url}/v1/models", headers={"Origin": ALLOWED},
                         timeout=30)]
    assert answers[0].status_code != 200 and answers[1].status_code == 200
    for r in answers:
        assert not [h for h in r.headers if h.startswith("access-control-")], r.headers
