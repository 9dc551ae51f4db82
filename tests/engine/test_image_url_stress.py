"""``--image-urls`` under a burst: one valid URL among 13 that hang or drip, sent together,
round after round. The valid request is answered every time; each bad one gets its own
documented 400 (the fetch deadline, naming the field); nothing is a 5xx."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from tests.helpers import IMAGES, ImagePeer, start_server, stop_server

DEADLINE_S = 1.5
#: How long the rounds run (each takes about the deadline).
STRESS_S = 25.0
FIELD = "messages[0].content[0].image_url"


@pytest.fixture(scope="module")
def peer():
    server = ImagePeer((IMAGES / "chelsea.png").read_bytes())
    yield server.base
    server.close()


@pytest.fixture(scope="module")
def url_server():
    srv = start_server(["--image-urls", "--image-url-allowlist", json.dumps(["127.0.0.2"]),
                        "--image-url-allowed-networks", json.dumps(["127.0.0.2/32"]),
                        "--image-url-timeout-s", str(DEADLINE_S)], name="image-url-stress")
    yield srv
    stop_server(srv)


async def ask(client: httpx.AsyncClient, srv, url: str, stream: bool) -> tuple[int, str]:
    body = {"model": srv.model, "max_tokens": 2, "stream": stream, "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                     {"type": "text", "text": "What is this?"}]}]}
    async with client.stream("POST", f"{srv.base_url}/v1/chat/completions", json=body) as r:
        return r.status_code, (await r.aread()).decode()


async def test_a_valid_url_among_hanging_and_dripping_ones(url_server, peer):
    srv = url_server
    errors_before = srv.metric("phi3v_http_responses_total",
                               {"route": "/v1/chat/completions", "code": "500"})
    rounds = 0
    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=64)) as client:
        end = time.monotonic() + STRESS_S
        while time.monotonic() < end or rounds < 5:
            # The valid one (non-streaming) first, the others right behind it; half of those
            # streaming. Query strings keep every URL distinct.
            jobs = [ask(client, srv, f"{peer}/img.png?{rounds}", stream=False)]
            jobs += [ask(client, srv, f"{peer}/{'hang' if i % 2 else 'drip'}/{rounds}-{i}",
                         stream=i % 4 < 2) for i in range(13)]
            (status, text), *bad = await asyncio.gather(*jobs)
            assert status == 200, (rounds, status, text[:300])
            assert json.loads(text)["choices"][0]["finish_reason"], text[:300]
            for code, text in bad:
                assert code == 400, (rounds, code, text[:300])
                error = json.loads(text)["error"]
                assert error["param"] == FIELD, error
                assert error["message"] == f"image URL did not deliver within {DEADLINE_S:g} s"
            rounds += 1
    assert srv.metric("phi3v_http_responses_total",
                      {"route": "/v1/chat/completions", "code": "500"}) == errors_before
