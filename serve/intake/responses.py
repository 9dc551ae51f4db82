"""Validation of an OpenAI Responses API body (``POST /v1/responses``), pure functions.

The same guarantees as chat completions (``serve.intake.request``): every text neutralised,
every image found and sent through the same intake, the same limits. Accepted shapes (as the
OpenAI API documents them, and as vLLM 0.32 turns them into chat messages):

- ``instructions``: a string (a system message).
- ``input``: a string (one user message), or a list of message items
  ``{"type": "message"?, "role": "user"|"assistant"|"system"|"developer", "content": ...}``
  whose ``content`` is a string or a list of parts: ``input_text`` / ``output_text``
  (``text``), ``refusal`` (assistant), ``input_image`` (``image_url``: a ``data:`` URL or,
  when enabled, an ``https`` URL; ``detail``: ``auto``, ``low``, ``high`` or null).

Text parts are rewritten to the type vLLM's schema takes where they stand: ``output_text``
inside an output message (an assistant item with ``id`` and ``status``, as the SDK returns
it), else ``input_text`` (vLLM refuses ``output_text`` in the short form, and cannot render a
``refusal`` part at all).

Tool calling follows ``--tools`` (``serve.intake.request.check_tools``): ``tools`` and
``tool_choice`` are refused, dropped or passed on as in chat, and the items of a tool call
(``function_call``, ``function_call_output``) are passed on as they are under ``pass`` and
refused otherwise (the model cannot read them).

Refused with a 400 naming the field: other item types (reasoning items: Phi-3-vision has no
reasoning format), ``input_image.file_id`` and ``input_file`` (this server stores no files),
images outside user messages, and ``previous_response_id`` (vLLM's response store is off by
default).
"""

from __future__ import annotations

import json
from typing import Any

from serve.intake.errors import IntakeError
from serve.intake.request import (
    NO_TOOL_FORMAT,
    GenerationRequest,
    ImageRef,
    RequestLimits,
    check_common,
    check_detail,
    check_image_count,
    check_image_role,
    check_num_crops,
    check_role,
    neutralise,
)

#: Roles of Responses input messages, and the chat role each becomes for the prompt count
#: (vLLM maps ``developer`` to the system turn of the chat template).
ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
TEXT_PARTS = ("input_text", "output_text")
#: Input items of a tool call: the model's call and the tool's result (the field counted).
TOOL_ITEMS = {"function_call": "arguments", "function_call_output": "output"}


def _text(part: dict, where: str, output_message: bool) -> str:
    """A text part's text, neutralised; the part is rewritten to the one text type vLLM's
    schema accepts where it stands: ``output_text`` (with ``annotations``) inside an output
    message (assistant item with ``id`` and ``status``), else ``input_text``. A ``refusal``
    part becomes text too (vLLM cannot render one: it answered 500)."""
    key = "refusal" if part["type"] == "refusal" else "text"
    if not isinstance(part.get(key), str):
        raise IntakeError(400, f"a {part['type']} part needs a string '{key}'", f"{where}.{key}")
    text = neutralise(part.pop(key))
    part["text"] = text
    if output_message:
        part.update(type="output_text", annotations=part.get("annotations") or [])
    else:
        part["type"] = "input_text"
        part.pop("annotations", None)
        part.pop("logprobs", None)
    return text


def _image(part: dict, role: str, where: str) -> ImageRef:
    check_image_role(role, where)
    if part.get("file_id") is not None:
        raise IntakeError(400, "input_image.file_id is not supported (this server stores no "
                          "files); send the image as image_url (a data: URL)", f"{where}.file_id")
    url = part.get("image_url")
    if not isinstance(url, str) or not url:
        raise IntakeError(400, "an input_image part needs image_url (a data: URL)",
                          f"{where}.image_url")
    check_detail(part.get("detail"), "input_image.detail", f"{where}.detail")
    return ImageRef(part, where, url, as_string=True)


def _tool_item(item: dict, where: str, tools: str) -> dict:
    """A tool-call input item (:data:`TOOL_ITEMS`), passed on as it is under ``--tools pass``
    (returned as a chat message for counting: its arguments or output as text), else a 400
    naming ``<where>.type``."""
    kind = item["type"]
    if tools != "pass":
        raise IntakeError(400, f"{kind} items cannot be sent to this model: {NO_TOOL_FORMAT}",
                          f"{where}.type")
    text = item.get(TOOL_ITEMS[kind])
    return {"role": "assistant" if kind == "function_call" else "tool",
            "content": text if isinstance(text, str) else json.dumps(text)}


def _message(item: Any, where: str, images: list[ImageRef], tools: str = "refuse") -> dict:
    """One input message item checked in place; returns it as a chat message for counting.
    ``tools``: the ``--tools`` policy (:func:`_tool_item`)."""
    if not isinstance(item, dict):
        raise IntakeError(400, "each input item must be an object", where)
    kind = item.get("type", "message")
    if kind in TOOL_ITEMS:
        return _tool_item(item, where, tools)
    if kind != "message":
        raise IntakeError(400, f"input item type {kind!r} is not supported; send messages "
                          "(role and content)", f"{where}.type")
    role = check_role(item, ROLES, where)
    content = item.get("content")
    if isinstance(content, str):
        item["content"] = neutralise(content)
        return {"role": ROLES[role], "content": item["content"]}
    output_message = role == "assistant" and "id" in item and "status" in item
    if not isinstance(content, list) or not content:
        raise IntakeError(400, "content must be a string or a non-empty list of parts",
                          f"{where}.content")
    parts = []
    for j, part in enumerate(content):
        at = f"{where}.content[{j}]"
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise IntakeError(400, "a content part must be an object with a 'type'", at)
        if part["type"] in TEXT_PARTS or (part["type"] == "refusal" and role == "assistant"):
            parts.append({"type": "text", "text": _text(part, at, output_message)})
        elif part["type"] == "input_image":
            images.append(_image(part, role, at))
            parts.append({"type": "image_url"})
        else:
            raise IntakeError(400, f"content part type {part['type']!r} is not supported; use "
                              "input_text or input_image", f"{at}.type")
    return {"role": ROLES[role], "content": parts}


def parse_responses_request(body: Any, limits: RequestLimits, *,
                            checked: bool = False) -> GenerationRequest:
    """Validate a decoded ``/v1/responses`` body; neutralises control sequences in place.
    ``checked``: as :func:`serve.intake.request.parse_chat_request`.

    Returns:
        the request, its images in order, and its prompt as chat messages (for the
        prompt-length check); the answer length field is ``max_output_tokens``.

    Raises:
        IntakeError: 400 naming the offending field (``input[0].content[1].image_url``).
    """
    if not isinstance(body, dict):
        raise IntakeError(400, "request body must be a JSON object")
    ignored = check_common(body, limits, checked=checked)
    if body.get("previous_response_id") is not None:
        raise IntakeError(400, "previous_response_id is not supported (responses are not "
                          "stored); send the conversation in input", "previous_response_id")
    messages: list[dict] = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise IntakeError(400, "instructions must be a string", "instructions")
        body["instructions"] = neutralise(instructions)
        messages.append({"role": "system", "content": body["instructions"]})
    images: list[ImageRef] = []
    data = body.get("input")
    if isinstance(data, str):
        body["input"] = neutralise(data)
        messages.append({"role": "user", "content": body["input"]})
    elif isinstance(data, list) and data:
        messages += [_message(item, f"input[{i}]", images, limits.tools)
                     for i, item in enumerate(data)]
    else:
        raise IntakeError(400, "input must be a string or a non-empty list of messages",
                          "input")
    check_image_count(images, limits)
    return GenerationRequest(body, images, check_num_crops(body, limits), messages,
                             ("max_output_tokens",), "input", tools_ignored=ignored)
