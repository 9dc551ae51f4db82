"""Validation of a chat request body before anything reaches the engine (pure functions).

vLLM validates sampling parameters itself (400 naming ``param``); this layer adds what it lets
through or answers badly: message structure (roles, ``content: null``, malformed parts, images
outside user turns), the image count, the ``n`` policy, per-request ``num_crops``, and the
neutralisation of Phi-3 control sequences typed by users.

**Control sequences.** Phi-3's chat format is plain text with special tokens (``<|user|>``,
``<|end|>``, ``<|assistant|>``, ...), and vLLM's Phi-3-vision path turns any ``<|image_N|>`` in
the prompt text into an image slot. User text could therefore fake turns or image slots. Every
``<|`` in message text is rewritten to ``<`` U+2060 (WORD JOINER) ``|``: it renders the same,
but no longer tokenises to a special token or matches the image-placeholder pattern.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from serve.intake.errors import IntakeError

ROLES = ("system", "user", "assistant")
CONTROL_PREFIX = "<|"
NEUTRALISED_PREFIX = "<\u2060|"


@dataclass(frozen=True)
class RequestLimits:
    """Per-request limits (from :class:`serve.settings.Settings`).

    Attributes:
        max_images: most images in one request (over all turns).
        max_n: most choices (``n``) per request.
        max_num_crops: highest per-request ``mm_processor_kwargs.num_crops``.
    """

    max_images: int
    max_n: int = 1
    max_num_crops: int = 16


@dataclass
class ImageRef:
    """One ``image_url`` part: where it is in the body and its URL."""

    message: int
    part: int
    url: str

    @property
    def param(self) -> str:
        return f"messages[{self.message}].content[{self.part}].image_url"

    @property
    def is_data_url(self) -> bool:
        """A ``data:`` URL (decoded here) rather than a URL to fetch."""
        return self.url[:5].lower() == "data:"


@dataclass
class ChatRequest:
    """A validated chat request body (mutable: the intake rewrites image URLs in place)."""

    body: dict[str, Any]
    images: list[ImageRef]
    num_crops: int | None
    #: True when the client set neither max_tokens nor max_completion_tokens and the intake
    #: put the server's default in ``max_tokens`` (clamped to the context by the budget).
    default_max_tokens: bool = False

    def set_image_url(self, ref: ImageRef, url: str) -> None:
        """Point an image part at ``url`` (the prepared image); a ``detail: null`` (the
        default, which vLLM's schema refuses) is dropped."""
        part = self.body["messages"][ref.message]["content"][ref.part]
        old = part["image_url"] if isinstance(part["image_url"], dict) else {}
        part["image_url"] = {**{k: v for k, v in old.items()
                                if not (k == "detail" and v is None)}, "url": url}


def neutralise(text: str) -> str:
    """User text with Phi-3 control sequences made inert (see module docstring)."""
    return text.replace(CONTROL_PREFIX, NEUTRALISED_PREFIX)


#: Accepted values of ``image_url.detail`` (OpenAI's; Phi-3-vision's resolution is set by
#: ``num_crops`` instead, so the value is accepted and has no effect). ``null``: the default.
DETAILS = ("auto", "low", "high")


def _image_url(part: dict, param: str) -> str:
    """The URL of an ``image_url`` part: ``{"url": ..., "detail": ...}`` or a bare string."""
    value = part.get("image_url")
    url = value.get("url") if isinstance(value, dict) else value
    if not isinstance(url, str) or not url:
        raise IntakeError(400, "an image_url part needs image_url.url (a data: URL)",
                          f"{param}.image_url")
    detail = value.get("detail") if isinstance(value, dict) else None
    if detail is not None and detail not in DETAILS:
        raise IntakeError(400, f"image_url.detail must be one of {', '.join(DETAILS)} or null; "
                          f"got {detail!r}", f"{param}.image_url.detail")
    return url


def _check_part(part: Any, role: str, i: int, j: int, images: list[ImageRef]) -> None:
    param = f"messages[{i}].content[{j}]"
    if not isinstance(part, dict) or not isinstance(part.get("type"), str):
        raise IntakeError(400, "a content part must be an object with a 'type'", param)
    kind = part["type"]
    if kind == "text":
        if not isinstance(part.get("text"), str):
            raise IntakeError(400, "a text part needs a string 'text'", f"{param}.text")
        part["text"] = neutralise(part["text"])
    elif kind == "image_url":
        if role != "user":
            raise IntakeError(400, f"images are accepted in user messages only, not {role}",
                              param)
        images.append(ImageRef(i, j, _image_url(part, param)))
    else:
        raise IntakeError(400, f"content part type {kind!r} is not supported; use 'text' or "
                          "'image_url'", f"{param}.type")


def _check_num_crops(body: dict, limits: RequestLimits) -> int | None:
    kwargs = body.get("mm_processor_kwargs")
    if kwargs is None:
        return None
    if not isinstance(kwargs, dict) or set(kwargs) - {"num_crops"}:
        raise IntakeError(400, "mm_processor_kwargs accepts only num_crops",
                          "mm_processor_kwargs")
    crops = kwargs.get("num_crops")
    if crops is None:
        return None
    if isinstance(crops, bool) or not isinstance(crops, int) or not (
            1 <= crops <= limits.max_num_crops):
        raise IntakeError(400, f"num_crops must be an integer from 1 to {limits.max_num_crops}",
                          "mm_processor_kwargs.num_crops")
    return crops


def parse_chat_request(body: Any, limits: RequestLimits) -> ChatRequest:
    """Validate a decoded ``/v1/chat/completions`` body; neutralises control sequences.

    Returns:
        the request with its image references in order of appearance.

    Raises:
        IntakeError: 400 naming the offending field.
    """
    if not isinstance(body, dict):
        raise IntakeError(400, "request body must be a JSON object")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise IntakeError(400, "messages must be a non-empty list", "messages")
    n = body.get("n", 1)
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1
                          or n > limits.max_n):
        raise IntakeError(400, f"n must be an integer from 1 to {limits.max_n} (each choice is "
                          "a full generation; send separate requests instead)", "n")
    images: list[ImageRef] = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise IntakeError(400, "each message must be an object", f"messages[{i}]")
        role = message.get("role")
        if role not in ROLES:
            raise IntakeError(400, f"role must be one of {', '.join(ROLES)}; got {role!r}",
                              f"messages[{i}].role")
        content = message.get("content")
        if isinstance(content, str):
            message["content"] = neutralise(content)
        elif isinstance(content, list):
            if not content:
                raise IntakeError(400, "content must not be an empty list",
                                  f"messages[{i}].content")
            for j, part in enumerate(content):
                _check_part(part, role, i, j, images)
        else:
            raise IntakeError(400, "content must be a string or a list of parts (null is not "
                              "accepted)", f"messages[{i}].content")
    if len(images) > limits.max_images:
        first_over = images[limits.max_images]
        raise IntakeError(400, f"{len(images)} images in one request; the limit is "
                          f"{limits.max_images} images per request",
                          f"messages[{first_over.message}].content[{first_over.part}]")
    return ChatRequest(body, images, _check_num_crops(body, limits))
