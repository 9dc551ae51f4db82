"""Small ASGI helpers shared by the request layers: buffered bodies and their replay, the
scope keys the layers share, and the one ``send`` wrapper of a response
(:class:`ResponseChannel`)."""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Generator
from typing import Protocol

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from serve.errors import openai_error

log = logging.getLogger("serve.asgi")

#: ASGI scope key carrying the request's image count from the intake to the layers behind it.
IMAGES_SCOPE_KEY = "phi3v.images"
#: ASGI scope key carrying the intake's estimate of the request's prompt tokens (image tokens
#: included; ``serve.intake.budget.PromptBudget.estimate``) to admission.
PROMPT_TOKENS_SCOPE_KEY = "phi3v.prompt_tokens"
#: ASGI scope key of the end hooks of the request's response (:meth:`ResponseChannel.on_end`),
#: shared by every channel of the request: an ASGI layer that wraps ``send`` between two of
#: ours (Starlette's CORS middleware does) makes the layers behind it use a channel of their
#: own (:func:`response_channel`), and the response still ends once, for all of them.
ENDS_SCOPE_KEY = "phi3v.ends"
#: ASGI scope key of a per-request dict shared by every layer (scope copies keep the same
#: dict): admission sets ``client_left`` there when the client disconnected before the answer;
#: the layers note there what the request's access record reports (``serve.logs``).
REQUEST_STATE_KEY = "phi3v.request"


class Gate(Protocol):
    """What :meth:`ResponseChannel.gate` takes: a filter in front of a response's observers."""

    def passes(self, message: Message) -> bool:
        """Whether ``message`` is an ordinary token chunk of a stream, which goes on as it is
        and is only counted (a plain call, run on every message)."""

    async def handle(self, message: Message) -> None:
        """Deal with a message :meth:`passes` held back, sending what it decides through
        :meth:`ResponseChannel.deliver`."""


class ResponseChannel:
    """The ``send`` of one HTTP response, shared by every request layer: one wrapper in
    front of the server's ``send`` however many layers watch or change the response.

    A layer that wrapped ``send`` added a coroutine call to every message, and a streamed
    answer is one message per token, on the event loop that streams every answer. A layer
    registers plain functions instead:

    - :meth:`gate`: one filter that sees each message the app sends first. A token chunk
      (``passes(message)`` true: the stream guard's O(1) test) goes straight to the server's
      ``send`` and is counted (:attr:`tokens`, :attr:`first_token_s`); any other message is
      handed to ``await handle(message)``, which sends what it decides through :meth:`deliver`;
    - :meth:`observe`: ``observer(message) -> bool`` sees every message :meth:`deliver`
      sends (all of them without a gate, all but the token chunks with one), before the
      head hooks; True drops the message;
    - :meth:`on_head`: ``hook(message) -> message``, applied to ``http.response.start``
      (response headers, status accounting), in registration order;
    - :meth:`close`: the server ended the answer; what the app sends after is dropped;
    - :meth:`on_end`: ``hook(failed)`` runs once when the response ends (:meth:`end`): at
      once after its last message (an ``http.response.body`` without ``more_body``) went to
      the server, else when a layer ends the request. The layers' accounting after an answer
      (slot release, billing, the access record) thus runs before the client, which has its
      whole answer, sends its next request, instead of after the app unwinds (Starlette's
      streaming response ends its task group some event-loop turns later), where it would
      delay the handling of the requests that then arrive.

    A streamed token thus costs two plain calls (this one and the gate's test) and no
    observer: the channel is a plain call that returns the server's ``send`` awaitable
    (:meth:`__call__`), so ``await channel(message)`` awaits the server's ``send``
    directly (as vLLM's own ``ScalingMiddleware`` passes its app's awaitable on), and the
    count replaces a timestamp per token for what the observers need of tokens (their
    number, the first one's time). :meth:`emit` sends a layer's own message past the gate
    and the observers (the head hooks still apply). Get a channel with
    :func:`response_channel`.

    Attributes:
        tokens: token chunks the gate passed (not seen by the observers).
        first_token_s: ``clock()`` when the first of them passed (None: none yet).
        clock: monotonic clock, seconds (an observer that times the answer sets its own).
    """

    __slots__ = ("_send", "_head_hooks", "_observers", "_gate", "_closed", "_ends", "tokens",
                 "first_token_s", "clock")

    def __init__(self, send: Send, clock: Callable[[], float] = time.monotonic,
                 ends: Ends | None = None) -> None:
        self._send = send
        self._head_hooks: list[Callable[[Message], Message]] = []
        self._observers: list[Callable[[Message], bool]] = []
        self._gate: Gate | None = None
        self._closed = False
        self._ends = ends if ends is not None else Ends()
        self.tokens = 0
        self.first_token_s: float | None = None
        self.clock = clock

    def on_head(self, hook: Callable[[Message], Message]) -> None:
        self._head_hooks.append(hook)

    def observe(self, observer: Callable[[Message], bool]) -> None:
        self._observers.append(observer)

    def gate(self, gate: Gate) -> None:
        """Put ``gate`` in front of the observers.

        Raises:
            ValueError: the channel has a gate already (one filter decides per response).
        """
        if self._gate is not None:
            raise ValueError("this response already has a gate")
        self._gate = gate

    def close(self) -> None:
        """Drop every message the app sends from now on (the server ended the answer with
        :meth:`emit`)."""
        self._closed = True

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    def on_end(self, hook: Callable[[bool], None]) -> None:
        """Run ``hook(failed)`` when the response ends (:meth:`end`); hooks run in reverse
        order of registration (the innermost layer's first, as its ``finally`` would)."""
        self._ends.hooks.append(hook)

    def end(self, failed: bool = False) -> None:
        """The response ended (``failed``: an exception ended it): run the end hooks, once
        (a later call does nothing). A hook that raises is logged and the others still run:
        a hook may run inside the app's ``send``, where an error of ours must not become the
        app's."""
        ends = self._ends
        if ends.ended:
            return
        ends.ended = True
        hooks, ends.hooks = ends.hooks, []
        for hook in reversed(hooks):
            try:
                hook(failed)
            except Exception:
                log.exception("an end-of-response hook failed")

    def __call__(self, message: Message) -> Awaitable[None]:
        """``send(message)``: a plain call that returns the awaitable of what goes on (the
        server's ``send``, the gate's ``handle``), so a streamed token costs no coroutine
        frame of ours. ASGI asks only that ``send`` be awaitable."""
        if self._closed:
            return _DROPPED
        gate = self._gate
        if gate is not None:
            if gate.passes(message):  # a token chunk: counted, straight on
                if not self.tokens:
                    self.first_token_s = self.clock()
                self.tokens += 1
                return self._send(message)
            return gate.handle(message)
        # deliver(), inlined: a plain call here too.
        for observer in self._observers:
            if observer(message):
                return _DROPPED
        kind = message["type"]
        if kind == "http.response.start":
            message = self._headed(message)
        elif kind == "http.response.body" and not message.get("more_body", False):
            return self._send_last(message)
        return self._send(message)

    async def _send_last(self, message: Message) -> None:
        """Send the response's last message, then :meth:`end` (not when the send raised:
        the layer that sees the error ends it as failed), then let go of the layers' gate,
        observers and hooks (the answer is complete; what the app sends after, a task it
        left behind, is dropped): the references between the channel and its layers'
        per-request objects then form no cycles, which only the garbage collector would
        free, with a pass over every young object of the process."""
        await self._send(message)
        self.end()
        self._gate = _AFTER_END
        self._observers = []
        self._head_hooks = []

    async def deliver(self, message: Message) -> None:
        """Send ``message`` past the gate: the observers see it, then the head hooks apply
        (what a gate sends on)."""
        if self._closed:
            return
        for observer in self._observers:
            if observer(message):
                return
        await self.emit(message)

    async def emit(self, message: Message) -> None:
        """Send a layer's own message (the gate and the observers do not see it)."""
        kind = message["type"]
        if kind == "http.response.start":
            message = self._headed(message)
        elif kind == "http.response.body" and not message.get("more_body", False):
            await self._send_last(message)
            return
        await self._send(message)

    def _headed(self, message: Message) -> Message:
        """``message`` (an ``http.response.start``) after the head hooks."""
        for hook in self._head_hooks:
            message = hook(message)
        return message


class Ends:
    """The end hooks of one response (:meth:`ResponseChannel.on_end`), shared by its
    channels (:data:`ENDS_SCOPE_KEY`)."""

    __slots__ = ("hooks", "ended")

    def __init__(self) -> None:
        self.hooks: list[Callable[[bool], None]] = []
        self.ended = False


class _Done:
    """An awaitable that completes at once with None (a message an observer dropped)."""

    __slots__ = ()

    def __await__(self) -> Generator[None, None, None]:
        return
        yield  # a generator: awaiting it finishes without suspending


#: What :meth:`ResponseChannel.__call__` returns for a message it does not send on.
_DROPPED = _Done()


class _AfterEnd:
    """The gate of a channel whose response ended: every message is dropped."""

    __slots__ = ()

    def passes(self, message: Message) -> bool:
        return False

    def handle(self, message: Message) -> Awaitable[None]:
        return _DROPPED


_AFTER_END = _AfterEnd()


def response_channel(send: Send, scope: Scope | None = None) -> ResponseChannel:
    """``send`` itself when it is a :class:`ResponseChannel` (the gateway makes one per HTTP
    request), else a new channel around it (a layer used on its own, or behind a layer that
    wraps ``send``) sharing the end hooks of ``scope``'s request (:data:`ENDS_SCOPE_KEY`; a
    first channel puts its own there)."""
    if isinstance(send, ResponseChannel):
        return send
    if scope is None:
        return ResponseChannel(send)
    ends = scope.get(ENDS_SCOPE_KEY)
    channel = ResponseChannel(send, ends=ends)
    if ends is None:
        scope[ENDS_SCOPE_KEY] = channel._ends
    return channel


class ClientGone(Exception):
    """The client disconnected before its request was handled."""


class BodyTooLarge(Exception):
    """The request body exceeds the configured limit."""


async def read_body(receive: Receive, limit: int | None = None) -> bytes:
    """The whole request body.

    Raises:
        ClientGone: the client disconnected.
        BodyTooLarge: more than ``limit`` bytes arrived.
    """
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        chunk = message.get("body", b"")
        size += len(chunk)
        if limit is not None and size > limit:
            raise BodyTooLarge
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


class Replay:
    """A ``receive`` that yields a buffered body once, then the client's real messages (so
    the app still sees ``http.disconnect`` and vLLM aborts the engine request). Make one
    with :func:`replay`.

    Attributes:
        body: the buffered body (bytes).
        receive: the client's ``receive``.
        sent: the body was yielded.
    """

    __slots__ = ("body", "receive", "sent")

    def __init__(self, body: bytes, receive: Receive) -> None:
        self.body = body
        self.receive = receive
        self.sent = False

    async def __call__(self) -> Message:
        if not self.sent:
            self.sent = True
            return {"type": "http.request", "body": self.body, "more_body": False}
        return await self.receive()


def replay(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that yields ``body`` once, then the client's real messages. In front of
    a replay not yet read (a layer in front buffered the body): that replay itself when it
    holds ``body``, else a replay of ``body`` in its place (the app sees one body)."""
    if type(receive) is Replay and not receive.sent:
        if receive.body is body:
            return receive
        receive = receive.receive
    return Replay(body, receive)


def buffered_body(receive: Receive) -> bytes | None:
    """The body of ``receive`` when it is a :class:`Replay` not yet read (a layer in front
    buffered the body), without reading it; None: read it (:func:`read_body`)."""
    return receive.body if type(receive) is Replay and not receive.sent else None


def with_content_length(scope: Scope, length: int) -> Scope:
    """``scope`` with its ``content-length`` header replaced (after a body rewrite)."""
    headers = [(k, v) for k, v in scope.get("headers", []) if k.lower() != b"content-length"]
    headers.append((b"content-length", str(length).encode()))
    return {**scope, "headers": headers}


class BodyLimitMiddleware:
    """Buffers request bodies up to ``max_bytes``; a larger body is 413 (checked from
    ``Content-Length`` first, then counted as it streams in)."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers", [])).get(b"content-length")
        try:
            if declared is not None and int(declared) > self.max_bytes:
                raise BodyTooLarge
            body = await read_body(receive, self.max_bytes)
        except BodyTooLarge:
            await openai_error(413, f"request body exceeds {self.max_bytes} bytes",
                               param=None)(scope, receive, send)
            return
        except ClientGone:
            return
        except ValueError:
            await openai_error(400, "invalid Content-Length header")(scope, receive, send)
            return
        await self.app(scope, replay(body, receive), send)
