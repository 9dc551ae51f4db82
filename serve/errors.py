"""OpenAI-style error responses for errors raised by our own layers (not vLLM's).

Shape (as the OpenAI API and vLLM's ``ErrorResponse``)::

    {"error": {"message": str, "type": str, "param": str | null, "code": int | str}}

``code``, one rule for every error this server sends: the HTTP status as an int (what vLLM's
own errors carry, so most clients already handle it), except where a client must tell cases
apart by machine: then the string the OpenAI API uses for that case (``invalid_api_key``,
``context_length_exceeded``), or ours in the same form (``image_too_large``). ``type`` is
OpenAI's class (``invalid_request_error``, ``rate_limit_exceeded``, ``server_error``, ...).

``param`` names the field as the client sent it, in one notation for every error of ours:
``messages[0].content[1].image_url``, ``logit_bias.100``. vLLM's request-validation errors
(pydantic, raised before a handler runs) are answered in the same notation by
:func:`validation_error_response` (:func:`client_field_error` picks the error and the field).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: Seconds a client should wait before retrying a 503 (booting, draining, engine lost).
RETRY_AFTER_S = 5
#: 503 messages of the server's life cycle (``serve.app``; the admission layer uses them too).
SHUTTING_DOWN = "The server is shutting down; retry on another replica or in a moment."
ENGINE_LOST = ("The engine stopped; this server is restarting. Retry on another replica or "
               "in a moment.")


def error_body(status: int, message: str, type_: str, param: str | None = None) -> dict:
    """The JSON body of an OpenAI-style error (``code`` is the HTTP status)."""
    return {"error": {"message": message, "type": type_, "param": param, "code": status}}


def openai_error(
    status: int,
    message: str,
    type_: str = "invalid_request_error",
    param: str | None = None,
    headers: dict[str, str] | None = None,
):
    """A Starlette ``JSONResponse`` carrying :func:`error_body` with HTTP ``status``."""
    from starlette.responses import JSONResponse  # error_body stays importable without it

    return JSONResponse(error_body(status, message, type_, param), status_code=status,
                        headers=headers)


# --- request-validation errors of vLLM's app (pydantic) -------------------------------------
@dataclass(frozen=True)
class _Located:
    """One pydantic error placed in the client's body.

    Attributes:
        error: the pydantic error (``type``, ``loc``, ``msg``).
        path: the field it concerns in our notation (``""``: its ``loc`` is not in the body).
        depth: how many fields deep ``path`` is (``messages[0].name``: 3).
        branches: for each ``loc`` segment the body does not hold (a union member such as
            ``ChatCompletionUserMessageParam``, a type alternative such as ``str``, a
            validator wrapper), outermost first: the ``loc`` prefix ending in it and the
            ``path`` where it stands (the union's field).
    """

    error: dict
    path: str
    depth: int
    branches: tuple[tuple[tuple, str], ...]


def _locate(error: dict, body: Any) -> _Located:
    """Walk ``error["loc"]`` along ``body``: a segment the body holds (a key of the object
    there, an index of the list there) is a field the client sent; the last segment of a
    ``missing`` error is the field the client left out; any other name is a branch. A ``loc``
    that does not start in the body, or names an index the list there lacks, is not placed
    (``path`` empty): a validator that re-raised an inner model's errors."""
    loc = tuple(error.get("loc") or ())
    if loc[:1] == ("body",):  # FastAPI's location prefix
        loc = loc[1:]
    node, path, depth, branches = body, "", 0, []
    for k, seg in enumerate(loc):
        if isinstance(node, dict) and isinstance(seg, str) and seg in node:
            node, path = node[seg], f"{path}.{seg}" if path else seg
        elif (isinstance(node, list) and isinstance(seg, int) and not isinstance(seg, bool)
              and 0 <= seg < len(node)):
            node, path = node[seg], f"{path}[{seg}]"
        elif (k == len(loc) - 1 and error.get("type") == "missing" and isinstance(node, dict)
              and isinstance(seg, str)):
            path = f"{path}.{seg}" if path else seg
        elif k == 0 or not isinstance(seg, str):
            return _Located(error, "", 0, ())
        else:
            branches.append((loc[:k + 1], path))
            continue
        depth += 1
    return _Located(error, path, depth, tuple(branches))


def _mismatch(member: tuple, union_path: str, errors: list[_Located]) -> bool:
    """Whether the client's value at ``union_path`` is plainly not of ``member``'s type: a
    literal field of the member (``role``, ``type``: the tag that selects a member) holds
    another value (``literal_error``), or the value itself has another type (an error at the
    union's field, ``input`` a list where this member is a string)."""
    return any((e.error.get("type") == "literal_error" and e.branches[-1][0] == member)
               or e.path == union_path for e in errors)


def _closest(errors: list[_Located], depth: int = 0) -> _Located:
    """The error of the union member the client most likely meant, union by union from the
    outermost on the first error's way: of the members whose type the value does not plainly
    miss (:func:`_mismatch`; all of them when it misses every one), the one whose errors lie
    deepest in the client's data (it matched furthest), then the one with the fewest errors;
    pydantic's order breaks ties."""
    first = errors[0]
    if len(first.branches) <= depth:
        return first
    point, union_path = first.branches[depth][0][:-1], first.branches[depth][1]
    members: dict[tuple, list[_Located]] = {}
    for item in errors:
        if len(item.branches) > depth and item.branches[depth][0][:-1] == point:
            members.setdefault(item.branches[depth][0], []).append(item)

    def rank(member: tuple) -> tuple[bool, int, int]:
        items = members[member]
        return (_mismatch(member, union_path, items), -max(e.depth for e in items), len(items))

    return _closest(members[min(members, key=rank)], depth + 1)


def client_field_error(errors: list, body: Any) -> tuple[str, str] | None:
    """The field and message to answer a pydantic validation of ``body`` that failed with
    ``errors`` (``ValidationError.errors()``, FastAPI's ``RequestValidationError.errors()``):
    ``("messages[0].name", "messages[0].name: Input should be a valid string")``.

    pydantic validates a value of a union type (``messages[i]`` is one of seven message types
    in vLLM's schema, as in OpenAI's; ``input`` a string or a list of items) against every
    member and reports every member's errors, each ``loc`` naming the member
    (``messages.0.ChatCompletionDeveloperMessageParam.role``). vLLM names the first error's
    ``loc``: for a user message with ``"name": 123`` the developer member's ``role``, a field
    the client got right. Here the member the client meant is chosen first (:func:`_closest`:
    not one whose tag or type the value plainly misses, then the one the value matched
    furthest) and its first error is reported at the path the client sent, member and
    wrapper names left out (:func:`_locate`).

    Returns:
        ``(param, message)``, or None when no error can be placed in ``body``.
    """
    located = [_locate(e, body) for e in errors if isinstance(e, dict)]
    located = [item for item in located if item.path]
    if not located:
        return None
    best = _closest(located)
    return best.path, f"{best.path}: {best.error.get('msg') or 'invalid value'}"


async def validation_error_response(request, exc):
    """FastAPI handler of ``RequestValidationError`` for vLLM's app: a 400 naming the field the
    client sent (:func:`client_field_error`). Errors that name their parameter themselves
    (vLLM's ``VLLMValidationError``) and errors without a field go to vLLM's own handler.
    """
    from vllm.entrypoints.serve.exception_handling.handlers.validation import (
        validation_exception_handler,
    )
    from vllm.exceptions import VLLMValidationError

    errors = exc.errors()
    named = any(isinstance((e.get("ctx") or {}).get("error"), VLLMValidationError)
                for e in errors if isinstance(e, dict))
    found = None if named else client_field_error(errors, exc.body)
    if found is None:
        return await validation_exception_handler(request, exc)
    param, message = found
    return openai_error(400, message, param=param)


def use_client_field_names(app) -> None:
    """Answer request-validation errors of the FastAPI ``app`` (vLLM's) with
    :func:`validation_error_response`. The app's middleware stack is reset, so the next
    request builds it with the new handler (vLLM builds it inside ``build_app``)."""
    from fastapi.exceptions import RequestValidationError

    app.add_exception_handler(RequestValidationError, validation_error_response)
    app.middleware_stack = None
