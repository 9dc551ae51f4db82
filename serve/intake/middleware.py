"""ASGI intake for the generation routes (``serve.routes.GENERATION_ROUTES``: chat
completions, completions, Responses API): validate, fetch and normalise images, count tokens,
then hand vLLM a clean body. A client mistake is a 4xx here and never reaches vLLM.

Order inside: ``X-Request-Id`` -> ``Content-Encoding`` (identity only, else 415) -> JSON ->
structure (``serve.intake.request`` for chat and completions, ``serve.intake.responses`` for the
Responses API) -> images (``images``/``urls``, through the prepared-image cache ``cache``) ->
prompt length (``budget``) -> forward with each image replaced by its prepared ``data:`` URL.
The tool fields ``--tools ignore`` took out of the body are named in the response header
``X-Tools-Ignored`` (``tools, tool_choice``), streamed or not.
The body's ``user`` (OpenAI's end-user identifier, at most 256 characters, forwarded
unchanged) goes to the access record; when the request's API key is a trusted front end's
(``serve.tenants``), it also goes to admission (``USER_SCOPE_KEY``), which shares the front
end's slots among its users.
A completions prompt is raw text without images: only the shared checks apply (``request_id``,
``n``).

The event loop only moves bytes: parsing the multi-MB JSON, base64 decoding, image decoding
and tokenisation run in a worker thread (one hop per request, two when an image URL has to be
fetched in between), so running streams keep their inter-token latency while photos arrive.
With image workers (``--image-workers``, ``serve.intake.workers``) that thread hands each
image's pixel work to a worker process and waits for it: the same bytes come back.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import secrets

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from serve.asgi import (
    IMAGES_SCOPE_KEY,
    PROMPT_TOKENS_SCOPE_KEY,
    ClientGone,
    ResponseChannel,
    buffered_body,
    read_body,
    replay,
    response_channel,
    with_content_length,
)
from serve.intake.body import decode_body, encode_body
from serve.intake.budget import PromptBudget, image_tokens
from serve.intake.cache import ImageCache, image_key
from serve.intake.errors import IntakeError
from serve.intake.images import ImagePolicy, data_url_payload, decode_base64, prepare_image
from serve.intake.request import (
    GenerationRequest,
    RequestLimits,
    check_request_id,
    check_user,
    parse_chat_request,
    parse_completion_request,
)
from serve.intake.responses import parse_responses_request
from serve.intake.urls import UrlPolicy, fetch_image_url
from serve.intake.workers import ImageWorkers
from serve.logs import note, served_request_id
from serve.routes import CHAT, COMPLETIONS, GENERATION_ROUTES, RESPONSES
from serve.tenants import ANONYMOUS, TENANT_SCOPE_KEY, USER_SCOPE_KEY

log = logging.getLogger("serve.intake")
#: The body parser of each generation protocol.
PARSERS = {CHAT: parse_chat_request, COMPLETIONS: parse_completion_request,
           RESPONSES: parse_responses_request}
REQUEST_ID_HEADER = b"x-request-id"
#: Response header naming the tool fields taken out of the request (``--tools ignore``).
TOOLS_IGNORED_HEADER = b"x-tools-ignored"
#: What the intake makes of a request (:meth:`IntakeMiddleware.serialize`): the body for vLLM,
#: its number of images, its request id, its prompt tokens, the tool fields taken out of it,
#: its ``user``.
Processed = tuple[bytes, int, str, int, tuple, str | None]
#: Largest body handled on the event loop when it has no images (a text chat): parsing it takes
#: microseconds, less than a hop to a worker thread.
INLINE_MAX_BYTES = 16 * 1024


class IntakeMiddleware:
    """See the module docstring.

    Args:
        app: the next ASGI app (admission control, then vLLM).
        limits / image_policy / url_policy: the intake policy.
        budget: prompt-length check; ``None`` until the tokenizer is loaded.
        cache: prepared images by content hash (history images cost a hash).
        default_num_crops: the server's ``num_crops`` (a request may ask for another).
        default_max_tokens: ``max_tokens`` of a request that sets neither it nor
            ``max_completion_tokens`` (clamped to what the context leaves).
        workers: the process pool that prepares images; None: the worker thread does.
        log_content: the request's access record carries its content (``--enable-log-requests``,
            :func:`request_content`).
    """

    def __init__(self, app: ASGIApp, limits: RequestLimits, image_policy: ImagePolicy,
                 url_policy: UrlPolicy, budget: PromptBudget | None = None,
                 cache: ImageCache | None = None, default_num_crops: int = 1,
                 default_max_tokens: int = 2048, workers: ImageWorkers | None = None,
                 log_content: bool = False) -> None:
        self.app = app
        self.log_content = log_content
        self.limits = limits
        self.image_policy = image_policy
        self.url_policy = url_policy
        self.budget = budget
        self.cache = cache if cache is not None else ImageCache(0)
        self.default_num_crops = default_num_crops
        self.default_max_tokens = default_max_tokens
        #: ``prepare_image`` or the same function in a worker process.
        self.prepare_image = workers.prepare if workers is not None else prepare_image

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        protocol = GENERATION_ROUTES.get(scope.get("path"))
        if scope["type"] != "http" or scope.get("method") != "POST" or protocol is None:
            await self.app(scope, receive, send)
            return
        try:
            raw = buffered_body(receive) or await read_body(receive)
        except ClientGone:
            return
        header_id = None
        channel = response_channel(send, scope)
        try:
            scope, header_id = unique_request_id_header(scope)
            check_content_encoding(scope)
            body, images, request_id, tokens, ignored, user = await self.process(
                raw, protocol, header_id)
        except IntakeError as err:
            note(reject_reason=err.code or "invalid_request")  # the access record
            if header_id is not None:
                echo_request_id(channel, header_id)
            await err.response()(scope, receive, channel)
            return
        scope = {**with_content_length(scope, len(body)), IMAGES_SCOPE_KEY: images,
                 PROMPT_TOKENS_SCOPE_KEY: tokens}
        if user is not None and scope.get(TENANT_SCOPE_KEY, ANONYMOUS).trusted_frontend:
            scope[USER_SCOPE_KEY] = user  # fair sharing among a front end's users
        echo_request_id(channel, request_id)
        if ignored:
            channel.on_head(_add_header(TOOLS_IGNORED_HEADER, ", ".join(ignored).encode()))
        await self.app(scope, replay(body, receive), channel)

    async def process(self, raw: bytes, protocol: str = CHAT,
                      header_id: str | None = None) -> Processed:
        """The cleaned request body, its number of images, its request id (:meth:`parse`),
        its prompt tokens as admission estimates them, the tool fields taken out of it and
        its ``user`` (:meth:`serialize`).

        A body of at most :data:`INLINE_MAX_BYTES` without images whose prompt provably fits
        (:meth:`PromptBudget.check`'s bound) is handled on the event loop: microseconds,
        less than a thread hop. Everything else runs in one worker thread (two when image
        URLs must be fetched in between).

        Raises:
            IntakeError: the first client mistake found.
        """
        if len(raw) <= INLINE_MAX_BYTES:
            request = self.parse(raw, protocol, header_id)
            if not request.images and (self.budget is None or request.messages is None
                                       or self.budget.fits(request)):
                return self.serialize(request, ())
        else:
            done = await asyncio.to_thread(self.parse_and_finish, raw, protocol, header_id)
            if not isinstance(done, GenerationRequest):
                return done
            request = done
        if request.has_urls_to_fetch:
            return await self.fetch_and_finish(request)
        return await asyncio.to_thread(self.finish, request, {})

    def parse_and_finish(self, raw: bytes, protocol: str = CHAT, header_id: str | None = None
                         ) -> Processed | GenerationRequest:
        """:meth:`parse` then :meth:`finish` in the calling (worker) thread, unless an image URL
        must be fetched first: then the parsed request is returned for :meth:`fetch_and_finish`.
        """
        request = self.parse(raw, protocol, header_id)
        if request.has_urls_to_fetch:
            return request
        return self.finish(request, {})

    async def fetch_and_finish(self, request: GenerationRequest
                               ) -> Processed:
        """Fetch the request's image URLs (SSRF rules in ``serve.intake.urls``), then finish in a
        worker thread."""
        fetched = {}
        for k, ref in enumerate(request.images):
            if not ref.is_data_url:
                fetched[k] = await fetch_image_url(ref.url, self.url_policy, ref.param)
        return await asyncio.to_thread(self.finish, request, fetched)

    def parse(self, raw: bytes, protocol: str = CHAT,
              header_id: str | None = None) -> GenerationRequest:
        """JSON and structure checks (CPU-bound for a large body: run it in a worker thread).

        Args:
            raw: the request body.
            protocol: the route's protocol (``serve.routes``: chat, completions, responses).
            header_id: the client's ``X-Request-Id`` made unique, if it sent one.

        Every request leaves with one request id, the one vLLM names the response after and
        the ``X-Request-Id`` response header echoes (:attr:`GenerationRequest.request_id`):
        for chat and completions the header's (vLLM prefers it), else the body's
        ``request_id``, else a new one put in the body; for the Responses API (vLLM reads
        only the body) the body's, else the header's, else a new ``resp_...``, in the body.

        Raises:
            IntakeError: 400 naming the field.
        """
        data = decode_body(raw)
        request = PARSERS[protocol](data, self.limits, checked=True)
        request.user = check_user(data.get("user"))
        note(user=request.user)  # the access record, from any key
        if protocol == RESPONSES:
            request.request_id = data.get("request_id") or header_id or new_request_id("resp_")
        else:
            # Without an id of the client's, the access record's (as random as a new one).
            request.request_id = (header_id or data.get("request_id") or served_request_id()
                                  or new_request_id())
        if header_id is None or protocol == RESPONSES:
            data["request_id"] = request.request_id
        note(request_id=request.request_id)  # on every log record from here (serve.logs)
        if request.messages is not None and all(
                data.get(name) is None for name in request.answer_fields):
            # Without a bound vLLM generates until the context is full (minutes on a 128k
            # context); the server's documented default applies instead. (A completions
            # request keeps vLLM's default of 16 tokens, as the OpenAI API.)
            data[request.answer_fields[-1]] = self.default_max_tokens
            request.default_max_tokens = True
        return request

    def finish(self, request: GenerationRequest,
               fetched: dict[int, bytes]) -> Processed:
        """Prepare every image (cached), check the prompt length, serialise (blocking).

        Args:
            request: the parsed request.
            fetched: bodies of the image URLs fetched already, by image index.

        Raises:
            IntakeError: the first bad image, or a prompt over ``max_model_len``.
        """
        crops = request.num_crops or self.default_num_crops
        sizes, described = [], []
        for k, ref in enumerate(request.images):
            payload = None if k in fetched else data_url_payload(
                ref.url, self.image_policy.max_bytes, ref.param)
            key = image_key(fetched[k] if payload is None else payload, crops)
            image = self.cache.get(key)
            if image is None:
                encoded = fetched[k] if payload is None else decode_base64(payload, ref.param)
                image = self.prepare_image(encoded, self.image_policy, crops, ref.param,
                                           base64_payload=payload)
                self.cache.put(key, image)
            ref.set_url(image.url)
            sizes.append((image.width, image.height))
            if self.log_content:
                raw = fetched[k] if payload is None else decode_base64(payload, ref.param)
                described.append({"bytes": len(raw), "sha256": hashlib.sha256(raw).hexdigest(),
                                  "width": image.width, "height": image.height})
        if self.budget is not None and request.messages is not None:
            self.budget.check(request, sizes)
        return self.serialize(request, sizes, described)

    def serialize(self, request: GenerationRequest, sizes, described: list[dict] = ()
                  ) -> Processed:
        """The body forwarded to vLLM, its number of images, its request id, its prompt
        tokens as estimated for admission (:meth:`PromptBudget.estimate`, for the pixel
        ``sizes`` of its prepared images; 0 without a budget: unknown) and the tool fields
        taken out of it (:attr:`GenerationRequest.tools_ignored`). Notes the image tokens
        for the access record, and with :attr:`log_content` its content (images
        ``described`` by :meth:`finish`), and the body's ``user`` (:func:`check_user`)."""
        crops = request.num_crops or self.default_num_crops
        note(image_tokens=sum(image_tokens(w, h, crops) for w, h in sizes))
        if self.log_content:
            note(content=request_content(request, described))
        tokens = 0 if self.budget is None else self.budget.estimate(request, sizes)
        return (encode_body(request.body), len(request.images), request.request_id,
                tokens, request.tools_ignored, request.user)


def unique_request_id_header(scope: Scope) -> tuple[Scope, str | None]:
    """``scope`` with a client's ``X-Request-Id`` made unique (:func:`check_request_id`), and
    that id (None when the client sent none): vLLM names the response after it, so two
    requests sharing an id would share a response id.

    Raises:
        IntakeError: 400 naming ``X-Request-Id`` when the id is over 256 characters or holds
            control characters.
    """
    headers = scope.get("headers") or []
    sent = [value for name, value in headers if name == REQUEST_ID_HEADER]
    if not sent:
        return scope, None
    unique = check_request_id(_header_text(sent[0]), "X-Request-Id")
    rewritten = [(name, value) for name, value in headers if name != REQUEST_ID_HEADER]
    rewritten.append((REQUEST_ID_HEADER, unique.encode()))
    return {**scope, "headers": rewritten}, unique


CONTENT_ENCODING_HEADER = b"content-encoding"


def check_content_encoding(scope: Scope) -> None:
    """The request body is not content-coded: a ``Content-Encoding`` other than ``identity``
    (``gzip``, ``deflate``, ``br``, ...) is refused, never inflated. Inflating a client's body
    would let a few KiB expand past ``--max-request-bytes`` (checked on the bytes received)
    into gigabytes in memory (a zip bomb); the OpenAI API and vLLM take plain JSON bodies.

    Raises:
        IntakeError: 415 naming ``Content-Encoding`` and the coding, with
            ``Accept-Encoding: identity`` (RFC 9110, section 15.5.16: a 415 caused by a
            content coding names the codings accepted).
    """
    codings = [c.strip().lower() for name, value in scope.get("headers") or []
               if name == CONTENT_ENCODING_HEADER
               for c in _header_text(value).split(",")]
    refused = [c for c in codings if c and c != "identity"]
    if refused:
        raise IntakeError(415, f"Content-Encoding {', '.join(refused)} is not supported: send "
                          "the request body uncompressed (identity)", "Content-Encoding",
                          headers={"Accept-Encoding": "identity"})


def _header_text(value: bytes) -> str:
    """A header value as text: UTF-8 as clients send it, else Latin-1 (HTTP's historic
    charset), so a length limit counts characters."""
    try:
        return value.decode()
    except UnicodeDecodeError:
        return value.decode("latin-1")


def new_request_id(prefix: str = "") -> str:
    """A request id for a request whose client chose none (16 random hex digits)."""
    return f"{prefix}{secrets.token_hex(8)}"


def echo_request_id(channel: ResponseChannel, request_id: str) -> None:
    """Add ``X-Request-Id: <request_id>`` to the response head (a head hook on ``channel``),
    so a client finds the unique id its request ran under; the access record has the same."""
    note(request_id=request_id)
    channel.on_head(_add_header(REQUEST_ID_HEADER, request_id.encode()))


def _add_header(name: bytes, value: bytes):
    """A head hook that sets the response header ``name`` (lower case) to ``value``, in place
    of any the app sent."""
    def add(message: Message) -> Message:
        headers = [(k, v) for k, v in message.get("headers") or [] if k.lower() != name]
        return {**message, "headers": [*headers, (name, value)]}
    return add


def request_content(request: GenerationRequest, images: list[dict]) -> dict:
    """What a request asks, for its access record (``--enable-log-requests`` only): each
    message's role and text (its text parts joined by newlines), or a completions prompt as
    sent, and its ``images`` as :meth:`IntakeMiddleware.finish` described them (bytes,
    SHA-256, pixel size), never their bytes."""
    if request.messages is None:
        return {"prompt": request.body.get(request.prompt_field), "images": images}
    messages = []
    for message in request.messages:
        content = message.get("content")
        text = content if isinstance(content, str) else "\n".join(
            p.get("text", "") for p in content or () if isinstance(p, dict)
            and p.get("type") == "text")
        messages.append({"role": message.get("role"), "text": text})
    return {"messages": messages, "images": images}
