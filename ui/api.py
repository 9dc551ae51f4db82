"""The UI's only way to the model: the API's HTTP surface, as any client uses it.

- ``GET /limits``: the server's image limits (:class:`ServerLimits`), cached for
  ``limits_ttl_s``; the one source of the numbers the UI enforces. Asked at the API, or at
  the first of ``limits_urls`` that answers (replicas behind vllm-router, which forwards only
  the OpenAI routes).
- ``POST /v1/chat/completions`` with ``stream: true``: :meth:`ApiClient.stream_chat` yields
  content tokens and the final usage. Each request names the logged-in user in OpenAI's
  ``user`` field (:func:`api_user`): with the UI's key a trusted front end of the API's keys
  file, the API shares the UI's capacity fairly among its users and accounts usage per user.
  Closing the stream early (the user pressed Stop: the Chainlit task is cancelled, and
  ``ui.app`` closes the iterator) cancels the task that runs the exchange, which closes the
  connection; the API then aborts the request in vLLM and frees its KV cache.

Every failure raises :class:`ui.errors.ApiError` with a message ready for the chat.
No Chainlit import: unit-tested in the main test environment.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import httpx

from ui import errors
from ui.errors import ApiError
from ui.settings import UISettings

#: The header vllm-router's consistent hash reads first (``deploy/replicas.py``): the UI sends
#: the conversation's id in it, so a conversation's turns reach the replica holding its images.
SESSION_HEADER = "X-Session-ID"
#: Longest ``user`` the API accepts (its intake refuses more with a 400), characters.
MAX_USER_CHARS = 256


def api_user(identifier: str) -> str:
    """The ``user`` sent for a logged-in user: the UI's user identifier, or, for one longer
    than the API accepts, ``sha256:`` and its hex digest (stable, so fairness and usage still
    count it as one user)."""
    if len(identifier) <= MAX_USER_CHARS:
        return identifier
    return "sha256:" + hashlib.sha256(identifier.encode()).hexdigest()


@dataclass(frozen=True)
class ServerLimits:
    """The server's ``GET /limits`` answer."""

    model: str
    max_images_per_request: int
    max_image_bytes: int
    max_image_pixels: int
    image_formats: tuple[str, ...]
    max_model_len: int
    num_crops: int
    max_num_crops: int

    @classmethod
    def from_json(cls, data: dict) -> ServerLimits:
        return cls(model=data["model"],
                   max_images_per_request=int(data["max_images_per_request"]),
                   max_image_bytes=int(data["max_image_bytes"]),
                   max_image_pixels=int(data["max_image_pixels"]),
                   image_formats=tuple(str(f).upper() for f in data["image_formats"]),
                   max_model_len=int(data["max_model_len"]),
                   num_crops=int(data["num_crops"]),
                   max_num_crops=int(data["max_num_crops"]))


@dataclass(frozen=True)
class Token:
    """A piece of answer text."""

    text: str


@dataclass(frozen=True)
class Usage:
    """The stream's final ``usage`` object."""

    usage: dict


@dataclass(frozen=True)
class Finish:
    """A choice finished (``stop``, ``length``, ...)."""

    reason: str


class ApiClient:
    """Async HTTP client of the API for one UI process (shared by all chats)."""

    def __init__(self, settings: UISettings, transport: httpx.AsyncBaseTransport | None = None
                 ) -> None:
        self.settings = settings
        self.base_url = settings.api_base_url.rstrip("/")
        headers = {"Authorization": f"Bearer {settings.api_key}"} if settings.api_key else {}
        self._http = httpx.AsyncClient(
            base_url=self.base_url, headers=headers, transport=transport,
            timeout=httpx.Timeout(connect=settings.connect_timeout_s,
                                  read=settings.read_timeout_s, write=60.0, pool=10.0),
            # httpx's default pool sizes, with our keep-alive expiry (its default, 5 s,
            # equalled uvicorn's keep-alive: a race to close an idle connection).
            limits=httpx.Limits(max_connections=100, max_keepalive_connections=20,
                                keepalive_expiry=settings.api_keep_alive_s))
        self._limits: ServerLimits | None = None
        self._limits_at = 0.0

    async def aclose(self) -> None:
        await self._http.aclose()

    async def limits(self, refresh: bool = False) -> ServerLimits:
        """The server's limits (cached ``limits_ttl_s``). Raises :class:`ApiError`."""
        fresh = time.monotonic() - self._limits_at < self.settings.limits_ttl_s
        if self._limits is not None and fresh and not refresh:
            return self._limits
        error: ApiError | None = None
        # The first that answers: behind a router, which answers only the OpenAI routes,
        # ``limits_urls`` lists the replicas.
        for base in [u.rstrip("/") for u in self.settings.limits_urls] or [self.base_url]:
            try:
                self._limits = await self._fetch_limits(base)
            except ApiError as exc:
                error = exc
                continue
            self._limits_at = time.monotonic()
            return self._limits
        raise error

    async def _fetch_limits(self, base: str) -> ServerLimits:
        """``GET {base}/limits``. Raises :class:`ApiError`."""
        try:
            r = await self._http.get(f"{base}/limits", timeout=self.settings.connect_timeout_s)
        except httpx.TransportError as exc:
            raise errors.from_transport(exc, base, self.settings.read_timeout_s) from exc
        if r.status_code != 200:
            raise errors.from_response(r.status_code, r.content, r.headers)
        try:
            return ServerLimits.from_json(r.json())
        except (KeyError, TypeError, ValueError) as exc:
            raise ApiError(f"The API at {base} answered GET /limits with something "
                           f"unexpected ({exc!r}); is it this project's server?") from exc

    async def stream_chat(self, body: dict, user: str | None = None,
                          conversation: str | None = None
                          ) -> AsyncIterator[Token | Usage | Finish]:
        """Stream one chat completion (``body`` without ``stream``) for the logged-in
        ``user`` (its identifier, sent as ``user``: :func:`api_user`) in ``conversation``
        (its id, sent as :data:`SESSION_HEADER`: a router keeps the conversation on one
        replica). Each request carries a new ``X-Request-Id``, the id the API's and the
        router's answers and the API's logs use. Raises :class:`ApiError`.

        Closing the iterator closes the HTTP connection, which makes the server abort the
        generation. The exchange runs in a task of its own (:meth:`_exchange`) that hands
        each event over through a queue, and closing cancels that task where it awaits the
        network, the one place httpcore closes the connection at once. Had the exchange run
        in this generator, a Stop landing while the page was updated would close httpcore's
        stream generators, left suspended at a ``yield``, through the garbage collector:
        under Chainlit (which applies ``nest_asyncio``) that finalization runs without the
        event loop, marks the connection closed without closing it, and vLLM went on
        generating until a later collection. Consume it under ``contextlib.aclosing``, so
        that a cancelled task closes it at once rather than at collection.
        """
        body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        if user:
            body["user"] = api_user(user)
        headers = {"X-Request-Id": f"ui-{uuid.uuid4().hex}"}
        if conversation:
            headers[SESSION_HEADER] = conversation
        events: asyncio.Queue[Token | Usage | Finish | Exception | None] = asyncio.Queue()
        exchange = asyncio.create_task(self._exchange(body, headers, events.put_nowait))
        try:
            while (event := await events.get()) is not None:
                if isinstance(event, Exception):
                    raise event
                yield event
        finally:
            exchange.cancel()
            # wait() rather than await: the exchange's CancelledError is its own, while a
            # cancellation of this task must still reach the caller
            await asyncio.wait([exchange])

    async def _exchange(self, body: dict, headers: dict[str, str],
                        put: Callable[[Token | Usage | Finish | Exception | None], None]
                        ) -> None:
        """The HTTP side of :meth:`stream_chat`: ``put`` each event, then None at the end, or
        the exception that ended it (an :class:`ApiError` for an HTTP or transport failure);
        raises nothing but its own cancellation."""
        try:
            async with self._http.stream("POST", "/v1/chat/completions", json=body,
                                         headers=headers) as r:
                if r.status_code != 200:
                    raise errors.from_response(r.status_code, await r.aread(), r.headers)
                async for line in r.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    payload = line[len("data:"):].strip()
                    if payload == "[DONE]":  # last event; let the body end by itself
                        continue
                    event = json.loads(payload)
                    if "error" in event:
                        raise errors.from_stream_event(event)
                    for choice in event.get("choices") or []:
                        text = (choice.get("delta") or {}).get("content")
                        if text:
                            put(Token(text))
                        if choice.get("finish_reason"):
                            put(Finish(choice["finish_reason"]))
                    if event.get("usage"):
                        put(Usage(event["usage"]))
        except httpx.TransportError as exc:
            error = errors.from_transport(exc, self.base_url, self.settings.read_timeout_s)
            error.__cause__ = exc
            put(error)
        except Exception as exc:  # noqa: BLE001 - handed to the consumer, which raises it
            put(exc)
        else:
            put(None)
