"""HTTP/1.1 connection limits below the app, in one uvicorn protocol class
(:func:`bounded_http_protocol`; flags in ``serve.settings``, README "Connection limits"):

1. **Head size.** A request head (request line and headers) over ``--max-header-bytes``, or
   with more than ``--max-header-count`` header fields, is 431
   (RFC 6585) and the connection closed. uvicorn's httptools parser buffers a header of any
   size before the app sees it (its h11 parser answers a plain 400); here the head's bytes are
   counted as they arrive, so a 1 MB header costs at most the limit plus one read of memory.
   A chunked body's trailer fields count against the same limit (uvicorn adds them to the
   request's headers).
2. **Head time.** A head must be complete ``--http-head-timeout-s`` after its first byte
   (blank lines before it included, which the parser skips: trickled CRLFs hold nothing);
   else 408 (RFC 9110 15.5.9) and the connection closed.
3. **Body time.** A body must be complete ``--http-body-timeout-s`` after its head, plus one
   second per ``--http-body-min-rate-bytes-s`` bytes received (:class:`ReceiveDeadline`);
   else 408 and the connection closed. Time the server itself holds the body back (uvicorn
   stops reading while the app has not taken what came: flow control, a pipelined request, a
   100-continue not sent yet) restarts the deadline instead.
4. **Silence.** A connection that sends nothing ``--http-first-request-timeout-s`` after it
   opens is closed without an answer (there is no request to answer).
5. **Connection cap.** At ``--max-connections`` open connections a new one closes the idle
   connection nearest its idle timeout (silent since it opened, or between requests: nginx
   reuses connections the same way); with none idle, the connection receiving a request head
   nearest its head deadline (the one trickling its head longest; 408, as at its head
   timeout), so clients holding heads open cannot lock others out (a liveness probe among
   them); with neither the new one gets a 503 and is closed. A connection whose request is
   being served or whose body is being received is never closed for room.

A deadline covers receiving a request only, never the answer: when one passes while an answer
is on its way (a response started, or the app still working on an earlier request of the
connection), the connection closes after that answer; a 408 is written only when none is.
Keep-alive between requests is uvicorn's own ``timeout_keep_alive``
(``--http-keep-alive-timeout-s``).

uvicorn's ``limit_concurrency`` is not the cap: it answers its own plain-text 503 (which no
counter of ours sees) only once a request head is complete, so connections that never send
one are not bounded by it, and it counts running requests too, which admission control
(``serve/admission``) already bounds with answers clients can act on. ``backlog`` bounds only
the connections the kernel holds before they are accepted; ``h11_max_incomplete_event_size``
applies to the h11 parser, not httptools.
"""

from __future__ import annotations

import asyncio
import http
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from serve.errors import RETRY_AFTER_S, error_body

if TYPE_CHECKING:
    from serve.settings import Settings

END_OF_HEAD = b"\r\n\r\n"

#: ``on_refused(status, path)``: an answer written below the app (``path`` None when the head
#: was not read), for ``phi3v_http_responses_total``.
OnRefused = Callable[[int, "str | None"], None]


@dataclass(frozen=True)
class ConnectionLimits:
    """The limits :func:`bounded_http_protocol` enforces; each is the ``Settings`` field of
    the same name, where its default is explained (bytes, seconds, connections)."""

    max_header_bytes: int
    http_head_timeout_s: float
    http_body_timeout_s: float
    http_body_min_rate_bytes_s: float
    http_first_request_timeout_s: float
    max_connections: int
    max_header_count: int = 256

    @classmethod
    def from_settings(cls, settings: Settings) -> ConnectionLimits:
        return cls(**{name: getattr(settings, name) for name in cls.__dataclass_fields__})


class ReceiveDeadline:
    """When the rest of a request part must have arrived, on a monotonic clock (seconds):
    ``timeout_s`` after it starts, plus ``1 / min_rate_bytes_s`` seconds per byte received
    (Apache mod_reqtimeout's rule). A client that keeps up ``min_rate_bytes_s`` on average
    never reaches it; one that trickles does about ``timeout_s`` after it starts. Without
    ``min_rate_bytes_s`` the deadline is flat.
    """

    __slots__ = ("at", "timeout_s", "s_per_byte")

    def __init__(self, now: float, timeout_s: float, min_rate_bytes_s: float | None = None
                 ) -> None:
        self.timeout_s = timeout_s
        self.s_per_byte = 1 / min_rate_bytes_s if min_rate_bytes_s else 0.0
        self.at = now + timeout_s

    def received(self, nbytes: int) -> None:
        """``nbytes`` more bytes arrived: the deadline moves on by their share of time."""
        self.at += nbytes * self.s_per_byte

    def restart(self, now: float) -> None:
        """The whole ``timeout_s`` again from ``now`` (the server, not the client, was the
        one holding the request back)."""
        self.at = max(self.at, now + self.timeout_s)


def raw_response(status: int, message: str) -> bytes:
    """An OpenAI-style JSON error answer with ``Connection: close``, as the bytes written to a
    connection below the app (503s also carry ``Retry-After``)."""
    type_ = "service_unavailable" if status == 503 else "invalid_request_error"
    body = json.dumps(error_body(status, message, type_)).encode()
    retry = f"retry-after: {RETRY_AFTER_S}\r\n" if status == 503 else ""
    return (f"HTTP/1.1 {status} {http.HTTPStatus(status).phrase}\r\n"
            "content-type: application/json\r\n"
            f"content-length: {len(body)}\r\n{retry}"
            "connection: close\r\n\r\n").encode() + body


def bounded_http_protocol(limits: ConnectionLimits, on_refused: OnRefused | None = None
                          ) -> type[HttpToolsProtocol]:
    """A uvicorn HTTP protocol class (``uvicorn.Config(http=...)``) enforcing ``limits``
    (module docstring); ``on_refused(status, path)`` is called for each answer it writes
    itself (the gateway counts them in ``phi3v_http_responses_total``: the app never sees
    them)."""

    def refused(status: int, path: str | None) -> None:
        if on_refused is not None:
            on_refused(status, path)

    class BoundedProtocol(HttpToolsProtocol):
        """uvicorn's httptools protocol with the connection limits of ``serve.http_limits``."""

        head_bytes = 0  # bytes of the current request's head received so far
        in_head = True  # the head of the current request is not complete yet
        deadline: ReceiveDeadline | None = None  # of the head or body being received
        timer: asyncio.TimerHandle | None = None  # fires at deadline.at

        # --- rule 5 (cap) and rule 4 (silence) ------------------------------------------------
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            if (len(self.connections) >= limits.max_connections and not self.close_an_idle()
                    and not self.close_a_head()):
                refused(503, None)
                transport.write(raw_response(
                    503, f"the server holds {limits.max_connections} connections"))
                transport.close()
                return  # never added to uvicorn's connections: connection_lost skips uvicorn
            super().connection_made(transport)
            # uvicorn's keep-alive timer, armed before the first request too: it closes the
            # connection, any byte received cancels it.
            self.timeout_keep_alive_task = self.loop.call_later(
                limits.http_first_request_timeout_s, self.timeout_keep_alive_handler)

        def close_an_idle(self) -> bool:
            """Close the idle connection whose idle timer fires first (a silent one before a
            kept-alive one); False when none is idle."""
            # uvicorn's set holds websocket connections too, which have no keep-alive timer
            idle = [c for c in self.connections
                    if getattr(c, "timeout_keep_alive_task", None) is not None
                    and not c.transport.is_closing()]
            if not idle:
                return False
            oldest = min(idle, key=lambda c: c.timeout_keep_alive_task.when())
            oldest._unset_keepalive_if_required()
            oldest.transport.close()
            return True

        def close_a_head(self) -> bool:
            """Close the connection whose request head has begun and not ended, with no
            request of it being served, nearest its head deadline (the one trickling longest);
            False when none is receiving a head."""
            heads = [c for c in self.connections
                     if getattr(c, "in_head", False) and c.deadline is not None
                     and (c.cycle is None or c.cycle.response_complete)
                     and not c.transport.is_closing()]
            if not heads:
                return False
            oldest = min(heads, key=lambda c: c.deadline.at)
            oldest.stop_deadline()
            # The answer its head timeout gives (rule 2): a 408 tells the client its request
            # was not taken, so it may send it again (RFC 9110 15.5.9), where a silent close
            # looks like a failure on the way; and it is counted like the 408s of rule 2.
            oldest.refuse(408, "request headers not complete when the server, at its "
                          f"{limits.max_connections} connections, needed the connection")
            return True

        def connection_lost(self, exc: Exception | None) -> None:
            self.stop_deadline()
            if self.transport is not None:  # None: refused at the cap
                super().connection_lost(exc)
                # uvicorn cancels the keep-alive timer only on a clean close: after a reset
                # the pending timer would hold this connection (its headers included) for
                # the whole --http-keep-alive-timeout-s.
                self._unset_keepalive_if_required()

        # --- rules 1 and 2 (head) -------------------------------------------------------------
        def data_received(self, data: bytes) -> None:
            if self.in_head:
                if self.timer is None:  # the first byte of a head
                    self.start_deadline(ReceiveDeadline(self.loop.time(),
                                                        limits.http_head_timeout_s))
                end = data.find(END_OF_HEAD)
                self.head_bytes += len(data) if end < 0 else end + len(END_OF_HEAD)
                if self.head_bytes > limits.max_header_bytes:
                    self.refuse(431, f"request headers exceed {limits.max_header_bytes} bytes")
                    return
            super().data_received(data)

        def on_message_begin(self) -> None:
            # A request that begins in the same read as the end of the previous one: its
            # head gets its deadline here (data_received saw a running deadline).
            if self.timer is None:
                self.start_deadline(ReceiveDeadline(self.loop.time(),
                                                    limits.http_head_timeout_s))
            super().on_message_begin()

        def on_header(self, name: bytes, value: bytes) -> None:
            if self.in_head and len(self.headers) >= limits.max_header_count:
                if not self.transport.is_closing():
                    self.refuse(431, f"more than {limits.max_header_count} request headers")
                return
            if not self.in_head:
                # A chunked body's trailer fields: httptools hands them here and uvicorn adds
                # them to the request's headers, so they count against the head limit too.
                if self.transport.is_closing():
                    return
                self.head_bytes += len(name) + len(value) + 4
                if self.head_bytes > limits.max_header_bytes:
                    self.refuse(431, f"request headers and trailers exceed "
                                f"{limits.max_header_bytes} bytes")
                    return
            super().on_header(name, value)

        # --- rule 3 (body) --------------------------------------------------------------------
        def on_headers_complete(self) -> None:
            self.in_head = False
            self.start_deadline(ReceiveDeadline(self.loop.time(), limits.http_body_timeout_s,
                                                limits.http_body_min_rate_bytes_s))
            super().on_headers_complete()

        def on_body(self, body: bytes) -> None:
            if self.deadline is not None:
                self.deadline.received(len(body))
            super().on_body(body)

        def on_message_complete(self) -> None:
            super().on_message_complete()
            self.in_head, self.head_bytes = True, 0
            self.stop_deadline()

        def handle_websocket_upgrade(self) -> None:
            self.stop_deadline()  # the connection is no longer an HTTP request's
            super().handle_websocket_upgrade()

        # --- deadlines ------------------------------------------------------------------------
        def start_deadline(self, deadline: ReceiveDeadline) -> None:
            self.stop_deadline()
            self.deadline = deadline
            self.timer = self.loop.call_at(deadline.at, self.check_deadline)

        def stop_deadline(self) -> None:
            if self.timer is not None:
                self.timer.cancel()
            self.timer = self.deadline = None

        def check_deadline(self) -> None:
            """The timer fired: wait on if the deadline moved (bytes arrived) or the server
            is holding the request back, else :meth:`expire`."""
            deadline, now = self.deadline, self.loop.time()
            cycle = self.cycle
            if self.flow.read_paused or (not self.in_head and cycle is not None
                                         and cycle.waiting_for_100_continue):
                deadline.restart(now)
            if now < deadline.at:
                self.timer = self.loop.call_at(deadline.at, self.check_deadline)
                return
            self.timer = self.deadline = None
            self.expire()

        def expire(self) -> None:
            """A head or body missed its deadline: 408 and close, unless an answer is on its
            way (then close after it) or this request was answered already (close now)."""
            cycle = self.cycle
            if cycle is not None and not cycle.response_complete:
                if cycle.response_started or self.in_head:
                    cycle.keep_alive = False  # uvicorn closes the connection after the answer
                    return
                path = cycle.scope.get("path")
            elif not self.in_head:  # answered before its body came (a 413 from the length)
                self.transport.close()
                return
            else:
                path = None
            self.refuse(408, "request headers not received in time" if self.in_head else
                        "request body not received in time (slower than "
                        f"{limits.http_body_min_rate_bytes_s:g} bytes/s)", path)

        def refuse(self, status: int, message: str, path: str | None = None) -> None:
            """Answer ``status`` below the app and close the connection."""
            refused(status, path)
            self.transport.write(raw_response(status, message))
            self.transport.close()

    return BoundedProtocol
