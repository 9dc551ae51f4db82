"""Protocol edge cases clients hit, on the real server (session fixture)."""

from __future__ import annotations

import httpx

from tests.conftest import IMAGES, data_url


def chat(server, **extra) -> dict:
    return {"model": server.model, "messages": [{"role": "user", "content": "Hello there"}],
            **extra}


def test_event_streams_are_not_buffered_by_proxies(server):
    with httpx.stream("POST", f"{server.base_url}/v1/chat/completions", timeout=60,
                      json=chat(server, max_tokens=4, stream=True)) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["cache-control"] == "no-cache"
        assert r.headers["x-accel-buffering"] == "no"
        r.read()


def test_errors_name_max_completion_tokens(server):
    r = httpx.post(f"{server.base_url}/v1/chat/completions", timeout=60,
                   json=chat(server, max_completion_tokens=9000))
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "max_completion_tokens" and "max_completion_tokens" in err["message"]


def test_image_detail_null_is_the_default_and_bad_values_name_the_field(server):
    url = data_url(IMAGES / "chelsea.png")

    def with_detail(detail):
        return chat(server, max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": url, "detail": detail}},
            {"type": "text", "text": "What is it?"}]}])

    assert httpx.post(f"{server.base_url}/v1/chat/completions", timeout=60,
                      json=with_detail(None)).status_code == 200
    bad = httpx.post(f"{server.base_url}/v1/chat/completions", timeout=60,
                     json=with_detail("ultra"))
    assert bad.status_code == 400
    err = bad.json()["error"]
    assert err["type"] == "invalid_request_error"
    assert err["param"] == "messages[0].content[0].image_url.detail"


def test_pixel_cap_refusal_names_our_limit(server):
    limits = httpx.get(f"{server.base_url}/limits", timeout=10).json()
    r = httpx.post(f"{server.base_url}/v1/chat/completions", timeout=60, json=chat(
        server, max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": data_url(IMAGES / "bomb_14000.png")}}]}]))
    assert r.status_code == 413
    message = r.json()["error"]["message"]
    assert str(limits["max_image_pixels"]) in message and "178956970" not in message
