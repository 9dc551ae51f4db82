"""A recording reverse proxy between the UI and the API, for the browser tests: what the UI
sends to the model, seen on the wire.

A network peer of the UI (a test double in the UI's sense): a Starlette app under uvicorn in a
thread on a free port that forwards every request to the API unchanged, streams each answer
back as it arrives, and keeps each ``POST /v1/chat/completions`` body with the text streamed
back for it. When the UI closes a connection (Stop), the proxy closes its own to the API,
which then aborts the request as it would for the UI.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from dataclasses import dataclass, field

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

from tests.helpers import free_port

CHAT_PATH = "/v1/chat/completions"
#: Hop-by-hop headers (RFC 9110 7.6.1) and the ones httpx sets itself.
DROPPED = {"host", "connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade",
           "proxy-connection", "content-length", "content-encoding"}


@dataclass
class ChatExchange:
    """One chat request the UI sent: its JSON ``body``, the ``status`` it got, the answer
    text streamed back (``answer``, the ``delta.content`` pieces joined) and ``done`` once the
    exchange ended (the answer complete, refused, or left by the UI)."""

    body: dict
    status: int | None = None
    pieces: list[str] = field(default_factory=list)
    done: bool = False

    @property
    def answer(self) -> str:
        return "".join(self.pieces)

    @property
    def messages(self) -> list[dict]:
        return self.body["messages"]

    def last_user_parts(self) -> list[dict]:
        """The content parts of the last user message (a plain text becomes one part)."""
        content = [m for m in self.messages if m["role"] == "user"][-1]["content"]
        return [{"type": "text", "text": content}] if isinstance(content, str) else content

    def image_urls(self) -> list[str]:
        """Every ``image_url`` of the request, in order."""
        return [p["image_url"]["url"] for m in self.messages if isinstance(m["content"], list)
                for p in m["content"] if p.get("type") == "image_url"]


def _sse_text(chunk: bytes, carry: bytearray, pieces: list[str]) -> None:
    """Collect the ``delta.content`` of the complete SSE lines in ``carry + chunk``."""
    carry.extend(chunk)
    *lines, rest = bytes(carry).split(b"\n")
    carry[:] = rest
    for line in lines:
        if not line.startswith(b"data:") or line.strip() == b"data: [DONE]":
            continue
        try:
            event = json.loads(line[5:])
        except ValueError:
            continue
        for choice in event.get("choices") or []:
            text = (choice.get("delta") or {}).get("content")
            if text:
                pieces.append(text)


class RecordingProxy:
    """The proxy to ``upstream`` (the API's base URL); :attr:`url` is its own;
    :attr:`chats` the chat requests in order. :meth:`close` stops it."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream.rstrip("/")
        self.chats: list[ChatExchange] = []
        app = Starlette(routes=[Route("/{path:path}", self._forward,
                                      methods=["GET", "POST", "PUT", "DELETE", "OPTIONS"])])
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self._server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                                     log_level="warning", lifespan="off"))
        self._thread = threading.Thread(target=self._server.run, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            assert time.monotonic() < deadline, "the recording proxy did not start"
            time.sleep(0.02)

    async def _forward(self, request: Request) -> StreamingResponse:
        body = await request.body()
        exchange = None
        if request.method == "POST" and request.url.path == CHAT_PATH:
            exchange = ChatExchange(json.loads(body))
            self.chats.append(exchange)
        client = httpx.AsyncClient(timeout=httpx.Timeout(300.0, connect=5.0))
        upstream = await client.send(client.build_request(
            request.method, self.upstream + request.url.path, params=request.query_params,
            content=body,
            headers={k: v for k, v in request.headers.items() if k.lower() not in DROPPED}),
            stream=True)
        if exchange is not None:
            exchange.status = upstream.status_code

        async def relay():
            carry = bytearray()
            async for chunk in upstream.aiter_raw():
                if exchange is not None:
                    _sse_text(chunk, carry, exchange.pieces)
                yield chunk

        async def close():  # also when the UI left early (Stop): the API aborts the request
            await upstream.aclose()
            await client.aclose()
            if exchange is not None:
                exchange.done = True

        headers = {k: v for k, v in upstream.headers.items() if k.lower() not in DROPPED}
        return StreamingResponse(relay(), status_code=upstream.status_code, headers=headers,
                                 background=BackgroundTask(close))

    async def wait_chats(self, n: int, timeout_s: float = 60) -> list[ChatExchange]:
        """Until ``n`` chat requests were made and all of them ended."""
        deadline = time.monotonic() + timeout_s
        while len(self.chats) < n or not all(c.done for c in self.chats[:n]):
            if time.monotonic() > deadline:
                raise AssertionError(f"{len(self.chats)} chat requests, wanted {n}: "
                                     f"{[c.status for c in self.chats]}")
            await asyncio.sleep(0.05)
        return self.chats

    def close(self) -> None:
        self._server.should_exit = True
        self._thread.join(10)
