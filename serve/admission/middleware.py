"""ASGI admission middleware for the generation routes, and goodput accounting.

For every generation route (``serve.routes.GENERATION_ROUTES``: chat completions,
completions, Responses API): buffer the body, take a slot from
the :class:`~serve.admission.limiter.AdmissionLimiter` (a client that leaves while queued
leaves the queue), forward to vLLM's app, and release the slot exactly once when the response
ends, however it ends. Refusals are 429 with ``Retry-After`` and an OpenAI-style error.

Goodput: the rule of ``serve.admission.goodput`` (DistServe's definition), applied to the
times measured here, as the client sees them (queue wait included).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from serve.admission.fair import DEFAULT_TENANT
from serve.admission.goodput import SloTargets, non_streamed_good, streamed_good
from serve.admission.limiter import UNAVAILABLE, AdmissionLimiter, Rejected
from serve.asgi import (
    IMAGES_SCOPE_KEY,
    PROMPT_TOKENS_SCOPE_KEY,
    REQUEST_STATE_KEY,
    ClientGone,
    ResponseChannel,
    buffered_body,
    read_body,
    replay,
    response_channel,
)
from serve.errors import ENGINE_LOST, RETRY_AFTER_S, error_body, openai_error
from serve.logs import note
from serve.metrics import Metrics
from serve.routes import GENERATION_ROUTES
from serve.sse import CHAT_END, CHAT_SSE, SseDialect, dialect, is_event_stream
from serve.tenants import ANONYMOUS, TENANT_SCOPE_KEY, USER_SCOPE_KEY


class ResponseTracker:
    """Watches one response's ASGI messages: status, chunk count and times, completion; and
    can end the answer early (:meth:`cut`).

    The chunks of a streamed answer are counted where they pass: the ordinary chunks by the
    response's channel (its gate, the stream guard, passes them without observers:
    :class:`~serve.asgi.ResponseChannel`), the rest here. The answer's first chunk is vLLM's
    role chunk or the channel's first token, whichever came first; its last is the end
    marker (``[DONE]``, a Responses end event), which the guard never passes unseen, so the
    span of a finished stream is exact, and its mean gap is known only once it finished.

    Args:
        arrival: when the request arrived, ``clock()`` seconds.
        clock: monotonic clock, seconds.
        sse: the route's SSE dialect.

    A plain class (one per request, made on the path of every request: the attributes below
    are class-level defaults until set), compared by identity (the middleware keeps the open
    ones in a set).
    """

    status: int | None = None
    streaming: bool = False
    #: Body chunks seen here (a stream's chunks other than the channel's token chunks).
    chunks: int = 0
    first_chunk_s: float | None = None
    last_chunk_s: float | None = None
    done_marker: bool = False
    finished: bool = False
    client_left: bool = False
    #: The body of an answer that is no stream (its first MiB), for its usage.
    body: bytearray | None = None
    _channel: ResponseChannel | None = None

    def __init__(self, arrival: float, clock: Callable[[], float],
                 sse: SseDialect = CHAT_SSE) -> None:
        self.arrival = arrival
        self.clock = clock
        #: The route's SSE dialect: what marks a streamed answer's normal end.
        self.sse = sse

    @property
    def is_cut(self) -> bool:
        """The server ended the answer early (:meth:`cut`): its channel is closed, and what the
        app sends after is dropped."""
        return self._channel is not None and self._channel.closed

    def chunk_span(self) -> tuple[int, float | None, float | None]:
        """(chunks, first chunk's clock time, last clock time seen here) of the answer, the
        channel's chunks included (times None: no chunk). The last time is the last chunk's
        once a stream's end marker was seen (class docstring); before, chunks the channel
        passed may have followed it."""
        channel = self._channel
        tokens = channel.tokens if channel is not None else 0
        first, last = self.first_chunk_s, self.last_chunk_s
        if tokens:
            token_s = channel.first_token_s
            first = token_s if first is None else min(first, token_s)
            last = token_s if last is None else last
        return self.chunks + tokens, first, last

    def watch(self, receive: Receive, request_state: dict | None = None) -> Receive:
        """``receive`` that notes a client disconnect seen before the answer was sent in full
        (vLLM listens for it to abort the engine request), here and in ``request_state``
        (the gateway's per-request dict, so the HTTP counter does not count a 200)."""
        async def watched() -> Message:
            message = await receive()
            if message["type"] == "http.disconnect" and not self.finished:
                self.client_left = True
                if request_state is not None:
                    request_state["client_left"] = True
            return message
        return watched

    def attach(self, channel: ResponseChannel) -> ResponseChannel:
        """Record the answer as it goes to the client (until :meth:`cut`): an observer on
        ``channel`` (:class:`~serve.asgi.ResponseChannel`), whose token count is part of the
        answer's, on this tracker's clock. Returns ``channel``."""
        self._channel = channel
        channel.clock = self.clock
        sse, clock = self.sse, self.clock
        # Every chat event carries tokens (``SseDialect.tokens`` empty), and its end is the
        # suffix ``SseDialect.has_done`` tests for: inlined, no Python call each.
        every_event = not sse.tokens
        chat_end = CHAT_END if sse.chunks else None

        def tracked(message: Message) -> bool:
            if message["type"] == "http.response.body":
                chunk = message.get("body", b"")
                if chunk:
                    if not self.streaming or every_event or sse.carries_tokens(chunk):
                        now = clock()
                        if self.first_chunk_s is None:
                            self.first_chunk_s = now
                        self.last_chunk_s = now
                        self.chunks += 1
                    if not self.streaming:
                        if self.body is None:
                            self.body = bytearray()
                        if len(self.body) < 1 << 20:
                            self.body.extend(chunk)
                    else:
                        if not self.done_marker:
                            self.done_marker = (chunk.endswith(chat_end) if chat_end
                                                else sse.has_done(chunk))
                if not message.get("more_body", False):
                    self.finished = True
            elif message["type"] == "http.response.start":
                self.status = message["status"]
                self.streaming = is_event_stream(message)
            return False

        channel.observe(tracked)
        return channel

    @property
    def completed(self) -> bool:
        """The whole answer reached the client with HTTP 200 (a client that left before the
        end did not get it, whatever was sent after)."""
        if self.status != 200 or not self.finished or self.client_left or self.is_cut:
            return False
        return self.done_marker if self.streaming else True

    async def cut(self, message: str, retry_after_s: int) -> None:
        """End the answer now (the server drains or lost its engine): one error event of the
        dialect (a started stream), a 503 with ``Retry-After`` (not started), or the end of
        the body (a started non-streamed answer). The request is not counted as finished."""
        if self.finished or self.is_cut or self._channel is None:
            return
        self._channel.close()
        send = self._channel.emit
        if self.status is None:
            body = json.dumps(error_body(503, message, "service_unavailable")).encode()
            await send({"type": "http.response.start", "status": 503, "headers": [
                (b"content-type", b"application/json"),
                (b"retry-after", str(retry_after_s).encode())]})
            await send({"type": "http.response.body", "body": body, "more_body": False})
        elif self.streaming:
            await send({"type": "http.response.body", "more_body": False,
                        "body": self.sse.error_event(message)})
        else:
            await send({"type": "http.response.body", "body": b"", "more_body": False})

    def ttft_s(self) -> float | None:
        first = self.chunk_span()[1]
        return None if first is None else first - self.arrival

    def mean_itl_s(self) -> float | None:
        """Mean gap between streamed chunks after the first (one chunk per engine step); None
        before the stream's end marker (the channel does not time the chunks before it)."""
        if self.streaming and not self.done_marker:
            return None
        return _mean_gap(*self.chunk_span())

    def completion_tokens(self) -> int | None:
        """Answer tokens of a non-streamed response (``usage.completion_tokens``, or the
        Responses API's ``usage.output_tokens``)."""
        with contextlib.suppress(ValueError, TypeError, KeyError, AttributeError):
            usage = json.loads(bytes(self.body or b""))["usage"]
            return int(usage.get("completion_tokens", usage.get("output_tokens")))
        return None

    def answer_tokens(self) -> int | None:
        """The answer's tokens as they went out: a streamed answer's token events (one per
        engine step, so at most a few tokens short), a whole body's own usage (its JSON is
        parsed here: call once)."""
        return self.chunk_span()[0] if self.streaming else self.completion_tokens()

    def meets(self, slo: SloTargets, answer_tokens: int | None = None) -> bool:
        """Whether a completed request met its targets (``serve.admission.goodput``);
        ``answer_tokens``: :meth:`answer_tokens`, when the caller has it already."""
        chunks, first, last = self.chunk_span()
        if self.streaming:
            return streamed_good(None if first is None else first - self.arrival,
                                 _mean_gap(chunks, first, last), slo)
        e2e = None if last is None else last - self.arrival
        if answer_tokens is None:
            answer_tokens = self.completion_tokens()
        return non_streamed_good(e2e, answer_tokens or 1, slo)


def _mean_gap(chunks: int, first: float | None, last: float | None) -> float | None:
    """Mean seconds between ``chunks`` chunks sent from ``first`` to ``last`` (None for
    fewer than two)."""
    return (last - first) / (chunks - 1) if chunks > 1 else None


class AdmissionMiddleware:
    """Admission control + goodput accounting in front of vLLM's OpenAI app.

    Args:
        app: the wrapped ASGI app (vLLM's OpenAI app).
        limiter: the shared admission limiter.
        slo: latency targets (goodput and SLO shedding).
        metrics: where arrivals, refusals, queue waits, finishes, aborts, goodput and TTFT
            are counted.
        clock: monotonic clock, seconds.
        engine_alive: checked when a slot is granted; False: the request gets 503 instead of
            reaching a dead engine (a queued request can be granted the slot of one the dying
            engine just failed, before the gateway's watch notices).
    """

    def __init__(self, app: ASGIApp, limiter: AdmissionLimiter, slo: SloTargets,
                 metrics: Metrics, clock: Callable[[], float] = time.monotonic,
                 engine_alive: Callable[[], bool] | None = None) -> None:
        self.app = app
        self.engine_alive = engine_alive
        self.limiter = limiter
        self.slo = slo
        self.metrics = metrics
        self.clock = clock
        #: Admitted requests whose answer is not complete (cut when a drain times out).
        self.open: set[ResponseTracker] = set()

    async def cut_open(self, message: str, retry_after_s: int) -> int:
        """End every admitted request now (the drain deadline, ``serve.app``): a stream gets
        exactly one error event of its dialect, an answer not started a 503 with
        ``Retry-After``. Returns how many were cut."""
        trackers = list(self.open)
        for tracker in trackers:
            await tracker.cut(message, retry_after_s)
        return len(trackers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (scope["type"] != "http" or scope.get("method") != "POST"
                or scope.get("path") not in GENERATION_ROUTES):
            await self.app(scope, receive, send)
            return
        metrics = self.metrics
        arrival = self.clock()
        try:
            body = buffered_body(receive)
            if body is None:
                body = await read_body(receive)
                receive = replay(body, receive)
            metrics.requests.inc()
            tenant = scope.get(TENANT_SCOPE_KEY, ANONYMOUS)
            tokens, user = scope.get(PROMPT_TOKENS_SCOPE_KEY, 0), scope.get(USER_SCOPE_KEY)
            # The intake's count (serve.intake.middleware), in the request's shared state.
            image_tokens = (scope.get(REQUEST_STATE_KEY) or {}).get("image_tokens") or 0
            # While queued, the client's own messages tell a disconnect (not the body's replay).
            slot = (self.limiter.try_acquire(tokens, tenant.name, user, image_tokens)
                    or await self._acquire(receive.receive, tokens, tenant.name, tenant.weight,
                                           user, image_tokens))
        except ClientGone:
            return
        except Rejected as rej:
            metrics.images.observe(scope.get(IMAGES_SCOPE_KEY, 0))
            note(reject_reason=rej.reason, queue_wait_s=rej.queue_wait_s)  # the access record
            headers = {"Retry-After": str(rej.retry_after_s), "X-Phi3v-Reject-Reason": rej.reason}
            if rej.reason == UNAVAILABLE:  # shutting down or engine lost: not a rate limit
                response = openai_error(503, str(rej), type_="service_unavailable",
                                        headers=headers)
            else:
                metrics.rejected.labels(reason=rej.reason).inc()
                metrics.queue_wait.observe(rej.queue_wait_s)
                response = openai_error(429, str(rej), type_="rate_limit_exceeded",
                                        headers=headers)
            await response(scope, receive, send)
            return
        if self.engine_alive is not None and not self.engine_alive():
            metrics.images.observe(scope.get(IMAGES_SCOPE_KEY, 0))
            metrics.queue_wait.observe(slot.queue_wait_s)
            slot.release(completed=False)
            note(queue_wait_s=slot.queue_wait_s, reject_reason=UNAVAILABLE)
            await openai_error(503, ENGINE_LOST, type_="service_unavailable",
                               headers={"Retry-After": str(RETRY_AFTER_S)})(
                scope, receive, send)
            return
        tracker = ResponseTracker(arrival, self.clock, sse=dialect(scope.get("path")))
        self.open.add(tracker)
        channel = tracker.attach(response_channel(send, scope))
        # The slot and the request's counts are settled when the answer ends (its last
        # message sent), before its client's next request (serve.asgi.ResponseChannel.on_end).
        state = scope.get(REQUEST_STATE_KEY)
        images = scope.get(IMAGES_SCOPE_KEY, 0)
        channel.on_end(lambda failed: self._finished(tracker, slot, arrival, images, state))
        try:
            await self.app(scope, tracker.watch(receive, state), channel)
        except BaseException:
            channel.end(failed=True)
            raise
        channel.end()  # no-op after the last message: for an answer its client left

    def _finished(self, tracker: ResponseTracker, slot, arrival: float, images: int,
                  state: dict | None) -> None:
        """The answer of ``tracker`` ended: release ``slot`` and count the request (its
        ``images``, as the intake counted them; queue wait, finished, aborted, TTFT,
        goodput), noting its access record's fields in ``state`` (the gateway's per-request
        dict; None: the current request's, ``serve.logs.note``: the hook may run in another
        task, a drain's). Counting here rather than on arrival keeps the work off the path
        of the requests arriving meanwhile."""
        metrics = self.metrics
        note_ = note if state is None else state.update
        metrics.images.observe(images)
        metrics.queue_wait.observe(slot.queue_wait_s)
        note_(queue_wait_s=slot.queue_wait_s)
        self.open.discard(tracker)
        completed = tracker.completed
        first = tracker.chunk_span()[1]
        if not tracker.streaming:
            first = None
        slot.release(completed=completed, first_token_at=first)
        if tracker.client_left:
            metrics.aborted.inc()
        if first is not None:
            note_(first_token_s=first)
        # For the tenant's bill where vLLM reports no usage (serve.accounting).
        answer_tokens = tracker.answer_tokens()
        note_(answer_tokens=answer_tokens)
        if completed:
            metrics.finished.inc()
            if first is not None:
                metrics.ttft.observe(first - arrival)
            if tracker.meets(self.slo, answer_tokens):
                metrics.goodput.inc()
                note_(goodput=True)  # the tenant's goodput (serve.accounting)

    async def _acquire(self, receive: Receive, tokens: int = 0, tenant: str = DEFAULT_TENANT,
                       weight: float = 1.0, user: str | None = None, image_tokens: int = 0):
        """Wait for a slot (:meth:`AdmissionLimiter.try_acquire` found none free) for a request
        of ``tokens`` prompt tokens (the intake's estimate; 0: unknown), ``image_tokens`` of
        them image tokens, of ``tenant`` (weight ``weight``; ``user``: a trusted front end's
        end user, :meth:`AdmissionLimiter.acquire`), giving up (``ClientGone``) if the client
        disconnects while queued."""
        lim = self.limiter
        acquire = asyncio.ensure_future(lim.acquire(ttft_target_s=self.slo.ttft_s,
                                                    tokens=tokens, tenant=tenant,
                                                    weight=weight, user=user,
                                                    image_tokens=image_tokens))
        watch = asyncio.ensure_future(receive())
        try:
            await asyncio.wait({acquire, watch}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            acquire.cancel()
            watch.cancel()
            raise
        if acquire.done():
            watch.cancel()
            return acquire.result()  # a slot, or raises Rejected
        acquire.cancel()
        with contextlib.suppress(asyncio.CancelledError, Rejected):
            slot = await acquire
            slot.release(completed=False)  # granted in the same tick: hand it back
        raise ClientGone
