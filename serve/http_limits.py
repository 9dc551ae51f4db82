"""HTTP/1.1 request-head limit: a request line plus headers over the limit is answered 431
(RFC 6585, "Request Header Fields Too Large") and the connection closed.

uvicorn's default parser (httptools) buffers a header of any size before the app sees it,
and its h11 parser answers such a request with a plain 400. This protocol counts the bytes of
the request head as they arrive and stops at the limit, so a 1 MB header costs at most the
limit plus one read of memory.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from serve.errors import error_body

END_OF_HEAD = b"\r\n\r\n"


def bounded_head_protocol(max_head_bytes: int, on_refused: Callable[[], None] | None = None
                          ) -> type[HttpToolsProtocol]:
    """A uvicorn HTTP protocol class (``uvicorn.Config(http=...)``) answering 431 to a
    request whose head is over ``max_head_bytes`` bytes; ``on_refused`` is called for each
    (the gateway counts it in ``phi3v_http_responses_total``: the app never sees it)."""

    class BoundedHeadProtocol(HttpToolsProtocol):
        """uvicorn's httptools protocol with a request-head limit (module docstring)."""

        head_bytes = 0  # bytes of the current request's head received so far
        in_head = True  # the head of the current request is not complete yet

        def on_headers_complete(self) -> None:
            self.in_head = False
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            super().on_message_complete()
            self.in_head, self.head_bytes = True, 0

        def data_received(self, data: bytes) -> None:
            if self.in_head:
                end = data.find(END_OF_HEAD)
                self.head_bytes += len(data) if end < 0 else end + len(END_OF_HEAD)
                if self.head_bytes > max_head_bytes:
                    self.send_431()
                    return
            super().data_received(data)

        def send_431(self) -> None:
            if on_refused is not None:
                on_refused()
            body = json.dumps(error_body(
                431, f"request headers exceed {max_head_bytes} bytes",
                "invalid_request_error")).encode()
            self.transport.write(
                b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
                b"content-type: application/json\r\n"
                b"content-length: " + str(len(body)).encode() + b"\r\n"
                b"connection: close\r\n\r\n" + body)
            self.transport.close()

    return BoundedHeadProtocol
