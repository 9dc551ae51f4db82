"""ASGI intake for ``POST /v1/chat/completions``: validate, fetch and normalise images, count
tokens, then hand vLLM a clean body. A client mistake is a 4xx here and never reaches vLLM.

Order inside: JSON -> structure (``serve.intake.request``) -> images (``images``/``urls``,
decoded in a worker thread so the event loop keeps streaming other answers) -> prompt length
(``budget``) -> forward with each image replaced by its normalised PNG ``data:`` URL.
"""

from __future__ import annotations

import asyncio
import json
import logging

from starlette.types import ASGIApp, Receive, Scope, Send

from serve.asgi import ClientGone, read_body, replay, with_content_length
from serve.intake.budget import PromptBudget
from serve.intake.errors import IntakeError
from serve.intake.images import ImagePolicy, decode_data_url, normalize_image
from serve.intake.request import RequestLimits, parse_chat_request
from serve.intake.urls import UrlPolicy, fetch_image_url

log = logging.getLogger("serve.intake")
CHAT_PATH = "/v1/chat/completions"
#: ASGI scope key carrying the request's image count to the layers behind the intake.
IMAGES_SCOPE_KEY = "phi3v.images"
#: Request fields vLLM would honour but we do not let clients set.
REFUSED_FIELDS = ("media_io_kwargs", "chat_template", "chat_template_kwargs")


class IntakeMiddleware:
    """See the module docstring.

    Args:
        app: the next ASGI app (admission control, then vLLM).
        limits / image_policy / url_policy: the intake policy.
        budget: prompt-length check; ``None`` until the tokenizer is loaded.
    """

    def __init__(self, app: ASGIApp, limits: RequestLimits, image_policy: ImagePolicy,
                 url_policy: UrlPolicy, budget: PromptBudget | None = None) -> None:
        self.app = app
        self.limits = limits
        self.image_policy = image_policy
        self.url_policy = url_policy
        self.budget = budget

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST" \
                or scope.get("path") != CHAT_PATH:
            await self.app(scope, receive, send)
            return
        try:
            raw = await read_body(receive)
        except ClientGone:
            return
        try:
            body, images = await self.process(raw)
        except IntakeError as err:
            await err.response()(scope, receive, send)
            return
        scope = {**with_content_length(scope, len(body)), IMAGES_SCOPE_KEY: images}
        await self.app(scope, replay(body, receive), send)

    async def process(self, raw: bytes) -> tuple[bytes, int]:
        """The cleaned request body and its number of images.

        Raises:
            IntakeError: the first client mistake found.
        """
        try:
            data = json.loads(raw)
        except ValueError as exc:
            raise IntakeError(400, f"request body is not valid JSON ({exc})") from None
        request = parse_chat_request(data, self.limits)
        for name in REFUSED_FIELDS:
            if isinstance(data, dict) and data.get(name) is not None:
                raise IntakeError(400, f"{name} is not accepted by this server", name)
        sizes = []
        for ref in request.images:
            if ref.url[:5].lower() == "data:":
                encoded = decode_data_url(ref.url, self.image_policy.max_bytes, ref.param)
            else:
                encoded = await fetch_image_url(ref.url, self.url_policy, ref.param)
            image = await asyncio.to_thread(normalize_image, encoded, self.image_policy,
                                            ref.param)
            request.set_image_url(ref, image.data_url())
            sizes.append((image.width, image.height))
        if self.budget is not None:
            self.budget.check(request, sizes)
        return json.dumps(request.body).encode(), len(request.images)
