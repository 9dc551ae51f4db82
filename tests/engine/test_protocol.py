"""Protocol edge cases clients hit, on the real server (session fixture)."""

from __future__ import annotations

import httpx

from tests.helpers import IMAGES, data_url


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


async def test_requests_without_max_tokens_get_the_documented_default():
    from transformers import AutoTokenizer

    from serve.intake.budget import PromptBudget
    from serve.intake.cache import ImageCache
    from serve.intake.images import ImagePolicy
    from serve.intake.middleware import IntakeMiddleware
    from serve.intake.request import RequestLimits
    from serve.intake.urls import UrlPolicy
    from tests.helpers import ensure_tiny_model

    tokenizer = AutoTokenizer.from_pretrained(ensure_tiny_model())

    def intake(max_model_len: int) -> IntakeMiddleware:
        return IntakeMiddleware(None, RequestLimits(max_images=4),
                                ImagePolicy(2**20, 10**7, frozenset({"PNG"})),
                                UrlPolicy(enabled=False),
                                PromptBudget(tokenizer, max_model_len, 1), ImageCache(0),
                                default_max_tokens=500)

    import json

    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "Hi there"}]})
    sent, *_ = await intake(8192).process(body.encode())
    assert json.loads(sent)["max_tokens"] == 500
    clamped, *_ = await intake(300).process(body.encode())  # the context leaves < 500
    assert 200 < json.loads(clamped)["max_tokens"] < 300
    own = json.dumps({"model": "m", "max_completion_tokens": 7,
                      "messages": [{"role": "user", "content": "Hi"}]})
    kept, *_ = await intake(8192).process(own.encode())
    assert "max_tokens" not in json.loads(kept) and json.loads(kept)["max_completion_tokens"] == 7


def _counts(server) -> dict[str, float]:
    scrape = server.metrics()
    return {"aborted": server.metric("phi3v_aborted_requests_total", scrape=scrape),
            "finished": server.metric("phi3v_finished_requests_total", scrape=scrape),
            "goodput": server.metric("phi3v_goodput_requests_total", scrape=scrape),
            "http200": server.metric("phi3v_http_responses_total",
                                     {"route": "/v1/chat/completions", "code": "200"},
                                     scrape=scrape)}


def _wait_for(predicate, timeout_s: float = 10.0) -> bool:
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return False


def test_client_that_leaves_is_counted_aborted_not_finished(server):
    """Honest accounting: a non-streamed request whose client gave up is not finished, not
    goodput and not an HTTP 200; a stream the client closed early is aborted, not finished."""
    before = _counts(server)
    long_answer = chat(server, max_tokens=4000, ignore_eos=True)
    try:
        httpx.post(f"{server.base_url}/v1/chat/completions", json=long_answer, timeout=0.5)
    except httpx.TimeoutException:
        pass
    assert _wait_for(lambda: _counts(server)["aborted"] == before["aborted"] + 1)
    with httpx.stream("POST", f"{server.base_url}/v1/chat/completions", timeout=60,
                      json={**long_answer, "stream": True}) as r:
        next(r.iter_lines())  # the first event, then the client leaves
    assert _wait_for(lambda: _counts(server)["aborted"] == before["aborted"] + 2)
    after = _counts(server)
    assert after["finished"] == before["finished"] and after["goodput"] == before["goodput"]
    assert after["http200"] == before["http200"] + 1  # the stream had started with 200
    assert server.metric("phi3v_http_responses_total",
                         {"route": "/v1/chat/completions", "code": "499"}) >= 1


# --- compressed bodies, validation errors' fields, non-finite numbers -------------------------
GENERATION_BODIES = {
    "/v1/chat/completions": lambda srv: chat(srv, max_tokens=2),
    "/v1/completions": lambda srv: {"model": srv.model, "prompt": "Hello", "max_tokens": 2},
    "/v1/responses": lambda srv: {"model": srv.model, "input": "Hello", "max_output_tokens": 2},
}


def refused_415(server, path: str) -> float:
    """``phi3v_http_responses_total{route=path,code="415"}`` (0 before the first 415)."""
    try:
        return server.metric("phi3v_http_responses_total", {"route": path, "code": "415"})
    except KeyError:
        return 0.0


def test_compressed_bodies_are_415_naming_the_encoding_on_every_route(server):
    import gzip
    import json
    import zlib

    codings = {"gzip": gzip.compress, "deflate": zlib.compress,
               "br": lambda raw: b"\x0b\x02\x80" + raw}  # never inflated: any bytes do
    for path, body in GENERATION_BODIES.items():
        raw = json.dumps(body(server)).encode()
        before = refused_415(server, path)
        for coding, compress in codings.items():
            r = httpx.post(f"{server.base_url}{path}", content=compress(raw), timeout=60,
                           headers={"Content-Type": "application/json",
                                    "Content-Encoding": coding})
            assert r.status_code == 415, (path, coding, r.text)
            err = r.json()["error"]
            assert err["param"] == "Content-Encoding" and coding in err["message"]
            assert r.headers["accept-encoding"] == "identity"
        assert refused_415(server, path) == before + len(codings)  # counted like any answer
        plain = httpx.post(f"{server.base_url}{path}", content=raw, timeout=60,
                           headers={"Content-Type": "application/json",
                                    "Content-Encoding": "identity"})
        assert plain.status_code == 200, plain.text


VALIDATION_CASES = [
    # A union member's field (vLLM alone: body.messages.0.ChatCompletionDeveloperMessageParam
    # .role, the first member's tag, which the client got right).
    ({"messages": [{"role": "user", "content": "Hello", "name": 123}]}, "messages[0].name"),
    ({"messages": [{"role": "system", "content": "Be brief."},
                   {"role": "user", "content": "Hello", "name": ["x"]}]}, "messages[1].name"),
    ({"stop": 5}, "stop"),
    ({"logit_bias": {"100": "high"}}, "logit_bias.100"),
]


def test_validation_errors_name_the_field_the_client_sent(server):
    for override, param in VALIDATION_CASES:
        r = httpx.post(f"{server.base_url}/v1/chat/completions", timeout=60,
                       json={**chat(server, max_tokens=2), **override})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == param and err["message"].startswith(param), r.text
        assert err["type"] == "invalid_request_error"


NON_FINITE = [  # (path, JSON fragment added to the route's body, field named)
    ("/v1/chat/completions", '"logit_bias": {"100": NaN}', "logit_bias.100"),
    ("/v1/chat/completions", '"temperature": NaN', "temperature"),
    ("/v1/chat/completions", '"top_p": Infinity', "top_p"),
    ("/v1/chat/completions", '"frequency_penalty": -Infinity', "frequency_penalty"),
    ("/v1/chat/completions", '"presence_penalty": 1e999', "presence_penalty"),
    ("/v1/completions", '"logit_bias": {"100": NaN}', "logit_bias.100"),
    ("/v1/responses", '"temperature": NaN', "temperature"),
]


def test_non_finite_numbers_are_400_naming_the_field(server):
    import json

    for path, fragment, param in NON_FINITE:
        raw = json.dumps(GENERATION_BODIES[path](server))[:-1] + ", " + fragment + "}"
        r = httpx.post(f"{server.base_url}{path}", content=raw, timeout=60,
                       headers={"Content-Type": "application/json"})
        assert r.status_code == 400, (path, fragment, r.text)
        err = r.json()["error"]
        assert err["param"] == param and "finite" in err["message"], r.text
