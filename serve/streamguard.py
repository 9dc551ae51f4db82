"""Stream guard: an SSE answer ends either normally or with exactly one error event.

Once a streamed response has started (HTTP 200 sent), an error can no longer change the
status. The rule then is: exactly one error event (``data: {"error": {...}}`` for chat and
completions, ``event: error`` for the Responses API: ``serve.sse``), then the stream ends;
never a truncated answer that looks like a normal stop. This ASGI piece enforces it around
vLLM's app:

- vLLM's own error event passes through; what follows it (vLLM's ``data: [DONE]``) is dropped.
- A chat/completions choice finishing with ``finish_reason`` ``"abort"`` or ``"error"``
  (engine-side abort) becomes one error event.
- An exception raised by the app after the stream started becomes one error event.
- A stream that ends without its normal end (``[DONE]``, ``response.completed``) and without
  an error gets one error event.
- A chunk that carries nothing (an empty ``content`` delta with no role, no finish reason),
  which vLLM sends after the role chunk when ``stop`` is set, is dropped.
- A Responses stream cut by ``max_output_tokens`` ends with the event the server's
  ``--responses-incomplete-event`` names: ``response.completed`` (the default) or
  ``response.incomplete`` (why each: ``serve.sse``). vLLM 0.32 sends ``response.completed``
  whatever the status; its response says ``status: incomplete`` either way.

Every ``text/event-stream`` response also gets ``Cache-Control: no-cache`` and
``X-Accel-Buffering: no`` (:data:`SSE_HEADERS`).
"""

from __future__ import annotations

import json
import logging
import re

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from serve.asgi import ResponseChannel, response_channel
from serve.sse import CHAT_END, INCOMPLETE_EVENTS, SseDialect, dialect, is_event_stream

log = logging.getLogger("serve.streamguard")

ABNORMAL_FINISH = ("abort", "error")
#: Bytes without which an event can be neither an error nor an abnormal finish: vLLM writes
#: compact JSON, so ``"error"`` (key or finish reason) and ``"abort"`` appear verbatim, while a
#: quote inside answer text is escaped (``\"error\"``) and cannot match.
_MARKERS = tuple(f'"{word}"'.encode() for word in ABNORMAL_FINISH)
#: The markers as one search (one pass over the chunk instead of one per marker).
_ABNORMAL_PATTERN = re.compile(b"|".join(re.escape(m) for m in _MARKERS))
#: What an empty delta holds (:func:`empty_delta`): in compact JSON ``:""`` is only ever an
#: empty string value.
EMPTY_CONTENT = b'"content":""'
#: The delta of vLLM's first chat event, which names the role: it holds
#: :data:`EMPTY_CONTENT` but carries the role, so it is no empty delta.
ROLE_DELTA = b'"delta":{"role":"assistant",' + EMPTY_CONTENT + b"}"


def needs_parse(data: bytes) -> bool:
    """Whether chat events ``data`` may hold an error, an abnormal finish or an empty delta,
    which the guard must parse: an abnormal marker (:data:`_MARKERS`), or an empty content
    outside a role delta (each :data:`ROLE_DELTA` holds one :data:`EMPTY_CONTENT`). Every
    other event passes untouched, the role event included: two C-level counts, no JSON."""
    return (_ABNORMAL_PATTERN.search(data) is not None
            or data.count(EMPTY_CONTENT) != data.count(ROLE_DELTA))


#: How vLLM 0.32 ends an ordinary token event, one per message (its generators yield each
#: ``data: {...}\n\n`` on its own): chat, then completions. ``"finish_reason":null`` rules out
#: an abnormal finish, and the chunk object has no ``error`` key. (Compact JSON: a quote or a
#: newline inside answer text is escaped, so answer text cannot end an event like this.)
TOKEN_EVENT_ENDS = (b'"finish_reason":null,"token_ids":null}]}\n\n',
                    b'"finish_reason":null,"stop_reason":null,"prompt_token_ids":null,'
                    b'"token_ids":null}]}\n\n')
#: A chat token event whose delta's last value is an empty string (``"content":""``): parsed
#: (:func:`empty_delta`). In compact JSON ``:""}`` is only ever an empty string value.
EMPTY_EVENT_END = b':""},"logprobs":null,' + TOKEN_EVENT_ENDS[0]


def ordinary_chunk(chunk: bytes) -> bool:
    """Whether a message body is whole chat events (nothing buffered before it) that the guard
    passes on as they are: holding no parse marker and not the end (``data: [DONE]``, after
    which the guard drops everything).

    Runs on every streamed token, so the common message is told in O(1): one event (its first
    newline is its last two bytes; compact JSON holds no raw newline) ending as vLLM ends a
    token event (:data:`TOKEN_EVENT_ENDS`), not an empty delta (:data:`EMPTY_EVENT_END`):
    ~0.85 us for a 230-byte chunk on the CPU machine (suffix tests and one ``memchr``), where
    the general test (any other message) is a regex scan for the markers and two counts
    (:func:`needs_parse`)."""
    if (chunk.endswith(TOKEN_EVENT_ENDS) and chunk.find(b"\n") == len(chunk) - 2
            and not chunk.endswith(EMPTY_EVENT_END)):
        return True
    return chunk.endswith(b"\n\n") and CHAT_END not in chunk and not needs_parse(chunk)


class _Stream:
    """State of one SSE response passing through the guard."""

    def __init__(self, send: Send, sse: SseDialect,
                 incomplete_event: str = INCOMPLETE_EVENTS[0]) -> None:
        self.send = send
        self.sse = sse
        self.incomplete_event = incomplete_event
        self.buffer = b""
        self.closed = False  # an error event was sent, or the normal end
        self.events = 0  # events sent (the next Responses sequence_number)

    async def emit(self, data: bytes, more: bool = True) -> None:
        if data:
            self.events += 1
        await self.send({"type": "http.response.body", "body": data, "more_body": more})

    async def fail(self, message: str) -> None:
        if not self.closed:
            self.closed = True
            await self.emit(self.sse.error_event(message, self.events))

    async def feed(self, chunk: bytes) -> None:
        """Forward complete events until the stream is closed."""
        if not self.buffer and chunk.endswith(b"\n\n") and chunk.count(b"\n\n") == 1:
            if not self.closed:  # the common case: one whole event per message, no copies
                await self._event(chunk)
            return
        self.buffer += chunk
        while b"\n\n" in self.buffer and not self.closed:
            event, self.buffer = self.buffer.split(b"\n\n", 1)
            await self._event(event + b"\n\n")

    async def _event(self, event: bytes) -> None:
        if not self.sse.chunks:  # Responses API: typed events
            self.closed = event.startswith(self.sse.done + self.sse.error)
            if event.startswith(END_EVENTS):
                event = incomplete_end_as(event, self.incomplete_event)
            await self.emit(event)
            return
        payload = event.strip()
        if payload.startswith(b"data: "):
            payload = payload[len(b"data: "):]
        if payload == b"[DONE]":
            self.closed = True
            await self.emit(event)
            return
        if not needs_parse(payload):
            await self.emit(event)  # an ordinary chunk: no JSON parse on the hot path
            return
        try:
            data = json.loads(payload)
        except ValueError:
            await self.emit(event)
            return
        if isinstance(data, dict) and "error" in data:
            self.closed = True
            await self.emit(event)
            return
        reasons = [c.get("finish_reason") for c in data.get("choices") or []
                   if isinstance(c, dict)] if isinstance(data, dict) else []
        abnormal = [r for r in reasons if r in ABNORMAL_FINISH]
        if abnormal:
            await self.fail(f"generation ended abnormally (finish_reason={abnormal[0]!r})")
            return
        if empty_delta(data):
            return  # a chunk that carries nothing (vLLM sends one when `stop` is set)
        await self.emit(event)


#: The events that end a Responses answer normally, as vLLM writes their first line.
END_EVENTS = (b"event: response.completed\n", b"event: response.incomplete\n")


def incomplete_end_as(event: bytes, name: str) -> bytes:
    """The end event of a Responses stream (one of :data:`END_EVENTS`) with the event name
    ``response.<name>`` when its response is ``incomplete`` (cut by ``max_output_tokens``),
    ``name`` being one of :data:`serve.sse.INCOMPLETE_EVENTS` (the choice and its sources are
    in ``serve.sse``). A completed response's event, and an event that is not JSON, pass
    unchanged. Runs once per stream."""
    head, _, payload = event.partition(b"\n")
    try:
        data = json.loads(payload.strip().removeprefix(b"data: "))
    except ValueError:
        return event
    if not isinstance(data, dict) or (data.get("response") or {}).get("status") != "incomplete":
        return event
    wanted = f"response.{name}"
    if head == f"event: {wanted}".encode() and data.get("type") == wanted:
        return event
    data["type"] = wanted
    return f"event: {wanted}\ndata: ".encode() + json.dumps(data).encode() + b"\n\n"


def empty_delta(data) -> bool:
    """A chat chunk that carries nothing: every choice's delta is empty (``content: ""``, no
    role, no tool calls), with no finish reason and no logprobs, and no usage."""
    if not isinstance(data, dict) or data.get("usage") \
            or data.get("object") != "chat.completion.chunk":
        return False
    choices = data.get("choices") or []
    return bool(choices) and all(
        isinstance(c, dict) and c.get("finish_reason") is None and not c.get("logprobs")
        and not any(v not in (None, "", []) for v in (c.get("delta") or {}).values())
        for c in choices)


#: Headers every ``text/event-stream`` response carries, so that nginx and other proxies pass
#: events on at once instead of buffering them (nginx honours ``X-Accel-Buffering``).
SSE_HEADERS = ((b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no"))


def no_buffering(headers) -> list[tuple[bytes, bytes]]:
    """``headers`` with :data:`SSE_HEADERS` set (replacing any earlier value)."""
    names = {name for name, _ in SSE_HEADERS}
    return [(k, v) for k, v in headers if k.lower() not in names] + list(SSE_HEADERS)


class _Guard:
    """The guard of one response: the gate of its :class:`~serve.asgi.ResponseChannel`
    (a token chunk passes in :meth:`passes`, a plain call; the rest goes to :meth:`handle`)."""

    __slots__ = ("channel", "sse", "incomplete_event", "stream", "finished", "open_chunks")

    def __init__(self, channel: ResponseChannel, sse: SseDialect,
                 incomplete_event: str = INCOMPLETE_EVENTS[0]) -> None:
        self.channel = channel
        self.sse = sse
        self.incomplete_event = incomplete_event
        self.stream: _Stream | None = None  # an SSE answer with status 200
        self.finished = False  # its last message was sent
        #: A chat/completions stream has started, holds no partial event and is not closed:
        #: a token chunk may pass (:meth:`passes`). Only :meth:`handle` changes the stream,
        #: so it sets this after each message.
        self.open_chunks = False

    def passes(self, message: Message) -> bool:
        """Whether ``message`` is an ordinary chat/completions chunk of a started stream
        (:func:`ordinary_chunk`), which goes on as vLLM sent it; everything else (the start,
        the end, an answer that is no stream, Responses events) goes to :meth:`handle`."""
        # The hot path: one ordinary token chunk goes on as vLLM sent it. (Its event is not
        # counted: the count numbers Responses events, which never take this path.) Only a
        # body message has ``more_body``, and a stream's last one has it false.
        if not (self.open_chunks and message.get("more_body", False)):
            return False
        chunk = message.get("body", b"")
        # ordinary_chunk's O(1) token test, inlined (no Python call per token); any other
        # message takes the whole test.
        return ((chunk.endswith(TOKEN_EVENT_ENDS) and chunk.find(b"\n") == len(chunk) - 2
                 and not chunk.endswith(EMPTY_EVENT_END)) or ordinary_chunk(chunk))

    async def handle(self, message: Message) -> None:
        try:
            await self._handle(message)
        finally:
            stream = self.stream
            self.open_chunks = (stream is not None and stream.sse.chunks and not stream.buffer
                                and not stream.closed)

    async def _handle(self, message: Message) -> None:
        stream = self.stream
        if message["type"] == "http.response.start":
            if is_event_stream(message):
                message = {**message, "headers": no_buffering(message.get("headers") or [])}
                if message.get("status") == 200:
                    self.stream = _Stream(self.channel.deliver, self.sse,
                                          self.incomplete_event)
            await self.channel.deliver(message)
        elif message["type"] == "http.response.body" and stream is not None:
            await stream.feed(message.get("body", b""))
            if not message.get("more_body", False):
                await stream.fail("stream ended before completion")
                await stream.emit(b"", more=False)
                self.finished = True
        else:
            await self.channel.deliver(message)


class StreamGuardMiddleware:
    """Enforces the stream-error rule (module docstring) on ``text/event-stream`` responses:
    the gate of the response's channel (``serve.asgi.ResponseChannel``), so a token costs no
    coroutine layer of its own.

    Args:
        app: the next ASGI app (vLLM's).
        incomplete_event: how a Responses stream cut by ``max_output_tokens`` ends, one of
            :data:`serve.sse.INCOMPLETE_EVENTS` (``--responses-incomplete-event``).

    Raises:
        ValueError: an ``incomplete_event`` not in :data:`serve.sse.INCOMPLETE_EVENTS`.
    """

    def __init__(self, app: ASGIApp, incomplete_event: str = INCOMPLETE_EVENTS[0]) -> None:
        if incomplete_event not in INCOMPLETE_EVENTS:
            raise ValueError(f"incomplete_event must be one of {INCOMPLETE_EVENTS}; "
                             f"got {incomplete_event!r}")
        self.app = app
        self.incomplete_event = incomplete_event

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        channel = response_channel(send, scope)
        guard = _Guard(channel, dialect(scope.get("path")), self.incomplete_event)
        channel.gate(guard)
        try:
            await self.app(scope, receive, channel)
        except Exception:
            stream = guard.stream
            guard.open_chunks = False  # a token sent after this (a leftover task's) is dropped
            if channel.closed:  # the server had ended the answer (a drain's cut): sent in full
                log.warning("the app failed after its answer was ended", exc_info=True)
                return
            if stream is None or guard.finished:
                raise
            log.exception("streamed response failed after it started")
            await stream.fail("internal error while streaming the answer")
            await stream.emit(b"", more=False)
