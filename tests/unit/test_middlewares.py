"""Each request layer in-process, in front of a scripted ASGI peer (the network peer vLLM's app
would be): body limit, intake, admission and its goodput accounting. The stream guard's own
in-process tests are in ``test_intake.py`` and ``test_responses_rules.py``."""

from __future__ import annotations

import json

import pytest
from prometheus_client import CollectorRegistry

from serve.admission.goodput import SloTargets
from serve.admission.limiter import AdmissionLimiter
from serve.admission.middleware import AdmissionMiddleware, ResponseTracker
from serve.asgi import BodyLimitMiddleware, ResponseChannel
from serve.intake.images import ImagePolicy
from serve.intake.middleware import IntakeMiddleware
from serve.intake.request import RequestLimits
from serve.intake.urls import UrlPolicy
from serve.metrics import Metrics

SLO = SloTargets(ttft_s=1.0, itl_s=0.1)


class Clock:
    """A monotonic clock the scripted peer moves forward."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def sse_peer(clock: Clock, gaps_s: list[float], status: int = 200, done: bool = True):
    """A streamed answer: one chunk after each gap, then ``[DONE]`` (or a cut stream)."""
    async def app(scope, receive, send):
        await receive()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"text/event-stream")]})
        for gap in gaps_s:
            clock.now += gap
            await send({"type": "http.response.body", "more_body": True,
                        "body": b'data: {"choices": [{"delta": {"content": "x"}}]}\n\n'})
        if done:
            await send({"type": "http.response.body", "body": b"data: [DONE]\n\n",
                        "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
    return app


def json_peer(clock: Clock, seconds: float, tokens: int, status: int = 200,
              listens: bool = False):
    """A non-streamed answer taking ``seconds`` with ``tokens`` completion tokens; with
    ``listens`` it waits for the client's next message first (vLLM's ``with_cancellation``
    does, and aborts on a disconnect; the answer here is sent anyway, late)."""
    async def app(scope, receive, send):
        await receive()
        if listens:
            await receive()
        clock.now += seconds
        body = json.dumps({"usage": {"completion_tokens": tokens}}).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": body, "more_body": False})
    return app


async def call(app, body: bytes = b"{}", path: str = "/v1/chat/completions",
               headers: list | None = None, disconnect: bool = False):
    """Run one request; returns (status, body, response headers)."""
    sent, messages = [], [{"type": "http.request", "body": body, "more_body": False}]

    async def receive():
        if messages:
            return messages.pop(0)
        return {"type": "http.disconnect"} if disconnect else await _forever()

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": path, "headers": headers or [],
             "query_string": b""}
    await app(scope, receive, send)
    start = next(m for m in sent if m["type"] == "http.response.start")
    data = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return start["status"], data, dict(start.get("headers") or [])


async def _forever():
    import asyncio

    await asyncio.sleep(3600)


def admission(peer, clock: Clock) -> tuple[AdmissionMiddleware, Metrics]:
    metrics = Metrics(CollectorRegistry())
    limiter = AdmissionLimiter(4, max_queue=4, max_queue_wait_s=5, clock=clock)
    return AdmissionMiddleware(peer, limiter, SLO, metrics, clock=clock), metrics


async def cut_while_open(app: AdmissionMiddleware, resume) -> tuple[int, bytes, dict]:
    """Send one request through ``app``, cut it with the drain's ``cut_open`` once it is
    admitted, then set ``resume`` (the peer goes on after the cut); the request's (status,
    body, response headers)."""
    import asyncio

    request = asyncio.create_task(call(app))
    while not app.open:
        await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert await app.cut_open("shutting down", 5) == 1
    resume.set()
    return await request


def counts(metrics: Metrics) -> tuple[float, float, float, float]:
    return (metrics.requests._value.get(), metrics.finished._value.get(),
            metrics.goodput._value.get(), metrics.aborted._value.get())


# --- goodput (DistServe: TTFT and ITL targets both met), streamed and not ----------------------
async def test_streamed_goodput_counts_only_requests_meeting_both_targets():
    clock = Clock()
    for gaps, good in (([0.5, 0.05, 0.05], True),    # TTFT 0.5 s, ITL 0.05 s
                       ([1.5, 0.05, 0.05], False),   # TTFT over 1 s
                       ([0.5, 0.3, 0.3], False)):    # ITL over 0.1 s
        app, metrics = admission(sse_peer(clock, gaps), clock)
        status, _, _ = await call(app)
        assert status == 200
        assert counts(metrics) == (1, 1, 1 if good else 0, 0), gaps


async def test_non_streamed_goodput_spreads_the_budget_over_the_answer():
    clock = Clock()
    # Budget: TTFT target + ITL target x (tokens - 1) = 1 + 0.1 x 9 = 1.9 s for 10 tokens.
    for seconds, good in ((1.8, True), (2.0, False)):
        app, metrics = admission(json_peer(clock, seconds, tokens=10), clock)
        assert (await call(app))[0] == 200
        assert counts(metrics) == (1, 1, 1 if good else 0, 0), seconds


async def test_failed_cut_and_abandoned_requests_are_neither_finished_nor_goodput():
    clock = Clock()
    for peer, disconnect in ((json_peer(clock, 0.1, 3, status=500), False),
                             (sse_peer(clock, [0.1], status=500), False),
                             (sse_peer(clock, [0.1, 0.01], done=False), False),
                             (json_peer(clock, 0.1, 3, listens=True), True)):
        app, metrics = admission(peer, clock)
        await call(app, disconnect=disconnect)
        requests, finished, goodput, aborted = counts(metrics)
        assert (requests, finished, goodput, aborted) == (1, 0, 0, 1 if disconnect else 0)


async def test_admission_frees_the_slot_however_the_answer_ends():
    clock = Clock()
    app, _ = admission(sse_peer(clock, [0.1], done=False), clock)
    await call(app)
    await call(app)
    assert app.limiter.in_flight == 0


# --- body limit ------------------------------------------------------------------------------
async def test_body_limit_refuses_declared_and_streamed_excess():
    clock = Clock()
    app = BodyLimitMiddleware(json_peer(clock, 0.0, 1), max_bytes=10)
    assert (await call(app, b"{}"))[0] == 200
    status, body, _ = await call(app, b"x" * 11)
    assert status == 413 and b"10 bytes" in body
    status, _, _ = await call(app, b"{}", headers=[(b"content-length", b"99")])
    assert status == 413


# --- intake ----------------------------------------------------------------------------------
def intake(peer) -> IntakeMiddleware:
    return IntakeMiddleware(peer, RequestLimits(max_images=2),
                            ImagePolicy(2**20, 10**6, frozenset({"PNG"})),
                            UrlPolicy(enabled=False))


async def test_intake_refuses_before_the_engine_and_echoes_the_request_id():
    seen = []

    async def peer(scope, receive, send):
        seen.append(json.loads((await receive())["body"]))
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}", "more_body": False})

    app = intake(peer)
    status, body, _ = await call(app, b'{"messages": [')
    assert status == 400 and not seen
    ok = json.dumps({"messages": [{"role": "user", "content": "<|end|>"}]}).encode()
    status, _, headers = await call(app, ok, headers=[(b"x-request-id", b"abc")])
    assert status == 200 and headers[b"x-request-id"].startswith(b"abc-")
    assert seen[0]["messages"][0]["content"] == "<\u2060|end|>"
    assert seen[0]["max_tokens"] == 2048  # the documented default


async def test_a_cut_stream_gets_one_error_event_and_is_not_counted_finished():
    """The drain deadline (``cut_open``): what the app sends after the cut never reaches the
    client, and the request counts neither as finished nor as goodput."""
    import asyncio

    clock, resume = Clock(), asyncio.Event()

    async def peer(scope, receive, send):
        await receive()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        await send({"type": "http.response.body", "more_body": True,
                    "body": b'data: {"choices": [{"delta": {"content": "x"}}]}\n\n'})
        await resume.wait()  # the engine goes on after the cut
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n",
                    "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    app, metrics = admission(peer, clock)
    status, body, _ = await cut_while_open(app, resume)
    events = [e for e in body.decode().split("\n\n") if e]
    assert status == 200 and events[-1].startswith('data: {"error"') and len(events) == 2
    assert "[DONE]" not in body.decode()
    assert counts(metrics) == (1, 0, 0, 0) and not app.open


async def test_the_tracker_counts_what_the_guard_lets_through_on_one_channel():
    """Admission's tracker in front of the stream guard, both on the response's one channel
    (the guard its gate): vLLM's token events pass as sent and are counted, an empty delta is
    dropped before it counts, an abort becomes the guard's one error event, and the tracker,
    seeing that event instead of ``[DONE]``, counts no finished request."""
    from serve.streamguard import StreamGuardMiddleware
    from tests.helpers import vllm_token_event

    def peer(tail: list[bytes]):
        async def app(scope, receive, send):
            await receive()
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/event-stream")]})
            for body in [*map(vllm_token_event, (b'"a"', b'""', b'"b"')), *tail]:
                clock.now += 0.05
                await send({"type": "http.response.body", "body": body, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        return app

    for tail, finished in (([b"data: [DONE]\n\n"], 1), ([vllm_token_event(b'"c"', b'"abort"')], 0)):
        clock = Clock()
        app, metrics = admission(StreamGuardMiddleware(peer(tail)), clock)
        status, body, headers = await call(app)
        events = [e for e in body.split(b"\n\n") if e]
        assert status == 200 and headers[b"x-accel-buffering"] == b"no"
        assert len(events) == 3
        assert events[:2] == [vllm_token_event(b'"a"')[:-2], vllm_token_event(b'"b"')[:-2]]
        assert (events[2] == b"data: [DONE]") if finished else (b'"error"' in events[2])
        assert counts(metrics)[:2] == (1, finished)
        if finished:  # TTFT from the first token event (sent 0.05 s after arrival)
            assert abs(metrics.ttft._sum.get() - 0.05) < 1e-9
    channel = ResponseChannel(None)
    channel.gate(object())
    with pytest.raises(ValueError):
        channel.gate(object())


async def test_token_chunks_the_guard_passes_are_counted_once_and_dropped_after_a_cut(
        monkeypatch):
    """Behind the guard, vLLM's ordinary token chunks go straight on, counted by the channel
    instead of each seen by the tracker: the answer's chunk count, TTFT and mean gap are those
    of every chunk (role chunk, tokens, finish chunk, ``[DONE]``) as sent, and once the server
    cut the answer (the drain deadline), the token chunks the engine still sends never reach
    the client."""
    import asyncio

    from serve.streamguard import StreamGuardMiddleware
    from tests.helpers import vllm_token_event

    role = (b'data: {"id":"chatcmpl-3","object":"chat.completion.chunk","created":1,"model":"m",'
            b'"choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,'
            b'"finish_reason":null}],"prompt_token_ids":null}\n\n')
    chunks = [role, *(vllm_token_event(b'"t%d"' % k) for k in range(5)),
              vllm_token_event(b'"end"', b'"length"'), b"data: [DONE]\n\n"]
    clock = Clock()
    seen: list[bytes] = []

    async def peer(scope, receive, send):
        await receive()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        for k, body in enumerate(chunks):
            clock.now += 0.2 if k == 0 else 0.01  # TTFT 0.2 s, then a chunk every 10 ms
            await send({"type": "http.response.body", "body": body, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    app, metrics = admission(StreamGuardMiddleware(peer), clock)
    original_attach = ResponseTracker.attach

    def attach(tracker, channel):  # record what the tracker's observer is shown
        channel.observe(lambda m: seen.append(m.get("body", b"")) or False)
        return original_attach(tracker, channel)

    monkeypatch.setattr(ResponseTracker, "attach", attach)
    status, body, _ = await call(app)
    monkeypatch.undo()
    assert status == 200 and body == b"".join(chunks)
    assert not any(vllm_token_event(b'"t%d"' % k) in seen for k in range(5))
    assert counts(metrics) == (1, 1, 1, 0)
    assert abs(metrics.ttft._sum.get() - 0.2) < 1e-9
    tracker = ResponseTracker(100.0, clock)
    channel = tracker.attach(ResponseChannel(None))
    channel.tokens, channel.first_token_s = 5, 100.3
    tracker.chunks, tracker.first_chunk_s, tracker.last_chunk_s = 3, 100.2, 100.7
    assert tracker.chunk_span() == (8, 100.2, 100.7)
    assert tracker.answer_tokens() is None  # no start seen: not a stream
    tracker.streaming = True
    assert tracker.answer_tokens() == 8 and tracker.mean_itl_s() is None  # no end marker yet
    tracker.done_marker = True
    assert abs(tracker.mean_itl_s() - 0.5 / 7) < 1e-12

    resume = asyncio.Event()

    async def cut_peer(scope, receive, send):
        await receive()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        await send({"type": "http.response.body", "body": role, "more_body": True})
        await resume.wait()  # the engine goes on after the cut
        for k in range(3):
            await send({"type": "http.response.body", "body": vllm_token_event(b'"t%d"' % k),
                        "more_body": True})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n",
                    "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    app, metrics = admission(StreamGuardMiddleware(cut_peer), Clock())
    status, body, _ = await cut_while_open(app, resume)
    events = [e for e in body.split(b"\n\n") if e]
    assert status == 200 and len(events) == 2 and events[1].startswith(b'data: {"error"')
    assert counts(metrics) == (1, 0, 0, 0)


async def test_an_app_failing_after_a_cut_before_its_answer_started_leaves_the_503():
    """A drain cut a request whose answer had not started (a 503 with ``Retry-After``); the
    app then starts its stream and fails: nothing more reaches the client, and the failure
    does not escape the guard (the client's answer was complete)."""
    import asyncio

    from serve.streamguard import StreamGuardMiddleware

    resume = asyncio.Event()

    async def peer(scope, receive, send):
        await receive()
        await resume.wait()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        raise RuntimeError("the engine failed")

    app, metrics = admission(StreamGuardMiddleware(peer), Clock())
    status, body, headers = await cut_while_open(app, resume)
    assert status == 503 and headers[b"retry-after"] == b"5" and b"shutting down" in body
    assert counts(metrics) == (1, 0, 0, 0)
