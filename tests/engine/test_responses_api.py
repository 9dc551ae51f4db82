"""The OpenAI Responses API (``POST /v1/responses``) through the full request path on the real
server, and the request-id and header rules every generation route shares."""

from __future__ import annotations

import json

import httpx
import pytest
from openai import OpenAI

from tests.helpers import IMAGES, data_url


# --- the real server (session fixture) ---------------------------------------------------------
def test_openai_sdk_responses_with_an_image_stream_and_not(server):
    client = OpenAI(base_url=f"{server.base_url}/v1", api_key="unused")
    before = server.metric("phi3v_requests_total")
    content = [{"type": "input_text", "text": "What is in this photo?"},
               {"type": "input_image", "image_url": data_url(IMAGES / "chelsea.png")}]
    response = client.responses.create(model=server.model, max_output_tokens=6,
                                       input=[{"role": "user", "content": content}])
    assert response.output_text and response.usage.output_tokens == 6
    assert response.usage.input_tokens > 100  # the image's tokens are in the prompt
    events = list(client.responses.create(
        model=server.model, max_output_tokens=4, stream=True, instructions="Be brief.",
        input=[{"role": "user", "content": content}]))
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and "response.output_text.delta" in kinds
    assert "error" not in kinds
    # By default a stream ends with response.completed, also when max_output_tokens cut it
    # (--responses-incomplete-event; test_cut_stream_* below); the status tells.
    assert kinds[-1] == "response.completed"
    assert events[-1].response.status in ("completed", "incomplete")
    assert server.metric("phi3v_requests_total") >= before + 2  # admission counted both
    assert server.metric("phi3v_http_responses_total",
                         {"route": "/v1/responses", "code": "200"}) >= 2


# --- a stream cut by max_output_tokens: its end event (--responses-incomplete-event) ----------
def cut_request(server) -> dict:
    """A Responses request the engine must cut at ``max_output_tokens`` (``ignore_eos``: the
    tiny model's random weights cannot end it sooner)."""
    return {"model": server.model, "input": "Tell me a long story.", "max_output_tokens": 3,
            "extra_body": {"ignore_eos": True}}


def raw_events(server, request: dict) -> list[tuple[str, dict]]:
    """The SSE events of a streamed Responses request as the server sent them: (event name,
    data), read with httpx rather than the SDK."""
    body = {**{k: v for k, v in request.items() if k != "extra_body"},
            **request.get("extra_body", {}), "stream": True}
    events, name = [], None
    with httpx.stream("POST", f"{server.base_url}/v1/responses", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[len("event: "):]
            elif line.startswith("data: "):
                events.append((name, json.loads(line[len("data: "):])))
    return events


def assert_cut(response) -> None:
    assert response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 3 and response.output_text


def test_cut_stream_ends_with_response_completed_and_the_sdk_helper_returns_it(server):
    """Default (``completed``): the pinned openai SDK's ``responses.stream()`` helper returns
    the cut answer, its status ``incomplete`` (with ``response.incomplete`` the helper raises:
    the next test)."""
    client = OpenAI(base_url=f"{server.base_url}/v1", api_key="unused")
    with client.responses.stream(**cut_request(server)) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert_cut(final)
    assert kinds[-1] == "response.completed" and "response.incomplete" not in kinds
    events = raw_events(server, cut_request(server))
    name, data = events[-1]
    assert name == data["type"] == "response.completed"
    assert data["response"]["status"] == "incomplete"
    assert data["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert [n for n, _ in events].count("response.completed") == 1
    assert [d["sequence_number"] for _, d in events] == list(range(len(events)))


@pytest.fixture(scope="module")
def incomplete_event_server(verbose_server):
    """A server with ``--responses-incomplete-event incomplete`` (OpenAI's event name): the
    session's ``verbose_server``."""
    return verbose_server


def test_cut_stream_ends_with_response_incomplete_when_configured(incomplete_event_server):
    """``incomplete``: the event OpenAI's reference names. As documented (``serve.sse``), the
    pinned SDK's ``get_final_response()`` then raises; iterating the events gets the end and
    the cut answer."""
    srv = incomplete_event_server
    events = raw_events(srv, cut_request(srv))
    name, data = events[-1]
    assert name == data["type"] == "response.incomplete"
    assert data["response"]["status"] == "incomplete"
    assert data["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert "response.completed" not in [n for n, _ in events]
    client = OpenAI(base_url=f"{srv.base_url}/v1", api_key="unused")
    with client.responses.stream(**cut_request(srv)) as stream:
        kinds = [event.type for event in stream]
        with pytest.raises(RuntimeError, match="Didn't receive a `response.completed` event"):
            stream.get_final_response()
    assert kinds[-1] == "response.incomplete"
    last = list(client.responses.create(**cut_request(srv), stream=True))[-1]
    assert last.type == "response.incomplete"
    assert_cut(last.response)


def test_responses_without_max_output_tokens_get_the_default(server):
    # Streamed, and left after the first event (response.created, which carries the limit):
    # the whole default answer would be 2,048 tokens of the tiny model's text.
    body = {"model": server.model, "input": "hi", "stream": True}
    with httpx.stream("POST", f"{server.base_url}/v1/responses", json=body, timeout=60) as r:
        assert r.status_code == 200
        created = next(json.loads(line[len("data: "):]) for line in r.iter_lines()
                       if line.startswith("data: "))
    assert created["type"] == "response.created", created
    assert created["response"]["max_output_tokens"] == 2048, created


def post(server, path: str, body: dict, **kw) -> httpx.Response:
    """POST ``body`` as JSON with non-ASCII escaped (so a lone surrogate can be sent, as any
    JSON encoder may)."""
    return httpx.post(f"{server.base_url}{path}", content=json.dumps(body), timeout=60,
                      headers={"Content-Type": "application/json"}, **kw)


def test_history_in_every_documented_shape_is_accepted(server):
    """Assistant history as clients send it: the short form with output_text, the SDK's output
    message form (id, status) with output_text and refusal parts."""
    history = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [{"type": "output_text", "text": "hello"}]},
        {"type": "message", "id": "msg_1", "status": "completed", "role": "assistant",
         "content": [{"type": "output_text", "text": "more", "annotations": []},
                     {"type": "refusal", "refusal": "no"}]},
        {"role": "user", "content": [{"type": "output_text", "text": "typed as output"}]},
    ]
    r = post(server, "/v1/responses", {"model": server.model, "max_output_tokens": 2,
                                       "input": history})
    assert r.status_code == 200, r.text


def test_responses_mistakes_are_400s_naming_the_field(server):
    base = {"model": server.model, "max_output_tokens": 2, "input": "hi"}
    cases = [
        ({**base, "input": "\ud800"}, "input"),
        ({**base, "instructions": "x\udfff"}, "instructions"),
        ({**base, "max_output_tokens": 0}, "max_output_tokens"),
        ({**base, "tools": [{"type": "function", "name": "f", "parameters": {}}]}, "tools"),
    ]
    for body, param in cases:
        r = post(server, "/v1/responses", body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    chat = {"model": server.model, "max_tokens": 2, "messages": [{"role": "user", "content": "a"}]}
    chat_cases = [
        ({**chat, "messages": [{"role": "user", "content": "a\ud800"}]}, "messages[0].content"),
        ({**chat, "stop": ["\ud800"]}, "stop[0]"),  # vLLM alone: 500 from its encoder
        ({**chat, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,\ud800"}}]}]},
         "messages[0].content[0].image_url.url"),
        ({**chat, "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ({**chat, "tool_choice": "auto"}, "tool_choice"),
    ]
    for body, param in chat_cases:
        r = post(server, "/v1/chat/completions", body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    r = post(server, "/v1/completions", {"model": server.model, "prompt": "\ud800"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    nested = '{"model": "m", "input": "hi", "x": ' + "[" * 1000 + "]" * 1000 + "}"
    for path in ("/v1/responses", "/v1/chat/completions"):
        r = httpx.post(f"{server.base_url}{path}", content=nested, timeout=60,
                       headers={"Content-Type": "application/json"})
        assert r.status_code == 400 and "nested" in r.json()["error"]["message"]
    assert httpx.get(f"{server.base_url}/health", timeout=10).status_code == 200


def test_same_request_id_gets_distinct_response_ids(server):
    chat = {"model": server.model, "max_tokens": 2,
            "messages": [{"role": "user", "content": "hi"}]}
    ids = set()
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        for _ in range(2):
            r = client.post("/v1/chat/completions", json=chat, headers={"X-Request-Id": "abc"})
            assert r.status_code == 200 and "abc" in r.json()["id"]
            assert r.headers["x-request-id"].startswith("abc-")  # the id it ran under
            ids.add(r.json()["id"])
            r = client.post("/v1/responses", headers={"X-Request-Id": "abc"},
                            json={"model": server.model, "input": "hi", "max_output_tokens": 2})
            assert r.json()["id"] == r.headers["x-request-id"] and "abc" in r.json()["id"]
            ids.add(r.json()["id"])
            for path, body in (("/v1/chat/completions", chat),
                               ("/v1/completions", {"model": server.model, "prompt": "hi",
                                                    "max_tokens": 2}),
                               ("/v1/responses", {"model": server.model, "input": "hi",
                                                  "max_output_tokens": 2})):
                r = client.post(path, json={**body, "request_id": "abc"})
                assert r.status_code == 200 and "abc" in r.json()["id"], r.text
                ids.add(r.json()["id"])
        assert len(ids) == 10
        long = client.post("/v1/chat/completions", json=chat, headers={"X-Request-Id": "a" * 257})
        assert long.status_code == 400 and long.json()["error"]["param"] == "X-Request-Id"
        # 256 characters, not bytes (UTF-8 in the header)
        accented = client.post("/v1/chat/completions", json=chat,
                               headers={"X-Request-Id": ("\u00e9" * 200).encode()})
        assert accented.status_code == 200, accented.text
        refused = client.post("/v1/chat/completions", headers={"X-Request-Id": "bad"},
                              json={**chat, "n": 5})
        assert refused.status_code == 400 and refused.headers["x-request-id"].startswith("bad-")
        # Every answer names the id it ran under, also when the client chose none.
        for path, body in (("/v1/chat/completions", chat),
                           ("/v1/responses", {"model": server.model, "input": "hi",
                                              "max_output_tokens": 2})):
            plain = client.post(path, json=body)
            assert plain.headers["x-request-id"] in plain.json()["id"]
            mine = client.post(path, json={**body, "request_id": "mine"})
            assert mine.headers["x-request-id"].startswith("mine-")
            assert mine.headers["x-request-id"] in mine.json()["id"]
        control = client.post("/v1/responses", json={"model": server.model, "input": "hi",
                                                     "request_id": "a\u0007b"})
        assert control.status_code == 400 and control.json()["error"]["param"] == "request_id"


def test_a_megabyte_header_is_431_and_a_large_one_passes(server):
    before = server.metric("phi3v_http_responses_total", {"code": "431"})
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        r = client.get("/v1/models", headers={"X-Big": "a" * 2**20})
        assert r.status_code == 431 and "headers exceed" in r.json()["error"]["message"]
    assert server.metric("phi3v_http_responses_total", {"code": "431"}) == before + 1
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        assert client.get("/v1/models", headers={"X-Big": "a" * 32_000}).status_code == 200
        assert client.get("/health").status_code == 200
