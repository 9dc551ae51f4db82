"""OpenAI-style error responses for errors raised by our own layers (not vLLM's).

Shape (as the OpenAI API and vLLM's ``ErrorResponse``)::

    {"error": {"message": str, "type": str, "param": str | null, "code": int | str}}

``code``, one rule for every error this server sends: the HTTP status as an int (what vLLM's
own errors carry, so most clients already handle it), except where a client must tell cases
apart by machine: then the string the OpenAI API uses for that case (``invalid_api_key``,
``context_length_exceeded``), or ours in the same form (``image_too_large``). ``type`` is
OpenAI's class (``invalid_request_error``, ``rate_limit_exceeded``, ``server_error``, ...).
"""

from __future__ import annotations

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
