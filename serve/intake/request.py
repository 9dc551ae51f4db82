"""Validation of a chat request body before anything reaches the engine (pure functions).

vLLM validates sampling parameters itself (400 naming ``param``); this layer adds what it lets
through or answers badly: message structure (roles, ``content: null``, malformed parts, images
outside user turns), the image count, the ``n`` policy, per-request ``num_crops``, tool calling
(``--tools``: :func:`check_tools`, :func:`check_tool_turn`), and the neutralisation of Phi-3
control sequences typed by users.

**Control sequences.** Phi-3's chat format is plain text with special tokens (``<|user|>``,
``<|end|>``, ``<|assistant|>``, ...), and vLLM's Phi-3-vision path turns any ``<|image_N|>`` in
the prompt text into an image slot. User text could therefore fake turns or image slots. Every
``<|`` in message text is rewritten to ``<`` U+2060 (WORD JOINER) ``|``: it renders the same,
but no longer tokenises to a special token or matches the image-placeholder pattern.
"""

from __future__ import annotations

import json
import math
import secrets
import unicodedata
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
        tools: what becomes of tool calling in a request (``--tools``; :func:`check_tools`):
            ``refuse``, ``ignore`` or ``pass``.
    """

    max_images: int
    max_n: int = 1
    max_num_crops: int = 16
    tools: str = "refuse"


@dataclass
class ImageRef:
    """One image part of a request: the part object, where it is, and its URL.

    Attributes:
        part: the part's dict inside the request body (rewritten in place).
        where: the part's path for error messages (``messages[0].content[1]``).
        url: the image's URL as sent (a ``data:`` URL or one to fetch).
        as_string: the protocol holds the URL as a bare string (Responses API
            ``input_image.image_url``) rather than ``{"url": ...}`` (chat ``image_url``).
    """

    part: dict
    where: str
    url: str
    as_string: bool = False

    @property
    def param(self) -> str:
        """The request field of the image's URL, for error messages."""
        return f"{self.where}.image_url"

    @property
    def is_data_url(self) -> bool:
        """A ``data:`` URL (decoded here) rather than a URL to fetch."""
        return self.url[:5].lower() == "data:"

    def set_url(self, url: str) -> None:
        """Point the part at ``url`` (the prepared image). A ``detail: null`` (the default,
        which vLLM's schema refuses) is dropped."""
        if self.as_string:
            self.part["image_url"] = url
            if self.part.get("detail", "") is None:
                del self.part["detail"]
            return
        old = self.part["image_url"] if isinstance(self.part["image_url"], dict) else {}
        self.part["image_url"] = {**{k: v for k, v in old.items()
                                     if not (k == "detail" and v is None)}, "url": url}


@dataclass
class GenerationRequest:
    """A validated generation request body (mutable: the intake rewrites image URLs in place).

    Attributes:
        body: the JSON body as forwarded to vLLM.
        images: its image parts in order of appearance.
        num_crops: the request's ``mm_processor_kwargs.num_crops``, or None (the server's).
        messages: the prompt as chat messages (``role``, ``content`` as a string or a list
            of ``{"type": "text", "text"}`` / ``{"type": "image_url"}`` parts) for the
            prompt-length check; None for a raw completions prompt (vLLM counts it).
        answer_fields: the body fields bounding the answer length, the preferred first
            (chat: ``max_completion_tokens`` wins over ``max_tokens``, as in vLLM); the
            server's default goes into the last one.
        prompt_field: the body field holding the prompt (named by a context-length error).
        default_max_tokens: the client set none of them and the intake put the server's
            default in (clamped to the context by the budget).
    """

    body: dict[str, Any]
    images: list[ImageRef]
    num_crops: int | None
    messages: list[dict] | None = None
    answer_fields: tuple[str, ...] = ("max_completion_tokens", "max_tokens")
    prompt_field: str = "messages"
    default_max_tokens: bool = False
    #: The id vLLM names the response after, echoed in ``X-Request-Id`` (set by the intake).
    request_id: str = ""
    #: The tool fields ``--tools ignore`` took out of the body (:func:`check_tools`), named in
    #: the response header ``X-Tools-Ignored``.
    tools_ignored: tuple[str, ...] = ()
    #: The body's ``user`` (:func:`check_user`; None: none, or empty).
    user: str | None = None

    @property
    def has_urls_to_fetch(self) -> bool:
        """Some image is a URL to fetch (not a ``data:`` URL)."""
        return not all(ref.is_data_url for ref in self.images)

    def answer_tokens(self) -> tuple[str, int | None]:
        """The answer-length field in use and its value: the first of :attr:`answer_fields`
        that is set, else the last; the value is None when it is not an integer (vLLM then
        validates the field itself)."""
        field = next((f for f in self.answer_fields if self.body.get(f)),
                     self.answer_fields[-1])
        value = self.body.get(field)
        return field, value if isinstance(value, int) and not isinstance(value, bool) else None


def neutralise(text: str) -> str:
    """User text with Phi-3 control sequences made inert (see module docstring)."""
    return text.replace(CONTROL_PREFIX, NEUTRALISED_PREFIX)


def check_values(value: Any, path: str = "") -> None:
    """Every string of a decoded JSON body is valid Unicode and every number finite (keys and
    values, any depth).

    - JSON allows a lone UTF-16 surrogate (``"\\ud800"``) that no tokenizer, encoder or log
      can handle: vLLM answered 500 for one in ``stop``. ASCII strings (base64 images, most
      text) are cleared by one C-level test each.
    - JSON has no NaN or Infinity (RFC 8259, section 6), but Python's parser reads the
      literals ``NaN``, ``Infinity`` and ``-Infinity``, and a number beyond a double's range
      (``1e999``) as infinity, and a NaN passes every range check (it compares false):
      vLLM accepted ``"logit_bias": {"100": NaN}``. Refused wherever they stand, so no
      sampling field (``temperature``, ``top_p``, penalties, ``logit_bias`` values, ...)
      needs its own rule and nothing non-finite reaches vLLM.

    Raises:
        IntakeError: 400 naming the field (``messages[0].content``, ``stop[0]``,
            ``logit_bias.100``).
    """
    if isinstance(value, str):
        if not value.isascii():
            try:
                value.encode()
            except UnicodeEncodeError:
                raise IntakeError(400, "text is not valid Unicode (it holds a lone UTF-16 "
                                  "surrogate)", path or None) from None
    elif isinstance(value, dict):
        for key, item in value.items():
            check_values(key, path or None)
            check_values(item, f"{path}.{key}" if path else key)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            check_values(item, f"{path}[{i}]")
    elif isinstance(value, float) and not math.isfinite(value):
        raise IntakeError(400, f"numbers must be finite; got {value} (JSON has no NaN or "
                          "Infinity, and this server takes no number beyond a double's range)",
                          path or None)


#: Accepted values of ``image_url.detail`` (OpenAI's; Phi-3-vision's resolution is set by
#: ``num_crops`` instead, so the value is accepted and has no effect). ``null``: the default.
DETAILS = ("auto", "low", "high")


def check_detail(detail: Any, name: str, param: str) -> None:
    """``detail`` of an image part (``name``: how the protocol calls it) is one of
    :data:`DETAILS` or null, else a 400 naming ``param``."""
    if detail is not None and detail not in DETAILS:
        raise IntakeError(400, f"{name} must be one of {', '.join(DETAILS)} or null; "
                          f"got {detail!r}", param)


def check_image_role(role: str, param: str) -> None:
    """Images are accepted in user messages only, else a 400 naming ``param``."""
    if role != "user":
        raise IntakeError(400, f"images are accepted in user messages only, not {role}", param)


def _image_url(part: dict, param: str) -> str:
    """The URL of an ``image_url`` part: ``{"url": ..., "detail": ...}`` or a bare string."""
    value = part.get("image_url")
    url = value.get("url") if isinstance(value, dict) else value
    if not isinstance(url, str) or not url:
        raise IntakeError(400, "an image_url part needs image_url.url (a data: URL)",
                          f"{param}.image_url")
    detail = value.get("detail") if isinstance(value, dict) else None
    check_detail(detail, "image_url.detail", f"{param}.image_url.detail")
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
        check_image_role(role, param)
        images.append(ImageRef(part, param, _image_url(part, param)))
    else:
        raise IntakeError(400, f"content part type {kind!r} is not supported; use 'text' or "
                          "'image_url'", f"{param}.type")


def check_role(message: dict, roles, where: str) -> str:
    """The message's ``role`` when it is one of ``roles``, else a 400 naming ``<where>.role``."""
    role = message.get("role")
    if role not in roles:
        raise IntakeError(400, f"role must be one of {', '.join(roles)}; got {role!r}",
                          f"{where}.role")
    return role


def check_num_crops(body: dict, limits: RequestLimits) -> int | None:
    """The request's ``mm_processor_kwargs.num_crops`` (None: the server's).

    Raises:
        IntakeError: 400 for other keys or a value outside 1..``max_num_crops``.
    """
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


def parse_chat_request(body: Any, limits: RequestLimits, *,
                       checked: bool = False) -> GenerationRequest:
    """Validate a decoded ``/v1/chat/completions`` body; neutralises control sequences.
    ``checked``: the body came from :func:`serve.intake.body.decode_body`, whose strings and
    numbers are known good (:func:`check_common`).

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
    ignored = check_common(body, limits, checked=checked)
    images: list[ImageRef] = []
    prompt: list[dict] = []  # the messages as the prompt-length check counts them
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise IntakeError(400, "each message must be an object", f"messages[{i}]")
        calls = check_tool_turn(message, f"messages[{i}]", limits.tools)
        role = check_role(message, ROLES + (("tool",) if limits.tools == "pass" else ()),
                          f"messages[{i}]")
        content = message.get("content")
        if content is None and calls:
            # An assistant turn that only calls tools (--tools pass): counted as its calls.
            prompt.append({"role": role, "content": json.dumps(calls)})
            continue
        prompt.append(message)
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
    check_image_count(images, limits)
    return GenerationRequest(body, images, check_num_crops(body, limits), prompt,
                             tools_ignored=ignored)


#: Longest client-chosen request id (header ``X-Request-Id`` or body ``request_id``), characters.
MAX_REQUEST_ID_CHARS = 256


def check_request_id(value: Any, param: str) -> str:
    """A client-chosen request id made unique: ``<value>-<8 hex digits>``, so two requests
    sent with the same id get distinct response ids (vLLM builds them from it) while the
    client's id stays visible in logs and answers.

    Raises:
        IntakeError: 400 naming ``param`` for a non-string, an id over
            :data:`MAX_REQUEST_ID_CHARS` characters, or one holding control characters.
    """
    if not isinstance(value, str) or not value:
        raise IntakeError(400, "a request id must be a non-empty string", param)
    if len(value) > MAX_REQUEST_ID_CHARS:
        raise IntakeError(400, f"a request id is at most {MAX_REQUEST_ID_CHARS} characters; "
                          f"got {len(value)}", param)
    if any(ord(c) < 32 or 127 <= ord(c) < 160 for c in value):
        raise IntakeError(400, "a request id must not contain control characters", param)
    return f"{value}-{secrets.token_hex(4)}"


#: Longest ``user`` field (OpenAI's end-user identifier), characters.
MAX_USER_CHARS = 256


def check_user(value: Any) -> str | None:
    """The body's ``user`` (OpenAI's end-user identifier; the body keeps it unchanged for
    vLLM): None when absent or empty. It goes to the access record, and from a trusted front
    end's key to fair admission among its users (``serve.tenants``).

    Raises:
        IntakeError: 400 naming ``user`` for a non-string, one over :data:`MAX_USER_CHARS`
            characters, or one holding control characters.
    """
    if value is None:
        return None
    if not isinstance(value, str):
        raise IntakeError(400, f"user must be a string; got {type(value).__name__}", "user")
    if len(value) > MAX_USER_CHARS:
        raise IntakeError(400, f"user is at most {MAX_USER_CHARS} characters; got "
                          f"{len(value)}", "user")
    if any(ord(c) < 32 or 127 <= ord(c) < 160 or unicodedata.category(c) in INVISIBLE
           for c in value):
        raise IntakeError(400, "user must not contain control, format (invisible or "
                          "direction-changing) or line-separator characters", "user")
    return value or None


#: Unicode categories refused in ``user``: format characters (zero-width, bidirectional
#: overrides: ``alice`` and ``alice\u200b`` would be two users who look like one in the usage
#: report) and the line and paragraph separators (Unicode's Cf, Zl, Zp; UAX #44).
INVISIBLE = frozenset({"Cf", "Zl", "Zp"})


#: Request fields vLLM would honour but we do not let clients set.
REFUSED_FIELDS = ("media_io_kwargs", "chat_template", "chat_template_kwargs")
#: Body fields bounding the answer length, over the three generation protocols.
ANSWER_FIELDS = ("max_tokens", "max_completion_tokens", "max_output_tokens")


def check_common(body: dict, limits: RequestLimits, *, checked: bool = False
                 ) -> tuple[str, ...]:
    """Checks every generation route shares: valid Unicode and finite numbers everywhere
    (:func:`check_values`; done already when ``checked``: ``serve.intake.body.decode_body``),
    none of :data:`REFUSED_FIELDS`, the tools policy (:func:`check_tools`), ``n``, the
    answer-length fields (integers of at least 1, each named in its error) and a
    client-chosen ``request_id`` (made unique in place, see :func:`check_request_id`).

    Returns:
        the tool fields taken out of the body (``--tools ignore``).

    Raises:
        IntakeError: 400 naming the field.
    """
    if not checked:
        check_values(body)
    for name in REFUSED_FIELDS:
        if body.get(name) is not None:
            raise IntakeError(400, f"{name} is not accepted by this server", name)
    ignored = check_tools(body, limits.tools)
    n = body.get("n", 1)
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1
                          or n > limits.max_n):
        raise IntakeError(400, f"n must be an integer from 1 to {limits.max_n} (each choice is "
                          "a full generation; send separate requests instead)", "n")
    if body.get("request_id") is not None:
        body["request_id"] = check_request_id(body["request_id"], "request_id")
    for field in ANSWER_FIELDS:
        value = body.get(field)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < 1):
            raise IntakeError(400, f"{field} must be an integer of at least 1; got {value!r}",
                              field)
    return ignored


# --- tool calling (--tools) ------------------------------------------------------------------
#: Body fields that ask for tool calling, over the generation protocols: chat's and the
#: Responses API's (``max_tool_calls`` is the Responses API's only), and chat's legacy
#: ``functions`` / ``function_call``.
TOOL_FIELDS = ("tools", "tool_choice", "parallel_tool_calls", "max_tool_calls", "functions",
               "function_call")
#: Of :data:`TOOL_FIELDS`, those that offer tools or ask for a call: refused under
#: ``--tools refuse`` when set (a list of at least one tool; a choice other than ``none``).
#: The others change nothing without tools and pass.
TOOL_REQUESTS = ("tools", "functions", "tool_choice", "function_call")
#: Values of ``tool_choice`` / ``function_call`` that ask for no call.
NO_CALL = (None, "none")
#: Why tool calling is refused (``--tools`` refuse and ignore).
NO_TOOL_FORMAT = "Phi-3-vision has no tool-call format"


def check_tools(body: dict, policy: str) -> tuple[str, ...]:
    """Apply the tools policy (``--tools``) to a request's :data:`TOOL_FIELDS`.

    - ``refuse``: a :data:`TOOL_REQUESTS` field that offers tools (``tools`` or ``functions``
      not empty) or asks for a call (``tool_choice`` or ``function_call`` other than
      ``none``) is a 400 naming it. ``tool_choice: "none"``, ``parallel_tool_calls`` and
      ``max_tool_calls`` alone ask for nothing and pass (vLLM ignores them without tools; an
      empty ``tools`` is vLLM's own 400).
    - ``ignore``: every tool field the body sets (not null) is taken out; the request is
      served as if the client had sent none of them.
    - ``pass``: the body is left as it is, for vLLM (a chat template and
      ``--tool-call-parser`` that support tools).

    Returns:
        the fields taken out (``ignore``), in :data:`TOOL_FIELDS` order; else empty.

    Raises:
        IntakeError: 400 naming the field (``refuse``).
    """
    if policy == "pass":
        return ()
    if policy == "ignore":
        dropped = tuple(name for name in TOOL_FIELDS if body.get(name) is not None)
        for name in dropped:
            del body[name]
        return dropped
    for name in TOOL_REQUESTS:
        value = body.get(name)
        if value not in NO_CALL and value != []:
            raise IntakeError(400, f"tools are not supported: {NO_TOOL_FORMAT}; send the "
                              f"request without {name}", name)
    return ()


def check_tool_turn(message: dict, where: str, policy: str) -> list | dict | None:
    """A chat message's tool calls: a ``tool`` (or legacy ``function``) message carrying a
    tool's result, or an assistant message with ``tool_calls`` (or a legacy
    ``function_call``). Under ``--tools pass`` they go to vLLM as they are; under
    ``refuse`` and ``ignore`` they are a 400: the model cannot read them, and dropping turns
    would change the conversation the client sent (a conversation with this model alone has
    none: it never calls a tool). Empty ``tool_calls`` (``[]``, null) are no calls.

    Returns:
        the message's calls (``tool_calls`` or ``function_call``) under ``pass``, or None;
        an assistant message with calls may have null ``content``.

    Raises:
        IntakeError: 400 naming ``<where>.role`` or ``<where>.tool_calls``.
    """
    role = message.get("role")
    calls = message.get("tool_calls") or message.get("function_call")
    if policy == "pass":
        return calls if role == "assistant" else None
    if role in ("tool", "function"):
        raise IntakeError(400, f"tool results cannot be sent to this model: {NO_TOOL_FORMAT}",
                          f"{where}.role")
    if calls:
        field = "tool_calls" if message.get("tool_calls") else "function_call"
        raise IntakeError(400, f"tool calls cannot be sent to this model: {NO_TOOL_FORMAT}; "
                          "send the assistant's text only", f"{where}.{field}")
    return None


def check_image_count(images: list[ImageRef], limits: RequestLimits) -> None:
    """Raises a 400 naming the first image part over ``limits.max_images``."""
    if len(images) > limits.max_images:
        raise IntakeError(400, f"{len(images)} images in one request; the limit is "
                          f"{limits.max_images} images per request",
                          images[limits.max_images].where)


def parse_completion_request(body: Any, limits: RequestLimits, *,
                             checked: bool = False) -> GenerationRequest:
    """Validate a decoded ``/v1/completions`` body: the shared checks only. Its prompt is raw
    text (the client writes the chat template, control tokens included, by design) and
    carries no images; vLLM validates and counts it. ``checked``: as
    :func:`parse_chat_request`.

    Raises:
        IntakeError: 400 naming the offending field.
    """
    if not isinstance(body, dict):
        raise IntakeError(400, "request body must be a JSON object")
    ignored = check_common(body, limits, checked=checked)
    check_one_prompt(body.get("prompt"))
    return GenerationRequest(body, [], None, None, ("max_tokens",), "prompt",
                             tools_ignored=ignored)


def is_token_ids(value: Any) -> bool:
    """Whether ``value`` is one prompt given as token ids (a non-empty list of integers)."""
    return (isinstance(value, list) and bool(value)
            and all(isinstance(t, int) and not isinstance(t, bool) for t in value))


def check_one_prompt(prompt: Any) -> None:
    """A completions ``prompt`` holds one prompt: a string, a list of token ids, or a list of
    one of those. A list of several is a batch (the OpenAI API's array form): vLLM runs each
    as its own generation under the one request, so one admission slot, one tenant limit
    check and one fair-queue turn would stand for all of them, as with ``n`` > 1.

    Raises:
        IntakeError: 400 naming ``prompt`` for a batch of more than one prompt.
    """
    if isinstance(prompt, list) and not is_token_ids(prompt) and len(prompt) > 1:
        raise IntakeError(400, f"prompt must be one prompt (a string or a list of token ids); "
                          f"got a batch of {len(prompt)}: each is a full generation, send "
                          "separate requests instead", "prompt")
