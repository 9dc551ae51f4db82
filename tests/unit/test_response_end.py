"""The end of a response (``serve.asgi.ResponseChannel.on_end``): what the layers settle once
an answer is over runs right after its last message, before the app unwinds; and the body a
layer buffered is read once (``serve.asgi.replay``)."""

from __future__ import annotations

import json
import logging

import pytest
from prometheus_client import CollectorRegistry

from serve.admission.limiter import AdmissionLimiter
from serve.app import Gateway, Phase, compose
from serve.asgi import Replay, ResponseChannel, buffered_body, read_body, replay
from serve.settings import Settings
from serve.tenants import DEFAULT_TENANT

CHAT = b'data: {"choices":[{"index":0,"delta":{"content":"x"},"finish_reason":null}]}\n\n'


def recorder() -> tuple[ResponseChannel, list]:
    sent: list = []

    async def send(message):
        sent.append(message)

    return ResponseChannel(send), sent


async def test_end_hooks_run_once_innermost_first_right_after_the_last_message():
    channel, sent = recorder()
    ran: list = []
    channel.on_end(lambda failed: ran.append(("outer", failed, len(sent))))
    channel.on_end(lambda failed: ran.append(("inner", failed, len(sent))))
    await channel({"type": "http.response.start", "status": 200, "headers": []})
    await channel({"type": "http.response.body", "body": b"a", "more_body": True})
    assert ran == []
    await channel({"type": "http.response.body", "body": b"b", "more_body": False})
    # after the last message went out (3 sent), the layer registered last first
    assert ran == [("inner", False, 3), ("outer", False, 3)]
    channel.end(failed=True)
    assert len(ran) == 2


async def test_a_layers_own_last_message_ends_the_response_too():
    channel, sent = recorder()
    ran: list = []
    channel.on_end(lambda failed: ran.append(len(sent)))
    await channel.emit({"type": "http.response.start", "status": 503, "headers": []})
    await channel.emit({"type": "http.response.body", "body": b"{}"})  # more_body absent
    assert ran == [2]


async def test_an_app_failing_before_its_last_message_ends_the_response_as_failed():
    """The layers end the response when the app raises (failed) or returns without a last
    message (its client left): the slot is released either way."""
    from serve.admission.goodput import SloTargets
    from serve.admission.middleware import AdmissionMiddleware
    from serve.metrics import Metrics

    async def failing(scope, receive, send):
        raise RuntimeError("the app failed")

    async def leaving(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})

    for peer, raises in ((failing, True), (leaving, False)):
        limiter = AdmissionLimiter(1, max_queue=1, max_queue_wait_s=5)
        app = AdmissionMiddleware(peer, limiter, SloTargets(30.0, 1.0),
                                  Metrics(CollectorRegistry()))
        channel, _ = recorder()
        ran: list = []
        channel.on_end(ran.append)  # a layer in front: it sees how the response ended
        messages = [{"type": "http.request", "body": b"{}", "more_body": False}]

        async def receive(messages=messages):
            return messages.pop(0) if messages else {"type": "http.disconnect"}

        scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions",
                 "headers": [], "query_string": b""}
        if raises:
            with pytest.raises(RuntimeError):
                await app(scope, receive, channel)
        else:
            await app(scope, receive, channel)
        assert ran == [raises] and limiter.in_flight == 0


async def test_a_failing_hook_is_logged_and_the_others_still_run(caplog):
    channel, _ = recorder()
    ran: list = []
    channel.on_end(ran.append)

    def broken(failed: bool) -> None:
        raise ValueError("a bug in a hook")

    channel.on_end(broken)
    with caplog.at_level(logging.ERROR, logger="serve.asgi"):
        await channel({"type": "http.response.body", "body": b"", "more_body": False})
    assert ran == [False]
    assert "end-of-response hook failed" in caplog.text


@pytest.mark.parametrize("origins", [[], ["http://ui.example"]])
async def test_the_gateway_settles_a_request_before_its_app_returns(caplog, origins):
    """Slot, tenant counts, metrics and the access record are done when the last message is
    sent, while vLLM's app (here a scripted peer) has not returned yet: Starlette's streamed
    response only returns event-loop turns later. The access record comes last, with what the
    layers noted, also where CORS (``--allowed-origins``: Starlette's middleware wraps
    ``send``) sits between the gateway's channel and the layers'."""
    gateway = Gateway(Settings(allowed_origins=origins), registry=CollectorRegistry())
    seen: dict = {}

    async def peer(scope, receive, send):
        await receive()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        await send({"type": "http.response.body", "body": CHAT, "more_body": True})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n",
                    "more_body": True})
        seen["in_flight_before"] = gateway.admission.limiter.in_flight
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        seen["in_flight"] = gateway.admission.limiter.in_flight
        seen["running"] = gateway.accounting.quota.concurrent(DEFAULT_TENANT)
        seen["finished"] = gateway.metrics.finished._value.get()
        seen["records"] = [r for r in caplog.records if r.name == "serve.access"]

    gateway.state.openai_app = compose(peer, gateway.request_layers())
    gateway.state.phase = Phase.READY
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                       "max_tokens": 4, "stream": True}).encode()
    messages = [{"type": "http.request", "body": body, "more_body": False}]
    sent: list = []

    async def receive():
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions",
             "query_string": b"", "headers": [(b"content-type", b"application/json")],
             "client": ("127.0.0.1", 5000), "server": ("127.0.0.1", 8000)}
    with caplog.at_level(logging.INFO, logger="serve.access"):
        await gateway(scope, receive, send)
    assert sent[0]["status"] == 200
    assert seen["in_flight_before"] == 1
    assert seen["in_flight"] == 0 and seen["running"] == 0 and seen["finished"] == 1
    (record,) = seen["records"]
    assert record.status == 200 and record.route == "/v1/chat/completions"
    assert record.queue_wait_s is not None and 0 < record.ttft_s <= record.e2e_s


async def test_a_buffered_body_is_read_once_and_replayed_once():
    messages = [{"type": "http.request", "body": b"{}", "more_body": False},
                {"type": "http.disconnect"}]

    async def client():
        return messages.pop(0)

    body = await read_body(client)
    first = replay(body, client)
    assert buffered_body(first) == b"{}"  # a layer behind reads it without consuming it
    assert replay(body, first) is first  # the same body: the same replay
    rewritten = replay(b'{"a":1}', first)  # a rewritten body takes the replay's place
    assert isinstance(rewritten, Replay) and rewritten.receive is client
    assert await rewritten() == {"type": "http.request", "body": b'{"a":1}', "more_body": False}
    assert buffered_body(rewritten) is None  # read: the next layer reads what comes
    assert await rewritten() == {"type": "http.disconnect"}


async def test_try_acquire_grants_only_what_acquire_would_grant_at_once():
    limiter = AdmissionLimiter(1, max_queue=4, max_queue_wait_s=5)
    slot = limiter.try_acquire()
    assert slot is not None and limiter.in_flight == 1
    assert limiter.try_acquire() is None  # no room: acquire() queues it
    assert limiter.slots.snapshot(0).arrivals == 1  # a refusal here counts no arrival
    slot.release(completed=True)
    limiter.reject_waiting(1, "shutting down")
    assert limiter.try_acquire() is None  # closed: acquire() refuses it


async def test_a_request_queued_behind_a_buffered_body_waits_for_its_slot():
    """Admission behind the body limit (which buffered the body): a queued request watches
    the client's own messages for a disconnect, not the replay of its body, and is served
    once a slot frees."""
    import asyncio

    from serve.admission.goodput import SloTargets
    from serve.admission.middleware import AdmissionMiddleware
    from serve.asgi import BodyLimitMiddleware
    from serve.metrics import Metrics

    go = asyncio.Event()

    async def peer(scope, receive, send):
        assert (await receive())["body"] == b"{}"
        await go.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    limiter = AdmissionLimiter(1, max_queue=4, max_queue_wait_s=30)
    app = BodyLimitMiddleware(AdmissionMiddleware(peer, limiter, SloTargets(30.0, 1.0),
                                                  Metrics(CollectorRegistry())), 1024)

    async def request() -> int:
        messages = [{"type": "http.request", "body": b"{}", "more_body": False}]
        sent: list = []

        async def receive():
            if messages:
                return messages.pop(0)
            await asyncio.sleep(3600)  # the client stays

        async def send(message):
            sent.append(message)

        await app({"type": "http", "method": "POST", "path": "/v1/chat/completions",
                   "headers": [], "query_string": b""}, receive, send)
        return sent[0]["status"] if sent else 0

    first = asyncio.create_task(request())
    second = asyncio.create_task(request())
    for _ in range(20):
        await asyncio.sleep(0)
    assert limiter.in_flight == 1 and limiter.pending == 1  # the second is queued
    go.set()
    assert await asyncio.gather(first, second) == [200, 200]


async def test_a_served_request_leaves_no_garbage_for_the_collector():
    """Once an answer is over, the channel lets go of its layers' objects: nothing of a
    request (streamed or not) is left in a reference cycle, which only a garbage-collector
    pass over the process's young objects would free."""
    import gc

    from bench.layers import chat_request, scripted_chat, serve_one

    gateway = Gateway(Settings(), registry=CollectorRegistry())
    gateway.state.openai_app = compose(scripted_chat(4), gateway.request_layers())
    gateway.state.phase = Phase.READY
    scope, body = chat_request(4)
    for _ in range(3):  # caches and lazy imports of a first request
        await serve_one(gateway, scope, body)
    gc.collect()
    gc.disable()
    try:
        for _ in range(10):
            await serve_one(gateway, scope, body)
        assert gc.collect() == 0
    finally:
        gc.enable()
